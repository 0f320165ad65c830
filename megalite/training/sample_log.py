"""`--sample-log DIR`: every sample a run consumes, so that an audit (or the fault soak,
scripts/soak.py) can show that across crashes, restarts and layout changes no sample was lost and
none was trained on twice.

Each data-parallel rank's reader (its rank with tensor, context and pipeline rank 0) appends one JSON
line per iteration to `DIR/samples-rank<R>.jsonl`: `{"run", "iteration", "dp", "samples", "t"}`, the
positions in the sample stream it read, and when. Rank 0 also appends `{"run", "resumed", "from_run"}` at a
resume (the iteration of the checkpoint and the run that saved it: checkpoints record their run),
and `{"run", "done", "t"}` when an iteration's step is over (a consumed record with no `done`: a
crash cut that iteration short).
A run is one start of the job (a torchrun restart is a new run), named by rank 0 and agreed by all.
Lines are flushed as written; a line cut short by a crash is skipped when read.

`lineage(DIR, final_run, final_iteration)` follows the runs back from the one that made the final
state: which run's iterations that state holds, and so the samples it was trained on.
"""
from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from megalite import parallel


def agreed_run_id() -> str:
    """A name for this start of the job, the same on every rank (rank 0's, broadcast)."""
    name = [uuid.uuid4().hex[:16]]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(name, src=0)
    return name[0]


class SampleLog:
    """This rank's writer (a no-op on ranks that do not read for their DP rank, or without --sample-log)."""

    def __init__(self, directory: str | None, run: str):
        self.run, self.file, self.reader, self.rank0 = run, None, False, False
        if directory is None:
            return
        self.reader = (parallel.get_tensor_model_parallel_rank() == 0 and parallel.get_context_parallel_rank() == 0
                       and parallel.get_pipeline_model_parallel_rank() == 0)
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.rank0 = rank == 0
        if self.reader or self.rank0:
            Path(directory).mkdir(parents=True, exist_ok=True)
            self.file = open(Path(directory) / f"samples-rank{rank}.jsonl", "a")

    def _write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def resumed(self, iteration: int, from_run: str | None) -> None:
        if self.file is not None and self.rank0 and iteration:
            self._write({"run": self.run, "resumed": iteration, "from_run": from_run})

    def consumed(self, iteration: int, dp_rank: int, samples: range) -> None:
        if self.file is not None and self.reader:
            self._write({"run": self.run, "iteration": iteration, "dp": dp_rank, "samples": list(samples),
                         "t": round(time.time(), 3)})

    def completed(self, iteration: int) -> None:
        if self.file is not None and self.rank0:
            self._write({"run": self.run, "done": iteration, "t": round(time.time(), 3)})

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


@dataclass
class Lineage:
    """The samples the final state was trained on, iteration by iteration, and where they came from."""
    runs: list[tuple[str, int, int]] = field(default_factory=list)  # (run, first, last iteration), oldest first
    samples: dict[int, list[int]] = field(default_factory=dict)  # iteration -> samples (all DP ranks)
    missing: list[tuple[str, int]] = field(default_factory=list)  # (run, iteration) with no record

    def counts(self, expected: range) -> tuple[int, int]:
        """(samples of `expected` never trained on, samples trained on more than once)."""
        seen = Counter(s for samples in self.samples.values() for s in samples)
        lost = sum(1 for s in expected if s not in seen)
        return lost, sum(n - 1 for n in seen.values() if n > 1)


def _records(directory: Path):
    for path in sorted(directory.glob("samples-rank*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                yield json.loads(line)
            except ValueError:  # cut short by a crash
                continue


def lineage(directory, final_run: str, final_iteration: int) -> Lineage:
    """Follow `final_run` (the run that saved the final checkpoint, at `final_iteration`) back
    through the runs it resumed from."""
    consumed: dict[tuple[str, int], dict[int, list[int]]] = {}
    resumed: dict[str, tuple[int, str | None]] = {}
    for r in _records(Path(directory)):
        if "resumed" in r:
            resumed.setdefault(r["run"], (r["resumed"], r["from_run"]))
        elif "iteration" in r:
            consumed.setdefault((r["run"], r["iteration"]), {}).setdefault(r["dp"], r["samples"])
    out, run, end = Lineage(), final_run, final_iteration
    while run is not None:
        start, previous = resumed.get(run, (0, None))
        out.runs.insert(0, (run, start + 1, end))
        for i in range(start + 1, end + 1):
            by_dp = consumed.get((run, i))
            if by_dp is None:
                out.missing.append((run, i))
                continue
            out.samples[i] = [s for dp in sorted(by_dp) for s in by_dp[dp]]
        run, end = (previous, start) if start else (None, 0)
    return out
