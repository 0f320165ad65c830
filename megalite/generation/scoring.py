"""Scoring continuations: the log-probability a model gives a continuation after its context, and
whether greedy decoding would have produced it; the forward of evaluation harnesses (lm-eval's
`loglikelihood`, megalite.generation.lm_eval_adapter) at any tp x pp (x ep) layout.

A batch of (context, continuation) pairs is left-padded into one row each and run in one step
through every stage (megalite.generation.stages; the cache only supplies positions and the mask,
nothing is decoded after it); the last stage reads the fp32 log-softmax of the whole vocabulary
(TP logits gathered) at each continuation position, and the sums go to every rank of the pipeline.
Every rank of the model calls it with the same pairs and gets the same numbers.
"""
from __future__ import annotations

from typing import Sequence

import torch

from megalite.generation.cache import KVCache
from megalite.generation.generate import eval_mode
from megalite.generation.stages import Stages


def score(model_chunks, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], batch_size: int = 8,
          v_shape: bool = False) -> list[tuple[float, bool]]:
    """For each (context ids, continuation ids): (sum of log p(continuation token | everything
    before it), whether each continuation token is the argmax there). The context must hold at
    least one token; context + continuation - 1 tokens must fit the model's positions (truncate
    the context's left side before calling, as harnesses do)."""
    if batch_size < 1:
        raise ValueError(f"batch size must be >= 1, got {batch_size}")
    stages = Stages(model_chunks, v_shape)
    limit, vocab = stages.config.max_position_embeddings, stages.config.vocab_size
    rows = []
    for i, (context, continuation) in enumerate(pairs):
        context, continuation = [int(t) for t in context], [int(t) for t in continuation]
        if not context or not continuation:
            raise ValueError(f"pair {i}: the context and the continuation each need at least one token")
        tokens = context + continuation
        if len(tokens) - 1 > limit:
            raise ValueError(f"pair {i}: {len(tokens) - 1} input tokens exceed the model's max_position_embeddings "
                             f"({limit}): truncate the context's left side")
        if any(t < 0 or t >= vocab for t in tokens):
            raise ValueError(f"pair {i} holds a token id outside the model's vocabulary (0..{vocab - 1})")
        rows.append((tokens, len(continuation)))
    # Longest first, so a batch's padding is small (each row's numbers do not depend on its batch).
    order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
    out: list[tuple[float, bool] | None] = [None] * len(rows)
    with torch.no_grad(), eval_mode(stages.chunks):
        for start in range(0, len(order), batch_size):
            batch = order[start:start + batch_size]
            for i, value in zip(batch, _score_batch(stages, [rows[i] for i in batch])):
                out[i] = value
    return out


def _score_batch(stages: Stages, rows) -> list[tuple[float, bool]]:
    inputs = [tokens[:-1] for tokens, _ in rows]
    longest = max(len(x) for x in inputs)
    pad = [longest - len(x) for x in inputs]
    ids = torch.tensor([[0] * n + x for n, x in zip(pad, inputs)], dtype=torch.long, device=stages.device)
    cache = KVCache(pad, longest, stages.device, max_position=stages.config.max_position_embeddings, all_logits=True)
    logits = stages.forward(ids, cache, longest)  # [b, longest, vocab] on the last stage
    result = torch.empty(len(rows), 2, dtype=torch.float64, device=stages.device)
    if logits is not None:
        logprobs = torch.log_softmax(logits, dim=-1)
        for r, (tokens, n) in enumerate(rows):
            target = torch.tensor(tokens[-n:], dtype=torch.long, device=stages.device)
            at = logprobs[r, longest - n:]  # the positions that predict the continuation
            result[r, 0] = at.gather(1, target[:, None]).sum().double()
            result[r, 1] = float(bool((at.argmax(dim=-1) == target).all()))
    return [(float(s), bool(g)) for s, g in stages.from_last_stage(result).tolist()]
