"""Pipeline parallelism: stage-to-stage communication and forward-backward schedules."""
from megalite.pipeline.executor import run_schedule
from megalite.pipeline.programs import build_program

__all__ = ["build_program", "run_schedule"]
