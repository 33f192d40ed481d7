"""``turnstile eval`` end to end: every (question, sample) once, scores that agree with the lines,
a run killed mid-way that continues without redoing what it finished, bad settings refused, and no
decrypted text of an encrypted benchmark in any output or log."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.openai_server import Reply, chat_server
from turnstile.cluster.cli.config import load_config
from turnstile.cluster.jobs.eval import BenchmarkConfig, EvalJob, judge, result_row, run_synthesis, summarize_results
from turnstile.cluster.jobs.eval_metrics import pass_at_k
from turnstile.cluster.jobs.synthesis import SynthesisConfig
from turnstile.envs.chat_client import ChatClientConfig
from turnstile.envs.datasets.registry import DatasetConfig, load_tasks
from turnstile.envs.plugins import PluginSpec
from turnstile.envs.protocol import StopReason
from turnstile.envs.tasks import Task
from turnstile.rollout.trajectory import Segment, Trajectory, Turn, load_trajectories

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "eval.yaml"
TURNSTILE = str(Path(sys.executable).parent / "turnstile")
HELDOUT = ("{kind: synthetic, path: '', split: eval, limit: 8, options: {min_hops: 1, max_hops: 1, "
           "entity_answer_fraction: 1.0, aggregation_fraction: 0.0, count: 1200}}")
# The scripted expert at a model server's pace (0.5 s a turn), two episodes at a time: slow enough
# to be killed half-way.
SLOW_EXPERT = ["rollout.engine.kind=sim", "rollout.engine.options={decode_s_per_token: 0.01, concurrency: 2}",
               "rollout.fleet.episodes_per_worker=2", "rollout.corpus.port=0", "k=2",
               # one benchmark twice: the second with another context manager, on the same fleet
               f"benchmarks=[{{name: synthetic-heldout, data: {HELDOUT}}}, "
               f"{{name: heldout-discard-all, data: {HELDOUT}, context: {{kind: discard_all, max_resets: 2}}}}]"]
# The same expert ten times faster: what the continued run uses for the samples left (a setting of
# the engine, not of what is evaluated, so the results file carries over).
FAST_EXPERT = [*SLOW_EXPERT, "rollout.engine.options={decode_s_per_token: 0.001, concurrency: 2}"]


def _eval(args: list[str], **kwargs: object) -> subprocess.Popen:
    """`turnstile eval` as a process of its own, a driver joining the test session's Ray (as under
    `ray job submit`); killing its process group kills the driver, and Ray ends the actors it owned."""
    import ray

    return subprocess.Popen([TURNSTILE, "eval", "--config", str(EXAMPLE), "--no-progress", *args,
                             f"rollout.ray.address={ray.get_runtime_context().gcs_address}"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, **kwargs)


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.timeout(600)
def test_a_killed_eval_continues_and_every_sample_is_scored_once(tmp_path: Path, ray_local: None) -> None:
    out = tmp_path / "eval"
    first = _eval([*SLOW_EXPERT, f"out={out}"])
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and first.poll() is None:
        if (out / "results.jsonl").is_file() and len(_rows(out)) >= 4:
            break
        time.sleep(0.2)
    assert first.poll() is None, first.stdout.read() if first.stdout else ""
    os.killpg(first.pid, signal.SIGKILL)  # the driver (its actors die with it)
    first.wait(timeout=30)
    killed_at = len(_rows(out))
    assert 4 <= killed_at < 32 and not (out / "summary.json").exists()
    with (out / "results.jsonl").open("a") as cut:  # a line the kill cut short
        cut.write('{"benchmark": "synthetic-heldout", "task_id": "synth')

    second = _eval([*FAST_EXPERT, f"out={out}"])
    log, _ = second.communicate(timeout=400)
    assert second.returncode == 0, log
    rows = _rows_tolerant(out)
    keys = Counter((row["benchmark"], row["task_id"], row["sample"]) for row in rows)
    assert len(keys) == 32 and set(keys.values()) == {1}, keys  # 8 questions x 2 samples x 2 contexts, each once
    summaries = json.loads((out / "summary.json").read_text())["benchmarks"]
    assert summaries["heldout-discard-all"]["tasks"] == 8
    summary = summaries["synthetic-heldout"]
    by_task: dict[str, list[bool]] = {}
    for row in rows:
        if row["benchmark"] == "synthetic-heldout":
            by_task.setdefault(row["task_id"], []).append(row["correct"])
    assert summary["tasks"] == 8 and summary["k"] == 2
    expected = sum(pass_at_k(2, sum(c), 1) for c in by_task.values()) / 8
    assert summary["pass@1"][0] == pytest.approx(expected) and summary["pass@1"][1] <= expected <= summary["pass@1"][2]
    assert set(summary) == {"tasks", "k", "pass@1", "pass@2", "avg@2", "maj@2", "answered", "well_formed"}
    assert all(row["turns"] >= 1 and row["stop_reason"] for row in rows)
    # Each sample's trajectory is kept to look at (a kill may leave at most the one it cut short out).
    trajectories = load_trajectories(out / "trajectories.jsonl")
    kept = {(t.uid, t.sample) for t in trajectories}
    assert len({(f"{r['benchmark']}/{r['task_id']}", r["sample"]) for r in rows} - kept) <= 1
    # ... each under its benchmark's context manager, both benchmarks on one fleet
    managers = {(t.uid.split("/")[0], t.context_manager) for t in trajectories}
    assert managers == {("synthetic-heldout", "mono"), ("heldout-discard-all", "discard_all")}, managers
    assert "pass@1" in log and "synthetic-heldout: 8 questions, k=2" in log
    assert (out / "eval.png").read_bytes()[:4] == b"\x89PNG"


def _rows_tolerant(out: Path) -> list[dict]:
    rows = []
    for line in (out / "results.jsonl").read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def test_an_eval_where_every_sample_fails_exits_nonzero_saying_why(tmp_path: Path, ray_local: None,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from turnstile.cluster.cli.commands import eval as command

    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    out = tmp_path / "eval"
    heldout = HELDOUT.replace("limit: 8", "limit: 2")
    args = parser.parse_args(["--config", str(EXAMPLE), "--no-progress", "k=1", f"out={out}", "rollout.corpus.port=0",
                              "rollout.engine.kind=tests.hostile:FailingEngine",
                              f"benchmarks=[{{name: synthetic-heldout, data: {heldout}}}]"])
    assert command.run(args) == 1
    printed = capsys.readouterr().out
    assert ("turnstile eval: every sample failed; the first said: the engine failed on turn 0: RuntimeError: "
            "this engine serves nothing") in printed
    rows = _rows(out)
    assert len(rows) == 2 and all("this engine serves nothing" in row["error"] for row in rows)
    assert not (out / "summary.json").exists()  # no 0% table of a run that measured nothing


def test_bad_settings_are_refused_before_anything_starts(tmp_path: Path) -> None:
    for override, words in ((["k=0"], "k=0"), (["benchmarks=[]"], "benchmarks is empty"),
                            (["benchmarks.0.limit=3"], "a list is set whole"),
                            (["synthesis.enabled=true"], "synthesis.client.model is empty"),
                            (["synthesis.synthesizer=oracle"], "synthesis.synthesizer='oracle'"),
                            (["benchmarks=[{data: {kind: jsonl, path: x}, judge: {kind: vibes}}]"],
                             "judge.kind='vibes'"),
                            (["benchmarks=[{data: {kind: jsonl, path: x}, judge: {kind: f1, options: {beta: 2}}}]"],
                             "beta")):
        with pytest.raises(ValueError, match=words):
            load_config(EvalJob, EXAMPLE, override)
    result = subprocess.run([TURNSTILE, "eval", "k=0", f"out={tmp_path}"], cwd=REPO,
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2 and "k=0 must be >= 1" in result.stdout and "Traceback" not in result.stderr


@pytest.mark.timeout(600)
def test_an_encrypted_benchmark_leaves_no_decrypted_text_in_outputs_or_logs(tmp_path: Path, shared_data: Path,
                                                                           ray_local: None) -> None:
    path = shared_data / "benchmarks" / "DeepSearch-2505.csv"
    tasks = load_tasks(DatasetConfig(kind="xbench", path=str(path), limit=3))
    out = tmp_path / "eval"
    bench = f"benchmarks=[{{name: xbench-2505, data: {{kind: xbench, path: {path}, limit: 3}}}}]"
    # The random-weight model: it answers nothing useful, but every question goes through the fleet.
    run = _eval([bench, "k=1", f"out={out}", "rollout.engine.kind=hf", "rollout.engine.model=tiny-qwen3",
                 "rollout.episode.max_new_tokens=24", "rollout.episode.env.max_turns=2", "rollout.corpus.port=0"])
    log, _ = run.communicate(timeout=500)
    assert run.returncode == 0, log
    rows = _rows(out)
    assert len(rows) == 3 and all(row["answer"] is None for row in rows)
    assert (out / "trajectories.jsonl").read_text() == ""  # no trajectory of an encrypted benchmark kept
    written = log + "".join(p.read_text(errors="replace") for p in out.rglob("*") if p.is_file())
    checked = 0
    for task in tasks:  # answers too short to be told from other text ("4") are not looked for
        for text in (task.question, *(a for a in task.answers if len(a.strip()) >= 6)):
            fragment = text.strip()[:12]
            assert fragment not in written, f"{task.id}: decrypted text in the outputs"
            checked += 1
    assert checked >= len(tasks)
    assert {row["task_id"] for row in rows} == {task.id for task in tasks}


def test_the_judge_scores_each_sample_and_f1_is_reported_beside_exact_match() -> None:
    bench = BenchmarkConfig(DatasetConfig(kind="jsonl", path="x"), name="qa", judge=PluginSpec("f1"))
    task = Task(id="t1", question="Where?", answers=("Paris France",))
    samples = [Trajectory(uid="qa/t1", sample=i, task_id="t1", question="Where?", answers=["Paris France"],
                          stop_reason=StopReason.ANSWERED, answer=answer)
               for i, answer in enumerate(["Paris", "paris, France", None])]
    samples[2].stop_reason = StopReason.NO_ANSWER
    def turn(index: int, ok: bool) -> Turn:
        return Turn(index=index, response_ids=[1], response_logprobs=[0.0], weights_version=0, context_len=1,
                    finish_reason="stop", format_ok=ok)
    samples[0].segments = [Segment(prompt_ids=[1], turns=[turn(0, False), turn(1, True)])]  # malformed, answer
    samples[1].segments = [Segment(prompt_ids=[1], turns=[turn(0, True)])]
    judge(samples, {"qa/t1": bench}, {"qa/t1": task})
    rows = [result_row(bench, t) for t in samples]
    assert [row["well_formed"] for row in rows] == [0.5, 1.0, 0.0]
    assert [row["correct"] for row in rows] == [False, True, False]
    assert [row["score"] for row in rows] == [pytest.approx(2 / 3), 1.0, 0.0]
    assert rows[0]["answer"] == "Paris" and rows[2]["answer"] is None and rows[2]["answer_key"] is None
    cfg = EvalJob(benchmarks=[bench], k=3)
    summary = summarize_results(cfg, iter(rows), [[task]])["qa"]
    assert summary["tasks"] == 1 and summary["f1@3"][0] == pytest.approx((2 / 3 + 1) / 3)
    assert summary["pass@1"][0] == pytest.approx(1 / 3) and summary["pass@3"][0] == 1.0
    assert summary["answered"][0] == pytest.approx(2 / 3) and summary["well_formed"][0] == pytest.approx(0.5)


def test_synth_at_n_reads_the_first_n_reports_through_a_local_openai_server(tmp_path: Path) -> None:
    bench = BenchmarkConfig(DatasetConfig(kind="jsonl", path="x"), name="qa")
    tasks = [Task(id=f"t{i}", question=f"Who founded company {i}?", answers=(f"Founder {i}",)) for i in range(3)]
    rows = [{"benchmark": "qa", "task_id": task.id, "sample": s, "correct": False,
             "report": f"Sample {s} of {task.id} read the page. Final answer: guess {s}"}
            for task in tasks for s in range(4)]

    def respond(messages: list[dict[str, str]]) -> Reply:  # right once it reads two reports or more
        prompt = messages[-1]["content"]
        task = next(t for t in tasks if t.question in prompt)
        if task.id == "t2":
            return Reply("overloaded", status=503)
        return Reply(f"<answer>{task.answers[0] if 'Report 2:' in prompt else 'someone else'}</answer>")

    with chat_server(respond) as server:
        synthesis = SynthesisConfig(enabled=True, ns=[1, 2, 4, 8],
                                    client=ChatClientConfig(base_url=server.base_url, model="synth", api_key_env="",
                                                            max_attempts=1))
        cfg = EvalJob(benchmarks=[bench], k=4, synthesis=synthesis)
        scores = run_synthesis(cfg, tmp_path, [tasks], rows, {})["qa"]
        asked = server.log.count
    assert set(scores) == {"synth@1", "synth@2", "synth@4"}  # 8 > k
    assert scores["synth@1"][0] == 0.0 and scores["synth@2"][0] == 1.0 and scores["synth@4"][0] == 1.0
    written = [json.loads(line) for line in (tmp_path / "synthesis.jsonl").read_text().splitlines()]
    assert len(written) == 6 and {r["task_id"] for r in written} == {"t0", "t1"}  # t2's endpoint failed: left out
    assert asked == 9  # 3 questions x 3 n; t2's three failed at once (max_attempts=1)
    with chat_server(respond) as server:  # run again: only what is missing is asked
        cfg.synthesis.client.base_url = server.base_url
        run_synthesis(cfg, tmp_path, [tasks], rows, {})
        assert server.log.count == 3


def test_the_policy_itself_synthesizes_on_its_own_engine_within_its_context_budget(
        tmp_path: Path, ray_local: None) -> None:
    """synthesizer=policy: one replica of the evaluated engine (here the openai engine, so the prompt
    it was given can be read at the server) answers from the reports, the reports' beginnings cut
    so the prompt fits the episode's budget."""
    from turnstile.cluster.jobs.defaults import default_rollout
    from turnstile.rollout.chat import ChatFormat
    from turnstile.rollout.model_store import resolve_model

    bench = BenchmarkConfig(DatasetConfig(kind="jsonl", path="x"), name="qa")
    tasks = [Task(id=f"t{i}", question=f"Who founded company {i}?", answers=(f"Founder {i}",)) for i in range(2)]
    filler = "The agent searched and read several pages about the company and its history. " * 40
    rows = [{"benchmark": "qa", "task_id": task.id, "sample": s, "correct": False,
             "report": f"{filler}Sample {s} concluded. Final answer: {task.answers[0] if s else 'nobody'}"}
            for task in tasks for s in range(4)]
    chat = ChatFormat.from_pretrained(resolve_model("tiny-qwen3"))
    prompts: list[str] = []

    def respond(messages: list[dict[str, str]]) -> Reply:  # the answer of the reports' last lines
        prompt = messages[-1]["content"]
        prompts.append(prompt)
        task = next(t for t in tasks if t.question in prompt)
        return Reply(f"<answer>{task.answers[0] if 'Sample 1 concluded' in prompt else 'nobody'}</answer>")

    with chat_server(respond) as server:
        rollout = default_rollout()
        rollout.engine.kind, rollout.engine.model = "openai", "tiny-qwen3"
        rollout.engine.options = {"base_url": server.base_url, "model": "api-model", "api_key_env": ""}
        rollout.episode.max_new_tokens, rollout.episode.context_budget = 64, 1024
        cfg = EvalJob(benchmarks=[bench], k=4, rollout=rollout,
                         synthesis=SynthesisConfig(enabled=True, ns=[1, 2, 4], synthesizer="policy"))
        scores = run_synthesis(cfg, tmp_path, [tasks], rows, {})["qa"]
    assert scores["synth@1"][0] == 0.0 and scores["synth@2"][0] == 1.0 and scores["synth@4"][0] == 1.0
    assert len(prompts) == 6  # 2 questions x 3 n, one request each
    for prompt in prompts:  # every report's end is there, its beginning cut to fit 1024 - 64 tokens
        assert len(chat.encode(prompt)) <= 1024 - 64 and "Final answer:" in prompt
    assert any(prompt.count("Report ") == 4 and filler not in prompt for prompt in prompts)
    written = [json.loads(line) for line in (tmp_path / "synthesis.jsonl").read_text().splitlines()]
    assert sorted((r["task_id"], r["n"], r["correct"]) for r in written) == [
        (t, n, n > 1) for t in ("t0", "t1") for n in (1, 2, 4)]


def test_a_synthesis_prompt_that_cannot_fit_is_that_questions_failure(tmp_path: Path) -> None:
    from turnstile.cluster.jobs.synthesis import fitted_prompt
    from turnstile.rollout.chat import ChatFormat
    from turnstile.rollout.model_store import resolve_model

    chat = ChatFormat.from_pretrained(resolve_model("tiny-qwen3"))
    ids = fitted_prompt(chat, "Who?", ["x" * 9000, "y" * 9000], 400)
    assert len(ids) <= 400 and "Report 2:" in chat.decode(ids)
    with pytest.raises(ValueError, match="without any report"):
        fitted_prompt(chat, "Who? " * 500, ["x"], 400)
