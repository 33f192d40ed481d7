"""How much signal a batch of episodes carries: the gradient noise scale of the policy-gradient loss.

Scored trajectories in (a train run's ``OUT/scored/step*.jsonl``, or ``turnstile score`` output:
turns with advantages); the groups are cut, in file order, into batches of ``--batch`` episodes;
for each batch the gradient of the on-policy loss the learner minimises (veRL's token-mean PPO loss
at ratio 1: −Σ A·log π(token) over the batch's policy tokens / their number) at the model's
weights, in plain PyTorch, one sequence per forward. From the batch gradients g_i:

- their norms and pairwise cosines: independent batches share only the true gradient G, so
  E[g_i·g_j] = |G|², while E|g_i|² = |G|² + tr(Σ)/B;
- the noise scale B_noise = tr(Σ)/|G|² = B·(mean|g_i|² − mean g_i·g_j)/mean g_i·g_j (McCandlish et
  al., 2018, "An Empirical Model of Large-Batch Training"): the batch at which one step's gradient
  is as much signal as noise. A step of B ≪ B_noise episodes is mostly noise, and it takes about
  B_noise/B such steps before their sum points along G (a signal-to-noise ratio of one).

The pairs share batches, so the cosines are not independent; the spread is reported as it is.

    .venv/bin/python benchmarks/gradient_noise.py SCORED.jsonl [...] [--batch 32] [--model tiny-qwen3-sft]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import statistics
from collections import defaultdict

import torch
from transformers import AutoModelForCausalLM

from turnstile.learner.batch import samples_from_trajectories
from turnstile.rollout.model_store import resolve_model
from turnstile.rollout.trajectory import Trajectory, load_trajectories


def load(paths: list[str]) -> list[Trajectory]:
    """The files' trajectories, each group named by its file too: two runs (or two seeds of one)
    may each hold a group ``s3-<task>``, and those are two groups, not one of eight."""
    return [dataclasses.replace(t, uid=f"{k}:{t.uid}") for k, path in enumerate(paths) for t in load_trajectories(path)]


def batches(trajectories: list[Trajectory], size: int) -> list[list[Trajectory]]:
    groups: dict[str, list[Trajectory]] = defaultdict(list)
    for trajectory in trajectories:
        groups[trajectory.uid].append(trajectory)
    cut: list[list[Trajectory]] = [[]]
    for group in groups.values():
        if len(cut[-1]) >= size:
            cut.append([])
        cut[-1].extend(group)
    return [batch for batch in cut if len(batch) >= size]


def gradient(model: torch.nn.Module, batch: list[Trajectory]) -> torch.Tensor:
    samples = samples_from_trajectories(batch)
    tokens = sum(sum(sample.response_mask) for sample in samples)
    model.zero_grad()
    for sample in samples:
        ids = torch.tensor([sample.prompt_ids + sample.response_ids])
        logits = model(ids).logits[0, len(sample.prompt_ids) - 1:-1]
        log_probs = torch.log_softmax(logits.float(), -1)
        chosen = log_probs.gather(-1, torch.tensor(sample.response_ids)[:, None])[:, 0]
        weights = torch.tensor(sample.advantages) * torch.tensor(sample.response_mask, dtype=torch.float32)
        (-(weights * chosen).sum() / tokens).backward()
    return torch.cat([p.grad.flatten().clone() for p in model.parameters() if p.grad is not None])


def shared_upper(gram: torch.Tensor, t: float) -> tuple[float, float]:
    """The mean of g_i·g_j over pairs of batches (an unbiased estimate of |G|²) and its one-sided
    upper bound, ``t`` jackknife standard errors above it (each batch left out in turn: the pairs
    share batches, so they are not independent samples)."""
    n = gram.shape[0]
    off = float(gram.sum() - gram.diagonal().sum())  # every pair twice
    rows = (gram.sum(1) - gram.diagonal()).tolist()
    left_out = [(off - 2 * row) / ((n - 1) * (n - 2)) for row in rows]
    centre = statistics.fmean(left_out)
    error = math.sqrt((n - 1) / n * sum((x - centre) ** 2 for x in left_out))
    shared = off / (n * (n - 1))
    return shared, shared + t * error


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="scored trajectory JSONL files (turns with advantages)")
    parser.add_argument("--batch", type=int, default=32, help="episodes per batch (whole groups)")
    parser.add_argument("--model", default="tiny-qwen3-sft", help="model name or directory")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    trajectories = load(args.files)
    cut = batches(trajectories, args.batch)
    if len(cut) < 3:
        raise SystemExit(f"{len(trajectories)} episodes make {len(cut)} batches of {args.batch}; need 3 or more")
    model = AutoModelForCausalLM.from_pretrained(str(resolve_model(args.model)), dtype=torch.float32)
    grads = [gradient(model, batch) for batch in cut]
    pairs = list(itertools.combinations(range(len(grads)), 2))
    stacked = torch.stack(grads).double()
    gram = stacked @ stacked.T
    dots = [float(gram[i, j]) for i, j in pairs]
    cosines = [dots[k] / float(grads[i].norm() * grads[j].norm()) for k, (i, j) in enumerate(pairs)]
    squared = float(gram.diagonal().mean())
    from learning import t_quantile  # the benchmark beside this one (a script's folder is first on sys.path)

    shared, upper = shared_upper(gram, t_quantile(0.95, len(grads) - 1))
    print(f"{len(trajectories)} episodes, {len(cut)} batches of {args.batch}, model {args.model}")
    print("gradient norms  " + " ".join(f"{float(g.norm()):.3f}" for g in grads))
    sizes = grads[0].abs()
    sample = sizes[torch.randperm(sizes.numel(), generator=torch.Generator().manual_seed(0))[:1_000_000]]
    quartiles = torch.quantile(sample, torch.tensor([0.25, 0.5, 0.75]))
    print(f"first batch, {sizes.numel():,} coordinates: RMS {float(sizes.pow(2).mean().sqrt()):.1e}, |g| quartiles "
          + " ".join(f"{float(q):.1e}" for q in quartiles))
    print(f"cosine between batches: mean {statistics.mean(cosines):+.3f}, sd {statistics.stdev(cosines):.3f}, "
          f"range {min(cosines):+.3f} to {max(cosines):+.3f} ({len(pairs)} pairs)")
    bound = (f"B_noise >= {args.batch * (squared - upper) / upper:.0f} episodes (95%, one-sided: mean g_i·g_j "
             f"at most {upper / squared:.3f} of mean |g_i|², jackknife over batches)") if upper > 0 else \
        "no lower bound on B_noise: the upper bound of mean g_i·g_j is not above 0"
    print(bound)
    if shared <= 0:
        print("mean g_i·g_j <= 0: no shared direction measurable at this size; B_noise unbounded")
        return
    noise_scale = args.batch * (squared - shared) / shared
    print(f"noise scale B_noise = {noise_scale:.0f} episodes: a step of {args.batch} is "
          f"{args.batch / noise_scale:.2f} signal to 1 noise (in squared norm); "
          f"about {noise_scale / args.batch:.0f} such steps sum to signal = noise")


if __name__ == "__main__":
    main()
