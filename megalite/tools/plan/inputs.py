"""What the planner is asked about: the machine (Cluster), a layout (Layout), the run (Run), and the
parameters each pipeline rank holds, counted on a model built on the meta device."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch.overrides import TorchFunctionMode

from megalite.checkpoint.layout import VOCAB_PARAMS
from megalite.models import PRESETS, GPTModel, TransformerConfig
from megalite.optim.muon import muon_matrix
from megalite.parallel.layers import pad_vocab_size
from megalite.pipeline.partition import V_SCHEDULES, layers_of, stage_layer_counts, virtual_stage
from megalite.pipeline.programs import is_one_chunk_program

GIB = 1024 ** 3
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
RECOMPUTE = ("none", "selective", "full")
ZERO_STAGES = (0, 1, 2, 3)  # --zero-stage: 1 is --use-distributed-optimizer
GPT_PRESETS = tuple(name for name in PRESETS if not name.startswith("bert"))  # GPT-2 and the Llama family


@dataclass(frozen=True)
class Cluster:
    """The machine. Bandwidths are per GPU and per direction, in GB/s (10^9 bytes), as NCCL's
    "bus bandwidth": an all-reduce of X bytes over n GPUs takes 2 (n-1)/n X / bandwidth."""
    gpus: int
    gpu_memory_gib: float = 80.0
    gpus_per_node: int = 8
    intra_node_gbps: float = 450.0  # H100 SXM NVLink 4: 900 GB/s both directions
    inter_node_gbps: float = 50.0  # one 400 Gb/s NIC per GPU
    peak_tflops: float = 989.0  # H100 SXM dense bf16
    efficiency: float = 0.5  # fraction of peak the transformer's matmuls sustain
    hbm_gbps: float = 3350.0  # H100 SXM HBM3, for the (memory-bound) optimizer step
    overhead_gib: float = 2.0  # CUDA context, cuBLAS workspaces, NCCL buffers
    fp8_speedup: float = 2.0  # dense FP8 peak over the model dtype's (H100/H200 SXM: 1979 / 989)
    # Every exchange's start-up (a collective, an all-to-all, a batch of pipeline sends, a ring step;
    # per gradient bucket): tens of microseconds on NVLink / InfiniBand; 3-4 ms on docs/slow-links.md's
    # emulated link.
    collective_latency_ms: float = 0.05
    # A link's token bucket: bytes that cross at full speed once it has idled (tc-tbf's burst on the
    # emulated link, 2 ms of its rate; 0 on a real fabric). The ep plays carry exchanges through it.
    link_burst_kib: float = 0.0
    # The attention core's FLOP/s over a layer's average (efficiency's): what a context-parallel ring
    # transfer hides behind is one attention block, whose softmax and masking run slower per FLOP than
    # the projections' GEMMs (this CPU: 0.36-0.60; docs/planner.md). The layer's compute stays its FLOPs at
    # the average rate: the core takes a larger part of it. The backward's pieces have their own
    # (None: attention_speed's).
    attention_speed: float = 1.0
    attention_backward_speed: float | None = None

    def __post_init__(self):
        for name in ("gpus", "gpus_per_node"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("gpu_memory_gib", "intra_node_gbps", "inter_node_gbps", "peak_tflops", "efficiency",
                     "hbm_gbps", "fp8_speedup", "attention_speed"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.attention_backward_speed is not None and not self.attention_backward_speed > 0:
            raise ValueError(f"attention_backward_speed must be > 0, got {self.attention_backward_speed}")
        if self.efficiency > 1:
            raise ValueError(f"efficiency is a fraction of peak (0-1], got {self.efficiency}")
        for name in ("overhead_gib", "collective_latency_ms", "link_burst_kib"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    @property
    def memory_bytes(self) -> float:
        return self.gpu_memory_gib * GIB


SCHEDULES = ("1f1b", "zb-h1", "zb-v", "dualpipev")  # the planner's pipeline schedules (interleaving: 1f1b with vpp)


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    vpp: int | None = None  # model chunks per pipeline rank (interleaved 1F1B); None = 1
    micro_batch_size: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False
    distributed_optimizer: bool = False  # ZeRO stage >= 1 (kept for callers; zero_stage says which)
    zero_stage: int | None = None  # None: 1 with the distributed optimizer, else 0
    cp: int = 1  # context-parallel size: each sequence split over cp ranks (ranks: tp, cp, dp, pp)
    # Expert layers (parallel folding): ETP x EP x EDP over the TP x CP x DP ranks, ETP fastest.
    ep: int = 1  # expert-parallel size: whole experts per rank
    etp: int | None = None  # expert-tensor-parallel size; None: tp (megalite's --etp default)
    schedule: str = "1f1b"  # --pipeline-schedule: 1f1b (interleaved with vpp), zb-h1, zb-v or dualpipev (vpp 2, a V)

    def __post_init__(self):
        if self.schedule in V_SCHEDULES and self.vpp is None and self.pp > 1:
            object.__setattr__(self, "vpp", 2)  # two chunks per rank, placed in a V
        if self.vpp is not None and self.vpp <= 1:
            object.__setattr__(self, "vpp", None)  # one chunk per rank: the plain 1F1B schedule
        if self.zero_stage is None:
            object.__setattr__(self, "zero_stage", 1 if self.distributed_optimizer else 0)
        elif self.zero_stage not in ZERO_STAGES:
            raise ValueError(f"zero_stage must be one of 0, 1, 2, 3, got {self.zero_stage!r}")
        elif self.distributed_optimizer and self.zero_stage == 0:
            raise ValueError("distributed_optimizer is ZeRO stage 1: give zero_stage >= 1 or drop it")
        object.__setattr__(self, "distributed_optimizer", self.zero_stage >= 1)
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        for name in ("tp", "pp", "dp", "micro_batch_size", "cp", "ep", "etp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if (self.tp * self.cp * self.dp) % (self.ep * self.etp):
            raise ValueError(f"etp {self.etp} x ep {self.ep} must divide tp x cp x dp = {self.tp * self.cp * self.dp} "
                             f"(the expert layers fold onto those ranks): choose ep x etp among its divisors")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"the planner models the schedules {', '.join(SCHEDULES)} (not yet {self.schedule!r})")
        if self.schedule == "zb-h1" and self.vpp:
            raise ValueError(f"the zb-h1 schedule runs one model chunk per rank: vpp {self.vpp} is for 1f1b")
        if self.schedule in V_SCHEDULES and (self.pp == 1 or self.vpp != 2):
            raise ValueError(f"the {self.schedule} schedule places two chunks per rank in a V: it needs pp > 1 and "
                             f"vpp 2 (pp {self.pp}, vpp {self.vpp or 1})")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {self.recompute!r}")

    @property
    def v_shape(self) -> bool:
        """Whether the chunks sit in a V (zb-v): chunk 1 of pipeline rank r is virtual stage 2p-1-r."""
        return self.schedule in V_SCHEDULES

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def dp_cp(self) -> int:
        """The ranks gradients are reduced and optimizer states sharded over: CP ranks hold the
        same parameters, so they join DP (`get_data_parallel_group(with_context_parallel=True)`)."""
        return self.dp * self.cp

    @property
    def edp(self) -> int:
        """Expert-data-parallel size: the copies of one expert shard, over which expert gradients
        are reduced and (ZeRO-1/2) sharded."""
        return self.tp * self.cp * self.dp // (self.ep * self.etp)

    @property
    def v(self) -> int:
        return self.vpp or 1

    def short(self) -> str:
        parts = [f"tp {self.tp}"] + ([f"cp {self.cp}"] if self.cp > 1 else []) + [f"pp {self.pp}", f"dp {self.dp}"]
        if self.vpp:
            parts.append(f"vpp {self.vpp}")
        if self.ep > 1 or self.etp != self.tp:
            parts.append(f"ep {self.ep} etp {self.etp}")
        parts += [f"mb {self.micro_batch_size}", f"recompute {self.recompute}"]
        if self.sequence_parallel:
            parts.append("sp")
        if self.zero_stage == 1:
            parts.append("dist-opt")
        elif self.zero_stage:
            parts.append(f"zero {self.zero_stage}")
        if self.schedule != "1f1b":
            parts.append(self.schedule)
        return " ".join(parts)


@dataclass(frozen=True)
class Run:
    """What one training run asks for besides the model shape and the layout."""
    global_batch_size: int
    seq_length: int
    dtype: str = "bf16"  # bf16 | fp16 | fp32: the model dtype (masters are always fp32)
    ddp_bucket_size: int = 40_000_000  # --ddp-bucket-size
    # sdpa: fused attention stores no s^2 matrices; torch and fused (softmax kernel) store them
    attention_backend: str = "sdpa"
    pipeline_layers: tuple | None = None  # --pipeline-layers, explicit layer count per virtual stage
    recompute_method: str = "uniform"
    recompute_num_layers: int | None = None
    grad_reduce_dtype: str = "fp32"  # --grad-reduce-dtype: at ZeRO stages 2-3 also the stored gradients' dtype
    zero_reshard_after_forward: bool = True  # --zero-reshard-after-forward (stage 3)
    zero_keep_params_for_step: bool = False  # --zero-keep-params-for-step (stage 3)
    # --local-sgd-interval H (0: off): DP replicas reduce no gradients; every H steps an all-reduce of
    # the pseudo-gradients in outer_grad_dtype (per fragment with streaming), hidden when async.
    local_sgd_interval: int = 0
    local_sgd_fragments: int = 1
    outer_grad_dtype: str = "fp32"
    local_sgd_async: bool = False
    fp8_layers: int = 0  # --fp8-format: transformer layers whose GEMMs run in FP8 (megalite.tools.plan.fp8)
    # Overlaps the planner predicts (exposed.py): --tp-comm-overlap (under sequence parallelism), and
    # --overlap-moe-expert-parallel-comm (one micro-batch's all-to-alls behind another's backward)
    tp_comm_overlap: bool = False
    tp_comm_overlap_splits: int = 1  # --tp-comm-overlap-splits: pieces a sequence shard (exposed.tp_exposure)
    overlap_moe_ep_comm: bool = False
    overlap_param_gather: bool = False  # ZeRO stages 1-2: the update's gathers behind the next forward (gather_play)
    moe_dispatch_chunks: int = 1  # --moe-dispatch-chunks: a MoE layer's exchanges in groups of experts (exposed.py)
    delay_wgrad_compute: bool = False  # --delay-wgrad-compute: weight gradients while exchanges fly (pair_play)
    # --pipeline-extra-warmup: one more forward ahead on every stage but the last, where the layout's
    # schedule has it (1f1b with one chunk a rank and no pairs, zb-h1: `extra_warmup_of`)
    pipeline_extra_warmup: int = 0
    # --optimizer muon (None: AdamW): Muon's matrices keep one fp32 moment, and each step orthogonalizes
    # them (megalite.tools.plan.muon) as --muon-tp-mode says, in --muon-num-ns-steps steps
    muon_tp_mode: str | None = None
    muon_ns_steps: int = 5
    exp_avg_dtype: str = "fp32"  # --exp-avg-dtype / --exp-avg-sq-dtype: Adam's moments as stored (fp32, bf16)
    exp_avg_sq_dtype: str = "fp32"

    @property
    def adam_moment_bytes(self) -> int:
        return sum(2 if d == "bf16" else 4 for d in (self.exp_avg_dtype, self.exp_avg_sq_dtype))

    def __post_init__(self):
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.grad_reduce_dtype not in ("fp32", "bf16"):
            raise ValueError(f"grad_reduce_dtype must be fp32 or bf16, got {self.grad_reduce_dtype!r}")
        if self.attention_backend not in ("sdpa", "fused", "torch"):
            raise ValueError(f"attention_backend must be sdpa, fused or torch, got {self.attention_backend!r}")
        for name in ("global_batch_size", "seq_length", "ddp_bucket_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.outer_grad_dtype not in ("fp32", "bf16"):
            raise ValueError(f"outer_grad_dtype must be fp32 or bf16, got {self.outer_grad_dtype!r}")
        h, f = self.local_sgd_interval, self.local_sgd_fragments
        if h < 0 or f < 1 or (h and h % f):
            raise ValueError(f"local_sgd_interval must be >= 0 and local_sgd_fragments >= 1 dividing it, got {h} "
                             f"and {f}")


def check_gpt(config: TransformerConfig) -> None:
    if config.layernorm_position != "pre":
        raise ValueError("the planner models megalite's GPT (pre-LayerNorm, tied embeddings); "
                         f"this config has layernorm_position={config.layernorm_position!r}")


def positions(config: TransformerConfig, seq_length: int) -> int:
    """Rows of the position embedding: the preset's, grown to the sequence length as
    `megalite.config.model_config` does."""
    return max(config.max_position_embeddings, seq_length)


# -------------------------------------------------------------------------------------------------
# Parameters: counted on megalite's own GPT stage, built on the meta device at tp = 1
# -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CountedParameter:
    numel: int  # at tp = 1
    tp_split: bool  # `tensor_model_parallel`: each TP rank holds numel // tp
    vocab_rows: bool  # word embedding or untied output layer: its rows are padded per tp (pad_vocab_size)
    tied: bool  # the tied word embedding: with pp > 1 its gradient bucket is deferred (summed over stages)
    expert: bool = False  # `expert_parallel`: whole experts over EP, each expert split over ETP
    part: int | None = None  # the part of its layer that holds it (the layer's children: norm, attention, MLP...)
    matrix: tuple[int, int] | None = None  # --optimizer muon's matrix (rows, cols) at tp 1, an expert's; None: AdamW's
    split_dim: int | None = None  # the matrix dim TP (experts: ETP) shards, 0 rows, 1 columns; None: replicated

    def per_rank(self, config: TransformerConfig, tp: int, ep: int = 1, etp: int | None = None) -> int:
        if self.expert:
            return self.numel // (ep * (tp if etp is None else etp))
        if self.vocab_rows:
            divisible = config.make_vocab_size_divisible_by
            width = self.numel // pad_vocab_size(config.vocab_size, 1, divisible)
            return pad_vocab_size(config.vocab_size, tp, divisible) // tp * width
        return self.numel // tp if self.tp_split else self.numel


@dataclass(frozen=True)
class StageParameters:
    """A GPT stage's parameters in definition order: those before its layers (embeddings), one
    layer's, those after (final norm). A MoE model's layers are of two kinds: `layer` is a dense
    one (a MoE one when every layer is), `moe_layer` a MoE one (None for a dense model)."""
    head: tuple[CountedParameter, ...]
    layer: tuple[CountedParameter, ...]
    tail: tuple[CountedParameter, ...]
    moe_layer: tuple[CountedParameter, ...] | None = None

    def layer_params(self, config: TransformerConfig, number: int) -> tuple[CountedParameter, ...]:
        """The parameters of global layer `number`."""
        return self.moe_layer if self.moe_layer is not None and config.is_moe_layer(number) else self.layer


class _ShapesOnly(TorchFunctionMode):
    """Every tensor made on the meta device and every in-place op on one (the initializations)
    skipped: a build that costs no memory and no time. (PyTorch's own module initializations,
    e.g. nn.Embedding's, call `normal_` on the meta tensor, which imports torch._dynamo: about a
    second of the planner's start.)"""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        target = next(iter([*args, *kwargs.values()]), None)
        if (name.endswith("_") and not name.endswith("__") and isinstance(target, torch.Tensor)
                and target.device.type == "meta"):
            return target
        if "device" in kwargs:
            kwargs = {**kwargs, "device": "meta"}
        return func(*args, **kwargs)


_STAGES: dict = {}


def stage_parameters(config: TransformerConfig, seq_length: int, pre: bool, post: bool) -> StageParameters:
    """The parameters of a GPT stage with the embedding (pre) and/or the final norm and output layer
    (post), as `megalite.models.GPTModel` builds them: counted on a one-layer stage on meta."""
    # Built alone at tp = 1: the shape only (sequence parallelism would need tp > 1).
    key = (repr(config), positions(config, seq_length), pre, post)
    if key not in _STAGES:
        # (the overlap and its pieces are options of SP's collectives: no parameters of their own)
        config = replace(config, max_position_embeddings=positions(config, seq_length), sequence_parallel=False,
                         tp_comm_overlap=False, tp_comm_overlap_splits=1)
        examples = example_layers(config)
        with torch.device("meta"), _ShapesOnly():
            model = GPTModel(config, pre, post, layer_numbers=examples, seed=0, device="meta")
        # The stage's own layers; multi-token prediction's layers (after the final norm) are the tail's
        layer_of = {id(p): m.layer_number for m in model.layers for p in m.parameters()}
        part_of = {id(p): k for m in model.layers for k, part in enumerate(m.children()) for p in part.parameters()}
        counted = [(layer_of.get(id(p)), CountedParameter(p.numel(), getattr(p, "tensor_model_parallel", False),
                                                          name in VOCAB_PARAMS, getattr(p, "tied_embedding", False),
                                                          getattr(p, "expert_parallel", False), part_of.get(id(p)),
                                                          *muon_matrix(p)))
                   for name, p in model.named_parameters()]
        first = next(i for i, (layer, _) in enumerate(counted) if layer is not None)
        last = max(i for i, (layer, _) in enumerate(counted) if layer is not None)
        params = [c for _, c in counted]
        kinds = [tuple(c for n, c in counted if n == number) for number in examples]
        moe = kinds[-1] if config.is_moe else None
        _STAGES[key] = StageParameters(tuple(params[:first]), kinds[0], tuple(params[last + 1:]), moe)
    return _STAGES[key]


def example_layers(config: TransformerConfig) -> list[int]:
    """Global numbers of one layer of each kind the model has: its first dense layer, then its
    first MoE layer (a stage of these is what gets counted)."""
    dense = next((i for i in range(config.num_layers) if not config.is_moe_layer(i)), None)
    moe = next((i for i in range(config.num_layers) if config.is_moe_layer(i)), None)
    return [i for i in (dense, moe) if i is not None]


def layer_numels(config: TransformerConfig, tp: int) -> list[int]:
    """One transformer layer's parameters on one TP rank, in definition order."""
    layer = stage_parameters(config, config.max_position_embeddings, False, False).layer
    return [c.per_rank(config, tp) for c in layer]


def rank_parameters(config: TransformerConfig, tp: int, pp: int, vpp: int | None, pp_rank: int,
                    seq_length: int, pipeline_layers=None, *, ep: int = 1, etp: int | None = None,
                    experts: bool | None = None, v_shape: bool = False) -> list[list[tuple[int, bool]]]:
    """(numel, deferred) of every parameter one rank holds, per model chunk, in definition order,
    as `megalite.models.GPTModel` builds them. deferred: the tied word embedding when pp > 1,
    which the gradient buffer keeps in a bucket of its own. Expert weights are split over ep x etp
    (etp None: tp); `experts` True keeps only them, False only the rest (megalite gives each its
    own buffer), None all. v_shape: the chunks sit in a V (zb-v), rank 0 holding the first and last."""
    check_gpt(config)
    chunks = []
    for stage, numbers in _rank_stages(config, pp, vpp, pp_rank, seq_length, pipeline_layers, v_shape):
        held = [*stage.head, *(x for n in numbers for x in stage.layer_params(config, n)), *stage.tail]
        chunks.append([(x.per_rank(config, tp, ep, etp), pp > 1 and x.tied) for x in held
                       if experts is None or x.expert == experts])
    return chunks


def _rank_stages(config: TransformerConfig, pp: int, vpp: int | None, pp_rank: int, seq_length: int,
                 pipeline_layers, v_shape: bool = False) -> list[tuple[StageParameters, range]]:
    """(the stage's parameters, its global layer numbers) for each model chunk of pipeline rank `pp_rank`."""
    v = vpp or 1
    counts = stage_layer_counts(config.num_layers, pp, vpp,
                                list(pipeline_layers) if pipeline_layers is not None else None)
    return [(stage_parameters(config, seq_length, vs == 0, vs == pp * v - 1), layers_of(counts, vs))
            for vs in (virtual_stage(pp, pp_rank, c, v_shape) for c in range(v))]


def rank_layer_numbers(config: TransformerConfig, pp: int, vpp: int | None, pp_rank: int,
                       pipeline_layers=None, v_shape: bool = False) -> list[range]:
    """The global layer numbers of each model chunk of pipeline rank `pp_rank`."""
    counts = stage_layer_counts(config.num_layers, pp, vpp,
                                list(pipeline_layers) if pipeline_layers is not None else None)
    return [layers_of(counts, virtual_stage(pp, pp_rank, c, v_shape)) for c in range(vpp or 1)]


def _rank_parameter_tags(config, pp, vpp, pp_rank, seq_length, pipeline_layers, experts, v_shape,
                         tag) -> list[list[int | None]]:
    """Aligned with `rank_parameters`: tag(layer of the chunk from 0, parameter) for every layer
    parameter, None for the embeddings, final norm and output layer."""
    def kept(params):
        return [x for x in params if experts is None or x.expert == experts]

    chunks = []
    for stage, numbers in _rank_stages(config, pp, vpp, pp_rank, seq_length, pipeline_layers, v_shape):
        tags = [tag(i, x) for i, n in enumerate(numbers) for x in kept(stage.layer_params(config, n))]
        chunks.append([None] * len(kept(stage.head)) + tags + [None] * len(kept(stage.tail)))
    return chunks


def rank_parameter_layers(config: TransformerConfig, tp: int, pp: int, vpp: int | None, pp_rank: int,
                          seq_length: int, pipeline_layers=None, *,
                          experts: bool | None = None, v_shape: bool = False) -> list[list[int | None]]:
    """Aligned with `rank_parameters`: for every parameter the transformer layer (of its chunk, from
    0) that holds it, None for the embeddings, final norm and output layer (ZeRO-3's units)."""
    return _rank_parameter_tags(config, pp, vpp, pp_rank, seq_length, pipeline_layers, experts, v_shape,
                                lambda layer, _: layer)


def rank_parameter_parts(config: TransformerConfig, tp: int, pp: int, vpp: int | None, pp_rank: int,
                         seq_length: int, pipeline_layers=None, *,
                         experts: bool | None = None, v_shape: bool = False) -> list[list[int | None]]:
    """Aligned with `rank_parameters`: for every layer parameter the part of its layer that holds it
    (`CountedParameter.part`), None outside the layers."""
    return _rank_parameter_tags(config, pp, vpp, pp_rank, seq_length, pipeline_layers, experts, v_shape,
                                lambda _, x: x.part)


def total_parameters(config: TransformerConfig, seq_length: int, mtp: bool = True) -> int:
    """Parameters of the whole model (one copy of the tied embedding, padded vocabulary at tp = 1);
    with its multi-token prediction modules unless `mtp` is False (the main model alone, as
    DeepSeek-V3's 671B counts it)."""
    if not mtp and config.mtp_num_layers:
        config = config.replace(mtp_num_layers=0)
    return sum(n for n, _ in rank_parameters(config, 1, 1, None, 0, seq_length)[0])


def active_parameters(config: TransformerConfig, seq_length: int, mtp: bool = True) -> int:
    """The parameters one token runs through: all but, in each MoE layer (multi-token prediction's
    included unless `mtp` is False), the experts its router does not choose
    (num_moe_experts - moe_router_topk of them)."""
    total = total_parameters(config, seq_length, mtp)
    if not config.is_moe:
        return total
    experts = sum(x.numel for x in stage_parameters(config, seq_length, False, False).moe_layer if x.expert)
    idle = experts // config.num_moe_experts * (config.num_moe_experts - config.moe_router_topk)
    moe_layers = sum(config.is_moe_layer(n) for n in range(config.num_layers + (config.mtp_num_layers if mtp else 0)))
    return total - idle * moe_layers


def extra_warmup_of(layout: Layout, run: Run) -> int:
    """The run's --pipeline-extra-warmup where the layout's schedule is built with it, else 0 (a
    search over layouts applies the option to those it fits)."""
    fits = is_one_chunk_program(layout.pp, layout.schedule, layout.vpp, run.overlap_moe_ep_comm)
    return run.pipeline_extra_warmup if fits else 0
