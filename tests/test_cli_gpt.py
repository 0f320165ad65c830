"""pretrain_gpt.py end to end under torchrun: the same losses whatever the layout, metrics
records with the documented keys, and bad layouts ending in one clear line."""
import pytest

from cli import losses, records, torchrun
from helpers import rel_err

import torch

COMMON = ["--train-iters", "20", "--log-interval", "1", "--seq-length", "32"]
KEYS = {"iteration", "loss", "lr", "grad_norm", "loss_scale", "skipped", "tokens_per_sec", "tflops_per_gpu", "mfu"}


@pytest.fixture(scope="module")
def single_device(tmp_path_factory):
    path = tmp_path_factory.mktemp("single") / "m.jsonl"
    run = torchrun("pretrain_gpt.py", 1, *COMMON, "--metrics-file", str(path))
    assert run.returncode == 0, run.stderr[-3000:]
    return path


def test_metrics_file_has_one_record_per_logged_iteration(single_device):
    recs = records(single_device)
    assert [r["iteration"] for r in recs] == list(range(1, 21))
    for r in recs:
        assert KEYS <= r.keys()
        assert r["tokens_per_sec"] > 0 and r["tflops_per_gpu"] > 0 and r["skipped"] == 0
    assert recs[-1]["loss"] < recs[0]["loss"], "the loss must fall on the learnable synthetic stream"


@pytest.mark.parametrize("nproc,layout", [(4, ["--tp", "2"]), (2, ["--tp", "1"])], ids=["tp2-dp2", "dp2"])
def test_layouts_give_the_single_device_losses(single_device, tmp_path, nproc, layout):
    path = tmp_path / "m.jsonl"
    run = torchrun("pretrain_gpt.py", nproc, *COMMON, *layout, "--metrics-file", str(path))
    assert run.returncode == 0, run.stderr[-3000:]
    got, want = losses(path), losses(single_device)
    assert len(got) == len(want) == 20
    assert rel_err(torch.tensor(got), torch.tensor(want)) <= 1e-5, (got, want)


@pytest.mark.parametrize("args,message", [
    (["--tp", "3"], "--tp 3 does not divide the number of ranks (4)"),
    (["--tp", "4", "--num-attention-heads", "2"], "num_attention_heads (2) is not divisible by the tensor-parallel size (4)"),
    (["--global-batch-size", "6", "--micro-batch-size", "2"],
     "--global-batch-size 6 is not divisible by --micro-batch-size 2 x data-parallel size 4 = 8"),
], ids=["tp3-on-4", "heads", "global-batch"])
def test_bad_layouts_exit_with_one_clear_message(args, message):
    run = torchrun("pretrain_gpt.py", 4, "--train-iters", "2", *args, timeout=120)
    assert run.returncode != 0
    ours = [line for line in run.stderr.splitlines() if line.startswith("megalite: error:")]
    assert len(ours) == 1 and message in ours[0], run.stderr[-2000:]
    # No traceback from megalite or the entry point (torchrun's own launcher summary aside).
    assert "megalite/" not in run.stderr.split("ChildFailedError")[0].replace(ours[0], "")
    assert 'pretrain_gpt.py", line' not in run.stderr
