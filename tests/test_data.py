"""Data pipeline: the Megatron .bin/.idx layout, preprocessing, tokenizers, GPT samples, blending."""
import json
import struct

import numpy as np
import pytest
import torch

from helpers import sentencepiece_fixture
from megalite.data import DatasetError, IndexedDataset, IndexedDatasetWriter, build_tokenizer
from megalite.data.gpt_dataset import BlendedDataset, GPTDataset, build_gpt_datasets, split_ranges
from megalite.data.preprocess import preprocess

DOCS = [[[5, 6, 7], [8]], [[9, 10, 11, 12]], [[13], [14, 15], [16, 17, 18]]]  # documents of sequences


def write_megatron_pair_by_hand(prefix, docs, dtype=np.uint16, code=8):
    """The documented layout, byte by byte, without megalite's writer."""
    seqs = [np.asarray(s, dtype=dtype) for d in docs for s in d]
    with open(f"{prefix}.bin", "wb") as f:
        for s in seqs:
            f.write(s.tobytes())
    lengths = [len(s) for s in seqs]
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]) * np.dtype(dtype).itemsize
    doc_idx = np.concatenate([[0], np.cumsum([len(d) for d in docs])])
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))
        f.write(struct.pack("<B", code))
        f.write(struct.pack("<Q", len(seqs)))
        f.write(struct.pack("<Q", len(doc_idx)))
        f.write(np.asarray(lengths, dtype=np.int32).tobytes())
        f.write(np.asarray(pointers, dtype=np.int64).tobytes())
        f.write(np.asarray(doc_idx, dtype=np.int64).tobytes())


@pytest.mark.parametrize("dtype,code", [(np.uint16, 8), (np.int32, 4)])
def test_reads_a_pair_built_byte_by_byte_from_the_megatron_layout(tmp_path, dtype, code):
    write_megatron_pair_by_hand(tmp_path / "hand", DOCS, dtype, code)
    ds = IndexedDataset(tmp_path / "hand")
    flat = [s for d in DOCS for s in d]
    assert len(ds) == len(flat) and ds.num_documents == len(DOCS)
    assert [ds[i].tolist() for i in range(len(ds))] == flat
    assert ds.document_indices.tolist() == [0, 2, 3, 6]
    assert ds.get(5, offset=1, length=2).tolist() == [17, 18]
    # megalite's writer produces the same bytes
    w = IndexedDatasetWriter(tmp_path / "ours", dtype)
    for d in DOCS:
        w.add_document(d)
    w.finalize()
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours{ext}").read_bytes() == (tmp_path / f"hand{ext}").read_bytes()


def test_truncated_or_corrupt_files_are_reported(tmp_path):
    write_megatron_pair_by_hand(tmp_path / "d", DOCS)
    bin_bytes, idx_bytes = (tmp_path / "d.bin").read_bytes(), (tmp_path / "d.idx").read_bytes()
    (tmp_path / "d.bin").write_bytes(bin_bytes[:-4])
    with pytest.raises(DatasetError, match="d.bin is truncated"):
        IndexedDataset(tmp_path / "d")
    (tmp_path / "d.bin").write_bytes(bin_bytes)
    (tmp_path / "d.idx").write_bytes(idx_bytes[:-8])
    with pytest.raises(DatasetError, match="d.idx is truncated"):
        IndexedDataset(tmp_path / "d")
    (tmp_path / "d.idx").write_bytes(b"NOTANIDX!" + idx_bytes[9:])
    with pytest.raises(DatasetError, match="bad magic"):
        IndexedDataset(tmp_path / "d")
    with pytest.raises(DatasetError, match="does not exist"):
        IndexedDataset(tmp_path / "missing")


tokenizer = sentencepiece_fixture("\n".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(400)))


def test_sentencepiece_has_the_special_tokens(tokenizer):
    for name in ("eod", "pad", "cls", "sep", "mask"):
        assert getattr(tokenizer, name) is not None
    assert len({tokenizer.eod, tokenizer.pad, tokenizer.cls, tokenizer.sep, tokenizer.mask}) == 5
    text = "def f3(x):\n    return x * 3 + 3\n"
    assert tokenizer.detokenize(tokenizer.tokenize(text)) == text


def test_preprocess_round_trips_exact_token_ids(tmp_path, tokenizer):
    docs = ["first document\nwith two lines", "def g():\n    pass", "third one"]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    for workers in (1, 2):
        preprocess([tmp_path / "in.jsonl"], tokenizer.path, str(tmp_path / f"gpt{workers}"), workers=workers,
                   append_eod=True, progress=False)
        ds = IndexedDataset(tmp_path / f"gpt{workers}")
        assert [ds[i].tolist() for i in range(len(ds))] == [tokenizer.tokenize(t) + [tokenizer.eod] for t in docs]
    assert (tmp_path / "gpt1.bin").read_bytes() == (tmp_path / "gpt2.bin").read_bytes()
    preprocess([tmp_path / "in.jsonl"], tokenizer.path, str(tmp_path / "bert"), split_sentences=True, progress=False)
    ds = IndexedDataset(tmp_path / "bert")
    assert ds.document_indices.tolist() == [0, 2, 4, 5]  # lines become sequences
    assert ds[1].tolist() == tokenizer.tokenize("with two lines\n")


def test_preprocess_cli_reports_bad_input_in_one_line(tmp_path, tokenizer):
    import subprocess
    import sys

    (tmp_path / "bad.jsonl").write_text('{"txt": 1}\n')
    run = subprocess.run([sys.executable, "-m", "megalite.data.preprocess", "--input", str(tmp_path / "bad.jsonl"),
                          "--tokenizer", tokenizer.path, "--output-prefix", str(tmp_path / "o")],
                         capture_output=True, text=True)
    assert run.returncode != 0 and "bad.jsonl:1: not a JSON object with a 'text' field" in run.stderr
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "o.bin").exists(), "no half-written dataset"


def _dataset(tmp_path, docs=60, seed=3, n=40, s=7):
    rng = np.random.RandomState(0)
    w = IndexedDatasetWriter(tmp_path / "c")
    for _ in range(docs):
        w.add_document([rng.randint(0, 500, rng.randint(1, 20)) for _ in range(rng.randint(1, 3))])
    w.finalize()
    return GPTDataset(IndexedDataset(tmp_path / "c"), (0, docs), n, s, seed)


def test_gpt_samples_are_windows_of_the_shuffled_concatenation(tmp_path):
    ds = _dataset(tmp_path)
    stream = np.concatenate([ds.indexed[int(i)] for i in ds.order]).astype(np.int64)
    for k in range(len(ds)):
        i = int(ds.shuffle[k])
        assert ds.sample(k).tolist() == stream[i * 7:(i + 1) * 7 + 1].tolist()
    batch = ds.batch([0, 1])
    assert torch.equal(batch["tokens"][:, 1:], batch["labels"][:, :-1])


def test_gpt_index_is_cached_and_identical_across_runs(tmp_path):
    a = _dataset(tmp_path)
    cached = sorted((tmp_path / "c.cache").glob("gpt-train-*.json"))  # the manifest, written last
    assert len(cached) == 1
    stamp = cached[0].stat().st_mtime_ns
    b = GPTDataset(IndexedDataset(tmp_path / "c"), (0, 60), 40, 7, 3)
    assert cached[0].stat().st_mtime_ns == stamp, "the second run must reuse the cached index"
    assert all(np.array_equal(getattr(a, k), getattr(b, k)) for k in ("order", "pos", "offset", "shuffle"))
    other_seed = GPTDataset(IndexedDataset(tmp_path / "c"), (0, 60), 40, 7, 4)
    assert not np.array_equal(a.shuffle, other_seed.shuffle)


def test_samples_do_not_depend_on_data_parallel_size_and_resume_exactly(tmp_path):
    from megalite.config import build_parser
    from megalite.training import micro_batches

    ds = _dataset(tmp_path)
    args = build_parser("x", "gpt-tiny").parse_args(["--global-batch-size", "8", "--micro-batch-size", "2"])
    cpu = torch.device("cpu")
    for iteration in range(3):
        whole = torch.cat([b["tokens"] for b in micro_batches(ds, iteration, args, 1, 0, cpu)])
        for dp in (2, 4):
            parts = [b["tokens"] for r in range(dp) for b in micro_batches(ds, iteration, args, dp, r, cpu)]
            assert torch.equal(torch.cat(parts), whole)
    # Resuming after N consumed samples reads exactly the next ones of an unbroken stream.
    resumed = GPTDataset(IndexedDataset(tmp_path / "c"), (0, 60), 40, 7, 3)
    assert torch.equal(resumed.batch(range(16, 24))["tokens"], ds.batch(range(16, 24))["tokens"])


def test_split_and_blending(tmp_path):
    assert split_ranges(1000, "949,50,1") == [(0, 949), (949, 999), (999, 1000)]
    assert split_ranges(10, "1") == [(0, 10), (10, 10), (10, 10)]
    with pytest.raises(ValueError):
        split_ranges(10, "a,b")
    for name in ("a", "b"):
        w = IndexedDatasetWriter(tmp_path / name)
        for i in range(30):
            w.add_document([[i % 5 + (100 if name == "b" else 0)] * 9])
        w.finalize()
    train, valid, test = build_gpt_datasets(["0.7", str(tmp_path / "a"), "0.3", str(tmp_path / "b")], "8,2,0", 4,
                                            (200, 20, 0), seed=1)
    assert isinstance(train, BlendedDataset) and valid is not None and test is None
    for k in range(1, 201):
        share = np.bincount(train.choice[:k], minlength=2) / k
        assert abs(share[0] - 0.7) <= 1.0 / k + 1e-9
    from_b = [k for k in range(200) if train.choice[k] == 1]
    assert all(train.sample(k)[0] >= 100 for k in from_b[:20])


def test_huggingface_tokenizer_from_a_local_directory(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world"])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]", pad_token="[PAD]",
                                                cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
    fast.save_pretrained(tmp_path / "hf")
    tok = build_tokenizer(tmp_path / "hf")
    assert tok.tokenize("hello world") == [5, 6]
    assert (tok.cls, tok.sep, tok.mask, tok.pad, tok.vocab_size) == (2, 3, 4, 0, 7)
