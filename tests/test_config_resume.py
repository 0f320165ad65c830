"""The configuration travels with the run: checkpoints and metrics hold it, and `--load` without
shape flags takes the model from the checkpoint (one imported from Hugging Face too); a shape flag
that disagrees is named in one line."""
import json
import os
import subprocess
import sys

import pytest

from cli import ROOT, records, torchrun
from megalite import checkpoint
from megalite.config import build_parser

tf = pytest.importorskip("transformers")

SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=256, max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=1e-6)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """A random Llama saved by transformers, imported with megalite's converter."""
    from megalite.tools import convert_hf

    root = tmp_path_factory.mktemp("hf-llama")
    import torch

    torch.manual_seed(0)
    tf.LlamaForCausalLM(tf.LlamaConfig(**SHAPE)).save_pretrained(root / "hf")
    assert convert_hf.main(["import", "--hf-dir", str(root / "hf"), "--out", str(root / "ckpt")]) == 0
    return root / "ckpt"


ENV = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}


def _print_config(*argv, here=None):
    """`pretrain_gpt.py argv --print-config` launched as rank 0 of 2; or, given `here` (pytest's
    monkeypatch and capsys), its main in this process with that environment: the same parse, checks
    and printing, without a Python start-up."""
    if here is None:
        return subprocess.run([sys.executable, str(ROOT / "pretrain_gpt.py"), *argv, "--print-config"],
                              capture_output=True, text=True, timeout=120, cwd=ROOT, env={**os.environ, **ENV})
    import pretrain_gpt

    monkeypatch, capsys = here
    for name in ("MEGALITE_QUIET", "TORCHELASTIC_ERROR_FILE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in ENV.items():
        monkeypatch.setenv(name, value)
    capsys.readouterr()
    code = pretrain_gpt.main([*argv, "--print-config"])
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["pretrain_gpt.py", *argv, "--print-config"], code, out, err)


def test_load_without_shape_flags_takes_the_imported_model(imported, tmp_path, monkeypatch, capsys):
    run = _print_config("--load", str(imported), "--mock-data", here=(monkeypatch, capsys))
    assert run.returncode == 0, run.stderr
    path = tmp_path / "run.toml"
    path.write_text(run.stdout)
    m = build_parser("x", "gpt-tiny").parse_args(["--config", str(path)]).model
    shape = (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups, m.ffn_hidden_size)
    assert shape == (2, 64, 4, 2, 96)
    # gpt-tiny's preset holds 128 positions: the checkpoint's 256 are kept, and the samples fill them.
    assert (m.max_position_embeddings, m.seq_length, m.vocab_size, m.swiglu, m.normalization) == (256, 256, 256, True,
                                                                                                  "rmsnorm")
    assert "model from" in run.stdout + run.stderr


def test_use_checkpoint_args_names_a_shape_flag_that_disagrees(imported):
    run = _print_config("--load", str(imported), "--mock-data", "--use-checkpoint-args", "--hidden-size", "128")
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        f"megalite: error: --hidden-size 128: the checkpoint {imported}/iter_0000000 holds 64; drop the flag to "
        f"train the checkpoint's model, or --load another"]


def test_a_shape_flag_without_use_checkpoint_args_is_checked_against_the_checkpoint(imported, tmp_path):
    run = torchrun("pretrain_gpt.py", 1, "--load", str(imported), "--mock-data", "--train-iters", "1",
                   "--model", "llama-tiny", timeout=200)
    assert run.returncode != 0
    assert "holds a model of another shape: num_layers 2 (checkpoint) vs 4 (now)" in run.stderr


@pytest.mark.slow
def test_the_imported_model_trains_and_its_configuration_travels(imported, tmp_path):
    """The fine-tuning run: pretrain_gpt's main on the 2 ranks of one spawn; the resume: launched by torchrun."""
    from training_ranks import entry_main

    from megalite.testing import run_ranks

    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    ranks = run_ranks(entry_main, 2, args=(["--load", str(imported), "--finetune", "--mock-data", "--tp", "2",
                                             "--seq-length", "32", "--train-iters", "2", "--log-interval", "1",
                                             "--eval-interval", "0", "--metrics-file", str(metrics), "--save",
                                             str(ckpt)],), timeout=300, env={"MEGALITE_QUIET": ""})
    assert [code for code, *_ in ranks] == [0, 0]
    stdout = ranks[0][1]
    assert f"writing checkpoints to {ckpt}, metrics to {metrics}, configuration to {metrics}.config.toml" in stdout
    assert len(records(metrics)) == 2
    sidecar = build_parser("x", "gpt-tiny").parse_args(["--config", f"{metrics}.config.toml"])
    assert (sidecar.model.hidden_size, sidecar.parallel.tp, sidecar.checkpoint.finetune) == (64, 2, True)
    saved = checkpoint.CheckpointReader(str(ckpt)).metadata["run_config"]
    assert saved["model"]["num_layers"] == 2 and saved["parallel"]["tp"] == 2
    # It resumes at another layout with no shape flag at all, its sequence length kept.
    again = torchrun("pretrain_gpt.py", 1, "--load", str(ckpt), "--mock-data", "--train-iters", "3",
                     "--log-interval", "1", "--eval-interval", "0", "--metrics-file", str(tmp_path / "r.jsonl"),
                     timeout=300)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from" in again.stdout and "x 32 tokens" in again.stdout
    assert [r["iteration"] for r in records(tmp_path / "r.jsonl")] == [3]
    assert json.loads((tmp_path / "r.jsonl").read_text().splitlines()[0])["loss"] > 0


def test_a_resumed_rope_model_may_take_longer_sequences_and_a_retuned_base(imported, tmp_path, monkeypatch, capsys):
    run = _print_config("--load", str(imported), "--mock-data", "--seq-length", "512", "--rotary-base", "20000",
                        "--pp", "2", "--num-layers-per-virtual-pipeline-stage", "1", here=(monkeypatch, capsys))
    assert run.returncode == 0, run.stderr
    path = tmp_path / "run.toml"
    path.write_text(run.stdout)
    cfg = build_parser("x", "gpt-tiny").parse_args(["--config", str(path)])
    # rotary positions are no weights: 512 tokens raise them; 2 layers on 2 stages are one a stage (no --vpp)
    assert (cfg.model.max_position_embeddings, cfg.model.rotary_base, cfg.parallel.vpp) == (512, 20000.0, None)


@pytest.mark.parametrize("argv,says", [(["--tp", "3"], r"^the checkpoint's num_attention_heads \(4\) is not divisible"),
                                       (["--cp", "3"], r"the checkpoint's seq_length 256 is not divisible by 6")])
def test_an_error_about_the_imported_models_values_names_the_checkpoint(imported, monkeypatch, argv, says):
    """Issue #48: a value that came from the Hugging Face import is not blamed on a flag never given."""
    from megalite.errors import UsageError
    from megalite.training.checkpoint_shape import adopt_checkpoint_shape

    monkeypatch.setenv("WORLD_SIZE", "3")
    cfg = build_parser("x", "gpt-tiny").parse_args(["--load", str(imported), "--mock-data", *argv])
    with pytest.raises(UsageError, match=says):
        adopt_checkpoint_shape(cfg)
