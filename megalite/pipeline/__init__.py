"""Pipeline parallelism: stage-to-stage communication and forward-backward schedules."""
from megalite.pipeline.schedules import forward_backward_no_pipelining

__all__ = ["forward_backward_no_pipelining"]
