"""turnstile score: reward plugins then credit over saved trajectories of the synthetic world."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_episode import BASE, Stubborn, chain, episode
from turnstile.cluster.cli import main
from turnstile.cluster.cli.config import load_config
from turnstile.cluster.jobs.score import ScoreJob, score_saved
from turnstile.rollout.trajectory import load_trajectories, save_trajectories

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "score.yaml"


@pytest.fixture
async def saved(tmp_path: Path, tasks, expert, toolbox, chat) -> Path:  # noqa: ANN001
    task = chain(tasks, hops=2)
    good = [await episode(task, expert, toolbox, chat, sample=s) for s in (0, 1)]
    bad = await episode(task, Stubborn(chat), toolbox, chat, sample=2, max_turns=3)
    trajectories = [*good, bad]
    for trajectory in trajectories:
        trajectory.metadata["corpus_url"] = BASE
    path = tmp_path / "rollout.jsonl"
    save_trajectories(trajectories, path)
    return path


async def test_rewards_and_credit_are_written(saved: Path, tmp_path: Path) -> None:
    out = tmp_path / "scored.jsonl"
    report = await score_saved(load_config(ScoreJob, EXAMPLE), saved, out)
    scored = load_trajectories(out)
    assert report.trajectories == 3 and report.groups == 1
    assert [t.outcome for t in scored] == [1.0, 1.0, -1.0]  # the stubborn one never answers: -λ_fmt
    assert all(turn.advantage is not None for t in scored for turn in t.turns)
    assert scored[0].turns[-1].advantage > 0 > scored[2].turns[-1].advantage
    events = [e for turn in scored[0].turns for e in turn.events]
    assert "answer_correct" in events and any(e.startswith("clue_found") for e in events)
    assert all(turn.step_score is not None for turn in scored[0].turns)


def test_command_reports_and_rejects_bad_options(saved: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "scored.jsonl"
    with pytest.raises(SystemExit) as done:
        main(["score", "--in", str(saved), "--out", str(out), "estimator.kind=grpo"])
    assert done.value.code == 0 and "scored 3 trajectories in 1 groups" in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:
        main(["score", "--in", str(saved), "--out", str(out), "estimator.options={gama: 0.5}"])
    assert done.value.code == 1 and "gama" in capsys.readouterr().out
