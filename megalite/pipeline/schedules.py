"""Forward-backward schedules over the micro-batches of one training step, by the names training,
tools and tests import: the programs (`programs`), the executor that runs one (`executor`), the
simulator that plays them on an ideal machine (`simulator`) and every rank's exchange plan (`replay`)."""
from megalite.pipeline.executor import ForwardStep, ScheduleStats, run_schedule
from megalite.pipeline.programs import (SCHEDULES, Op, build_program, forward_only_kind, is_v_shaped, peak_in_flight,
                                        program_1f1b, program_dualpipev, program_forward_only, program_forward_only_v,
                                        program_gpipe, program_interleaved, program_no_pipelining, program_zb_h1,
                                        program_zb_v)
from megalite.pipeline.replay import exchange_plans
from megalite.pipeline.simulator import (Timeline, bubble_fraction, bubble_time, main, predicted_idle, simulate,
                                         theoretical_bubble)

__all__ = [
    "ForwardStep", "ScheduleStats", "run_schedule",
    "SCHEDULES", "Op", "build_program", "forward_only_kind", "is_v_shaped", "peak_in_flight", "program_1f1b",
    "program_dualpipev", "program_forward_only", "program_forward_only_v", "program_gpipe", "program_interleaved",
    "program_no_pipelining", "program_zb_h1", "program_zb_v",
    "exchange_plans",
    "Timeline", "bubble_fraction", "bubble_time", "main", "predicted_idle", "simulate", "theoretical_bubble",
]
