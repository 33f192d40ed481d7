"""The ``synthetic`` dataset kind: questions about the procedurally generated world.

``DatasetConfig(kind="synthetic", path="", seed=S, limit=N, url_prefix=BASE)`` gives the first N
questions (200 when ``limit`` is unset) of the world of seed S, with evidence URLs under ``BASE`` (the
corpus server serving that world). ``path`` is not used. Importing this module registers the kind.
"""

from __future__ import annotations

from envs.datasets.registry import DatasetConfig, register_dataset
from envs.synthetic.questions import QuestionConfig, load_synthetic_tasks
from envs.tasks import Task


@register_dataset("synthetic")
def load_synthetic(cfg: DatasetConfig) -> list[Task]:
    count = cfg.limit if cfg.limit else QuestionConfig().count
    return load_synthetic_tasks(seed=cfg.seed, n=count, base_url=cfg.url_prefix)
