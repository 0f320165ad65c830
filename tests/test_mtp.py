"""Multi-token prediction (megalite.models.mtp) against a reference written from DeepSeek-V3's
equations (fp32, 1e-6): each depth's loss and every gradient of the training loss, tied and untied;
the gradients written straight into the buffer equal autograd's; across layouts (TP 2 with SP, PP 2
tied and untied, CP 2, ZeRO-3) the main and MTP losses equal one device's; a checkpoint resumes on
another layout; bad settings end in one line."""
import copy

import pytest
import torch
import torch.nn.functional as F

from megalite import parallel
from megalite.models import GPTModel, TransformerConfig
from megalite.models.mtp import mtp_term_names, with_mtp_gradient, with_mtp_targets
from megalite.testing import run_ranks

V, S, B = 96, 12, 2


def _config(**kw) -> TransformerConfig:
    return TransformerConfig(**{**dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=V,
                                       max_position_embeddings=S, hidden_dropout=0.0, attention_dropout=0.0,
                                       position_embedding_type="rope", normalization="rmsnorm",
                                       gated_linear_unit=True, activation="silu", add_bias_linear=False,
                                       mtp_num_layers=2, mtp_loss_scaling_factor=0.3), **kw})


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, V, (B, S + 1), generator=g)
    mask = (torch.rand(B, S, generator=g) > 0.2).float()
    return stream, {"tokens": stream[:, :-1], "labels": stream[:, 1:], "loss_mask": mask}


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_losses(model: GPTModel, stream: torch.Tensor, mask: torch.Tensor) -> list[torch.Tensor]:
    """Summed losses [main, depth 1, ...] from the paper's equations on the model's weights, each depth
    run on the positions whose target exists (causal: later positions never change them). Depth k at
    position i reads token t_{i+k} = stream[i+k] and predicts stream[i+k+1], masked as that label."""
    c = model.config
    emb = model.word_embeddings.weight
    head = model.output_layer.weight if c.untie_embeddings_and_output_weights else emb
    x = F.embedding(stream[:, :S].t(), emb)
    for layer in model.layers:
        x = layer(x)
    h = _rms(x, model.final_layernorm.weight, c.layernorm_epsilon)
    ce = F.cross_entropy((h @ head[:V].t()).reshape(-1, V), stream[:, 1:].t().reshape(-1), reduction="none")
    losses = [(ce.view(S, B).t() * mask).sum()]
    for k, m in enumerate(model.mtp, 1):
        n = S - k  # positions with a target
        e = F.embedding(stream[:, k:k + n].t(), emb)
        joined = torch.cat([_rms(e, m.enorm.weight, c.layernorm_epsilon),
                            _rms(h[:n], m.hnorm.weight, c.layernorm_epsilon)], dim=-1)
        h = _rms(m.layer(joined @ m.eh_proj.weight.t()), m.final_layernorm.weight, c.layernorm_epsilon)
        ce = F.cross_entropy((h @ head[:V].t()).reshape(-1, V), stream[:, k + 1:k + 1 + n].t().reshape(-1),
                             reduction="none")
        losses.append((ce.view(n, B).t() * mask[:, k:k + n]).sum())
    return losses


def test_targets_are_the_labels_and_masks_moved_k_on_with_zeros_past_the_end():
    _, batch = _batch()
    out = with_mtp_targets(batch, 2)
    assert out["mtp_labels"].shape == (B, S, 2) and out["mtp_loss_mask"].shape == (B, S, 2)
    for k in (1, 2):
        assert torch.equal(out["mtp_labels"][:, :S - k, k - 1], batch["labels"][:, k:])
        assert torch.equal(out["mtp_loss_mask"][:, :S - k, k - 1], batch["loss_mask"][:, k:])
        assert not out["mtp_loss_mask"][:, S - k:, k - 1].any() and not out["mtp_labels"][:, S - k:, k - 1].any()


@pytest.mark.parametrize("untied", [False, True], ids=["tied", "untied"])
def test_mtp_losses_and_gradients_equal_the_papers_equations(untied):
    torch.manual_seed(0)
    model = GPTModel(_config(untie_embeddings_and_output_weights=untied), seed=5, device="cpu")
    with torch.no_grad():  # norms off their init of ones
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    reference = copy.deepcopy(model)
    stream, batch = _batch()
    batch = with_mtp_targets(batch, 2)
    sums = model(batch["tokens"], labels=batch["labels"], loss_mask=batch["loss_mask"],
                 mtp_labels=batch["mtp_labels"], mtp_loss_mask=batch["mtp_loss_mask"])
    want = reference_losses(reference, stream, batch["loss_mask"])
    assert sums.shape == (3,)
    assert max(float((a - b).abs() / b.abs()) for a, b in zip(sums.detach(), want)) <= 1e-6, (sums, want)
    # Trained as main + 0.3 / 2 x (mtp_1 + mtp_2); its value is the main loss alone.
    loss = with_mtp_gradient(sums[0], sums[1:], 0.3)
    assert float(loss) == float(sums[0])
    loss.backward()
    (want[0] + 0.15 * (want[1] + want[2])).backward()
    errors = {n: float((p.grad - q.grad).abs().max() / q.grad.abs().max())
              for (n, p), q in zip(model.named_parameters(), reference.parameters())}
    assert len(errors) == len(list(model.parameters())) and max(errors.values()) <= 1e-6, errors
    assert any(n.startswith("mtp.1.layer.") for n in errors)


def _fused_equals_autograd(rank, world, untied):
    """Two micro-batches through the gradient buffer (the output GEMMs and lookups of the shared
    table written straight into it) against autograd's .grad."""
    from megalite.optim.buffers import ParamAndGradBuffer
    from megalite.parallel import grad_accumulation
    from megalite.training.task import gpt_forward_step

    grad_accumulation.MIN_FUSED_NUMEL = 0
    parallel.initialize_model_parallel(1)
    model = GPTModel(_config(untie_embeddings_and_output_weights=untied), seed=3, device="cpu").train()
    reference = copy.deepcopy(model)
    batches = [with_mtp_targets(_batch(i)[1], 2) for i in range(2)]
    for b in batches:
        gpt_forward_step(reference, dict(b)).backward()
    buffer = ParamAndGradBuffer(list(model.parameters()), param_dtype=torch.float32, grad_dtype=torch.float32,
                                bucket_numel=4000, dp_group=None, dp_size=1, reduce_scatter=False)
    for i, b in enumerate(batches):
        if i == len(batches) - 1:
            buffer.enable_sync()
        gpt_forward_step(model, dict(b)).backward()
    buffer.finish_grad_sync()
    return {n: float((p.main_grad - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-30))
            for (n, p), q in zip(model.named_parameters(), reference.parameters())}


@pytest.mark.parametrize("untied", [False, True], ids=["tied", "untied"])
def test_gradients_written_into_the_buffer_equal_autograds(untied):
    errors = run_ranks(_fused_equals_autograd, 1, args=(untied,))[0]
    assert max(errors.values()) <= 1e-6, errors


def test_without_mtp_layers_the_model_has_no_mtp_and_the_step_is_unchanged():
    model = GPTModel(_config(mtp_num_layers=0), seed=5, device="cpu")
    assert not hasattr(model, "mtp")
    with_mtp = GPTModel(_config(), seed=5, device="cpu")
    base = {n: p for n, p in model.named_parameters()}
    # The main model's weights do not depend on whether MTP modules are built.
    assert all(torch.equal(base[n], p) for n, p in with_mtp.named_parameters() if not n.startswith("mtp."))
    assert mtp_term_names(2) == ("mtp_1_loss", "mtp_2_loss")


MTP_FLAGS = ["--model", "llama-tiny", "--mtp-num-layers", "2", "--seq-length", "32"]
TRAIN = ["--train-iters", "5", "--lr", "1e-3", "--log-interval", "1", "--global-batch-size", "8",
         "--micro-batch-size", "2", "--eval-interval", "0"]


def _losses(rank, world, argv):
    from training_ranks import gpt_run
    return [(r["loss"], r["mtp_1_loss"], r["mtp_2_loss"]) for r in gpt_run(argv).records]


def _close(got, want):
    flat = [(a, b) for g, w in zip(got, want) for a, b in zip(g, w)]
    return len(got) == len(want) and max(abs(a - b) / abs(b) for a, b in flat) <= 1e-5


@pytest.mark.slow
def test_mtp_losses_equal_one_devices_at_tp2_sp_pp2_tied_and_untied_cp2_and_zero3():
    from training_ranks import several

    one = run_ranks(_losses, 1, args=(MTP_FLAGS + TRAIN,))[0]
    tied_flags = ["--model", "gpt-tiny", "--position-embedding-type", "rope", "--mtp-num-layers", "2",
                  "--seq-length", "32"]
    tied_one = run_ranks(_losses, 1, args=(tied_flags + TRAIN,))[0]
    layouts = [MTP_FLAGS + ["--tp", "2", "--sequence-parallel"], MTP_FLAGS + ["--pp", "2"],
               MTP_FLAGS + ["--cp", "2"], MTP_FLAGS + ["--zero-stage", "3"], tied_flags + ["--pp", "2"]]
    runs = run_ranks(several, 4, args=(_losses, [x + TRAIN for x in layouts]), timeout=600)
    for i, layout in enumerate(layouts):
        got = runs[-1][i] if "--pp" in layout else runs[0][i]  # the last stage logs the losses
        want = tied_one if layout[1] == "gpt-tiny" else one
        assert _close(got, want), (layout, got, want)


@pytest.mark.slow
def test_an_mtp_checkpoint_saved_at_pp2_tp2_resumes_exactly_on_one_device(tmp_path):
    whole = run_ranks(_losses, 1, args=(MTP_FLAGS + TRAIN,))[0]
    first = run_ranks(_losses, 4, args=(MTP_FLAGS + TRAIN + ["--tp", "2", "--pp", "2", "--save", str(tmp_path),
                                                             "--save-interval", "3", "--exit-interval", "3"],))
    resumed = run_ranks(_losses, 1, args=(["--load", str(tmp_path)] + TRAIN,))[0]  # --load alone: its shape
    assert _close(first[-1] + resumed, whole), (first[-1], resumed, whole)


@pytest.mark.parametrize("argv, message", [
    (["--model", "gpt-tiny", "--mtp-num-layers", "1", "--pp", "2"], r"learned absolute positions needs --pp 1"),
    (["--model", "deepseek-tiny", "--tp", "3"], r"num_attention_heads \(4\) is not divisible by the tensor-parallel "
                                                r"size \(3\)"),
    (["--model", "llama-tiny", "--mtp-num-layers", "8", "--seq-length", "8"], r"predicts past the --seq-length 8"),
])
def test_bad_mtp_settings_end_in_one_line(argv, message):
    from megalite import config as C
    from megalite.errors import UsageError

    cfg = C.build_parser("test", "gpt-tiny").parse_args(["--mock-data", *argv])
    with pytest.raises(UsageError, match=message) as e:
        C.validate(cfg, 2 if "--pp" in argv else 3 if "--tp" in argv else 1, C.model_config(cfg), machine=False)
    assert "\n" not in str(e.value)


def test_mtp_with_bert_ends_in_one_line_before_anything_starts():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(root / "pretrain_bert.py"), "--mock-data", "--mtp-num-layers", "1",
                          "--train-iters", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert lines[-1].endswith("--mtp-num-layers: multi-token prediction is for GPT models (pretrain_gpt.py); a bert "
                              "model does not predict the next tokens: drop it"), out.stderr
