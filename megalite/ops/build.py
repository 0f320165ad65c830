"""Just-in-time build and load of the CUDA kernels in kernels/, once per machine.

The build lives in a cache directory named after a hash of the kernel sources, the GPU
architectures, the torch and CUDA versions and the Python ABI: a changed source or a new torch
gets a new name, so a stale build is never loaded. Many ranks may start together: an exclusive
file lock lets one build while the others wait and then load its result (the operating system
drops the lock of a killed builder, so nobody waits on a stale lock; where the file system has no
flock, torch's own build lock serialises the builds). A failed build is recorded,
so the ranks that waited on it fall back at once instead of each failing the same build again;
the next run tries again.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import os
import platform
import re
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

SOURCES = ("bindings.cpp", "softmax.cu", "layer_norm.cu")
HEADERS = ("common.cuh",)
CUDA_FLAGS = ("-O3", "-lineinfo")
CXX_FLAGS = ("-O3",)
FAILED_MARKER = "BUILD_FAILED"


@dataclass(frozen=True)
class KernelStatus:
    """Which path megalite.ops runs and why; true when the fused CUDA kernels are in use."""
    available: bool
    reason: str
    build_dir: str | None = None

    def __bool__(self) -> bool:
        return self.available

    def __str__(self) -> str:
        return ("fused CUDA kernels: " if self.available else "PyTorch fallback: ") + self.reason


def source_dir() -> Path | None:
    """kernels/ of a source checkout, or the copy a wheel installs as megalite/_kernels."""
    here = Path(__file__).resolve()
    for candidate in (here.parents[2] / "kernels", here.parents[1] / "_kernels"):
        if all((candidate / f).is_file() for f in SOURCES + HEADERS):
            return candidate
    return None


def cache_root() -> Path:
    if os.environ.get("MEGALITE_KERNEL_CACHE"):
        return Path(os.environ["MEGALITE_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megalite" / "kernels"


def cuda_arch_list() -> str:
    """The compute capabilities of the visible GPUs, as TORCH_CUDA_ARCH_LIST wants them."""
    caps = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    return ";".join(f"{major}.{minor}" for major, minor in sorted(caps))


def build_name(src: Path, arch_list: str) -> str:
    h = hashlib.sha256()
    for f in sorted(SOURCES + HEADERS):
        h.update(f.encode() + b"\0" + (src / f).read_bytes() + b"\0")
    for part in (torch.__version__, str(torch.version.cuda), arch_list, sys.implementation.cache_tag,
                 platform.machine(), " ".join(CUDA_FLAGS + CXX_FLAGS)):
        h.update(part.encode() + b"\0")
    return f"megalite_kernels_{h.hexdigest()[:16]}"


def unavailable_reason() -> str | None:
    """Why the kernels cannot be built or run here, or None when they can be tried."""
    if os.environ.get("MEGALITE_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
        return "disabled by MEGALITE_KERNELS=0"
    if torch.version.cuda is None:
        return "this PyTorch build has no CUDA support"
    if not torch.cuda.is_available():
        return "no CUDA device is visible (torch.cuda.is_available() is False)"
    if source_dir() is None:
        return "the kernel sources (kernels/*.cu) are missing from this installation; reinstall megalite"
    from torch.utils import cpp_extension
    if cpp_extension.CUDA_HOME is None:
        return "no CUDA compiler: nvcc was not found (install the CUDA toolkit or set CUDA_HOME)"
    if not cpp_extension.is_ninja_available():
        return "ninja, which torch.utils.cpp_extension builds with, is not installed (pip install ninja)"
    return None


@dataclass
class LockState:
    held: bool  # False where the file system has no flock
    waited: bool  # another process held it first


@contextlib.contextmanager
def exclusive(lock_path: Path, waiting_message: str | None = None):
    """Hold an exclusive lock on `lock_path`; yields a LockState. Where the file system has no flock
    (some network mounts) the lock is not held and the caller relies on torch's own build lock."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as f:
        state = LockState(held=True, waited=False)
        try:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                state.waited = True
                if waiting_message:
                    print(waiting_message, file=sys.stderr, flush=True)
                fcntl.flock(f, fcntl.LOCK_EX)
        except OSError:
            yield LockState(held=False, waited=False)
            return
        try:
            yield state
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _file_identity(path: Path):
    """What changes whenever the file is written anew (it is always replaced, so a new inode)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns, st.st_size


def import_library(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def locked_build(cache: Path, name: str, build, load=import_library):
    """Load the library `name` built under `cache`, building it first (once, under a lock) when
    it is not there. `build(build_dir)` compiles `build_dir/name.so` (returning the imported module,
    or None to have it loaded here) and raises on failure.
    Returns (module or None, KernelStatus)."""
    build_dir = cache / name
    library = build_dir / f"{name}.so"
    failed = build_dir / FAILED_MARKER
    failure_before = _file_identity(failed)
    waiting = f"megalite: waiting for another process building the kernels in {build_dir}"
    with exclusive(cache / f"{name}.lock", waiting) as lock:
        locked = lock.held
        # A failure recorded while this process waited for the builder: the same build would fail
        # again. A failure from an earlier run is retried.
        if lock.waited and _file_identity(failed) not in (None, failure_before):
            try:
                reason = failed.read_text().strip()
            except OSError:
                reason = "(no reason recorded)"
            return None, KernelStatus(False, f"the kernel build failed in another process: {reason}", str(build_dir))
        if library.exists():
            try:
                return load(name, library), KernelStatus(True, f"loaded from {build_dir}", str(build_dir))
            except (ImportError, OSError):
                if not locked:
                    raise  # maybe another process is still writing it
                library.unlink(missing_ok=True)  # a half-written library from a killed build: build it again
        build_dir.mkdir(parents=True, exist_ok=True)
        if locked:
            # torch's own build lock, left behind by a killed build, would block us for ever; ours is held.
            (build_dir / "lock").unlink(missing_ok=True)
        print(f"megalite: building the fused CUDA kernels in {build_dir} (once per machine, about a minute)",
              file=sys.stderr, flush=True)
        t0 = time.time()
        try:
            module = build(build_dir)  # cpp_extension returns the module it imported; a test build may not
            if module is None:
                module = load(name, library)
        except Exception as e:  # noqa: BLE001 - any build failure means: fall back, and say why
            summary = _summarize(e)
            tmp = failed.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(summary + "\n")
            os.replace(tmp, failed)
            return None, KernelStatus(False, f"the kernel build failed: {summary} (build directory {build_dir})",
                                      str(build_dir))
        failed.unlink(missing_ok=True)
        return module, KernelStatus(True, f"built in {time.time() - t0:.0f} s in {build_dir}", str(build_dir))


def _summarize(e: Exception) -> str:
    """The compiler's first error line when there is one, else the first line naming an error,
    else the first line."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    compiler = [line for line in lines if re.search(r"\berror\s*:", line, re.IGNORECASE)]
    errors = [line for line in lines if "error" in line.lower()]
    return (compiler or errors or lines or [type(e).__name__])[0][:500]


def compile_extension(name: str, src: Path, arch_list: str):
    """The build step of locked_build: torch.utils.cpp_extension with ninja, for `arch_list`."""
    from torch.utils import cpp_extension

    def build(build_dir: Path):
        saved = os.environ.get("TORCH_CUDA_ARCH_LIST")
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list
        try:
            return cpp_extension.load(name=name, sources=[str(src / f) for f in SOURCES],
                                      build_directory=str(build_dir), extra_cflags=list(CXX_FLAGS),
                                      extra_cuda_cflags=list(CUDA_FLAGS), extra_include_paths=[str(src)],
                                      verbose=False)
        finally:
            if saved is None:
                os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
            else:
                os.environ["TORCH_CUDA_ARCH_LIST"] = saved

    return build


_lock = threading.Lock()
_loaded: tuple | None = None  # (module or None, KernelStatus)


def load():
    """(module or None, KernelStatus), building on first use; the answer is kept for the process."""
    global _loaded
    if _loaded is not None:  # every op call asks: no lock once the answer is known
        return _loaded
    with _lock:
        if _loaded is None:
            reason = unavailable_reason()
            if reason is not None:
                _loaded = (None, KernelStatus(False, reason))
            else:
                _loaded = _build_and_check()
        return _loaded


def _build_and_check():
    """Build or load, then self-check; any failure (an unwritable cache, a GPU the build cannot
    run on, a kernel that disagrees) becomes a fallback with its reason, never an exception."""
    from megalite.ops.selfcheck import self_check

    status = None
    try:
        src, arch = source_dir(), cuda_arch_list()
        name = build_name(src, arch)
        module, status = locked_build(cache_root(), name, compile_extension(name, src, arch))
        if module is None:
            return None, status
        problem = self_check(module)
    except Exception as e:  # noqa: BLE001
        where = "building or loading" if status is None else "running"
        return None, KernelStatus(False, f"{where} the kernels failed: {_summarize(e)}",
                                  None if status is None else status.build_dir)
    if problem is not None:
        return None, KernelStatus(False, f"the kernels failed their self-check ({problem}); please report this",
                                  status.build_dir)
    return module, status


def reset() -> None:
    """Forget the loaded state (tests; a changed MEGALITE_KERNELS)."""
    global _loaded
    with _lock:
        _loaded = None
