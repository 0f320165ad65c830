"""A printed configuration is the model that trains (issue #48): for every preset, --print-config's
file read back builds the same model, with the preset's fields written out as derived comments and
with those comments taken as given; a MoE preset's MoE fields included; and the run's .config.toml
is the same file."""
from __future__ import annotations

import re

import pytest

from megalite import config as C
from megalite.config.expand import expanded
from megalite.models import PRESETS
from training_ranks import train_losses
from megalite.testing import run_ranks

GPT_PRESETS = sorted(n for n in PRESETS if not n.startswith("bert"))


def _parse(argv):
    return C.build_parser("test", "gpt-tiny").parse_args(argv)


def _printed(cfg) -> str:
    return C.to_toml(expanded(cfg), "printed")


def _uncommented(text: str, moe: bool) -> str:
    """Every derived line of [model] (and of [moe] for a MoE model: a dense one refuses MoE flags) given."""
    parts = re.split(r"^(?=\[)", text, flags=re.M)
    return "".join(re.sub(r"^# (\w+ = .*)  \(derived\)$", r"\1", part, flags=re.M)
                   if part.startswith("[model]") or (moe and part.startswith("[moe]")) else part for part in parts)


@pytest.mark.parametrize("name", GPT_PRESETS)
def test_every_preset_prints_and_reads_back_to_the_same_model(name, tmp_path):
    cfg = _parse(["--model", name])
    built = C.model_config(cfg)
    text = _printed(cfg)
    assert f"# num_layers = {built.num_layers}  (derived)" in text  # the preset written out
    for kind, body in (("as printed", text), ("every derived line given", _uncommented(text, built.is_moe))):
        path = tmp_path / f"{kind[:5]}.toml"
        path.write_text(body)
        again = _parse(["--config", str(path)])
        assert C.model_config(again) == built, kind
    assert _printed(_parse(["--config", str(tmp_path / "as pr.toml")])) == text  # and prints the same file again


def test_a_moe_presets_printed_moe_fields_are_the_models():
    text = _printed(_parse(["--model", "moe-tiny"]))
    for line in ("# num_experts = 8  (derived)", '# moe_layer_freq = "[0,1,1,1]"  (derived)',
                 "# moe_aux_loss_coeff = 0.01  (derived)", "# moe_shared_expert_intermediate_size = 32  (derived)"):
        assert line in text, line
    dense = _printed(_parse([]))
    assert "\nmoe_router_topk = 2" not in dense and "# moe_router_topk = 2  (derived)" in dense


def test_a_flag_over_a_printed_file_still_derives_the_fields_it_decides(tmp_path):
    path = tmp_path / "moe.toml"
    path.write_text(_printed(_parse(["--model", "moe-tiny"])))
    deeper = C.model_config(_parse(["--config", str(path), "--num-layers", "6", "--moe-layer-freq", "2"]))
    assert deeper.num_layers == 6 and list(deeper.moe_layer_freq) == [1, 0, 1, 0, 1, 0]


@pytest.mark.slow
def test_print_reload_train_gives_the_same_losses(tmp_path):
    argv = ["--model", "moe-tiny", "--train-iters", "3", "--log-interval", "1", "--seq-length", "32",
            "--global-batch-size", "4", "--micro-batch-size", "2", "--eval-interval", "0"]
    path = tmp_path / "moe.toml"
    path.write_text(_printed(_parse(argv)))
    first = run_ranks(train_losses, 1, args=(argv,))[0]
    again = run_ranks(train_losses, 1, args=(["--config", str(path)],))[0]
    assert again == first
