"""The contract every reward plugin keeps (rewards/base.py), checked for every registered one.

The plugins are the ``turnstile.rewards`` entry points of the installed packages, plus the
built-in ones listed in :data:`BUILTIN` (by import path, so they are tested before the entry points
are declared). Each is built from its default options — with ``client`` pointed at a local
OpenAI-compatible server when it has that option — and run on a group of real trajectories (the
scripted expert through the search tool, one solved and one cut short).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle
from collections.abc import Iterator
from importlib.metadata import entry_points

import pytest

from tests.openai_server import ChatServer, Reply, chat_server
from tests.test_episode import BASE, chain, episode
from tests.tools_for_tests import memory_toolbox
from turnstile.envs.synthetic.questions import QuestionConfig, generate_tasks
from turnstile.envs.synthetic.render import world_documents
from turnstile.envs.synthetic.world import WorldConfig, generate_world
from turnstile.envs.tasks import Task
from turnstile.envs.tools.base import JsonValue
from turnstile.rewards.base import (
    ENTRY_POINT_GROUP,
    REWARDS,
    PluginSpec,
    RewardError,
    RewardPlugin,
    build_reward,
    resolve_reward,
)
from turnstile.rollout.chat import ChatFormat
from turnstile.rollout.engines.scripted import ScriptedEngine
from turnstile.rollout.model_store import ensure_default_model
from turnstile.rollout.trajectory import Trajectory

# The plugins this package declares in pyproject.toml under [project.entry-points."turnstile.rewards"].
BUILTIN = {
    "exact_match": "turnstile.rewards.outcome:ExactMatch",
    "f1": "turnstile.rewards.outcome:TokenF1",
    "llm_judge": "turnstile.rewards.outcome:LlmJudge",
    "format": "turnstile.rewards.format:FormatPenalty",
    "clue_steps": "turnstile.rewards.clues:ClueSteps",
    "information_gain": "turnstile.rewards.information_gain.plugin:InformationGain",
}


def plugin_kinds() -> list[str]:
    """Every registered name, and the built-in import paths not (yet) registered by name."""
    names = REWARDS.names()
    return sorted(set(names) | {path for name, path in BUILTIN.items() if name not in names})


def answer_everything(messages: list[dict[str, str]]) -> Reply:
    """Replies any judge of this package can read."""
    prompt = messages[-1]["content"]
    if "correct: yes" in prompt:
        return Reply("extracted_final_answer: x\nreasoning: the same.\ncorrect: yes")
    return Reply(json.dumps({"turns": [{"turn": 0, "events": []}]}))


@pytest.fixture(scope="module")
def judge_server() -> Iterator[ChatServer]:
    with chat_server(answer_everything) as server:
        yield server


@pytest.fixture(scope="module")
async def group() -> tuple[Task, list[Trajectory]]:
    chat = ChatFormat.from_pretrained(ensure_default_model())
    world = generate_world(WorldConfig(seed=0))
    tasks = generate_tasks(world, QuestionConfig(), BASE)
    documents = world_documents(world, BASE)
    toolbox = memory_toolbox(documents)
    task = chain(tasks, 3)
    solved = await episode(task, ScriptedEngine(chat, tasks=tasks), toolbox, chat)
    cut = await episode(task, ScriptedEngine(chat, tasks=tasks), toolbox, chat, max_turns=3, sample=1)
    return task, [solved, cut]


def options_for(kind: str, server: ChatServer) -> dict[str, JsonValue]:
    fields = {f.name for f in dataclasses.fields(resolve_reward(kind).Options)}
    if "client" not in fields:
        return {}
    return {"client": {"base_url": server.base_url, "model": "contract", "api_key_env": ""}}


def changed_fields(before: Trajectory, after: Trajectory) -> set[str]:
    old, new = before.to_json(), after.to_json()
    changed = {f"trajectory.{key}" for key in old if key != "segments" and old[key] != new[key]}
    for old_turn, new_turn in zip(before.turns, after.turns, strict=True):
        old_t, new_t = dataclasses.asdict(old_turn), dataclasses.asdict(new_turn)
        changed |= {f"turn.{key}" for key in old_t if old_t[key] != new_t[key]}
    return changed


@pytest.mark.parametrize("kind", plugin_kinds())
async def test_plugin_contract(kind: str, judge_server: ChatServer,
                               group: tuple[Task, list[Trajectory]]) -> None:
    cls = resolve_reward(kind)
    assert issubclass(cls, RewardPlugin) and dataclasses.is_dataclass(cls.Options)
    spec = PluginSpec(kind, options_for(kind, judge_server))
    assert pickle.loads(pickle.dumps(spec)) == spec  # what travels to a reward actor
    with pytest.raises(RewardError, match="unknown option 'no_such_option'"):
        build_reward(PluginSpec(kind, {"no_such_option": 1}))

    task, trajectories = group
    plugin = build_reward(spec)
    scored = copy.deepcopy(trajectories)
    await plugin.score_group(scored, task)
    for before, after in zip(trajectories, scored, strict=True):
        assert changed_fields(before, after) <= plugin.writes, f"{kind} wrote undeclared fields"
        assert Trajectory.from_json(json.loads(json.dumps(after.to_json()))).to_json() == after.to_json()
        if "trajectory.outcome" in plugin.writes:
            assert after.outcome is not None
        if "turn.step_score" in plugin.writes:
            assert all(turn.step_score is not None for turn in after.turns)
        if "turn.ig_value" in plugin.writes:
            assert all(turn.ig_value is not None and turn.ig_value < 0 for turn in after.turns)
    again = copy.deepcopy(scored)
    await plugin.score_group(again, task)  # idempotent
    assert [t.to_json() for t in again] == [t.to_json() for t in scored]
    await plugin.aclose()
    await plugin.aclose()  # safe twice


def test_builtin_plugins_are_declared_as_entry_points() -> None:
    declared = {entry.name: entry.value for entry in entry_points(group=ENTRY_POINT_GROUP)}
    for name, path in BUILTIN.items():
        assert declared.get(name) == path, f"entry point {name} = {path!r} is missing or differs"
        assert resolve_reward(name) is resolve_reward(path)


def test_unknown_kinds_say_what_to_do() -> None:
    with pytest.raises(RewardError, match=r"unknown reward kind 'no_such_reward'; known: .*exact_match"):
        resolve_reward("no_such_reward")
    with pytest.raises(RewardError, match="cannot load 'Nope'"):
        resolve_reward("turnstile.rewards.outcome:Nope")
    with pytest.raises(RewardError, match="not a RewardPlugin"):
        resolve_reward("turnstile.rewards.outcome:token_f1")


async def test_in_process_registration() -> None:
    from turnstile.rewards.base import register_reward
    from turnstile.rewards.format import FormatPenalty

    @register_reward("test_double_penalty")
    class DoublePenalty(FormatPenalty):
        """A plugin defined in a test: found by name without an entry point."""

    assert "test_double_penalty" in REWARDS.names()
    assert isinstance(build_reward(PluginSpec("test_double_penalty")), DoublePenalty)
    with pytest.raises(RewardError, match="already registered"):
        register_reward("test_double_penalty")(FormatPenalty)
