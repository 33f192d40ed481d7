"""``turnstile eval``: k samples of every question of one or more benchmarks on the rollout fleet,
judged, scored (pass@1..k, avg@k, maj@k with 95% intervals) and written as they finish.

Reads like :func:`turnstile.cluster.jobs.rollout.run_rollout`: serve the corpus, load every benchmark's tasks
(checked together before any actor starts), start the fleet (``rollout.*`` as in train: engine,
fleet, context, episode, tools, corpus, ray; ``rollout.data`` and ``rollout.group_size`` are not
used, ``benchmarks`` and ``k`` are), run the samples not yet in ``OUT/results.jsonl``, then score.

- **Outputs.** ``OUT/results.jsonl``, one line per (benchmark, question, sample), appended as each
  episode ends; ``OUT/summary.json``, per benchmark its questions, k and every score as
  ``[mean, low, high]`` (with the share of samples answered and of turns well formed); the same as a
  table on the console; ``OUT/trajectories.jsonl``, every sample's trajectory, to look at with
  ``turnstile view OUT`` (not an encrypted benchmark's); ``OUT/eval.png``, pass@k against k,
  the browse ratio of correct and wrong samples and the turns per sample.
- **Resumable.** A killed eval continues with the samples it has no line for; a line cut short by
  the kill is cut off (and its sample run again).
- **Encrypted benchmarks** (BrowseComp-ZH, xbench-DeepSearch: published encrypted so their text
  stays off the web) never put a decrypted question, gold answer or the policy's answer into a file
  or a log: their lines carry ids and a digest of the normalised answer (for the majority vote).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from turnstile.cluster.fleet.dispatch import Episode
from turnstile.cluster.jobs.defaults import default_eval_data, default_rollout
from turnstile.cluster.jobs.eval_metrics import benchmark_scores, mean_interval
from turnstile.cluster.jobs.metrics import browse_ratio
from turnstile.cluster.jobs.session import RolloutJob, fleet_session
from turnstile.cluster.jobs.synthesis import SynthesisConfig, final_report, synthesize, synthesize_with_policy
from turnstile.envs.answers import normalize_answer
from turnstile.envs.datasets.registry import DatasetConfig
from turnstile.envs.plugins import PluginSpec
from turnstile.envs.protocol import StopReason
from turnstile.envs.tasks import Task
from turnstile.rewards.apply import score_groups
from turnstile.rewards.base import build_reward
from turnstile.rollout.context import ContextConfig
from turnstile.rollout.model_store import resolve_model
from turnstile.rollout.summary import FAILED, is_correct, nothing_ran
from turnstile.rollout.trajectory import Trajectory, write_trajectory

log = logging.getLogger(__name__)
ENCRYPTED_KINDS = frozenset({"browsecomp_zh", "xbench"})  # loaders that decrypt in memory
JUDGES = ("exact_match", "f1", "llm_judge")
TRAJECTORIES = "trajectories.jsonl"  # every sample's whole trajectory (not an encrypted benchmark's)


@dataclass
class BenchmarkConfig:
    data: DatasetConfig
    name: str = ""  # in the outputs; "" = the data's kind
    # The outcome plugin that judges an answer (rewards.outcome): exact_match, f1 (its mean is
    # reported as f1@k; "correct" stays the exact match) or llm_judge (BrowseComp's grader over an
    # OpenAI-compatible endpoint; an exact match never reaches it).
    judge: PluginSpec = field(default_factory=lambda: PluginSpec("exact_match"))
    # The context manager of this benchmark's episodes (None: rollout.context). Test-time context
    # management is compared by listing a benchmark twice, named apart, with two contexts (mono,
    # discard_all with its max_resets, iter_research, budgets): each context runs on its own fleet.
    context: ContextConfig | None = None

    def __post_init__(self) -> None:
        if self.judge.kind not in JUDGES:
            raise ValueError(f"judge.kind={self.judge.kind!r} is not one of {', '.join(JUDGES)}")
        # An answer's score, not training's format penalty (a malformed answer has no answer: 0).
        self.judge = PluginSpec(self.judge.kind, {"format_penalty": False, **self.judge.options})
        build_reward(self.judge)  # its options checked now, not after the first episodes
        self.name = self.name or self.data.kind

    @property
    def encrypted(self) -> bool:
        return self.data.kind in ENCRYPTED_KINDS


def _default_benchmarks() -> list[BenchmarkConfig]:
    return [BenchmarkConfig(default_eval_data(), name="synthetic-heldout")]


@dataclass
class EvalJob:
    """One evaluation (``examples/eval.yaml``)."""

    benchmarks: list[BenchmarkConfig] = field(default_factory=_default_benchmarks)
    k: int = 4  # samples per question
    rollout: RolloutJob = field(default_factory=default_rollout)  # the policy and its environment
    synthesis: SynthesisConfig = field(default_factory=SynthesisConfig)  # synth@n (cluster.jobs.synthesis)
    out: str = "runs/eval"

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ValueError(f"k={self.k} must be >= 1 (samples per question)")
        if not self.benchmarks:
            raise ValueError("benchmarks is empty: name at least one")
        names = [b.name for b in self.benchmarks]
        if len(set(names)) != len(names):
            raise ValueError(f"benchmark names must differ (set name: for two of one kind); got {names}")


class EvalError(ValueError):
    """An evaluation that measured nothing: every sample it ran failed."""


def run_eval(cfg: EvalJob, progress: bool = True) -> dict[str, dict[str, object]]:
    """Run what ``OUT/results.jsonl`` lacks, then write and return the summary. Raises
    :class:`EvalError` when every sample this run ran failed (the rows stay, with their errors)."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    drop_partial_line(results)
    drop_partial_line(out / TRAJECTORIES)
    done = {(row["benchmark"], row["task_id"], row["sample"]) for row in read_results(results)}
    reports: dict[tuple[str, str, int], str] = {}  # this run's samples' final reports (for synth@n)
    # Whether this run measured anything: its first failed sample, and whether any other ran through
    # (not every trajectory: a long eval's would all be held until the end).
    first_failure: Trajectory | None = None
    any_ran_through = False
    started = time.monotonic()
    with fleet_session(cfg.rollout, [b.data for b in cfg.benchmarks], name=f"turnstile-eval-{uuid.uuid4().hex[:8]}",
                       events=out / "fleet.jsonl") as session:
        task_lists = session.tasks
        by_uid, tasks_by_uid = {}, {}
        episodes: list[Episode] = []
        for bench, tasks in zip(cfg.benchmarks, task_lists, strict=True):
            for task in tasks:
                uid = f"{bench.name}/{task.id}"
                by_uid[uid], tasks_by_uid[uid] = bench, task
                # a benchmark with its own context manager runs it on the same fleet
                episodes += [(task, uid, s, bench.context) if bench.context else (task, uid, s)
                             for s in range(cfg.k) if (bench.name, task.id, s) not in done]
        bar = tqdm(total=len(episodes) + len(done), initial=len(done), desc="samples", unit="ep",
                   disable=not progress)
        with results.open("a", encoding="utf-8") as sink, (out / TRAJECTORIES).open("a", encoding="utf-8") as kept:
            for finished in session.stream(session.dispatcher(episodes)):
                for trajectory in judge(finished, by_uid, tasks_by_uid):
                    if trajectory.stop_reason not in FAILED:
                        any_ran_through = True
                    elif first_failure is None:
                        first_failure = trajectory
                    report = final_report(trajectory)
                    benchmark = by_uid[trajectory.uid]
                    row = result_row(benchmark, trajectory, report)
                    reports[(benchmark.name, trajectory.task_id, trajectory.sample)] = report
                    sink.write(json.dumps(row) + "\n")
                    if not benchmark.encrypted:  # to look at: turnstile view OUT
                        write_trajectory(trajectory, kept)
                    bar.update(1)
                sink.flush()
                kept.flush()
        bar.close()
    if first_failure is not None and not any_ran_through:
        raise EvalError(nothing_ran([first_failure], "sample"))
    rows = list(read_results(results))
    summary = summarize_results(cfg, iter(rows), task_lists)
    if cfg.synthesis.enabled:
        for name, scores in run_synthesis(cfg, out, task_lists, rows, reports).items():
            summary[name].update(scores)
    write_figure(out / "eval.png", summary, rows)
    (out / "summary.json").write_text(json.dumps({"benchmarks": summary, "wall_s": time.monotonic() - started},
                                                 indent=1) + "\n")
    return summary


def judge(trajectories: list[Trajectory], benches: dict[str, BenchmarkConfig],
          tasks: dict[str, Task]) -> list[Trajectory]:
    """Each benchmark's judge over its finished samples (one sample's failure, a judge endpoint
    down say, leaves it unscored and counted wrong, with the error in its line)."""
    for name in {benches[t.uid].name for t in trajectories}:
        mine = [t for t in trajectories if benches[t.uid].name == name]
        spec = benches[mine[0].uid].judge
        asyncio.run(score_groups([spec], mine, {t.task_id: tasks[t.uid] for t in mine}))
    return trajectories


def run_synthesis(cfg: EvalJob, out: Path, task_lists: list[list[Task]], rows: list[dict],
                  reports: dict[tuple[str, str, int], str]) -> dict[str, dict[str, list[float]]]:
    """synth@n for every benchmark (``OUT/synthesis.jsonl``, resumable like the results): the
    synthesis model over the first n samples' final reports, judged by the benchmark's judge. A
    plain benchmark's reports are in its result lines; an encrypted one's only in this run's memory,
    so its questions sampled before a kill are left out (and counted in the log)."""
    path = out / "synthesis.jsonl"
    drop_partial_line(path)
    have = {(r["benchmark"], r["task_id"], r["n"]): r for r in _json_lines(path)}
    for row in rows:
        if row.get("report") is not None:
            reports.setdefault((row["benchmark"], row["task_id"], row["sample"]), row["report"])
    ns = [n for n in sorted(set(cfg.synthesis.ns)) if n <= cfg.k]
    jobs, keys = [], []
    for bench, tasks in zip(cfg.benchmarks, task_lists, strict=True):
        missing = 0
        for task in tasks:
            wanted = [n for n in ns if (bench.name, task.id, n) not in have]
            texts = [reports.get((bench.name, task.id, s)) for s in range(max(wanted, default=0))]
            found = [text for text in texts if text is not None]
            if wanted and len(found) < len(texts):
                missing += 1
                continue
            for n in wanted:
                jobs.append((task.question, found[:n]))
                keys.append((bench, task, n))
        if missing:
            log.warning("%s: %d questions have no reports for synthesis (sampled before a restart%s)", bench.name,
                        missing, "; an encrypted benchmark's reports are never written" if bench.encrypted else "")
    answers = asyncio.run(synthesizer(cfg, jobs)) if jobs else []
    with path.open("a", encoding="utf-8") as sink:
        for (bench, task, n), answer in zip(keys, answers, strict=True):
            if isinstance(answer, Exception):
                log.warning("%s/%s synth@%d: the synthesis model gave no reply (%s); left out", bench.name,
                            task.id, n, type(answer).__name__ if bench.encrypted else answer)
                continue
            uid = f"{bench.name}/{task.id}"
            verdict = Trajectory(uid=uid, sample=-n, task_id=task.id, question=task.question,
                                 answers=list(task.answers), answer=answer,
                                 stop_reason=StopReason.ANSWERED if answer else StopReason.NO_ANSWER)
            judge([verdict], {uid: bench}, {uid: task})
            row = {"benchmark": bench.name, "task_id": task.id, "n": n,
                   "answer": None if bench.encrypted else answer, "correct": is_correct(verdict)}
            have[(bench.name, task.id, n)] = row
            sink.write(json.dumps(row) + "\n")
    scores: dict[str, dict[str, list[float]]] = {}
    for bench in cfg.benchmarks:
        for n in ns:
            values = [float(r["correct"]) for (name, _, m), r in have.items() if name == bench.name and m == n]
            scores.setdefault(bench.name, {})[f"synth@{n}"] = list(mean_interval(values))
    return scores


async def synthesizer(cfg: EvalJob, jobs: list[tuple[str, list[str]]]) -> list[str | Exception | None]:
    """The configured synthesis model's answers: the endpoint's, or the evaluated policy's."""
    if cfg.synthesis.synthesizer == "policy":
        return await synthesize_with_policy(cfg.rollout.engine, resolve_model(cfg.rollout.engine.model),
                                            cfg.rollout.episode, jobs)
    return await synthesize(cfg.synthesis, jobs)


def result_row(bench: BenchmarkConfig, trajectory: Trajectory, report: str | None = None) -> dict[str, object]:
    """One sample's line of ``results.jsonl`` (no decrypted text for an encrypted benchmark);
    ``report``: its final report, when the caller has it already."""
    tools = [turn.tool for turn in trajectory.turns if turn.tool]
    answer = trajectory.answer if trajectory.answered else None
    reward_error = trajectory.metadata.get("reward_error")  # {"plugin", "error", "deliveries"}
    return {"benchmark": bench.name, "task_id": trajectory.task_id, "sample": trajectory.sample,
            "answer": None if bench.encrypted else answer,
            "answer_key": hashlib.sha256(normalize_answer(answer).encode()).hexdigest()[:16] if answer else None,
            "correct": is_correct(trajectory), "turns": len(trajectory.turns), "tool_calls": len(tools),
            "well_formed": (sum(turn.format_ok for turn in trajectory.turns) / len(trajectory.turns)
                            if trajectory.turns else 0.0),
            "browse_ratio": browse_ratio([trajectory]), "stop_reason": trajectory.stop_reason.value,
            "wall_s": round(trajectory.wall_s, 3),
            "score": trajectory.outcome if trajectory.outcome is not None else 0.0,  # the judge's
            "report": None if bench.encrypted else report or final_report(trajectory),  # for synth@n
            **({"judge_error": reward_error["error"]} if isinstance(reward_error, dict) else {}),
            **({"error": trajectory.metadata.get("error")}
               if trajectory.stop_reason in FAILED and not bench.encrypted else {})}


def drop_partial_line(path: Path) -> None:
    """Cut a last line a kill left without its newline, so the lines appended next stand alone
    (its sample runs again)."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    with path.open("rb") as file:
        file.seek(-1, 2)
        if file.read(1) == b"\n":
            return  # whole lines only: nothing to read past the last byte
    data = path.read_bytes()
    log.warning("%s: its last line was cut short (an eval killed while writing it); that sample runs again", path)
    with path.open("r+b") as file:
        file.truncate(data.rfind(b"\n") + 1)


def read_results(path: Path) -> Iterator[dict]:
    """The lines of ``results.jsonl`` so far (a line that is not a whole result is skipped)."""
    return (row for row in _json_lines(path) if {"benchmark", "task_id", "sample", "correct"} <= set(row))


def _json_lines(path: Path) -> Iterator[dict]:
    if not path.is_file():
        return
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                log.warning("%s:%d: not a whole line; its item runs again", path, number)
                continue
            if isinstance(row, dict):
                yield row


def summarize_results(cfg: EvalJob, rows: Iterator[dict], task_lists: list) -> dict[str, dict[str, object]]:
    """Per benchmark: its questions, k and the scores over the questions that have all k samples;
    with them, per question over its k samples, the share answered and the share of turns well
    formed (the protocol: a model that writes none never reaches its tools)."""
    samples: dict[tuple[str, str], dict[int, dict]] = {}
    for row in rows:
        samples.setdefault((row["benchmark"], row["task_id"]), {})[int(row["sample"])] = row
    summary = {}
    for bench, tasks in zip(cfg.benchmarks, task_lists, strict=True):
        questions, f1, answered, well_formed = [], [], [], []
        for task in tasks:
            got = samples.get((bench.name, task.id), {})
            if all(s in got for s in range(cfg.k)):
                ordered = [got[s] for s in range(cfg.k)]
                questions.append(([r["answer_key"] for r in ordered], [bool(r["correct"]) for r in ordered]))
                f1.append(sum(float(r.get("score", 0.0)) for r in ordered) / cfg.k)
                answered.append(sum(r["answer_key"] is not None for r in ordered) / cfg.k)
                well_formed.append(sum(float(r.get("well_formed", 0.0)) for r in ordered) / cfg.k)
        summary[bench.name] = {"tasks": len(questions), "k": cfg.k, **benchmark_scores(questions, cfg.k),
                               "answered": list(mean_interval(answered)),
                               "well_formed": list(mean_interval(well_formed))}
        if bench.judge.kind == "f1":
            summary[bench.name][f"f1@{cfg.k}"] = list(mean_interval(f1))
    return summary


def write_figure(path: Path, summary: dict[str, dict[str, object]], rows: list[dict]) -> None:
    """One PNG, three panels per run: pass@k against k with its interval, the browse ratio of
    correct and wrong samples (DR-Venus' figure 4), and the turns per sample."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (curve, browse, turns) = plt.subplots(1, 3, figsize=(13, 3.8))
    for name, entry in summary.items():
        scores = {key: value for key, value in entry.items() if isinstance(value, list)}  # not the counts
        ks = [int(key.split("@")[1]) for key in scores if key.startswith("pass@")]
        values = [scores[f"pass@{k}"] for k in ks]
        curve.plot(ks, [100 * v[0] for v in values], marker="o", label=name)
        curve.fill_between(ks, [100 * v[1] for v in values], [100 * v[2] for v in values], alpha=0.2)
        ns = [int(key.split("@")[1]) for key in scores if key.startswith("synth@")]
        if ns:
            curve.plot(ns, [100 * scores[f"synth@{n}"][0] for n in ns], marker="s", linestyle="--",
                       label=f"{name} synth@n")
    curve.set(xlabel="k (n for synth@n)", ylabel="%", title="pass@k and synth@n, 95% interval")
    curve.xaxis.get_major_locator().set_params(integer=True)
    curve.legend(fontsize=8)
    names = list(summary)
    for offset, (label, wanted) in enumerate((("correct", True), ("wrong", False))):
        ratios = []
        for name in names:
            mine = [r["browse_ratio"] for r in rows if r["benchmark"] == name and bool(r["correct"]) is wanted]
            ratios.append(sum(mine) / len(mine) if mine else 0.0)
        browse.bar([i + 0.4 * offset for i in range(len(names))], ratios, width=0.4, label=label)
    browse.set_xticks([i + 0.2 for i in range(len(names))], names, fontsize=8)
    browse.set(ylabel="visits / tool calls", title="browse ratio")
    browse.legend(fontsize=8)
    for name in names:
        turns.hist([r["turns"] for r in rows if r["benchmark"] == name], bins=20, histtype="step", label=name)
    turns.set(xlabel="turns", ylabel="samples", title="turns per sample")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def render(summary: dict[str, dict[str, object]]) -> str:
    """The console table: one row per benchmark, each score as mean [low, high] in percent."""
    lines = []
    for name, scores in summary.items():
        lines.append(f"{name}: {scores['tasks']} questions, k={scores['k']}")
        for key, value in scores.items():
            if isinstance(value, list):
                mean, low, high = value
                lines.append(f"  {key:<11} {100 * mean:5.1f}%  [{100 * low:5.1f}, {100 * high:5.1f}]")
    return "\n".join(lines)
