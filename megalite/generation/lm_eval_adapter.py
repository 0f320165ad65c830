"""lm-evaluation-harness (`lm_eval`) scores megalite model chunks directly, at any tp x pp (x ep)
layout: `MegaliteLM` is its model interface (a `TemplateLM`, the base of its own Hugging Face model).

- `loglikelihood`: one forward over each (context, continuation) through megalite.generation.scoring;
  lm-eval's `TemplateLM` tokenizes the pair (a context's trailing spaces move to the continuation),
  the context is truncated on the left to the model's positions, as lm-eval's Hugging Face model does.
- `loglikelihood_rolling`: lm-eval's own disjoint windows of the model's length, each scored.
- `generate_until`: megalite.generation.generate (greedy, or sampled with the request's temperature),
  the text cut at the first stop string, the end-of-sequence token's text being one of them.

Tokens go through the megalite tokenizer the model trained with, and without special tokens unless
asked (`add_bos_token`), as lm-eval's Hugging Face model encodes. Every rank of a model calls each
method with the same requests; with `shard_over_data_parallel` lm-eval deals requests over the
data-parallel replicas (its `rank` / `world_size` are the replica's) and gathers their results.
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
import torch.distributed as dist

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as e:  # an optional dependency: one line that says how to get it
    raise ImportError("lm-eval is not installed: `pip install megalite[eval]` (lm-eval==0.4.13)") from e

from megalite.generation.generate import generate
from megalite.generation.scoring import score
from megalite.generation.stages import chunks_device


class MegaliteLM(TemplateLM):
    """`model_chunks`: this rank's GPTModel chunks (one per virtual stage it holds, `v_shape` for V
    schedules); `tokenizer`: a megalite tokenizer (megalite.data.build_tokenizer). `max_length`: the
    longest input (default: the model's max_position_embeddings)."""

    def __init__(self, model_chunks, tokenizer, batch_size: int = 8, max_length: int | None = None,
                 max_gen_toks: int = 256, add_bos_token: bool = False, seed: int = 0, v_shape: bool = False,
                 shard_over_data_parallel: bool = False):
        super().__init__()
        self.chunks, self.v_shape = list(model_chunks), v_shape
        if tokenizer is None or tokenizer.eod is None:
            raise ValueError("lm-eval needs the model's tokenizer, with an end-of-sequence token")
        self.megalite_tokenizer = tokenizer
        self.tokenizer = getattr(tokenizer, "tok", None)  # a Hugging Face tokenizer's chat template, where one is
        config = self.chunks[0].config
        self._max_length = int(max_length or config.max_position_embeddings)
        self._max_gen_toks, self.add_bos_token, self.seed = max_gen_toks, add_bos_token, seed
        self.batch_size = int(batch_size)
        self._device = chunks_device(self.chunks)
        self._group = None
        if shard_over_data_parallel:
            from megalite import parallel

            self._group = parallel.get_data_parallel_group()
            self._rank, self._world_size = parallel.get_data_parallel_rank(), parallel.get_data_parallel_world_size()

    # --- tokens ----------------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.megalite_tokenizer.eod

    @property
    def prefix_token_id(self) -> int:
        bos = self.megalite_tokenizer.bos
        return self.eot_token_id if bos is None else bos

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", type(self.megalite_tokenizer).__name__).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        special = self.add_bos_token if add_special_tokens is None else add_special_tokens
        if self.tokenizer is not None:
            return self.tokenizer.encode(string, add_special_tokens=special)
        ids = self.megalite_tokenizer.tokenize(string)
        bos = self.megalite_tokenizer.bos
        return [bos] + ids if special and bos is not None and self.megalite_tokenizer.add_bos else ids

    def tok_decode(self, ids) -> str:
        if self.tokenizer is not None:
            return self.tokenizer.decode(ids, skip_special_tokens=True)
        return self.megalite_tokenizer.detokenize([t for t in ids if t != self.eot_token_id])

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("--apply-chat-template needs a Hugging Face tokenizer with a chat template")
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    # --- requests --------------------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        pairs = []
        for (context, continuation), context_enc, continuation_enc in requests:
            n = len(continuation_enc)
            if n > self.max_length:
                raise ValueError(f"a continuation of {n} tokens is longer than the model's {self.max_length}")
            tokens = (context_enc + continuation_enc)[-(self.max_length + 1):]  # the context cut on the left
            pairs.append((tokens[:-n], tokens[-n:]))
        out = score(self.chunks, pairs, self.batch_size, self.v_shape)
        for (request, _, _), answer in zip(requests, out):
            if request is not None:
                self.cache_hook.add_partial("loglikelihood", request, answer)
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        owners, pairs = [], []
        for i, (string,) in enumerate(req.args for req in requests):
            windows = get_rolling_token_windows(token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                                                max_seq_len=self.max_length, context_len=1)
            for context, continuation in map(make_disjoint_window, windows):
                owners.append(i)
                pairs.append((context, continuation))
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owners, score(self.chunks, pairs, self.batch_size, self.v_shape)):
            totals[i] += logprob
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        groups = defaultdict(list)  # one generation setting a batch, as lm-eval's own models group them
        for i, req in enumerate(requests):
            groups[json.dumps(req.args[1], sort_keys=True, default=str)].append(i)
        eos = (self.tokenizer.decode([self.eot_token_id]) if self.tokenizer is not None
               else self.megalite_tokenizer.detokenize([self.eot_token_id]))
        out: list[str | None] = [None] * len(requests)
        for indices in groups.values():
            kwargs = normalize_gen_kwargs(dict(requests[indices[0]].args[1]), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_new = kwargs.pop("max_gen_toks")
            room = self.max_length - max_new
            if room < 1:
                raise ValueError(f"max_gen_toks {max_new} leaves no room for a context in the model's {self.max_length} "
                                 f"positions: lower it in the task's generation_kwargs")
            temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
            contexts = [self.tok_encode(requests[i].args[0])[-room:] or [self.prefix_token_id] for i in indices]
            for start in range(0, len(indices), self.batch_size):
                batch = indices[start:start + self.batch_size]
                done = generate(self.chunks, contexts[start:start + self.batch_size], max_new_tokens=max_new,
                                temperature=temperature, top_k=int(kwargs.get("top_k") or 0),
                                top_p=float(kwargs.get("top_p") or 1.0), seed=self.seed, eos_id=self.eot_token_id,
                                v_shape=self.v_shape)
                for i, tokens in zip(batch, done.tokens):
                    text = postprocess_generated_text(self.tok_decode(tokens), until, None)
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out

    # --- data-parallel replicas (lm-eval deals requests by rank) ---------------------------------

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._group is None or self.world_size == 1:
            return tensor.reshape(1) if tensor.dim() == 0 else tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous(), group=self._group)
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj, dst: int = 0):
        if self._group is None or self.world_size == 1:
            return [obj]
        gathered = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, gathered, dst=dist.get_global_rank(self._group, dst), group=self._group)
        return gathered

    def barrier(self) -> None:
        if self._group is not None and self.world_size > 1:
            dist.barrier(group=self._group)


_MANAGERS: dict = {}  # lm-eval indexes its thousands of task files once a directory


def known_tasks(tasks: list[str], include_path: str | None = None):
    """lm-eval's task manager, once every name of `tasks` is known to it (else ValueError)."""
    from lm_eval.tasks import TaskManager

    if not tasks:
        raise ValueError("no lm-eval task named")
    if include_path is not None and not Path(include_path).is_dir():
        raise ValueError(f"the task directory {include_path} does not exist")
    if include_path not in _MANAGERS:
        _MANAGERS[include_path] = TaskManager(include_path=include_path)
    manager = _MANAGERS[include_path]
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ValueError(f"lm-eval knows no task {', '.join(unknown)}: check the names (`lm_eval ls tasks`) or give "
                         f"the directory of their YAML files (--include-path; --eval-tasks-path in training)")
    return manager


def evaluate_tasks(lm, tasks: list[str], include_path: str | None = None, limit: float | None = None,
                   num_fewshot: int | None = None, seed: int = 0, apply_chat_template: bool = False,
                   log_samples: bool = False) -> dict:
    """lm-eval's results dictionary for `tasks`, scored by `lm` (a MegaliteLM), on the ranks of the
    first data-parallel replica (lm-eval gathers there); `log_samples`: with each request's answers."""
    import lm_eval

    results = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=known_tasks(tasks, include_path), limit=limit, num_fewshot=num_fewshot,
                                      random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                                      fewshot_random_seed=seed, log_samples=log_samples, bootstrap_iters=0,
                                      apply_chat_template=apply_chat_template, verbosity="ERROR")
    return results or {}


def scores(results: dict) -> dict[str, float]:
    """'task/metric' -> value for every numeric metric (lm-eval's 'acc,none' named 'acc')."""
    out = {}
    for task, metrics in (results.get("results") or {}).items():
        for key, value in metrics.items():
            metric, _, flt = key.partition(",")
            if (isinstance(value, (int, float)) and not isinstance(value, bool) and not metric.endswith("_stderr")
                    and metric != "sample_len"):
                out[f"{task}/{metric if flt in ('', 'none') else metric + '_' + flt}"] = float(value)
    return out
