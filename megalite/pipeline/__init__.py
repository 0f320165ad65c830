"""Pipeline parallelism: stage-to-stage communication and forward-backward schedules."""
from megalite.pipeline.schedules import build_program, run_schedule

__all__ = ["build_program", "run_schedule"]
