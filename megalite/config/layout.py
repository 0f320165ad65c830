"""The layout checked against the world size and the model, before anything starts: every rank
runs the same checks on the same configuration and ends with the same one-line message."""
from __future__ import annotations

from megalite.config.fields import in_user_spelling
from megalite.config.rules import check_sections
from megalite.config.run import RunConfig
from megalite.errors import UsageError
from megalite.models.config import TransformerConfig
from megalite.pipeline.partition import V_SCHEDULES, stage_layer_counts
from megalite.pipeline.programs import PAIRED_SCHEDULES


def _check_context_parallel(config: RunConfig, world_size: int, model: TransformerConfig) -> None:
    """--cp N: the ranks, the sequence's 2N chunks (causal load balancing), and what attends."""
    p, seq = config.parallel, config.model.seq_length
    tp, cp, pp = p.tp, p.cp, p.pp
    if world_size % (tp * cp * pp):
        raise UsageError(f"--tp {tp} x --cp {cp} x --pp {pp} = {tp * cp * pp} does not divide the number of ranks "
                         f"({world_size}): launch a multiple of {tp * cp * pp} ranks or change the sizes")
    if seq % (2 * cp):
        raise UsageError(f"--cp {cp} cuts each sequence into {2 * cp} chunks: --seq-length {seq} is not "
                         f"divisible by {2 * cp}; use a multiple of {2 * cp}")
    if p.sequence_parallel and (seq // cp) % tp:
        raise UsageError(f"--sequence-parallel with --cp {cp} needs each rank's {seq // cp} tokens "
                         f"divisible by --tp {tp}: change --seq-length")
    if config.model.attention_dropout:
        raise UsageError(f"--cp attends over ranks without attention dropout: drop --attention-dropout "
                         f"{config.model.attention_dropout} (hidden dropout is fine)")
    sizes = p.hierarchical_context_parallel_sizes
    a2a = cp if p.cp_comm_type == "a2a" else sizes[0] if p.cp_comm_type == "a2a+p2p" else 1
    if a2a > 1:
        heads = model.num_attention_heads // tp
        kv_heads = max(1, (model.num_query_groups or model.num_attention_heads) // tp)  # this rank's
        if heads % a2a or kv_heads % a2a:
            what = (f"--cp {cp}; use --cp-comm-type p2p" if p.cp_comm_type == "a2a" else
                    f"the all-to-all's {a2a} ranks; choose a smaller first --hierarchical-context-parallel-sizes")
            raise UsageError(f"--cp-comm-type {p.cp_comm_type} exchanges heads for sequence: this rank's {heads} "
                             f"attention heads (and its key/value groups) must be divisible by {what}")


def _check_hierarchy(p) -> None:
    """--cp-comm-type a2a+p2p and --hierarchical-context-parallel-sizes: together, their product --cp."""
    sizes, cp = p.hierarchical_context_parallel_sizes, p.cp
    if sizes is not None and len(sizes) != 2:  # (a configuration file's list: the command line takes two)
        raise UsageError(f"--hierarchical-context-parallel-sizes takes two sizes, the all-to-all's and the ring's, "
                         f"not {len(sizes)}: {sizes}")
    if sizes is not None and p.cp_comm_type != "a2a+p2p":
        raise UsageError(f"--hierarchical-context-parallel-sizes {' '.join(map(str, sizes))} splits --cp for "
                         f"--cp-comm-type a2a+p2p: add it, or drop the sizes")
    if p.cp_comm_type == "a2a+p2p":
        if sizes is None:
            raise UsageError("--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A2A P2P (the "
                             f"all-to-all's ranks and the ring's, their product --cp {cp})")
        if min(sizes) < 1 or sizes[0] * sizes[1] != cp:
            raise UsageError(f"--hierarchical-context-parallel-sizes {sizes[0]} {sizes[1]}: the product must be --cp "
                             f"{cp}, each at least 1")


def _check_batches(config: RunConfig, dp: int) -> None:
    t, p = config.training, config.parallel
    per_step = t.micro_batch_size * dp
    interleaved = p.vpp and p.vpp > 1 and p.pipeline_schedule not in V_SCHEDULES
    if t.global_batch_size % per_step:
        raise UsageError(f"--global-batch-size {t.global_batch_size} is not divisible by --micro-batch-size "
                         f"{t.micro_batch_size} x data-parallel size {dp} = {per_step}: use a multiple of {per_step}")
    if t.rampup_batch_size is not None:
        start, increment, _ = t.rampup_batch_size
        if start % per_step or increment % per_step:
            raise UsageError(f"--rampup-batch-size {start} {increment}: every batch of the ramp must be a multiple of "
                             f"--micro-batch-size {t.micro_batch_size} x data-parallel size {dp} = {per_step}")
        if interleaved and (start // per_step % p.pp or increment // per_step % p.pp):
            raise UsageError(f"--rampup-batch-size with the interleaved schedule (--vpp {p.vpp}): every batch of the "
                             f"ramp must hold a multiple of --pp ({p.pp}) micro-batches")
        if config.local_sgd.local_sgd_interval:
            raise UsageError("--rampup-batch-size with --local-sgd-interval is not supported: drop one")
        if p.pipeline_schedule == "dualpipev" and start // per_step < 2 * p.pp:
            raise UsageError(f"--rampup-batch-size {start} with --pipeline-schedule dualpipev: every batch of the ramp "
                             f"needs at least 2 x --pp = {2 * p.pp} micro-batches (of {per_step} samples)")
    if p.pipeline_schedule in ("zb-h1", *V_SCHEDULES) and config.model.torch_compile:
        raise UsageError(f"--pipeline-schedule {p.pipeline_schedule} splits each backward into input- and weight-gradient "
                         "passes outside compiled graphs, and --torch-compile keeps the weight gradients inside them: "
                         "drop one")
    micro_batches = t.global_batch_size // per_step
    if p.pipeline_schedule == "dualpipev" and micro_batches < 2 * p.pp:
        raise UsageError(f"--pipeline-schedule dualpipev needs at least 2 x --pp = {2 * p.pp} micro-batches per step "
                         f"({micro_batches} = --global-batch-size {t.global_batch_size} / (--micro-batch-size "
                         f"{t.micro_batch_size} x data-parallel size {dp})): raise --global-batch-size")
    if interleaved and micro_batches % p.pp:
        raise UsageError(
            f"the interleaved schedule (--vpp {p.vpp}) needs the micro-batches per step ({micro_batches} = "
            f"--global-batch-size {t.global_batch_size} / (--micro-batch-size {t.micro_batch_size} x "
            f"data-parallel size {dp})) to be a multiple of --pp ({p.pp}): raise --global-batch-size")


def _check_installed(config: RunConfig) -> None:
    """What the configuration needs installed or runnable on this machine."""
    if config.logging.tensorboard_dir:
        try:
            import torch.utils.tensorboard  # noqa: F401
        except ImportError:
            raise UsageError("--tensorboard-dir needs tensorboard: pip install 'megalite[tb]'") from None
    if config.optimizer.use_apex_adam:
        try:
            import apex.optimizers  # noqa: F401
        except ImportError:
            raise UsageError("--use-apex-adam needs NVIDIA apex built from source (the PyPI package named "
                             "'apex' is unrelated); drop the flag to use PyTorch's fused AdamW") from None
    m = config.model
    for flag, value in (("--attention-backend", m.attention_backend), ("--norm-backend", m.norm_backend)):
        if value == "fused":
            from megalite import ops
            status = ops.kernels_available()
            if not status:
                raise UsageError(f"{flag} fused needs megalite's CUDA kernels, which cannot run here: {status.reason}. "
                                 f"Use {flag} auto (or torch), or fix the cause")


def _check_experts(config: RunConfig, model: TransformerConfig, dp: int) -> None:
    """The expert layout against the dense one (parallel folding) and the model."""
    from megalite.parallel.state import expert_grid

    p = config.parallel
    ep, etp = p.expert_model_parallel_size, p.expert_tensor_parallel_size or p.tp
    try:
        expert_grid(p.tp, p.cp, dp, p.pp, ep, etp)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if model.num_moe_experts % ep:
        raise UsageError(f"--num-experts {model.num_moe_experts} is not divisible by --ep {ep}: choose --ep among "
                         f"its divisors")
    if model.moe_ffn_hidden_size % etp:
        raise UsageError(f"--moe-ffn-hidden-size {model.moe_ffn_hidden_size} is not divisible by --etp {etp}: "
                         f"choose --etp among its divisors")
    if model.add_bias_linear and etp > 1:  # fc2's bias would be added on every ETP rank (Megatron-Core asserts it)
        raise UsageError(f"experts with biases (the model's linear layers have them; --disable-bias-linear drops "
                         f"them) run at --etp 1, as Megatron-Core's: --etp {etp}" + (" (--etp defaults to --tp)"
                         if p.expert_tensor_parallel_size is None else "") + "; add --etp 1")
    if p.tp > 1 and not p.sequence_parallel:
        raise UsageError(f"mixture-of-experts layers at --tp {p.tp} need --sequence-parallel (each TP rank routes "
                         f"its own part of the sequence): add --sequence-parallel")
    if config.local_sgd.local_sgd_interval:
        _check_experts_under_local_sgd(model, p.tp * p.cp, ep, etp)
    _check_dispatch_chunks(config, model, ep)


def _check_dispatch_chunks(config: RunConfig, model: TransformerConfig, ep: int) -> None:
    chunks, flag = config.parallel.moe_dispatch_chunks, f"--moe-dispatch-chunks {config.parallel.moe_dispatch_chunks}"
    if chunks == 1:
        return
    local = model.num_moe_experts // ep
    why = ("the allgather dispatcher has no all-to-all to cut: use --moe-token-dispatcher-type alltoall"
           if model.moe_token_dispatcher_type == "allgather" else
           "at --ep 1 no rows travel: give --ep > 1" if ep == 1 else
           f"groups are of whole experts, and a rank holds {local}: give at most {local}" if chunks > local else
           "posts exchanges that the compiled layers do not trace here: drop --torch-compile"
           if config.model.torch_compile else None)
    if why:
        raise UsageError(f"{flag}: {why}")


def _check_experts_under_local_sgd(model: TransformerConfig, replica_ranks: int, ep: int, etp: int) -> None:
    """Local SGD's replicas share nothing between outer steps: the experts' all-to-all and every
    statistic of the router stay inside a replica (its TP x CP ranks)."""
    if replica_ranks % (ep * etp):
        raise UsageError(f"--local-sgd-interval keeps expert parallelism inside a replica: --etp {etp} x --ep {ep} "
                         f"must divide --tp x --cp ({replica_ranks}); choose --ep and --etp whose product divides it")
    if model.moe_router_load_balancing_type == "global_aux_loss":
        raise UsageError("--moe-router-load-balancing-type global_aux_loss counts tokens over every replica each "
                         "step, which --local-sgd-interval does not synchronize: use aux_loss or seq_aux_loss")
    if model.moe_router_enable_expert_bias:
        raise UsageError("--moe-router-enable-expert-bias moves the bias from the whole global batch's counts each "
                         "step, which --local-sgd-interval does not synchronize: drop one of them")


def _check_multi_token_prediction(config: RunConfig, model: TransformerConfig) -> None:
    depth, s = model.mtp_num_layers, config.model.seq_length
    if depth >= s:
        raise UsageError(f"--mtp-num-layers {depth} predicts past the --seq-length {s} tokens: use fewer MTP layers")
    if model.position_embedding_type == "learned_absolute" and config.parallel.pp > 1:
        raise UsageError("--mtp-num-layers with learned absolute positions needs --pp 1 (the last stage would need "
                         "the position table too): use rotary positions (--position-embedding-type rope) or --pp 1")


def validate(config: RunConfig, world_size: int, model: TransformerConfig, machine: bool = True) -> int:
    """Check the layout against the world and the model; return the data-parallel size. `machine`:
    also what this machine must have installed or be able to run (not for --print-config, which
    may run on a login node for a job elsewhere). Errors name flags as the command line spelled them."""
    try:
        return _validate(config, world_size, model, machine)
    except UsageError as e:
        raise UsageError(in_user_spelling(str(e), config.spelled)) from None


def _validate(config: RunConfig, world_size: int, model: TransformerConfig, machine: bool) -> int:
    check_sections(config)
    p, d = config.parallel, config.data_parallel
    tp, pp, cp = p.tp, p.pp, p.cp
    if world_size % tp:
        raise UsageError(f"--tp {tp} does not divide the number of ranks ({world_size}): "
                         f"use a --tp among the divisors of {world_size}, or launch a multiple of {tp} ranks")
    if world_size % (tp * pp):
        raise UsageError(f"--tp {tp} x --pp {pp} = {tp * pp} does not divide the number of ranks ({world_size}): "
                         f"launch a multiple of {tp * pp} ranks or change --tp/--pp")
    _check_hierarchy(p)
    if cp > 1:
        _check_context_parallel(config, world_size, model)
    dp = world_size // (tp * cp * pp)
    try:
        model.check_tensor_parallel(tp)
        stage_layer_counts(model.num_layers, pp, p.vpp, p.pipeline_layers)
        config.precision.fp8_layers(model.num_layers)  # --first-last-layers-bf16 must leave some
    except ValueError as e:
        raise UsageError(str(e)) from None
    if model.vocab_size < 2:
        raise UsageError(f"vocabulary size must be >= 2, got {model.vocab_size}")
    _check_batches(config, dp)
    if model.is_moe:
        _check_experts(config, model, dp)
    elif p.moe_dispatch_chunks > 1:
        raise UsageError("--moe-dispatch-chunks: for mixture-of-experts models only: add --num-experts N, or drop it")
    if machine:
        _check_installed(config)
    if d.zero_stage == 3 and config.model.torch_compile:
        raise UsageError("--zero-stage 3 gathers parameters in module hooks, which --torch-compile does not "
                         "trace here: drop --torch-compile, or use --zero-stage 2")
    if d.overlap_param_gather and d.zero_stage in (1, 2) and config.model.torch_compile:
        raise UsageError("--overlap-param-gather waits for each bucket's gather in module hooks, which "
                         "--torch-compile does not trace here: drop one of them")
    if p.overlap_moe_expert_parallel_comm:
        _check_overlapped_pairs(config)
    if p.delay_wgrad_compute:
        _check_delayed_weight_gradients(config)
    if p.sequence_parallel and config.model.seq_length % tp:
        raise UsageError(f"--sequence-parallel needs --seq-length ({config.model.seq_length}) divisible by "
                         f"--tp ({tp})")
    if model.mtp_num_layers:
        _check_multi_token_prediction(config, model)
    if model.fp32_residual_connection and not (config.precision.bf16 or config.precision.fp16):
        raise UsageError("--fp32-residual-connection keeps the residual stream in fp32 beside 16-bit weights: add "
                         "--bf16 or --fp16 (without them the stream is fp32 already)")
    if config.optimizer.optimizer in ("muon", "dist_muon"):
        _check_muon(config, model)
    if config.optimizer.qk_clip or config.optimizer.log_max_attention_logit:
        _check_max_logits(config, model)
    if config.local_sgd.local_sgd_interval and d.zero_stage:
        raise UsageError("--local-sgd-interval keeps each replica's whole optimizer state (nothing is sharded over "
                         "data parallelism): drop --use-distributed-optimizer / --zero-stage")
    return dp


def _check_muon(config: RunConfig, model: TransformerConfig) -> None:
    """Muon orthogonalizes whole matrices (or each TP rank's block of one)."""
    name = config.optimizer.optimizer
    if config.data_parallel.zero_stage:
        raise UsageError(f"--optimizer {name} orthogonalizes each weight matrix whole, which ZeRO's flat shards split "
                         f"(Megatron-LM refuses its distributed optimizer with Muon too; --optimizer dist_muon shards "
                         f"by whole layers): drop --use-distributed-optimizer / --zero-stage")
    if name == "dist_muon" and config.local_sgd.local_sgd_interval:
        raise UsageError("--optimizer dist_muon shards the optimizer over data parallelism, and --local-sgd-interval "
                         "keeps each replica's whole: use --optimizer muon, or drop --local-sgd-interval")
    tp, groups = config.parallel.tp, model.num_query_groups
    if config.optimizer.muon_tp_mode == "blockwise" and groups is not None and tp > groups:
        raise UsageError(f"--muon-tp-mode blockwise orthogonalizes each TP rank's heads' q, k and v, but with --tp "
                         f"{tp} above the {groups} query groups a rank holds part of a group: use --muon-tp-mode "
                         f"duplicated or distributed (one device's numbers), or a --tp that divides {groups}")


def _check_max_logits(config: RunConfig, model: TransformerConfig) -> None:
    """--qk-clip / --log-max-attention-logit record each head's largest logit in the local core."""
    flag = "--qk-clip" if config.optimizer.qk_clip else "--log-max-attention-logit"
    if config.parallel.cp > 1:
        raise UsageError(f"{flag} takes each head's largest logit from the whole sequence's scores, which context "
                         f"parallelism never holds in one place: drop --cp, or {flag}")
    if config.model.torch_compile:
        raise UsageError(f"{flag} records each head's largest logit outside the compiled layers: drop --torch-compile, "
                         f"or {flag}")
    if config.optimizer.qk_clip and not model.multi_latent_attention and (model.qk_layernorm or model.qk_l2_norm):
        norm = "--qk-l2-norm" if model.qk_l2_norm else "--qk-layernorm"
        raise UsageError(f"--qk-clip shrinks the query and key weights, but {norm} normalizes q and k after them, "
                         f"so the logits would stay and the weights shrink every step: drop --qk-clip (or {norm}); "
                         f"--log-max-attention-logit still logs the largest logit")


def _check_overlapped_pairs(config: RunConfig) -> None:
    """--overlap-moe-expert-parallel-comm runs two passes on two lanes (megalite.parallel.lanes):
    what would not give the numbers of running them one after the other is refused."""
    flag, p = "--overlap-moe-expert-parallel-comm", config.parallel
    if p.pipeline_schedule not in PAIRED_SCHEDULES:
        raise UsageError(f"{flag}: the {p.pipeline_schedule} schedule has no overlapped forward/backward pairs: "
                         "choose --pipeline-schedule 1f1b, interleaved or dualpipev")
    refused = [  # (the flag as the user names it, whether it is on, why the lanes cannot run with it)
        ("--recompute", config.model.recompute != "none",
         "a recomputing backward swaps the RNG and the forward lane draws from it"),
        ("--fp8-format", config.precision.fp8_format is not None,
         "FP8's scaling state is updated by forward and backward alike"),
        ("--zero-stage 3", config.data_parallel.zero_stage == 3,
         "ZeRO-3's parameter gathers are shared by the forward and the backward"),
        ("--torch-compile", config.model.torch_compile, "compiled layers' collectives cannot hand the turn over")]
    for name, on, reason in refused:
        if on:
            raise UsageError(f"{flag} with {name} is not supported ({reason}): drop one")


def _check_delayed_weight_gradients(config: RunConfig) -> None:
    """--delay-wgrad-compute does a backward's weight-gradient work while exchanges are in flight;
    where that work would launch collectives of its own, or is not split out, it is refused."""
    flag, why = "--delay-wgrad-compute", None
    if config.data_parallel.zero_stage >= 2:
        why = (f"--zero-stage {config.data_parallel.zero_stage} reduce-scatters each backward's gradients as they "
               "arrive, so work moved into a wait would reorder a rank's collectives: use --zero-stage 0 or 1")
    elif config.model.torch_compile:
        why = "compiled layers keep their weight gradients inside the backward: drop --torch-compile"
    if why:
        raise UsageError(f"{flag}: {why}")
