"""Memory over a long training run: does any process of `turnstile train` grow step after step?

Runs the real `turnstile train` loop in this process (``run_train``: async mode, so the store, the
reward service and its workers run): the warm start on vLLM (CPU), the real veRL learner, weights
published to the engine every step, the real environment, tools, workers, router and store, as the
embedded default runs them, at a smaller step (2 tasks × 4 samples, 128 new tokens a turn) so that
hundreds of steps fit in an hour; a tenth of the tool calls fail (the environment's fault: the fault
path runs every step). Rewards: exact match, the format check and information gain, whose reward
workers score every episode with the policy of its version (the weights archive). (An engine that
answers instantly, the scripted expert, is always right: every group all-equal, nothing trained or
published, so the learner's and the engine's memory would go unmeasured.)
After each step's checkpoint (``run.json``) a reading is taken of:

- the resident set size (RSS) of every process of the run, by role: this driver, the rollout
  workers, the engine replicas, the reward workers, the learner's ranks, the memory store's actor,
  idle Ray workers and Ray's own processes (raylet, GCS, ...): every descendant of this process,
  classed by the title Ray gives an actor's process (``ray::ClassName``);
- the Ray object store's bytes in use (the raylet's store statistics, as ``ray memory --stats-only``
  prints them).

    .venv/bin/python benchmarks/soak.py [--steps 300] [--out runs/soak] [--plot docs/benchmarks/soak.png]
    .venv/bin/python benchmarks/soak.py --report-only [--out runs/soak] [--plot ...]

Resumable: a run killed midway continues from its last checkpoint (``resume=true``) when started
again with the same ``--out``; the readings already taken are kept (``memory.jsonl``).

Reading: per role, RSS after the warm-up (the first ``--warm-up`` share of the readings: a process'
first steps fill its caches and allocator pools) and at the last step, and the slope of a
least-squares line over the readings after it, in MB per 100 steps; Ray's own processes also one by
one. Target:
every slope within noise of zero (a leak of a few KB a step shows as tens of MB over hundreds of
steps). MB here is 2^20 bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import threading
from collections import defaultdict
from pathlib import Path

import psutil
import ray

from turnstile.cluster.cli.config import load_config
from turnstile.cluster.jobs.run import TrainJob
from turnstile.cluster.jobs.train import run_train

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train.yaml"
MB = 1 << 20

DRIVER, RAY_OWN = "driver", "Ray's own processes"
ROLES = {"RolloutWorker": "rollout workers", "EngineActor": "engines", "RewardWorker": "reward workers",
         "PolicyWorker": "learner", "MemoryStoreActor": "store", "IDLE": "idle Ray workers",
         "DashboardAgent": RAY_OWN, "RuntimeEnvAgent": RAY_OWN}
"""The role of a Ray actor's process, by its class (another actor's class is its own role)."""
_TITLE = re.compile(r"^ray::(\w+)")


def overrides(steps: int, out: Path, resume: bool) -> list[str]:
    return [f"steps={steps}", "mode=async", "staleness=1", "eval_every=0", "checkpoint_every=1",
            f"out={out}", "name=soak", f"resume={str(resume).lower()}", "tasks_per_step=2",
            "rollout.group_size=4", "rollout.episode.max_new_tokens=128",
            # A tenth of the tool calls fail (the environment's: those episodes are left out of the loss)
            "rollout.tools.toolbox.inject_failure_rate=0.1",
            "rollout.corpus.port=0", "rollout.fleet.workers=2", "rollout.fleet.episodes_per_worker=8",
            "rewards=[{kind: exact_match}, {kind: format}, {kind: information_gain}]",
            "estimator.kind=igpo", "learner.mini_batch=8", "learner.micro_batch=2", "learner.threads=1"]


def role_of(process: psutil.Process) -> str:
    """The role of the nearest Ray actor process at or above ``process`` (vLLM's engine core is a
    child of its replica's actor), this driver's, or Ray's own (raylet, GCS, dashboard, log monitor)."""
    if process.pid == os.getpid():
        return DRIVER
    step: psutil.Process | None = process
    while step is not None and step.pid != os.getpid():
        match = _TITLE.match(" ".join(step.cmdline()))
        if match is not None:
            return ROLES.get(match.group(1), match.group(1))
        step = step.parent()
    return RAY_OWN


def reading(step: int) -> dict[str, object]:
    """RSS by role (MB, and the number of processes) of every process under this one, the sum of
    their peaks so far (``VmHWM``: a process' largest RSS since it started), and the object store's
    bytes in use."""
    rss: dict[str, float] = defaultdict(float)
    peak: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    ray_own: dict[str, float] = defaultdict(float)  # which of Ray's processes, if that role grows
    for process in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            role, size = role_of(process), process.memory_info().rss
            name = service_name(process.cmdline()) if role == RAY_OWN else ""
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue  # it ended between the listing and the reading
        rss[role] += size / MB
        peak[role] += high_water_mark(process.pid, size) / MB
        count[role] += 1
        if name:
            ray_own[name] += size / MB
    return {"step": step, "rss_mb": dict(rss), "peak_mb": dict(peak), "processes": dict(count),
            "object_store_mb": object_store_mb(), "ray_own_mb": dict(ray_own)}


def high_water_mark(pid: int, rss: int) -> int:
    """The process' peak RSS in bytes (``VmHWM`` in /proc/PID/status); ``rss`` where it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return rss


def service_name(cmdline: list[str]) -> str:
    """A Ray service's name: its executable's (``raylet``), or a Python service's script's."""
    script = next((arg for arg in cmdline if arg.endswith(".py")), None)
    return (script or cmdline[0]).rsplit("/", 1)[-1]


def object_store_mb() -> float:
    # Ray's public API reports the store only as text (``ray memory --stats-only``); this is the
    # reply that text is made from.
    from ray._private.internal_api import get_memory_info_reply, get_state_from_address

    reply = get_memory_info_reply(get_state_from_address(ray.get_runtime_context().gcs_address))
    return reply.store_stats.object_store_bytes_used / MB


class Sampler(threading.Thread):
    """Takes a :func:`reading` each time the run's checkpoint names a new step."""

    def __init__(self, out: Path, log: Path) -> None:
        super().__init__(daemon=True)
        self.out, self.log, self.stop = out, log, threading.Event()
        # A resumed run starts at its checkpoint's step: readings belong to steps this run finishes.
        self.last = max([row["step"] for row in load(log)] + [self.checkpoint_step()])

    def run(self) -> None:
        while not self.stop.wait(0.5):
            self.poll()

    def checkpoint_step(self) -> int:
        try:
            return int(json.loads((self.out / "run.json").read_text())["step"])
        except (OSError, ValueError, KeyError):
            return 0  # not written yet

    def poll(self) -> None:
        step = self.checkpoint_step()
        # Not before this process' Ray is up: the store's reading would look for another cluster
        # (a dead one's address left behind kills the process after a minute).
        if step > self.last and ray.is_initialized():
            with self.log.open("a") as log:
                log.write(json.dumps(reading(step)) + "\n")
            self.last = step


def run_sampled(job: TrainJob, log: Path) -> None:
    """``run_train(job)`` with a :class:`Sampler` appending a reading to ``log`` at each step's checkpoint."""
    sampler = Sampler(Path(job.out), log)
    sampler.start()
    try:
        run_train(job, progress=False)
    finally:
        sampler.stop.set()
        sampler.join()
    sampler.poll()  # the last step, if the run ended before the sampler saw it (Ray is still up)


def load(log: Path) -> list[dict]:
    if not log.is_file():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def slope_per_100(steps: list[float], values: list[float]) -> float:
    """The least-squares slope of ``values`` over ``steps``, per 100 steps."""
    if len(set(steps)) < 2:
        return 0.0
    return 100 * statistics.linear_regression(steps, values).slope


def summary(rows: list[dict], warm_up: float) -> list[tuple[str, int, float, float, float]]:
    """Per role: processes, RSS after the warm-up (the first ``warm_up`` share of the readings), at
    the last step, and the slope over the readings after the warm-up (MB per 100 steps)."""
    warm = rows[int(len(rows) * warm_up):] or rows
    roles = sorted({role for row in rows for role in row["rss_mb"]}, key=lambda r: -warm[-1]["rss_mb"].get(r, 0))
    series = {role: [row["rss_mb"].get(role, 0.0) for row in warm] for role in roles}
    series["object store"] = [row["object_store_mb"] for row in warm]
    for name in warm[-1].get("ray_own_mb", {}):
        series[f"  of Ray's own: {name}"] = [row.get("ray_own_mb", {}).get(name, 0.0) for row in warm]
    steps = [float(row["step"]) for row in warm]
    return [(role, warm[-1]["processes"].get(role, 0), values[0], values[-1], slope_per_100(steps, values))
            for role, values in series.items()]


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [row["step"] for row in rows]
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True, height_ratios=(3, 1))
    for role in sorted({role for row in rows for role in row["rss_mb"]}):
        top.plot(steps, [row["rss_mb"].get(role, 0.0) for row in rows], label=role)
    top.set_ylabel("RSS (MB, all processes of the role)")
    top.legend(fontsize=8, ncol=2)
    top.set_title("turnstile train (async) over a long run: memory by role")
    bottom.plot(steps, [row["object_store_mb"] for row in rows], color="black")
    bottom.set_ylabel("object store (MB)")
    bottom.set_xlabel("step")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", type=Path, default=Path("runs/soak"))
    parser.add_argument("--plot", type=Path, default=None, help="write the curves here (a .png)")
    parser.add_argument("--warm-up", type=float, default=0.3, help="the share of the readings left out of the slopes")
    parser.add_argument("--report-only", action="store_true", help="read OUT/memory.jsonl, run nothing")
    args = parser.parse_args()
    run_dir, log = args.out / "run", args.out / "memory.jsonl"
    if not args.report_only:
        run_dir.mkdir(parents=True, exist_ok=True)
        job = load_config(TrainJob, EXAMPLE, overrides(args.steps, run_dir, resume=(run_dir / "run.json").is_file()))
        run_sampled(job, log)
    rows = load(log)
    if not rows:
        raise SystemExit(f"{log}: no readings")
    skipped = int(len(rows) * args.warm_up)
    print(f"{len(rows)} readings, steps {rows[0]['step']}-{rows[-1]['step']}; slopes from step "
          f"{rows[min(skipped, len(rows) - 1)]['step']} (the first {args.warm_up:.0%} of the readings left out)")
    print("| role | processes | RSS after warm-up (MB) | at the last step (MB) | slope (MB / 100 steps) |")
    print("|---|---|---|---|---|")
    for role, processes, first, last, slope in summary(rows, args.warm_up):
        print(f"| {role} | {processes or ''} | {first:.0f} | {last:.0f} | {slope:+.1f} |")
    if args.plot:
        plot(rows, args.plot)
        print(f"curves: {args.plot}")


if __name__ == "__main__":
    main()
