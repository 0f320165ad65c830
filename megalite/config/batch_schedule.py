"""The global batch of every step, as Megatron-LM computes it from the samples already consumed:
constant (--global-batch-size), the linear ramp-up (--rampup-batch-size START INCREMENT SAMPLES,
deprecated upstream), or the step schedule (--step-batch-size-schedule "THRESHOLD:BATCH ...").

The step schedule, as Megatron-LM reads it (megatron/core/num_microbatches_calculator.py): entries
separated by spaces or commas, each THRESHOLD:BATCH; a number may end in K, M, B or T (x 1e3, 1e6,
1e9, 1e12; "2.5K" is 2500). Thresholds count tokens and become samples by integer division by
--seq-length. Sorted by threshold, the first must be 0 and they must rise strictly; a step that
starts after `consumed` samples takes the batch of the last threshold <= consumed. The run's
--global-batch-size is the last entry's batch: the learning-rate schedule counts in it (its position
is samples consumed / that batch, as in a ramp-up), and --train-samples counts the schedule's steps
one by one up to its last threshold, then whole last batches (a partial last batch is dropped)."""
from __future__ import annotations

from dataclasses import dataclass

from megalite.config.sections import global_batch_at, steps_for_samples

_SUFFIXES = {"K": 10 ** 3, "M": 10 ** 6, "B": 10 ** 9, "T": 10 ** 12}


def parse_count(text: str) -> int:
    """A schedule number: digits (a decimal point allowed) with an optional K/M/B/T suffix."""
    word = text.strip().upper()
    scale = _SUFFIXES.get(word[-1:], 1)
    if scale != 1:
        word = word[:-1]
    try:
        return int(float(word) * scale)
    except ValueError:
        raise ValueError(f"--step-batch-size-schedule: {text!r} is not a number (digits, optionally with K, M, B "
                         f"or T)") from None


def parse_step_schedule(text: str, seq_length: int) -> tuple[tuple[int, int], ...]:
    """((threshold in samples, global batch), ...) sorted by threshold; ValueError naming the fault."""
    entries = text.replace(",", " ").split()
    if not entries:
        raise ValueError("--step-batch-size-schedule is empty: give THRESHOLD:BATCH entries, the first at 0, "
                         "e.g. \"0:768 250B:1536\"")
    schedule = []
    for entry in entries:
        if ":" not in entry:
            raise ValueError(f"--step-batch-size-schedule: entry {entry!r} is not THRESHOLD:BATCH")
        threshold, batch = entry.split(":", 1)
        schedule.append((parse_count(threshold) // seq_length, parse_count(batch)))
    schedule.sort(key=lambda e: e[0])
    if schedule[0][0] != 0:
        raise ValueError(f"--step-batch-size-schedule: the first threshold must be 0, got {schedule[0][0]} samples "
                         f"(thresholds are tokens / --seq-length {seq_length})")
    for (before, _), (after, _) in zip(schedule, schedule[1:]):
        if after <= before:
            raise ValueError(f"--step-batch-size-schedule: thresholds must rise strictly, but two fall on "
                             f"{after} samples (tokens / --seq-length {seq_length})")
    bad = [batch for _, batch in schedule if batch < 1]
    if bad:
        raise ValueError(f"--step-batch-size-schedule: every batch must be >= 1, got {bad[0]}")
    return tuple(schedule)


@dataclass(frozen=True)
class BatchSchedule:
    """The global batch a step takes, by the samples consumed before it."""
    global_batch_size: int  # the final batch: what the learning-rate schedule counts in
    rampup: tuple[int, int, int] | None = None
    steps: tuple[tuple[int, int], ...] | None = None

    @property
    def varies(self) -> bool:
        return self.rampup is not None or self.steps is not None

    def at(self, consumed: int) -> int:
        """The global batch of the step that starts after `consumed` samples."""
        if self.steps is None:
            return global_batch_at(consumed, self.global_batch_size, list(self.rampup) if self.rampup else None)
        batch = self.steps[0][1]
        for threshold, size in self.steps:
            if consumed < threshold:
                break
            batch = size
        return batch

    def steps_for_samples(self, samples: int) -> int:
        """Optimizer steps that train on `samples` samples (Megatron-LM's count)."""
        if self.steps is None:
            return steps_for_samples(samples, self.global_batch_size, list(self.rampup) if self.rampup else None)
        consumed = steps = 0
        while consumed <= self.steps[-1][0] and consumed <= samples:
            consumed += self.at(consumed)
            steps += 1
        return steps + max(0, samples - consumed) // self.global_batch_size

    def samples_for_steps(self, steps: int, start: int = 0) -> int:
        """Where `steps` optimizer steps from sample `start` end: the samples they train on, step by step
        while the batch still changes, then the final batch each, after `start`."""
        if not self.varies:
            return start + steps * self.global_batch_size
        settled = self.steps[-1][0] if self.steps is not None else self.rampup[2]  # consumed: final batch on
        consumed = start
        while steps and consumed <= settled:
            consumed, steps = consumed + self.at(consumed), steps - 1
        return consumed + steps * self.global_batch_size

    def ahead(self, consumed: int) -> list[int]:
        """The batches still to come after `consumed` samples (the current one first)."""
        if self.steps is None:
            if self.rampup is None:
                return [self.global_batch_size]
            start, increment, _ = self.rampup
            return list(range(self.at(consumed), self.global_batch_size + 1, increment))
        return [self.at(consumed)] + [b for threshold, b in self.steps if threshold > consumed]


def batch_schedule(training, seq_length: int) -> BatchSchedule:
    """The schedule a resolved TrainingConfig trains with."""
    text = getattr(training, "step_batch_size_schedule", None)
    if text:
        steps = parse_step_schedule(text, seq_length)
        return BatchSchedule(steps[-1][1], None, steps)
    ramp = training.rampup_batch_size
    return BatchSchedule(training.global_batch_size, tuple(ramp) if ramp is not None and len(ramp) == 3 else None)


def check_schedule_layout(schedule: BatchSchedule, consumed: int, micro_batch_size: int, dp: int,
                          pp: int = 1, interleaved: bool = False) -> None:
    """Every batch still to come fits the layout (Megatron-LM checks each as it starts); ValueError
    naming the first that does not."""
    per_step = micro_batch_size * dp
    for batch in schedule.ahead(consumed):
        if batch % per_step:
            raise ValueError(f"--step-batch-size-schedule: a global batch of {batch} is not a multiple of "
                             f"--micro-batch-size {micro_batch_size} x data-parallel size {dp} = {per_step}")
        if interleaved and batch // per_step % pp:
            raise ValueError(f"--step-batch-size-schedule with the interleaved schedule: a global batch of {batch} "
                             f"holds {batch // per_step} micro-batches, not a multiple of --pp ({pp})")
