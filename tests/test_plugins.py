"""One plugin mechanism (envs/plugins.py): a user's estimator, reward plugin, dataset and engine load
from their own module by import path; registered names, entry points and the errors."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import user_plugins
from turnstile.cluster.cli import main
from turnstile.envs.datasets.registry import DatasetConfig, load_tasks
from turnstile.envs.plugins import PluginError, PluginSpec, Registry, typed_options
from turnstile.learner.credit import build_estimator, estimator_class
from turnstile.rewards.base import RewardError, build_reward, resolve_reward
from turnstile.rollout.engines.config import EngineConfig
from turnstile.rollout.engines.registry import build_engine, weight_sync
from turnstile.rollout.trajectory import Segment, StopReason, Trajectory

FIXTURES = Path(__file__).parent / "fixtures" / "credit"


def test_a_users_estimator_by_import_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert estimator_class("tests.user_plugins:Constant") is user_plugins.Constant
    out = tmp_path / "credited.jsonl"
    with pytest.raises(SystemExit) as done:
        main(["credit", "--estimator", "tests.user_plugins:Constant", "--in", str(FIXTURES / "e1.jsonl"),
              "--out", str(out), "value=0.5"])
    assert done.value.code == 0, capsys.readouterr().out
    advantages = {turn["advantage"] for line in out.read_text().splitlines() for turn in json.loads(line)["turns"]}
    assert advantages == {0.5}
    with pytest.raises(SystemExit) as done:
        main(["credit", "--estimator", "tests.user_plugins:Nope", "--in", str(FIXTURES / "e1.jsonl"),
              "--out", str(out)])
    assert done.value.code == 2 and "cannot load 'Nope'" in capsys.readouterr().out
    with pytest.raises(KeyError, match="not an Estimator class"):
        build_estimator("tests.user_plugins:AnswerLength")


def test_a_users_reward_by_import_path() -> None:
    plugin = build_reward(PluginSpec("tests.user_plugins:AnswerLength", {"per_char": 0.5}))
    trajectory = Trajectory(uid="u", sample=0, task_id="t", question="q?", answers=["a"],
                            segments=[Segment(prompt_ids=[1])], stop_reason=StopReason.ANSWERED, answer="four")
    asyncio.run(plugin.score(trajectory, load_tasks(DatasetConfig(kind="tests.user_plugins:three_questions",
                                                                  path="t"))[0]))
    assert trajectory.outcome == 2.0
    with pytest.raises(RewardError, match="unknown option 'per_word'; the options are: per_char"):
        build_reward(PluginSpec("tests.user_plugins:AnswerLength", {"per_word": 1}))
    with pytest.raises(RewardError, match="not a RewardPlugin class"):
        resolve_reward("tests.user_plugins:Constant")
    with pytest.raises(RewardError, match="declares 'config_type'; the options dataclass is now named 'Options'"):
        build_reward(PluginSpec("tests.user_plugins:OldStyle", {"per_char": 0.5}))


def test_a_users_dataset_and_engine_by_import_path() -> None:
    tasks = load_tasks(DatasetConfig(kind="tests.user_plugins:three_questions", path="mine-", limit=2))
    assert [task.id for task in tasks] == ["mine-0", "mine-1"]
    config = EngineConfig(kind="tests.user_plugins:NullEngine", model="m", options={"version": 3})
    engine = build_engine(config)
    assert isinstance(engine, user_plugins.NullEngine) and engine.config.model == "m"
    assert engine.options.version == 3  # its own options, typed
    with pytest.raises(PluginError, match="unknown option 'versoin'"):
        build_engine(EngineConfig(kind="tests.user_plugins:NullEngine", options={"versoin": 3}))
    # How the driver publishes weights is the engine's to say; the core names no engine.
    assert weight_sync(config) == ("checkpoint", "/shared/m")
    assert weight_sync(EngineConfig(kind="hf")) == ("inplace", "")
    vllm = EngineConfig(kind="vllm")
    vllm.vllm.weight_sync, vllm.vllm.checkpoint_dir = "checkpoint", "/ckpt"
    assert weight_sync(vllm) == ("checkpoint", "/ckpt")
    with pytest.raises(ValueError, match=r"engine.kind 'tests.user_plugins:three_questions' names .* not an engine"):
        build_engine(EngineConfig(kind="tests.user_plugins:three_questions"))


def test_registry_names_registrations_entry_points_and_errors() -> None:
    registry: Registry[type] = Registry("widget", "turnstile.rewards", accepts=lambda found: isinstance(found, type),
                                        expected="a class")

    @registry.register("mine")
    class Mine:
        pass

    assert registry.load("mine") is Mine
    assert {"mine", "exact_match"} <= set(registry.names())  # in process, and an installed entry point
    assert registry.load("exact_match").__name__ == "ExactMatch"
    with pytest.raises(PluginError, match=r"widget 'mine' is already registered by .*Mine; choose another"):
        registry.register("mine")(int)
    with pytest.raises(PluginError, match=r"unknown widget 'theirs'; known: .*mine.*package.module:Name"):
        registry.load("theirs")
    with pytest.raises(PluginError, match=r"widget 'json:loads' names .* which is not a class"):
        registry.load("json:loads")


def test_typed_options_refuse_what_they_do_not_know() -> None:
    @dataclass
    class Options:
        rate: float = 0.1
        name: str = "a"

        def __post_init__(self) -> None:
            if self.rate < 0:
                raise ValueError(f"rate={self.rate} must be >= 0")

    assert typed_options(Options, {"rate": 2}, "widget 'w'") == Options(rate=2.0)
    with pytest.raises(PluginError, match="widget 'w': unknown option 'rte'; the options are: rate, name"):
        typed_options(Options, {"rte": 1}, "widget 'w'")
    with pytest.raises(PluginError, match="widget 'w': bad value for option 'rate'"):
        typed_options(Options, {"rate": "fast"}, "widget 'w'")
    with pytest.raises(PluginError, match=r"widget 'w': rate=-1.0 must be >= 0"):
        typed_options(Options, {"rate": -1}, "widget 'w'")
