"""Checkpoint files are data, never code; paths stay inside the directory; damage is caught."""
import json
import pathlib
import struct

import pytest
import torch

from megalite import checkpoint
from megalite.checkpoint.sealed import SEAL, sealed
from megalite.models.config import TransformerConfig
from megalite.runtime import UsageError


def tiny_state(config):
    g = torch.Generator().manual_seed(0)
    return {"word_embeddings.weight": torch.randn(config.vocab_size, config.hidden_size, generator=g),
            "layers.0.mlp.fc1.weight": torch.randn(4 * config.hidden_size, config.hidden_size, generator=g),
            "final_norm.bias": torch.randn(config.hidden_size, generator=g)}


@pytest.fixture
def config():
    return TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2, vocab_size=16,
                             max_position_embeddings=8)


@pytest.fixture
def saved(tmp_path, config):
    directory = tmp_path / "ckpt"
    checkpoint.save_model_checkpoint(directory, config, "gpt", tiny_state(config), iteration=4)
    return directory


def _meta_path(directory):
    return directory / (directory / "latest").read_text().strip() / "metadata.json"


def _rank_file(directory):
    meta = json.loads(_meta_path(directory).read_text())
    return _meta_path(directory).parent / next(iter(meta["files"]))


def _replace_rank_file(directory, data: bytes):
    """New bytes for the rank file, with the size the metadata records made to match."""
    path = _rank_file(directory)
    path.write_bytes(data)
    meta = json.loads(_meta_path(directory).read_text())
    entry = meta["files"][path.name]
    meta["files"][path.name] = {**entry, "bytes": len(data)} if isinstance(entry, dict) else len(data)
    _meta_path(directory).write_text(json.dumps(sealed(meta)))  # the metadata made to agree, seal and all


class MakesAMarker:
    """Unpickling this creates a file: the proof that loading ran code."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (pathlib.Path(self.marker),)


def _pickle_bytes(obj, tmp_path) -> bytes:
    f = tmp_path / "evil.pt"
    torch.save({"model": {}, "iteration": 4, "evil": obj}, f)
    return f.read_bytes()


def test_a_pickled_rank_file_is_refused_without_running_it(saved, tmp_path):
    marker = tmp_path / "marker"
    _replace_rank_file(saved, _pickle_bytes(MakesAMarker(str(marker)), tmp_path))
    with pytest.raises(UsageError, match=f"{_rank_file(saved)} is corrupt: not a megalite rank file"):
        checkpoint.load_full_state_dict(saved)
    assert not marker.exists(), "loading the checkpoint ran code from the rank file"


def test_a_version_1_checkpoint_is_refused_without_unpickling(saved, tmp_path):
    marker = tmp_path / "marker"
    it = saved / "iter_0000004"
    (it / "rank_00000.pt").write_bytes(_pickle_bytes(MakesAMarker(str(marker)), tmp_path))
    meta = json.loads((it / "metadata.json").read_text())
    meta.update(format_version=1, files={"rank_00000.pt": (it / "rank_00000.pt").stat().st_size})
    (it / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(UsageError, match="format version 1, this megalite reads versions 2, 3"):
        checkpoint.load_full_state_dict(saved)
    assert not marker.exists()


def _edit_metadata(directory, edit, reseal=False):
    meta = json.loads(_meta_path(directory).read_text())
    edit(meta)
    _meta_path(directory).write_text(json.dumps(sealed({k: v for k, v in meta.items() if k != SEAL}) if reseal
                                                else meta))


@pytest.mark.parametrize("edit, message", [
    (lambda m: m["config"].update(layernorm_epsilon=0.5), r"field config\.layernorm_epsilon was changed after the "
                                                          r"checkpoint was written \(it fails its CRC-32 check; it now "
                                                          r"holds 0\.5\)"),
    (lambda m: m["config"].pop("num_layers"), r"field config\.num_layers was deleted after the checkpoint was written"),
    (lambda m: m.update(iteration=9), r"field iteration was changed"),
    (lambda m: m["config"].update(flavour="x"), r"field config\.flavour was added"),
], ids=["epsilon-edited", "field-deleted", "iteration-edited", "field-added"])
def test_an_edited_metadata_field_is_refused_naming_it(saved, edit, message):
    """Issue #48: metadata.json was outside the checks: layernorm_epsilon edited to 0.5 trained silently."""
    checkpoint.load_full_state_dict(saved)  # intact
    _edit_metadata(saved, edit)
    with pytest.raises(UsageError, match=message) as e:
        checkpoint.load_full_state_dict(saved)
    assert "\n" not in str(e.value) and "restore the checkpoint's own metadata.json" in str(e.value)


@pytest.mark.parametrize("edit, message", [
    (lambda m: m["config"].pop("num_layers"), r"the model config has no num_layers"),
    (lambda m: m["config"].update(num_moe_experts="four"), r"config\.num_moe_experts holds 'four', not int"),
    (lambda m: m["config"].update(num_layers=3.5), r"config\.num_layers holds 3\.5, not int"),
    (lambda m: m["config"].update(hidden_size=0), r"its model config is refused \(hidden_size must be >= 1"),
    (lambda m: m["config"].update(params_dtype="float99"), r"config\.params_dtype 'float99' is not a torch dtype"),
], ids=["missing", "mistyped", "float-for-int", "refused-value", "bad-dtype"])
def test_a_missing_or_mistyped_config_field_is_one_line(saved, edit, message):
    """Typed on read: what a seal cannot vouch for (an older checkpoint without one, or a rewritten
    seal) still ends in one line, not a KeyError / TypeError traceback."""
    _edit_metadata(saved, edit, reseal=True)
    with pytest.raises(UsageError, match=message) as e:
        checkpoint.load_full_state_dict(saved)
    assert "\n" not in str(e.value)


def test_a_checkpoint_written_before_seals_reads_as_before(saved):
    _edit_metadata(saved, lambda m: m.pop(SEAL))
    config, kind, state = checkpoint.load_full_state_dict(saved)
    assert kind == "gpt" and config.hidden_size == 8 and state


def test_latest_pointing_outside_the_directory_is_refused(tmp_path, config):
    checkpoint.save_model_checkpoint(tmp_path / "elsewhere", config, "gpt", tiny_state(config), iteration=4)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "latest").write_text("../elsewhere/iter_0000004\n")
    with pytest.raises(UsageError, match=r"names '\.\./elsewhere/iter_0000004', not a checkpoint of this directory"):
        checkpoint.CheckpointReader(tmp_path / "ckpt")


@pytest.mark.parametrize("name", ["../../outside.safetensors", "rank_00000.safetensors/../../x", "x.pt"])
def test_metadata_naming_files_outside_the_checkpoint_is_refused(saved, name):
    meta = json.loads(_meta_path(saved).read_text())
    meta["files"] = {name: next(iter(meta["files"].values()))}
    # crafted with a seal of its own: the file-name check still stands behind the seal
    _meta_path(saved).write_text(json.dumps(sealed({k: v for k, v in meta.items() if k != SEAL})))
    with pytest.raises(UsageError, match="not rank_NNNNN.safetensors"):
        checkpoint.CheckpointReader(saved)


def test_metadata_listing_fewer_files_than_ranks_is_refused(saved):
    meta = json.loads(_meta_path(saved).read_text())
    meta["layout"]["world"] = 2
    _meta_path(saved).write_text(json.dumps(sealed({k: v for k, v in meta.items() if k != SEAL})))  # resealed
    with pytest.raises(UsageError, match="written by 2 ranks but its metadata lists 1 rank files"):
        checkpoint.CheckpointReader(saved)


def _data_start(path) -> int:
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def test_zeros_over_the_middle_of_a_rank_file_are_caught_by_the_checksum(saved):
    path = _rank_file(saved)
    data = bytearray(path.read_bytes())
    start = _data_start(path)
    middle = start + (len(data) - start) // 2
    data[middle - 64:middle + 64] = bytes(128)
    path.write_bytes(bytes(data))
    with pytest.raises(UsageError, match=rf"{path.name} is corrupt: tensor model/\S+ fails its CRC-32 check"):
        checkpoint.load_full_state_dict(saved)


def test_one_flipped_bit_in_a_float_is_caught_by_the_checksum(saved):
    path = _rank_file(saved)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # a mantissa bit of the last float
    path.write_bytes(bytes(data))
    with pytest.raises(UsageError, match="fails its CRC-32 check"):
        checkpoint.load_full_state_dict(saved)


def test_a_tensor_with_a_missing_tp_half_is_refused(saved):
    """A slice claiming rows [0, 8) of a 16-row tensor whose other half no rank file holds."""
    from megalite.checkpoint.fileformat import RankFile, write_rank_file

    path = _rank_file(saved)
    writer = RankFile(path).meta["writer"]  # the same writer, so only the missing half is wrong
    half = torch.ones(8, 8)
    meta = {"iteration": 4, "writer": writer, "model": {"word_embeddings.weight": [
        {"tensor": "model/word_embeddings.weight", "dim": 0, "start": 0, "full": 16}]}}
    size = write_rank_file(path, [("model/word_embeddings.weight", half)], meta)
    _replace_rank_file(saved, path.read_bytes()[:size])
    with pytest.raises(UsageError, match=r"holds word_embeddings.weight only in part \(rows/columns \[\(0, 8\)\] of 16"):
        checkpoint.CheckpointReader(saved).full_tensor("word_embeddings.weight")


def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path, config):
    state = tiny_state(config)
    state["layers.0.mlp.fc1.weight"][3, 1] = float("nan")
    checkpoint.save_model_checkpoint(tmp_path, config, "gpt", state)
    with pytest.raises(UsageError, match="holds NaN/inf values in layers.0.mlp.fc1.weight"):
        checkpoint.load_full_state_dict(tmp_path)


def test_reader_takes_a_save_directory_or_one_iteration_and_names_a_missing_path(saved, tmp_path):
    it = saved / "iter_0000004"
    assert checkpoint.CheckpointReader.exists(saved) and checkpoint.CheckpointReader.exists(it)
    assert checkpoint.CheckpointReader(it).path == it == checkpoint.CheckpointReader(saved).path
    assert not checkpoint.CheckpointReader.exists(tmp_path / "nothing")
    with pytest.raises(UsageError, match=f"checkpoint path {tmp_path / 'nothing'} does not exist"):
        checkpoint.CheckpointReader(tmp_path / "nothing")
    (tmp_path / "plain").write_text("x")
    with pytest.raises(UsageError, match=f"checkpoint path {tmp_path / 'plain'} is a file"):
        checkpoint.CheckpointReader(tmp_path / "plain")


def test_state_dict_round_trips_and_vocabulary_is_padded(saved, config):
    loaded_config, kind, sd = checkpoint.load_full_state_dict(saved)
    want = tiny_state(config)
    assert kind == "gpt" and loaded_config.hidden_size == 8
    assert all(torch.equal(sd[k][:want[k].shape[0]], want[k]) for k in want)


def test_rank_files_are_readable_with_the_safetensors_package(saved, config):
    safetensors = pytest.importorskip("safetensors")
    path = _rank_file(saved)
    with safetensors.safe_open(str(path), framework="pt") as f:
        structure = json.loads(f.metadata()["megalite"])
        fc1 = f.get_tensor(structure["model"]["layers.0.mlp.fc1.weight"][0]["tensor"])
    assert torch.equal(fc1, tiny_state(config)["layers.0.mlp.fc1.weight"])
