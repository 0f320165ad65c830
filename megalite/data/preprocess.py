"""Tokenize text into an indexed dataset (.bin/.idx, Megatron-LM's layout).

    python -m megalite.data.preprocess --input corpus.jsonl --tokenizer tok.model --output-prefix data/corpus \\
        --append-eod --workers 8

Megatron-LM's tokenizer flags work instead of --tokenizer (`--tokenizer-type GPT2BPETokenizer --vocab-file
vocab.json --merge-file merges.txt`, BertWordPiece*, HuggingFaceTokenizer, SentencePieceTokenizer).

Input: JSON lines (`.jsonl`/`.json`, one document per line, text under --json-key) or plain text
(one document per file, or per line with --plain-text-docs line). With --split-sentences each
document is stored as its lines (non-empty), one sequence each, as BERT's sentence pairs need.
Documents are tokenized in parallel workers, written in input order. A Hugging Face tokenizer
whose own encoding starts a text with its BOS token (Llama 3's <|begin_of_text|>) starts every
document with it (not with --split-sentences); --append-eod ends each with its EOS token
(Llama 3 base: <|end_of_text|>; the tokenizer directory's eos_token).
"""
from __future__ import annotations

import argparse
import json
import sys
from multiprocessing import get_context
from pathlib import Path

from megalite.data.indexed import IndexedDatasetWriter, token_dtype
from megalite.data.tokenizers import build_tokenizer

_TOKENIZER = None


def _decode(data: bytes, path: Path, first_line: int = 1) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = first_line + data.count(b"\n", 0, e.start)
        raise ValueError(f"{path}:{line}: not valid UTF-8 (byte {data[e.start]:#04x}): convert the file to UTF-8, "
                         f"e.g. with iconv") from None


def _json_lines(path: Path, json_key: str):
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            line = _decode(raw, path, lineno)
            if not line.strip():
                continue
            try:
                text = json.loads(line)[json_key]
            except (json.JSONDecodeError, KeyError, TypeError, IndexError) as e:
                raise ValueError(f"{path}:{lineno}: not a JSON object with a {json_key!r} field ({e})") from None
            if not isinstance(text, str):
                raise ValueError(f"{path}:{lineno}: the {json_key!r} field is {type(text).__name__} "
                                 f"{json.dumps(text)[:40]}, not a string")
            yield text


def read_documents(paths, json_key: str = "text", plain_text_docs: str = "file"):
    """Documents as strings; bad input raises ValueError naming the file and line."""
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"input file {path} does not exist")
        if path.suffix in (".jsonl", ".json"):
            yield from _json_lines(path, json_key)
            continue
        text = _decode(path.read_bytes(), path).replace("\r\n", "\n").replace("\r", "\n")  # as read_text()
        if plain_text_docs == "line":
            yield from (line for line in text.splitlines() if line.strip())
        else:
            yield text


def _init_worker(tokenizer_spec):
    global _TOKENIZER
    _TOKENIZER = build_tokenizer(tokenizer_spec)


def _encode(job):
    text, split_sentences, append_eod = job
    tok = _TOKENIZER
    parts = [line for line in text.splitlines() if line.strip()] if split_sentences else [text]
    seqs = [tok.tokenize(p + ("\n" if split_sentences else "")) for p in parts]
    seqs = [s for s in seqs if s]
    if tok.add_bos and seqs and not split_sentences:  # BERT's sequences get [CLS] / [SEP] later instead
        seqs[0] = [tok.bos] + seqs[0]
    if append_eod and seqs:
        seqs[-1] = seqs[-1] + [tok.eod]
    return seqs, len(text.encode("utf-8", errors="replace"))


def preprocess(inputs, tokenizer_spec: str | tuple, output_prefix: str, workers: int = 1, json_key: str = "text",
               plain_text_docs: str = "file", split_sentences: bool = False, append_eod: bool = False,
               progress: bool | None = None) -> dict:
    """Write output_prefix.bin/.idx; return counts {documents, sequences, tokens, bytes}."""
    tokenizer = build_tokenizer(tokenizer_spec)
    if append_eod:
        tokenizer.require("eod")
    with IndexedDatasetWriter(output_prefix, token_dtype(tokenizer.vocab_size)) as writer:
        stats = _write_documents(writer, inputs, tokenizer_spec, workers, json_key, plain_text_docs, split_sentences,
                                 append_eod, progress)
        writer.finalize()
    return stats


def _write_documents(writer, inputs, tokenizer_spec, workers, json_key, plain_text_docs, split_sentences, append_eod,
                     progress) -> dict:
    jobs = ((text, split_sentences, append_eod) for text in read_documents(inputs, json_key, plain_text_docs))
    stats = {"documents": 0, "sequences": 0, "tokens": 0, "bytes": 0}
    show = sys.stderr.isatty() if progress is None else progress
    bar = None
    if show:
        try:
            from tqdm import tqdm

            bar = tqdm(unit="doc", desc="preprocess", file=sys.stderr)
        except ImportError:
            bar = None
    pool = get_context("spawn").Pool(workers, _init_worker, (tokenizer_spec,)) if workers > 1 else None
    try:
        if pool is None:
            _init_worker(tokenizer_spec)
            results = map(_encode, jobs)
        else:
            results = pool.imap(_encode, jobs, chunksize=16)
        for seqs, nbytes in results:
            if not seqs:
                continue
            writer.add_document(seqs)
            stats["documents"] += 1
            stats["sequences"] += len(seqs)
            stats["tokens"] += sum(len(s) for s in seqs)
            stats["bytes"] += nbytes
            if bar is not None:
                bar.update(1)
    finally:
        if pool is not None:
            pool.close()
            pool.join()
        if bar is not None:
            bar.close()
    return stats


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m megalite.data.preprocess", description=__doc__.split("\n")[0])
    ap.add_argument("--input", nargs="+", required=True, help="JSON-lines or plain-text files")
    ap.add_argument("--tokenizer", help="SentencePiece .model file or Hugging Face tokenizer dir")
    megatron = ap.add_argument_group("Megatron-LM's tokenizer flags (instead of --tokenizer)")
    megatron.add_argument("--tokenizer-type", help="GPT2BPETokenizer, BertWordPieceLowerCase, BertWordPieceCase, "
                                                   "HuggingFaceTokenizer, SentencePieceTokenizer, ...")
    megatron.add_argument("--vocab-file")
    megatron.add_argument("--merge-file")
    megatron.add_argument("--tokenizer-model")
    ap.add_argument("--output-prefix", required=True)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--json-key", default="text")
    ap.add_argument("--plain-text-docs", choices=["file", "line"], default="file")
    ap.add_argument("--split-sentences", action="store_true", help="one sequence per line (BERT)")
    ap.add_argument("--append-eod", action="store_true", help="end each document with the EOD token (GPT)")
    a = ap.parse_args(argv)
    if bool(a.tokenizer) == bool(a.tokenizer_type):
        ap.error("give --tokenizer, or Megatron-LM's --tokenizer-type with its files (one of the two)")
    spec = a.tokenizer or (a.tokenizer_type, a.vocab_file, a.merge_file, a.tokenizer_model)
    try:
        stats = preprocess(a.input, spec, a.output_prefix, a.workers, a.json_key, a.plain_text_docs,
                           a.split_sentences, a.append_eod)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"megalite: error: {e}")
    print(f"wrote {a.output_prefix}.bin/.idx: {stats['documents']} documents, {stats['sequences']} sequences, "
          f"{stats['tokens']} tokens from {stats['bytes']} bytes")


if __name__ == "__main__":
    main()
