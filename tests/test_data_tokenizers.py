"""Special tokens of Hugging Face tokenizer directories in preprocessing: a byte-level BPE built
locally with `tokenizers` (nothing downloaded), with Llama 3's <|begin_of_text|> / <|end_of_text|>."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from megalite.data import IndexedDataset  # noqa: E402
from megalite.data.preprocess import preprocess  # noqa: E402
from megalite.data.tokenizers import build_tokenizer  # noqa: E402

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
DOCS = ["hello world, a tiny corpus.", "a second document"]


def _byte_level_bpe(directory, adds_bos: bool):
    """A Llama-3-style tokenizer directory: byte-level BPE, bos/eos named in its config, and (if
    `adds_bos`) a template that puts BOS before every encoded text, as Llama 3's does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(DOCS * 20, trainer)
    if adds_bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                                           special_tokens=[(BOS, tok.token_to_id(BOS))])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS).save_pretrained(directory)
    return directory


def _documents(tmp_path, tokenizer_dir, **options):
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    preprocess([tmp_path / "in.jsonl"], str(tokenizer_dir), str(tmp_path / "out"), progress=False, **options)
    data = IndexedDataset(tmp_path / "out")
    return [data[i].tolist() for i in range(len(data))]


def test_a_llama3_style_tokenizer_starts_documents_with_bos_and_ends_them_with_eos(tmp_path):
    tok = build_tokenizer(_byte_level_bpe(tmp_path / "tok", adds_bos=True))
    bos, eos = tok.tok.convert_tokens_to_ids([BOS, EOS])
    assert (tok.bos, tok.eod, tok.add_bos) == (bos, eos, True)
    docs = _documents(tmp_path, tmp_path / "tok", append_eod=True)
    assert docs == [[bos] + tok.tokenize(text) + [eos] for text in DOCS]
    assert docs[0] == tok.tok(DOCS[0])["input_ids"] + [eos]  # what the tokenizer itself encodes


def test_a_tokenizer_that_adds_no_bos_gets_none_and_bert_sentences_never_do(tmp_path):
    plain = build_tokenizer(_byte_level_bpe(tmp_path / "plain", adds_bos=False))
    assert plain.bos is not None and not plain.add_bos  # GPT-2 and Qwen2 encode without one
    assert _documents(tmp_path, tmp_path / "plain", append_eod=True) == [plain.tokenize(t) + [plain.eod] for t in DOCS]
    with_bos = build_tokenizer(_byte_level_bpe(tmp_path / "tok", adds_bos=True))
    sentences = _documents(tmp_path, tmp_path / "tok", split_sentences=True)
    assert sentences == [with_bos.tokenize(t + "\n") for t in DOCS]
