"""Megatron-LM's checkpoint and matmul switches honoured: `--ckpt-step N` (--load's iteration N, not
its newest), `--exit-on-missing-checkpoint` (no start from scratch), `--no-save-optim` / `--no-save-rng`
(checkpoints without them, resumed with a fresh optimizer and the seed's streams, said so), and
`--disable-bf16-reduced-precision-matmul` (PyTorch's bf16 GEMM reduction switch off for the run)."""
from __future__ import annotations

import contextlib
import io
import json
import os
from pathlib import Path

import pytest
import torch

from megalite.errors import UsageError
from megalite.testing import run_ranks
from training_ranks import gpt_run, run_refusal

RUN = ["--global-batch-size", "4", "--micro-batch-size", "2", "--log-interval", "1", "--eval-interval", "0"]


def _runs(rank, world, d):
    out = {}
    whole = gpt_run(RUN + ["--train-iters", "4", "--save", f"{d}/ckpt", "--save-interval", "1"])
    out["whole"] = [r["loss"] for r in whole.records]
    # from iteration 2 of four saved: iterations 3, 4 again, as the run that saved them trained them
    out["from 2"] = [r["loss"] for r in gpt_run(RUN + ["--train-iters", "4", "--load", f"{d}/ckpt",
                                                       "--ckpt-step", "2"]).records]
    megatron = str(Path(__file__).parent / "fixtures" / "megatron_ckpt" / "gpt")  # Megatron-LM's, iteration 7
    out["megatron step 7"] = [r["iteration"] for r in gpt_run(RUN + ["--train-iters", "8", "--load", megatron,
                                                                      "--ckpt-step", "7"]).records]
    out["refused"] = [
        run_refusal(RUN + ["--train-iters", "4", "--load", f"{d}/ckpt", "--ckpt-step", "7"]),
        run_refusal(RUN + ["--train-iters", "4", "--load", f"{d}/ckpt/iter_0000002", "--ckpt-step", "2"]),
        run_refusal(RUN + ["--train-iters", "2", "--load", f"{d}/fresh", "--save", f"{d}/fresh",
                        "--exit-on-missing-checkpoint"]),
    ]
    # the restart idiom without the flag: from scratch, as before
    out["scratch"] = [r["loss"] for r in gpt_run(RUN + ["--train-iters", "2", "--load", f"{d}/fresh2",
                                                        "--save", f"{d}/fresh2"]).records]
    gpt_run(RUN + ["--train-iters", "2", "--save", f"{d}/small", "--no-save-optim", "--no-save-rng"])
    said, quiet = io.StringIO(), os.environ.pop("MEGALITE_QUIET", None)  # the resume line is what is checked
    try:
        with contextlib.redirect_stdout(said):
            out["without optim"] = [r["loss"] for r in gpt_run(RUN + ["--train-iters", "4", "--load",
                                                                      f"{d}/small"]).records]
    finally:
        if quiet is not None:
            os.environ["MEGALITE_QUIET"] = quiet
    out["said"] = said.getvalue()
    out["refused"].append(run_refusal(RUN + ["--train-iters", "2", "--save", f"{d}/lsgd", "--no-save-optim",
                                          "--local-sgd-interval", "2"]))
    gpt_run(RUN + ["--train-iters", "1", "--disable-bf16-reduced-precision-matmul"])
    out["reduced after the flag"] = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    gpt_run(RUN + ["--train-iters", "1"])
    out["reduced after a plain run"] = torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction
    return out


def test_ckpt_step_and_exit_on_missing_checkpoint_and_bf16_reduction(tmp_path):
    out = run_ranks(_runs, 1, args=(str(tmp_path),))[0]
    assert out["from 2"] == out["whole"][2:]
    assert out["megatron step 7"] == [8]  # a torch_dist iteration directory read as Megatron-LM's
    missing, already, exit_missing, local_sgd = out["refused"]
    assert "--no-save-optim with --local-sgd-interval" in local_sgd
    assert "--ckpt-step 7:" in missing and "holds no checkpoint of iteration 7 (it holds iterations 1, 2, 3, 4)" in missing
    assert "is one already: give the directory above it" in already
    assert "--exit-on-missing-checkpoint: --load" in exit_missing and "holds no checkpoint" in exit_missing
    assert out["scratch"] == out["whole"][:2]
    assert out["reduced after the flag"] is False and out["reduced after a plain run"] is True
    # without the optimizer state: iteration 3 is a forward of the same weights, iteration 4 follows a
    # step whose Adam moments started anew
    assert out["without optim"][0] == out["whole"][2] and out["without optim"][1] != out["whole"][3]
    assert ("optimizer state fresh (the checkpoint holds none); RNG streams from the seed "
            "(the checkpoint holds none)") in out["said"], out["said"]
    header = (Path(tmp_path) / "small" / "iter_0000002" / "rank_00000.safetensors").read_bytes()
    meta = json.loads(header[8:8 + int.from_bytes(header[:8], "little")])
    assert "optim" not in json.dumps(meta) and "rng" not in json.dumps(meta)
    full = (Path(tmp_path) / "ckpt" / "iter_0000002" / "rank_00000.safetensors").stat().st_size
    assert len(header) < full / 2
    # --print-config resolves the checkpoint the run would load
    import pretrain_gpt
    from megalite.training.entry import print_config
    from training_ranks import parse

    with pytest.raises(UsageError, match="--ckpt-step 99: .* holds no checkpoint of iteration 99"):
        print_config(parse(RUN + ["--train-iters", "4", "--load", f"{tmp_path}/ckpt", "--ckpt-step", "99"]),
                     pretrain_gpt.task())
