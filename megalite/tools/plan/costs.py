"""What one layout of one run costs per micro-batch and layer, whatever the pipeline rank
(`LayoutCosts`): the numbers step_time.py works out (FLOPs, link speeds, message sizes) and the
pipeline ranks' predictions, the data-parallel model (comm.py) and --explain read."""
from __future__ import annotations

from dataclasses import dataclass

from megalite.models.config import TransformerConfig
from megalite.tools.plan.inputs import Cluster, Layout, Run

# Bytes of memory traffic per element the optimizer step updates (fused AdamW on the GPU): Adam
# reads master, gradient, exp_avg, exp_avg_sq (16) and writes master, exp_avg, exp_avg_sq (12); the
# global norm reads the gradient (4); clipping rides in Adam's grad_scale, which writes the clipped
# gradient back (4; MegaliteOptimizer.step); publishing the new weights reads the master and writes
# the model-dtype parameter (4 + 2 for bf16/fp16, nothing for fp32, whose masters are the
# parameters). fp16 adds the unscaling pass (read + write, 8).
OPTIMIZER_TRAFFIC = {"bf16": 16 + 12 + 4 + 4 + 6, "fp16": 16 + 12 + 4 + 4 + 6 + 8, "fp32": 16 + 12 + 4 + 4}


@dataclass(frozen=True)
class LayoutCosts:
    """What one layout of one run costs per micro-batch and layer, whatever the pipeline rank."""
    config: TransformerConfig
    layout: Layout
    cluster: Cluster
    run: Run
    micro_batches: int  # m: per step and data-parallel rank
    layer_counts: list  # layers of each virtual stage
    vocab: int  # padded for tp
    act_bytes: int  # bytes of one activation element (model dtype)
    bw_tp: float  # bytes/s of the slowest link of each kind of group
    bw_pp: float
    bw_dp: float
    bw_emb: float
    rate: float  # sustained FLOP/s per GPU
    fwd: float  # FLOPs of one layer and micro-batch, all TP ranks together (see layer_flops)
    bwd: float
    core: float
    logits_fwd: float  # output layer forward, all TP ranks together
    ar_bytes: float  # one TP all-reduce (or all-gather + reduce-scatter under SP)
    ar_time: float
    ar_per_layer: int
    msg: float  # one pipeline message: megalite's p2p tensor_shape
    pp_mb: float  # pipeline exchanges per micro-batch (all chunks)
    bw_cp: float = 0.0  # context parallelism (cp > 1): the CP group's slowest link
    ring_bytes: float = 0.0  # bytes one rank sends around the ring per layer and micro-batch (see ring_layer_bytes)
    ring_step_bytes: tuple = (0.0, 0.0)  # bytes of one ring step: (forward, backward) (exposed.cp_exposure)
    # Mixture of experts (0 for a dense model): a MoE layer's FLOPs (active experts only), its TP
    # collectives, and per micro-batch the bytes one rank's dispatcher sends and their seconds
    moe_count: int = 0  # MoE layers in the model
    moe_fwd: float = 0.0
    moe_bwd: float = 0.0
    moe_ar_per_layer: int = 0
    ep_bytes: float = 0.0  # over EP (alltoall) or ETP x EP (allgather)
    etp_bytes: float = 0.0  # over ETP (alltoall)
    ep_time: float = 0.0  # seconds, each exchange's latency included
    ep_exchanges: int = 0  # per MoE layer and micro-batch (experts.dispatch_exchanges)
    bw_ep: float = 0.0
    bw_etp: float = 0.0
    bw_edp: float = 0.0  # the expert-data-parallel group's slowest link (expert gradients)
    # Multi-token prediction (0 without): its modules' FLOPs per micro-batch on the last stage, all TP
    # ranks together (mtp_flops), its TP collectives, and how many of its layers are MoE layers
    mtp_fwd: float = 0.0
    mtp_bwd: float = 0.0
    mtp_ar: int = 0
    mtp_moe: int = 0

    @property
    def traffic(self) -> int:
        """Bytes an element; bf16 moments read and write 2 bytes each of 4 (as one fused kernel would)."""
        return OPTIMIZER_TRAFFIC[self.run.dtype] - 2 * (8 - self.run.adam_moment_bytes)

    @property
    def hardware_flops(self) -> float:
        """FLOPs of one step, the whole model, recomputation included."""
        m, d, L, n = self.micro_batches, self.layout.dp, self.config.num_layers, self.moe_count
        return m * d * ((L - n) * (self.fwd + self.bwd) + n * (self.moe_fwd + self.moe_bwd) + 3 * self.logits_fwd
                        + self.mtp_fwd + self.mtp_bwd)

    @property
    def head_flops(self) -> float:
        """What the last virtual stage runs besides its layers, per micro-batch, all TP ranks
        together: the output layer's forward and backward, and multi-token prediction's."""
        return 3 * self.logits_fwd + self.mtp_fwd + self.mtp_bwd

    def layers_flops(self, layers: int, moe_layers: int) -> float:
        """Forward and backward FLOPs of `layers` layers (`moe_layers` of them MoE) of one
        micro-batch, all TP ranks together."""
        return (layers - moe_layers) * (self.fwd + self.bwd) + moe_layers * (self.moe_fwd + self.moe_bwd)
