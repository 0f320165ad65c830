"""Bad data ends in one line naming the file and the fix: ids beyond the vocabulary, corrupt index
entries, bad tokenizer files, bad preprocessing input, damaged caches, a lock held too long. And
the caches are memory-mapped; mock batches are vectorised."""
import json
import mmap
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helpers import sentencepiece_fixture
from megalite.data import DatasetError, IndexedDataset, IndexedDatasetWriter, build_tokenizer
from megalite.data.bert_dataset import build_bert_datasets
from megalite.data.gpt_dataset import GPTDataset, build_gpt_datasets
from megalite.data.preprocess import preprocess
from megalite.data.synthetic import SyntheticTokens
from megalite.runtime import UsageError


class _BertTok:
    cls, sep, mask, pad, vocab_size = 4, 5, 6, 3, 600

    def require(self, *names):
        pass


def _write(prefix, docs, max_id=499, seed=0):
    """Documents of random sequences with ids in [10, max_id], one of them max_id."""
    rng = np.random.RandomState(seed)
    with IndexedDatasetWriter(prefix) as w:
        for d in range(docs):
            seqs = [rng.randint(10, max_id, rng.randint(2, 20)) for _ in range(rng.randint(2, 4))]
            if d == docs // 2:
                seqs[0][0] = max_id
            w.add_document(seqs)
        w.finalize()
    return str(prefix)


# --- 1. ids beyond the vocabulary

def test_dataset_with_an_id_beyond_the_vocabulary_is_refused_naming_the_id(tmp_path):
    prefix = _write(tmp_path / "d", 30)
    with pytest.raises(DatasetError, match=r"dataset .*d holds token id 499, outside the vocabulary of 300 ids "
                                           r"\(0..299\): give the --tokenizer it was preprocessed with"):
        build_gpt_datasets([prefix], "1", 8, (10, 0, 0), 1, vocab_size=300)
    with pytest.raises(DatasetError, match="holds token id 499, outside the vocabulary of 499 ids"):
        build_bert_datasets(prefix, "1", 16, (10, 0, 0), 1, _BertTok(), vocab_size=499)
    train, _, _ = build_gpt_datasets([prefix], "1", 8, (10, 0, 0), 1, vocab_size=500)
    assert train.sample(0).max() < 500


def test_writer_leaves_a_sidecar_so_the_max_id_is_known_without_reading_the_bin(tmp_path, monkeypatch):
    prefix = _write(tmp_path / "d", 30)
    ds = IndexedDataset(prefix)
    meta = json.loads((tmp_path / "d.meta.json").read_text())
    assert (meta["max_token_id"], meta["min_token_id"]) == (499, 10)
    assert meta["num_tokens"] == int(ds.sequence_lengths.sum()) and meta["num_documents"] == 30
    monkeypatch.setattr(IndexedDataset, "_scan_token_range", lambda self: pytest.fail("scanned despite the sidecar"))
    assert ds.token_range() == (10, 499)


def test_pair_without_a_sidecar_is_scanned_once_and_the_result_cached(tmp_path, monkeypatch):
    prefix = _write(tmp_path / "d", 30)
    (tmp_path / "d.meta.json").unlink()  # as from Megatron-LM's preprocessing
    assert IndexedDataset(prefix).token_range() == (10, 499)
    assert json.loads((tmp_path / "d.cache" / "token-range.json").read_text())["max"] == 499
    monkeypatch.setattr(IndexedDataset, "_scan_token_range", lambda self: pytest.fail("scanned twice"))
    assert IndexedDataset(prefix).token_range() == (10, 499)
    with pytest.raises(DatasetError, match="holds token id 499"):
        IndexedDataset(prefix).check_token_ids(400)


@pytest.mark.parametrize("kind", ["gpt", "bert"])
def test_pretrain_build_data_refuses_ids_beyond_the_model_vocabulary(tmp_path, kind, monkeypatch):
    import pretrain_bert
    import pretrain_gpt
    from megalite.config import build_parser

    prefix = _write(tmp_path / "d", 30)
    cfg = build_parser("x", "gpt-tiny").parse_args(
        ["--data-path", prefix, "--tokenizer", "unused", "--split", "1", "--seq-length", "16", "--eval-iters", "1",
         "--eval-interval", "0", "--global-batch-size", "2", "--train-iters", "2", "--seed", "1",
         "--distributed-timeout-minutes", "1"])
    monkeypatch.setattr(pretrain_bert, "data_tokenizer", lambda data: _BertTok())
    build_data = (pretrain_gpt if kind == "gpt" else pretrain_bert).build_data
    with pytest.raises(UsageError, match="holds token id 499, outside the vocabulary of 256 ids"):
        build_data(SimpleNamespace(vocab_size=256, add_binary_head=True), cfg)
    train, _ = build_data(SimpleNamespace(vocab_size=600, add_binary_head=True), cfg)
    assert train is not None


# --- 2. every index entry is checked

N_SEQS = [3, 1, 4, 1, 2, 3]  # lengths of 6 uint16 sequences, 3 documents


def _write_pair(prefix, lengths, pointers, docs, bin_bytes):
    with open(f"{prefix}.bin", "wb") as f:
        f.write(b"\x01\x00" * (bin_bytes // 2))
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, len(lengths), len(docs)))
        f.write(np.asarray(lengths, np.int32).tobytes() + np.asarray(pointers, np.int64).tobytes())
        f.write(np.asarray(docs, np.int64).tobytes())


def _good():
    lengths = list(N_SEQS)
    pointers = list(np.concatenate([[0], np.cumsum(lengths)[:-1]]) * 2)
    return lengths, pointers, [0, 2, 3, 6], 2 * sum(lengths)


def _pointer_past_bin(lengths, pointers, docs, size):
    pointers[2] = 10_000
    return lengths, pointers, docs, size


def _odd_offset(lengths, pointers, docs, size):
    pointers[3] += 1
    return lengths, pointers, docs, size


def _negative_length(lengths, pointers, docs, size):
    lengths[1] = -3
    return lengths, pointers, docs, size


def _huge_length(lengths, pointers, docs, size):
    lengths[4] = 2**31 - 1
    return lengths, pointers, docs, size


def _last_sequence_past_bin(lengths, pointers, docs, size):
    lengths[5] = 1000
    return lengths, pointers, docs, size


def _document_beyond_n(lengths, pointers, docs, size):
    return lengths, pointers, [0, 9, 3, 6], size


def _documents_out_of_order(lengths, pointers, docs, size):
    return lengths, pointers, [0, 4, 3, 6], size


@pytest.mark.parametrize("corrupt,message", [
    (_pointer_past_bin, r"d.idx is corrupt: sequence 2 starts at byte 10000, but sequence 1 ends at byte 8"),
    (_odd_offset, r"d.idx is corrupt: sequence 3 starts at byte 17, not a non-negative multiple of the 2-byte uint16"),
    (_negative_length, r"d.idx is corrupt: sequence 1 has length -3"),
    (_huge_length, r"d.idx is corrupt: sequence 5 starts at byte 22, but sequence 4 ends at byte 4294967312"),
    (_last_sequence_past_bin, r"d.bin is truncated: 28 bytes, but sequence 5 needs bytes 22..2022"),
    (_document_beyond_n, r"d.idx is corrupt: document index entry 1 is 9, outside 0..6"),
    (_documents_out_of_order, r"d.idx is corrupt: document index entry 2 is 3, .* below the entry before it"),
])
def test_index_entries_are_all_validated_naming_the_first_bad_one(tmp_path, corrupt, message):
    _write_pair(tmp_path / "d", *_good())
    assert [IndexedDataset(tmp_path / "d")[i].tolist() for i in range(2)] == [[1, 1, 1], [1]]
    _write_pair(tmp_path / "d", *corrupt(*_good()))
    with pytest.raises(DatasetError, match=message):
        IndexedDataset(tmp_path / "d")


# --- 3. bad tokenizer files; 4. bad preprocessing input

tokenizer = sentencepiece_fixture("\n".join(f"the value {i} is {i * 7}" for i in range(200)))


def test_bad_tokenizer_paths_are_one_line_errors_naming_path_and_expectation(tmp_path):
    (tmp_path / "corrupt.model").write_bytes(b"not a sentencepiece model")
    (tmp_path / "empty").mkdir()
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "README.md").write_text("no tokenizer here")
    cases = {"corrupt.model": r"corrupt.model is not a readable SentencePiece model .*: give a SentencePiece .model "
                              r"file or a directory holding a Hugging Face tokenizer",
             "empty": r"tokenizer directory .*empty is empty: give a SentencePiece .model file",
             "other": r"tokenizer directory .*other holds no tokenizer files \(expected one of tokenizer.json"}
    for name, message in cases.items():
        with pytest.raises(DatasetError, match=message):
            build_tokenizer(tmp_path / name)
    run = subprocess.run([sys.executable, "-m", "megalite.data.preprocess", "--input", str(tmp_path / "x.txt"),
                          "--tokenizer", str(tmp_path / "corrupt.model"), "--output-prefix", str(tmp_path / "o")],
                         capture_output=True, text=True)
    assert run.returncode != 0 and "Traceback" not in run.stderr
    assert run.stderr.strip().splitlines() == [run.stderr.strip()] and "corrupt.model is not a readable" in run.stderr


def _leftovers(directory):
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("out"))


def test_preprocess_refuses_a_non_string_text_naming_file_line_and_key(tmp_path, tokenizer):
    lines = [{"text": "fine"}, {"text": "also fine"}, {"text": 5}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    with pytest.raises(ValueError, match=r"in.jsonl:3: the 'text' field is int 5, not a string"):
        preprocess([tmp_path / "in.jsonl"], tokenizer.path, str(tmp_path / "out"), progress=False)
    assert _leftovers(tmp_path) == [], "no .bin.tmp/.idx.tmp (nor a dataset) left behind"


def test_preprocess_refuses_non_utf8_naming_file_and_line(tmp_path, tokenizer):
    (tmp_path / "in.jsonl").write_bytes(b'{"text": "ok"}\n\n{"text": "caf\xe9"}\n')
    (tmp_path / "in.txt").write_bytes(b"line one\nline two \xff\n")
    for name, line in (("in.jsonl", 3), ("in.txt", 2)):
        with pytest.raises(ValueError, match=rf"{name}:{line}: not valid UTF-8 \(byte 0x..\): convert the file"):
            preprocess([tmp_path / name], tokenizer.path, str(tmp_path / "out"), progress=False)
        assert _leftovers(tmp_path) == []


def test_writer_removes_its_temporary_files_on_any_failure(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with IndexedDatasetWriter(tmp_path / "out") as w:
            w.add_document([[1, 2, 3]])
            raise KeyboardInterrupt
    assert _leftovers(tmp_path) == []


# --- 5. damaged caches are rebuilt; 8. and memory-mapped

def _cache_files(cache_dir):
    """The cache's data files, whatever their format (not the lock files, not the token-range note)."""
    return [p for p in sorted(cache_dir.iterdir()) if not p.name.startswith(".") and p.name != "token-range.json"]


def _truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])


def _flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) * 3 // 4] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_truncate, _flip_a_byte])
def test_damaged_sample_index_caches_are_rebuilt_with_a_note(tmp_path, capsys, damage):
    prefix = _write(tmp_path / "d", 40)
    gpt = GPTDataset(IndexedDataset(prefix), (0, 40), 200, 8, 1)
    bert = build_bert_datasets(prefix, "1", 16, (50, 0, 0), 1, _BertTok())[0]
    expected = {k: np.array(getattr(gpt, k)) for k in ("order", "pos", "offset", "shuffle")}
    expected_segments = np.array(bert.segments)
    for path in _cache_files(tmp_path / "d.cache"):
        damage(path)
    capsys.readouterr()
    again = GPTDataset(IndexedDataset(prefix), (0, 40), 200, 8, 1)
    assert all(np.array_equal(getattr(again, k), v) for k, v in expected.items())
    assert np.array_equal(build_bert_datasets(prefix, "1", 16, (50, 0, 0), 1, _BertTok())[0].segments,
                          expected_segments)
    notes = [line for line in capsys.readouterr().err.splitlines() if "damaged" in line]
    assert len(notes) == 2 and all("; rebuilding it" in n for n in notes), notes
    capsys.readouterr()
    GPTDataset(IndexedDataset(prefix), (0, 40), 200, 8, 1)
    assert "damaged" not in capsys.readouterr().err, "a rebuilt cache loads clean"


def _memory_mapped(array) -> bool:
    while array is not None:
        if isinstance(array, (np.memmap, mmap.mmap)):
            return True
        array = getattr(array, "base", None)
    return False


def test_sample_index_is_memory_mapped_not_read_into_each_rank(tmp_path):
    prefix = _write(tmp_path / "d", 40)
    for ds in (GPTDataset(IndexedDataset(prefix), (0, 40), 200, 8, 1),
               GPTDataset(IndexedDataset(prefix), (0, 40), 200, 8, 1)):  # built, then loaded
        assert all(_memory_mapped(getattr(ds, k)) for k in ("order", "pos", "offset", "shuffle"))
        assert not ds.shuffle.flags.writeable
    assert not [p for p in (tmp_path / "d.cache").iterdir() if p.name.endswith(".tmp")]


# --- 6. the cache lock is waited on for a bounded time

def test_cache_lock_wait_is_bounded_and_names_the_holder(tmp_path, monkeypatch):
    from megalite.data.cache import file_lock

    prefix = _write(tmp_path / "d", 40)
    GPTDataset(IndexedDataset(prefix), (0, 40), 200, 8, 1)
    (lock,) = [p for p in (tmp_path / "d.cache").iterdir() if p.name.endswith(".lock")]
    for path in _cache_files(tmp_path / "d.cache"):
        path.unlink()  # so the next open must build, under the lock
    monkeypatch.setenv("MEGALITE_CACHE_LOCK_TIMEOUT_S", "0.3")
    outcome = []

    def open_dataset():
        try:
            GPTDataset(IndexedDataset(prefix), (0, 40), 200, 8, 1)
            outcome.append("built")
        except DatasetError as e:
            outcome.append(str(e))

    with file_lock(lock):  # another process, as far as flock is concerned: a second open file
        waiter = threading.Thread(target=open_dataset, daemon=True)
        start = time.monotonic()
        waiter.start()
        waiter.join(timeout=20)
        waited = time.monotonic() - start
        assert not waiter.is_alive(), "the wait for the lock must end"
    assert 0.3 <= waited < 10
    assert outcome == [f"waited 0.3 s for the cache lock {lock}, held by host {socket.gethostname()} pid "
                       f"{os.getpid()}: if that process is gone or stuck, delete the lock file; to wait longer, set "
                       f"MEGALITE_CACHE_LOCK_TIMEOUT_S (seconds)"]
    monkeypatch.setenv("MEGALITE_CACHE_LOCK_TIMEOUT_S", "soon")
    with pytest.raises(DatasetError, match="MEGALITE_CACHE_LOCK_TIMEOUT_S='soon' must be a positive number"):
        GPTDataset(IndexedDataset(prefix), (0, 40), 200, 8, 1)


# --- 7. mock data is vectorised

def _recurrence(vocab, seq, seed, index):
    """The documented stream, token by token: t[k+1] = (7 t[k] + 3 + noise[k]) mod vocab."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + index)
    noise = torch.randint(0, 2, (seq,), generator=gen)
    tokens = [int(torch.randint(0, vocab, (1,), generator=gen))]
    for k in range(seq):
        tokens.append((7 * tokens[-1] + 3 + int(noise[k])) % vocab)
    return tokens


def test_mock_data_keeps_its_stream_and_builds_a_2x2048_batch_in_milliseconds():
    for vocab, seq in ((50257, 300), (4, 33), (7, 1), (2**31 - 1, 70)):
        ds = SyntheticTokens(vocab, seq, seed=3)
        batch = ds.batch([4, 9])
        for row, index in enumerate((4, 9)):
            expected = _recurrence(vocab, seq, 3, index)
            assert batch["tokens"][row].tolist() == expected[:-1] and batch["labels"][row].tolist() == expected[1:]
    ds = SyntheticTokens(50257, 2048, seed=0)
    times = []
    for i in range(5):
        start = time.perf_counter()
        ds.batch([2 * i, 2 * i + 1])
        times.append(time.perf_counter() - start)
    assert min(times) < 0.01, f"{min(times) * 1e3:.1f} ms: token by token in Python it takes ~40 ms"
