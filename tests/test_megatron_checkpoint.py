"""`--load` of a Megatron-LM `torch_dist` checkpoint (megalite.checkpoint.megatron_dist): checkpoints
that megatron-core 0.19.2 wrote on a CPU with gloo load into megalite at other layouts than they were
saved at and give megatron-core's own logits (fp32, within 1e-5), without importing Megatron.

The checkpoints are tests/fixtures/megatron_ckpt/{gpt,llama,mixtral}: written by megatron-core's
`dist_checkpointing.save(..., 'torch_dist')` from its own GPTModel (the local layer spec) by
tests/fixtures/megatron_ckpt/write_mcore.py, with megatron-core's logits for fixed tokens beside
each (`expected.pt`):
  gpt      learned positions, LayerNorm, biases, tanh GeLU (Megatron-LM's fused bias-GeLU), tied,
           vocabulary 60 padded to 64; saved at tp 2, pp 2
  llama    rope, RMSNorm, SwiGLU, GQA (4 heads, 2 groups), untied; saved at tp 2 (dp 2), with the
           legacy `common.pt` beside the common_state object
  mixtral  the llama layers with Mixtral-style MoE MLPs (4 experts, top-2); saved at ep 2, pp 2
They are committed because megatron-core 0.19.2 needs Python >= 3.12 (CI's venv is 3.11) and takes
~100 s to write them; `test_megatron_core_writes_what_the_fixtures_hold` regenerates them where
megatron-core is installed (slow).

What megatron-core could not run on a CPU, and what the writer does about it (write_mcore.py's
docstring has the exact errors): its CUDA RNG tracker, attention scratch buffer, default causal
mask, tied-embedding set-up under pipelining and the checkpoint writer's synchronize/flag tensor call
CUDA; the writer makes those calls CPU no-ops (the files do not depend on them). The alltoall token
dispatcher creates a CUDA stream: the MoE case uses the allgather dispatcher (the same numbers).
Grouped experts (TEGroupedMLP / GroupedMLP) need Transformer Engine or the grouped_gemm CUDA
package: not built; their dist-checkpoint layout is the SequentialMLP's used here. Megatron-LM's
`args` come from its training package, which megatron-core's wheel lacks: the writer fills an
argparse.Namespace with arguments.py's field names (holding megatron-core's AttnBackend enum)."""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from helpers import gather_tp
from megalite import checkpoint, parallel
from megalite.checkpoint.megatron_dist import MegatronCheckpoint, is_megatron_checkpoint
from megalite.errors import UsageError
from megalite.models import GPTModel
from megalite.testing import run_ranks

FIXTURES = Path(__file__).parent / "fixtures" / "megatron_ckpt"
TOL = 1e-5
# case -> the layouts (tp, pp, ep) megalite loads it at on 2 ranks: none is the one it was saved at
LAYOUTS = {"gpt": [(2, 1, 1), (1, 2, 1)],
           "llama": [(1, 2, 1)],
           "mixtral": [(1, 1, 2), (1, 2, 1)]}


def _stage_logits(config, reader, tokens):
    """This rank's model for the current layout, loaded from `reader`, and the full logits on the
    last stage (None elsewhere)."""
    pp, pp_rank = parallel.get_pipeline_model_parallel_world_size(), parallel.get_pipeline_model_parallel_rank()
    per = config.num_layers // pp
    model = GPTModel(config, pre_process=pp_rank == 0, post_process=pp_rank == pp - 1,
                     layer_numbers=range(pp_rank * per, (pp_rank + 1) * per), seed=11, device="cpu").eval()
    checkpoint.load_model_weights(reader.path, [model], reader)
    ranks = parallel.get_pipeline_model_parallel_ranks()
    with torch.no_grad():
        if pp_rank > 0:
            h = torch.empty(tokens.shape[1], tokens.shape[0], config.hidden_size)
            dist.recv(h, ranks[pp_rank - 1])
            model.set_input_tensor(h)
        out = model(tokens)
        if pp_rank < pp - 1:
            dist.send(out.contiguous(), ranks[pp_rank + 1])
            return None
    return gather_tp(out, dim=-1)[..., :config.vocab_size]


def _load_everywhere(rank, world, layouts):
    errors = {}
    for name, cases in layouts.items():
        reader = MegatronCheckpoint(FIXTURES / name)
        expected = torch.load(FIXTURES / name / "expected.pt")
        for tp, pp, ep in cases:
            parallel.initialize_model_parallel(tp, pp, expert_model_parallel_size=ep)
            try:
                logits = _stage_logits(reader.config, reader, expected["tokens"])
            finally:
                parallel.destroy_model_parallel()
            if logits is not None:
                theirs = expected["logits"][..., :reader.config.vocab_size]
                errors[f"{name} tp{tp} pp{pp} ep{ep}"] = (logits - theirs).abs().max().item()
    return errors


def test_megatron_core_checkpoints_give_its_logits_at_other_layouts():
    results = run_ranks(_load_everywhere, 2, (LAYOUTS,))
    errors = {k: v for r in results for k, v in r.items()}
    assert len(errors) == sum(len(v) for v in LAYOUTS.values())
    assert all(e <= TOL for e in errors.values()), errors


def test_args_become_megalites_configuration():
    gpt, llama, mixtral = (MegatronCheckpoint(FIXTURES / n) for n in ("gpt", "llama", "mixtral"))
    assert (gpt.config.activation, gpt.config.position_embedding_type, gpt.config.vocab_size) == (
        "gelu_tanh", "learned_absolute", 60)
    assert not gpt.config.untie_embeddings_and_output_weights and gpt.config.add_bias_linear
    c = llama.config
    assert (c.normalization, c.gated_linear_unit, c.num_query_groups, c.layernorm_epsilon, c.ffn_hidden_size) == (
        "rmsnorm", True, 2, 1e-6, 48)
    assert c.untie_embeddings_and_output_weights and not c.add_bias_linear
    m = mixtral.config
    assert (m.num_moe_experts, m.moe_router_topk, m.moe_ffn_hidden_size, m.moe_layer_freq) == (4, 2, 24, [1, 1])
    assert (gpt.metadata["iteration"], gpt.metadata["consumed_samples"]) == (7, 112)
    assert (llama.path / "common.pt").is_file()  # read instead of the common_state object, as megatron-core does
    # megatron-core's enum in args is a stand-in: nothing of megatron was imported
    assert type(gpt.common["args"].attention_backend).__name__ == "AttnBackend"
    assert not any(m.startswith("megatron") for m in sys.modules)


def test_a_megatron_directory_is_recognised_and_its_iteration_directory_too():
    assert is_megatron_checkpoint(FIXTURES / "gpt") and is_megatron_checkpoint(FIXTURES / "gpt" / "iter_0000007")
    assert not checkpoint.CheckpointReader.exists(FIXTURES / "gpt")
    assert MegatronCheckpoint(FIXTURES / "gpt" / "iter_0000007").path == MegatronCheckpoint(FIXTURES / "gpt").path


def _copy(name, tmp_path) -> Path:
    return Path(shutil.copytree(FIXTURES / name, tmp_path / name))


def _one_line(fn) -> str:
    with pytest.raises(UsageError) as e:
        fn()
    assert "\n" not in str(e.value)
    return str(e.value)


def test_a_damaged_checkpoint_is_named_in_one_line(tmp_path):
    d = _copy("llama", tmp_path)
    (d / "latest_checkpointed_iteration.txt").write_text("9")
    assert "names iteration 9, but" in _one_line(lambda: MegatronCheckpoint(d))
    (d / "latest_checkpointed_iteration.txt").write_text("7")
    reader = MegatronCheckpoint(d)
    distcp = d / "iter_0000007" / "__1_0.distcp"
    distcp.write_bytes(distcp.read_bytes()[:100] + bytes(len(distcp.read_bytes()) - 100))  # zeroed after 100 bytes
    assert "reading its torch_dist files failed" in _one_line(lambda: reader.full_tensor("layers.1.mlp.fc1.weight"))
    distcp.write_bytes(distcp.read_bytes()[:1000])
    assert f"checkpoint file {distcp} has 1000 bytes, its metadata places" in _one_line(lambda: MegatronCheckpoint(d))
    distcp.unlink()
    assert f"checkpoint file {distcp} is missing" in _one_line(lambda: MegatronCheckpoint(d))
    (d / "iter_0000007" / ".metadata").unlink()
    assert "has no .metadata" in _one_line(lambda: MegatronCheckpoint(d))


def test_a_missing_tensor_or_an_unsupported_feature_is_named(tmp_path):
    reader = MegatronCheckpoint(FIXTURES / "llama")
    del reader._tensors["decoder.layers.mlp.linear_fc2.weight"]
    msg = _one_line(lambda: reader.full_tensor("layers.0.mlp.fc2.weight"))
    assert "has no tensor decoder.layers.mlp.linear_fc2.weight (megalite's layers.0.mlp.fc2.weight)" in msg
    args = reader.common["args"]
    args.multi_latent_attention = True
    from megalite.checkpoint.megatron_dist_map import translate_args

    assert "args.multi_latent_attention = True (multi-latent attention)" in _one_line(
        lambda: translate_args(args, "ckpt"))
    args.multi_latent_attention, args.add_bias_linear, args.swiglu = False, True, False
    args.bias_gelu_fusion = False
    assert "--openai-gelu" not in translate_args(args, "ckpt").flags  # Megatron-LM's exact GeLU


def test_load_without_shape_flags_takes_the_checkpoints_model():
    from megalite.config import build_parser, model_config
    from megalite.training.checkpoint_shape import adopt_checkpoint_shape

    for name in LAYOUTS:
        cfg = build_parser("test", "gpt-tiny").parse_args(["--load", str(FIXTURES / name), "--mock-data"])
        built = model_config(adopt_checkpoint_shape(cfg))
        checkpoint.check_compatible(MegatronCheckpoint(FIXTURES / name), built, "gpt")  # the same model


@pytest.mark.slow
def test_pretrain_resumes_a_megatron_checkpoint_with_a_fresh_optimizer(tmp_path):
    from cli import torchrun

    run = torchrun("pretrain_gpt.py", 2, "--load", str(FIXTURES / "gpt"), "--mock-data", "--tp", "2",
                   "--train-iters", "8", "--micro-batch-size", "2", "--global-batch-size", "4",
                   "--save", str(tmp_path / "save"))
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout + run.stderr
    assert "is a Megatron-LM torch_dist checkpoint: its weights, args and iteration are taken; it holds no " \
           "optimizer state: the optimizer starts fresh from these weights, the RNG streams from --seed" in out
    assert "(iteration 7, 112 samples consumed; optimizer state fresh; RNG streams from the seed)" in out
    assert (tmp_path / "save" / "latest").read_text().strip() == "iter_0000008"


class _RunsCode:
    """A pickle that calls os.system when loaded by an unrestricted unpickler."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_common_state_is_unpickled_without_running_code(tmp_path):
    d = _copy("llama", tmp_path)
    marker = tmp_path / "ran"
    torch.save({"args": _RunsCode(marker), "iteration": 7}, d / "iter_0000007" / "common.pt")
    msg = _one_line(lambda: MegatronCheckpoint(d))
    assert "its 'args' is a system, not Megatron-LM's argparse.Namespace" in msg
    assert not marker.exists()
    (d / "iter_0000007" / "common.pt").write_bytes(b"not a pickle")
    assert "common.pt cannot be read" in _one_line(lambda: MegatronCheckpoint(d))


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed "
                    "(0.19.2 needs Python >= 3.12): the committed fixtures stand for it")
def test_megatron_core_writes_what_the_fixtures_hold(tmp_path):
    run = subprocess.run([sys.executable, str(FIXTURES / "write_mcore.py"), str(tmp_path)], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    for name in LAYOUTS:
        ours, theirs = MegatronCheckpoint(tmp_path / name), MegatronCheckpoint(FIXTURES / name)
        for n in theirs.model_names():
            assert torch.equal(ours.full_tensor(n), theirs.full_tensor(n)), (name, n)
        assert torch.equal(torch.load(tmp_path / name / "expected.pt")["logits"],
                           torch.load(FIXTURES / name / "expected.pt")["logits"])


def test_a_residual_after_the_norm_that_megatron_core_never_read_loads_with_a_note():
    """args.apply_residual_connection_post_layernorm: a field of Megatron-Core's TransformerConfig that no
    layer of megatron-core 0.19 reads, so a torch_dist checkpoint saved with it holds the plain model."""
    from megalite.checkpoint.megatron_dist_map import translate_args

    args = MegatronCheckpoint(FIXTURES / "llama").common["args"]
    plain = translate_args(args, "ckpt")
    args.apply_residual_connection_post_layernorm = True
    noted = translate_args(args, "ckpt")
    assert noted.flags == plain.flags
    assert [n for n in noted.notes if "no Megatron-Core layer reads" in n] and len(noted.notes) == len(plain.notes) + 1
