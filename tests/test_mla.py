"""Multi-head latent attention (megalite.models.mla) against a plain reference written from the
DeepSeek-V2/V3 papers' equations (fp32, 1e-6): outputs, the input's gradient and every weight's, with
and without a query low rank; at TP 2 (with and without sequence parallelism) equal to the reference
on the gathered weights. Bad MLA settings end in one line."""
import math

import pytest
import torch
import torch.distributed as dist

from helpers import gather_tp
from megalite import parallel
from megalite.models.config import TransformerConfig
from megalite.testing import run_ranks

HIDDEN, HEADS, NOPE, ROPE, V, KV_RANK, Q_RANK, SEQ, BATCH = 32, 4, 8, 4, 6, 12, 10, 8, 2


def config(q_lora_rank=Q_RANK, **overrides) -> TransformerConfig:
    fields = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, vocab_size=64,
                  max_position_embeddings=SEQ, position_embedding_type="rope", normalization="rmsnorm",
                  add_bias_linear=False, multi_latent_attention=True, q_lora_rank=q_lora_rank, kv_lora_rank=KV_RANK,
                  qk_head_dim=NOPE, qk_pos_emb_head_dim=ROPE, v_head_dim=V)
    return TransformerConfig(**{**fields, **overrides})


def _rms(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, base=10000.0):
    """x [s, b, heads, ROPE] rotated by position ("rotate half")."""
    inv = 1.0 / base ** (torch.arange(0, ROPE, 2, dtype=torch.float32) / ROPE)
    angles = torch.outer(torch.arange(x.shape[0], dtype=torch.float32), inv)
    cos, sin = (torch.cat([angles, angles], -1)[:, None, None, :].cos(),
                torch.cat([angles, angles], -1)[:, None, None, :].sin())
    half = ROPE // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def reference(x, w: dict) -> torch.Tensor:
    """MLA on x [s, b, h] with whole weights `w`, causal."""
    s, b, _ = x.shape
    if "q_down" in w:
        q = _rms(x @ w["q_down"].t(), w["q_norm"]) @ w["q_up"].t()
    else:
        q = x @ w["q"].t()
    q = q.view(s, b, HEADS, NOPE + ROPE)
    compressed = x @ w["kv_down"].t()
    latent, k_pe = compressed[..., :KV_RANK], compressed[..., KV_RANK:]
    kv = (_rms(latent, w["kv_norm"]) @ w["kv_up"].t()).view(s, b, HEADS, NOPE + V)
    q = torch.cat([q[..., :NOPE], _rope(q[..., NOPE:])], -1)
    k = torch.cat([kv[..., :NOPE], _rope(k_pe[:, :, None, :]).expand(s, b, HEADS, ROPE)], -1)
    v = kv[..., NOPE:]
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / math.sqrt(NOPE + ROPE)
    scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    ctx = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v).reshape(s, b, HEADS * V)
    return ctx @ w["proj"].t()


# name -> (module attribute path, TP dim of its shard: 0 column, 1 row, None replicated)
WEIGHTS = {"q": ("q.weight", 0), "q_down": ("q_down.weight", None), "q_norm": ("q_norm.weight", None),
           "q_up": ("q_up.weight", 0), "kv_down": ("kv_down.weight", None), "kv_norm": ("kv_norm.weight", None),
           "kv_up": ("kv_up.weight", 0), "proj": ("proj.weight", 1)}


def _params(layer) -> dict:
    named = dict(layer.named_parameters())
    return {k: named[path] for k, (path, _) in WEIGHTS.items() if path in named}


def _whole(t: torch.Tensor, dim) -> torch.Tensor:
    if dim is None:
        return t.detach().clone()
    return gather_tp(t, dim)


def _grad_sum(t: torch.Tensor, dim) -> torch.Tensor:
    """A weight's whole gradient: shards joined, a replicated weight's partial gradients summed."""
    if dim is not None:
        return gather_tp(t, dim)
    out = t.detach().clone()
    if parallel.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(out, group=parallel.get_tensor_model_parallel_group())
    return out


def _compare(rank, world, q_lora_rank, sequence_parallel):
    """Forward and backward of the layer at tp = world against the reference on gathered weights:
    the largest relative error of the output, the input's gradient and each weight's gradient."""
    from megalite.models.mla import MultiLatentAttention

    if world > 1:
        parallel.initialize_model_parallel(tensor_model_parallel_size=world)
    torch.manual_seed(0)
    layer = MultiLatentAttention(config(q_lora_rank, sequence_parallel=sequence_parallel), None, None)
    with torch.no_grad():  # norms off their init of ones
        for name in ("q_norm", "kv_norm"):
            if hasattr(layer, name):
                getattr(layer, name).weight.add_(0.1 * torch.randn_like(getattr(layer, name).weight))
    g = torch.Generator().manual_seed(1)
    x, grad = torch.randn(SEQ, BATCH, HIDDEN, generator=g), torch.randn(SEQ, BATCH, HIDDEN, generator=g)
    mine = slice(rank * SEQ // world, (rank + 1) * SEQ // world) if sequence_parallel else slice(None)
    xi = x[mine].clone().requires_grad_(True)
    out = layer(xi)
    out.backward(grad[mine])
    params = _params(layer)
    whole = {k: _whole(p, WEIGHTS[k][1]).requires_grad_(True) for k, p in params.items()}
    xr = x.clone().requires_grad_(True)
    want = reference(xr, whole)
    want.backward(grad)

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max())

    got_out = gather_tp(out, 0) if sequence_parallel else out.detach()
    got_x = gather_tp(xi.grad, 0) if sequence_parallel else xi.grad
    errors = {"out": rel(got_out, want.detach()), "x": rel(got_x, xr.grad)}
    errors.update({k: rel(_grad_sum(p.grad, WEIGHTS[k][1]), whole[k].grad) for k, p in params.items()})
    return errors


@pytest.mark.parametrize("q_lora_rank", [Q_RANK, None], ids=["q-lora", "plain-q"])
def test_mla_equals_the_reference_at_tp1(q_lora_rank):
    errors = _compare(0, 1, q_lora_rank, False)
    assert len(errors) == (9 if q_lora_rank else 7) and max(errors.values()) <= 1e-6, errors


@pytest.mark.parametrize("q_lora_rank,sequence_parallel", [(Q_RANK, True), (None, False)], ids=["q-lora-sp", "plain-q"])
def test_mla_at_tp2_equals_the_reference_on_the_gathered_weights(q_lora_rank, sequence_parallel):
    for errors in run_ranks(_compare, 2, args=(q_lora_rank, sequence_parallel)):
        assert max(errors.values()) <= 1e-5, errors


def test_the_mla_layer_holds_the_papers_shapes():
    from megalite.models.mla import MultiLatentAttention

    layer = MultiLatentAttention(config(), None, None)
    shapes = {k: tuple(p.shape) for k, p in _params(layer).items()}
    assert shapes == {"q_down": (Q_RANK, HIDDEN), "q_norm": (Q_RANK,), "q_up": (HEADS * (NOPE + ROPE), Q_RANK),
                      "kv_down": (KV_RANK + ROPE, HIDDEN), "kv_norm": (KV_RANK,),
                      "kv_up": (HEADS * (NOPE + V), KV_RANK), "proj": (HIDDEN, HEADS * V)}


@pytest.mark.parametrize("overrides, message", [
    (dict(qk_pos_emb_head_dim=3), r"--qk-pos-emb-head-dim must be even"),
    (dict(position_embedding_type="learned_absolute"), r"needs --position-embedding-type rope"),
    (dict(num_query_groups=2), r"drop --num-query-groups"),
    (dict(q_lora_rank=0), r"--q-lora-rank must be >= 1"),
])
def test_bad_mla_settings_end_in_one_line(overrides, message):
    with pytest.raises(ValueError, match=message) as e:
        config(**{"q_lora_rank": Q_RANK, **overrides})
    assert "\n" not in str(e.value)


MLA_FLAGS = ["--model", "llama-tiny", "--multi-latent-attention", "--q-lora-rank", "32", "--kv-lora-rank", "24",
             "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16"]
TRAIN = ["--train-iters", "6", "--log-interval", "1", "--seq-length", "32", "--global-batch-size", "8",
         "--micro-batch-size", "2", "--eval-interval", "0"]


def test_an_mla_model_trains_to_the_one_device_losses_at_tp2_sp_cp2_pp2_and_zero3():
    """From the command line: llama-tiny's layers with MLA (its grouped keys replaced). Under CP the
    ring carries keys and values (values zero-padded to the keys' width)."""
    from training_ranks import several, train_losses

    one = run_ranks(train_losses, 1, args=(MLA_FLAGS + TRAIN,))[0]
    layouts = [["--tp", "2", "--sequence-parallel"], ["--cp", "2"], ["--pp", "2"], ["--zero-stage", "3"]]
    runs = run_ranks(several, 4, args=(train_losses, [MLA_FLAGS + TRAIN + x for x in layouts]), timeout=600)
    for i, layout in enumerate(layouts):
        losses = runs[-1][i] if "--pp" in layout else runs[0][i]  # the last stage logs the loss
        assert len(losses) == 6 and max(abs(a - b) / abs(b) for a, b in zip(losses, one)) <= 1e-5, (layout, losses)


@pytest.mark.parametrize("argv, message", [
    (["--kv-lora-rank", "24"], r"--kv-lora-rank: for multi-head latent attention only: add --multi-latent-attention"),
    (["--multi-latent-attention", "--position-embedding-type", "learned_absolute"],
     r"needs --position-embedding-type rope"),
])
def test_mla_flags_without_mla_or_rope_end_in_one_line(argv, message):
    from megalite import config as C
    from megalite.errors import UsageError

    cfg = C.build_parser("test", "gpt-tiny").parse_args(["--mock-data", "--model", "llama-tiny", *argv])
    with pytest.raises(UsageError, match=message) as e:
        C.model_config(cfg)
    assert "\n" not in str(e.value)


def test_an_mla_checkpoint_saved_at_tp2_resumes_exactly_on_one_device(tmp_path):
    """The replicated down projections and latent norms are written once, the up projections as TP
    shards of whole tensors: a layout-free checkpoint."""
    from training_ranks import train_losses

    whole = run_ranks(train_losses, 1, args=(MLA_FLAGS + TRAIN,))[0]
    first = run_ranks(train_losses, 2, args=(MLA_FLAGS + TRAIN + ["--tp", "2", "--sequence-parallel", "--save",
                                                                  str(tmp_path), "--save-interval", "3",
                                                                  "--exit-interval", "3"],))[0]
    resumed = run_ranks(train_losses, 1, args=(MLA_FLAGS + TRAIN + ["--load", str(tmp_path)],))[0]
    got = first + resumed
    assert len(got) == 6 and max(abs(a - b) / abs(b) for a, b in zip(got, whole)) <= 1e-5, (got, whole)


def test_mla_flops_count_its_projections_and_both_attention_matmuls():
    """Each projection's multiply-adds are its weight's elements: the model's own parameters count
    them (norms aside); the core's are s^2 (d_n + d_r + d_v) per head."""
    from megalite.metrics import layer_forward_flops
    from megalite.models.mla import MultiLatentAttention

    for q_lora_rank in (Q_RANK, None):
        c = config(q_lora_rank, ffn_hidden_size=20)
        layer = MultiLatentAttention(c, None, None)
        macs = sum(p.numel() for n, p in layer.named_parameters() if "norm" not in n)
        dense, core = layer_forward_flops(c, SEQ, BATCH)
        assert dense == 2.0 * SEQ * BATCH * (macs + 2 * HIDDEN * 20)
        assert core == 2.0 * BATCH * SEQ * SEQ * HEADS * (NOPE + ROPE + V)


def test_the_mla_ring_sends_keys_and_values_of_the_key_width_as_the_formula_says():
    """CP 2, one step of 4 micro-batches: per layer the ring sends every head's key (d_n + d_r) and
    value, zero-padded to the key's width (d_v 16 -> 24 here) for the ring's kernels: exactly
    ring_bytes_per_layer at head width d_n + d_r."""
    from megalite.parallel.context_parallel import ring_bytes_per_layer
    from test_context_parallel import ring_traffic

    argv = MLA_FLAGS + ["--seq-length", "32", "--global-batch-size", "8", "--micro-batch-size", "2",
                        "--train-iters", "1", "--eval-interval", "0", "--cp", "2"]
    per_layer = ring_bytes_per_layer(2, 8, 16, 16 + 8, 2)["total"]  # llama-tiny: 8 heads, 4 layers
    for sent in run_ranks(ring_traffic, 2, args=(argv,)):
        assert sent == 4 * 4 * per_layer
