"""The papers' ablations in miniature: arms of ``turnstile train`` from the same warm start, at the
same sample budget, several seeds each, with held-out accuracy before and after.

Every arm is the embedded default (``examples/train.yaml``: the warm start ``tiny-qwen3-mixed``, 10
steps of 8 tasks × 4 samples, all 110 held-out tasks) plus its own overrides (:data:`ARMS`) and the
campaign's (the trailing ``key=value`` arguments, e.g. another budget), with an evaluation before
the first update, every 5 steps and after the last. A seed sets the learner's seed (the order
of the training tasks and of the mini-batches; seed 0 is the default run).

Resumable, across machines: each (arm, seed) trains in ``OUT/<arm>/seed<k>``; after every finished
run (its ``run.json`` at the last step with the final evaluation) its summary goes into the record
(``--record``, committed: ``docs/benchmarks/learning-runs.json``) and the table is rewritten (with
``--doc``, the Markdown table and the PNG of the curves). A run in the record or finished in ``OUT``
is not rerun; an unfinished one continues from its checkpoint (``resume=true``). A killed campaign
loses at most one run; a fresh clone keeps every run whose summary was committed.

    .venv/bin/python benchmarks/learning.py [--arms grpo,igpo] [--seeds 3] [--out runs/learning] [key=value ...]
    .venv/bin/python benchmarks/learning.py --report-only --doc docs/benchmarks/learning.md
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

from omegaconf import OmegaConf

from turnstile.cluster.jobs.defaults import MULTIHOP_TASKS
from turnstile.rollout.model_store import BUILD_INFO, ITER_MODEL, MULTIHOP_MODEL
from turnstile.rollout.trajectory import load_trajectories

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train.yaml"
RECORD = ROOT / "docs" / "benchmarks" / "learning-runs.json"
# The hard split: the name two relations away (two pages to read, five turns); the warm start was
# fine-tuned on one relation only.
HARD_MIX = "{min_hops: 2, max_hops: 2, entity_answer_fraction: 1.0, aggregation_fraction: 0.0, count: 1200}"
HARD = f"rollout.data.options={HARD_MIX}"
HARD_EVAL = f"eval_data.options={HARD_MIX}"
IG = "rewards=[{kind: exact_match}, {kind: format}, {kind: information_gain}]"
CLUES = "rewards=[{kind: exact_match}, {kind: format}, {kind: clue_steps}]"

# An iter_research turn writes its <report> besides the think and the call: at the default's 160
# new tokens a turn, 18% of the warm start's rounds are cut (median 132 tokens, 90th percentile 157).
ITER = ["rollout.context.kind=iter_research", "estimator.kind=gspo_round", "learner.loss=gspo"]

# The multi-hop comparison (issue 36): two- and three-hop chains (seven turns at most for the expert,
# eight allowed), 2,000 questions so that ~180 are held out (one evaluation within about ±5 points at
# 15%), from tiny-qwen3-multihop, 20 steps, evaluations at steps 0, 10 and 20.
MULTIHOP_MIX = json.dumps(MULTIHOP_TASKS)  # the split the warm start was built for (cluster/jobs/defaults.py)
MULTIHOP = [f"rollout.data.options={MULTIHOP_MIX}", f"eval_data.options={MULTIHOP_MIX}",
            "rollout.episode.env.max_turns=8", "rollout.episode.context_budget=4096", "steps=20", "eval_every=10"]
MULTIHOP_ARMS = ("mh_grpo", "mh_igpo", "mh_igpo_every", "mh_abc_grpo", "mh_grpo_unanswered0", "mh_igpo_unanswered0",
                 "mh_igpo_unanswered0_live", "mh_grpo_seqmean", "mh_abc_grpo_seqmean", "mh_igpo_seqmean",
                 "mh_grpo_placebo", "mh_grpo_lr3e5", "mh_abc_grpo_lr3e5", "mh_igpo_lr3e5", "mh_igpo_every_lr3e5")
# The fix tried from the first runs' reading (item 4): in a group whose answers are all wrong, the
# format rule's -1 for an episode the turn limit cut was the only spread, and GRPO learnt to answer
# sooner. These arms score a cut episode 0, as a wrong answer (docs/algorithms.md §3).
UNANSWERED0 = "estimator.options={penalise_unanswered: false}"
# The fix tried from the third build's first runs (GRPO and ABC-GRPO both lost accuracy): with the
# token-mean loss a sample weighs by its tokens, and in groups that are mostly wrong the long failed
# episodes carry the negative advantages, so the update lowers the likelihood of the sampled text
# overall (token-weighted mean advantage -0.10 a step in the multi-hop runs, negative at 17-20 of 20
# steps, against -0.03 and 6 of 10 in the default's one-hop run). seq-mean-token-mean weighs every
# sample the same, where the group normalisation makes the advantages sum to zero.
SEQMEAN = "learner.loss_agg_mode=seq-mean-token-mean"
# GRPO with seq-mean fell as far (11.3 -> 2.6%, seed 0), and its wrong answers were ever more often
# names no page showed (40 -> 83 of 195): what the default's one-hop warm start did under updates
# that carry noise and no signal (the placebo of "Noise, not a sign error"). The same control here:
# each group's outcomes shuffled among its samples (benchmarks/placebo.py; the format rule stays),
# and the same runs at a third of the step size.
PLACEBO = 'rewards=[{kind: exact_match}, {kind: format}, {kind: "benchmarks.placebo:ShuffledOutcomes"}]'
LOW_LR = "learner.lr=3e-5"
# Whom each multi-hop arm is compared with after the last step: GRPO under the same outcome rule and loss.
BASELINE = {"mh_igpo_unanswered0": "mh_grpo_unanswered0", "mh_igpo_unanswered0_live": "mh_grpo_unanswered0",
            "mh_abc_grpo_seqmean": "mh_grpo_seqmean", "mh_igpo_seqmean": "mh_grpo_seqmean",
            "mh_abc_grpo_lr3e5": "mh_grpo_lr3e5", "mh_igpo_lr3e5": "mh_grpo_lr3e5",
            "mh_igpo_every_lr3e5": "mh_grpo_lr3e5"}
# The comparison the issue asks for, at the step size where GRPO holds (learning rate 3e-5): drawn per
# step in its own figure (:func:`plot_detail`).
COMPARISON = ("mh_grpo_lr3e5", "mh_abc_grpo_lr3e5", "mh_igpo_lr3e5", "mh_igpo_every_lr3e5")

# The fault drill (issue 37): the toolbox fails 30% of the tool calls as an unavailable service would
# (the environment's fault), with no retry (with the default 3 attempts only 2.7% of calls would
# fail, and cached results never do); the default masks the episodes the environment decided,
# ``keep`` trains them as the wrong answers they look like.
FAULTS = ["rollout.tools.toolbox.inject_failure_rate=0.3", "rollout.tools.toolbox.max_attempts=1"]

# Off-policy gaps (issue 50): the default job, sync or async (staleness 1), fp32 or bf16 engines, with
# and without veRL's rollout correction (token TIS at 2, decoupled: the proximal log-probs recomputed).
BF16 = "rollout.engine.dtype=bfloat16"
ASYNC = ["mode=async", "staleness=1"]
TIS = ["learner.recompute_old_log_probs=true", "learner.rollout_correction.rollout_is=token"]
OFFPOLICY_ARMS = ("op_sync_fp32", "op_sync_bf16", "op_sync_bf16_tis", "op_async", "op_async_tis")

ARMS: dict[str, tuple[str, list[str]]] = {
    "grpo": ("GRPO, mono context (the default)", []),
    "igpo": ("IGPO: browse-aware IG, IG-Scale, turn format penalty", [IG, "estimator.kind=igpo"]),
    # Pooled step scores (norm=joint), as these runs were made: the default is now norm=separate,
    # docs/algorithms.md §6.
    "abc_grpo": ("ABC-GRPO, heuristic clue judge", [CLUES, "estimator.kind=abc_grpo",
                                                     "estimator.options={norm: joint}"]),
    "mono_gspo": ("mono context, GSPO loss", ["learner.loss=gspo"]),
    "iter_research_gspo": ("iter_research, round-level GSPO (from tiny-qwen3-iter), 256 tokens a turn", [
        *ITER, "rollout.episode.max_new_tokens=256"]),
    "iter_research_gspo_160": ("iter_research, round-level GSPO (from tiny-qwen3-iter), 160 tokens a turn", ITER),
    # A step's ~100 rounds make 3 mini-batches of 32, so 3 Adam steps where mono's 32 samples make 1:
    # the later ones on ratios the first moved out of GSPO's narrow clip range.
    "iter_research_gspo_mb64": ("iter_research, round-level GSPO (from tiny-qwen3-iter), 256 tokens a turn, "
                                "mini-batches of 64 rounds", [*ITER, "rollout.episode.max_new_tokens=256",
                                                              "learner.mini_batch=64"]),
    "mono_gspo_iter": ("mono context, GSPO loss (from tiny-qwen3-iter)", ["learner.loss=gspo"]),
    "grpo_hard": ("GRPO on the hard split (2 hops)", [HARD, HARD_EVAL]),
    "igpo_hard": ("IGPO on the hard split (2 hops)", [HARD, HARD_EVAL, IG, "estimator.kind=igpo"]),
    "grpo_faults30": ("GRPO, 30% of tool calls failed by the environment, its episodes masked (the default)",
                      FAULTS),
    "grpo_faults30_keep": ("GRPO, 30% of tool calls failed by the environment, every episode trained "
                           "(environment_faults=keep)", [*FAULTS, "environment_faults=keep"]),
    "mh_grpo": ("multi-hop: GRPO", MULTIHOP),
    "mh_igpo": ("multi-hop: IGPO (browse-aware IG, IG-Scale, turn format penalty)",
                [*MULTIHOP, IG, "estimator.kind=igpo"]),
    "mh_igpo_every": ("multi-hop: IG at every turn boundary (ig_tools=[])",
                      [*MULTIHOP, IG, "estimator.kind=igpo", "estimator.options={ig_tools: []}"]),
    "mh_abc_grpo": ("multi-hop: ABC-GRPO, heuristic clue judge", [*MULTIHOP, CLUES, "estimator.kind=abc_grpo"]),
    "mh_grpo_unanswered0": ("multi-hop: GRPO, a cut episode scored as a wrong answer (penalise_unanswered=false)",
                            [*MULTIHOP, UNANSWERED0]),
    "mh_igpo_unanswered0": ("multi-hop: IGPO, a cut episode scored as a wrong answer (penalise_unanswered=false)",
                            [*MULTIHOP, IG, "estimator.kind=igpo", UNANSWERED0]),
    # ... and no information gain for a tool call that failed (reading 2 of the same diagnosis)
    "mh_igpo_unanswered0_live": ("multi-hop: IGPO, a cut episode scored as a wrong answer, no IG for a failed call",
                                 [*MULTIHOP, IG, "estimator.kind=igpo",
                                  "estimator.options={penalise_unanswered: false, credit_failed_calls: false}"]),
    "mh_grpo_seqmean": ("multi-hop: GRPO, every sample weighing the same in the loss (seq-mean-token-mean)",
                        [*MULTIHOP, SEQMEAN]),
    "mh_abc_grpo_seqmean": ("multi-hop: ABC-GRPO, every sample weighing the same in the loss",
                            [*MULTIHOP, CLUES, "estimator.kind=abc_grpo", SEQMEAN]),
    "mh_igpo_seqmean": ("multi-hop: IGPO, every sample weighing the same in the loss",
                        [*MULTIHOP, IG, "estimator.kind=igpo", SEQMEAN]),
    "mh_grpo_placebo": ("multi-hop: GRPO on each group's outcomes shuffled (placebo)", [*MULTIHOP, PLACEBO]),
    "mh_grpo_lr3e5": ("multi-hop: GRPO, learning rate 3e-5", [*MULTIHOP, LOW_LR]),
    "mh_abc_grpo_lr3e5": ("multi-hop: ABC-GRPO, learning rate 3e-5",
                          [*MULTIHOP, CLUES, "estimator.kind=abc_grpo", LOW_LR]),
    "mh_igpo_lr3e5": ("multi-hop: IGPO (browse-aware IG, IG-Scale, turn format penalty), learning rate 3e-5",
                      [*MULTIHOP, IG, "estimator.kind=igpo", LOW_LR]),
    "mh_igpo_every_lr3e5": ("multi-hop: IG at every turn boundary (ig_tools=[]), learning rate 3e-5",
                            [*MULTIHOP, IG, "estimator.kind=igpo", "estimator.options={ig_tools: []}", LOW_LR]),
    "op_sync_fp32": ("off-policy: sync, fp32 engines (the default)", []),
    "op_sync_bf16": ("off-policy: sync, bf16 engines, uncorrected", [BF16]),
    "op_sync_bf16_tis": ("off-policy: sync, bf16 engines, token TIS (decoupled)", [BF16, *TIS]),
    "op_async": ("off-policy: async (staleness 1), fp32 engines, uncorrected", ASYNC),
    "op_async_tis": ("off-policy: async (staleness 1), fp32 engines, token TIS (decoupled)", [*ASYNC, *TIS]),
}
# The arms that start from another model than the warm start, built once into OUT/models/NAME
# (`turnstile build-model NAME`, resumable). The warm start never writes the <report> an
# iter_research turn must carry, so every turn of it is malformed there (measured: 0.0% format and
# accuracy at step 0, 110 episodes) and no estimator has a signal; mono vs iter_research is compared
# from tiny-qwen3-iter, which writes both.
ARM_MODELS = {arm: ITER_MODEL for arm in ("iter_research_gspo", "iter_research_gspo_160", "iter_research_gspo_mb64",
                                          "mono_gspo_iter")} | {arm: MULTIHOP_MODEL for arm in MULTIHOP_ARMS}


def finished(out: Path) -> bool:
    """Whether the run in ``out`` reached its last step (``steps`` in its ``config.yaml``) with its
    step-0 and final evaluations: a run killed after the step-0 evaluation has both rows at step 0."""
    state, config = out / "run.json", out / "config.yaml"
    if not (state.is_file() and config.is_file()):
        return False
    data = json.loads(state.read_text())
    history = data.get("history", [])
    steps = int(OmegaConf.load(config).get("steps", -1))
    return bool(history) and "eval/accuracy" in history[-1] and history[-1]["step"] == data["step"] == steps and \
        any(row["step"] == 0 for row in history)


def train(arm: str, seed: int, out: Path, extra: list[str]) -> float:
    """One (arm, seed) run to its end; returns the wall seconds this call took."""
    # The seed is the learner's (the order of the training tasks and of the mini-batches); sampling
    # stays unseeded: per-request seeds crash vLLM's CPU build when a seeded prompt's prefill is
    # chunked ("CPU Generator does not use offset"), which the default's contexts reach.
    overrides = ["eval_every=5", *ARMS[arm][1], f"learner.seed={seed}", f"out={out}", "resume=true", *extra]
    log = out.parent / f"seed{seed}.log"
    out.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as sink:
        if arm in ARM_MODELS:  # built before the clock starts: the wall time is the run's
            model = out.parent.parent / "models" / ARM_MODELS[arm]
            if not (model / BUILD_INFO).is_file():
                subprocess.run([str(Path(sys.executable).parent / "turnstile"), "build-model", ARM_MODELS[arm],
                                "--out", str(model), "--no-progress"], check=True, cwd=ROOT, stdout=sink,
                               stderr=subprocess.STDOUT)
            overrides.insert(1, f"rollout.engine.model={model.resolve()}")
        started = time.monotonic()
        subprocess.run([str(Path(sys.executable).parent / "turnstile"), "train", "--config", str(EXAMPLE),
                        "--no-progress", *overrides], check=True, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT)
    seconds = time.monotonic() - started
    (out / "wall_s.txt").write_text(f"{seconds + _previous_wall(out):.1f}\n")
    return seconds


def _previous_wall(out: Path) -> float:
    path = out / "wall_s.txt"
    return float(path.read_text()) if path.is_file() else 0.0


def run_summary(out: Path) -> dict[str, object]:
    """What one finished run measured: accuracy per evaluation, browse ratio of correct and wrong
    final-evaluation trajectories, turns per episode, wall time."""
    from turnstile.cluster.jobs.metrics import browse_ratio
    from turnstile.rollout.summary import is_correct

    data = json.loads((out / "run.json").read_text())
    evals = {int(row["step"]): row["eval/accuracy"] for row in data["history"] if "eval/accuracy" in row}
    last = max(evals)
    final = load_trajectories(out / "eval" / f"step{last}.jsonl")
    right = [t for t in final if is_correct(t)]
    wrong = [t for t in final if not is_correct(t)]
    # (an async run writes no rollouts/: its scored/step<k>.jsonl holds the same batch, scored)
    batches = sorted((out / "rollouts").glob("step*.jsonl")) or sorted((out / "scored").glob("step*.jsonl"))
    by_step = {int(path.stem[4:]): load_trajectories(path) for path in batches}
    trained = [t for batch in by_step.values() for t in batch]
    return {"evals": evals, "browse_correct": browse_ratio(right) if right else None,
            "browse_wrong": browse_ratio(wrong) if wrong else None,
            "turns": statistics.fmean(len(t.turns) for t in trained) if trained else 0.0,
            # per training step (``rollouts/step<k>.jsonl`` is what step k + 1 trained on), the
            # turns per episode of its batch
            "turns_by_step": {step + 1: statistics.fmean(len(t.turns) for t in batch)
                              for step, batch in by_step.items() if batch},
            "format": {int(row["step"]): row["eval/format_rate"] for row in data["history"]
                       if "eval/format_rate" in row},
            # per training step, the share of groups whose samples all got the same outcome
            "uniform": {int(row["step"]): row["reward/uniform_groups"] for row in data["history"]
                        if "reward/uniform_groups" in row},
            # per training step, the share of groups with no correct sample
            "all_wrong": {int(row["step"]): row["reward/all_wrong_groups"] for row in data["history"]
                          if "reward/all_wrong_groups" in row},
            # per evaluation, accuracy by the questions' hop count
            "hops": {int(row["step"]): {key.removeprefix("eval/accuracy_hops"): value for key, value in row.items()
                                        if key.startswith("eval/accuracy_hops")}
                     for row in data["history"] if "eval/accuracy" in row},
            # per training step, the episodes the environment decided and those left out of the loss
            "environment": {int(row["step"]): [row.get("rollout/environment_decided", 0.0),
                                               row.get("rollout/environment_left_out", 0.0)]
                            for row in data["history"] if "reward/mean" in row},
            # per training step, the off-policy gap the learner saw and how fast the run went
            # (``rollout_corr/*``: veRL's estimates of KL(engine || learner) on the step's tokens)
            "offpolicy": {int(row["step"]): {name: row[key] for name, key in OFFPOLICY_FIELDS.items() if key in row}
                          for row in data["history"] if row.get("learner/trained")},
            "wall_s": _previous_wall(out)}


OFFPOLICY_FIELDS = {"kl": "learner/rollout_corr/kl", "k3_kl": "learner/rollout_corr/k3_kl",
                    "ratio_max": "learner/mismatch/ratio_max", "clipped": "learner/mismatch/clipped",
                    "is_weight_max": "learner/correction/is_weight_max",
                    "truncated": "learner/correction/truncated", "staleness": "staleness/mean",
                    "tokens_per_s": "throughput/tokens_per_s", "step_s": "time/step_s"}


# keyed by step
STEP_FIELDS = ("evals", "format", "uniform", "all_wrong", "hops", "environment", "turns_by_step", "offpolicy")


def load_record(record: Path) -> dict[str, dict[int, dict[str, object]]]:
    """Arm -> seed -> run summary, as committed (JSON keys are strings; steps and seeds come back as ints)."""
    if not record.is_file():
        return {}
    raw = json.loads(record.read_text())
    return {arm: {int(seed): {**run, **{field: {int(k): v for k, v in run.get(field, {}).items()}
                                        for field in STEP_FIELDS}}
                  for seed, run in seeds.items()} for arm, seeds in raw.items()}


def report(root: Path, doc: Path | None, record: Path) -> dict[str, dict[str, Any]]:
    """Adds the runs finished in ``root`` to the record, rewrites it, and the table from it."""
    summaries = load_record(record)
    for arm in ARMS:
        for path in sorted((root / arm).glob("seed*")):
            if path.is_dir() and finished(path):
                summaries.setdefault(arm, {})[int(path.name[4:])] = run_summary(path)
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps({arm: {str(seed): run for seed, run in sorted(seeds.items())}
                                  for arm, seeds in summaries.items()}, indent=1) + "\n")
    results = {arm: {"label": ARMS[arm][0], "seeds": summaries[arm]} for arm in ARMS if summaries.get(arm)}
    onehop = {arm: entry for arm, entry in results.items() if arm not in (*MULTIHOP_ARMS, *OFFPOLICY_ARMS)}
    multihop = {arm: entry for arm, entry in results.items() if arm in MULTIHOP_ARMS}
    offpolicy = {arm: entry for arm, entry in results.items() if arm in OFFPOLICY_ARMS}
    lines, multihop_lines, offpolicy_lines = table(onehop), multihop_table(multihop), offpolicy_table(offpolicy)
    print("\n".join([*lines, "", *multihop_lines, "", *offpolicy_lines]))
    if doc is not None:
        plot(onehop, doc.with_suffix(".png"), "the ablations in miniature")
        text = doc.read_text() if doc.is_file() else "# Learning\n"
        text = _replace_between(text, "<!-- learning-table -->", lines)
        if multihop:
            plot(multihop, doc.with_name(doc.stem + "-multihop.png"), "two- and three-hop questions")
            compared = {arm: multihop[arm] for arm in COMPARISON if arm in multihop}
            if compared:
                plot_detail(compared, doc.with_name(doc.stem + "-multihop-arms.png"),
                            "two- and three-hop questions, learning rate 3e-5")
            text = _replace_between(text, "<!-- multihop-table -->", multihop_lines)
        if offpolicy:
            text = _replace_between(text, "<!-- offpolicy-table -->", offpolicy_lines)
        doc.write_text(text)
    return results


def _replace_between(text: str, marker: str, lines: list[str]) -> str:
    """``text`` with what lies between the two ``marker`` lines replaced by ``lines`` (appended with
    its markers when the text has none)."""
    if marker not in text:
        text = f"{text.rstrip()}\n\n{marker}\n{marker}\n"
    head, _, rest = text.partition(marker)
    _, _, tail = rest.partition(marker)
    return f"{head}{marker}\n" + "\n".join(lines) + f"\n{marker}{tail}"


def _mean_std(values: list[float]) -> str:
    if not values:
        return "-"
    spread = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values) * 100:.1f} ± {spread * 100:.1f}"


def table(results: dict[str, dict[str, Any]]) -> list[str]:
    lines = ["| arm | seeds | held-out accuracy % before | after | change (points) | format % after | "
             "browse ratio correct / wrong | turns per episode | wall per run (min) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for arm, entry in results.items():
        runs = list(entry["seeds"].values())
        before = [r["evals"][0] for r in runs]
        after = [r["evals"][max(r["evals"])] for r in runs]
        change = [b - a for a, b in zip(before, after, strict=True)]
        fmt = [r["format"][max(r["format"])] for r in runs]
        browse_c = [r["browse_correct"] for r in runs if r["browse_correct"] is not None]
        browse_w = [r["browse_wrong"] for r in runs if r["browse_wrong"] is not None]
        browse = (f"{statistics.fmean(browse_c):.2f} / " if browse_c else "- / ") + \
            (f"{statistics.fmean(browse_w):.2f}" if browse_w else "-")
        lines.append(f"| {arm}: {entry['label']} | {len(runs)} | {_mean_std(before)} | {_mean_std(after)} | "
                     f"{_mean_std(change)} | {_mean_std(fmt)} | {browse} | "
                     f"{statistics.fmean(r['turns'] for r in runs):.1f} | "
                     f"{statistics.fmean(r['wall_s'] for r in runs) / 60:.1f} |")
    return lines


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile (p > 0.5) of Student's t with ``df`` degrees of freedom (fractional, as
    Welch's are): bisection on the CDF, integrated with Simpson's rule. No SciPy here for one number."""
    scale = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def cdf(x: float, n: int = 2000) -> float:
        h = x / n
        total = sum((1 if i in (0, n) else 4 if i % 2 else 2) * (1 + (i * h) ** 2 / df) ** (-(df + 1) / 2)
                    for i in range(n + 1))
        return 0.5 + scale * total * h / 3

    low, high = 0.0, 1000.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if cdf(middle) < p else (low, middle)
    return (low + high) / 2


def welch_interval(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """``mean(a) - mean(b)`` and its 95% Welch interval (unequal variances, Welch-Satterthwaite
    degrees of freedom); the interval is the point itself when neither sample varies."""
    va, vb = statistics.variance(a) / len(a), statistics.variance(b) / len(b)
    difference = statistics.fmean(a) - statistics.fmean(b)
    if va + vb == 0:
        return difference, difference, difference
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    half = t_quantile(0.975, df) * math.sqrt(va + vb)
    return difference, difference - half, difference + half


def _by_hops(runs: list[dict[str, Any]], *, first: bool) -> str:
    """Two-hop / three-hop held-out accuracy at each run's first (or last) evaluation, over the seeds."""
    by_hops = [r["hops"].get(min(r["evals"]) if first else max(r["evals"]), {}) for r in runs]
    return " / ".join(_mean_std([h[n] for h in by_hops if n in h]) for n in ("2", "3"))


def multihop_table(results: dict[str, dict[str, Any]]) -> list[str]:
    """The multi-hop comparison: each arm's held-out accuracy before and after, by hop count, its
    difference from GRPO under the same outcome rule (``BASELINE``; the fixed GRPO against the
    first) after the last step with the 95% Welch interval over seeds, and the share of
    training groups with no correct sample and of those whose samples all got the same outcome (the
    outcome reward's, before the estimator's format rule; mean over steps and seeds)."""
    lines = ["| arm | seeds | held-out % before | after | before, 2 / 3 hops | after, 2 / 3 hops | "
             "vs GRPO after (points, 95% Welch) | all-wrong groups % | same-outcome groups % | turns per episode | "
             "wall per run (min) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    finals = {arm: [r["evals"][max(r["evals"])] for r in entry["seeds"].values()]
              for arm, entry in results.items()}
    for arm, entry in results.items():
        grpo = finals.get(BASELINE.get(arm, "mh_grpo"), [])
        runs = list(entry["seeds"].values())
        before = [r["evals"][0] for r in runs]
        versus = "-"
        if arm not in ("mh_grpo", *BASELINE.values()) and len(grpo) >= 2 and len(finals[arm]) >= 2:
            difference, low, high = welch_interval(finals[arm], grpo)
            versus = f"{difference * 100:+.1f} [{low * 100:+.1f}, {high * 100:+.1f}]"
        uniform = [value for r in runs for value in r.get("uniform", {}).values()]
        all_wrong = [value for r in runs for value in r.get("all_wrong", {}).values()]
        lines.append(f"| {arm}: {entry['label']} | {len(runs)} | {_mean_std(before)} | {_mean_std(finals[arm])} | "
                     f"{_by_hops(runs, first=True)} | {_by_hops(runs, first=False)} | {versus} | "
                     f"{_mean_std(all_wrong)} | {_mean_std(uniform)} | "
                     f"{statistics.fmean(r['turns'] for r in runs):.1f} | "
                     f"{statistics.fmean(r['wall_s'] for r in runs) / 60:.1f} |")
    return lines


def _step_mean(steps: list[dict[str, float]], name: str, scale: float = 1.0, fmt: str = ".2g") -> str:
    values = [step[name] for step in steps if name in step]
    return format(statistics.fmean(values) * scale, fmt) if values else "-"


def _run_rate(runs: list[dict[str, Any]]) -> str:
    """Generated training tokens per second of the whole run, mean over seeds."""
    rates = [sum(step["tokens_per_s"] * step["step_s"] for step in r["offpolicy"].values()) / r["wall_s"]
             for r in runs if r.get("offpolicy") and r.get("wall_s")]
    return f"{statistics.fmean(rates):.0f}" if rates else "-"


def offpolicy_table(results: dict[str, dict[str, Any]]) -> list[str]:
    """The off-policy arms: held-out accuracy before and after with the change's 95% t interval over
    seeds, the after's difference from sync fp32 (95% Welch), and per training step (mean over
    steps and seeds, max for maxima) veRL's mismatch KL (k1, k3), the largest importance ratio, the
    share of tokens the correction truncated, the staleness, and the tokens the policy generated
    for training per second of the whole run (startup and evaluations included, the same measure
    for sync and async) with the wall time per run."""
    lines = ["| arm | seeds | held-out % before | after | change (points, 95% t) | vs sync fp32 after "
             "(points, 95% Welch) | mismatch KL k1 / k3 | ratio max | truncated % | staleness | "
             "generated tokens/s of run | wall per run (min) |", "|---" * 12 + "|"]
    finals = {arm: [r["evals"][max(r["evals"])] for r in entry["seeds"].values()] for arm, entry in results.items()}
    for arm, entry in results.items():
        runs = list(entry["seeds"].values())
        before = [r["evals"][0] for r in runs]
        change = [after - first for first, after in zip(before, finals[arm], strict=True)]
        interval = "-"
        if len(change) >= 2:
            half = t_quantile(0.975, len(change) - 1) * statistics.stdev(change) / math.sqrt(len(change))
            mean = statistics.fmean(change)
            interval = f"{mean * 100:+.1f} [{(mean - half) * 100:+.1f}, {(mean + half) * 100:+.1f}]"
        versus = "-"
        base = finals.get("op_sync_fp32", [])
        if arm != "op_sync_fp32" and len(base) >= 2 and len(finals[arm]) >= 2:
            difference, low, high = welch_interval(finals[arm], base)
            versus = f"{difference * 100:+.1f} [{low * 100:+.1f}, {high * 100:+.1f}]"
        steps = [step for r in runs for step in r.get("offpolicy", {}).values()]
        ratio_max = [step["ratio_max"] for step in steps if "ratio_max" in step]
        lines.append(f"| {arm}: {entry['label']} | {len(runs)} | {_mean_std(before)} | {_mean_std(finals[arm])} | "
                     f"{interval} | {versus} | {_step_mean(steps, 'kl')} / {_step_mean(steps, 'k3_kl')} | "
                     f"{format(max(ratio_max), '.2f') if ratio_max else '-'} | "
                     f"{_step_mean(steps, 'truncated', 100, '.3f')} | {_step_mean(steps, 'staleness', 1, '.2f')} | "
                     f"{_run_rate(runs)} | "
                     f"{statistics.fmean(r['wall_s'] for r in runs) / 60:.1f} |")
    return lines


def _pyplot() -> ModuleType:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--doc draws the curves with matplotlib: .venv/bin/pip install matplotlib") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


class _Axis(Protocol):  # what _curve draws on: a matplotlib Axes
    def errorbar(self, x: list[int], y: list[float], *, yerr: list[float], capsize: float, label: str,
                 **style: object) -> object: ...


Series = Callable[[dict[str, Any]], Mapping[int, float]]  # one run's step -> value


def _curve(axis: _Axis, runs: list[dict[str, Any]], value: Series, label: str, **style: object) -> None:
    """One arm's curve on ``axis``: the mean over seeds of ``value(run)`` (a step -> number mapping),
    in percent when the numbers are shares, with the spread over seeds as error bars, at the steps
    every seed has."""
    series = [value(r) for r in runs]
    steps = sorted(set.intersection(*(set(s) for s in series))) if series else []
    if not steps:
        return
    means = [statistics.fmean(s[step] for s in series) for step in steps]
    spread = [statistics.stdev([s[step] for s in series]) if len(series) > 1 else 0.0 for step in steps]
    axis.errorbar(steps, means, yerr=spread, capsize=3, label=label, **style)


def _accuracy(run: dict[str, Any]) -> dict[int, float]:
    """A run's held-out accuracy per evaluation, in percent."""
    return {step: value * 100 for step, value in run["evals"].items()}


def plot(results: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    """Held-out accuracy per evaluation, each arm's mean ± std over its seeds."""
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(7, 4.5))
    for arm, entry in results.items():
        runs = list(entry["seeds"].values())
        _curve(axis, runs, _accuracy, f"{arm} ({len(runs)} seeds)", marker="o")
    axis.set_xlabel("training step")
    axis.set_ylabel("held-out accuracy, % (mean ± std over seeds)")
    axis.set_title(f"turnstile train from the warm start: {title}")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


# What the multi-hop comparison plots per step (issue 36): the panel's title, and the step -> value
# mapping of one run it draws (percent, or turns).
DETAIL_PANELS: tuple[tuple[str, Series], ...] = (
    ("held-out accuracy, %", _accuracy),
    ("held-out accuracy, two-hop questions, %", lambda r: {s: h["2"] * 100 for s, h in r["hops"].items() if "2" in h}),
    ("held-out accuracy, three-hop questions, %",
     lambda r: {s: h["3"] * 100 for s, h in r["hops"].items() if "3" in h}),
    ("held-out turns well formed, %", lambda r: {s: v * 100 for s, v in r["format"].items()}),
    ("training groups whose samples all got the same outcome, %",
     lambda r: {s: v * 100 for s, v in r["uniform"].items()}),
    ("turns per training episode", lambda r: r["turns_by_step"]),
)


def plot_detail(results: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    """Every quantity of :data:`DETAIL_PANELS` per step, one panel each, each arm's mean ± std over
    its seeds: the figure of a comparison whose arms differ in how they credit turns."""
    plt = _pyplot()
    figure, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    for axis, (name, value) in zip(axes.flat, DETAIL_PANELS, strict=True):
        for arm, entry in results.items():
            runs = list(entry["seeds"].values())
            _curve(axis, runs, value, f"{arm} ({len(runs)} seeds)", marker="o", markersize=3)
        axis.set_title(name, fontsize=10)
        axis.set_xlabel("training step")
        axis.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    figure.suptitle(f"turnstile train from the warm start: {title} (mean ± std over seeds)")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, of: {', '.join(ARMS)} "
                        "(default: all)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", default="runs/learning")
    parser.add_argument("--doc", default="", help="also rewrite this Markdown table and its PNG")
    parser.add_argument("--record", default=str(RECORD), help="the finished runs' summaries (committed)")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = parser.parse_args()
    root = Path(args.out)
    doc = Path(args.doc) if args.doc else None
    record = Path(args.record)
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        parser.error(f"unknown arm {unknown[0]!r}; the arms are: {', '.join(ARMS)}")
    if doc is not None:
        try:
            import matplotlib  # noqa: F401 - checked before the first run, not after it
        except ImportError:
            parser.error("--doc draws the curves with matplotlib: .venv/bin/pip install matplotlib")
    if not args.report_only:
        recorded = load_record(record)  # runs finished since are caught by finished(out)
        for seed in range(args.seeds):  # seed-major: every arm gets its first seed before any its third
            for arm in arms:
                out = root / arm / f"seed{seed}"
                if finished(out) or seed in recorded.get(arm, {}):
                    continue
                print(f"{arm} seed {seed}: training in {out}", flush=True)
                try:
                    seconds = train(arm, seed, out, args.overrides)
                except subprocess.CalledProcessError as error:  # one arm's failure does not stop the rest
                    print(f"{arm} seed {seed}: failed (exit {error.returncode}); its log: "
                          f"{out.parent / f'seed{seed}.log'}", flush=True)
                    continue
                print(f"{arm} seed {seed}: done in {seconds / 60:.1f} min", flush=True)
                report(root, doc, record)
    report(root, doc, record)


if __name__ == "__main__":
    main()
