"""The embedded default corpus: Python's standard-library sources, present on every machine.

With no --data-path, the entry points train on it: the first call collects the sources (a fixed,
sorted selection of at most `max_bytes`), trains a SentencePiece tokenizer on them and preprocesses
them twice (whole files with an end-of-document token for GPT; line by line for BERT's sentence
pairs) into a cache directory. Later calls, and the other ranks of the same job (they wait on a
file lock), reuse it.
"""
from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from megalite.data.cache import file_lock
from megalite.data.preprocess import preprocess
from megalite.data.tokenizers import train_sentencepiece


@dataclass
class EmbeddedCorpus:
    tokenizer: str  # SentencePiece .model
    gpt_prefix: str  # documents = files, EOD appended
    bert_prefix: str  # documents = files, sequences = lines


def default_cache_dir() -> Path:
    base = os.environ.get("MEGALITE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "megalite")
    return Path(base)


def stdlib_sources(max_bytes: int) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if any(p in ("site-packages", "dist-packages", "test", "tests", "idlelib") for p in rel):
            continue
        size = path.stat().st_size
        if size == 0 or total + size > max_bytes:
            continue
        files.append(path)
        total += size
    return files


def embedded_corpus(vocab_size: int = 4096, max_bytes: int = 6_000_000, cache_dir: Path | None = None,
                    log=print) -> EmbeddedCorpus:
    files = stdlib_sources(max_bytes)
    if not files:
        raise FileNotFoundError("no Python standard-library sources found for the embedded corpus; "
                                "give --data-path and --tokenizer")
    fingerprint = hashlib.sha256(
        "\n".join(f"{p}:{p.stat().st_size}" for p in files).encode() + f"{vocab_size}{sys.version}".encode()
    ).hexdigest()[:12]
    out = (cache_dir or default_cache_dir()) / f"stdlib-corpus-{fingerprint}"
    corpus = EmbeddedCorpus(str(out / "tokenizer.model"), str(out / "gpt"), str(out / "bert"))
    done = out / "READY"
    with file_lock(out.parent / f".{out.name}.lock"):
        if not done.exists():
            out.mkdir(parents=True, exist_ok=True)
            log(f"megalite: building the embedded corpus from {len(files)} standard-library files "
                f"into {out} (once)")
            text = out / "sentences.txt"
            with open(text, "w", encoding="utf-8") as f:
                for path in files:
                    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
                        if line.strip():
                            f.write(line + "\n")
            train_sentencepiece([text], str(out / "tokenizer"), vocab_size)
            text.unlink()
            workers = min(4, os.cpu_count() or 1)
            preprocess(files, corpus.tokenizer, corpus.gpt_prefix, workers=workers, append_eod=True, progress=False)
            preprocess(files, corpus.tokenizer, corpus.bert_prefix, workers=workers, split_sentences=True,
                       progress=False)
            done.write_text("ok\n")
    return corpus
