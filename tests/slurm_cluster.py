"""What the Slurm test clusters (tests/test_slurm.py, tests/test_multinode.py) share: a state
directory, the environment their daemons and jobs see, and the scripts/slurm/*.sh that runs them."""
from __future__ import annotations

import socket
import subprocess
from pathlib import Path

from cli import ROOT

SLURM = ROOT / "scripts" / "slurm"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmTestCluster:
    """A cluster started by scripts/slurm/`script_name` with state under `state`; subclasses set
    `self.env` (the environment of the script, the daemons and every command run)."""
    script_name: str

    def __init__(self, state: Path):
        self.state = state
        self.env: dict = {}

    def script(self, action: str, timeout: float = 120):
        return subprocess.run(["bash", str(SLURM / self.script_name), action], env=self.env,
                              capture_output=True, text=True, timeout=timeout)

    def run(self, *cmd: str, timeout: float = 30, cwd=None, env=None):
        return subprocess.run(list(cmd), env={**self.env, **(env or {})}, capture_output=True, text=True,
                              timeout=timeout, cwd=cwd)

    def daemon_logs(self) -> str:
        return "\n".join(f"----- {p} -----\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted((self.state / "log").glob("*.log")))
