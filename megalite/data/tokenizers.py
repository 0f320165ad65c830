"""Tokenizers: SentencePiece (load a .model, or train one) and Hugging Face tokenizers saved in a
local directory, behind one small interface with the special tokens GPT and BERT need.

    python -m megalite.data.tokenizers train --input a.txt b.txt --vocab-size 8000 --output-prefix tok
    -> tok.model, usable as --tokenizer tok.model
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from megalite.data.errors import DatasetError

BERT_SPECIALS = ("[CLS]", "[SEP]", "[MASK]")
# Files a Hugging Face tokenizer directory holds (at least one): fast, WordPiece, BPE, SentencePiece.
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "spiece.model",
                      "tokenizer.model", "sentencepiece.bpe.model")
_EXPECTED = "a SentencePiece .model file or a directory holding a Hugging Face tokenizer (save_pretrained)"


class TokenizerError(DatasetError):
    """A tokenizer file or directory is missing, empty or unreadable."""


class Tokenizer:
    """ids = tok.tokenize(text) (no special tokens); tok.vocab_size; special ids: eod (end of
    document, GPT), bos (beginning of sequence), cls, sep, mask, pad (BERT). A special id is None
    when the tokenizer has no such token. `add_bos`: a document starts with bos, as the
    tokenizer's own encoding does (Llama's; not GPT-2's or Qwen's, which have none to add)."""

    vocab_size: int
    eod: int | None = None
    bos: int | None = None
    add_bos: bool = False
    cls: int | None = None
    sep: int | None = None
    mask: int | None = None
    pad: int | None = None

    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError

    def detokenize(self, ids) -> str:
        raise NotImplementedError

    def require(self, *names: str) -> None:
        missing = [n for n in names if getattr(self, n) is None]
        if missing:
            raise ValueError(f"the tokenizer has no {', '.join(missing)} token(s), which this model needs")


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, model_path: str | os.PathLike):
        import sentencepiece as spm

        if not Path(model_path).is_file():
            raise FileNotFoundError(f"SentencePiece model {model_path} does not exist")
        self.path = str(model_path)
        try:
            self.sp = spm.SentencePieceProcessor(model_file=self.path)
        except (RuntimeError, OSError) as e:  # sentencepiece reports a bad file as RuntimeError
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise TokenizerError(f"tokenizer {model_path} is not a readable SentencePiece model ({first}): "
                                 f"give {_EXPECTED}") from None
        self.vocab_size = self.sp.get_piece_size()
        self.eod = self.sp.eos_id() if self.sp.eos_id() >= 0 else None
        self.pad = self.sp.pad_id() if self.sp.pad_id() >= 0 else None
        for name, piece in zip(("cls", "sep", "mask"), BERT_SPECIALS):
            pid = self.sp.piece_to_id(piece)
            setattr(self, name, pid if pid != self.sp.unk_id() else None)

    def tokenize(self, text: str) -> list[int]:
        return self.sp.encode(text)

    def detokenize(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids])


class HuggingFaceTokenizer(Tokenizer):
    """Any tokenizer saved with `save_pretrained` in a local directory (nothing is downloaded)."""

    def __init__(self, directory: str | os.PathLike):
        if not Path(directory).is_dir():
            raise FileNotFoundError(f"Hugging Face tokenizer directory {directory} does not exist")
        _check_tokenizer_directory(Path(directory))
        try:
            from transformers import AutoTokenizer
        except ImportError as e:
            raise ImportError("Hugging Face tokenizers need `pip install megalite[hf]` (transformers)") from e
        try:
            tok = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
        except Exception as e:  # transformers raises OSError, ValueError, KeyError, ... for bad files
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            raise TokenizerError(f"tokenizer directory {directory} could not be loaded as a Hugging Face tokenizer "
                                 f"({type(e).__name__}: {first}): give {_EXPECTED}") from None
        self._adopt(tok)

    def _adopt(self, tok) -> None:
        self.tok = tok
        self.vocab_size = len(self.tok)
        self.eod = self.tok.eos_token_id if self.tok.eos_token_id is not None else self.tok.sep_token_id
        self.bos = self.tok.bos_token_id
        self.add_bos = _encoding_starts_with(self.tok, self.bos)
        self.cls, self.sep = self.tok.cls_token_id, self.tok.sep_token_id
        self.mask, self.pad = self.tok.mask_token_id, self.tok.pad_token_id

    def tokenize(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def detokenize(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids])


class VocabFileTokenizer(HuggingFaceTokenizer):
    """Megatron-LM's file-based tokenizers, built with the `tokenizers` library that transformers
    brings: GPT-2's byte-level BPE from vocab.json + merges.txt, BERT's WordPiece from vocab.txt
    (lower-cased or not)."""

    def __init__(self, kind: str, vocab_file: str, merge_file: str | None = None):
        try:
            from tokenizers import Tokenizer as Backend
            from tokenizers import decoders, models, normalizers, pre_tokenizers
            from transformers import PreTrainedTokenizerFast
        except ImportError as e:
            raise ImportError(f"--tokenizer-type {kind} needs `pip install megalite[hf]` (transformers)") from e
        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if path is not None and not Path(path).is_file():
                raise FileNotFoundError(f"{flag} {path} does not exist")
        try:
            if kind == "GPT2BPETokenizer":
                backend = Backend(models.BPE.from_file(vocab_file, merge_file))
                backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
                backend.decoder = decoders.ByteLevel()
                specials = dict(eos_token="<|endoftext|>", bos_token="<|endoftext|>", unk_token="<|endoftext|>")
            else:
                backend = Backend(models.WordPiece.from_file(vocab_file, unk_token="[UNK]"))
                backend.normalizer = normalizers.BertNormalizer(lowercase=kind.endswith("LowerCase"))
                backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
                backend.decoder = decoders.WordPiece()
                specials = dict(unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]", cls_token="[CLS]",
                                mask_token="[MASK]")
            tok = PreTrainedTokenizerFast(tokenizer_object=backend, **specials)
        except BaseException as e:  # noqa: BLE001 - the tokenizers library raises its own kinds (a Rust panic too)
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise TokenizerError(f"--tokenizer-type {kind}: {vocab_file} could not be read ({type(e).__name__}: "
                                 f"{str(e).strip()[:200]})") from None
        self._adopt(tok)


_SENTENCEPIECE_KINDS = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")


def megatron_tokenizer(kind: str, vocab_file: str | None, merge_file: str | None,
                       tokenizer_model: str | None) -> Tokenizer:
    """The tokenizer Megatron-LM's --tokenizer-type and file flags name."""
    needs = {"GPT2BPETokenizer": ("--vocab-file", "--merge-file"), "BertWordPieceLowerCase": ("--vocab-file",),
             "BertWordPieceCase": ("--vocab-file",), "HuggingFaceTokenizer": ("--tokenizer-model",),
             **{k: ("--tokenizer-model",) for k in _SENTENCEPIECE_KINDS}}
    if kind not in needs:
        raise TokenizerError(f"--tokenizer-type {kind} reads no files: it is for --mock-data runs")
    given = {"--vocab-file": vocab_file, "--merge-file": merge_file, "--tokenizer-model": tokenizer_model}
    missing = [flag for flag in needs[kind] if not given[flag]]
    if missing:
        raise TokenizerError(f"--tokenizer-type {kind} needs {' and '.join(missing)}")
    if kind == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model)
    if kind in _SENTENCEPIECE_KINDS:
        return SentencePieceTokenizer(tokenizer_model)
    return VocabFileTokenizer(kind, vocab_file, merge_file)


def _encoding_starts_with(tok, token_id: int | None) -> bool:
    """Whether the tokenizer's encoding with its special tokens (what `tok(text)` gives) puts
    `token_id` in front of a text, as Llama 3's template puts <|begin_of_text|>."""
    if token_id is None:
        return False
    probe = "a"
    with_specials, plain = tok(probe)["input_ids"], tok(probe, add_special_tokens=False)["input_ids"]
    return with_specials[:1] == [token_id] and plain[:1] != [token_id]


def _check_tokenizer_directory(directory: Path) -> None:
    """An empty directory, or one without tokenizer files (a wrong path), is named with what it lacks."""
    names = {p.name for p in directory.iterdir()}
    if not names:
        raise TokenizerError(f"tokenizer directory {directory} is empty: give {_EXPECTED}")
    if not names & set(HF_TOKENIZER_FILES):
        raise TokenizerError(f"tokenizer directory {directory} holds no tokenizer files (expected one of "
                             f"{', '.join(HF_TOKENIZER_FILES)}): give {_EXPECTED}")


def build_tokenizer(spec: str | os.PathLike | tuple) -> Tokenizer:
    """A `.model` file is SentencePiece; a directory is a Hugging Face tokenizer; a tuple (kind,
    vocab_file, merge_file, tokenizer_model) is one of Megatron-LM's --tokenizer-type kinds."""
    if isinstance(spec, tuple):
        return megatron_tokenizer(*spec)
    path = Path(spec)
    if path.is_dir():
        return HuggingFaceTokenizer(path)
    if path.suffix == ".model" or path.is_file():
        return SentencePieceTokenizer(path)
    raise FileNotFoundError(f"tokenizer {spec} not found: give {_EXPECTED}")


def train_sentencepiece(inputs, output_prefix: str, vocab_size: int, model_type: str = "bpe",
                        max_sentences: int = 2_000_000) -> SentencePieceTokenizer:
    """Train a SentencePiece model on text files (one sentence per line), with end-of-document,
    padding and the BERT special tokens built in. Writes output_prefix.model / .vocab."""
    import sentencepiece as spm

    Path(output_prefix).parent.mkdir(parents=True, exist_ok=True)
    spm.SentencePieceTrainer.train(
        input=[str(p) for p in inputs], model_prefix=str(output_prefix), vocab_size=vocab_size,
        model_type=model_type, character_coverage=1.0, byte_fallback=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=3, user_defined_symbols=list(BERT_SPECIALS),
        input_sentence_size=max_sentences, shuffle_input_sentence=True, num_threads=os.cpu_count() or 1,
        minloglevel=2, split_digits=True, allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity",
    )
    return SentencePieceTokenizer(f"{output_prefix}.model")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m megalite.data.tokenizers")
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train", help="train a SentencePiece model on text files")
    t.add_argument("--input", nargs="+", required=True)
    t.add_argument("--vocab-size", type=int, default=32000)
    t.add_argument("--model-type", choices=["bpe", "unigram"], default="bpe")
    t.add_argument("--output-prefix", required=True)
    a = ap.parse_args(argv)
    tok = train_sentencepiece(a.input, a.output_prefix, a.vocab_size, a.model_type)
    print(f"wrote {a.output_prefix}.model ({tok.vocab_size} pieces)")


if __name__ == "__main__":
    main()
