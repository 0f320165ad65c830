"""Facts read off the schedule programs without running them: the peak number of micro-batches
(of one model chunk) whose activations a pipeline rank holds."""
import pytest

from megalite.pipeline.schedules import Op, build_program, peak_in_flight


def closed_form_in_flight(p, r, m, v):
    """What the planner computed by hand before it read the programs: the warm-up forwards of
    megalite's programs plus the one forward before the first backward."""
    if p == 1:
        return 1  # gradient accumulation: forward, backward, forward, ...
    if v == 1:
        return min(p - r, m)  # program_1f1b: p - r - 1 warm-up forwards, then 1F1B
    if m == p:
        return m * v  # program_interleaved: all forwards first
    return min(m * v, 2 * (p - r - 1) + (v - 1) * p + 1)


def schedule_cases():
    """(p, r, m, v) of megalite's training programs for p <= 5, v <= 3, m <= 10 (v = 1: no interleaving)."""
    for p in range(1, 6):
        for v in (1, 2, 3):
            if v > 1 and p == 1:
                continue
            for m in range(1, 11):
                if v > 1 and m % p:
                    continue
                for r in range(p):
                    yield p, r, m, v


def test_peak_in_flight_of_the_programs_equals_the_closed_form():
    cases = list(schedule_cases())
    assert len(cases) > 200
    for p, r, m, v in cases:
        program = build_program(p, r, m, v if v > 1 else None)
        assert peak_in_flight(program) == closed_form_in_flight(p, r, m, v), (p, v, m, r)


@pytest.mark.parametrize("kind,want", [("1f1b", 4), ("gpipe", 8)])
def test_peak_in_flight_tells_1f1b_from_gpipe(kind, want):
    assert peak_in_flight(build_program(4, 0, 8, None, kind)) == want


def test_peak_in_flight_counts_forwards_not_yet_backwarded():
    F, B, X = (lambda i: Op("F", 0, i)), (lambda i: Op("B", 0, i)), Op("X")
    assert peak_in_flight([X, F(0), X, F(1), B(0), F(2), X, B(1), B(2)]) == 2
    assert peak_in_flight([Op("F", c, i) for i in range(3) for c in range(2)]) == 6  # forward-only: all held
    assert peak_in_flight([]) == 0


def test_zb_h1_holds_1f1bs_first_stage_peak_on_every_stage():
    """ZB-H1 keeps up to p micro-batches forwarded and not yet through W on every stage (W runs
    late on later stages): 1F1B's first-stage peak, the memory the paper allows it."""
    for p in range(1, 9):
        for m in range(1, 4 * p + 1):
            for r in range(p):
                assert peak_in_flight(build_program(p, r, m, None, "zb-h1")) == min(p, m), (p, r, m)
