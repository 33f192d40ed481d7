"""One entry point from a dataset config to tasks, through loaders registered by name.

A new kind of dataset is one decorated function anywhere in the code base::

    @register_dataset("synthetic")
    def load_synthetic(cfg: DatasetConfig) -> list[Task]: ...

A package makes its kinds known without being imported first through the entry-point group
``turnstile.datasets`` in its ``pyproject.toml`` (that is how ``synthetic`` is found: the registry
never lists its plugins). A loader can also be named by import path, ``kind="package.module:function"``
(same signature), which needs no registration at all.
After loading, :func:`load_tasks` applies the options every kind shares, in this order: ``split``
(a stable train/eval partition by task id), ``shard``, ``shuffle`` (seeded), then ``limit``.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from turnstile.envs.datasets.benchmarks import load_browsecomp_zh, load_webshaper, load_webwalkerqa, load_xbench
from turnstile.envs.datasets.generic import DatasetError, load_jsonl, load_parquet
from turnstile.envs.datasets.hotpotqa import read_hotpotqa
from turnstile.envs.plugins import Registry
from turnstile.envs.tasks import Task

SPLITS = ("all", "train", "eval")

Loader = Callable[["DatasetConfig"], list[Task]]


@dataclass
class DatasetConfig:
    """Where tasks come from and which of them to use.

    kind: a registered loader name (see :func:`known_kinds`) or ``package.module:function``.
    path: the file to read.
    split: ``all``, or ``train``/``eval`` for a partition that depends only on each task's id and
        ``seed`` (so it is the same however the file is ordered, shuffled or limited);
        ``eval_fraction`` of the tasks go to ``eval``.
    shards, shard: keep every ``shards``-th task from position ``shard`` (after the split, before
        shuffle and limit): ``shards`` runs with ``shard`` 0 to ``shards - 1`` cover the split once.
    limit: keep at most this many tasks (after split and shuffle); ``None`` keeps all.
    shuffle: shuffle with ``seed`` (the same seed gives the same order).
    field_map: file field name → task field name, for ``jsonl``/``parquet``
        (e.g. ``{"query": "question", "answer": "answers"}``).
    url_prefix: where the corpus server serves pages; required by ``hotpotqa``.
    expected_count: for benchmarks, the number of questions the file must hold; ``None`` means the
        published count.
    options: the kind's own settings, refused by the loader when it does not know one (``synthetic``:
        the fields of :class:`turnstile.envs.synthetic.questions.QuestionConfig`, e.g. ``{max_hops: 1}``).
    """

    kind: str
    path: str
    split: str = "all"
    eval_fraction: float = 0.1
    shards: int = 1
    shard: int = 0
    limit: int | None = None
    shuffle: bool = False
    seed: int = 0
    field_map: dict[str, str] = field(default_factory=dict)
    url_prefix: str = ""
    expected_count: int | None = None
    options: dict[str, Any] = field(default_factory=dict)


ENTRY_POINT_GROUP = "turnstile.datasets"
DATASETS: Registry[Loader] = Registry("dataset kind", ENTRY_POINT_GROUP, error=DatasetError,
                                     expected="a loader function")


def register_dataset(name: str) -> Callable[[Loader], Loader]:
    """Register ``loader`` as the dataset kind ``name``; registering a name twice is an error."""
    return DATASETS.register(name)


def known_kinds() -> list[str]:
    """The dataset kinds: registered here, by import, or through entry points; sorted."""
    return DATASETS.names()


def resolve_loader(kind: str) -> Loader:
    """The loader for ``kind``: a registered name or ``package.module:function``."""
    return DATASETS.load(kind)


def load_tasks(cfg: DatasetConfig) -> list[Task]:
    """Load the tasks ``cfg`` describes, then apply its split, shuffle and limit."""
    if cfg.split not in SPLITS:
        raise DatasetError(f"dataset split {cfg.split!r} is not one of {', '.join(SPLITS)}")
    if not 0.0 <= cfg.eval_fraction <= 1.0:
        raise DatasetError(f"dataset eval_fraction {cfg.eval_fraction} must be between 0 and 1")
    if cfg.limit is not None and cfg.limit < 0:
        raise DatasetError(f"dataset limit {cfg.limit} must be >= 0 (or null for no limit)")
    if not 0 <= cfg.shard < cfg.shards:
        raise DatasetError(f"dataset shard {cfg.shard} must be >= 0 and below shards ({cfg.shards})")
    tasks = resolve_loader(cfg.kind)(cfg)
    if cfg.split != "all":
        wanted = cfg.split == "eval"
        tasks = [task for task in tasks if _in_eval(task.id, cfg.seed, cfg.eval_fraction) == wanted]
    tasks = tasks[cfg.shard :: cfg.shards]
    if cfg.shuffle:
        tasks = list(tasks)
        random.Random(cfg.seed).shuffle(tasks)
    if cfg.limit is not None:
        tasks = tasks[: cfg.limit]
    return tasks


def _in_eval(task_id: str, seed: int, eval_fraction: float) -> bool:
    digest = hashlib.sha256(f"{seed}:{task_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < eval_fraction


@register_dataset("jsonl")
def _jsonl(cfg: DatasetConfig) -> list[Task]:
    return load_jsonl(cfg.path, cfg.field_map)


@register_dataset("parquet")
def _parquet(cfg: DatasetConfig) -> list[Task]:
    return load_parquet(cfg.path, cfg.field_map)


@register_dataset("hotpotqa")
def _hotpotqa(cfg: DatasetConfig) -> list[Task]:
    return read_hotpotqa(cfg.path, cfg.url_prefix).tasks


@register_dataset("browsecomp_zh")
def _browsecomp_zh(cfg: DatasetConfig) -> list[Task]:
    return load_browsecomp_zh(cfg.path, expected_count=cfg.expected_count)


@register_dataset("xbench")
def _xbench(cfg: DatasetConfig) -> list[Task]:
    return load_xbench(cfg.path, expected_count=cfg.expected_count)


@register_dataset("webwalkerqa")
def _webwalkerqa(cfg: DatasetConfig) -> list[Task]:
    return load_webwalkerqa(cfg.path, expected_count=cfg.expected_count)


@register_dataset("webshaper")
def _webshaper(cfg: DatasetConfig) -> list[Task]:
    return load_webshaper(cfg.path, expected_count=cfg.expected_count)
