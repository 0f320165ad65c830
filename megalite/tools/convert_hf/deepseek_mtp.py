"""DeepSeek-V3's multi-token prediction (MTP) layers beside Hugging Face's model: their copies of the head
and embedding, how many the weights hold, reading them from weight files, and the module export appends.
Their rows (deepseek.mtp_rows) and the import that reads them (deepseek.mtp_tensors) build on the
table, so they stay in deepseek.py.

Multi-token prediction: DeepSeek's files hold depth k's module as decoder layer num_hidden_layers + k - 1
(num_nextn_predict_layers of them) with `enorm`, `hnorm`, `eh_proj`, `shared_head.norm` (megalite's
`mtp.{k-1}.final_layernorm`) and copies of the head and embedding (`shared_head.head`, `embed_tokens`),
which megalite shares and import checks. transformers' DeepseekV3ForCausalLM does not load them, so
import reads them from the directory the model came from (its layer through the main layers' rows, the
rotary rows reordered alike); export appends them to DeepseekV3Model.layers, which runs only the first
num_hidden_layers, so that save_pretrained writes them as DeepSeek's files hold them.
"""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Mapping

import torch
from torch import nn

# Beside each MTP layer DeepSeek's files hold copies of the output head and the embedding, which
# megalite's MTP modules share with the main model.
MTP_COPIES = {"shared_head.head.weight": "lm_head.weight", "embed_tokens.weight": "model.embed_tokens.weight"}


def layer_of(name: str) -> int | None:
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


def nextn(cfg) -> int:
    """num_nextn_predict_layers (transformers' num_mtp_layers)."""
    return int(getattr(cfg, "num_nextn_predict_layers", 0) or 0)


def mtp_layers_in(names, num_layers: int) -> list[int]:
    """The layer numbers from num_layers on (multi-token prediction's) of tensor `names`."""
    return sorted({i for i in map(layer_of, names) if i is not None and i >= num_layers})


def mtp_count_problems(layers: list[int], cfg) -> list[str]:
    """The MTP layers weights hold against num_nextn_predict_layers' (holding none is a note, not a problem)."""
    n, depth = cfg.num_hidden_layers, nextn(cfg)
    if not layers or layers == list(range(n, n + depth)):
        return []
    held = ", ".join(f"model.layers.{i}" for i in layers)
    wanted = ", ".join(f"model.layers.{i}" for i in range(n, n + depth)) or "none"
    return [f"the weights hold multi-token prediction layer(s) {held} but num_hidden_layers={n} and "
            f"num_nextn_predict_layers={depth} call for {wanted} (use the config saved with these weights)"]


def differing_copies(layers: list[int], get) -> list[str]:
    """The MTP layers' copies of the output head and embedding that are not the main model's (`get(name)`:
    a tensor, or None when absent; a tied model's lm_head is its embedding)."""
    problems = []
    for i in layers:
        for leaf, main in MTP_COPIES.items():
            held = get(f"model.layers.{i}.{leaf}")
            if held is None:
                continue
            shared = get(main)
            shared = get("model.embed_tokens.weight") if shared is None else shared
            if not torch.equal(held.to(shared.dtype), shared):
                problems.append(f"model.layers.{i}.{leaf} differs from {main} (megalite's multi-token prediction "
                                f"shares the output head and the embedding with the main model)")
    return problems


def read_stored(directory, names) -> dict[str, torch.Tensor]:
    """Tensors `names` of a save_pretrained directory's weight files (safetensors or pytorch_model.bin,
    sharded or not; the order stored_tensor_names reads them in)."""
    path, wanted = Path(directory), set(names)
    files = sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (path / index).is_file():
            weight_map = json.loads((path / index).read_text())["weight_map"]
            files = [path / f for f in sorted({weight_map[n] for n in wanted if n in weight_map})]
            break
    out = {}
    for file in files:
        if file.suffix == ".safetensors":
            from safetensors import safe_open  # installed with transformers

            with safe_open(str(file), framework="pt") as f:
                out.update({n: f.get_tensor(n) for n in wanted & set(f.keys())})
        else:
            tensors = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            out.update({n: tensors[n] for n in wanted & set(tensors)})
    return out


def main_dtype(name: str, theirs: Mapping[str, torch.Tensor], n: int) -> torch.dtype:
    """The dtype of the last main layer's tensor of the same name (the routers' fp32 biases), else the
    embedding's."""
    twin = re.sub(r"^model\.layers\.\d+\.", f"model.layers.{n - 1}.", name)
    return theirs[twin].dtype if twin in theirs else theirs["model.embed_tokens.weight"].dtype


def mtp_module(cfg, i: int, has_experts: bool) -> nn.Module:
    """DeepSeek's MTP layer i (num_hidden_layers + j) as its files hold it: a DeepseekV3DecoderLayer
    with enorm, hnorm, eh_proj, shared_head (norm, head) and embed_tokens beside it. Appended to
    DeepseekV3Model.layers, which runs its first num_hidden_layers only, save_pretrained writes it and
    the logits stay the main model's."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    cfg = copy.deepcopy(cfg)
    cfg.first_k_dense_replace = 0 if has_experts else i + 1  # the MLP's kind: the last main layer's
    layer = hf.DeepseekV3DecoderLayer(cfg, layer_idx=i)
    h, eps = cfg.hidden_size, cfg.rms_norm_eps
    layer.enorm, layer.hnorm = hf.DeepseekV3RMSNorm(h, eps), hf.DeepseekV3RMSNorm(h, eps)
    layer.eh_proj = nn.Linear(2 * h, h, bias=False)
    layer.shared_head = nn.Module()
    layer.shared_head.norm = hf.DeepseekV3RMSNorm(h, eps)
    layer.shared_head.head = nn.Linear(h, cfg.vocab_size, bias=False)
    layer.embed_tokens = nn.Embedding(cfg.vocab_size, h)
    return layer
