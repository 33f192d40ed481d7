"""The turnstile command line, run as a user runs it."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cluster.cli import build_parser, main


def turnstile(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "from cluster.cli import main; main()", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_every_command_is_wired() -> None:
    parser = build_parser()
    for command in ("serve-corpus", "episode", "expert"):
        assert parser.parse_args([command]).command == command


def test_bad_override_names_the_key(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["episode", "env.max_turn=3"])
    assert exit_info.value.code == 2
    assert "unknown key 'env.max_turn'" in capsys.readouterr().out


@pytest.mark.integration
def test_episode_smoke_command() -> None:
    result = turnstile("episode", "question=3")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "correct: True" in result.stdout and "end: answered" in result.stdout


@pytest.mark.integration
def test_episode_refuses_a_server_of_another_world() -> None:
    result = turnstile("episode", "--corpus-url", "http://127.0.0.1:1")
    assert result.returncode == 1 and "cannot reach the corpus server" in result.stdout
