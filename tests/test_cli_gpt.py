"""pretrain_gpt.py end to end under torchrun: the same losses whatever the layout, metrics
records with the documented keys, and bad layouts ending in one clear line."""
import pytest

from cli import losses, records, torchrun
from helpers import rel_err

import torch

COMMON = ["--mock-data", "--train-iters", "8", "--log-interval", "1", "--seq-length", "32"]
KEYS = {"iteration", "loss", "lr", "grad_norm", "loss_scale", "skipped", "tokens_per_sec", "tflops_per_gpu", "mfu"}


@pytest.fixture(scope="module")
def single_device(tmp_path_factory):
    path = tmp_path_factory.mktemp("single") / "m.jsonl"
    run = torchrun("pretrain_gpt.py", 1, *COMMON, "--metrics-file", str(path))
    assert run.returncode == 0, run.stderr[-3000:]
    return path


def test_metrics_file_has_one_record_per_logged_iteration(single_device):
    recs = records(single_device)
    assert [r["iteration"] for r in recs] == list(range(1, 9))
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
    assert len(got) == len(want) == 8
    assert rel_err(torch.tensor(got), torch.tensor(want)) <= 1e-5, (got, want)


@pytest.mark.parametrize("nproc,args,message,launched", [
    (4, ["--tp", "3"], "--tp 3 does not divide the number of ranks (4)", False),
    (2, ["--tp", "2", "--num-attention-heads", "3", "--hidden-size", "129"],
     "num_attention_heads (3) is not divisible by the tensor-parallel size (2)", False),
    (2, ["--global-batch-size", "6", "--micro-batch-size", "2"],
     "--global-batch-size 6 is not divisible by --micro-batch-size 2 x data-parallel size 2 = 4", True),
], ids=["tp3-on-4", "heads", "global-batch"])
def test_bad_layouts_exit_with_one_clear_message(nproc, args, message, launched, monkeypatch, capsys):
    """One case is launched under torchrun: every rank finds the error, the job prints it once. The
    others go through the same checks (validated before any process group starts) in this process,
    as rank 0 of `nproc` ranks: pretrain_gpt.main's exit code and stderr."""
    argv = ["--mock-data", "--train-iters", "2", *args]
    if launched:
        run = torchrun("pretrain_gpt.py", nproc, *argv, timeout=120)
        code, stderr = run.returncode, run.stderr
    else:
        import pretrain_gpt

        for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", str(nproc))):
            monkeypatch.setenv(name, value)
        capsys.readouterr()
        code = pretrain_gpt.main(argv)
        stderr = capsys.readouterr().err
        assert code == 2, stderr[-2000:]
    assert code != 0
    ours = [line for line in stderr.splitlines() if line.startswith("megalite: error:")]
    assert len(ours) == 1 and message in ours[0], stderr[-2000:]
    # No traceback from megalite or the entry point (torchrun's own launcher summary aside).
    assert "megalite/" not in stderr.split("ChildFailedError")[0].replace(ours[0], "")
    assert 'pretrain_gpt.py", line' not in stderr


def test_a_bad_layout_is_refused_before_the_embedded_corpus_is_built(monkeypatch, capsys, tmp_path):
    """No data flags and an empty cache: the layout's refusal comes first, nothing is built."""
    import pretrain_gpt

    monkeypatch.setenv("MEGALITE_CACHE", str(tmp_path))
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    code = pretrain_gpt.main(["--tp", "4"])
    stderr = capsys.readouterr().err
    assert code == 2 and "--tp 4 does not divide the number of ranks (2)" in stderr, stderr[-2000:]
    assert "building the embedded corpus" not in stderr and not any(tmp_path.iterdir())


def test_default_run_trains_on_the_embedded_corpus(tmp_path):
    """No data flags: the standard library's sources, tokenized once into the cache. On 2 ranks, pp 2
    (the data defaults are what is tested here; the layout matrices cover tp x pp), for 20 iterations:
    it ends cleanly, learns (the loss falls by over 0.5 from the first logged iteration, 10, to the
    last, 20) and validates at the end."""
    path = tmp_path / "m.jsonl"
    run = torchrun("pretrain_gpt.py", 2, "--pp", "2", "--train-iters", "20", "--metrics-file", str(path))
    assert run.returncode == 0, run.stderr[-3000:]
    recs = records(path)
    assert [r["iteration"] for r in recs] == [10, 20]
    assert recs[-1]["loss"] < recs[0]["loss"] - 0.5, recs
    valid = records(path, split="valid")
    assert valid and valid[-1]["iteration"] == 20 and valid[-1]["valid_ppl"] > 1


def test_tensorboard_events_hold_the_logged_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megalite.testing import run_ranks
    from training_ranks import train_losses

    argv = ["--train-iters", "6", "--log-interval", "2", "--seq-length", "16", "--eval-interval", "3",
            "--tensorboard-dir", str(tmp_path / "tb")]
    losses_logged = run_ranks(train_losses, 2, args=(argv,))[0]
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for tag in ("train/loss", "train/lr", "train/grad_norm", "train/tokens_per_sec", "valid/loss", "valid/ppl"):
        assert tag in tags, tags
    events = acc.Scalars("train/loss")
    assert [e.step for e in events] == [2, 4, 6]
    assert [e.value for e in events] == pytest.approx(losses_logged, rel=1e-6)
    assert [e.step for e in acc.Scalars("valid/loss")] == [3, 6]


def test_normalization_and_backends_reach_the_model_config():
    from megalite import arguments
    args = arguments.build_parser("t", "gpt-tiny").parse_args(
        ["--normalization", "rmsnorm", "--norm-backend", "torch", "--attention-backend", "fused"])
    config = arguments.model_config(args)
    assert (config.normalization, config.norm_backend, config.attention_backend) == ("rmsnorm", "torch", "fused")
    default = arguments.model_config(arguments.build_parser("t", "gpt-tiny").parse_args([]))
    assert (default.normalization, default.norm_backend, default.attention_backend) == ("layernorm", "auto", "sdpa")
