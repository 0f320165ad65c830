"""Training metrics: model FLOPs, a log line, and JSON-lines records.

FLOPs per iteration follow Megatron-LM's model-FLOPs formula for a GPT (Narayanan et al.,
"Efficient Large-Scale Language Model Training on GPU Clusters", 2021, eq. 3 without
recomputation): 72 * B * s * L * h^2 * (1 + s / (6 h) + V / (12 L h)), B the global batch in
sequences, s the sequence length, L layers, h hidden size, V the (padded) vocabulary. It counts
forward and backward matmuls (backward = 2x forward); recomputation is not counted, so TFLOP/s
and MFU are comparable across recompute settings.
"""
from __future__ import annotations

import json
import math
import os
import time

import torch
import torch.distributed as dist

from megalite.parallel import traffic

# Dense datasheet peaks (TFLOP/s, no sparsity) by the dtype the matmuls run in, for MFU when
# --peak-tflops is not given. Most specific device names first: the H100's three forms differ.
_PEAK_TFLOPS = (
    ("H100 PCIe", {"bf16": 756.0, "tf32": 378.0, "fp32": 51.0}),
    ("H100 NVL", {"bf16": 835.0, "tf32": 417.5, "fp32": 60.0}),
    ("H200 NVL", {"bf16": 835.0, "tf32": 417.5, "fp32": 60.0}),
    ("H100", {"bf16": 989.0, "tf32": 494.5, "fp32": 67.0}),  # SXM ("H100 80GB HBM3")
    ("H200", {"bf16": 989.0, "tf32": 494.5, "fp32": 67.0}),
    ("A100", {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5}),
)


def gpt_flops_per_iteration(global_batch: int, seq_length: int, num_layers: int, hidden: int,
                            vocab: int) -> float:
    """Megatron-LM's model FLOPs of a GPT-2-shaped model (Narayanan et al. 2021, "Efficient
    Large-Scale Language Model Training on GPU Clusters", eq. 3); `model_flops_per_iteration` is the
    same count for any shape and equals this one for GPT-2's."""
    return 72.0 * global_batch * seq_length * num_layers * hidden ** 2 * (
        1.0 + seq_length / (6.0 * hidden) + vocab / (12.0 * num_layers * hidden)
    )


def layer_forward_flops(config, s: int, b: int, moe: bool = False) -> tuple[float, float]:
    """(dense, attention core) forward FLOPs of one transformer layer over b sequences of s tokens,
    all TP ranks together, 2 FLOPs per multiply-add: the query, key/value (grouped-query: G of the
    a heads), output projection and MLP (gated: gate and up) matmuls, and the two attention matmuls
    q k^T and p v over every pair of positions (as Megatron-LM counts, causal or not). A MoE layer
    (`moe`) counts what a token runs: the router, its top-k experts and the shared expert, not the
    experts it skips (active parameters)."""
    h, f = config.hidden_size, config.ffn_hidden_size
    q = config.num_attention_heads * config.head_dim
    kv = 2 * config.query_groups * config.head_dim
    width = 3 if config.gated_linear_unit else 2
    mlp = h * f * width
    if moe:
        shared = config.moe_shared_expert_intermediate_size or 0
        mlp = h * config.num_moe_experts + config.moe_router_topk * h * config.moe_ffn_hidden_size * width + \
            h * shared * width + (h if config.moe_shared_expert_gate else 0)
    if config.multi_latent_attention:
        return 2.0 * s * b * (mla_projection_macs(config) + mlp), _mla_core_flops(config, s, b)
    dense = 2.0 * s * b * (h * q + h * kv + q * h + mlp)
    core = 4.0 * b * s * s * q
    return dense, core


def mla_projection_macs(config) -> int:
    """Multiply-adds per token of multi-head latent attention's projections (megalite.models.mla):
    the query down and up projections (or the one plain query projection), the keys' and values'
    down projection to the latent and the shared rotary key, their up projection, the output."""
    h, a = config.hidden_size, config.num_attention_heads
    qk, v, r, c = config.qk_head_dim + config.qk_pos_emb_head_dim, config.v_head_dim, config.q_lora_rank, \
        config.kv_lora_rank
    query = h * a * qk if r is None else h * r + r * a * qk
    return query + h * (c + config.qk_pos_emb_head_dim) + c * a * (config.qk_head_dim + v) + a * v * h


def _mla_core_flops(config, s: int, b: int) -> float:
    """q k^T over (d_n + d_r) dims and p v over d_v, every pair of positions."""
    a = config.num_attention_heads
    return 2.0 * b * s * s * a * (config.qk_head_dim + config.qk_pos_emb_head_dim + config.v_head_dim)


def mtp_forward_flops(config, s: int, b: int, vocab: int | None = None) -> tuple[float, float]:
    """(dense, attention core) forward FLOPs of the multi-token prediction modules
    (megalite.models.mtp) over b sequences of s tokens, all TP ranks together: per depth one more
    layer of the kind the model's last layer is, eh_proj (2h -> h: 2h x h multiply-adds a token) and
    one more pass through the output head (h x vocab; `vocab` defaults to the config's). 0 without MTP."""
    dense = core = 0.0
    h, vocab = config.hidden_size, config.vocab_size if vocab is None else vocab
    for k in range(config.mtp_num_layers):
        layer, layer_core = layer_forward_flops(config, s, b, moe=config.is_moe_layer(config.num_layers + k))
        dense += layer + 2.0 * s * b * (2 * h * h + h * vocab)
        core += layer_core
    return dense, core


def model_flops_per_iteration(config, global_batch: int, seq_length: int) -> float:
    """Model FLOPs of one training iteration (forward, and backward as twice the forward; no
    recomputation counted): every layer's matmuls plus the output logits, 2*s*h*vocab a sequence,
    plus the multi-token prediction modules (`mtp_forward_flops`).
    For GPT-2's shape this is `gpt_flops_per_iteration`; grouped-query attention shrinks the
    key/value term, a gated MLP adds a third of its MLP; biases, norms and rotary positions are
    elementwise and not counted; an untied output layer costs what the tied one does."""
    logits = 2.0 * global_batch * seq_length * config.hidden_size * config.vocab_size
    layers = 0.0
    for i in range(config.num_layers):
        dense, core = layer_forward_flops(config, seq_length, global_batch, moe=config.is_moe_layer(i))
        layers += dense + core
    return 3.0 * (layers + logits + sum(mtp_forward_flops(config, seq_length, global_batch)))


def peak_tflops_of(device_name: str, dtype: torch.dtype = torch.bfloat16, tf32: bool = True) -> float | None:
    """The datasheet peak of a GPU for matmuls in `dtype` (fp16 counts as bf16; fp32 as TF32 when
    TF32 is allowed); None for a GPU not in the table."""
    kind = "bf16" if dtype in (torch.bfloat16, torch.float16) else "tf32" if tf32 else "fp32"
    return next((peaks[kind] for name, peaks in _PEAK_TFLOPS if name in device_name), None)


def default_peak_tflops(dtype: torch.dtype = torch.bfloat16, tf32: bool = True) -> float | None:
    """This rank's GPU's peak for `dtype`, if it is one we know; None on CPU."""
    if not torch.cuda.is_available():
        return None
    return peak_tflops_of(torch.cuda.get_device_name(), dtype, tf32)


class MetricsWriter:
    """Writes one JSON object a line; the file is flushed after each record so a crash keeps them."""

    def __init__(self, path: str | None):
        self._file = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._file = open(path, "a", encoding="utf-8")

    def write(self, record: dict) -> None:
        if self._file is not None:
            clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
            self._file.write(json.dumps(clean) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def ppl_key(loss_key: str) -> str:
    """The record key of a loss term's perplexity: mlm_loss -> mlm_ppl."""
    return loss_key.removesuffix("_loss") + "_ppl"


def _loss_term_keys(r: dict) -> list[str]:
    """A task's named loss terms in a record (BERT: mlm_loss, sop_loss), and their perplexities."""
    return [k for k in r if k.endswith(("_loss", "_ppl")) and k not in ("valid_loss", "valid_ppl")]


class LogWindow:
    """The figures of the iterations since the last log line: losses (and a task's named loss
    terms) summed on the device, so adding one makes no host sync, and the pipeline bubble of the
    iterations whose timings mean something. `close()` reduces them over the layout (loss over
    data parallelism, from the last pipeline stage; bubble averaged over stages) and starts anew."""

    def __init__(self, device, loss_terms: tuple[str, ...], perplexity_of: str | None, dp_group, pp_group,
                 last_stage: int):
        self.device, self.loss_terms, self.perplexity_of = device, loss_terms, perplexity_of
        self.dp_group, self.pp_group, self.last_stage = dp_group, pp_group, last_stage
        self._reset()

    def _reset(self) -> None:
        self.start, self.iters = time.perf_counter(), 0
        self.losses = torch.zeros(1 + len(self.loss_terms), device=self.device)  # loss, then the terms
        self.bubble, self.bubble_iters = 0.0, 0

    def add(self, loss_sum: torch.Tensor, terms: torch.Tensor | None, num_tokens: torch.Tensor,
            bubble: float | None) -> None:
        """One iteration: summed loss and terms (None: the task has none) over this rank's
        micro-batches, the global token count, and its measured bubble (None when its timings were
        not synchronized)."""
        self.losses[0] += loss_sum / num_tokens
        if terms is not None:
            self.losses[1:] += terms / num_tokens
        if bubble is not None:
            self.bubble, self.bubble_iters = self.bubble + bubble, self.bubble_iters + 1
        self.iters += 1

    def close(self) -> dict:
        """{'loss', the named terms (and the perplexity term), 'bubble' or None, 'seconds_per_iter'}."""
        n = self.losses.numel()
        both = torch.cat([self.losses, torch.tensor([self.bubble], device=self.device)])
        if self.dp_group is not None and dist.get_world_size(self.dp_group) > 1:
            traffic.counted_all_reduce("metrics", both[:n], self.dp_group)
        pp = dist.get_world_size(self.pp_group) if self.pp_group is not None else 1
        if pp > 1:  # the loss lives on the last stage; the bubble is averaged over stages
            bubble = both[n:].clone()
            traffic.counted_all_reduce("metrics", bubble, self.pp_group)
            traffic.gather_or_scatter("metrics", both.nbytes, pp)  # a broadcast
            dist.broadcast(both, src=self.last_stage, group=self.pp_group)
            both[n] = bubble[0] / pp
        values = both.tolist()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        out = {"loss": values[0] / self.iters}
        terms = {k: v / self.iters for k, v in zip(self.loss_terms, values[1:n])}
        out.update(terms)
        if self.perplexity_of is not None:
            out[ppl_key(self.perplexity_of)] = math.exp(min(terms[self.perplexity_of], 80.0))
        out["bubble"] = values[n] / self.bubble_iters if self.bubble_iters and pp > 1 else None
        out["seconds_per_iter"] = (time.perf_counter() - self.start) / self.iters
        self._reset()
        return out


def format_log_line(r: dict) -> str:
    parts = [
        f"iter {r['iteration']:>6}/{r['train_iters']}",
        f"samples {r['consumed_samples']}",
        f"loss {r['loss']:.6f}",
        *(f"{k} {r[k]:.6f}" if k.endswith("_loss") else f"{k} {r[k]:.3f}" for k in _loss_term_keys(r)),
        f"lr {r['lr']:.3e}",
        f"grad_norm {r['grad_norm']:.3f}",
        *([f"params_norm {r['params_norm']:.3f}"] if r.get("params_norm") is not None else []),
        *([f"max_attention_logit {r['max_attention_logit']:.2f}"] if "max_attention_logit" in r else []),
        f"loss_scale {r['loss_scale']:g}",
        f"skipped {r['skipped']}",
        f"{r['ms_per_iter']:.1f} ms/it",
        f"{r['tokens_per_sec']:.0f} tok/s",
        f"{r['tflops_per_gpu']:.2f} TFLOP/s/gpu",
    ]
    if r.get("mfu") is not None:
        parts.append(f"MFU {100 * r['mfu']:.1f}%")
    if "moe_load_imbalance" in r:  # tokens per expert, max over mean (worst layer); assignments dropped
        parts.append(f"moe load {r['moe_load_imbalance']:.2f} dropped {100 * r['moe_dropped_fraction']:.1f}%")
    if r.get("bubble_theory"):
        measured = r.get("bubble_measured")
        parts.append(f"bubble {100 * measured:.1f}% (theory {100 * r['bubble_theory']:.1f}%)" if measured is not None
                     else f"bubble theory {100 * r['bubble_theory']:.1f}%, measured n/a (GPU not synchronized "
                          f"outside --timeline iterations)")
    return " | ".join(parts)


# Spans drawn on a row of their own under the rank's compute row: communication that runs beside it.
_ROWS = {"zero-gather": (1, "ZeRO-3 parameter all-gathers (launch to completion)"),
         "ep-comm": (2, "collectives in flight (launch to completion)")}
# Rows a span names itself (its 5th element): an overlapped pair's forward lane and its collectives
# (megalite.parallel.lanes), which run beside the compute row.
_LANES = {3: "second lane: the overlapped pair's forward", 4: "second lane: its collectives in flight"}


def _row_label(tid: int) -> str:
    labels = {row: label for row, label in _ROWS.values()} | _LANES
    return labels.get(tid, f"row {tid}")


class Timeline:
    """Per-rank spans (name, category, start, duration[, row]) merged into one Chrome-trace file
    (chrome://tracing, ui.perfetto.dev) with one row per rank; `row` (an int) puts a span on a row
    of its own, e.g. a forward running on a second thread beside a backward."""

    def __init__(self, path: str | None, max_iterations: int):
        self.path, self.max_iterations = path, max_iterations
        self.events: list[dict] = []
        self.t0 = 0.0

    def start(self) -> None:
        """Call right after a barrier, so that every rank's clock starts together."""
        self.t0 = time.perf_counter()

    def records(self, iteration: int) -> bool:
        return bool(self.path) and iteration < self.max_iterations

    def add(self, rank: int, iteration: int, spans) -> None:
        for name, category, start, dur, *row in spans:
            self.events.append({"name": name, "cat": category, "ph": "X", "pid": rank,
                                "tid": row[0] if row else _ROWS.get(category, (0, ""))[0],
                                "ts": (start - self.t0) * 1e6, "dur": dur * 1e6, "args": {"iteration": iteration}})

    def counter(self, rank: int, name: str, start: float, values: dict[str, int]) -> None:
        """A point of the rank's counter track `name` (a Chrome-trace "C" event, drawn as stacked
        series): `values` hold from `start` until its next point (the bytes a step sent, by kind)."""
        self.events.append({"name": name, "ph": "C", "pid": rank, "tid": 0, "ts": (start - self.t0) * 1e6,
                            "args": dict(values) or {"none": 0}})

    def write(self, labels: dict[int, str]) -> None:
        """Gather every rank's events on rank 0 and write the file atomically."""
        if not self.path:
            return
        gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(self.events, gathered, dst=0)
        if dist.get_rank() != 0:
            return
        events = [e for part in gathered for e in part]
        rows = {(e["pid"], e["tid"]) for e in events if e["tid"]}
        for pid, tid in sorted(rows):
            events.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                           "args": {"name": _row_label(tid)}})
        for rank, label in labels.items():
            events.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": label}})
            events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "args": {"sort_index": rank}})
        tmp = f"{self.path}.tmp"
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
        os.replace(tmp, self.path)


_TENSORBOARD_KEYS = ("loss", "lr", "grad_norm", "params_norm", "max_attention_logit", "loss_scale", "tokens_per_sec",
                     "tflops_per_gpu", "mfu", "bubble_measured", "skipped", "moe_load_imbalance", "moe_dropped_fraction")


class TrainingLogger:
    """Where the logging rank's records go: a log line, the metrics file, TensorBoard, Weights & Biases
    (`wandb`: megalite.metrics_wandb's options; the package is checked on every rank, the run started
    on the active one), and a progress bar when attached to a terminal."""

    def __init__(self, active: bool, metrics_file: str | None, tensorboard_dir: str | None, total_iters: int,
                 progress_bar: bool, wandb=None):
        import sys

        self.active = active
        self.metrics = MetricsWriter(metrics_file if active else None)
        self.tb = self.wandb = None
        if wandb is not None:
            from megalite.metrics_wandb import WandbRun, require_wandb

            require_wandb()
            self.wandb = WandbRun(wandb) if active else None
        if active and tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(tensorboard_dir)
        self.bar = None
        if active and progress_bar and sys.stdout.isatty() and not os.environ.get("MEGALITE_QUIET"):
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total_iters, unit="it", dynamic_ncols=True, leave=False)
            except ImportError:
                pass

    def configuration(self, toml_text: str, metrics_file: str | None, values: dict | None = None) -> None:
        """The run's configuration beside its records: `<metrics file>.config.toml`, TensorBoard's
        text tab, and W&B's config (`values`: the same configuration as {section: {field: value}}).
        Written once, at the start."""
        if not self.active:
            return
        if metrics_file:
            with open(f"{metrics_file}.config.toml", "w", encoding="utf-8") as f:
                f.write(toml_text)
        if self.tb is not None:
            self.tb.add_text("config", "```toml\n" + toml_text + "```", 0)
        if self.wandb is not None and values is not None:
            self.wandb.config(values)

    def _scalars(self, scalars: dict[str, float], step: int) -> None:
        """The one place scalars go out: TensorBoard and W&B get the same tags at the same step."""
        if self.tb is not None:
            for tag, value in scalars.items():
                self.tb.add_scalar(tag, value, step)
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(scalars, step)

    def say(self, line: str) -> None:
        if not self.active or os.environ.get("MEGALITE_QUIET"):
            return
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def step(self, loss: float | None = None) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def train(self, record: dict) -> None:
        if not self.active:
            return
        self.say(format_log_line(record))
        self.metrics.write(record)
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{record['loss']:.4f}")
        scalars = {f"train/{k}": record[k] for k in (*_TENSORBOARD_KEYS, *_loss_term_keys(record))
                   if record.get(k) is not None}
        scalars.update({f"comm_bytes/{kind}": nbytes for kind, nbytes in record.get("comm_bytes", {}).items()})
        self._scalars(scalars, record["iteration"])

    def evaluation(self, iteration: int, values: dict[str, float], perplexity_of: str | None = None,
                   name: str | None = None, split: str = "valid", scalars: bool = True) -> None:
        """values: {'loss': mean loss, and the task's named terms}. The perplexity is exp of the
        term `perplexity_of` (BERT: the MLM loss alone), else of the whole loss. `name`: which of
        --multiple-validation-sets (in the line, the record's "valid_set", TensorBoard's valid/NAME/).
        `split` "test": the test split once training ends (test_loss, TensorBoard's test/). `scalars`
        False: the line and the record only (--skip-train, as Megatron-LM writes no TensorBoard then)."""
        if not self.active:
            return
        loss = values["loss"]
        ppl = math.exp(min(values[perplexity_of or "loss"], 80.0))
        terms = {f"{split}_{k}": v for k, v in values.items() if k != "loss"}
        what = f"{perplexity_of.removesuffix('_loss')} perplexity" if perplexity_of else "perplexity"
        self.say(" | ".join([f"{'validation' if split == 'valid' else split}{'' if name is None else f' ({name})'} at "
                             f"iteration {iteration}", f"loss {loss:.6f}",
                             *(f"{k.removeprefix(split + '_')} {v:.6f}" for k, v in terms.items()), f"{what} {ppl:.3f}"]))
        self.metrics.write({"iteration": iteration, "split": split, **({} if name is None else {"valid_set": name}),
                            f"{split}_loss": loss, **terms, f"{split}_ppl": ppl})
        tag = f"{split}/" if name is None else f"{split}/{name}/"
        if scalars:
            self._scalars({f"{tag}loss": loss, **{f"{tag}{k.removeprefix(split + '_')}": v for k, v in terms.items()},
                           f"{tag}ppl": ppl}, iteration)

    def tasks(self, iteration: int, scores: dict[str, float]) -> None:
        """--eval-tasks: lm-eval's metrics ('task/metric' -> value)."""
        if not self.active:
            return
        self.say(" | ".join([f"lm-eval at iteration {iteration}", *(f"{k} {v:.6g}" for k, v in scores.items())]))
        self.metrics.write({"iteration": iteration, "split": "lm_eval", **scores})
        self._scalars({f"lm_eval/{k}": v for k, v in scores.items()}, iteration)

    def close(self, exit_code: int = 0) -> None:
        """At the end of training (`exit_code` 0), or when it stops on an error (W&B marks the run
        failed); a second call does nothing."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            self.wandb.finish(exit_code)
            self.wandb = None
        self.metrics.close()
