"""Long trajectories through the learner: one SFT and one RL update (GRPO and GSPO, old log-probs
recomputed) on a single 8- to 200-turn mono trajectory, with the chunked LM head (``head_chunk``,
learner/head.py) and, where it fits, without it (``head_chunk=0``, veRL's whole-logits path).

The trajectories are real episodes of the synthetic world: the scripted expert on its largest
aggregation question (``benchmarks/ig_scoring.py``), cut at each number of turns; a mono context
makes each one sample. Each update runs through :class:`turnstile.learner.trainer.Learner` as ``turnstile
train`` and ``turnstile sft`` call it (``train_rl`` / ``train_sft``, the veRL workers, one rank),
with ``max_length`` above the longest sample. The RL advantages are made up (±1 per turn: the
cost does not depend on them).

Per update: seconds, tokens (prompt + response) per second, and the peak RSS of the learner's
worker process during it (its ``VmHWM``, reset just before through ``/proc/PID/clear_refs``;
Linux only). Lengths run shortest first, so memory a worker keeps from an earlier update is
below the next one's peak. The whole-logits path runs only up to ``--before-max-tokens``: beyond
that it would need more memory than this machine has (the table gives the extrapolated figure).

Resumable: each finished row is appended to ``--out`` (JSON lines) and not run again.

    .venv/bin/python benchmarks/learner_long.py [--turns 8,50,100,200] [--out runs/learner_long.jsonl]
    .venv/bin/python benchmarks/learner_long.py --report-only --out runs/learner_long.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from turnstile.learner.batch import Sample, samples_from_trajectories
from turnstile.learner.trainer import Learner, LearnerConfig

UPDATES = ("sft", "grpo", "gspo")
MAX_LENGTH = 1 << 17


def long_samples(turns: list[int], model: str) -> dict[int, Sample]:
    """One sample per turn count: the expert's episode cut there, with ±1 advantages."""
    from turnstile.rollout.chat import ChatFormat

    from ig_scoring import make_trajectories  # benchmarks/, on the path of a script run from there

    rng = random.Random(0)
    chat = ChatFormat.from_pretrained(model)
    samples = {}
    for count, trajectory in zip(turns, make_trajectories(chat, turns), strict=True):
        (sample,) = samples_from_trajectories([trajectory], require_advantage=False)
        samples[count] = replace(sample, advantages=[rng.choice((-1.0, 1.0)) for _ in sample.advantages])
    return samples


def length(sample: Sample) -> int:
    return len(sample.prompt_ids) + len(sample.response_ids)


def worker_pid(learner: Learner) -> int:
    import ray

    worker = learner._actor.workers[0]  # noqa: SLF001 - the benchmark reads the worker's process
    return int(ray.get(worker.__ray_call__.remote(lambda _self: os.getpid())))


def measure(learner: Learner, update: str, sample: Sample) -> dict[str, float]:
    from memory import reset_peak, status_kb  # benchmarks/memory.py, on the path of a script run from there

    pid = worker_pid(learner)
    if not reset_peak(pid):
        raise RuntimeError(f"cannot reset the peak RSS of process {pid} (/proc/{pid}/clear_refs)")
    started = time.perf_counter()
    report = learner.train_sft([sample]) if update == "sft" else learner.train_rl([sample])
    seconds = time.perf_counter() - started
    tokens = length(sample)
    if report.truncated_tokens:
        raise RuntimeError(f"{report.truncated_tokens} tokens were cut: raise MAX_LENGTH")
    return {"seconds": seconds, "tokens_per_s": tokens / seconds, "peak_rss": status_kb("VmHWM", pid)}


def load_rows(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def report(rows: list[dict[str, Any]]) -> str:
    """The Markdown table: one line per (turns, update), before and after side by side."""
    by_key = {(r["turns"], r["update"], r["head_chunk"]): r for r in rows}
    chunks = sorted({r["head_chunk"] for r in rows if r["head_chunk"]})
    after_chunk = chunks[0] if chunks else 1024
    lines = ["| turns | tokens | policy tokens | update | before: peak RSS | before: tokens/s | "
             f"after (head_chunk={after_chunk}): peak RSS | after: tokens/s | peak ratio | speed ratio |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for turns in sorted({r["turns"] for r in rows}):
        for update in UPDATES:
            after, before = by_key.get((turns, update, after_chunk)), by_key.get((turns, update, 0))
            known = after or before
            if known is None:
                continue
            cells = [str(turns), f"{known['tokens']:,}", f"{known['policy_tokens']:,}", update]
            for row in (before, after):
                cells += ([f"{row['peak_rss'] / 2**30:.2f} GiB", f"{row['tokens_per_s']:,.0f}"] if row
                          else ["not run", "-"])
            if before and after:
                cells += [f"{before['peak_rss'] / after['peak_rss']:.2f}x",
                          f"{after['tokens_per_s'] / before['tokens_per_s']:.2f}x"]
            else:
                cells += ["-", "-"]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", default="8,50,100,200")
    parser.add_argument("--head-chunk", type=int, default=1024, help="the chunked path's head_chunk")
    parser.add_argument("--before-max-tokens", type=int, default=50_000,
                        help="run the whole-logits path (head_chunk=0) only on samples up to this length")
    parser.add_argument("--updates", default=",".join(UPDATES), help="which of sft, grpo, gspo to run")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default="", help="a model directory or name (default: the tiny model)")
    parser.add_argument("--out", default="runs/learner_long.jsonl")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    rows = load_rows(out)
    if args.report_only:
        print(report(rows))
        return

    import ray

    from turnstile.cluster.jobs.session import RayConfig, init_ray
    from turnstile.rollout.model_store import resolve_model

    model = resolve_model(args.model)
    turns = sorted(int(t) for t in args.turns.split(","))
    samples = long_samples(turns, model)
    done = {(r["turns"], r["update"], r["head_chunk"]) for r in rows}
    out.parent.mkdir(parents=True, exist_ok=True)
    init_ray(RayConfig(num_cpus=4))
    for chunk in (args.head_chunk, 0):
        for loss in ("vanilla", "gspo"):
            updates = [u for u in (("sft", "grpo") if loss == "vanilla" else ("gspo",))
                       if u in args.updates.split(",")]
            todo = [(t, u) for t in turns for u in updates if (t, u, chunk) not in done
                    and (chunk or length(samples[t]) <= args.before_max_tokens)]
            if not todo:
                continue
            learner = Learner(LearnerConfig(model=model, mini_batch=1, micro_batch=1, lr=1e-6, loss=loss,
                                            recompute_old_log_probs=True, max_length=MAX_LENGTH,
                                            head_chunk=chunk, num_cpus_per_worker=1,
                                            threads=args.threads)).start()
            try:
                for count, update in todo:
                    sample = samples[count]
                    row = {"turns": count, "update": update, "head_chunk": chunk, "tokens": length(sample),
                           "policy_tokens": sum(sample.response_mask),
                           **measure(learner, update, sample)}
                    with out.open("a") as file:
                        file.write(json.dumps(row) + "\n")
                    print(json.dumps(row), flush=True)
            finally:
                learner.close()
    ray.shutdown()
    print(report(load_rows(out)))


if __name__ == "__main__":
    main()
