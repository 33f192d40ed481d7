"""The turnstile command line, run as a user runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from turnstile.cluster.cli import build_parser, main


def turnstile(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "from turnstile.cluster.cli import main; main()", *args],
                          capture_output=True, text=True, timeout=timeout, check=False)


def test_every_command_is_wired() -> None:
    parser = build_parser()
    for command in ("serve-corpus", "episode", "expert"):
        assert parser.parse_args([command]).command == command


HEAVY = ("torch", "vllm", "ray", "transformers", "verl")
FIXTURES = Path(__file__).parent / "fixtures" / "credit"


def test_help_and_credit_start_without_the_heavy_stack(tmp_path: Path) -> None:
    """``turnstile --help``, every command's ``--help`` and ``turnstile credit`` on a small file
    import none of torch, vLLM, Ray, transformers or veRL (they cost seconds to import)."""
    script = f"""
import sys
from turnstile.cluster.cli import COMMANDS, main
for argv in [["--help"], *[[name.replace("_", "-"), "--help"] for name in COMMANDS], ["data", "clean", "--help"],
             ["credit", "--estimator", "igpo", "--in", {str(FIXTURES / "e1.jsonl")!r},
              "--out", {str(tmp_path / "o.jsonl")!r}]]:
    try:
        main(argv)
    except SystemExit as done:
        assert done.code in (0, None), (argv, done.code)
print(sorted(name for name in {HEAVY!r} if name in sys.modules))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"
    assert (tmp_path / "o.jsonl").is_file()


def test_bad_override_names_the_key(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["episode", "env.max_turn=3"])
    assert exit_info.value.code == 2
    assert "unknown key 'env.max_turn'" in capsys.readouterr().out


@pytest.mark.integration
def test_a_busy_corpus_port_is_one_line(tmp_path: Path) -> None:
    """The world's address taken by another program: rollout and train say which address and what
    to do, exit 1, no traceback."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        runs = (["rollout", "--out", str(tmp_path / "r.jsonl"), "engine.kind=scripted",
                 f"corpus.port={port}"],
                ["train", f"out={tmp_path / 'train'}", f"rollout.corpus.port={port}"])
        for command in runs:
            result = turnstile(*command, "--no-progress")
            assert result.returncode == 1, result.stdout + result.stderr
            assert f"cannot listen on 127.0.0.1:{port}" in result.stdout
            assert "pick another port" in result.stdout
            assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.integration
def test_episode_smoke_command() -> None:
    result = turnstile("episode", "question=3")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "correct: True" in result.stdout and "end: answered" in result.stdout


@pytest.mark.integration
def test_episode_refuses_a_server_of_another_world() -> None:
    result = turnstile("episode", "--corpus-url", "http://127.0.0.1:1")
    assert result.returncode == 1 and "cannot reach the corpus server" in result.stdout


BAD_TRAIN_VALUES = [
    (["rollout.episode.max_new_tokens=-1"], "rollout.episode.max_new_tokens=-1 must be >= 1"),
    (["rollout.group_size=0"], "rollout.group_size=0 must be >= 1"),
    (["mode=async", "staleness=-1"], "staleness=-1 must be >= 0"),
    (["steps=-1"], "steps=-1 must be >= 1"),
    (["tasks_per_step=0"], "tasks_per_step=0 must be >= 1"),
    (["mode=turbo"], "mode='turbo' is not one of sync, async"),
    (["rollout.fleet.workers=0"], "rollout.fleet.workers=0 must be >= 1"),
    (["rollout.episode.env.max_turns=0"], "rollout.episode.env.max_turns=0 must be >= 1"),
    (["rollout.episode.context_budget=50", "rollout.episode.max_new_tokens=96"],
     "rollout.episode.context_budget=50 must exceed max_new_tokens=96"),
    (["mode=async", "rollout.group_size=64"], "rollout.group_size=64 must be <= rollout.fleet.workers"),
    (["estimator.kind=nope"], "estimator.kind: unknown estimator 'nope'"),
    (["estimator.options={beta: 1}"], "estimator 'grpo': unknown option 'beta'"),
    (["rewards=[{kind: exact_match, options: {nope: 1}}]"], "reward 'exact_match': unknown option 'nope'"),
    (["rollout.data.field_map={answer:answers}"], "YAML needs a space after ':'; write '{answer: answers}'"),
    (["rollout.data.field_map={answer: answers"], "cannot be read"),
]


@pytest.mark.parametrize("overrides, message", BAD_TRAIN_VALUES, ids=[" ".join(o) for o, _ in BAD_TRAIN_VALUES])
def test_train_refuses_bad_values_before_anything_starts(tmp_path, capsys: pytest.CaptureFixture[str],  # noqa: ANN001
                                                         overrides: list[str], message: str) -> None:
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        main(["train", f"out={out}", *overrides])
    printed = capsys.readouterr()
    assert exit_info.value.code == 2
    lines = [line for line in printed.out.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], printed.out
    assert "Traceback" not in printed.out + printed.err
    assert not out.exists()  # no banner, no config.yaml, no checkpoint


def test_rollout_refuses_bad_values(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:  # noqa: ANN001
    with pytest.raises(SystemExit) as exit_info:
        main(["rollout", "--out", str(tmp_path / "r.jsonl"), "episode.max_new_tokens=-1"])
    assert exit_info.value.code == 2
    assert "episode.max_new_tokens=-1 must be >= 1" in capsys.readouterr().out
