"""Command-line arguments of the pretraining entry points, and their validation.

Validation runs before any process group exists, from the world size torchrun announces, so a
bad layout ends every rank at once with the same one-line message.
"""
from __future__ import annotations

import argparse
import math

import torch

from megalite.models.config import PRESETS, TransformerConfig, preset
from megalite.pipeline.partition import stage_layer_counts
from megalite.runtime import UsageError, tell_torchrun, env_world


class ArgumentParser(argparse.ArgumentParser):
    """argparse that reports a bad command line once per node: under torchrun every rank parses the
    same argv, and N copies of the usage text bury the one line that matters."""

    def parse_args(self, args=None, namespace=None):
        """Parsed flags with the defaults that depend on other flags filled in here, once, so nothing
        later changes the namespace: --seq-length defaults to the preset's position count."""
        ns = super().parse_args(args, namespace)
        if getattr(ns, "seq_length", False) is None and getattr(ns, "model", None) in PRESETS:
            ns.seq_length = preset(ns.model).max_position_embeddings
        if hasattr(ns, "zero_stage"):
            self._zero_stage(ns)
        return ns

    def _zero_stage(self, ns) -> None:
        """--use-distributed-optimizer is --zero-stage 1; every stage >= 1 shards the optimizer."""
        if ns.use_distributed_optimizer and ns.zero_stage == 0:
            self.error("--use-distributed-optimizer is ZeRO stage 1: drop --zero-stage 0, or the flag")
        if ns.zero_stage is None:
            ns.zero_stage = 1 if ns.use_distributed_optimizer else 0
        ns.use_distributed_optimizer = ns.zero_stage >= 1
        if ns.zero_stage != 3 and (ns.zero_reshard_after_forward is not None or ns.zero_keep_params_for_step):
            self.error("--zero-reshard-after-forward and --zero-keep-params-for-step apply to --zero-stage 3")
        if ns.zero_reshard_after_forward is None:
            ns.zero_reshard_after_forward = True

    def error(self, message):
        if env_world()[2] != 0:
            raise SystemExit(2)
        tell_torchrun(f"{self.prog}: error: {message}")
        super().error(message)


def _on_off(value: str) -> bool:
    if value.lower() in ("true", "1", "yes", "on"):
        return True
    if value.lower() in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def build_parser(description: str, default_model: str) -> argparse.ArgumentParser:
    p = ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("parallelism")
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    g.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    g.add_argument("--vpp", type=int, default=None, help="virtual stages (model chunks) per pipeline rank")
    g.add_argument("--pipeline-layers", type=lambda v: [int(x) for x in v.split(",")], default=None,
                   help="explicit layer count per (virtual) pipeline stage, e.g. 3,5 (default: even split)")
    g.add_argument("--sequence-parallel", action="store_true", help="shard norms/dropout along the sequence (tp>1)")
    g.add_argument("--cp", type=int, default=1,
                   help="context-parallel size: each sequence split over N ranks (ring attention; "
                        "docs/context-parallel.md)")
    g.add_argument("--cp-comm-type", choices=["p2p", "a2a"], default="p2p",
                   help="context parallelism's attention: keys/values around a ring (p2p) or heads exchanged for "
                        "the sequence (a2a, DeepSpeed-Ulysses; heads and KV groups divisible by --cp)")

    g = p.add_argument_group("model")
    g.add_argument("--model", default=default_model, choices=sorted(PRESETS), help="model preset")
    g.add_argument("--num-layers", type=int, help="override the preset")
    g.add_argument("--hidden-size", type=int, help="override the preset")
    g.add_argument("--num-attention-heads", type=int, help="override the preset")
    g.add_argument("--ffn-hidden-size", type=int, help="override the preset (default 4 x hidden)")
    g.add_argument("--vocab-size", type=int, help="override the preset (synthetic data only)")
    g.add_argument("--seq-length", type=int, help="tokens per sample (default: the preset's positions)")
    g.add_argument("--hidden-dropout", type=float, default=0.0,
                   help="dropout on the residual stream (0 is usual for pretraining)")
    g.add_argument("--attention-dropout", type=float, default=0.0, help="dropout on attention probabilities")
    g.add_argument("--recompute", choices=["none", "selective", "full"], default="none",
                   help="activation recomputation")
    g.add_argument("--attention-backend", choices=["auto", "sdpa", "fused", "torch"], default="auto",
                   help="sdpa: PyTorch's fused attention (what auto picks); fused: score matmuls + megalite's "
                        "fused softmax kernel; torch: explicit softmax matrices")
    g.add_argument("--torch-compile", action="store_true",
                   help="torch.compile each transformer layer (fuses bias+GeLU, dropout+residual, norms)")
    g.add_argument("--normalization", type=str.lower, choices=["layernorm", "rmsnorm"], default=None,
                   help="the norm of every layer, LayerNorm or RMSNorm (default: the preset's)")
    g.add_argument("--norm-backend", choices=["auto", "fused", "torch"], default="auto",
                   help="LayerNorm / RMSNorm: megalite's fused kernel where it runs, else PyTorch (auto); fused: the "
                        "kernel or an error saying why it cannot run; torch: PyTorch ops")
    g.add_argument("--recompute-method", choices=["uniform", "block"], default="uniform")
    g.add_argument("--recompute-num-layers", type=int, default=None)

    _add_llama_flags(p.add_argument_group("model: Llama-family switches (default: the preset's)"))

    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+", metavar="[WEIGHT] PREFIX",
                   help="indexed dataset prefix, or weight-prefix pairs to blend (default: the embedded corpus)")
    g.add_argument("--tokenizer", help="SentencePiece .model file or Hugging Face tokenizer directory")
    g.add_argument("--split", default="969,30,1", help="train,valid,test proportions of the documents")
    g.add_argument("--mock-data", action="store_true", help="a deterministic synthetic token stream")

    g = p.add_argument_group("training")
    g.add_argument("--train-iters", type=int, default=100)
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument("--global-batch-size", type=int, default=16)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=1e-4)
    g.add_argument("--lr-warmup-iters", type=int, default=10)
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default: --train-iters")
    g.add_argument("--lr-decay-style", choices=["cosine", "linear", "constant"], default="cosine")
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--clip-grad", type=float, default=1.0, help="global gradient-norm clip (0: off)")
    g.add_argument("--optimizer", choices=["adam", "sgd"], default="adam",
                   help="the (inner) optimizer: AdamW, or plain SGD without momentum (same lr schedule and "
                        "decoupled weight decay; exact equivalences such as local SGD at H=1 hold for it)")

    g = p.add_argument_group("data parallelism and precision")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard fp32 master weights and Adam states over data-parallel ranks (ZeRO-1)")
    g.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=None,
                   help="shard over data-parallel ranks: 1 optimizer state (= --use-distributed-optimizer), "
                        "2 and gradients, 3 and parameters (gathered layer by layer); docs/optimizer.md")
    g.add_argument("--zero-reshard-after-forward", type=_on_off, default=None, metavar="{true,false}",
                   help="stage 3: free a layer's gathered parameters after its forward (true) or keep them "
                        "until its backward (false: one gather less per micro-batch, more memory)")
    g.add_argument("--zero-keep-params-for-step", action="store_true",
                   help="stage 3: gather each layer once per step and keep it across the step's micro-batches")
    g.add_argument("--ddp-bucket-size", type=int, default=40_000_000,
                   help="gradient elements per data-parallel reduction bucket")
    g.add_argument("--grad-reduce-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="dtype of the data-parallel gradient reduction (bf16 halves the traffic)")
    g.add_argument("--overlap-grad-reduce", type=_on_off, default=True, metavar="{true,false}",
                   help="ZeRO stages 0-1: start each bucket's reduction as soon as backward fills it (true), or "
                        "reduce every bucket after the last backward (false: to measure what the overlap saves)")
    precision = g.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true", help="bf16 model, fp32 master weights")
    precision.add_argument("--fp16", action="store_true", help="fp16 model, fp32 master weights, loss scaling")
    g.add_argument("--loss-scale", type=float, default=None, help="fp16: a fixed loss scale (default: dynamic)")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 16)
    g.add_argument("--loss-scale-window", type=int, default=1000, help="clean steps before the scale grows")
    g.add_argument("--hysteresis", type=int, default=2, help="overflowing steps before the scale shrinks")
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--no-tf32", action="store_true",
                   help="fp32 runs: full-FP32 matmuls instead of TF32 tensor cores (MFU then against the FP32 peak)")
    g.add_argument("--use-apex-adam", action="store_true", help="NVIDIA apex FusedAdam, if you built apex")

    _add_local_sgd_flags(p.add_argument_group("local SGD / DiLoCo (docs/local-sgd.md)"))
    g.add_argument("--plan", action="store_true",
                   help="before training, predict memory and step time of this layout and warn if it will not fit")
    g.add_argument("--plan-gpu-memory-gib", type=float, default=None,
                   help="GPU memory for --plan (default: this GPU's)")

    g = p.add_argument_group("checkpoints and exits")
    g.add_argument("--save", metavar="DIR", help="save checkpoints here")
    g.add_argument("--load", metavar="DIR", help="resume from the newest checkpoint here (at any layout)")
    g.add_argument("--save-interval", type=int, default=None, help="save every N iterations (and at the end)")
    g.add_argument("--save-async", action="store_true", help="write checkpoints in the background")
    g.add_argument("--no-load-optim", action="store_true", help="load weights only (fresh optimizer)")
    g.add_argument("--finetune", action="store_true",
                   help="with --load: take the weights only and start a new run (iteration 0, data from the "
                        "start, fresh optimizer and RNG streams)")
    g.add_argument("--exit-interval", type=int, default=None, help="save and exit at an iteration divisible by N")
    g.add_argument("--exit-duration-in-mins", type=float, default=None, help="save and exit after this long")
    g.add_argument("--no-exit-signal-handler", action="store_true",
                   help="do not turn SIGTERM/SIGUSR1 into save-and-exit")
    g.add_argument("--max-skipped-iters", type=int, default=30,
                   help="stop after this many iterations in a row with inf/NaN gradients")

    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=10)
    g.add_argument("--eval-interval", type=int, default=100, help="validate every N iterations (0: never)")
    g.add_argument("--eval-iters", type=int, default=4, help="global batches per validation")
    g.add_argument("--tensorboard-dir", help="write TensorBoard scalars here (needs megalite[tb])")
    g.add_argument("--no-progress-bar", action="store_true", help="no progress bar even on a terminal")
    g.add_argument("--metrics-file", help="JSON lines, one record per logged iteration")
    g.add_argument("--peak-tflops", type=float, default=None,
                   help="per-GPU peak for MFU (default: the datasheet dense peak of known GPUs for the dtype in use)")
    g.add_argument("--timeline", metavar="PATH", help="write a Chrome-trace timeline of all ranks (one row each)")
    g.add_argument("--timeline-iters", type=int, default=3, help="iterations recorded in the timeline")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    return p


def _add_local_sgd_flags(g) -> None:
    g.add_argument("--local-sgd-interval", type=int, default=0, metavar="H",
                   help="data-parallel replicas take H optimizer steps without reducing gradients across "
                        "replicas, then average their parameter deltas into an outer Nesterov-SGD step (0: off)")
    g.add_argument("--outer-lr", type=float, default=0.7, help="local SGD: the outer optimizer's learning rate")
    g.add_argument("--outer-momentum", type=float, default=0.9, help="local SGD: the outer Nesterov momentum")
    g.add_argument("--outer-grad-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="local SGD: dtype of the averaged pseudo-gradients on the wire")
    g.add_argument("--local-sgd-async", action="store_true",
                   help="local SGD: overlap each outer reduction with the next H inner steps and apply it one "
                        "round late")
    g.add_argument("--local-sgd-fragments", type=int, default=1, metavar="F",
                   help="local SGD (streaming): synchronize the parameters in F fragments, one every H/F steps")
    g.add_argument("--local-sgd-warmup-iters", type=int, default=0, metavar="N",
                   help="local SGD: plain data parallelism (gradients averaged every step) for the first N steps, "
                        "local SGD after (post-local SGD)")


def _check_local_sgd(args) -> None:
    """--local-sgd-interval H and its options: one line per bad combination."""
    h = getattr(args, "local_sgd_interval", 0) or 0
    if not h:
        given = (("--local-sgd-async", getattr(args, "local_sgd_async", False)),
                 ("--local-sgd-fragments", getattr(args, "local_sgd_fragments", 1) != 1),
                 ("--outer-grad-dtype bf16", getattr(args, "outer_grad_dtype", "fp32") != "fp32"),
                 ("--local-sgd-warmup-iters", getattr(args, "local_sgd_warmup_iters", 0) != 0))
        extras = [flag for flag, on in given if on]
        if extras:
            raise UsageError(f"{', '.join(extras)}: options of local SGD; add --local-sgd-interval H (or drop them)")
        return
    f = args.local_sgd_fragments
    if h % f:
        raise UsageError(f"--local-sgd-fragments {f} must divide --local-sgd-interval {h} (one fragment every H/F "
                         f"steps): use a divisor of {h}")
    if getattr(args, "zero_stage", 0) or args.use_distributed_optimizer:
        raise UsageError("--local-sgd-interval keeps each replica's whole optimizer state (nothing is sharded over "
                         "data parallelism): drop --use-distributed-optimizer / --zero-stage")


def _add_llama_flags(g) -> None:
    """Megatron-LM's names; each left unset keeps the preset's value."""
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope", "none"], default=None)
    g.add_argument("--rotary-base", type=float, help="rope: the base of the rotation frequencies")
    g.add_argument("--rotary-percent", type=float, help="rope: the fraction of each head's dims rotated")
    g.add_argument("--rope-scaling-factor", type=float, help="rope: Llama 3.1 frequency scaling factor")
    g.add_argument("--rope-low-freq-factor", type=float, help="rope scaling: low-frequency factor")
    g.add_argument("--rope-high-freq-factor", type=float, help="rope scaling: high-frequency factor")
    g.add_argument("--rope-original-max-position-embeddings", type=int,
                   help="rope scaling: the context length the model was first trained at")
    g.add_argument("--swiglu", action="store_true",
                   help="gated MLP with silu (ffn size: each of gate and up; default 8h/3 rounded down to 64)")
    g.add_argument("--group-query-attention", action="store_true", help="grouped-query attention (with "
                   "--num-query-groups)")
    g.add_argument("--num-query-groups", type=int, help="key/value heads (with --group-query-attention)")
    g.add_argument("--disable-bias-linear", action="store_true", help="no biases in the layers' linear maps")
    g.add_argument("--add-qkv-bias", action="store_true", help="query/key/value biases even without other biases")
    g.add_argument("--qk-layernorm", action="store_true", help="normalize every query and key head")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="an output layer of its own instead of the word embedding")
    g.add_argument("--norm-epsilon", type=float, help="epsilon of every LayerNorm / RMSNorm")


_ROPE_FIELDS = ("rotary_base", "rotary_percent", "rope_scaling_factor", "rope_low_freq_factor",
                "rope_high_freq_factor", "rope_original_max_position_embeddings")


def _llama_overrides(args) -> dict:
    """TransformerConfig fields the Llama-family flags set; flags not given set nothing."""
    has_groups, gqa = getattr(args, "num_query_groups", None) is not None, getattr(args, "group_query_attention", False)
    if has_groups != gqa:
        raise UsageError("--group-query-attention and --num-query-groups G go together: give both, or neither")
    numeric = {
        "position_embedding_type": "position_embedding_type", "rotary_base": "rotary_base",
        "rotary_percent": "rotary_percent", "rope_scaling_factor": "rope_scaling_factor",
        "rope_low_freq_factor": "rope_low_freq_factor", "rope_high_freq_factor": "rope_high_freq_factor",
        "rope_original_max_position_embeddings": "rope_original_max_position_embeddings",
        "num_query_groups": "num_query_groups", "layernorm_epsilon": "norm_epsilon",
    }
    out = {field: getattr(args, attr) for field, attr in numeric.items() if getattr(args, attr, None) is not None}
    switches = {
        "swiglu": dict(gated_linear_unit=True, activation="silu"), "disable_bias_linear": dict(add_bias_linear=False),
        "add_qkv_bias": dict(add_qkv_bias=True), "qk_layernorm": dict(qk_layernorm=True),
        "untie_embeddings_and_output_weights": dict(untie_embeddings_and_output_weights=True),
    }
    for attr, fields in switches.items():
        if getattr(args, attr, False):
            out.update(fields)
    return out


def model_config(args) -> TransformerConfig:
    """The model `args` describe (the preset with its overrides); reads `args`, never changes it."""
    check_numbers(args)
    overrides = {
        k: v for k, v in {
            "num_layers": args.num_layers, "hidden_size": args.hidden_size,
            "num_attention_heads": args.num_attention_heads, "ffn_hidden_size": args.ffn_hidden_size,
            "vocab_size": args.vocab_size, "normalization": args.normalization,
        }.items() if v is not None
    }
    overrides.update(_llama_overrides(args))
    if args.swiglu and args.ffn_hidden_size is None and not PRESETS[args.model].get("gated_linear_unit"):
        # As Megatron-LM sizes it: the gated MLP's three matrices hold about the parameters of a 4h
        # GeLU MLP's two (8h/3 each), rounded down to a multiple of 64.
        hidden = args.hidden_size or PRESETS[args.model]["hidden_size"]
        overrides["ffn_hidden_size"] = int(4 * hidden * 2 / 3 / 64) * 64
    try:
        config = preset(args.model, hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
                        sequence_parallel=args.sequence_parallel, recompute=args.recompute,
                        attention_backend="sdpa" if args.attention_backend == "auto" else args.attention_backend,
                        norm_backend=args.norm_backend,
                        recompute_method=args.recompute_method, recompute_num_layers=args.recompute_num_layers,
                        cp_comm_type=getattr(args, "cp_comm_type", "p2p"), **overrides)
    except ValueError as e:
        raise UsageError(str(e)) from None
    rope_flags = [f"--{k.replace('_', '-')}" for k in _ROPE_FIELDS if k in overrides]
    if rope_flags and config.position_embedding_type != "rope":
        raise UsageError(f"{', '.join(rope_flags)}: for rotary positions only, but this model's position embedding is "
                         f"{config.position_embedding_type}: add --position-embedding-type rope, or drop them")
    if args.seq_length is None:  # a namespace not from build_parser
        raise UsageError("--seq-length is not set")
    if args.seq_length > config.max_position_embeddings:
        config = config.replace(max_position_embeddings=args.seq_length)
    return config


def _check_context_parallel(args, world_size: int, config: TransformerConfig) -> None:
    """--cp N: the ranks, the sequence's 2N chunks (causal load balancing), and what attends."""
    tp, cp, pp = args.tp, args.cp, args.pp
    if world_size % (tp * cp * pp):
        raise UsageError(f"--tp {tp} x --cp {cp} x --pp {pp} = {tp * cp * pp} does not divide the number of ranks "
                         f"({world_size}): launch a multiple of {tp * cp * pp} ranks or change the sizes")
    if args.seq_length % (2 * cp):
        raise UsageError(f"--cp {cp} cuts each sequence into {2 * cp} chunks: --seq-length {args.seq_length} is not "
                         f"divisible by {2 * cp}; use a multiple of {2 * cp}")
    if args.sequence_parallel and (args.seq_length // cp) % tp:
        raise UsageError(f"--sequence-parallel with --cp {cp} needs each rank's {args.seq_length // cp} tokens "
                         f"divisible by --tp {tp}: change --seq-length")
    if args.attention_dropout:
        raise UsageError(f"--cp attends over ranks without attention dropout: drop --attention-dropout "
                         f"{args.attention_dropout} (hidden dropout is fine)")
    if args.cp_comm_type == "a2a":
        heads = config.num_attention_heads // tp
        kv_heads = max(1, (config.num_query_groups or config.num_attention_heads) // tp)  # this rank's
        if heads % cp or kv_heads % cp:
            raise UsageError(f"--cp-comm-type a2a exchanges heads for sequence: this rank's {heads} attention heads "
                             f"(and its key/value groups) must be divisible by --cp {cp}; use --cp-comm-type p2p")


def model_dtype(args) -> torch.dtype:
    """The dtype parameters and activations train in (the model is built, and masters kept, in fp32)."""
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


# (flag, attribute, rule, what the rule says). Rules see the value only when the flag is set (not
# None). Every number a run depends on is checked here, before anything starts, so a typo such as
# `--loss-scale 0` or `--recompute-num-layers -1` ends the run instead of silently meaning something else.
_POSITIVE_INT, _NON_NEGATIVE = (lambda v: v >= 1, "an integer >= 1"), (lambda v: v >= 0, ">= 0")
_POSITIVE, _PROBABILITY = (lambda v: v > 0, "> 0"), (lambda v: 0 <= v < 1, "in [0, 1)")
_NUMERIC_FLAGS = [
    ("--tp", "tp", _POSITIVE_INT), ("--pp", "pp", _POSITIVE_INT), ("--vpp", "vpp", _POSITIVE_INT),
    ("--num-layers", "num_layers", _POSITIVE_INT), ("--hidden-size", "hidden_size", _POSITIVE_INT),
    ("--num-attention-heads", "num_attention_heads", _POSITIVE_INT),
    ("--ffn-hidden-size", "ffn_hidden_size", _POSITIVE_INT), ("--seq-length", "seq_length", _POSITIVE_INT),
    ("--vocab-size", "vocab_size", (lambda v: v >= 2, "an integer >= 2")),
    ("--hidden-dropout", "hidden_dropout", _PROBABILITY), ("--attention-dropout", "attention_dropout", _PROBABILITY),
    ("--recompute-num-layers", "recompute_num_layers", _POSITIVE_INT),
    ("--train-iters", "train_iters", _POSITIVE_INT), ("--micro-batch-size", "micro_batch_size", _POSITIVE_INT),
    ("--global-batch-size", "global_batch_size", _POSITIVE_INT),
    ("--seed", "seed", (lambda v: 0 <= v < 2 ** 63, "in [0, 2**63)")),
    ("--lr", "lr", _POSITIVE), ("--min-lr", "min_lr", _NON_NEGATIVE),
    ("--lr-warmup-iters", "lr_warmup_iters", _NON_NEGATIVE), ("--lr-decay-iters", "lr_decay_iters", _POSITIVE_INT),
    ("--weight-decay", "weight_decay", _NON_NEGATIVE),
    ("--adam-beta1", "adam_beta1", _PROBABILITY), ("--adam-beta2", "adam_beta2", _PROBABILITY),
    ("--adam-eps", "adam_eps", _POSITIVE), ("--clip-grad", "clip_grad", _NON_NEGATIVE),
    ("--ddp-bucket-size", "ddp_bucket_size", _POSITIVE_INT),
    ("--loss-scale", "loss_scale", _POSITIVE), ("--initial-loss-scale", "initial_loss_scale", _POSITIVE),
    ("--loss-scale-window", "loss_scale_window", _POSITIVE_INT), ("--hysteresis", "hysteresis", _POSITIVE_INT),
    ("--min-loss-scale", "min_loss_scale", _POSITIVE),
    ("--plan-gpu-memory-gib", "plan_gpu_memory_gib", _POSITIVE),
    ("--save-interval", "save_interval", _POSITIVE_INT), ("--exit-interval", "exit_interval", _POSITIVE_INT),
    ("--exit-duration-in-mins", "exit_duration_in_mins", _POSITIVE),
    ("--max-skipped-iters", "max_skipped_iters", _POSITIVE_INT), ("--log-interval", "log_interval", _POSITIVE_INT),
    ("--eval-interval", "eval_interval", _NON_NEGATIVE), ("--eval-iters", "eval_iters", _NON_NEGATIVE),
    ("--peak-tflops", "peak_tflops", _POSITIVE), ("--timeline-iters", "timeline_iters", _POSITIVE_INT),
    ("--distributed-timeout-minutes", "distributed_timeout_minutes", _POSITIVE),
    ("--rotary-base", "rotary_base", _POSITIVE),
    ("--rotary-percent", "rotary_percent", (lambda v: 0 < v <= 1, "in (0, 1]")),
    ("--rope-scaling-factor", "rope_scaling_factor", (lambda v: v >= 1, ">= 1")),
    ("--rope-low-freq-factor", "rope_low_freq_factor", _POSITIVE),
    ("--rope-high-freq-factor", "rope_high_freq_factor", _POSITIVE),
    ("--rope-original-max-position-embeddings", "rope_original_max_position_embeddings", _POSITIVE_INT),
    ("--num-query-groups", "num_query_groups", _POSITIVE_INT), ("--norm-epsilon", "norm_epsilon", _POSITIVE),
    ("--local-sgd-interval", "local_sgd_interval", (lambda v: v >= 0, "an integer >= 0 (0: off)")),
    ("--local-sgd-fragments", "local_sgd_fragments", _POSITIVE_INT),
    ("--local-sgd-warmup-iters", "local_sgd_warmup_iters", (lambda v: v >= 0, "an integer >= 0")),
    ("--outer-lr", "outer_lr", _POSITIVE), ("--outer-momentum", "outer_momentum", _PROBABILITY),
]


def check_numbers(args) -> None:
    """Every numeric flag in its range (and finite), each problem one line naming the flag."""
    for flag, attr, (ok, rule) in _NUMERIC_FLAGS:
        v = getattr(args, attr, None)
        if v is None:
            continue
        if not math.isfinite(v) or not ok(v):
            raise UsageError(f"{flag} must be {rule}, got {v}")
    for i, n in enumerate(args.pipeline_layers or []):
        if n < 1:
            raise UsageError(f"--pipeline-layers: stage {i} gets {n} layers; every stage needs at least 1")
    if args.min_lr > args.lr:
        raise UsageError(f"--min-lr {args.min_lr} is above --lr {args.lr}: the schedule decays from --lr to --min-lr")
    if args.fp16 and args.loss_scale is None and args.min_loss_scale > args.initial_loss_scale:
        raise UsageError(f"--min-loss-scale {args.min_loss_scale} is above --initial-loss-scale "
                         f"{args.initial_loss_scale}")
    if args.recompute_num_layers is not None and args.recompute != "full":
        raise UsageError(f"--recompute-num-layers {args.recompute_num_layers} applies to --recompute full only "
                         f"(got --recompute {args.recompute})")


def validate(args, world_size: int, config: TransformerConfig) -> int:
    """Check the layout against the world and the model; return the data-parallel size."""
    check_numbers(args)
    tp, pp = args.tp, args.pp
    if world_size % tp:
        raise UsageError(f"--tp {tp} does not divide the number of ranks ({world_size}): "
                         f"use a --tp among the divisors of {world_size}, or launch a multiple of {tp} ranks")
    if world_size % (tp * pp):
        raise UsageError(f"--tp {tp} x --pp {pp} = {tp * pp} does not divide the number of ranks ({world_size}): "
                         f"launch a multiple of {tp * pp} ranks or change --tp/--pp")
    cp = getattr(args, "cp", 1)
    if cp > 1:
        _check_context_parallel(args, world_size, config)
    dp = world_size // (tp * cp * pp)
    if args.vpp and args.vpp > 1 and pp == 1:
        raise UsageError(f"--vpp {args.vpp} needs pipeline parallelism (--pp > 1)")
    try:
        config.check_tensor_parallel(tp)
        stage_layer_counts(config.num_layers, pp, args.vpp, args.pipeline_layers)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if config.vocab_size < 2:
        raise UsageError(f"vocabulary size must be >= 2, got {config.vocab_size}")
    per_step = args.micro_batch_size * dp
    if args.global_batch_size % per_step:
        raise UsageError(
            f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
            f"{args.micro_batch_size} x data-parallel size {dp} = {per_step}: use a multiple of {per_step}"
        )
    micro_batches = args.global_batch_size // per_step
    if args.vpp and args.vpp > 1 and micro_batches % pp:
        raise UsageError(
            f"the interleaved schedule (--vpp {args.vpp}) needs the micro-batches per step ({micro_batches} = "
            f"--global-batch-size {args.global_batch_size} / (--micro-batch-size {args.micro_batch_size} x "
            f"data-parallel size {dp})) to be a multiple of --pp ({pp}): raise --global-batch-size"
        )
    if args.data_path and args.mock_data:
        raise UsageError("--mock-data and --data-path exclude each other")
    if args.tensorboard_dir:
        try:
            import torch.utils.tensorboard  # noqa: F401
        except ImportError:
            raise UsageError("--tensorboard-dir needs tensorboard: pip install 'megalite[tb]'") from None
    if args.finetune and not args.load:
        raise UsageError("--finetune needs --load DIR (the checkpoint whose weights to start from)")
    if args.save_interval and not args.save:
        raise UsageError("--save-interval needs --save DIR")
    if args.loss_scale is not None and not args.fp16:
        raise UsageError("--loss-scale applies to --fp16 only")
    if args.use_apex_adam:
        try:
            import apex.optimizers  # noqa: F401
        except ImportError:
            raise UsageError("--use-apex-adam needs NVIDIA apex built from source (the PyPI package named "
                             "'apex' is unrelated); drop the flag to use PyTorch's fused AdamW") from None
    for flag, value in (("--attention-backend", args.attention_backend), ("--norm-backend", args.norm_backend)):
        if value == "fused":
            from megalite import ops
            status = ops.kernels_available()
            if not status:
                raise UsageError(f"{flag} fused needs megalite's CUDA kernels, which cannot run here: {status.reason}. "
                                 f"Use {flag} auto (or torch), or fix the cause")
    if getattr(args, "zero_stage", 0) == 3 and getattr(args, "torch_compile", False):
        raise UsageError("--zero-stage 3 gathers parameters in module hooks, which --torch-compile does not "
                         "trace here: drop --torch-compile, or use --zero-stage 2")
    if args.sequence_parallel and args.seq_length % tp:
        raise UsageError(f"--sequence-parallel needs --seq-length ({args.seq_length}) divisible by --tp ({tp})")
    if not getattr(args, "overlap_grad_reduce", True) and getattr(args, "zero_stage", 0) >= 2:
        raise UsageError(f"--overlap-grad-reduce false applies to ZeRO stages 0-1 (stage {args.zero_stage} "
                         f"reduce-scatters during every backward): drop it, or use --zero-stage 0 or 1")
    _check_local_sgd(args)
    return dp
