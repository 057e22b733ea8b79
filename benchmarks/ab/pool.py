"""The pool of GPUs: the workers' processes run in order, one per GPU at a time, each in a
process group of its own that a timeout or a deadline ends whole (vLLM's engine core is a child
that holds the GPU's memory); every worker started leaves a result file, its error in it if it
wrote none."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Job:
    label: str  # for the progress lines
    cmd: list[str]
    result: Path  # run_<...>.json; its log is log_<...>.txt beside it
    stub: dict  # written with an error when the worker leaves no result
    timeout: float | None = None  # seconds; None: the pool's
    estimate_s: float = 0  # the plan's seconds for it, against a deadline

    @property
    def log(self) -> Path:
        return self.result.with_name("log_" + self.result.stem.removeprefix("run_") + ".txt")


def gpu_slots(n: int, visible: str | None) -> list[str]:
    """The device ids of the first ``n`` GPUs this process may use: its own
    ``CUDA_VISIBLE_DEVICES`` if set (a worker must get one of those), else 0..n-1."""
    ids = [v.strip() for v in visible.split(",") if v.strip()] if visible else [str(i) for i in range(n)]
    if n > len(ids):
        raise ValueError(f"--gpus {n}, but CUDA_VISIBLE_DEVICES={visible} names {len(ids)}")
    return ids[:n]


def _group_alive(pgid: int) -> bool:
    """Whether a process of group ``pgid`` still runs (zombies hold no GPU memory; a container's
    init may never reap them)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            state, _ppid, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):
            continue
        if group == str(pgid) and state not in "ZX":
            return True
    return False


def _end_group(pgid: int, wait_s: float = 60) -> None:
    """SIGKILL the group and wait until it is gone: the next worker on this GPU needs its memory."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + wait_s
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)


def _start(job: Job, gpu: str) -> subprocess.Popen:
    job.result.unlink(missing_ok=True)  # a stale result must not hide a dead worker
    print(f"start {job.label} on GPU {gpu}", flush=True)
    with open(job.log, "wb") as log:  # one log per worker: parallel workers would interleave
        # Its own process group: vLLM's engine core is a child process that keeps the GPU's
        # memory until it exits, so a timeout must end the whole group. Unbuffered: a killed
        # worker's log still ends with its last lines.
        return subprocess.Popen(job.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "CUDA_VISIBLE_DEVICES": gpu, "PYTHONUNBUFFERED": "1"})


# vLLM's warning when a Triton kernel compiles while serving (its JIT monitor), with its time.
JIT_LINE = re.compile(r"(\d\d-\d\d \d\d:\d\d:\d\d) \[jit_monitor\.py:\d+\] Triton kernel JIT compilation "
                      r"during inference: (\w+)")


def mark_jit_compiles(result: dict, log: str, year: int) -> dict:
    """Name, in each scenario, the kernels vLLM logged compiling inside its timed calls: their
    compile time is in that scenario's numbers. Log times are local and to the second."""
    events = [(time.mktime(time.strptime(f"{year}-{m[1]}", "%Y-%m-%d %H:%M:%S")), m[2]) for m in JIT_LINE.finditer(log)]
    for scenario, spans in (result.get("spans") or {}).items():
        hits = [name for t, name in events if any(a - 1 <= t <= b + 1 for a, b in spans)]
        if hits and isinstance(result.get(scenario), dict):
            result[scenario]["jit_compiles"] = hits
    return result


def _finish(job: Job, gpu: str, seconds: float, returncode: int, timed_out: str | None) -> None:
    """Leave a result file (the stub with the error if the worker left none) and say how it went.
    A finished result written before the timeout stands: only the engine's shutdown hung. A
    partial one (still ``running`` a scenario) keeps the scenarios it finished, with the error."""
    wrote = job.result.exists()
    if not wrote:
        error = timed_out or f"the worker exited with status {returncode} and no result (see {job.log.name})"
        job.result.write_text(json.dumps({**job.stub, "error": error}))
    result = json.loads(job.result.read_text())
    if "running" in result:
        scenario = result.pop("running")
        result["error"] = (f"{timed_out} in {scenario}" if timed_out else
                           f"the worker exited with status {returncode} in {scenario} (see {job.log.name})")
    if wrote:
        result["worker_s"] = round(seconds, 1)  # start to end, against the plan's estimate
        if job.log.exists() and "spans" in result:
            result = mark_jit_compiles(result, job.log.read_text(errors="replace"), time.localtime().tm_year)
        job.result.write_text(json.dumps(result, indent=1))
    error = result.get("error")
    print(f"end {job.label} on GPU {gpu}: {seconds:.0f} s, " + (f"failed: {error}" if error else "ok"), flush=True)
    if error:
        tail = job.log.read_text(errors="replace").splitlines()[-20:]
        print(f"--- last lines of {job.log}:\n" + "\n".join(tail) + "\n---", flush=True)


# With --deadline-s: a configuration starts only if its plan estimate, times this, fits the time
# left (the estimates ran up to 20% short on 2026-12-04, results/ab_4k), and every engine is
# ended this many seconds before the deadline, for its shutdown and the report.
DEADLINE_MARGIN = 1.25
DEADLINE_RESERVE_S = 30


def run_pool(jobs: list[Job], gpus: list[str], timeout: float, poll_s: float = 0.5,
             deadline_s: float | None = None) -> list[Job]:
    """Run ``jobs`` in order, at most one per GPU of ``gpus`` at a time, each ended (with its
    process group) after ``timeout`` seconds. With ``deadline_s``, the whole run ends within
    that many seconds: a job whose estimate does not fit the time left is not started, and one
    still running at ``deadline_s - DEADLINE_RESERVE_S`` is ended (a finished scenario's results
    stay). Every job it starts leaves its result file. Returns the jobs not started."""
    queue, free, running, skipped = list(jobs), list(gpus), {}, []  # running: process -> (job, gpu, start)
    t_run = time.monotonic()
    try:
        while queue or running:
            while queue and free:
                job, gpu = queue.pop(0), free.pop(0)
                left = None if deadline_s is None else deadline_s - DEADLINE_RESERVE_S - (time.monotonic() - t_run)
                if left is not None and DEADLINE_MARGIN * job.estimate_s > left:
                    # No result file (a stale one goes): a later run of the same plan fills it in.
                    free.insert(0, gpu)
                    skipped.append(job)
                    job.result.unlink(missing_ok=True)
                    print(f"not started {job.label}: {max(left, 0):.0f} s left of --deadline-s {deadline_s:g}, "
                          f"estimate {job.estimate_s:.0f} s x {DEADLINE_MARGIN:g}", flush=True)
                    continue
                running[_start(job, gpu)] = (job, gpu, time.monotonic())
            time.sleep(poll_s)
            for proc, (job, gpu, t0) in list(running.items()):
                done = proc.poll() is not None
                limit = job.timeout or timeout
                if deadline_s is not None:
                    limit = min(limit, round(deadline_s - DEADLINE_RESERVE_S - (t0 - t_run)))
                late = not done and time.monotonic() - t0 > limit
                if not (done or late):
                    continue
                _end_group(proc.pid)  # on exit too: whatever the worker left behind
                proc.wait()
                del running[proc]
                free.append(gpu)
                _finish(job, gpu, time.monotonic() - t0, proc.returncode,
                        f"timed out after {limit:g} s" if late else None)
    finally:  # an interrupt or an error here: no engine outlives the parent
        for proc in running:
            _end_group(proc.pid)
    return skipped
