"""The dataset registry: kinds by name or import path, and the shared split/shuffle/limit options."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from turnstile.envs.datasets import DatasetConfig, DatasetError, known_kinds, load_tasks, register_dataset, registry
from turnstile.envs.tasks import Task

BUILTIN = {"jsonl", "parquet", "hotpotqa", "browsecomp_zh", "xbench", "webwalkerqa", "webshaper"}


@pytest.fixture()
def tasks_file(tmp_path: Path) -> Path:
    path = tmp_path / "many.jsonl"
    path.write_text("".join(json.dumps({"id": f"t{i}", "question": f"q{i}", "answers": [str(i)]}) + "\n"
                            for i in range(50)))
    return path


@pytest.fixture()
def scoped_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registrations made in a test disappear after it."""
    monkeypatch.setattr(registry.DATASETS, "_registered", dict(registry.DATASETS._registered))


def load_fixed(cfg: DatasetConfig) -> list[Task]:
    """A loader named by import path in a test."""
    return [Task(id="fixed", question=cfg.path, answers=("a",))]


def test_builtin_kinds_are_registered() -> None:
    assert BUILTIN <= set(known_kinds())


def test_unknown_kind_lists_known_kinds() -> None:
    with pytest.raises(DatasetError,
                       match=r"unknown dataset kind 'nope'; known: .*hotpotqa.*jsonl.*package.module:Name"):
        load_tasks(DatasetConfig(kind="nope", path="x"))


def test_register_dataset_is_one_decorator(scoped_registry: None) -> None:
    @register_dataset("tiny")
    def load_tiny(cfg: DatasetConfig) -> list[Task]:
        return [Task(id=f"tiny:{i}", question="q", answers=("a",)) for i in range(3)]

    assert "tiny" in known_kinds()
    assert [t.id for t in load_tasks(DatasetConfig(kind="tiny", path="", limit=2))] == ["tiny:0", "tiny:1"]
    with pytest.raises(ValueError, match="already registered"):
        register_dataset("tiny")(load_fixed)


def test_kind_by_import_path() -> None:
    (task,) = load_tasks(DatasetConfig(kind="tests.test_datasets_registry:load_fixed", path="p?"))
    assert task.question == "p?"
    with pytest.raises(DatasetError, match="cannot load"):
        load_tasks(DatasetConfig(kind="tests.test_datasets_registry:absent", path="p"))


def test_limit_and_seeded_shuffle(tasks_file: Path) -> None:
    def ids(**options: object) -> list[str]:
        return [t.id for t in load_tasks(DatasetConfig(kind="jsonl", path=str(tasks_file), **options))]

    assert ids(limit=3) == ["t0", "t1", "t2"]
    assert ids(limit=0) == []
    shuffled = ids(shuffle=True, seed=1)
    assert shuffled == ids(shuffle=True, seed=1) and shuffled != ids(shuffle=True, seed=2)
    assert sorted(shuffled) == sorted(ids())
    assert ids(shuffle=True, seed=1, limit=5) == shuffled[:5]


def test_shards_cover_the_split_once(tasks_file: Path) -> None:
    def ids(**options: object) -> list[str]:
        return [t.id for t in load_tasks(DatasetConfig(kind="jsonl", path=str(tasks_file), **options))]

    train = ids(split="train", eval_fraction=0.3)
    parts = [ids(split="train", eval_fraction=0.3, shards=3, shard=i) for i in range(3)]
    assert all(parts) and sorted(i for part in parts for i in part) == sorted(train)
    assert parts[1] == train[1::3] and ids(shards=3, shard=2, limit=1) == [ids()[2]]
    for shard, shards in ((3, 3), (-1, 3), (0, 0)):
        with pytest.raises(DatasetError, match="shard"):
            ids(shards=shards, shard=shard)


def test_split_is_a_stable_partition(tasks_file: Path) -> None:
    def ids(**options: object) -> set[str]:
        return {t.id for t in load_tasks(DatasetConfig(kind="jsonl", path=str(tasks_file), **options))}

    train, held_out = ids(split="train", eval_fraction=0.3), ids(split="eval", eval_fraction=0.3)
    assert train.isdisjoint(held_out) and train | held_out == ids()
    assert 5 <= len(held_out) <= 25
    assert ids(split="eval", eval_fraction=0.3, shuffle=True, seed=0) == held_out
    with pytest.raises(DatasetError, match="split 'test' is not one of all, train, eval"):
        ids(split="test")


def test_field_map_reaches_the_loader(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"query": "q", "answer": "a"}\n')
    (task,) = load_tasks(DatasetConfig(kind="jsonl", path=str(path),
                                       field_map={"query": "question", "answer": "answers"}))
    assert task.answers == ("a",)


def test_config_merges_overrides_and_pickles() -> None:
    merged = OmegaConf.merge(OmegaConf.structured(DatasetConfig(kind="jsonl", path="x")),
                             OmegaConf.from_dotlist(["limit=5", "field_map.answer=answers"]))
    cfg = OmegaConf.to_object(merged)
    assert isinstance(cfg, DatasetConfig) and cfg.limit == 5 and cfg.field_map == {"answer": "answers"}
    assert pickle.loads(pickle.dumps(cfg)) == cfg


def test_hotpotqa_kind_needs_url_prefix(shared_data: Path) -> None:
    path = str(shared_data / "multihop" / "hotpotqa_dev500.jsonl")
    with pytest.raises(DatasetError, match="url_prefix is empty"):
        load_tasks(DatasetConfig(kind="hotpotqa", path=path))
    tasks = load_tasks(DatasetConfig(kind="hotpotqa", path=path, url_prefix="http://h/wiki/", limit=10))
    assert len(tasks) == 10
