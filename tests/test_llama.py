"""The Llama family (issue 17): rope, grouped-query attention, SwiGLU, qk-norm and biases off, each
against a plain-PyTorch reference written here; GPTModel with them at TP 2 and 4 (key/value groups
replicated at 4) equal to TP 1; llama-tiny training to the same losses in every layout; checkpoints
resharded across TP sizes; the command line and the config's one-line refusals."""
import math

import pytest
import torch
import torch.nn.functional as F

from helpers import assert_rel_close, assert_same_model_run, fresh_seed, gpt_forward_backward_record, rel_err
from megalite import arguments, checkpoint, parallel
from megalite.checkpoint.layout import config_dict, config_from_dict
from megalite.models import BERTModel, GPTModel, TransformerConfig, preset
from megalite.models.attention import ParallelAttention
from megalite.models.mlp import mlp_layer
from megalite.models.rope import RotaryEmbedding
from megalite.optim.grads import is_partial_over_tp
from megalite.parallel.layers import normal_init
from megalite.runtime import UsageError
from megalite.testing import run_ranks
from training_ranks import parse, train_losses

VOCAB = 100  # padded to 128 * tp, differently for each TP size


def small_config(**kw):
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2, ffn_hidden_size=96,
                vocab_size=VOCAB, max_position_embeddings=16, position_embedding_type="rope",
                gated_linear_unit=True, activation="silu", normalization="rmsnorm", add_bias_linear=False,
                untie_embeddings_and_output_weights=True)
    return TransformerConfig(**{**base, **kw})


# ---- references -------------------------------------------------------------------------------

def reference_inverse_frequencies(c: TransformerConfig) -> torch.Tensor:
    """base^(-2i/dims), then Llama 3.1's three wavelength regimes written out one by one."""
    dims = c.rotary_dims
    freqs = [c.rotary_base ** (-2 * i / dims) for i in range(dims // 2)]
    if c.rope_scaling_factor is not None:
        low_wavelength = c.rope_original_max_position_embeddings / c.rope_low_freq_factor
        high_wavelength = c.rope_original_max_position_embeddings / c.rope_high_freq_factor
        scaled = []
        for f in freqs:
            wavelength = 2 * math.pi / f
            if wavelength < high_wavelength:
                scaled.append(f)
            elif wavelength > low_wavelength:
                scaled.append(f / c.rope_scaling_factor)
            else:
                smooth = (c.rope_original_max_position_embeddings / wavelength - c.rope_low_freq_factor) / (
                    c.rope_high_freq_factor - c.rope_low_freq_factor)
                scaled.append((1 - smooth) * f / c.rope_scaling_factor + smooth * f)
        freqs = scaled
    return torch.tensor(freqs, dtype=torch.float64)


def reference_rope(x: torch.Tensor, c: TransformerConfig) -> torch.Tensor:
    """x [s, b, heads, d]: at position p, dims (i, i + dims/2) turn by the angle p * freq_i."""
    out, half = x.double().clone(), c.rotary_dims // 2
    freqs = reference_inverse_frequencies(c)
    for p in range(x.shape[0]):
        for i in range(half):
            cos, sin = math.cos(p * freqs[i]), math.sin(p * freqs[i])
            a, b = x[p, ..., i].double(), x[p, ..., i + half].double()
            out[p, ..., i], out[p, ..., i + half] = a * cos - b * sin, b * cos + a * sin
    return out.to(x.dtype)


def reference_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def reference_attention(attn: ParallelAttention, x: torch.Tensor, c: TransformerConfig, mask=None) -> torch.Tensor:
    """Every query head against its group's key/value head, repeated (x [s, b, h], tp = 1)."""
    s, b, d = x.shape[0], x.shape[1], c.head_dim
    if c.num_query_groups is None:
        q, k, v = F.linear(x, attn.qkv.weight, attn.qkv.bias).view(s, b, -1, 3, d).unbind(3)
    else:
        q = F.linear(x, attn.q.weight, attn.q.bias).view(s, b, -1, d)
        k, v = F.linear(x, attn.kv.weight, attn.kv.bias).view(s, b, -1, 2, d).unbind(3)
    if c.qk_layernorm:
        q, k = reference_rms(q, attn.q_norm.weight, c.layernorm_epsilon), reference_rms(k, attn.k_norm.weight,
                                                                                         c.layernorm_epsilon)
    if c.position_embedding_type == "rope":
        q, k = reference_rope(q, c), reference_rope(k, c)
    per_group = c.num_attention_heads // k.shape[2]
    k, v = k.repeat_interleave(per_group, dim=2), v.repeat_interleave(per_group, dim=2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) / math.sqrt(d)
    allowed = torch.ones(s, s, dtype=torch.bool).tril() if mask is None else mask
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    ctx = torch.einsum("bhqk,kbhd->qbhd", probs, v).reshape(s, b, -1)
    return F.linear(ctx, attn.proj.weight, attn.proj.bias)


def randomize_norms(module: torch.nn.Module, seed: int) -> None:
    """Norm weights start at one; make them matter."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=gen))


# ---- components ------------------------------------------------------------------------------

@pytest.mark.parametrize("changes", [
    dict(),
    dict(rotary_percent=0.5, rotary_base=500000.0, rope_scaling_factor=32.0, rope_original_max_position_embeddings=512),
    dict(rope_scaling_factor=8.0, rope_low_freq_factor=2.0, rope_high_freq_factor=8.0,
         rope_original_max_position_embeddings=64),
], ids=["plain", "half-rotated-llama3-scaled", "llama3-scaled"])
def test_rope_turns_each_pair_of_dims_by_position_times_its_frequency(changes):
    c = small_config(hidden_size=128, num_attention_heads=8, **changes)  # head_dim 16
    assert torch.allclose(RotaryEmbedding(c).inv_freq.double(), reference_inverse_frequencies(c), rtol=1e-6)
    x = torch.randn(40, 2, 3, c.head_dim, generator=torch.Generator().manual_seed(0))
    got = RotaryEmbedding(c)(x)
    assert_rel_close(got, reference_rope(x, c), tol=1e-5, what="rope")
    assert torch.equal(got[..., c.rotary_dims:], x[..., c.rotary_dims:]), "dims past rotary_percent must pass"


def test_llama3_scaling_keeps_short_wavelengths_and_slows_long_ones():
    c = small_config(hidden_size=128, rotary_base=500000.0, rope_scaling_factor=32.0,
                     rope_original_max_position_embeddings=512)
    plain, scaled = RotaryEmbedding(c.replace(rope_scaling_factor=None)).inv_freq, RotaryEmbedding(c).inv_freq
    # Wavelengths 2 pi / freq: 6.3, 32 (kept: below 512 / 4), 167 (blended), 860 and up (above 512: slowed).
    assert torch.equal(scaled[:2], plain[:2]) and torch.allclose(scaled[3:], plain[3:] / 32)
    assert plain[2] / 32 < scaled[2] < plain[2], "a wavelength between the two bounds is blended"


@pytest.mark.parametrize("changes", [
    dict(position_embedding_type="none"),
    dict(qk_layernorm=True),
    dict(num_query_groups=None, add_qkv_bias=True, rotary_percent=0.5),
    dict(num_query_groups=4, add_bias_linear=True, attention_backend="torch"),
    dict(qk_layernorm=True, normalization="rmsnorm", attention_backend="fused"),
    dict(kv_channels=16, qk_layernorm=True),  # heads twice hidden / heads wide (Qwen3's shape)
    dict(num_query_groups=None, kv_channels=4, attention_backend="torch"),  # and half as wide
], ids=["gqa", "gqa-qk-norm-rope", "mha-qkv-bias-half-rope", "gqa4-biases-torch", "qk-norm-fused", "wide-heads",
        "narrow-heads-mha"])
def test_attention_equals_the_repeat_kv_reference(changes):
    c = small_config(**changes)
    attn = ParallelAttention(c, normal_init(0.2), normal_init(0.2), device="cpu")
    randomize_norms(attn, 1)
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(2))
    x = torch.randn(12, 3, c.hidden_size, generator=torch.Generator().manual_seed(3))
    assert_rel_close(attn(x), reference_attention(attn, x, c), what="attention")
    mask = torch.rand(3, 1, 12, 12, generator=torch.Generator().manual_seed(4)) > 0.3
    mask |= torch.eye(12, dtype=torch.bool)  # every query sees at least itself
    assert_rel_close(attn(x, mask), reference_attention(attn, x, c, mask), what="masked attention")


def test_swiglu_is_fc2_of_silu_gate_times_up_with_gate_rows_then_up_rows():
    c = small_config(add_bias_linear=True)
    mlp = mlp_layer(c, normal_init(0.2, torch.Generator().manual_seed(0)), normal_init(0.2), device="cpu")
    with torch.no_grad():
        mlp.fc1.bias.normal_(0, 0.1)
    x = torch.randn(5, 2, c.hidden_size, generator=torch.Generator().manual_seed(1))
    assert mlp.fc1.weight.shape == (2 * c.ffn_hidden_size, c.hidden_size)
    w, b = mlp.fc1.weight, mlp.fc1.bias
    gate, up = F.linear(x, w[:c.ffn_hidden_size], b[:c.ffn_hidden_size]), F.linear(x, w[c.ffn_hidden_size:], b[c.ffn_hidden_size:])
    want = F.linear(F.silu(gate) * up, mlp.fc2.weight, mlp.fc2.bias)
    assert_rel_close(mlp(x), want, what="swiglu")


def test_biases_off_leaves_no_bias_and_qkv_bias_adds_only_those():
    names = {n for n, _ in GPTModel(small_config(add_qkv_bias=True), seed=1, device="cpu").named_parameters()}
    assert {n for n in names if n.endswith("bias")} == {"layers.0.attention.q.bias", "layers.0.attention.kv.bias",
                                                       "layers.1.attention.q.bias", "layers.1.attention.kv.bias"}
    assert "output_layer.weight" in names and "position_embeddings.weight" not in names


def test_qk_norm_weights_are_head_sized_and_summed_over_tp():
    attn = ParallelAttention(small_config(qk_layernorm=True, normalization="layernorm"), normal_init(), normal_init(),
                             device="cpu")
    shapes = {n: tuple(p.shape) for n, p in attn.named_parameters() if "norm" in n}
    assert shapes == {f"{w}_norm.{t}": (8,) for w in "qk" for t in ("weight", "bias")}
    assert all(is_partial_over_tp(p) for n, p in attn.named_parameters() if "norm" in n)


# ---- tensor parallelism -------------------------------------------------------------------

TP_CONFIG = dict(qk_layernorm=True, add_qkv_bias=True)  # every new parameter, kv bias gathered at tp 4


def llama_forward_backward(rank, world, seed):
    parallel.initialize_model_parallel(world)
    parallel.model_parallel_manual_seed(seed)
    model = GPTModel(small_config(**TP_CONFIG), seed=seed)
    randomize_norms(model, seed)
    return gpt_forward_backward_record(model, world, seed, VOCAB)


@pytest.fixture(scope="module")
def single_device_run():
    """(seed, the tp = 1 run) on fresh inputs, shared by the TP sizes."""
    seed = fresh_seed()
    return seed, run_ranks(llama_forward_backward, 1, args=(seed,))[0]


@pytest.mark.parametrize("tp", [2, 4], ids=["tp2-one-group-each", "tp4-groups-replicated"])
def test_llama_tensor_parallel_matches_single_device(tp, single_device_run):
    seed, reference = single_device_run
    for r in run_ranks(llama_forward_backward, tp, args=(seed,)):
        assert_same_model_run(r, reference, f"tp={tp}")


# ---- training in every layout, and checkpoints across TP sizes ------------------------------

LLAMA = ["--model", "llama-tiny", "--train-iters", "5", "--log-interval", "1", "--seq-length", "32",
         "--global-batch-size", "8", "--micro-batch-size", "2", "--eval-interval", "0"]


@pytest.fixture(scope="module")
def llama_unbroken():
    return run_ranks(train_losses, 1, args=(LLAMA,))[0]


@pytest.mark.parametrize("world, flags", [
    (2, ["--tp", "2"]),
    (4, ["--tp", "4"]),
    (4, ["--tp", "2", "--pp", "2", "--sequence-parallel"]),
    (4, ["--pp", "2", "--use-distributed-optimizer"]),
    (2, ["--pp", "2", "--vpp", "2", "--recompute", "selective"]),
    (2, ["--tp", "2", "--recompute", "full"]),
], ids=["tp2", "tp4-kv-replicated", "tp2-pp2-sp", "pp2-dp2-zero1", "pp2-vpp2-selective", "tp2-recompute-full"])
def test_llama_tiny_trains_to_the_single_device_losses_in_every_layout(llama_unbroken, world, flags):
    losses = run_ranks(train_losses, world, args=(LLAMA + flags,))[0]
    assert len(losses) == 5 and losses[-1] < losses[0]
    assert rel_err(torch.tensor(losses), torch.tensor(llama_unbroken)) <= 1e-5, (flags, losses, llama_unbroken)


# Heads wider than hidden / heads (Qwen3's): q, k, v and the output projection's input are heads x 32
# wide at hidden 128 (8 heads), through TP with sequence parallelism, both context-parallel paths and the pipeline.
WIDE = LLAMA[:3] + ["4"] + LLAMA[4:] + ["--kv-channels", "32", "--qk-layernorm"]


@pytest.fixture(scope="module")
def wide_unbroken():
    return run_ranks(train_losses, 1, args=(WIDE,))[0]


@pytest.mark.parametrize("flags", [["--tp", "2", "--sequence-parallel"], ["--cp", "2"],
                                   ["--cp", "2", "--cp-comm-type", "a2a"], ["--pp", "2"]],
                         ids=["tp2-sp", "cp2-ring", "cp2-a2a", "pp2"])
def test_heads_wider_than_hidden_over_heads_train_alike_in_every_layout(wide_unbroken, flags):
    losses = run_ranks(train_losses, 2, args=(WIDE + flags,))[0]
    assert len(losses) == 4
    assert rel_err(torch.tensor(losses), torch.tensor(wide_unbroken)) <= 1e-5, (flags, losses, wide_unbroken)


def test_a_wide_headed_model_holds_heads_x_kv_channels_wide_projections():
    c = preset("llama-tiny", kv_channels=48)
    attn = ParallelAttention(c, normal_init(0.02), normal_init(0.02), device="cpu")
    assert c.head_dim == 48 and attn.q.weight.shape == (c.num_attention_heads * 48, c.hidden_size)
    assert attn.kv.weight.shape == (2 * c.num_query_groups * 48, c.hidden_size)
    assert attn.proj.weight.shape == (c.hidden_size, c.num_attention_heads * 48)


# 1100 pads to 1152, 1280 and 1536 rows at tp 1, 2 and 4: the untied output layer's padding is resharded.
@pytest.mark.parametrize("vocab", ["1024", "1100"], ids=["same-padding", "padding-differs-per-tp"])
def test_a_tp2_llama_checkpoint_resumes_at_tp4_and_tp1(tmp_path, vocab):
    argv = LLAMA + ["--vocab-size", vocab, "--train-iters", "6"]
    unbroken = run_ranks(train_losses, 1, args=(argv,))[0]
    run_ranks(train_losses, 2, args=(argv + ["--tp", "2", "--save", str(tmp_path), "--exit-interval", "3"],))
    for tp in (4, 1):
        losses = run_ranks(train_losses, tp, args=(argv + ["--tp", str(tp), "--load", str(tmp_path)],))[0]
        assert rel_err(torch.tensor(losses), torch.tensor(unbroken[3:])) <= 1e-5, (tp, losses)


def test_a_checkpoint_of_another_architecture_is_refused_and_an_old_one_reads_as_today(tmp_path, capsys):
    run_ranks(train_losses, 1, args=(LLAMA + ["--train-iters", "1", "--save", str(tmp_path)],))
    reader = checkpoint.CheckpointReader(tmp_path)
    llama = preset("llama-tiny", max_position_embeddings=128)
    checkpoint.check_compatible(reader, llama, reader.model_kind)
    with pytest.raises(UsageError, match=r"qk_layernorm False \(checkpoint\) vs True \(now\)"):
        checkpoint.check_compatible(reader, llama.replace(qk_layernorm=True), reader.model_kind)
    with pytest.raises(UsageError, match=r"rotary_percent 1.0 \(checkpoint\) vs 0.5 \(now\)"):
        checkpoint.check_compatible(reader, llama.replace(rotary_percent=0.5), reader.model_kind)
    # Another rope base (context extension) or epsilon loads, and says so in one line.
    checkpoint.check_compatible(reader, llama.replace(rotary_base=500000.0, layernorm_epsilon=1e-6),
                                reader.model_kind)
    said = capsys.readouterr().out
    assert "rotary_base 10000.0 (checkpoint) -> 500000.0 (now)" in said and "layernorm_epsilon" in said, said
    old = {k: v for k, v in config_dict(preset("gpt-tiny")).items() if k in OLD_FIELDS}
    assert config_from_dict(old) == preset("gpt-tiny")


OLD_FIELDS = {"num_layers", "hidden_size", "num_attention_heads", "vocab_size", "max_position_embeddings",
              "ffn_hidden_size", "layernorm_epsilon", "normalization", "activation", "layernorm_position"}


def test_llama_tiny_trains_on_the_embedded_corpus_with_no_other_flag(tmp_path):
    from cli import records, torchrun

    metrics = tmp_path / "m.jsonl"
    run = torchrun("pretrain_gpt.py", 1, "--model", "llama-tiny", "--train-iters", "3", "--metrics-file", str(metrics),
                   "--log-interval", "1")
    assert run.returncode == 0, run.stderr[-3000:]
    losses = [r["loss"] for r in records(metrics)]
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)


# ---- command line and config --------------------------------------------------------------

def config_of(*argv):
    return arguments.model_config(parse(list(argv)))


def test_llama_flags_reach_the_config_and_unset_ones_keep_the_preset():
    c = config_of("--position-embedding-type", "rope", "--rotary-base", "500000", "--rotary-percent", "0.5",
                  "--rope-scaling-factor", "8", "--rope-low-freq-factor", "1", "--rope-high-freq-factor", "4",
                  "--rope-original-max-position-embeddings", "64", "--swiglu", "--group-query-attention",
                  "--num-query-groups", "2", "--normalization", "RMSNorm", "--disable-bias-linear", "--add-qkv-bias",
                  "--qk-layernorm", "--untie-embeddings-and-output-weights", "--norm-epsilon", "1e-6")
    assert (c.position_embedding_type, c.rotary_base, c.rotary_percent, c.rope_scaling_factor) == ("rope", 5e5, 0.5, 8)
    assert (c.rope_low_freq_factor, c.rope_high_freq_factor, c.rope_original_max_position_embeddings) == (1, 4, 64)
    assert (c.gated_linear_unit, c.activation, c.num_query_groups, c.normalization) == (True, "silu", 2, "rmsnorm")
    assert (c.add_bias_linear, c.add_qkv_bias, c.qk_layernorm, c.untie_embeddings_and_output_weights) == (
        False, True, True, True)
    assert c.layernorm_epsilon == 1e-6
    assert config_of("--normalization", "LayerNorm").normalization == "layernorm"
    assert config_of("--model", "llama-tiny", "--seq-length", "128") == preset("llama-tiny")
    assert config_of("--model", "qwen2.5-0.5b", "--seq-length", "64", "--rotary-base", "10").add_qkv_bias


def test_swiglu_without_an_ffn_size_keeps_the_gelu_mlps_parameters_as_megatron_sizes_it():
    # gpt2-124m: h = 768, so 8h/3 = 2048 (already a multiple of 64); gpt-tiny: 128 -> 341 -> 320.
    assert config_of("--model", "gpt2-124m", "--swiglu").ffn_hidden_size == 2048
    assert config_of("--swiglu").ffn_hidden_size == 320
    assert config_of("--swiglu", "--hidden-size", "256", "--num-attention-heads", "4").ffn_hidden_size == 640
    assert config_of("--swiglu", "--ffn-hidden-size", "96").ffn_hidden_size == 96  # given: kept
    assert config_of("--model", "llama-tiny", "--swiglu").ffn_hidden_size == 256  # a gated preset keeps its own


@pytest.mark.parametrize("argv, message", [
    (["--num-query-groups", "2"], "--group-query-attention and --num-query-groups G go together"),
    (["--group-query-attention"], "--group-query-attention and --num-query-groups G go together"),
    (["--rotary-percent", "0"], "--rotary-percent must be in (0, 1], got 0.0"),
    (["--group-query-attention", "--num-query-groups", "3"],
     "num_query_groups (3) must divide num_attention_heads (4)"),
    (["--position-embedding-type", "rope", "--rotary-percent", "0.03"], "rope needs an even number (>= 2) of rotated"),
    (["--rotary-base", "500000"], "--rotary-base: for rotary positions only"),
])
def test_bad_llama_flags_end_in_one_line(argv, message):
    with pytest.raises(UsageError) as e:
        config_of(*argv)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("heads, groups, tp, message", [
    (12, 4, 3, "num_query_groups (4) and the tensor-parallel size (3) must divide one another"),
    (8, 2, 8, None),
    (8, 8, 4, None),
])
def test_gqa_splits_when_groups_and_tp_divide_one_another(heads, groups, tp, message):
    c = TransformerConfig(num_layers=1, hidden_size=heads * 4, num_attention_heads=heads, num_query_groups=groups)
    if message is None:
        c.check_tensor_parallel(tp)
    else:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            c.check_tensor_parallel(tp)


def test_bert_refuses_llama_switches_with_one_line():
    with pytest.raises(ValueError, match="BERTModel does not support num_query_groups=2"):
        BERTModel(TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2),
                  device="cpu")


def parameter_count(c: TransformerConfig) -> int:
    """Embedding (+ output layer when untied), per layer two norms, q, k/v, o (+ qkv biases), gate/up/down,
    and the final norm; no padding."""
    h, d, f, groups = c.hidden_size, c.head_dim, c.ffn_hidden_size, c.query_groups
    qkv = h * (c.num_attention_heads + 2 * groups) * d
    qkv_bias = (c.num_attention_heads + 2 * groups) * d if c.add_qkv_bias else 0
    layer = 2 * h + qkv + qkv_bias + c.num_attention_heads * d * h + 3 * h * f
    return c.vocab_size * h * (2 if c.untie_embeddings_and_output_weights else 1) + c.num_layers * layer + h


def test_presets_have_their_published_parameter_counts():
    counts = {name: parameter_count(preset(name))
              for name in ("smollm2-135m", "qwen2.5-0.5b", "llama-3.2-1b", "llama-3-8b", "llama-3-70b")}
    assert counts == {"smollm2-135m": 134_515_008, "qwen2.5-0.5b": 494_032_768, "llama-3.2-1b": 1_235_814_400,
                      "llama-3-8b": 8_030_261_248, "llama-3-70b": 70_553_706_496}


def test_a_small_preset_builds_with_the_counted_parameters():
    c = preset("llama-tiny", make_vocab_size_divisible_by=1)
    assert sum(p.numel() for p in GPTModel(c, seed=0, device="cpu").parameters()) == parameter_count(c)
    c = preset("qwen2.5-0.5b", num_layers=1, vocab_size=64, make_vocab_size_divisible_by=1)
    assert sum(p.numel() for p in GPTModel(c, seed=0, device="cpu").parameters()) == parameter_count(c)
