"""A run's pieces, built once: the layout and process groups, this rank's model chunks, the
gradient buffers and the optimizer."""
from __future__ import annotations

import datetime

import torch

from megalite import determinism, parallel
from megalite.models import compile_layers
from megalite.models.fp8 import enable_fp8
from megalite.config import lr_schedule_lengths, model_config, model_dtype, validate, weight_decay_steps
from megalite.optim import (ConstantLossScaler, DynamicLossScaler, LRSchedule, MegaliteOptimizer, ParamAndGradBuffer,
                            WeightDecaySchedule)
from megalite.optim.grads import SAME_RANK, is_expert
from megalite.optim.local_sgd import LocalSGD
from megalite.optim.low_precision_adam import adamw
from megalite.optim.optimizer import sgd
from megalite.optim.param_gather import attach_gather_waits
from megalite.parallel import host_heap
from megalite.parallel.context_parallel_hierarchy import initialize_hierarchy
from megalite.optim.zero import ShardedGradBuffer, ShardedParamBuffer, attach_unit_hooks, layer_units
from megalite.pipeline.partition import V_SCHEDULES, layers_of, stage_layer_counts, stage_rank, virtual_stage
from megalite.runtime import UsageError, init_distributed, say, select_device
from megalite.training.muon_setup import layer_wise_owners, use_muon
from megalite.training.qk_clip import QKClip
from megalite.training.task import Task


def set_tf32(enabled: bool) -> None:
    """TF32 tensor cores for fp32 matmuls and convolutions (Ampere and later): on by default, as the
    MFU of an fp32 run is reported against the TF32 peak. bf16/fp16 runs do not use it."""
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def set_bf16_reduction(reduced: bool) -> None:
    """cuBLAS may keep a bf16 GEMM's partial sums in bf16 (PyTorch's default, True); Megatron-LM's
    --disable-bf16-reduced-precision-matmul keeps them in fp32. Set by every run, so none inherits it."""
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = reduced


def _plan_warning(cfg, world_size: int) -> None:
    """--plan: the layout planner's prediction for this run, with a warning if it will not fit."""
    from megalite.training.plan_check import check_run

    memory = cfg.training.plan_gpu_memory_gib * 2 ** 30 if cfg.training.plan_gpu_memory_gib else None
    if memory is None and not torch.cuda.is_available():
        raise UsageError("--plan on a machine without GPUs needs --plan-gpu-memory-gib (the GPUs' memory)")
    try:
        fits, pred = check_run(cfg, world_size, gpu_memory_bytes=memory)
    except ValueError as e:
        say(f"megalite: --plan cannot model this run: {e}")
        return
    gib = pred.memory.total / 2 ** 30
    if fits:
        say(f"megalite: plan: this layout needs about {gib:.1f} GiB per GPU, a step about "
            f"{pred.time.total * 1e3:.0f} ms (see python -m megalite.tools.plan --explain)")
    else:
        say(f"megalite: warning: the planner predicts this layout will not fit: {pred.reason}. "
            f"`python -m megalite.tools.plan` lists layouts that do")


def setup(cfg, world_size: int):
    """Validate the layout, start the process groups, seed the RNG streams. Returns (model config,
    data-parallel size, device)."""
    device = select_device()  # first: validation may build the fused kernels on the current GPU
    if cfg.training.deterministic_mode:  # before NCCL and cuBLAS start: they read the environment once
        set_here = determinism.enable("nccl" if device.type == "cuda" else "gloo")
        if set_here:
            say(f"megalite: --deterministic-mode: set {', '.join(set_here)}")
    if device.type == "cpu" and cfg.parallel.overlap_moe_expert_parallel_comm:
        host_heap.share_one_heap()  # before gloo's threads: the forward lane's own heap costs page faults
    if device.type == "cpu" and cfg.parallel.delay_wgrad_compute:
        host_heap.keep_freed_memory()  # memory held until W runs, then freed: no fresh pages each micro-batch
    config = model_config(cfg)
    dp = validate(cfg, world_size, config)
    set_tf32(not cfg.precision.no_tf32)
    set_bf16_reduction(not cfg.precision.disable_bf16_reduced_precision_matmul)
    if cfg.training.plan:
        _plan_warning(cfg, world_size)
    device = init_distributed(cfg.parallel.distributed_timeout_minutes)
    parallel.initialize_model_parallel(cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.vpp,
                                       timeout=datetime.timedelta(minutes=cfg.parallel.distributed_timeout_minutes),
                                       context_parallel_size=cfg.parallel.cp,
                                       expert_model_parallel_size=cfg.parallel.expert_model_parallel_size,
                                       expert_tensor_parallel_size=cfg.parallel.expert_tensor_parallel_size)
    if cfg.parallel.cp_comm_type == "a2a+p2p":  # the all-to-all's groups and the ring's, inside each CP group
        initialize_hierarchy(cfg.parallel.hierarchical_context_parallel_sizes[0],
                             timeout=datetime.timedelta(minutes=cfg.parallel.distributed_timeout_minutes))
    # --data-parallel-random-init: Megatron-LM's offset of the runtime streams per DP rank (the weights
    # come from per-component generators, so every replica still starts alike)
    offset = 10 * parallel.get_data_parallel_rank() if cfg.training.data_parallel_random_init else 0
    parallel.model_parallel_manual_seed(cfg.training.seed + offset)
    return config, dp, device


def build_model_chunks(task: Task, config, cfg, device) -> list[torch.nn.Module]:
    """This rank's model chunks: one per virtual stage it runs (chunk c is virtual stage c*pp + r, or
    in a V, r then 2pp-1-r: `megalite.pipeline.partition.virtual_stage`)."""
    p, r, v = cfg.parallel.pp, parallel.get_pipeline_model_parallel_rank(), cfg.parallel.vpp or 1
    counts = stage_layer_counts(config.num_layers, p, cfg.parallel.vpp, cfg.parallel.pipeline_layers)
    v_shape = cfg.parallel.pipeline_schedule in V_SCHEDULES
    fp8_recipe, fp8_layers = cfg.precision.fp8(), cfg.precision.fp8_layers(config.num_layers)
    chunks = []
    for c in range(v):
        vs = virtual_stage(p, r, c, v_shape)
        chunks.append(task.build_model(config, cfg, device, pre_process=vs == 0,
                                       post_process=vs == p * v - 1, layer_numbers=layers_of(counts, vs)))
        enable_fp8(chunks[-1], fp8_recipe, fp8_layers)
        if cfg.model.torch_compile:
            # One region per chunk where no TP/CP collective runs inside it; else layer by layer.
            compile_layers(chunks[-1], whole=cfg.parallel.tp == 1 and cfg.parallel.cp == 1)
    return chunks


def tied_embedding_group(cfg):
    """The group over which the tied word embedding's gradient is summed: the first and last
    pipeline stage; `SAME_RANK` when they are two chunks of each pipeline rank 0 (a V: summed
    there); None when one stage holds both copies (no pipeline). An untied model marks no
    parameter tied (but for multi-token prediction's copy of the word embedding), so nothing is
    summed over it."""
    if cfg.parallel.pp == 1:
        return None
    return SAME_RANK if cfg.parallel.pipeline_schedule in V_SCHEDULES else parallel.get_embedding_group()


def loss_stage_rank(cfg) -> int:
    """The pipeline rank that holds the last virtual stage, and so the loss: the last rank, or in a V
    the first."""
    return stage_rank(cfg.parallel.pp, cfg.parallel.pp * (cfg.parallel.vpp or 1) - 1,
                      cfg.parallel.pipeline_schedule in V_SCHEDULES)


def build_optimizer(cfg, chunks) -> tuple[list[ParamAndGradBuffer], MegaliteOptimizer]:
    """Lay each chunk's parameters out in gradient buckets (ZeRO-3: one unit per layer) and build
    the optimizer over them."""
    dtype = model_dtype(cfg)
    tied_across_stages = tied_embedding_group(cfg) is not None
    stage = cfg.data_parallel.zero_stage

    def deferred(p):
        return tied_across_stages and getattr(p, "tied_embedding", False)

    if cfg.local_sgd.local_sgd_interval:
        # Local SGD: a replica's gradients are reduced only inside it (over CP, whose ranks hold the
        # same parameters); replicas meet in the outer step (megalite.optim.local_sgd).
        cp = cfg.parallel.cp
        reduce_group, reduce_size = (parallel.get_context_parallel_group(), cp) if cp > 1 else (None, 1)
    else:  # context-parallel ranks hold the same parameters: reduce and shard over DP x CP
        reduce_group = parallel.get_data_parallel_group(with_context_parallel=True)
        reduce_size = parallel.get_data_parallel_world_size(with_context_parallel=True)
    moe = config_is_moe(chunks)
    if cfg.local_sgd.local_sgd_interval:  # expert copies summed inside the replica only
        expert_group = parallel.get_expert_data_parallel_group_in_replica() if moe else None
        expert_size = parallel.get_expert_data_parallel_group_in_replica_size()
    else:
        expert_group = parallel.get_expert_data_parallel_group()
        expert_size = parallel.get_expert_data_parallel_world_size()
    buffers = []
    for index, chunk in enumerate(chunks):
        params = [p for p in chunk.parameters() if p.requires_grad]
        bf16_reduce = cfg.data_parallel.grad_reduce_dtype == "bf16"
        # Stages 2-3 keep gradients only as reduced shards: in bf16 when they are reduced in bf16
        # (the ZeRO paper's 2 + 2 + 12 bytes per parameter); below stage 2 they accumulate in fp32.
        grad_dtype = torch.bfloat16 if bf16_reduce and stage >= 2 else torch.float32
        common = dict(param_dtype=dtype, grad_dtype=grad_dtype, bucket_numel=cfg.data_parallel.ddp_bucket_size,
                      comm_dtype=torch.bfloat16 if bf16_reduce else None, deferred=deferred)
        # Expert weights (parallel folding) are copies over the expert-data-parallel group only:
        # a buffer of their own, reduced (and sharded) there.
        first = len(buffers)
        dense = [p for p in params if not is_expert(p)]
        experts = [p for p in params if is_expert(p)]
        if dense:
            buffers.append(_buffer(chunk, dense, stage, cfg, deferred, dict(common, dp_group=reduce_group,
                                                                            dp_size=reduce_size)))
        if experts:
            buffers.append(_buffer(chunk, experts, stage, cfg, deferred, dict(
                common, dp_group=expert_group, dp_size=expert_size, experts=True)))
        for buf in buffers[first:]:
            buf.chunk_index = index  # the chunk whose backward fills it
    if cfg.precision.fp8_param_gather:
        _gather_fp8_weights(chunks, buffers)
    prec, o = cfg.precision, cfg.optimizer
    if prec.fp16:
        scaler = ConstantLossScaler(prec.loss_scale) if prec.loss_scale is not None else DynamicLossScaler(
            prec.initial_loss_scale, prec.loss_scale_window, prec.hysteresis, prec.min_loss_scale)
    else:
        scaler = ConstantLossScaler()
    optimizer = MegaliteOptimizer(buffers, lr=o.lr, weight_decay=o.weight_decay, betas=(o.adam_beta1, o.adam_beta2),
                                  eps=o.adam_eps, distributed=cfg.data_parallel.use_distributed_optimizer,
                                  loss_scaler=scaler, use_apex=o.use_apex_adam,
                                  separate_embedding_lr=o.decoupled_lr is not None, moe=moe,
                                  owners=layer_wise_owners(chunks, buffers) if o.optimizer == "dist_muon"
                                  else None)
    if o.optimizer == "sgd":
        _use_plain_sgd(optimizer, o.lr, o.sgd_momentum)
    elif "bf16" in (o.exp_avg_dtype, o.exp_avg_sq_dtype) and o.optimizer == "adam":
        optimizer.inner = adamw(optimizer.plain_groups(), lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps,
                                exp_avg_dtype=o.exp_avg_dtype, exp_avg_sq_dtype=o.exp_avg_sq_dtype)
    if o.optimizer in ("muon", "dist_muon"):
        use_muon(optimizer, cfg, chunks)
    optimizer.qk_clip = None
    if o.qk_clip or o.log_max_attention_logit:
        optimizer.qk_clip = QKClip(chunks, optimizer, o.qk_clip_alpha, o.qk_clip_threshold, o.qk_clip)
        optimizer.after_update.append(optimizer.qk_clip)
    return buffers, optimizer


def _gather_fp8_weights(chunks, buffers) -> None:
    """--fp8-param-gather: ZeRO-3 gathers the weights of FP8 layers (delayed scaling) as FP8."""
    states = {id(m.weight): m.fp8 for c in chunks for m in c.modules()
              if getattr(m, "fp8", None) is not None and m.fp8.scaling is not None
              and not getattr(m.weight, "read_gathered_over_tp", False)}  # (GQA's kv when TP > groups)
    for buf in buffers:
        if isinstance(buf, ShardedParamBuffer):
            buf.use_fp8_param_gather(states)


def config_is_moe(chunks) -> bool:
    return any(getattr(c, "config", None) is not None and c.config.is_moe for c in chunks)


def _buffer(chunk, params, stage: int, cfg, deferred, common):
    if stage == 3:
        buf = ShardedParamBuffer(params, units=layer_units(chunk, params, deferred),
                                 reshard_after_forward=cfg.data_parallel.zero_reshard_after_forward,
                                 keep_params_for_step=cfg.data_parallel.zero_keep_params_for_step, **common)
        # One chunk a rank (V schedules set vpp 2; pairs with stage 3 are refused): the units at each
        # turn between its passes stay whole
        attach_unit_hooks(chunk, buf, keep_at_turns=(cfg.parallel.vpp or 1) == 1)
        return buf
    if stage == 2:
        buf = ShardedGradBuffer(params, **common)
    else:
        buf = ParamAndGradBuffer(params, reduce_scatter=stage == 1, **common)
    if stage >= 1 and cfg.data_parallel.overlap_param_gather:
        attach_gather_waits(chunk, buf)  # the update's gathers wait for the next forward
    return buf


def lr_schedules(cfg) -> tuple[LRSchedule, LRSchedule | None]:
    """The learning rate of each step, with lengths given in iterations or samples; and the word
    embedding and output layer's, of the same shape, with --decoupled-lr (else None)."""
    o = cfg.optimizer
    warmup, decay, wsd = lr_schedule_lengths(cfg)

    def schedule(peak: float, floor: float) -> LRSchedule:
        return LRSchedule(peak, floor, warmup, decay, o.lr_decay_style, wsd_decay_iters=wsd,
                          wsd_style=o.lr_wsd_decay_style, warmup_init=o.lr_warmup_init)

    decoupled = None if o.decoupled_lr is None else schedule(o.decoupled_lr, o.decoupled_min_lr if
                                                              o.decoupled_min_lr is not None else o.min_lr)
    return schedule(o.lr, o.min_lr), decoupled


def weight_decay_schedule(cfg) -> WeightDecaySchedule | None:
    """--weight-decay-incr-style linear or cosine: each step's weight decay, over the run's length in
    steps (--train-samples over the global batch); None for a constant one (--weight-decay)."""
    o = cfg.optimizer
    if o.weight_decay_incr_style == "constant":
        return None
    return WeightDecaySchedule(o.start_weight_decay, o.end_weight_decay, o.weight_decay_incr_style,
                               weight_decay_steps(cfg))


def _use_plain_sgd(optimizer: MegaliteOptimizer, lr: float, momentum: float = 0.0) -> None:
    """--optimizer sgd: the same masters, groups and weight decay under SGD (megalite.optim.optimizer.sgd:
    Megatron-LM's, with --sgd-momentum). Without momentum, SGD's weight decay (added to the gradient) is
    AdamW's decoupled one: p - lr * (g + wd * p)."""
    optimizer.inner = sgd(optimizer.plain_groups(), lr, momentum)


def build_local_sgd(cfg, optimizer: MegaliteOptimizer) -> LocalSGD | None:
    """--local-sgd-interval H: the outer loop over the optimizer's masters (as they are now: build it
    after a checkpoint's optimizer state is loaded), averaging over the data-parallel group."""
    if not cfg.local_sgd.local_sgd_interval:
        return None
    return LocalSGD([piece.master for piece in optimizer.pieces], interval=cfg.local_sgd.local_sgd_interval,
                    outer_lr=cfg.local_sgd.outer_lr, outer_momentum=cfg.local_sgd.outer_momentum,
                    group=parallel.get_data_parallel_group(),
                    comm_dtype=torch.bfloat16 if cfg.local_sgd.outer_grad_dtype == "bf16" else torch.float32,
                    asynchronous=cfg.local_sgd.local_sgd_async, fragments=cfg.local_sgd.local_sgd_fragments,
                    publish=optimizer.publish, warmup=cfg.local_sgd.local_sgd_warmup_iters)
