"""`generate`: completions of a batch of prompts from this rank's model chunks, at any tp x pp
(x ep) layout; every rank of the model calls it with the same prompts and gets the same tokens.

The prompts are left-padded into one batch, prefilled in one step (the whole prompts through the
model, their keys and values cached), then decoded one token a step against the cache
(megalite.generation.cache). A row stops at its end-of-sequence token (kept as its last token);
the loop stops when every row has, or after `max_new_tokens`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Sequence

import torch

from megalite.generation.cache import KVCache
from megalite.generation.sampling import Sampling, next_tokens
from megalite.generation.stages import Stages


@dataclass
class Completions:
    """tokens[i]: the new token ids of prompt i (ending with the end-of-sequence id where it
    stopped there); texts[i]: them detokenized (without that id) where a tokenizer was given;
    logits: with `return_logits`, on the last stage, each step's [b, vocab] fp32 logits."""
    prompts: list[list[int]]
    tokens: list[list[int]]
    texts: list[str] | None = None
    logits: list[torch.Tensor] | None = field(default=None, repr=False)


def prompt_ids(prompts: Sequence, tokenizer=None) -> list[list[int]]:
    """Token ids of each prompt: lists of ids as given; text through `tokenizer` (with its
    beginning-of-sequence id in front where its encoding adds one)."""
    out = []
    for p in prompts:
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError("text prompts need a tokenizer (--tokenizer, or one named by the checkpoint's run)")
            ids = tokenizer.tokenize(p)
            if getattr(tokenizer, "add_bos", False) and tokenizer.bos is not None:
                ids = [tokenizer.bos] + ids
        else:
            ids = [int(t) for t in p]
        if not ids:
            raise ValueError(f"prompt {len(out)} has no tokens: give at least one")
        out.append(ids)
    if not out:
        raise ValueError("no prompts to complete")
    return out


@contextlib.contextmanager
def eval_mode(chunks):
    """The chunks in eval mode for the block, then back in the modes they had."""
    modes = [c.training for c in chunks]
    for c in chunks:
        c.eval()
    try:
        yield
    finally:
        for c, mode in zip(chunks, modes):
            c.train(mode)


def generate(model_chunks, prompts: Sequence, tokenizer=None, max_new_tokens: int = 32, temperature: float = 0.0,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0, eos_id: int | Sequence[int] | None = -1,
             v_shape: bool = False, return_logits: bool = False) -> Completions:
    """Complete `prompts` (texts, with `tokenizer`, or lists of token ids) with this rank's
    `model_chunks` (GPTModel, one per virtual stage it holds, in chunk order; `v_shape` for V
    schedules). Greedy at temperature 0, else sampled after top-k / top-p filtering from a generator
    seeded with `seed` (the same draws on every rank). `eos_id`: the id (or ids) that end a row
    (default -1: the tokenizer's end-of-document id; None: none ends it)."""
    sampling = Sampling(temperature, top_k, top_p, seed)
    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    ids = prompt_ids(prompts, tokenizer)
    if isinstance(eos_id, int) and eos_id == -1:
        eos_id = getattr(tokenizer, "eod", None)
    stop = [] if eos_id is None else [eos_id] if isinstance(eos_id, int) else [int(t) for t in eos_id]
    stages = Stages(model_chunks, v_shape)
    config = stages.config
    longest = max(len(p) for p in ids)
    if longest + max_new_tokens > config.max_position_embeddings:
        raise ValueError(f"the longest prompt ({longest} tokens) + --max-new-tokens {max_new_tokens} exceeds the "
                         f"model's max_position_embeddings ({config.max_position_embeddings})")
    if any(t < 0 or t >= config.vocab_size for p in ids for t in p):
        raise ValueError(f"a prompt holds a token id outside the model's vocabulary (0..{config.vocab_size - 1}): "
                         f"is the tokenizer the model's?")
    device, b = stages.device, len(ids)
    pad = [longest - len(p) for p in ids]
    filler = stop[0] if stop else 0
    batch = torch.tensor([[filler] * n + p for n, p in zip(pad, ids)], dtype=torch.long, device=device)
    cache = KVCache(pad, longest + max_new_tokens, device, max_position=config.max_position_embeddings)
    generator = sampling.generator(device) if stages.samples else None
    done = torch.zeros(b, dtype=torch.bool, device=device)
    stop_ids = torch.tensor(stop, dtype=torch.long, device=device)
    new, logits_seen = [], []
    with torch.no_grad(), eval_mode(stages.chunks):
        step_ids = batch
        for _ in range(max_new_tokens):
            logits = stages.forward(step_ids, cache, step_ids.shape[1])
            token = None
            if logits is not None:
                logits = logits[:, -1]
                token = next_tokens(logits, sampling, generator)
                if return_logits:
                    logits_seen.append(logits)
            token = stages.share(token, b)
            token = torch.where(done, torch.full_like(token, filler), token)
            new.append(token)
            if stop:
                done |= torch.isin(token, stop_ids)
                if bool(done.all()):
                    break
            step_ids = token.unsqueeze(1)
    return _completions(ids, torch.stack(new, dim=1).tolist(), set(stop), tokenizer,
                        logits_seen if return_logits and stages.samples else None)


def _completions(prompts, rows, stop: set[int], tokenizer, logits) -> Completions:
    tokens = []
    for row in rows:
        ends = [i for i, t in enumerate(row) if t in stop]
        tokens.append(row[:ends[0] + 1] if ends else row)
    texts = None
    if tokenizer is not None:
        texts = [tokenizer.detokenize([t for t in row if t not in stop]) for row in tokens]
    return Completions(prompts, tokens, texts, logits)
