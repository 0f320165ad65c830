"""Time to build one pipeline stage of a large GPT on one tensor-parallel rank, measured on a few
layers and extrapolated to the stage.

    python scripts/bench_model_build.py                           # gpt-175b, tp 8, pp 16, 1 layer, CPU
    python scripts/bench_model_build.py --device cuda --layers 2  # on a GPU: weights drawn there

Layout-free initialization draws every full weight on every TP rank and keeps the rank's block, so
a rank's build time does not shrink with tp. On a GPU the draws run on the GPU (`init_device`).
This process stands in for TP rank 0 of `--tp` (the parallel state is faked: no other ranks
exist), builds `--layers` transformer layers and the first stage's embeddings, and reports seconds
per layer and the extrapolated time for a stage of num_layers / pp layers (plus the embeddings).
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from megalite.models import preset
from megalite.models.transformer import TransformerLayer
from megalite.parallel import state
from megalite.parallel.layers import VocabParallelEmbedding, pad_vocab_size


def _timed(fn, device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    del out
    return time.perf_counter() - t


def measure(model: str, tp: int, pp: int, layers: int, device: torch.device) -> dict:
    config = preset(model)
    saved = state.get_tensor_model_parallel_world_size, state.get_tensor_model_parallel_rank
    state.get_tensor_model_parallel_world_size = lambda: tp  # stand in for rank 0 of tp
    state.get_tensor_model_parallel_rank = lambda: 0
    try:
        per_layer = [_timed(lambda n=n: TransformerLayer(config, n, seed=1234, device=device), device)
                     for n in range(layers)]
        padded = pad_vocab_size(config.vocab_size, tp, config.make_vocab_size_divisible_by)
        embedding = _timed(lambda: VocabParallelEmbedding(padded, config.hidden_size,
                                                          num_real_embeddings=config.vocab_size, device=device), device)
    finally:
        state.get_tensor_model_parallel_world_size, state.get_tensor_model_parallel_rank = saved
    stage_layers = config.num_layers // pp
    layer_s = sum(per_layer) / len(per_layer)
    return {"model": model, "tp": tp, "pp": pp, "device": str(device), "layers_built": layers,
            "seconds_per_layer": layer_s, "embedding_seconds": embedding, "stage_layers": stage_layers,
            "first_stage_seconds": stage_layers * layer_s + embedding, "other_stage_seconds": stage_layers * layer_s}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-175b")
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--pp", type=int, default=16)
    ap.add_argument("--layers", type=int, default=1, help="layers actually built (the rest extrapolated)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    with torch.no_grad():
        r = measure(args.model, args.tp, args.pp, args.layers, torch.device(args.device))
    print(f"{r['model']} tp={r['tp']} pp={r['pp']} on {r['device']}: {r['seconds_per_layer']:.2f} s per layer "
          f"(mean of {r['layers_built']}), embedding {r['embedding_seconds']:.2f} s; a stage of "
          f"{r['stage_layers']} layers: first {r['first_stage_seconds']:.1f} s, others {r['other_stage_seconds']:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)


if __name__ == "__main__":
    main()
