"""Checkpoints that load at any layout, never lose work, and never run code from a file.

Format (version 3): `DIR/latest` names the newest complete checkpoint `DIR/iter_NNNNNNN/`, which
holds `metadata.json` and one `rank_NNNNN.safetensors` per rank (see `fileformat`). Every tensor
is stored as a slice of its *full* tensor: the one a single-device model would hold, under a
layout-free name (layers by global number, vocabulary without padding). A rank file's structure
(JSON in its header) holds

  "model": {name: [{tensor, dim, start, full, blocks}]}    slices of model weights (dim None: the whole)
  "optim": {name: [{dim, start, shard, full, blocks, lo, hi, values: {master, exp_avg, exp_avg_sq}}]}
           flat ranges [lo, hi) of a TP shard (placed at `start` along `dim` of the full tensor);
           master "model" when the fp32 master is the parameter itself (stored once, as the weight)
  "blocks" (absent: 1) k > 1: the full tensor is k equal blocks along `dim` (a gated MLP's fc1:
           [gate; up]) and the slice is its part of each, at `start` within every block
  "step", "loss_scaler", "rng" (this rank's RNG streams)

Loading assembles, for each tensor this rank needs, its full tensor from every rank's slices
(which must cover it exactly) and cuts out the new layout's piece: any (tp, pp, dp, vpp) reads any
other, at any ZeRO stage (the optimizer's shards too; stage 3 gathers its units while saving).
Each replica writes once: model weights from DP rank 0, replicated (non-TP) tensors from TP rank 0,
the tied embedding from the first stage only.

Version 2 (read too) differs only in a gated MLP's fc1, whose rows it interleaved (gate_i, up_i);
the reader puts them in halves as it assembles them.

Writing is atomic: ranks write into `iter_N.tmp/` (fsynced), then rank 0 writes the metadata,
renames the directory into place and updates `latest` last, so a crash at any moment leaves the
previous checkpoint loadable (see `save` for the store-based commit that --save-async uses).

A Megatron-LM `torch_dist` checkpoint (its `latest_checkpointed_iteration.txt` and
`iter_NNNNNNN/.metadata`) loads too: `open_checkpoint` gives a `MegatronCheckpoint` for it, read
with torch.distributed.checkpoint and never with Megatron-LM (`megatron_dist`, `megatron_dist_map`;
docs/megatron-checkpoints.md).

Modules, one job each: `layout` (names, placements, directory names), `fileformat` (rank file
bytes; plain data as JSON that names its tensors), `rank_state` (what a rank saves; RNG restore), `atomic` (temporary directory, rank-file
writes, commit), `save` (the Checkpointer: inline and background saves over the store), `lock`
(one job per --save directory), `reader` (validation, checksums, full tensors), `load` (loading at
any layout).
"""
from megalite.checkpoint.atomic import build_metadata, commit, save_model_checkpoint
from megalite.checkpoint.layout import FORMAT_VERSION, config_from_dict, global_name
from megalite.checkpoint.megatron_dist import (MegatronCheckpoint, checkpoint_exists, is_megatron_checkpoint,
                                               open_checkpoint)
from megalite.checkpoint.load import load_full_state_dict, load_model_weights, load_optimizer_state
from megalite.checkpoint.rank_state import collect_rank_state, restore_rng
from megalite.checkpoint.layout import SHAPE_FIELDS
from megalite.checkpoint.reader import LLAMA_SHAPE_FIELDS, CheckpointReader, check_compatible, check_finite
from megalite.checkpoint.save import Checkpointer

__all__ = ["FORMAT_VERSION", "LLAMA_SHAPE_FIELDS", "SHAPE_FIELDS", "CheckpointReader", "Checkpointer",
           "MegatronCheckpoint", "build_metadata", "check_compatible", "checkpoint_exists",
           "check_finite", "collect_rank_state", "commit", "config_from_dict", "global_name", "is_megatron_checkpoint",
           "load_full_state_dict", "load_model_weights", "load_optimizer_state", "open_checkpoint", "restore_rng",
           "save_model_checkpoint"]
