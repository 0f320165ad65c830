"""The fault soak: train a tiny GPT for many iterations while faults from a seeded schedule strike it,
then prove that nothing was lost.

    python scripts/soak.py --faults 200 --seed 1

Three tracks, each against its own run that never failed (same flags, no faults):
- `fixed`: one layout (dp 2, ZeRO-3): the end state must be bitwise the uninterrupted run's;
- `layouts`: the layout changes between restarts (dp, ZeRO 1/3, tp with and without sequence
  parallelism, pp, cp): every loss within 1e-5 of the uninterrupted run's;
- `local-sgd`: local SGD with two fragments (dp 2): bitwise, as `fixed`.

Faults (megalite.faults names the in-process points):
- kill -9 of a random rank at a random iteration: after a step, inside a save (sync and
  `--save-async`), inside a ZeRO-3 gather, a pipeline send, local SGD's outer all-reduce; and at a
  random moment from outside (`anytime`);
- SIGTERM to a random rank (every rank saves and stops);
- a full disk: the save directory is a small tmpfs, filled up (without root to mount it, the save's
  write fails with ENOSPC instead);
- a checkpoint file of the latest checkpoint corrupted (one bit of a weight), truncated, deleted, or
  swapped with another rank's; the next start must refuse it in one line naming the file, and the job
  goes on from the checkpoint before it (as the message says);
- a restart at another layout (track `layouts`).
In-process kills chain as `torchrun --max-restarts` restarts of one job (the automatic restarts);
the others end the job, and the soak starts it again, as a Slurm requeue would.

Every sample each run consumes is logged (`--sample-log`); from the final checkpoint back, the runs
whose iterations the final state holds give the samples it was trained on: each of the
uninterrupted run's samples once. The last line:

    soak: F faults injected, F survived, S samples lost, R repeated, final loss gap G vs the uninterrupted run
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megalite.checkpoint.fileformat import RankFile  # noqa: E402
from megalite.launch import worker_pids  # noqa: E402
from soak_accounting import account, runs_in_order  # noqa: E402
from soak_jobs import (CURRENT, DAMAGE, GLOBAL_BATCH, KILLS, LAYOUTS, SAVE_INTERVAL, WORLD, Fault,  # noqa: E402
                       Track, adopt_runs, command, finish, latest_iteration, launch, resumable, resumed_line, run_job,
                       say)

LOCAL_SGD = ["--local-sgd-interval", "2", "--local-sgd-fragments", "2"]
TRACKS = {"fixed": ("dp2-zero3", []), "layouts": ("dp2-zero1", []), "local-sgd": ("dp2", LOCAL_SGD)}
SHARE = {"fixed": 0.4, "layouts": 0.4, "local-sgd": 0.2}

KINDS = (*KILLS, "term", "anytime", *DAMAGE, "disk", "layout")
REFUSAL = {"corrupt": "fails its CRC-32 check", "truncate": "bytes, the metadata says", "delete": "is missing",
           "swap": "checkpoint file"}
MARKER = re.compile(r"megalite: fault injected: (\S+) on rank (\d+) in iteration (\d+) \(attempt (\d+)\)")
ONLY: set[str] | None = None  # --kinds: draw only these


# -- faults between jobs --------------------------------------------------------------------------

def damage(track: Track, kind: str, rng: random.Random) -> tuple[str, list[str], Path] | None:
    """Damage one rank file of the latest checkpoint: (what was done, the files touched, the
    complete checkpoint before it); None when there is none before it to go back to."""
    last = latest_iteration(track)
    earlier = sorted(int(p.name.split("_")[-1]) for p in track.save.glob("iter_*")
                     if p.suffix == "" and last is not None and int(p.name.split("_")[-1]) < last)
    if last is None or not earlier:
        return None
    directory = track.save / f"iter_{last:07d}"
    files = sorted(directory.glob("rank_*.safetensors"))
    path = rng.choice(files)
    if kind == "corrupt":
        f = RankFile(path)
        # weights or optimizer state, what every load reads (a ZeRO-3 rank file may hold only the
        # latter, a local SGD replica's file only its own state, which its resume reads)
        keys = sorted(k for k in f.keys() if k.startswith(("model/", "optim/")))
        key = rng.choice(keys or sorted(k for k in f.keys() if not k.startswith("rng")))
        lo, hi = f.byte_range(key)
        data = bytearray(path.read_bytes())
        at = rng.randrange(lo, hi)
        data[at] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
        detail, touched = f"one bit of byte {at} ({key}) of {path.name}", [path.name]
    elif kind == "truncate":
        data = path.read_bytes()
        path.write_bytes(data[:rng.randrange(8, len(data))])
        detail, touched = f"{path.name} cut short", [path.name]
    elif kind == "delete":
        path.unlink()
        detail, touched = f"{path.name} deleted", [path.name]
    else:
        other = rng.choice([f for f in files if f != path])
        a, b = path.read_bytes(), other.read_bytes()
        path.write_bytes(b)
        other.write_bytes(a)
        detail, touched = f"{path.name} and {other.name} swapped", [path.name, other.name]
    return f"iter_{last:07d}: {detail}", touched, track.save / f"iter_{max(earlier):07d}"


def strike_damage(track: Track, kind: str, rng: random.Random) -> bool:
    done = damage(track, kind, rng)
    if done is None:
        return False
    detail, touched, earlier = done
    fault = Fault(kind, detail, injected=True)
    track.faults.append(fault)
    track.since_last_run.append(kind)
    rc, out, _ = run_job(track, command(track, f"{len(track.faults)}-refused"), [])
    line = next((x for x in out.splitlines() if x.startswith("megalite: error")), "")
    refused = rc != 0 and REFUSAL[kind] in line and any(t in line for t in touched) and not resumed_line(out)
    # As the refusal says: --load the checkpoint before it. This start stops at its first save,
    # which becomes `latest` (or replaces the damaged one), so later jobs resume the usual way.
    rc, out, _ = run_job(track, command(track, f"{len(track.faults)}-recover", load=earlier)
                         + ["--exit-interval", str(SAVE_INTERVAL)], ["exit"])
    fault.survived = refused and rc == 0 and resumed_line(out) and resumable(track)
    say(f"  [{track.name}] {kind}: {detail}: " + (f"refused ({line[:150]}...), went on from {earlier.name}"
                                                   if fault.survived else f"NOT as it should be (rc {rc}): {out[-800:]}"))
    return True


def strike_full_disk(track: Track, rng: random.Random) -> None:
    """The save directory's tmpfs filled up to less than half a checkpoint: the job's first save
    fails, one line says so, the checkpoint before stays `latest`; then room is made again."""
    disk = track.root / "disk"
    for leftover in track.save.glob("iter_*.tmp"):  # a crashed save's: the next save would free them
        shutil.rmtree(leftover)
    stat = os.statvfs(disk)
    last = latest_iteration(track)
    size = sum(p.stat().st_size for p in (track.save / f"iter_{last:07d}").iterdir())
    ballast = disk / "ballast"
    with open(ballast, "wb") as f:
        f.write(b"\0" * max(stat.f_bavail * stat.f_frsize - size // 2, 0))
    fault = Fault("disk", "the save directory's tmpfs full", injected=True)
    track.faults.append(fault)
    track.since_last_run.append("disk")
    rc, out, _ = run_job(track, command(track, f"{len(track.faults)}-disk", save_async=rng.random() < 0.5), ["disk"])
    ballast.unlink()
    fault.survived = rc != 0 and "No space left on device" in out and "is intact" in out and resumable(track)
    say(f"  [{track.name}] disk full: a save failed, latest iteration {latest_iteration(track)} (was {last})"
        if fault.survived else f"  [{track.name}] disk full: NOT handled (rc {rc}): {out[-800:]}")


# -- faults inside jobs ---------------------------------------------------------------------------

def run_chain(track: Track, attempts: list[str], rng: random.Random) -> None:
    """One job under `torchrun --max-restarts`: attempt a dies of fault attempts[a], at a random
    rank a random number of iterations after it resumed, and torchrun restarts it; the last
    attempt's fault ends the job (SIGTERM: a clean stop; a kill: the job fails)."""
    points = [("enospc" if k == "disk" else k, rng.randrange(WORLD), rng.randint(1, 2 * SAVE_INTERVAL + 1))
              for k in attempts]
    spec = ",".join(f"{a}:{rank}@+{k}:{p}" for a, (p, rank, k) in enumerate(points))
    save_async = "async-save" in attempts or ("save" not in attempts and rng.random() < 0.3)
    faults = [Fault(k, f"rank {rank}, {k_} iteration(s) after the resume") for k, (_, rank, k_) in zip(attempts, points)]
    track.faults += faults
    rc, out, runs = run_job(track, command(track, f"{len(track.faults)}-chain", len(attempts) - 1, save_async),
                            attempts, spec)
    fired = {(int(m.group(4)), m.group(1), int(m.group(2))) for m in MARKER.finditer(out)}
    for a, (f, (point, rank, _)) in enumerate(zip(faults, points)):
        f.injected = (a, point, rank) in fired
        if a < len(attempts) - 1:  # torchrun started the next attempt, which went on
            f.survived = f.injected and len(runs) > a + 1
        else:
            f.survived = f.injected and (rc == 0 if point == "term" else rc != 0) and resumable(track)
    settle_layout_faults(track, out)
    ok = all(f.survived for f in faults)
    say(f"  [{track.name}] {' -> '.join(f'{k} (rank {r}, +{i})' for k, (_, r, i) in zip(attempts, points))}: "
        f"{len(runs)} run(s), rc {rc}" + ("" if ok else f"  NOT as planned:\n{out[-1500:]}"))


def run_anytime(track: Track, rng: random.Random) -> None:
    """kill -9 of a random worker at a random moment, from outside."""
    fault = Fault("anytime")
    track.faults.append(fault)
    tag = f"{len(track.faults)}-anytime"
    metrics = track.root / f"metrics-{tag}.jsonl"
    before = len(runs_in_order(track.root / "samples"))
    proc, log = launch(track, command(track, tag, save_async=rng.random() < 0.5))
    delay, worker = rng.uniform(0.0, 1.5), rng.randrange(WORLD)
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline and not (metrics.exists() and metrics.read_text().strip()):
        time.sleep(0.05)
    time.sleep(delay)
    workers = sorted(worker_pids(proc.pid))
    if proc.poll() is None and len(workers) == WORLD:
        os.kill(workers[worker], signal.SIGKILL)
        fault.injected = True
    rc, out = finish(proc, log)
    adopt_runs(track, before, ["anytime"])
    settle_layout_faults(track, out)
    fault.detail = f"worker {worker}, {delay:.2f} s after the first step"
    fault.survived = fault.injected and rc != 0 and resumable(track)
    say(f"  [{track.name}] anytime: kill -9 {fault.detail}, rc {rc}" + ("" if fault.survived else "  NOT survived"))


def settle_layout_faults(track: Track, out: str) -> None:
    """A layout change survived when the start after it resumed."""
    for f in track.faults:
        if f.kind == "layout" and not f.survived and resumed_line(out):
            f.survived = True


# -- the schedule ---------------------------------------------------------------------------------

def kinds_for(track: Track) -> dict[str, int]:
    """What can strike this track's current layout, with weights."""
    w = {"step": 3, "term": 2, "save": 2, "async-save": 2, "anytime": 2, "corrupt": 1, "truncate": 1, "delete": 1,
         "swap": 1, "disk": 1}
    if "zero3" in track.layout:
        w["gather"] = 2
    if track.layout == "pp2":
        w["p2p"] = 2
    if track.extra == LOCAL_SGD:
        w["outer"] = 3
    if track.name == "layouts":
        w["layout"] = 3
    return {k: v for k, v in w.items() if ONLY is None or k in ONLY}


def draw(track: Track, rng: random.Random) -> str:
    w = kinds_for(track)
    if not w:  # --kinds left nothing for this layout: move to another (track layouts) or stop
        if track.name == "layouts":
            return "layout"
        raise SystemExit(f"soak: --kinds leaves no fault that can strike track {track.name} at {track.layout}")
    return rng.choices(list(w), weights=list(w.values()))[0]


def in_process(kind: str, track: Track) -> bool:
    return kind in KILLS or kind == "term" or (kind == "disk" and not track.tmpfs)


def run_track(track: Track, n: int, rng: random.Random) -> None:
    # A first job, no fault: two checkpoints to damage or go back to, then a clean exit.
    rc, out, _ = run_job(track, command(track, "first") + ["--exit-interval", str(2 * SAVE_INTERVAL)], ["exit"])
    if rc != 0:
        raise SystemExit(f"soak: the first job of track {track.name} failed (rc {rc}):\n{out[-3000:]}")
    pending: str | None = None
    redraws, done = 0, 0
    while len(track.faults) < n:
        if len(track.faults) != done:
            redraws, done = 0, len(track.faults)
        if (latest_iteration(track) or 0) + 4 * (2 * SAVE_INTERVAL + 1) > track.iters:
            say(f"  [{track.name}] too few iterations left for another fault")
            break
        if redraws > 100:
            raise SystemExit(f"soak: --kinds {','.join(sorted(ONLY or ()))} leaves nothing that can strike now")
        kind = pending or draw(track, rng)
        pending = None
        redraws += 1
        if kind in DAMAGE:
            strike_damage(track, kind, rng)
        elif kind == "layout":
            if "layout" in track.since_last_run:
                continue  # one change per start: the start after it proves it survived
            new = rng.choice([name for name in LAYOUTS if name != track.layout])
            track.faults.append(Fault("layout", f"{track.layout} -> {new}", injected=True))
            track.since_last_run.append("layout")
            say(f"  [{track.name}] layout: {track.layout} -> {new} at the next start")
            track.layout = new
        elif kind == "disk" and track.tmpfs:
            strike_full_disk(track, rng)
        elif kind == "anytime":
            run_anytime(track, rng)
        else:
            attempts = [kind]
            while len(track.faults) + len(attempts) < n and attempts[-1] != "term":
                nxt = draw(track, rng)
                clash = {nxt, *attempts} >= {"save", "async-save"}  # one job saves one way
                if not in_process(nxt, track) or clash:
                    pending = nxt
                    break
                attempts.append(nxt)
            run_chain(track, attempts, rng)
    # the last job, with no fault, to the end
    rc, out, _ = run_job(track, command(track, "final"), [])
    if rc != 0:
        raise SystemExit(f"soak: the final job of track {track.name} failed (rc {rc}):\n{out[-3000:]}")
    settle_layout_faults(track, out)


# -- the command ----------------------------------------------------------------------------------

def mount_tmpfs(disk: Path, no_tmpfs: bool) -> bool:
    if no_tmpfs or os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(disk)],
                          capture_output=True).returncode == 0


def soak_track(name: str, n: int, work: Path, rng: random.Random, no_tmpfs: bool, mounts: list) -> dict:
    layout, extra = TRACKS[name]
    root = work / name
    if os.path.ismount(root / "disk"):  # left by a soak that was killed
        subprocess.run(["umount", str(root / "disk")], capture_output=True)
    shutil.rmtree(root, ignore_errors=True)
    (root / "disk").mkdir(parents=True)
    track = Track(name, layout, extra, root, iters=6 * n + 20)
    track.tmpfs = mount_tmpfs(root / "disk", no_tmpfs)
    if track.tmpfs:
        mounts.append(root / "disk")
    say(f"soak: track {name}: {n} faults over {track.iters} iterations at {layout}"
        + (" with local SGD" if extra else "") + (", the save directory on a tmpfs" if track.tmpfs else ""))
    rc, out = finish(*launch(track, command(track, "reference", save=root / "reference-ckpt")))
    if rc != 0:
        raise SystemExit(f"soak: the uninterrupted run of track {name} failed:\n{out[-3000:]}")
    run_track(track, n, rng)
    result = {"track": name, "faults": len(track.faults), "injected": sum(f.injected for f in track.faults),
              "survived": sum(f.survived for f in track.faults), "kinds": sorted({f.kind for f in track.faults}),
              "not_survived": [f"{f.kind}: {f.detail}" for f in track.faults if not f.survived],
              **account(root, track.save, root / "reference-ckpt", track.iters, GLOBAL_BATCH,
                        bitwise=name != "layouts", cause=track.cause)}
    say(f"soak: track {name}: {result['injected']} injected, {result['survived']} survived, {result['lost']} samples "
        f"lost, {result['repeated']} repeated, {result['losses_compared']} losses compared (max gap "
        f"{result['max_loss_gap']:.3g}), final state gap {result['final_state_gap']:.3g}, "
        f"{'OK' if result['ok'] else 'FAILED'}")
    return result


def report_costs(results: list[dict]) -> None:
    say("soak: what a restart cost, by the fault before it (seconds from the last step finished to the same "
        "point again; iterations recomputed):")
    by_kind: dict[str, list] = {}
    for r in results:
        for kind, v in r["lost_by_kind"].items():
            by_kind.setdefault(kind, []).append(v)
    for kind, vs in sorted(by_kind.items()):
        n = sum(v["restarts"] for v in vs)
        say(f"  {kind:11s} {n:4d} restart(s), {sum(v['mean_seconds'] * v['restarts'] for v in vs) / n:6.1f} s, "
            f"{sum(v['mean_iterations'] * v['restarts'] for v in vs) / n:5.2f} iterations")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--faults", type=int, default=12, help="faults in all, shared by the tracks (default 12)")
    ap.add_argument("--seed", type=int, default=1, help="seed of the fault schedule")
    ap.add_argument("--tracks", default="fixed,layouts,local-sgd", help="which tracks, comma-separated")
    ap.add_argument("--kinds", help="draw only these faults, comma-separated (of: " + ", ".join(KINDS) + ")")
    ap.add_argument("--workdir", help="keep everything here (default: a temporary directory, removed)")
    ap.add_argument("--no-tmpfs", action="store_true", help="a full disk by injected ENOSPC, even as root")
    ap.add_argument("--json", help="write the per-track accounting here")
    args = ap.parse_args(argv)
    names = [t for t in args.tracks.split(",") if t]
    if not names or set(names) - set(TRACKS):
        ap.error(f"--tracks takes {', '.join(TRACKS)} (got {args.tracks!r})")
    if args.faults < len(names):
        ap.error(f"--faults {args.faults}: at least one per track ({len(names)})")
    global ONLY
    if args.kinds:
        ONLY = set(args.kinds.split(","))
        if ONLY - set(KINDS):
            ap.error(f"--kinds: unknown {', '.join(sorted(ONLY - set(KINDS)))}; known: {', '.join(KINDS)}")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="megalite-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    share = {t: SHARE[t] for t in names}
    counts = {t: max(1, round(args.faults * share[t] / sum(share.values()))) for t in names}
    counts[names[0]] += args.faults - sum(counts.values())
    started, results, mounts = time.time(), [], []

    def stop(*_):
        for proc in CURRENT:
            os.killpg(proc.pid, signal.SIGKILL)
        sys.exit(143)
    signal.signal(signal.SIGTERM, stop)
    try:
        for name in names:
            results.append(soak_track(name, counts[name], work, rng, args.no_tmpfs, mounts))
    finally:
        for proc in CURRENT:
            os.killpg(proc.pid, signal.SIGKILL)
        for m in mounts:
            subprocess.run(["umount", "--lazy", str(m)], capture_output=True)  # a traceback may hold a map
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"seed": args.seed, "faults": args.faults,
                                               "seconds": time.time() - started, "tracks": results}, indent=1))
    report_costs(results)
    injected = sum(r["injected"] for r in results)
    survived = sum(r["survived"] for r in results)
    lost, repeated = sum(r["lost"] for r in results), sum(r["repeated"] for r in results)
    gap = max(r["final_loss_gap"] for r in results)
    print(f"soak: {injected} faults injected, {survived} survived, {lost} samples lost, {repeated} repeated, "
          f"final loss gap {gap:.3g} vs the uninterrupted run", flush=True)
    ok = all(r["ok"] for r in results) and survived == injected == args.faults
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
