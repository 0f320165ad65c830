"""README's test command groups tests on pytest-xdist workers (tests/conftest.py: the machine-wide
tests, and a module's tests that share a module fixture): with the pinned pytest and pytest-xdist
a module fixture shared by several tests runs once under `-n 2 --dist loadgroup`, not once a worker."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

MODULE = '''
import os
import time

import pytest


@pytest.fixture(scope="module")
def shared():
    with open(os.environ["SETUPS"], "a") as f:
        f.write(os.environ.get("PYTEST_XDIST_WORKER", "-") + "\\n")


@pytest.mark.parametrize("case", range(6))
def test_a_case_of_a_matrix(shared, case):
    time.sleep(0.05)


@pytest.mark.parametrize("case", range(6))
def test_alone(case):
    time.sleep(0.05)
'''


def test_a_module_fixture_runs_once_under_two_workers(tmp_path):
    shutil.copy(Path(__file__).with_name("conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_matrix.py").write_text(MODULE)
    setups = tmp_path / "setups"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider",
                           "-m", "not gpu", str(tmp_path)], capture_output=True, text=True, timeout=120,
                          cwd=tmp_path, env={**{k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"},
                                                         "SETUPS": str(setups)})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "12 passed" in done.stdout
    assert len(setups.read_text().split()) == 1, setups.read_text()
