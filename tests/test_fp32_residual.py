"""--fp32-residual-connection (Megatron-LM's flag): beside bf16 weights the stream between the layers
and the pipeline stages is fp32; each norm reads it in fp32 and gives the weights' dtype to the linear
layers after it; the branches join it in fp32. pp 2 gives one rank's losses bit for bit (the stages
exchange the fp32 stream), tp 2 with SP its losses within bf16's rounding; refused without 16-bit
weights, for post-norm models and with multi-token prediction."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers import rel_err
from megalite.testing import run_ranks
from training_ranks import parse, built_model as _built

RUN = ["--model", "llama-tiny", "--num-layers", "4", "--seq-length", "16", "--global-batch-size", "4",
       "--micro-batch-size", "1", "--log-interval", "1", "--eval-iters", "0", "--train-iters", "3", "--bf16",
       "--fp32-residual-connection"]


def test_the_stream_is_fp32_and_every_norm_gives_the_weights_dtype():
    from megalite.models import GPTModel

    config = _built(RUN)
    assert config.fp32_residual_connection
    model = GPTModel(config, seed=1, device="cpu").to(torch.bfloat16)
    seen = {}

    def note(name):
        def hook(module, args, out):
            seen.setdefault(name, (args[0].dtype, out.dtype))
        return hook

    for name, module in model.named_modules():
        if name.endswith(("layernorm", "attention", "mlp")) or name in ("layers.0", "layers.3"):
            module.register_forward_hook(note(name))
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = model(ids)
    assert seen["layers.0"] == seen["layers.3"] == (torch.float32, torch.float32)
    assert seen["layers.0.input_layernorm"] == seen["final_layernorm"] == (torch.float32, torch.bfloat16)
    assert seen["layers.1.attention"] == seen["layers.1.mlp"] == (torch.bfloat16, torch.bfloat16)
    assert logits.dtype == torch.bfloat16


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_a_norm_of_the_fp32_stream_is_the_fp32_norm_rounded_once(kind, backend):
    from megalite.models.norms import NORMS
    from megalite.ops import reference

    norm = NORMS[kind](64, 1e-5, False, torch.bfloat16, "cpu", backend)
    with torch.no_grad():
        for p in norm.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)) * 3 + 1
    got = norm(x)
    w = norm.weight.float()
    want = (F.layer_norm(x, (64,), w, norm.bias.float(), 1e-5) if kind == "layernorm"
            else reference.rms_norm(x, w, 1e-5))
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.to(torch.bfloat16))
    # the formula itself, in float64 from the fp32 input: within one bf16 rounding of it
    x64, w64 = x.double(), w.double()
    centred = x64 - x64.mean(-1, keepdim=True) if kind == "layernorm" else x64
    exact = centred / (centred.square().mean(-1, keepdim=True) + 1e-5).sqrt() * w64
    exact = exact + norm.bias.double() if kind == "layernorm" else exact
    assert ((got.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-6).all()
    assert not torch.equal(got, norm(x.to(torch.bfloat16)))  # the stream's fp32 digits count


def losses(rank, world, argv):
    import pretrain_gpt
    from megalite.training import pretrain

    return [r["loss"] for r in pretrain(parse(argv), pretrain_gpt.task()).records]


def test_pp2_gives_one_ranks_losses_bit_for_bit_and_tp2_within_bf16s_rounding():
    [want] = run_ranks(losses, 1, args=(RUN,))
    for got in run_ranks(losses, 2, args=(RUN + ["--pp", "2"],)):
        assert got == want
    for got in run_ranks(losses, 2, args=(RUN + ["--tp", "2", "--sequence-parallel"],)):
        assert rel_err(torch.tensor(got), torch.tensor(want)) <= 1e-3, (got, want)
    [bf16_stream] = run_ranks(losses, 1, args=(RUN[:-1],))
    assert bf16_stream[0] != want[0]


def test_it_is_refused_without_16_bit_weights_for_post_norm_and_with_mtp():
    from megalite.config import validate
    from megalite.errors import UsageError

    fp32 = [a for a in RUN if a != "--bf16"]
    with pytest.raises(UsageError, match="add --bf16 or --fp16"):
        validate(parse(fp32), 1, _built(fp32))
    with pytest.raises(UsageError, match="post-norm layers"):
        _built(["--model", "bert-tiny", "--bf16", "--fp32-residual-connection"])
    with pytest.raises(UsageError, match="multi-token prediction"):
        _built(RUN + ["--mtp-num-layers", "1"])


def test_the_planner_counts_fp32_messages_between_stages():
    from megalite.models import preset
    from megalite.tools import plan as P

    cluster = P.Cluster(gpus=2, gpus_per_node=1, inter_node_gbps=1, peak_tflops=1, efficiency=1,
                        collective_latency_ms=1)
    config = preset("gpt-tiny")

    def pp_bytes(**fields):
        run = P.Run(16, 64, "bf16", 200_000)
        return P.predict(config.replace(**fields), P.Layout(pp=2, micro_batch_size=4), cluster, run=run).exposed["pp"].bytes

    assert pp_bytes(fp32_residual_connection=True) == 2 * pp_bytes()
    from megalite.tools.plan.activations import output_layer_bytes

    run, layout = P.Run(16, 64, "bf16", 200_000), P.Layout(pp=2, micro_batch_size=4)
    extra = output_layer_bytes(config.replace(fp32_residual_connection=True), layout, run, 1024) - output_layer_bytes(
        config, layout, run, 1024)
    assert extra == 64 * 4 * config.hidden_size * 2  # the final norm's input: 4 bytes a value, not 2


def generated(rank, world, fields):
    """Greedy tokens of a 2-layer bf16 model (built in fp32 and cast, as a training run's) over `world`
    pipeline stages."""
    from megalite import parallel
    from megalite.generation import generate
    from megalite.models import GPTModel
    from megalite.models.presets import preset

    parallel.initialize_model_parallel(1, world)
    config = preset("llama-tiny", num_layers=2, **fields)
    layers = [0, 1] if world == 1 else [rank]
    model = GPTModel(config, pre_process=rank == 0, post_process=rank == world - 1, layer_numbers=layers, seed=1,
                     device="cpu").to(torch.bfloat16).eval()
    tokens = generate([model], [[5, 6, 7], [9, 10]], max_new_tokens=4, eos_id=None).tokens
    parallel.destroy_model_parallel()
    return tokens


@pytest.mark.parametrize("fields", [{}, {"fp32_residual_connection": True}])
def test_generation_at_pp2_exchanges_the_stream_in_its_dtype(fields):
    """The stages exchange bf16 hidden states (the weights' dtype, though the config says fp32), or fp32
    ones under --fp32-residual-connection: the tokens of one rank."""
    [want] = run_ranks(generated, 1, args=(fields,))
    assert run_ranks(generated, 2, args=(fields,)) == [want, want]
