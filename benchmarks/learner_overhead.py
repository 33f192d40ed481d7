"""The learner's overhead over its arithmetic: veRL's update against a plain PyTorch forward and
backward of the same batch on the same model.

The batch is real: the scripted expert's trajectories of the embedded default's tasks (a file from
``turnstile rollout``, or made here), random advantages of both signs. The plain PyTorch figures run
one sequence per forward (no padding, the causal attention kernel), loss on the response tokens,
one optimiser step — the arithmetic an update cannot avoid — projecting onto the vocabulary either
every position (what a Hugging Face forward does) or only the positions whose next token the policy
generated (what the learner's chunked head does, learner/head.py). The veRL figures are
:meth:`turnstile.learner.trainer.Learner.train_rl` with the default's settings (one mini-batch of every
sample) at the given micro-batch sizes and ``head_chunk`` values (0: veRL's whole-logits path); each
is set against the plain figure that does the same work. All on the same threads of this machine,
one after the other, ``--repeats`` times.

    .venv/bin/python benchmarks/learner_overhead.py [--samples 32] [--micro-batches 1] [--head-chunks 0,1024]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import ray
import torch

from turnstile.cluster.jobs.session import RayConfig, init_ray
from turnstile.cluster.recipes.warm_start import WarmStartRecipe, expert_trajectories
from turnstile.learner.batch import Sample, samples_from_trajectories
from turnstile.learner.trainer import Learner, LearnerConfig
from turnstile.rollout.model_store import resolve_model


def batch(path: str, count: int) -> list[Sample]:
    if path:
        from turnstile.rollout.trajectory import load_trajectories

        trajectories = load_trajectories(path)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            trajectories = expert_trajectories(replace(WarmStartRecipe(), tasks={**WarmStartRecipe().tasks,
                                                                              "count": 3 * count}),
                                               Path(tmp) / "expert.jsonl", progress=False)
    rng = random.Random(0)
    samples = samples_from_trajectories(trajectories[:count], require_advantage=False)
    return [replace(s, advantages=[a * rng.choice((-1.0, 1.0)) or 0.5 for a in s.advantages],
                    trajectory=(f"u{i}", 0), uid=f"u{i}") for i, s in enumerate(samples)]


def plain(model_path: str, samples: list[Sample], *, trained_only: bool) -> float:
    """Seconds for one forward+backward of every sample and one AdamW step; with ``trained_only``
    the LM head projects only the positions whose next token is the policy's."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    optimiser = torch.optim.AdamW(model.parameters(), lr=1e-6)
    started = time.perf_counter()
    for sample in samples:
        ids = torch.tensor([sample.prompt_ids + sample.response_ids])
        mask = torch.tensor([0] * len(sample.prompt_ids) + list(sample.response_mask))[1:].bool()
        targets = ids[0, 1:]
        if trained_only:
            hidden = model.model(input_ids=ids).last_hidden_state[0, :-1]
            logits, targets = model.lm_head(hidden[mask]), targets[mask]
        else:
            logits, targets = model(input_ids=ids).logits[0, :-1][mask], targets[mask]
        log_probs = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]
        (-log_probs.sum() / mask.sum()).backward()
    optimiser.step()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", default="", help="a rollout JSONL (default: the expert's, made here)")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--micro-batches", default="1", help="the default trains at micro-batch 1")
    parser.add_argument("--head-chunks", default="0,1024", help="learner.head_chunk values (0: whole logits)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="", help="a model directory or name (default: the tiny model; "
                        "the weights do not change the cost)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    init_ray(RayConfig(num_cpus=4))
    samples = batch(args.trajectories, args.samples)
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    model = resolve_model(args.model)
    plain_times = {trained: [plain(model, samples, trained_only=trained) for _ in range(args.repeats)]
                   for trained in (False, True)}
    rows = [(f"plain PyTorch, {what} to the vocabulary", plain_times[trained], plain_times[trained])
            for trained, what in ((False, "every position"), (True, "trained positions"))]
    for chunk in (int(c) for c in args.head_chunks.split(",")):
        for micro in (int(m) for m in args.micro_batches.split(",")):
            learner = Learner(LearnerConfig(model=model, mini_batch=len(samples), micro_batch=micro, lr=1e-6,
                                            max_length=4096, head_chunk=chunk, num_cpus_per_worker=2)).start()
            try:
                times = []
                for _ in range(args.repeats):
                    started = time.perf_counter()
                    learner.train_rl(samples)
                    times.append(time.perf_counter() - started)
            finally:
                learner.close()
            rows.append((f"veRL train_rl, micro_batch={micro}, head_chunk={chunk}", times,
                         plain_times[chunk > 0]))
    ray.shutdown()
    print(f"{len(samples)} samples, {tokens:,} tokens (prompt + response), "
          f"{sum(sum(s.response_mask) for s in samples):,} of them the policy's, model {Path(model).name}")
    print(f"{'what':62} {'median s':>9} {'tokens/s':>9} {'x plain (same work)':>20}")
    for name, times, same_work in rows:
        median = statistics.median(times)
        print(f"{name:62} {median:9.2f} {tokens / median:9.0f} {median / statistics.median(same_work):20.2f}")

if __name__ == "__main__":
    main()
