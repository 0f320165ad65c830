"""Supervised fine-tuning data: conversations from a JSON-lines file, the loss on the replies only,
packed into sequences whose documents attend only to themselves.

A record is `{"prompt": ..., "response": ...}` or `{"messages": [{"role": ..., "content": ...}, ...]}`.
- prompt/response: the prompt's tokens then the response's, then the EOD (with the tokenizer's BOS
  first where its own encoding starts with one); the loss on the response and the EOD.
- messages: rendered with the tokenizer's own chat template (Hugging Face's `apply_chat_template`);
  the loss on every assistant turn, as the template renders it (its end-of-turn marker too), plus
  the EOD that megalite appends to end the conversation.
A conversation is one document: it ends with the EOD, so megalite.data.documents finds it, and
training confines attention to it and counts its positions from 0 (Megatron-LM's
--reset-attention-mask and --reset-position-ids, one implementation).

Packing: conversations in file order fill rows of seq_length + 1 tokens greedily (inputs are the
first seq_length, labels the last); a conversation that does not fit in the row's room starts the
next row; the rest of a row is EODs with no loss (one-token documents). A conversation longer than
a row is cut to it (its loss on what is kept), counted in one note. Without packing
(`pack=False`) every conversation has a row of its own.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from megalite.data.indexed import DatasetError


@dataclass(frozen=True)
class Conversation:
    tokens: list[int]
    trained: list[bool]  # per token: is it a target of the loss (a reply's token)


def read_records(path: str | Path) -> list[dict]:
    """The records of a JSON-lines file; a bad line is one error naming the line."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"--sft-data-path {path} does not exist")
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path} line {number} is not JSON ({e.msg}): give one JSON object a line") from None
            if not isinstance(record, dict) or not ({"prompt", "response"} <= record.keys() or "messages" in record):
                raise DatasetError(f"{path} line {number} has neither \"prompt\" and \"response\" nor \"messages\": "
                                   f"give one of the two forms")
            records.append(record)
    if not records:
        raise DatasetError(f"--sft-data-path {path} holds no records")
    return records


def conversation(record: dict, tokenizer) -> Conversation:
    """One record's tokens and which of them the loss trains on (the EOD appended)."""
    tokenizer.require("eod")
    if "messages" in record:
        tokens, trained = _chat(record["messages"], tokenizer)
    else:
        head = [tokenizer.bos] if tokenizer.add_bos and tokenizer.bos is not None else []
        prompt = head + tokenizer.tokenize(str(record["prompt"]))
        response = tokenizer.tokenize(str(record["response"]))
        tokens, trained = prompt + response, [False] * len(prompt) + [True] * len(response)
    return Conversation(tokens + [tokenizer.eod], trained + [True])


def _chat(messages: list[dict], tokenizer) -> tuple[list[int], list[bool]]:
    """The template's rendering of the whole conversation, and its assistant turns marked: turn k is
    what rendering messages[:k + 1] adds to rendering messages[:k] with the generation prompt."""
    template = getattr(getattr(tokenizer, "tok", None), "chat_template", None)
    if not template:
        raise DatasetError("\"messages\" records are rendered with the tokenizer's chat template, and this tokenizer "
                           "has none: use a Hugging Face tokenizer with a chat_template, or prompt/response records")

    def render(upto: int, generation_prompt: bool = False) -> list[int]:
        out = tokenizer.tok.apply_chat_template(messages[:upto], tokenize=True, add_generation_prompt=generation_prompt)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    tokens = render(len(messages))
    trained = [False] * len(tokens)
    for k, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before, through = render(k, generation_prompt=True), render(k + 1)
        if through[:len(before)] != before or tokens[:len(through)] != through:
            raise DatasetError("the chat template renders a conversation's start differently once more turns follow, "
                               "so its assistant turns cannot be found: use prompt/response records")
        for i in range(len(before), len(through)):
            trained[i] = True
    return tokens, trained


class SFTDataset:
    """Packed (or one a row) conversations as GPT samples: `batch(indices)` gives tokens, labels and a
    loss mask [b, seq_length]; sample k is row `order[k mod rows]`, the rows shuffled once per epoch
    with `seed`, so every DP layout and a resumed run read the same samples."""

    def __init__(self, conversations: list[Conversation], seq_length: int, eod: int, seed: int, pack: bool = True):
        self.seq_length, self.eod = seq_length, eod
        self.rows, self.cut = _pack(conversations, seq_length + 1, eod, pack)
        self.seed = seed

    def __len__(self) -> int:
        return len(self.rows)

    def _row(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        epoch, within = divmod(k, len(self.rows))
        order = np.random.RandomState((self.seed + epoch) % 2**32).permutation(len(self.rows))
        return self.rows[int(order[within])]

    def batch(self, indices) -> dict[str, torch.Tensor]:
        rows = [self._row(k) for k in indices]
        tokens = torch.from_numpy(np.stack([r[0] for r in rows]).astype(np.int64))
        trained = torch.from_numpy(np.stack([r[1] for r in rows]))
        # Position i predicts token i + 1: the loss counts where that token is a reply's.
        return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
                "loss_mask": trained[:, 1:].float().contiguous()}


def _pack(conversations, row_length: int, eod: int, pack: bool):
    rows, tokens, trained, cut = [], [], [], 0

    def close():
        room = row_length - len(tokens)
        rows.append((np.array(tokens + [eod] * room, dtype=np.int64), np.array(trained + [False] * room)))

    for c in conversations:
        t, m = c.tokens, c.trained
        if len(t) > row_length:
            t, m, cut = t[:row_length], m[:row_length], cut + 1
        if tokens and (not pack or len(tokens) + len(t) > row_length):
            close()
            tokens, trained = [], []
        tokens, trained = tokens + t, trained + m
    if tokens:
        close()
    return rows, cut


def build_sft_datasets(path, tokenizer, seq_length: int, split_weights: list[float], seed: int,
                       pack: bool = True) -> tuple[SFTDataset, SFTDataset | None]:
    """(train, valid or None): the file's conversations split in order by the first two weights of
    --split (train, valid)."""
    conversations = [conversation(r, tokenizer) for r in read_records(path)]
    n = len(conversations)
    n_valid = int(round(n * split_weights[1] / sum(split_weights))) if len(split_weights) > 1 else 0
    n_train = n - n_valid - (int(round(n * split_weights[2] / sum(split_weights))) if len(split_weights) > 2 else 0)
    if n_train <= 0:
        raise DatasetError(f"--split leaves none of the {n} conversations of {path} for training")
    train = SFTDataset(conversations[:n_train], seq_length, tokenizer.eod, seed, pack)
    valid = SFTDataset(conversations[n_train:n_train + n_valid], seq_length, tokenizer.eod, seed + 1, pack) \
        if n_valid else None
    return train, valid
