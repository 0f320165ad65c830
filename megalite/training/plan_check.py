"""`--plan`: the layout planner's prediction for the run a configuration describes."""
from __future__ import annotations

import torch

from megalite.config import RunConfig, model_config
from megalite.metrics import default_peak_tflops
from megalite.tools.plan import Cluster, Prediction, check_layout
from megalite.tools.plan.muon import optimizer_of
from megalite.tools.plan.search import local_sgd_of


def check_run(cfg: RunConfig, world_size: int, gpu_memory_bytes: float | None = None,
             cluster: Cluster | None = None) -> tuple[bool, Prediction]:
    """The planner's check_layout for a run's configuration (after megalite.config.validate): the
    device's memory by default."""
    config = model_config(cfg)
    if gpu_memory_bytes is None:
        if not torch.cuda.is_available():
            raise ValueError("no GPU: give gpu_memory_bytes to check a layout")
        gpu_memory_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    if cluster is None:
        cluster = Cluster(gpus=world_size, peak_tflops=cfg.logging.peak_tflops or default_peak_tflops()
                          or Cluster.peak_tflops)
    p, t, d, prec = cfg.parallel, cfg.training, cfg.data_parallel, cfg.precision
    dtype = "bf16" if prec.bf16 else "fp16" if prec.fp16 else "fp32"
    dp = world_size // (p.tp * p.cp * p.pp)
    return check_layout(config, tp=p.tp, pp=p.pp, dp=dp, cp=p.cp, vpp=p.vpp, micro_batch_size=t.micro_batch_size,
                        global_batch_size=t.global_batch_size, seq_length=cfg.model.seq_length,
                        recompute=cfg.model.recompute, sequence_parallel=p.sequence_parallel,
                        use_distributed_optimizer=d.use_distributed_optimizer, dtype=dtype,
                        gpu_memory_bytes=gpu_memory_bytes, cluster=cluster, ddp_bucket_size=d.ddp_bucket_size,
                        pipeline_layers=p.pipeline_layers, zero_stage=d.zero_stage,
                        grad_reduce_dtype=d.grad_reduce_dtype,
                        zero_reshard_after_forward=d.zero_reshard_after_forward is not False,
                        zero_keep_params_for_step=d.zero_keep_params_for_step,
                        local_sgd=local_sgd_of(cfg.local_sgd), ep=p.expert_model_parallel_size,
                        etp=p.expert_tensor_parallel_size, schedule=p.pipeline_schedule,
                        fp8_layers=len(prec.fp8_layers(config.num_layers)), tp_comm_overlap=p.tp_comm_overlap,
                        overlap_moe_ep_comm=p.overlap_moe_expert_parallel_comm,
                        pipeline_extra_warmup=p.pipeline_extra_warmup,
                        tp_comm_overlap_splits=p.tp_comm_overlap_splits,
                        overlap_param_gather=d.overlap_param_gather, moe_dispatch_chunks=p.moe_dispatch_chunks,
                        delay_wgrad_compute=p.delay_wgrad_compute, optimizer=optimizer_of(cfg.optimizer))
