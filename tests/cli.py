"""Run the entry points under torchrun from tests."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def torchrun(script: str, nproc: int, *args: str, timeout: float = 300, env: dict | None = None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(ROOT / script), *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("MEGALITE_QUIET", None)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=ROOT)


def records(path: Path, split: str = "train") -> list[dict]:
    """Training records (or validation ones, split='valid') of a metrics file."""
    out = [json.loads(line) for line in path.read_text().splitlines()]
    return [r for r in out if r.get("split", "train") == split]


def losses(path: Path) -> list[float]:
    return [r["loss"] for r in records(path)]
