"""The engine/learner gap over a 200-turn trajectory: teacher-forced log-probs of the same policy
tokens from a rollout engine (vLLM or hf, bfloat16 or float32) and from the fp32 learner.

The trajectory is the scripted expert's 200-turn episode of the synthetic world's largest
aggregation question (``benchmarks/ig_scoring.py``, the one ``benchmarks/learner_long.py`` trains
on), as one mono sample: about 90k tokens, 18k of them the policy's. The engine scores it with
:meth:`PolicyEngine.probe` (one prefill of the whole continuation, the call information gain
uses); the learner with :meth:`Learner.log_probs` (veRL's forward, fp32, the chunked head), as
``turnstile train`` recomputes its proximal log-probs. Per policy token, with ``e`` the engine's
log-prob and ``l`` the learner's, ``r = exp(l - e)`` is veRL's rollout importance ratio:

- the difference ``e - l`` (mean, mean absolute, max absolute);
- k1 = mean(e - l) and k3 = mean(r - 1 - log r), veRL's ``rollout_corr/kl`` and ``k3_kl``
  estimates of KL(engine || learner);
- quantiles of r;

each over the turns of a range (0-9, 10-49, ...), to show how they grow with position.

What is not measured: the engine's decode path. A rollout's log-probs come from decoding one token
at a time against a KV cache; a probe's from one prefill. The two use different kernels, so on a
GPU the sampled gap can differ from this one; ``turnstile train`` measures the sampled gap every
step (``learner/rollout_corr/kl``).

Resumable: each finished row (engine, dtype) is appended to ``--out`` and not run again.

    .venv/bin/python benchmarks/mismatch.py [--engines hf:float32,hf:bfloat16,vllm:float32,vllm:bfloat16] [--turns 200]
    .venv/bin/python benchmarks/mismatch.py --report-only
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
from pathlib import Path

import torch

from turnstile.learner.batch import Sample

BINS = ((0, 10), (10, 50), (50, 100), (100, 150), (150, 200))
QUANTILES = (0.001, 0.5, 0.999)


def turn_index(mask: list[int]) -> list[int]:
    """For each response token, the index of the turn (run of policy tokens) it belongs to, or of
    the turn whose tool result it is (observation tokens)."""
    index, turn, previous = [], -1, 0
    for bit in mask:
        if bit and not previous:
            turn += 1
        index.append(turn)
        previous = bit
    return index


def engine_log_probs(kind: str, dtype: str, model: str, sample: Sample) -> list[float]:
    """The engine's teacher-forced log-probs of every response token of ``sample``."""
    from turnstile.rollout.engines.config import EngineConfig
    from turnstile.rollout.engines.registry import build_engine

    length = len(sample.prompt_ids) + len(sample.response_ids)
    engine = build_engine(EngineConfig(kind=kind, model=model, dtype=dtype, max_model_len=length + 16))

    async def score() -> list[float]:
        start = getattr(engine, "start", None)
        if start is not None:
            await start()
        try:
            probe = await engine.probe(sample.prompt_ids, sample.response_ids, (0, len(sample.response_ids)))
            return list(probe.logprobs)
        finally:
            await engine.aclose()

    return asyncio.run(score())


def learner_log_probs(model: str, sample: Sample) -> list[float]:
    import ray
    from learner_long import MAX_LENGTH  # benchmarks/, on the path of a script run from there

    from turnstile.cluster.jobs.session import RayConfig, init_ray
    from turnstile.learner.trainer import Learner, LearnerConfig

    init_ray(RayConfig(num_cpus=4))
    learner = Learner(LearnerConfig(model=model, mini_batch=1, micro_batch=1, max_length=MAX_LENGTH,
                                    num_cpus_per_worker=1)).start()
    try:
        return learner.log_probs([sample])[0, :len(sample.response_ids)].tolist()
    finally:
        learner.close()
        ray.shutdown()


def gap(engine: list[float], learner: list[float], mask: list[int], turns: list[int]) -> list[dict[str, float]]:
    """The gap's statistics per range of turns, over the policy tokens."""
    e, lp = torch.tensor(engine, dtype=torch.float64), torch.tensor(learner, dtype=torch.float64)
    turn = torch.tensor(turns)
    policy = torch.tensor(mask, dtype=torch.bool)
    position = torch.arange(len(mask))
    rows = []
    for low, high in (*BINS, (0, 200)):
        keep = policy & (turn >= low) & (turn < high)
        if not keep.any():
            continue
        diff = (e - lp)[keep]
        log_ratio = -diff
        ratio = log_ratio.exp()
        quantiles = torch.quantile(ratio, torch.tensor(QUANTILES, dtype=torch.float64)).tolist()
        # the same gap on the tokens the learner is unsure of (p < 0.9): the gap of a token grows
        # with its distribution's spread, so this separates position from confidence
        unsure = keep & (lp < math.log(0.9))
        unsure_ratio = (lp - e)[unsure].exp()
        rows.append({"turns": f"{low}-{high - 1}" if (low, high) in BINS else "all", "tokens": int(keep.sum()),
                     "learner_mean": lp[keep].mean().item(), "unsure": int(unsure.sum()),
                     "k3_unsure": (unsure_ratio - 1 - unsure_ratio.log()).mean().item() if unsure.any() else None,
                     "positions": [int(position[keep].min()), int(position[keep].max())],
                     "diff_mean": diff.mean().item(), "diff_abs_mean": diff.abs().mean().item(),
                     "diff_abs_max": diff.abs().max().item(), "k1": diff.mean().item(),
                     "k3": (ratio - 1 - log_ratio).mean().item(),
                     "ratio_p001": quantiles[0], "ratio_p50": quantiles[1], "ratio_p999": quantiles[2],
                     "ratio_min": ratio.min().item(), "ratio_max": ratio.max().item()})
    return rows


def report(rows: list[dict[str, object]]) -> str:
    lines = ["| model | engine | turns | response positions | policy tokens | learner's mean log-prob | mean e - l | "
             "mean abs | max abs | k1 | k3 | ratio p0.1% | p50 | p99.9% | min | max | tokens p < 0.9 | k3 on them |",
             "|---" * 18 + "|"]
    for row in rows:
        for b in row["bins"]:  # type: ignore[attr-defined]
            lines.append(f"| {row['model']} | {row['engine']} {row['dtype']} | {b['turns']} | "
                         f"{b['positions'][0]:,}-{b['positions'][1]:,} | {b['tokens']:,} | "
                         + (f"{b['learner_mean']:.3f}" if "learner_mean" in b else "-")
                         + f" | {b['diff_mean']:.2e} | "
                         f"{b['diff_abs_mean']:.2e} | "
                         f"{b['diff_abs_max']:.3f} | {b['k1']:.2e} | {b['k3']:.2e} | {b['ratio_p001']:.4f} | "
                         f"{b['ratio_p50']:.4f} | {b['ratio_p999']:.4f} | {b['ratio_min']:.3f} | "
                         f"{b['ratio_max']:.3f} | {b.get('unsure', '-')} | "
                         + (f"{b['k3_unsure']:.2e} |" if b.get("k3_unsure") is not None else "- |"))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default="hf:float32,hf:bfloat16,vllm:float32,vllm:bfloat16",
                        help="comma-separated kind:dtype")
    parser.add_argument("--turns", type=int, default=200)
    parser.add_argument("--model", default="tiny-qwen3-mixed", help="the warm start of turnstile train")
    parser.add_argument("--out", default="runs/mismatch.jsonl")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    rows = [json.loads(line) for line in out.read_text().splitlines()] if out.is_file() else []
    if not args.report_only:
        from learner_long import length, long_samples

        from turnstile.rollout.model_store import resolve_model

        model = resolve_model(args.model)
        (sample,) = long_samples([args.turns], model).values()
        turns = turn_index(sample.response_mask)
        done = {(r["engine"], r["dtype"], r["turns"], r["model"]) for r in rows}
        todo = [tuple(spec.split(":")) for spec in args.engines.split(",")]
        todo = [(k, d) for k, d in todo if (k, d, args.turns, args.model) not in done]
        if todo:
            learner = learner_log_probs(model, sample)
            for kind, dtype in todo:
                engine = engine_log_probs(kind, dtype, model, sample)
                bins = gap(engine, learner, sample.response_mask, turns)
                assert all(math.isfinite(b["k3"]) for b in bins)
                row = {"engine": kind, "dtype": dtype, "turns": args.turns, "model": args.model,
                       "tokens": length(sample), "bins": bins}
                rows.append(row)
                out.parent.mkdir(parents=True, exist_ok=True)
                with out.open("a") as file:
                    file.write(json.dumps(row) + "\n")
                print(f"{kind} {dtype}: all turns k1 {bins[-1]['k1']:.2e} k3 {bins[-1]['k3']:.2e} "
                      f"ratio max {bins[-1]['ratio_max']:.3f}", flush=True)
    print(report(rows))


if __name__ == "__main__":
    main()
