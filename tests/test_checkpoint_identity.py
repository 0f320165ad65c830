"""Every rank file records who wrote it (global rank, coordinates, the save's token, the iteration)
and the reader checks it against the file's place: a file written by rank 2 put in rank 3's place,
or a file from another save, is refused in one line naming both, for every checkpoint kind (plain,
ZeRO 1-3, local SGD with fragments, pipeline stages) even when sizes match. Issue #34's first
reproduction: replica 1's two tensor-parallel files of equal size swapped."""
import json
import shutil

import pytest

from megalite.checkpoint import CheckpointReader
from megalite.checkpoint.layout import iter_dir, rank_file_name
from megalite.errors import UsageError
from megalite.testing import RankFailure, run_ranks
from megalite.checkpoint.sealed import sealed

pytestmark = pytest.mark.slow  # one 4-rank spawn saves six checkpoints; one torchrun of 4 ranks

BASE = ["--train-iters", "2", "--log-interval", "1", "--seq-length", "16", "--global-batch-size", "8",
        "--micro-batch-size", "2", "--eval-interval", "0"]
KINDS = {"plain": ["--tp", "2"], "zero1": ["--zero-stage", "1"], "zero2": ["--zero-stage", "2"],
         "zero3": ["--zero-stage", "3"], "pipeline": ["--pp", "2", "--tp", "2"],
         "local-sgd": ["--tp", "2", "--local-sgd-interval", "2", "--local-sgd-async", "--local-sgd-fragments", "2"]}


def _save_all(rank, world, root):
    from training_ranks import gpt_run

    for name, flags in KINDS.items():
        gpt_run(BASE + flags + ["--save", f"{root}/{name}", "--save-interval", "2"])


def _put_in_place_of(directory, src: int, dst: int, swap: bool = False) -> None:
    """Copy (or swap) rank files, and make the metadata's recorded sizes agree, so that only the
    files' own record of their writer can tell."""
    d = iter_dir(directory, 2)
    a, b = d / rank_file_name(src), d / rank_file_name(dst)
    if swap:
        a.rename(d / "swap")
        b.rename(a)
        (d / "swap").rename(b)
    else:
        shutil.copyfile(a, b)
    meta = json.loads((d / "metadata.json").read_text())
    for r in (src, dst):
        meta["files"][rank_file_name(r)]["bytes"] = (d / rank_file_name(r)).stat().st_size
    (d / "metadata.json").write_text(json.dumps(sealed(meta)))  # made to agree, seal and all


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("kinds")
    run_ranks(_save_all, 4, args=(str(root),), timeout=600)
    return root


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_file_of_rank_2_in_rank_3s_place_is_refused_in_one_line(saved, kind, tmp_path):
    directory = tmp_path / kind
    shutil.copytree(saved / kind, directory)
    CheckpointReader(directory).files  # intact: every file is where its writer put it
    _put_in_place_of(directory, 2, 3)
    with pytest.raises(UsageError, match=r"rank_00003\.safetensors holds the state rank 2 \(tp \d, pp \d, dp \d, "
                                         r"cp 0, ep \d\) wrote, not rank 3's: files were swapped") as e:
        CheckpointReader(directory).files
    assert "\n" not in str(e.value)


def test_a_file_from_another_save_is_refused(saved, tmp_path):
    """The same rank's file from another save of the same iteration: same writer, another token."""
    first, second = tmp_path / "first", tmp_path / "second"
    shutil.copytree(saved / "plain", first)
    shutil.copytree(saved / "plain", second)
    meta_path = iter_dir(second, 2) / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["save"] = "0" * 32  # as if saved again: a new token, files of its own
    meta_path.write_text(json.dumps(sealed(meta)))
    with pytest.raises(UsageError, match=r"was written by another save \(iteration 2, save [0-9a-f]{8}\) than this "
                                         r"checkpoint's \(iteration 2, save 00000000\): files were mixed"):
        CheckpointReader(second).files


def _resume(rank, world, directory):
    from training_ranks import gpt_run
    gpt_run(BASE + KINDS["local-sgd"] + ["--load", directory, "--train-iters", "3"])


def test_swapped_equal_size_files_of_a_local_sgd_replica_stop_the_resume(saved, tmp_path):
    """Issue #34: 4 ranks, TP 2, local SGD with 2 fragments; replica 1's two TP files are the same size.
    Swapped, they used to load as each other's shards; now the resume stops with one line."""
    directory = tmp_path / "local-sgd"
    shutil.copytree(saved / "local-sgd", directory)
    d = iter_dir(directory, 2)
    assert (d / rank_file_name(2)).stat().st_size == (d / rank_file_name(3)).stat().st_size
    _put_in_place_of(directory, 2, 3, swap=True)
    with pytest.raises(RankFailure, match=r"rank_00002\.safetensors holds the state rank 3 \(tp 1, pp 0, dp 1, cp 0, "
                                          r"ep \d\) wrote, not rank 2.s"):
        run_ranks(_resume, 4, args=(str(directory),))


def test_an_error_on_rank_1_alone_is_the_first_line_once_and_nothing_is_said_resumed(saved, tmp_path):
    """Issue #34: a CRC failure in rank 1's file (rank 0's is intact) reaches the user as the first
    megalite line, printed once, whichever rank raised it; rank 0 never says "resumed" first, and
    its lost contact with rank 1 adds no line of its own."""
    from cli import torchrun

    directory = tmp_path / "zero1"
    shutil.copytree(saved / "zero1", directory)
    f = iter_dir(directory, 2) / rank_file_name(1)
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x01  # a bit of rank 1's last float
    f.write_bytes(bytes(data))
    out = torchrun("pretrain_gpt.py", 4, "--mock-data", *BASE, "--zero-stage", "1", "--train-iters", "4",
                   "--load", str(directory), timeout=240)
    assert out.returncode != 0
    ours = [line for line in (out.stdout + out.stderr).splitlines() if line.startswith("megalite: error:")]
    assert len(ours) == 1 and "rank_00001.safetensors" in ours[0] and "CRC-32" in ours[0], out.stderr
    assert "resumed from" not in out.stdout, out.stdout


def test_a_file_without_a_writer_record_in_a_checkpoint_whose_files_have_one_is_refused(saved, tmp_path):
    """An older-format file (no writer record) put into a new checkpoint."""
    from megalite.checkpoint.fileformat import RankFile, write_rank_file

    directory = tmp_path / "plain"
    shutil.copytree(saved / "plain", directory)
    path = iter_dir(directory, 2) / rank_file_name(1)
    f = RankFile(path)
    entries = [(k, f.tensor(k).clone()) for k in f.keys()]
    meta = {k: v for k, v in f.meta.items() if k != "writer"}
    del f
    write_rank_file(path, entries, meta)
    meta_path = iter_dir(directory, 2) / "metadata.json"
    metadata = json.loads(meta_path.read_text())
    metadata["files"][rank_file_name(1)]["bytes"] = path.stat().st_size  # the recorded size made to agree
    meta_path.write_text(json.dumps(sealed(metadata)))
    with pytest.raises(UsageError, match=r"rank_00001\.safetensors records no writer, but every file of this "
                                         r"checkpoint does: it comes from an older checkpoint"):
        CheckpointReader(directory).files
