"""megalite.ops' build logic on the CPU: the fall-backs and why (no CUDA, no compiler, missing sources, an
unwritable cache), the build name (sources, headers, architecture), one build shared by ranks that ask at
once (and a failure re-tried later), a half-written library rebuilt, the CLI's refusal of the fused
backend without kernels, the wheel's kernel sources and the kernel benchmark's own logic."""
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from megalite import ops
from megalite.ops import build
from megalite.testing import process_context
from test_ops import layer_norm64, softmax64

ROOT = Path(__file__).resolve().parents[1]

# -- build logic -----------------------------------------------------------------------------------

def test_cpu_falls_back_and_says_why(monkeypatch):
    monkeypatch.delenv("MEGALITE_KERNELS", raising=False)
    build.reset()
    status = ops.kernels_available()
    assert not status and "CUDA" in status.reason and str(status).startswith("PyTorch fallback")
    monkeypatch.setenv("MEGALITE_KERNELS", "0")
    build.reset()
    assert ops.kernels_available().reason == "disabled by MEGALITE_KERNELS=0"
    build.reset()


def test_missing_compiler_falls_back_with_a_clear_reason(monkeypatch):
    """As on a GPU machine without the CUDA toolkit: no build is tried, the ops still work."""
    from torch.utils import cpp_extension
    monkeypatch.delenv("MEGALITE_KERNELS", raising=False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    monkeypatch.setattr(build, "locked_build", lambda *a, **k: pytest.fail("no build may start without nvcc"))
    build.reset()
    try:
        status = ops.kernels_available()
        assert not status and "nvcc was not found" in status.reason and "CUDA_HOME" in status.reason
        x = torch.randn(1, 1, 2, 3)
        torch.testing.assert_close(ops.scaled_causal_softmax(x, 1.0), softmax64(x, torch.ones(2, 3, dtype=torch.bool).triu(1), 1.0).float())
    finally:
        build.reset()


def test_missing_sources_are_named(monkeypatch):
    monkeypatch.delenv("MEGALITE_KERNELS", raising=False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(build, "source_dir", lambda: None)
    assert "kernel sources" in build.unavailable_reason()


def test_build_name_follows_sources_and_architecture(tmp_path):
    src = tmp_path / "kernels"
    shutil.copytree(build.source_dir(), src)
    name = build.build_name(src, "9.0")
    assert name == build.build_name(src, "9.0")
    assert name != build.build_name(src, "8.0;9.0")
    (src / "softmax.cu").write_text((src / "softmax.cu").read_text() + "\n// changed\n")
    assert build.build_name(src, "9.0") != name, "an edited source must never load an old build"
    edited = build.build_name(src, "9.0")
    (src / "common.cuh").write_text((src / "common.cuh").read_text() + "\n// changed\n")
    assert build.build_name(src, "9.0") != edited, "an edited shared header must never load an old build"


def test_every_file_the_kernels_include_is_part_of_the_build_name():
    src = build.source_dir()
    included = set()
    for f in build.SOURCES + build.HEADERS:
        included.update(re.findall(r'^#include "([^"]+)"', (src / f).read_text(), flags=re.MULTILINE))
    assert included and included <= set(build.HEADERS), f"hash these too: {sorted(included - set(build.HEADERS))}"
    assert {p.name for p in src.iterdir() if p.suffix in (".cu", ".cuh", ".cpp")} == set(build.SOURCES + build.HEADERS)


def _fake_build(counter: Path, delay: float, fail: bool):
    def build_fn(build_dir: Path):
        with open(counter, "a") as f:
            f.write("built\n")
        time.sleep(delay)
        if fail:
            raise RuntimeError("Error building extension 'x':\nsoftmax.cu(12): error: identifier \"foo\" is undefined\n")
        (build_dir / f"{build_dir.name}.so").write_text("library")
    return build_fn


def _read_library(name, path):
    text = Path(path).read_text()
    if text != "library":
        raise ImportError("half-written")
    return text


def _rank_build(cache, counter, fail, queue, barrier):
    barrier.wait()  # all ranks ask at once, as ranks starting together do
    module, status = build.locked_build(Path(cache), "megalite_kernels_test", _fake_build(Path(counter), 1.0, fail),
                                        load=_read_library)
    queue.put((module, status.available, status.reason))


@pytest.mark.parametrize("fail", [False, True])
def test_many_ranks_build_once_and_share_the_result(tmp_path, fail):
    ctx = process_context()  # separate processes, as ranks are, without each importing torch anew
    queue, barrier = ctx.Queue(), ctx.Barrier(3)
    counter = tmp_path / "count"
    procs = [ctx.Process(target=_rank_build, args=(str(tmp_path / "cache"), str(counter), fail, queue, barrier))
             for _ in range(3)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert counter.read_text().count("built") == 1, "exactly one rank compiles; the others wait for it"
    if fail:
        assert all(not ok for _, ok, _ in results)
        assert all('identifier "foo" is undefined' in reason for _, _, reason in results)
        assert sum("another process" in reason for _, _, reason in results) == 2
        # A later run tries again rather than trusting an old failure.
        _, status = build.locked_build(tmp_path / "cache", "megalite_kernels_test",
                                       _fake_build(counter, 0.0, False), load=_read_library)
        assert status and counter.read_text().count("built") == 2
    else:
        assert [m for m, _, _ in results] == ["library"] * 3


def test_half_written_library_is_rebuilt(tmp_path):
    lib_dir = tmp_path / "megalite_kernels_test"
    lib_dir.mkdir()
    (lib_dir / "megalite_kernels_test.so").write_text("trunc")
    (lib_dir / "lock").write_text("")  # torch's own build lock, left by a killed build
    counter = tmp_path / "count"
    module, status = build.locked_build(tmp_path, "megalite_kernels_test", _fake_build(counter, 0.0, False),
                                        load=_read_library)
    assert module == "library" and status and counter.read_text().count("built") == 1


def test_fused_backend_on_cpu_is_a_clear_cli_error(capsys):
    import pretrain_gpt
    code = pretrain_gpt.main(["--model", "gpt-tiny", "--mock-data", "--train-iters", "1", "--global-batch-size", "2",
                              "--micro-batch-size", "2", "--attention-backend", "fused"])
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    (line,) = [x for x in err.splitlines() if x.startswith("megalite: error:")]
    assert "--attention-backend fused needs megalite's CUDA kernels" in line
    assert "no CUDA" in line or "has no CUDA support" in line


def test_wheel_ships_the_kernel_sources(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("megalite-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in build.SOURCES + build.HEADERS:
        assert f"megalite/_kernels/{f}" in names


def test_kernel_benchmark_script_runs_and_reports_every_case(tmp_path):
    """The GPU benchmark's own logic (cases, byte counts, ratios, JSON), on tiny CPU shapes."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("bench_kernels", ROOT / "scripts" / "bench_kernels.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = script.main(["--device", "cpu", "--quick", "--reps", "1", "--json", str(tmp_path / "k.json")])
    import json
    saved = json.loads((tmp_path / "k.json").read_text())
    assert saved["cases"] == out["cases"] and saved["copy_gbs"] > 0
    assert [c["case"] for c in out["cases"]] == ["causal softmax", "masked softmax", "layer_norm", "rms_norm"]
    for c in out["cases"]:
        assert c["megalite_fwd_ms"] > 0 and c["fwd_speedup_vs_eager"] > 0 and 0 < c["fwd_copy_fraction"]


def test_an_unwritable_cache_falls_back_instead_of_raising(monkeypatch):
    from torch.utils import cpp_extension
    monkeypatch.delenv("MEGALITE_KERNELS", raising=False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", "/usr/local/cuda")
    monkeypatch.setattr(cpp_extension, "is_ninja_available", lambda: True)
    monkeypatch.setattr(build, "cuda_arch_list", lambda: "9.0")

    def read_only(*args, **kwargs):
        raise PermissionError(13, "Permission denied", "/home/me/.cache/megalite/kernels")
    monkeypatch.setattr(build, "locked_build", read_only)
    build.reset()
    try:
        status = ops.kernels_available()
        assert not status and "building or loading the kernels failed" in status.reason
        assert "Permission denied" in status.reason
        x = torch.randn(3, 8)
        torch.testing.assert_close(ops.rms_norm(x, torch.ones(8), 1e-5), layer_norm64(x, torch.ones(8), None, 1e-5, True).float())
    finally:
        build.reset()
