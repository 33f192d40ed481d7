"""Synthetic questions: determinism, hop counts, unique answers, clue chains, the dataset kind."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest

from turnstile.envs.synthetic import schema
from turnstile.envs.synthetic.questions import QuestionConfig, generate_tasks, load_synthetic_tasks
from turnstile.envs.synthetic.world import World, WorldConfig, generate_world
from turnstile.envs.tasks import Task

BASE = "http://127.0.0.1:8765"


@pytest.fixture(scope="module")
def world() -> World:
    return generate_world(WorldConfig(seed=0))


@pytest.fixture(scope="module")
def tasks(world: World) -> list[Task]:
    return generate_tasks(world, QuestionConfig(count=200), BASE)


def _solve(world: World, task: Task) -> str:
    """The answer recomputed from the world and the plan alone (an independent check)."""
    plan = task.metadata
    if plan["kind"] == "chain":
        entity = world.by_name(str(plan["start"]))
        for kind, relation in plan["path"]:  # type: ignore[union-attr]
            assert entity.kind == kind
            entity = world.entities[entity.relations[str(relation)]]
        if plan["attribute"] is None:
            return entity.name
        kind, name = plan["attribute"]  # type: ignore[misc]
        return schema.format_value(schema.attribute(str(kind), str(name)), entity.attributes[str(name)])
    members = world.members(world.by_name(str(plan["hub"])))
    attribute = str(plan["attribute"][1])  # type: ignore[index]
    values = [m.attributes[attribute] for m in members]
    if plan["op"] == "count_before":
        return str(sum(int(v) < int(plan["value"]) for v in values))  # type: ignore[arg-type]
    if plan["op"] == "count_taller":
        return str(sum(int(v) > int(plan["value"]) for v in values))  # type: ignore[arg-type]
    if plan["op"] == "count_equal":
        return str(sum(v == plan["value"] for v in values))
    if plan["op"] == "mode":
        ranked = Counter(values).most_common(2)
        assert len(ranked) == 1 or ranked[0][1] > ranked[1][1], "tie: the answer is not unique"
        return str(ranked[0][0])
    born = sorted((int(m.attributes["born"]), m.name) for m in members)
    assert len(born) == 1 or born[0][0] < born[1][0], "tie: the answer is not unique"
    return born[0][1]


def test_same_seed_same_questions(world: World, tasks: list[Task]) -> None:
    again = generate_tasks(generate_world(WorldConfig(seed=0)), QuestionConfig(count=200), BASE)
    assert [(t.id, t.question, t.answers, t.clues, t.metadata) for t in again] == \
           [(t.id, t.question, t.answers, t.clues, t.metadata) for t in tasks]


def test_other_seed_other_questions(tasks: list[Task]) -> None:
    other = load_synthetic_tasks(seed=1, n=50, base_url=BASE)
    assert not {t.question for t in other} & {t.question for t in tasks}


def test_mix_hops_and_sizes(tasks: list[Task]) -> None:
    kinds = Counter(str(t.metadata["kind"]) for t in tasks)
    assert kinds == {"chain": 170, "aggregate": 30}
    chains = [t for t in tasks if t.metadata["kind"] == "chain"]
    hops = [int(t.metadata["hops"]) for t in chains]  # type: ignore[arg-type]
    assert min(hops) >= 2 and max(hops) <= 8 and set(hops) == set(range(2, 9))
    aggregates = [t for t in tasks if t.metadata["kind"] == "aggregate"]
    members = [int(t.metadata["members"]) for t in aggregates]  # type: ignore[arg-type]
    assert all(50 <= m <= 90 for m in members)
    assert len({t.question for t in tasks}) == len(tasks)
    assert any(int(t.metadata["js_pages"]) > 0 for t in tasks)  # type: ignore[arg-type]


def test_every_answer_is_unique_and_matches_the_world(world: World, tasks: list[Task]) -> None:
    for task in tasks:
        assert _solve(world, task) == task.answers[0], task.question
        assert not any(answer.lower() in task.question.lower() for answer in task.answers[:1]
                       if task.metadata["kind"] == "chain")


def test_chain_entities_are_distinct_and_clues_follow_the_chain(world: World, tasks: list[Task]) -> None:
    for task in (t for t in tasks if t.metadata["kind"] == "chain"):
        assert task.clues is not None
        bridges = [c for c in task.clues if c.id.startswith("hop")]
        assert len(bridges) == task.metadata["hops"]
        names = [str(task.metadata["start"])] + [c.aliases[0] for c in bridges]
        assert len(set(names)) == len(names), "a chain must not visit an entity twice"
        for clue, source in zip(bridges, names, strict=False):
            assert clue.evidence_urls == (f"{BASE}/wiki/{world.by_name(source).slug}",)
        assert task.clues[-1].role == "answer"
        assert {c.role for c in task.clues} <= {"bridge", "constraint", "answer"}


def test_aggregation_clues_name_every_member(world: World, tasks: list[Task]) -> None:
    task = next(t for t in tasks if t.metadata["kind"] == "aggregate")
    assert task.clues is not None
    members = world.members(world.by_name(str(task.metadata["hub"])))
    constraints = [c for c in task.clues if c.role == "constraint"]
    assert [c.aliases[0] for c in constraints] == [m.name for m in members]


def test_bad_config_errors_name_the_setting(world: World) -> None:
    with pytest.raises(ValueError, match="min_hops"):
        generate_tasks(world, QuestionConfig(min_hops=5, max_hops=3))
    with pytest.raises(ValueError, match="aggregation_"):
        generate_tasks(world, QuestionConfig(aggregation_min_members=500, aggregation_max_members=600))


def test_found_as_dataset_kind_through_its_entry_point() -> None:
    # A fresh interpreter: nothing has imported envs.synthetic, so only the entry point can find it.
    code = (
        "from turnstile.envs.datasets.registry import DatasetConfig, load_tasks\n"
        f"tasks = load_tasks(DatasetConfig(kind='synthetic', path='', limit=12, seed=0, "
        f"url_prefix='{BASE}/wiki/'))\n"
        "print(len(tasks), all(t.id.startswith('synthetic-s0-') for t in tasks),"
        f" all(u.startswith('{BASE}/wiki/') for t in tasks for c in t.clues for u in c.evidence_urls))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["12", "True", "True"]


def test_first_questions_do_not_depend_on_count(world: World) -> None:
    many = generate_tasks(world, QuestionConfig(count=60))
    few = generate_tasks(world, QuestionConfig(count=7))
    assert [t.question for t in few] == [t.question for t in many[:7]]
    assert [t.answers for t in few] == [t.answers for t in many[:7]]
