"""Which layout: every valid one of a cluster, predicted and ranked (`plan`); or one requested
layout checked (`check_layout`; megalite.training.plan_check applies it to a run's configuration)."""
from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

from megalite.models.config import TransformerConfig
from megalite.pipeline.partition import V_SCHEDULES, stage_layer_counts
from megalite.tools.plan.inputs import GIB, RECOMPUTE, SCHEDULES, ZERO_STAGES, Cluster, Layout, Run, check_gpt
from megalite.tools.plan.predict import Prediction, predict, stage_that_makes_it_fit, with_zero_stage

__all__ = [  # with the two that moved to predict.py
    "PlanResult",
    "Reject",
    "Rejection",
    "SearchSpace",
    "check_layout",
    "divisors",
    "expert_sizes",
    "local_sgd_of",
    "plan",
    "stage_that_makes_it_fit",
    "with_zero_stage",
]


def divisors(n: int) -> list[int]:
    small = [i for i in range(1, math.isqrt(n) + 1) if n % i == 0]
    return sorted(set(small + [n // i for i in small]))


@dataclass
class Rejection:
    """Layouts refused for one reason: how many, and one example."""
    count: int
    example: str
    prediction: Prediction | None = None  # "does not fit": the layout needing the least memory


@dataclass
class PlanResult:
    """The layouts that fit, fastest first (indexable like a list), and why the others do not."""
    predictions: list  # fitting Predictions, by step time
    rejected: dict = field(default_factory=dict)  # reason kind -> Rejection
    evaluated: int = 0  # layouts whose memory and time were predicted
    closest: Prediction | None = None  # when nothing fits: the layout needing the least memory

    def __iter__(self):
        return iter(self.predictions)

    def __len__(self):
        return len(self.predictions)

    def __getitem__(self, i):
        return self.predictions[i]

    @property
    def best(self) -> Prediction | None:
        return self.predictions[0] if self.predictions else None

    def reject(self, kind: str, example: str) -> None:
        self.rejected.setdefault(kind, Rejection(0, example)).count += 1

    def add(self, pred: Prediction) -> None:
        self.evaluated += 1
        if pred.fits:
            self.predictions.append(pred)
            return
        example = f"{pred.layout.short()}: {pred.reason}"
        self.reject("does not fit", example)
        if self.closest is None or pred.peak_bytes < self.closest.peak_bytes:
            self.closest = pred
            self.rejected["does not fit"].example, self.rejected["does not fit"].prediction = example, pred


@dataclass(frozen=True)
class SearchSpace:
    """The values to try: every valid one where a size is None."""
    max_tp: int
    max_tp_is_node: bool  # the limit is the GPUs per node (not --max-tp)
    tp: int | None = None
    pp: int | None = None
    vpp: int | None = None
    micro_batch_size: int | None = None
    recompute: tuple = RECOMPUTE
    sequence_parallel: tuple = (False, True)
    zero_stage: tuple = ZERO_STAGES
    cp: int | None = None  # context-parallel size; None: every valid one
    ep: int | None = None  # MoE models: expert-parallel size; None: every divisor of the experts that fits
    etp: int | None = None  # MoE models: expert-tensor-parallel size; None: 1 and tp
    schedule: tuple = SCHEDULES  # pipeline schedules (zb-h1 where pp > 1 without vpp, zb-v/dualpipev with vpp 2)


def plan(config: TransformerConfig, cluster: Cluster, global_batch_size: int, seq_length: int | None = None, *,
         dtype: str = "bf16", ddp_bucket_size: int = 40_000_000, attention_backend: str = "sdpa",
         max_tp: int | None = None, tp: int | None = None, pp: int | None = None, vpp: int | None = None,
         micro_batch_size: int | None = None, recompute=RECOMPUTE, sequence_parallel=(False, True),
         distributed_optimizer=(False, True), zero_stage=None, grad_reduce_dtype: str = "fp32",
         cp: int | str | None = None, local_sgd: dict | None = None, ep: int | None = None,
         etp: int | None = None, pipeline_layers=None, schedule=SCHEDULES, fp8_layers: int = 0,
         overlap: dict | None = None, optimizer: dict | None = None) -> PlanResult:
    """Enumerate every valid layout of `cluster.gpus` GPUs (optionally restricted), predict each, and
    return those that fit, fastest first (the lowest ZeRO stage first at equal speed). max_tp
    defaults to the GPUs per node. zero_stage: a stage or stages to try; None: every stage, or
    with `distributed_optimizer` restricted, 1 (True) or 0 (False) as before stages 2-3. cp: the
    context-parallel size; "all": every one that divides the GPUs and the sequence; None: cp = 1,
    and every cp only when no cp = 1 layout fits (so that plans without context parallelism stay
    as they were, and long sequences get cp where it is what makes the model fit). local_sgd: Run's
    local-SGD fields (local_sgd_interval, local_sgd_fragments, outer_grad_dtype, local_sgd_async);
    with an interval, only ZeRO stage 0 (megalite refuses sharding with local SGD). ep, etp: a MoE
    model's expert-parallel and expert-tensor-parallel sizes; None: every ep dividing the experts
    and etp in (1, tp), with etp x ep dividing tp x cp x dp (a dense model: ep 1). pipeline_layers:
    megalite's --pipeline-layers, one layer count per virtual stage (pp x vpp of them; the layers
    need not divide evenly then), which fixes the pipeline depth. schedule: a pipeline schedule or
    schedules to try (zb-h1 only where pp > 1 and vpp 1, zb-v and dualpipev where pp > 1 and vpp 2: two
    chunks in a V; dualpipev with at least 2 x pp micro-batches). overlap: Run's overlap options
    (tp_comm_overlap, tp_comm_overlap_splits, overlap_moe_ep_comm, overlap_param_gather, moe_dispatch_chunks,
    pipeline_extra_warmup, delay_wgrad_compute). optimizer: Run's Muon fields (muon_of), with which only ZeRO
    stage 0 (megalite refuses sharding with Muon)."""
    if cp is None:
        result = plan(config, cluster, global_batch_size, seq_length, dtype=dtype, ddp_bucket_size=ddp_bucket_size,
                      attention_backend=attention_backend, max_tp=max_tp, tp=tp, pp=pp, vpp=vpp,
                      micro_batch_size=micro_batch_size, recompute=recompute, sequence_parallel=sequence_parallel,
                      distributed_optimizer=distributed_optimizer, zero_stage=zero_stage,
                      grad_reduce_dtype=grad_reduce_dtype, cp=1, local_sgd=local_sgd, ep=ep, etp=etp,
                      pipeline_layers=pipeline_layers, schedule=schedule, fp8_layers=fp8_layers, overlap=overlap,
                      optimizer=optimizer)
        if result.best is not None or cluster.gpus == 1:
            return result
        cp = "all"
    if cp != "all" and (not isinstance(cp, int) or cp < 1):
        raise ValueError(f"cp must be a context-parallel size >= 1, \"all\" or None, got {cp!r}")
    check_gpt(config)
    if not config.is_moe and (ep or 1) > 1:
        raise ValueError(f"ep {ep} is for mixture-of-experts models only: this model has no experts (drop ep)")
    explicit = tuple(pipeline_layers) if pipeline_layers is not None else None
    if explicit is not None:  # the split fixes the pipeline depth; megalite's own checks
        pp = pp or max(1, len(explicit) // (vpp or 1))
        stage_layer_counts(config.num_layers, pp, vpp, list(explicit))
    run = Run(global_batch_size, seq_length or config.max_position_embeddings, dtype, ddp_bucket_size,
              attention_backend, explicit, grad_reduce_dtype=grad_reduce_dtype, fp8_layers=fp8_layers,
              **(local_sgd or {}), **(overlap or {}), **(optimizer or {}))
    if run.local_sgd_interval or run.muon_tp_mode:
        zero_stage, distributed_optimizer = 0, (False,)
    space = SearchSpace(max_tp or cluster.gpus_per_node, (max_tp or cluster.gpus_per_node) == cluster.gpus_per_node,
                        tp, pp, vpp, micro_batch_size, _values(recompute, str), _values(sequence_parallel, bool),
                        _stages(zero_stage, _values(distributed_optimizer, bool)), None if cp == "all" else cp, ep, etp,
                        _schedules(schedule))
    result = PlanResult([])
    for layout in _layouts(config, cluster.gpus, run, space, result.reject):
        result.add(predict(config, layout, cluster, run=run))
    result.predictions.sort(key=lambda x: (x.step_time, x.layout.zero_stage, x.peak_bytes))
    if result.predictions:
        result.closest = None
    return result


def _values(choice, kind: type) -> tuple:
    return (choice,) if isinstance(choice, kind) else tuple(choice)


def _schedules(schedule) -> tuple:
    schedules = _values(schedule, str)
    bad = [x for x in schedules if x not in SCHEDULES]
    if bad or not schedules:
        raise ValueError(f"schedule must be among {', '.join(SCHEDULES)}, got {bad[0] if bad else 'none'!r}")
    return schedules


def _stages(zero_stage, distributed_optimizer: tuple) -> tuple:
    """The ZeRO stages to try: those given, else all, or the old keyword's 0 / 1."""
    if zero_stage is None:
        if set(distributed_optimizer) == {False, True}:
            return ZERO_STAGES
        return tuple(sorted(int(x) for x in distributed_optimizer))
    stages = _values(zero_stage, int)
    bad = [x for x in stages if x not in ZERO_STAGES]
    if bad:
        raise ValueError(f"zero_stage must be among 0, 1, 2, 3, got {bad[0]!r}")
    if set(distributed_optimizer) != {False, True} and any((x >= 1) not in distributed_optimizer for x in stages):
        raise ValueError(f"zero stages {stages} disagree with distributed_optimizer={distributed_optimizer}: "
                         f"the distributed optimizer is stage 1 and every stage above it")
    return tuple(sorted(stages))


Reject = Callable[[str, str], None]


def _layouts(config: TransformerConfig, N: int, run: Run, space: SearchSpace, reject: Reject) -> Iterator[Layout]:
    """Every layout of N GPUs megalite accepts for this model and batch; the others reported to
    `reject` where they fail (a tp value, a (tp, pp) pair, or one full layout)."""
    if space.tp is not None and N % space.tp:
        reject("tp does not divide gpus", f"tp {space.tp} does not divide the {N} GPUs")
    for t in divisors(N):
        if (space.tp is not None and t != space.tp) or not _tp_is_valid(config, t, space, reject):
            continue
        if space.cp is not None and (N // t) % space.cp:
            reject("tp x cp does not divide gpus", f"tp {t} x cp {space.cp} does not divide the {N} GPUs")
        for c in divisors(N // t):
            if (space.cp is not None and c != space.cp) or not _cp_is_valid(c, run, reject):
                continue
            yield from _layouts_of_tp_cp(config, t, c, N, run, space, reject)


def _cp_is_valid(c: int, run: Run, reject: Reject) -> bool:
    """megalite's --cp rules that do not depend on tp (config.layout._check_context_parallel; the
    planner models GPT only, so BERT's refusal never applies)."""
    if c > 1 and run.seq_length % (2 * c):
        reject("seq % 2cp", f"cp {c} cuts each sequence into {2 * c} chunks: seq length {run.seq_length} "
                            f"is not divisible by {2 * c}")
        return False
    return True


def _layouts_of_tp_cp(config: TransformerConfig, t: int, c: int, N: int, run: Run, space: SearchSpace,
                      reject: Reject) -> Iterator[Layout]:
    L, B = config.num_layers, run.global_batch_size
    rest = N // (t * c)
    cp_part = f" x cp {c}" if c > 1 else ""
    if space.pp is not None and rest % space.pp:
        reject("tp x pp does not divide gpus", f"tp {t}{cp_part} x pp {space.pp} does not divide the {N} GPUs")
    for p in divisors(rest):
        if space.pp is not None and p != space.pp:
            continue
        even = run.pipeline_layers is None  # an explicit split (of pp stages) takes any layer counts
        if even and p > L:
            reject("pp > layers", f"pp {p} exceeds the {L} layers")
            continue
        if even and L % p:
            reject("layers % pp", f"layers {L} not divisible by pp {p}")
            continue
        d = rest // p
        if B % d:
            reject("batch % dp", f"global batch {B} not divisible by dp {d} (tp {t}{cp_part} pp {p})")
            continue
        yield from _layouts_of_grid(config, t, p, d, run, space, reject, c)


def _tp_is_valid(config: TransformerConfig, t: int, space: SearchSpace, reject: Reject) -> bool:
    if t > space.max_tp:
        reject("tp > gpus per node", f"tp {t} exceeds {space.max_tp} GPUs per node" if space.max_tp_is_node
               else f"tp {t} exceeds --max-tp {space.max_tp}")
        return False
    if config.num_attention_heads % t:
        reject("heads % tp", f"heads {config.num_attention_heads} not divisible by tp {t}")
        return False
    if config.ffn_hidden_size % t:
        reject("ffn % tp", f"ffn hidden size {config.ffn_hidden_size} not divisible by tp {t}")
        return False
    try:  # everything else the model refuses at this tp (grouped-query attention's groups)
        replace(config, sequence_parallel=False).check_tensor_parallel(t)
    except ValueError as e:
        reject("model vs tp", str(e))
        return False
    return True


def _layouts_of_grid(config: TransformerConfig, t: int, p: int, d: int, run: Run, space: SearchSpace,
                     reject: Reject, c: int = 1) -> Iterator[Layout]:
    """The layouts of one (tp, pp, dp): interleaving, micro-batch, recomputation, sequence
    parallelism and the ZeRO stage."""
    B, s = run.global_batch_size, run.seq_length
    vpps = [None] + ([x for x in divisors(config.num_layers // p) if x > 1] if p > 1 else [])
    if run.pipeline_layers is not None:
        vpps = [space.vpp if space.vpp and space.vpp > 1 else None]
    elif space.vpp is not None:
        vpps = [x for x in vpps if (x or 1) == space.vpp]
    for b in divisors(B // d):
        if space.micro_batch_size is not None and b != space.micro_batch_size:
            continue
        m = B // (d * b)
        for v in vpps:
            # 1f1b (interleaved with vpp), zb-h1 at one chunk per rank, zb-v at two in a V
            schedules = [x for x in space.schedule if x == "1f1b" or (p > 1 and (v == 2 if x in V_SCHEDULES
                                                                                  else not v))]
            if not schedules:
                reject("zb: pp 1 or vpp", f"zb-h1 needs pp > 1 and one chunk per rank, zb-v pp > 1 and two "
                                          f"(pp {p}, vpp {v or 1})")
                continue
            if v and m % p and "1f1b" in schedules:  # the interleaved schedule's rule; a V has none
                reject("interleaved: m % pp", f"vpp {v} needs the micro-batches per step ({m}, mb {b} "
                                              f"tp {t} pp {p} dp {d}) to be a multiple of pp {p}")
                schedules.remove("1f1b")
            if "dualpipev" in schedules and m < 2 * p:
                reject("dualpipev: m < 2 pp", f"dualpipev needs at least 2 x pp = {2 * p} micro-batches per step "
                                              f"({m}, mb {b} tp {t} pp {p} dp {d})")
                schedules.remove("dualpipev")
            if not schedules:
                continue
            for rc in space.recompute:
                for sp in space.sequence_parallel:
                    if sp and t == 1:
                        continue
                    if sp and s % t:
                        reject("seq % tp", f"sequence parallelism needs seq length {s} divisible by tp {t}")
                        continue
                    if sp and (s // c) % t:
                        reject("seq / cp % tp", f"sequence parallelism with cp {c} needs each rank's {s // c} "
                                                f"tokens divisible by tp {t}")
                        continue
                    if config.is_moe and t > 1 and not sp:
                        reject("moe: tp needs sp", f"mixture-of-experts layers at tp {t} need sequence parallelism")
                        continue
                    for stage in space.zero_stage:
                        for e, et in expert_sizes(config, t, c, d, space, reject, bool(run.local_sgd_interval)):
                            if stage and d * c == 1 and t // (e * et) == 1 and 0 in space.zero_stage:
                                continue  # nothing to shard at dp x cp = 1 (and edp = 1): stage 0 at best
                            for sched in schedules:
                                yield Layout(t, p, d, v, b, rc, sp, stage >= 1, stage, c, e, et, sched)


def expert_sizes(config: TransformerConfig, t: int, c: int, d: int, space: SearchSpace,
                 reject: Reject, local_sgd: bool = False) -> list[tuple[int, int]]:
    """The (ep, etp) to try on a (tp, cp, dp) grid: for a dense model (1, tp); for a MoE model every
    ep dividing the experts and etp in (1, tp) (or those asked for) that megalite accepts: etp x ep
    dividing tp x cp x dp (under local SGD, tp x cp: the experts inside a replica), etp dividing the
    expert width."""
    if not config.is_moe:
        return [(1, t)]
    ranks = t * c * d
    eps = [space.ep] if space.ep is not None else divisors(config.num_moe_experts)
    etps = [space.etp] if space.etp is not None else sorted({1, t})
    out = []
    for e in eps:
        for et in etps:
            if config.num_moe_experts % e:
                reject("experts % ep", f"experts {config.num_moe_experts} not divisible by ep {e}")
            elif config.moe_ffn_hidden_size % et:
                reject("expert width % etp", f"expert width {config.moe_ffn_hidden_size} not divisible by etp {et}")
            elif config.add_bias_linear and et > 1:
                reject("expert biases need etp 1", f"experts with biases run at etp 1, not {et}")
            elif ranks % (e * et):
                if space.ep is not None or space.etp is not None:
                    reject("etp x ep vs tp x cp x dp", f"etp {et} x ep {e} does not divide tp {t} x cp {c} x dp {d}")
            elif local_sgd and (t * c) % (e * et):
                reject("local sgd: experts cross replicas", f"local SGD keeps etp {et} x ep {e} inside a replica "
                                                            f"(tp {t} x cp {c})")
            else:
                out.append((e, et))
    return out


def check_layout(config: TransformerConfig, *, tp: int = 1, pp: int = 1, dp: int = 1, vpp: int | None = None,
                 micro_batch_size: int = 1, global_batch_size: int, seq_length: int | None = None,
                 recompute: str | None = None, sequence_parallel: bool | None = None,
                 use_distributed_optimizer: bool = False, dtype: str = "bf16", gpu_memory_bytes: float,
                 cluster: Cluster | None = None, ddp_bucket_size: int = 40_000_000,
                 attention_backend: str | None = None, pipeline_layers=None, zero_stage: int | None = None,
                 grad_reduce_dtype: str = "fp32", zero_reshard_after_forward: bool = True,
                 zero_keep_params_for_step: bool = False, cp: int = 1,
                 local_sgd: dict | None = None, ep: int = 1, etp: int | None = None,
                 schedule: str = "1f1b", fp8_layers: int = 0, tp_comm_overlap: bool = False,
                 overlap_moe_ep_comm: bool = False, pipeline_extra_warmup: int = 0,
                 tp_comm_overlap_splits: int = 1, overlap_param_gather: bool = False,
                 moe_dispatch_chunks: int = 1, delay_wgrad_compute: bool = False,
                 optimizer: dict | None = None) -> tuple[bool, Prediction]:
    """(fits, prediction) for one layout; recompute / sequence_parallel / attention_backend default
    to the config's. gpu_memory_bytes overrides the cluster's memory. zero_stage None: 1 with
    use_distributed_optimizer, else 0; a stage >= 1 implies the distributed optimizer. ep, etp:
    the expert layout of a MoE model (etp None: tp). tp_comm_overlap, tp_comm_overlap_splits,
    overlap_moe_ep_comm, overlap_param_gather: the run's --tp-comm-overlap, --tp-comm-overlap-splits,
    --overlap-moe-expert-parallel-comm and --overlap-param-gather (what the exposed time assumes);
    moe_dispatch_chunks, delay_wgrad_compute: its --moe-dispatch-chunks and --delay-wgrad-compute;
    pipeline_extra_warmup: its --pipeline-extra-warmup (the pipeline's transfers and memory); optimizer:
    Run's Muon fields (megalite.tools.plan.muon.muon_of), None for AdamW."""
    gpus = tp * cp * pp * dp
    base = cluster or Cluster(gpus=gpus)
    cluster = replace(base, gpus=gpus, gpu_memory_gib=gpu_memory_bytes / GIB)
    layout = Layout(tp, pp, dp, vpp if vpp and vpp > 1 else None, micro_batch_size,
                    recompute or config.recompute,
                    config.sequence_parallel if sequence_parallel is None else sequence_parallel,
                    use_distributed_optimizer and zero_stage != 0, zero_stage, cp, ep, etp,
                    "1f1b" if schedule == "interleaved" else schedule)
    run = Run(global_batch_size, seq_length or config.max_position_embeddings, dtype, ddp_bucket_size,
              attention_backend or config.attention_backend,
              tuple(pipeline_layers) if pipeline_layers else None, config.recompute_method,
              config.recompute_num_layers, grad_reduce_dtype, zero_reshard_after_forward, zero_keep_params_for_step,
              fp8_layers=fp8_layers, tp_comm_overlap=tp_comm_overlap, tp_comm_overlap_splits=tp_comm_overlap_splits,
              overlap_moe_ep_comm=overlap_moe_ep_comm, overlap_param_gather=overlap_param_gather,
              moe_dispatch_chunks=moe_dispatch_chunks, pipeline_extra_warmup=pipeline_extra_warmup,
              delay_wgrad_compute=delay_wgrad_compute,
              **(local_sgd or {}), **(optimizer or {}))
    pred = predict(config, layout, cluster, run=run)
    return pred.fits, pred


def local_sgd_of(args) -> dict | None:
    """Run's local-SGD fields from the local_sgd section (or the planner's namespace); None when off."""
    if not args.local_sgd_interval:
        return None
    return {"local_sgd_interval": args.local_sgd_interval, "local_sgd_fragments": args.local_sgd_fragments,
            "outer_grad_dtype": args.outer_grad_dtype, "local_sgd_async": args.local_sgd_async}
