"""FP8 in the planner's step time: the transformer layers' linear GEMMs of a run with `--fp8-format`
(`Run.fp8_layers` of its layers) run `Cluster.fp8_speedup` times faster than the model dtype's
(2 on H100 and H200: 1979 dense FP8 TFLOP/s against 989 bf16), the attention core, the output layer
and multi-token prediction's modules at the model dtype's rate. The step's FLOPs stay what they are;
the rate they run at becomes their blend: FLOPs over the model-dtype FLOPs that take the same time.
Quantization's passes (an amax and a cast per operand, memory-bound) are not counted."""
from __future__ import annotations

from megalite.metrics import layer_forward_flops


def fp8_rate(costs) -> float:
    """The sustained FLOP/s of `costs`' step (a megalite.tools.plan.step_time.LayoutCosts) with its
    FP8 layers' GEMMs sped up; `costs.rate` without FP8 layers."""
    run, config, layout = costs.run, costs.config, costs.layout
    n = min(run.fp8_layers, config.num_layers)
    if n == 0 or costs.cluster.fp8_speedup == 1.0:
        return costs.rate
    s, b = run.seq_length, layout.micro_batch_size
    # The dense part runs forward, twice backward, and once more where recomputation repeats it.
    passes = 4.0 if layout.recompute == "full" else 3.0
    dense, _ = layer_forward_flops(config, s, b)
    moe_dense = layer_forward_flops(config, s, b, moe=True)[0] if costs.moe_count else 0.0
    L, moe = config.num_layers, costs.moe_count
    per_layer = ((L - moe) * dense + moe * moe_dense) / L  # an average layer's dense forward
    fp8_flops = costs.micro_batches * layout.dp * n * per_layer * passes
    total = costs.hardware_flops
    saved = fp8_flops * (1.0 - 1.0 / costs.cluster.fp8_speedup)
    return costs.rate * total / (total - saved)
