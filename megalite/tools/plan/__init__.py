"""Parallel layout planner: which (tp, pp, dp, vpp, micro-batch, recompute, sequence parallel,
ZeRO stage; and for a mixture-of-experts model ep, etp) to train a GPT with, on how many GPUs, and
what it costs.

    python -m megalite.tools.plan --model gpt-175b --gpus 1024 --gpu-memory-gib 80 \\
        --global-batch-size 1536 --seq-length 2048 [--explain] [--json]

    from megalite.tools.plan import Cluster, Layout, plan, predict, check_layout
    result = plan(preset("gpt-175b"), Cluster(gpus=1024), global_batch_size=1536, seq_length=2048)
    best = result[0]                       # a Prediction: .memory, .time, .fits, .command()
    fits, pred = check_layout(config, tp=8, pp=16, dp=8, micro_batch_size=1, global_batch_size=1536,
                              seq_length=2048, gpu_memory_bytes=80 * 2**30)
    pred.memory.total, pred.time.total     # bytes on the fullest stage, seconds per step

Every layout megalite accepts is enumerated and, for each, the planner predicts:

- memory per GPU on the fullest pipeline stage, itemised (`memory.py`; its parts in `states.py`,
  `zero_replay.py` and `activations.py`): parameters, gradients and optimizer states counted the
  way megalite lays them out at each ZeRO stage (the parameters of a GPT stage built on the meta
  device, `megalite.optim.buffers.plan_layout`, stage 3's units from
  `megalite.optim.zero.layer_units`, `MegaliteOptimizer._master`), stages 2-3's transient
  whole-bucket gradients and gathered units (replayed in megalite's order of events),
  activations from `megalite.models.activation_bytes_per_layer` (Korthikanti et al. 2022) times
  the chunks the schedule program holds in flight (`megalite.pipeline.schedules.peak_in_flight`),
  the output layer and cross-entropy buffers on the last stage, and a fixed framework overhead;
  plus the transient peak while the model is built;
- step time (`step_time.py`; links and data parallelism in `comm.py`): model FLOPs
  (`megalite.metrics.model_flops_per_iteration`, plus what recomputation runs again) over the
  cluster's sustained throughput, the pipeline bubble of the schedule
  (`megalite.pipeline.schedules.bubble_fraction`), tensor-parallel collectives, pipeline
  point-to-point messages, the data-parallel gradient reduction that cannot hide behind the last
  backward pass, and the optimizer step;
- for a MoE model (`experts.py`): expert weights split over ep x etp in buffers of their own,
  reduced and sharded over the expert-data-parallel group; the router's, the dispatched rows' and
  the experts' activations; the active experts' FLOPs; the token dispatch's bytes, all exposed;
- for DeepSeek-V3's parts: multi-head latent attention's activations
  (`megalite.models.memory.mla_activation_bytes_per_layer`; its parameters come with the meta
  build), and the multi-token prediction modules on the last stage: parameters, activations
  (`activations.mtp_bytes`) and FLOPs (`megalite.metrics.mtp_forward_flops`).

`--compare LAYOUT` predicts a layout of the user's (an explicit --pipeline-layers split included)
next to the plan's best.

inputs.py: Cluster, Layout, Run, parameter counts; states.py, zero_replay.py, activations.py: the
memory's parts, memory.py: their totals; costs.py: one layout's costs, step_time.py: its compute,
comm.py: its communication; experts.py: the MoE terms; predict.py: one layout; search.py: every
layout, check_layout; report.py: tables, --explain; command.py: the pretrain_gpt.py command;
json_forms.py: JSON; cli.py: the command line. docs/planner.md states every formula and assumption.
"""
from megalite.tools.plan.activations import in_flight_chunks
from megalite.tools.plan.cli import build_parser, config_from_args, main
from megalite.tools.plan.comm import DataParallelTime, dp_traffic, turn_kept
from megalite.tools.plan.command import launch_command, model_flags
from megalite.tools.plan.inputs import (
    DTYPE_BYTES,
    GIB,
    GPT_PRESETS,
    RECOMPUTE,
    SCHEDULES,
    ZERO_STAGES,
    Cluster,
    Layout,
    Run,
    active_parameters,
    layer_numels,
    positions,
    rank_parameters,
    stage_parameters,
    total_parameters,
)
from megalite.tools.plan.memory import Memory
from megalite.tools.plan.predict import Prediction, StageResult, predict, stage_that_makes_it_fit, with_zero_stage
from megalite.tools.plan.report import explain, format_rejections, format_table
from megalite.tools.plan.search import PlanResult, Rejection, check_layout, divisors, plan
from megalite.tools.plan.states import StateBytes, rank_state_bytes
from megalite.tools.plan.step_time import StepTime

__all__ = [
    "DTYPE_BYTES",
    "GIB",
    "GPT_PRESETS",
    "RECOMPUTE",
    "SCHEDULES",
    "ZERO_STAGES",
    "Cluster",
    "DataParallelTime",
    "Layout",
    "Memory",
    "PlanResult",
    "Prediction",
    "Rejection",
    "Run",
    "StageResult",
    "StateBytes",
    "StepTime",
    "active_parameters",
    "build_parser",
    "check_layout",
    "config_from_args",
    "divisors",
    "dp_traffic",
    "explain",
    "format_rejections",
    "format_table",
    "in_flight_chunks",
    "launch_command",
    "layer_numels",
    "main",
    "model_flags",
    "plan",
    "positions",
    "predict",
    "rank_parameters",
    "rank_state_bytes",
    "stage_parameters",
    "stage_that_makes_it_fit",
    "total_parameters",
    "turn_kept",
    "with_zero_stage",
]
