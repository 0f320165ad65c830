"""The sections of a run's configuration, one dataclass per concern (the model's two in
megalite.config.model_sections, the checkpoints' and reports' in megalite.config.output_sections).
Each field has a default, a type and one line of help; each section checks its own fields (`check`).
Rules that join sections live in megalite.config.rules. Flags are the fields' names with dashes,
plus Megatron-LM's spellings where they differ (the `flags` and `sets` of a field)."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from megalite.config.fields import NON_NEGATIVE, POSITIVE, POSITIVE_INT, PROBABILITY, check_numbers, opt
from megalite.pipeline.partition import V_SCHEDULES
from megalite.pipeline.programs import check_extra_warmup

_SEED = (lambda v: 0 <= v < 2 ** 63, "in [0, 2**63)")


def pass_costs(costs: str) -> tuple[float, float, float]:
    """--pipeline-pass-costs '1,1.2,0.9' -> (1.0, 1.2, 0.9): a chunk's F, B and W, relative."""
    try:
        values = tuple(float(x) for x in costs.split(","))
    except ValueError:
        values = ()
    if len(values) != 3 or not all(v > 0 and math.isfinite(v) for v in values):
        raise ValueError(f"--pipeline-pass-costs {costs!r} must be three positive numbers F,B,W "
                         "(a forward's, an input-gradient pass's and a weight-gradient pass's cost), e.g. 1,1.2,0.9")
    return values


def split_weights(split: str) -> list[float]:
    """--split '949,50,1' -> [949, 50, 1] (missing parts 0). Quotes a shell script passed through
    (`'99,1,0'`, as Megatron-LM's Llama example does) and slashes as separators are accepted."""
    try:
        weights = [float(x) for x in re.split(r"[,/]", split.strip().strip("'\""))]
    except ValueError:
        raise ValueError(f"--split {split!r} must be comma-separated numbers, e.g. 949,50,1") from None
    if any(w < 0 or not math.isfinite(w) for w in weights):
        raise ValueError(f"--split {split!r} must be up to three non-negative numbers with a positive sum")
    weights += [0.0] * (3 - len(weights))
    if len(weights) != 3 or sum(weights) <= 0:
        raise ValueError(f"--split {split!r} must be up to three non-negative numbers with a positive sum")
    return weights


@dataclass
class ParallelConfig:
    """How the ranks split the model and the data."""
    tp: int = opt(1, "tensor-parallel size", flags=("--tp", "--tensor-model-parallel-size"), check=POSITIVE_INT)
    pp: int = opt(1, "pipeline-parallel size", flags=("--pp", "--pipeline-model-parallel-size"), check=POSITIVE_INT)
    vpp: int | None = opt(None, "virtual stages (model chunks) per pipeline rank",
                          flags=("--vpp", "--virtual-pipeline-model-parallel-size"), check=POSITIVE_INT)
    num_layers_per_virtual_pipeline_stage: int | None = opt(
        None, "layers per virtual stage (Megatron-LM's other way to give --vpp: layers / (pp x this))",
        check=POSITIVE_INT)
    pipeline_schedule: str = opt(
        "1f1b", "the pipeline's order of passes: 1f1b (interleaved when --vpp > 1), interleaved, zb-h1 (each "
                "backward split into input- and weight-gradient passes, the latter filling the bubble), zb-v "
                "(split too, two chunks per rank in a V: first and last layers on rank 0; sets --vpp 2), or "
                "dualpipev (that V in DualPipeV's order: forwards paired with backwards; docs/pipeline.md)",
        choices=("1f1b", "interleaved", "zb-h1", "zb-v", "dualpipev"))
    pipeline_pass_costs: str = opt(
        "1,1,1", "F,B,W: the relative costs of a forward, an input-gradient and a weight-gradient pass that "
                 "zb-v orders its passes for (docs/pipeline.md: read them off --timeline)", metavar="F,B,W")
    pipeline_extra_warmup: int = opt(
        0, "1: one more forward before the first backward on every pipeline stage but the last (1f1b, zb-h1): one "
           "more micro-batch's activations held, and no steady-state boundary transfer shorter than a pass on the "
           "schedule's path (slow pipeline links; the same numbers; docs/pipeline.md)", choices=(0, 1))
    pipeline_layers: list[int] | None = opt(
        None, "explicit layer count per (virtual) pipeline stage, e.g. 3,5 (default: even split)", metavar="N,N,...")
    decoder_first_pipeline_num_layers: int | None = opt(
        None, "layers on the first pipeline stage, the rest split evenly (Megatron-LM's; sets --pipeline-layers)",
        check=POSITIVE_INT)
    decoder_last_pipeline_num_layers: int | None = opt(
        None, "layers on the last pipeline stage, the rest split evenly (Megatron-LM's; sets --pipeline-layers)",
        check=POSITIVE_INT)
    pipeline_model_parallel_layout: str | None = opt(
        None, "Megatron-LM's layout: each virtual stage's layers in stage order, e.g. 'Et*3|(tt|)*2,mL' (E embedding, "
              "t layer, m MTP layer, L loss, '|' between stages; a stage may hold no layer; sets --pipeline-layers and "
              "--vpp; docs/pipeline.md)", metavar="LAYOUT")
    account_for_embedding_in_pipeline_split: bool = opt(
        False, "split the layers evenly as if the embedding were one more, on the first stage (Megatron-LM's; sets "
               "--pipeline-layers)")
    account_for_loss_in_pipeline_split: bool = opt(
        False, "split the layers evenly as if the loss were one more, on the last stage (Megatron-LM's; sets "
               "--pipeline-layers)")
    sequence_parallel: bool = opt(False, "shard norms/dropout along the sequence (tp>1)")
    tp_comm_overlap: bool = opt(False, "pipeline sequence parallelism's all-gathers and reduce-scatters with the "
                                       "linear layers' GEMMs, shard by shard (needs --sequence-parallel; the same "
                                       "numbers; docs/communication.md)")
    tp_comm_overlap_splits: int = opt(
        1, "each sequence shard's GEMMs and (with --tp-comm-overlap) its transfers in N row pieces, so a shard's "
           "GEMM runs beside the tail of its own transfer (needs --sequence-parallel; with or without "
           "--tp-comm-overlap the same GEMMs, so the same numbers; docs/communication.md)", metavar="N",
        check=POSITIVE_INT)
    overlap_moe_expert_parallel_comm: bool = opt(
        False, "run each steady-state forward beside a backward of another micro-batch, handing over at every "
               "collective, so that one's expert all-to-alls (and TP/SP, CP exchanges) are in flight while the "
               "other computes (1f1b at any --pp, interleaved, dualpipev's pairs; the same numbers; one more "
               "micro-batch in flight; docs/communication.md)")
    delay_wgrad_compute: bool = opt(
        False, "do each backward's weight-gradient GEMMs while its (and, with --overlap-moe-expert-parallel-comm, "
               "the other pass's) exchanges are in flight, instead of where autograd meets them (the same numbers; "
               "docs/communication.md)")
    moe_dispatch_chunks: int = opt(
        1, "each MoE layer's experts in N groups, each group's rows sent, computed and sent back on their own, so "
           "one group's experts compute while the next group's rows travel (the all-to-all dispatcher at --ep > 1; "
           "the same numbers; docs/communication.md)", metavar="N", check=POSITIVE_INT)
    cp: int = opt(1, "context-parallel size: each sequence split over N ranks (ring attention; "
                     "docs/context-parallel.md)", flags=("--cp", "--context-parallel-size"), check=POSITIVE_INT)
    cp_comm_type: str = opt("p2p", "context parallelism's attention: keys/values around a ring (p2p), heads "
                                   "exchanged for the sequence (a2a, DeepSpeed-Ulysses; heads and KV groups "
                                   "divisible by --cp), or both (a2a+p2p: --hierarchical-context-parallel-sizes)",
                            choices=("p2p", "a2a", "a2a+p2p"))
    hierarchical_context_parallel_sizes: list[int] | None = opt(
        None, "--cp-comm-type a2a+p2p: the all-to-all's size A (consecutive CP ranks: A x --tp GPUs, one node's "
              "at most) and the ring's P, A x P = --cp (Megatron-LM's flag; docs/context-parallel.md)", nargs=2,
        metavar=("A2A", "P2P"))
    expert_model_parallel_size: int = opt(1, "expert-parallel size: the experts of each MoE layer split over N "
                                             "ranks (folded onto TP x CP x DP; docs/moe.md)",
                                          flags=("--ep", "--expert-model-parallel-size"), check=POSITIVE_INT)
    expert_tensor_parallel_size: int | None = opt(None, "each expert split over N ranks like a tensor-parallel MLP "
                                                        "(default: --tp)",
                                                  flags=("--etp", "--expert-tensor-parallel-size"), check=POSITIVE_INT)
    distributed_timeout_minutes: float = opt(10.0, "how long a collective may wait for another rank", check=POSITIVE)

    def check(self) -> None:
        check_numbers(self)
        for i, n in enumerate(self.pipeline_layers or []):
            if n < 0:
                raise ValueError(f"--pipeline-layers: stage {i} gets {n} layers; a stage holds 0 or more")
        if self.vpp and self.vpp > 1 and self.pp == 1:
            raise ValueError(f"--vpp {self.vpp} needs pipeline parallelism (--pp > 1)")
        if self.pipeline_schedule == "interleaved" and not (self.vpp and self.vpp > 1):
            raise ValueError("--pipeline-schedule interleaved needs model chunks per rank: give --vpp 2 or more")
        if self.pipeline_schedule == "zb-h1" and self.vpp and self.vpp > 1:
            raise ValueError(f"--pipeline-schedule zb-h1 runs one model chunk per rank, but --vpp is {self.vpp}: "
                             "drop --vpp, or use --pipeline-schedule interleaved")
        pass_costs(self.pipeline_pass_costs)
        kind = self.pipeline_schedule
        if self.pipeline_extra_warmup and self.pp == 1:
            raise ValueError("--pipeline-extra-warmup 1 runs a pipeline stage ahead of the next: it needs --pp 2 or more")
        check_extra_warmup(self.pipeline_extra_warmup, kind, self.vpp, self.overlap_moe_expert_parallel_comm)
        if kind in V_SCHEDULES:
            if self.pp == 1:
                raise ValueError(f"--pipeline-schedule {kind} places two model chunks per rank in a V over the "
                                 "pipeline: it needs --pp 2 or more")
            if self.vpp not in (None, 2):
                raise ValueError(f"--pipeline-schedule {kind} runs two model chunks per rank, but --vpp is {self.vpp}: "
                                 f"drop --vpp ({kind} sets it to 2)")
            if self.num_layers_per_virtual_pipeline_stage is not None:
                raise ValueError(f"--pipeline-schedule {kind} places two model chunks per rank itself: drop "
                                 "--num-layers-per-virtual-pipeline-stage (or give --pipeline-layers, one count per "
                                 "chunk in stage order)")


@dataclass
class DataConfig:
    """Where the tokens come from."""
    data_path: list[str] | None = opt(None, "indexed dataset prefix, weight-prefix pairs to blend, or prefixes "
                                            "alone (each read once, blended by its size, as Megatron-LM) (default: "
                                            "the embedded corpus)", metavar="[WEIGHT] PREFIX")
    train_data_path: list[str] | None = opt(
        None, "Megatron-LM's per-split data: the training split's prefix(es) or weight-prefix pairs, every document of "
              "them (instead of --data-path and --split; docs/data.md)", metavar="[WEIGHT] PREFIX")
    valid_data_path: list[str] | None = opt(
        None, "the validation split's prefix(es) or weight-prefix pairs, every document of them (with --train-data-path; "
              "none: no validation)", metavar="[WEIGHT] PREFIX")
    test_data_path: list[str] | None = opt(
        None, "the test split's prefix(es) or weight-prefix pairs (with --train-data-path; evaluated once training ends)",
        metavar="[WEIGHT] PREFIX")
    data_args_path: str | None = opt(
        None, "a file holding --data-path's words (Megatron-LM's; whitespace-separated)", metavar="FILE")
    per_split_data_args_path: str | None = opt(
        None, "a JSON file {\"train\": ..., \"valid\": ..., \"test\": ...}, each a list (or string) of "
              "--train/valid/test-data-path's words (Megatron-LM's)", metavar="FILE")
    tokenizer: str | None = opt(None, "SentencePiece .model file or Hugging Face tokenizer directory")
    tokenizer_type: str | None = opt(
        None, "Megatron-LM's tokenizer kinds: the files they read are --vocab-file/--merge-file/--tokenizer-model",
        choices=("GPT2BPETokenizer", "BertWordPieceLowerCase", "BertWordPieceCase", "HuggingFaceTokenizer",
                 "SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer", "NullTokenizer"))
    vocab_file: str | None = opt(None, "GPT2BPETokenizer: vocab.json; BertWordPiece*: vocab.txt")
    merge_file: str | None = opt(None, "GPT2BPETokenizer: merges.txt")
    tokenizer_model: str | None = opt(None, "SentencePiece model file, or a Hugging Face tokenizer directory")
    split: str = opt("969,30,1", "train,valid,test proportions of the documents")
    mask_prob: float = opt(0.15, "BERT: the share of a sample's tokens chosen for the masked-LM loss",
                           check=(lambda v: 0 < v <= 1, "in (0, 1]"))
    short_seq_prob: float = opt(0.1, "BERT: how often a sample's segment aims at a random shorter length",
                                check=PROBABILITY)
    mock_data: bool = opt(False, "a deterministic synthetic token stream")
    # Documents packed into a sequence, told apart by the tokenizer's EOD (megalite.data.documents).
    reset_attention_mask: bool = opt(False, "attend only within each document packed into a sequence (GPT)")
    reset_position_ids: bool = opt(False, "positions restart at 0 at each document packed into a sequence (GPT)")
    eod_mask_loss: bool = opt(False, "no loss where the input token is the end-of-document token (GPT)")
    sft_data_path: str | None = opt(None, "supervised fine-tuning: a JSON-lines file of {prompt, response} or "
                                          "{messages} records (the loss on the replies; conversations packed, each "
                                          "attending to itself; needs --tokenizer; docs/sft.md)")
    sft_no_packing: bool = opt(False, "--sft-data-path: one conversation a sequence instead of packing them")

    def check(self) -> None:
        split_weights(self.split)
        for flag, path in (("--data-args-path", self.data_args_path),
                           ("--per-split-data-args-path", self.per_split_data_args_path)):
            if path is not None and not path.strip():
                raise ValueError(f"{flag} is empty: give the file's path (an unset shell variable?)")
        given = [flag for flag, v in (("--data-path", self.data_path), ("--data-args-path", self.data_args_path),
                                      ("--train-data-path", self.train_data_path),
                                      ("--valid-data-path", self.valid_data_path),
                                      ("--test-data-path", self.test_data_path),
                                      ("--per-split-data-args-path", self.per_split_data_args_path)) if v]
        if given and self.mock_data:
            raise ValueError(f"--mock-data and {given[0]} exclude each other")
        if self.sft_data_path and (given or self.mock_data):
            raise ValueError(f"--sft-data-path trains on its conversations alone: drop "
                             f"{' and '.join(given) if given else '--mock-data'}")
        whole = [f for f in given if f in ("--data-path", "--data-args-path")]
        if len(whole) == 2 or (whole and len(given) > 1):
            raise ValueError(f"{given[0]} and {given[1]} both name the data: keep one ({whole[0]} is split by --split; "
                             f"the per-split flags name each split's data)")
        if "--per-split-data-args-path" in given and len(given) > 1:
            others = " and ".join(f for f in given if f != "--per-split-data-args-path")
            raise ValueError(f"--per-split-data-args-path names every split's data: drop {others}")
        if given and not whole and not {"--train-data-path", "--per-split-data-args-path"} & set(given):
            raise ValueError(f"{given[0]} needs --train-data-path: the training split's data")
        if self.sft_no_packing and not self.sft_data_path:
            raise ValueError("--sft-no-packing is about --sft-data-path's conversations: give --sft-data-path")


@dataclass
class TrainingConfig:
    """How long, how big a batch, and when to stop early."""
    train_iters: int | None = opt(None, "optimizer steps (default 100, or from --train-samples)", check=POSITIVE_INT)
    train_samples: int | None = opt(None, "samples to train on instead of --train-iters (steps: this / global "
                                          "batch)", check=POSITIVE_INT)
    micro_batch_size: int = opt(2, "samples per forward/backward on one rank", check=POSITIVE_INT)
    global_batch_size: int = opt(16, "samples per optimizer step over all ranks", check=POSITIVE_INT)
    rampup_batch_size: list[int] | None = opt(
        None, "Megatron-LM's batch ramp-up: start at START samples a step, add INCREMENT every SAMPLES / ((global - "
              "START) / INCREMENT) samples, reach --global-batch-size after SAMPLES", nargs=3,
        metavar=("START", "INCREMENT", "SAMPLES"))
    step_batch_size_schedule: str | None = opt(
        None, "Megatron-LM's step schedule of the global batch: \"THRESHOLD:BATCH ...\", thresholds in tokens (K/M/B/T "
              "suffixes), the first 0; a step takes the batch of the last threshold reached; sets --global-batch-size "
              "to the last batch (megalite.config.batch_schedule)", metavar="SCHEDULE")
    seed: int = opt(1234, "seed of the weights, dropout and data order", check=_SEED)
    data_parallel_random_init: bool = opt(False, "each data-parallel rank's dropout streams seeded apart (seed + 10 x "
                                                 "its DP rank, Megatron-LM's flag); the weights stay every "
                                                 "replica's alike, as Megatron-LM broadcasts DP rank 0's")
    eval_interval: int = opt(100, "validate every N iterations (0: never)", check=NON_NEGATIVE)
    eval_iters: int = opt(4, "global batches per validation", check=NON_NEGATIVE)
    full_validation: bool = opt(False, "each validation reads every sample of the validation data once, in whole "
                                       "global batches (--eval-iters unused; GPT; Megatron-LM's flag)")
    multiple_validation_sets: bool = opt(False, "each prefix of --valid-data-path validated on its own, with a loss of "
                                                "its own (weights unused; GPT; Megatron-LM's flag)")
    validation_set_names: list[str] | None = opt(None, "with --multiple-validation-sets: a name for each prefix's "
                                                       "loss (default 0, 1, ...)", metavar="NAME")
    eval_prompts: str | None = opt(None, "a file of prompts (one a line) completed greedily at each validation, "
                                         "printed and written to TensorBoard (GPT; docs/generate.md)", metavar="FILE")
    eval_tasks: str | None = opt(None, "lm-eval task names, comma-separated, scored at each validation and logged as "
                                       "lm_eval/TASK/METRIC (GPT; needs megalite[eval]; docs/evaluate.md)",
                                 metavar="TASKS")
    eval_tasks_path: str | None = opt(None, "a directory of lm-eval task YAML files for --eval-tasks (lm-eval's "
                                            "--include_path)", metavar="DIR")
    eval_tasks_limit: float | None = opt(None, "documents per --eval-tasks task at each validation (a fraction if < 1; "
                                               "default: all)", check=POSITIVE)
    skip_train: bool = opt(False, "evaluate only: the validation and test splits at the loaded iteration, no step "
                                  "(Megatron-LM's flag)")
    exit_interval: int | None = opt(None, "save and exit at an iteration divisible by N", check=POSITIVE_INT)
    exit_duration_in_mins: float | None = opt(None, "save and exit after this long", check=POSITIVE)
    no_exit_signal_handler: bool = opt(False, "do not turn SIGTERM/SIGUSR1 into save-and-exit",
                                       sets={"--exit-signal-handler": False})
    max_skipped_iters: int = opt(30, "stop after this many iterations in a row with inf/NaN gradients",
                                 check=POSITIVE_INT)
    calculate_per_token_loss: bool = opt(False, "the loss is the global batch's sum over tokens / its token count "
                                                "(default, as Megatron-LM: the mean of each micro-batch's mean; "
                                                "the two differ where loss masks differ: --eod-mask-loss, SFT, "
                                                "BERT's masking)")
    deterministic_mode: bool = opt(False, "the same numbers from every run of one command: PyTorch's deterministic "
                                          "algorithms (an operation without one raises), NCCL_ALGO and "
                                          "CUBLAS_WORKSPACE_CONFIG set or checked (Megatron-LM's flag; "
                                          "docs/reproducibility.md)")
    plan: bool = opt(False, "before training, predict memory and step time of this layout and warn if it will "
                            "not fit")
    plan_gpu_memory_gib: float | None = opt(None, "GPU memory for --plan (default: this GPU's)", check=POSITIVE)

    def check(self) -> None:
        check_numbers(self)
        if self.skip_train and not (self.eval_iters and self.eval_interval):
            raise ValueError(f"--skip-train evaluates the validation and test splits: give --eval-iters above 0 and "
                             f"leave --eval-interval above 0 (got {self.eval_iters} and {self.eval_interval})")
        if self.rampup_batch_size is not None:
            if len(self.rampup_batch_size) != 3:
                raise ValueError(f"--rampup-batch-size takes START INCREMENT SAMPLES, got {self.rampup_batch_size}")
            start, increment, samples = self.rampup_batch_size
            if start < 1 or increment < 1 or samples < 0 or start > self.global_batch_size:
                raise ValueError(f"--rampup-batch-size {start} {increment} {samples}: START and INCREMENT must be "
                                 f">= 1, SAMPLES >= 0 and START at most --global-batch-size {self.global_batch_size}")
            if (self.global_batch_size - start) % increment:
                raise ValueError(f"--rampup-batch-size: --global-batch-size {self.global_batch_size} - START {start} "
                                 f"is not a multiple of INCREMENT {increment}")


def global_batch_at(consumed: int, global_batch_size: int, rampup: list[int] | None) -> int:
    """The global batch of the step that starts after `consumed` samples (Megatron-LM's ramp-up: the
    final size past SAMPLES, else START + INCREMENT x whole steps of SAMPLES / increments)."""
    if rampup is None:
        return global_batch_size
    start, increment, samples = rampup
    increments = (global_batch_size - start) // increment
    if increments == 0 or consumed > samples:
        return global_batch_size
    return start + int(consumed / (samples / increments)) * increment


def steps_for_samples(samples: int, global_batch_size: int, rampup: list[int] | None) -> int:
    """Optimizer steps that train on `samples` samples (Megatron-LM's count: the ramp-up's steps one
    by one, then whole final batches; a last partial batch is dropped)."""
    consumed = steps = 0
    if rampup is not None:
        while consumed <= rampup[2] and consumed <= samples:
            consumed += global_batch_at(consumed, global_batch_size, rampup)
            steps += 1
    return steps + max(0, samples - consumed) // global_batch_size


@dataclass
class DataParallelConfig:
    """Data parallelism: the gradient reduction and what ZeRO shards."""
    use_distributed_optimizer: bool = opt(False, "shard fp32 master weights and Adam states over data-parallel "
                                                 "ranks (ZeRO-1)")
    zero_stage: int | None = opt(None, "shard over data-parallel ranks: 1 optimizer state (= "
                                       "--use-distributed-optimizer), 2 and gradients, 3 and parameters (gathered "
                                       "layer by layer); docs/optimizer.md", choices=(0, 1, 2, 3))
    zero_reshard_after_forward: bool | None = opt(
        None, "stage 3: free a layer's gathered parameters after its forward (true) or keep them until its "
              "backward (false: one gather less per micro-batch, more memory)", switch=False)
    zero_keep_params_for_step: bool = opt(False, "stage 3: gather each layer once per step and keep it across the "
                                                 "step's micro-batches")
    ddp_bucket_size: int = opt(40_000_000, "gradient elements per data-parallel reduction bucket", check=POSITIVE_INT)
    grad_reduce_dtype: str = opt("fp32", "dtype of the data-parallel gradient reduction (bf16 halves the traffic)",
                                 choices=("fp32", "bf16"), sets={"--grad-reduce-in-bf16": "bf16"})
    overlap_grad_reduce: bool = opt(True, "ZeRO stages 0-1: start each bucket's reduction as soon as backward "
                                          "fills it (true), or reduce every bucket after the last backward (false)")
    overlap_param_gather: bool = opt(False, "ZeRO stages 1-2: all-gather the updated parameters beside the next "
                                            "forward, each bucket waited for before the part of a layer that reads "
                                            "it (stage 3 gathers layer by layer always)")

    def check(self) -> None:
        check_numbers(self)
        stage = self.zero_stage if self.zero_stage is not None else int(self.use_distributed_optimizer)
        if stage != 3 and (self.zero_reshard_after_forward is not None or self.zero_keep_params_for_step):
            raise ValueError("--zero-reshard-after-forward and --zero-keep-params-for-step apply to --zero-stage 3")
        if not self.overlap_grad_reduce and stage >= 2:
            raise ValueError(f"--overlap-grad-reduce false applies to ZeRO stages 0-1 (stage {stage} "
                             f"reduce-scatters during every backward): drop it, or use --zero-stage 0 or 1")
        if self.overlap_param_gather and stage == 0:
            raise ValueError("--overlap-param-gather overlaps the distributed optimizer's parameter all-gather, "
                             "which plain data parallelism does not have: add --use-distributed-optimizer, or drop it")


@dataclass
class LocalSGDConfig:
    """Local SGD / DiLoCo for slow links (docs/local-sgd.md)."""
    local_sgd_interval: int = opt(0, "data-parallel replicas take H optimizer steps without reducing gradients "
                                     "across replicas, then average their parameter deltas into an outer "
                                     "Nesterov-SGD step (0: off)", metavar="H",
                                  check=(lambda v: v >= 0, "an integer >= 0 (0: off)"))
    outer_lr: float = opt(0.7, "the outer optimizer's learning rate", check=POSITIVE)
    outer_momentum: float = opt(0.9, "the outer Nesterov momentum", check=PROBABILITY)
    outer_grad_dtype: str = opt("fp32", "dtype of the averaged pseudo-gradients on the wire", choices=("fp32", "bf16"))
    local_sgd_async: bool = opt(False, "overlap each outer reduction with the next H inner steps and apply it one "
                                       "round late")
    local_sgd_fragments: int = opt(1, "streaming: synchronize the parameters in F fragments, one every H/F steps",
                                   metavar="F", check=POSITIVE_INT)
    local_sgd_warmup_iters: int = opt(0, "plain data parallelism for the first N steps, local SGD after "
                                         "(post-local SGD)", metavar="N", check=(lambda v: v >= 0, "an integer >= 0"))

    def check(self) -> None:
        check_numbers(self)
        if not self.local_sgd_interval:
            given = (("--local-sgd-async", self.local_sgd_async),
                     ("--local-sgd-fragments", self.local_sgd_fragments != 1),
                     ("--outer-grad-dtype bf16", self.outer_grad_dtype != "fp32"),
                     ("--local-sgd-warmup-iters", self.local_sgd_warmup_iters != 0))
            extras = [flag for flag, on in given if on]
            if extras:
                raise ValueError(f"{', '.join(extras)}: options of local SGD; add --local-sgd-interval H (or drop "
                                 f"them)")
        elif self.local_sgd_interval % self.local_sgd_fragments:
            f, h = self.local_sgd_fragments, self.local_sgd_interval
            raise ValueError(f"--local-sgd-fragments {f} must divide --local-sgd-interval {h} (one fragment every "
                             f"H/F steps): use a divisor of {h}")
