"""The ``synthetic`` dataset kind: questions about the procedurally generated world.

``DatasetConfig(kind="synthetic", path="", seed=S, limit=N, url_prefix=PREFIX)`` gives the first N
questions (200 when ``limit`` is unset) of the world of seed S, with evidence URLs under ``PREFIX``,
the page prefix of the corpus server serving that world (``http://host:port/wiki/``, as for every
served corpus). ``path`` is not used. The kind is found through the ``turnstile.datasets`` entry point.
"""

from __future__ import annotations

from envs.corpus_server import PAGE_PREFIX
from envs.datasets.registry import DatasetConfig, register_dataset
from envs.synthetic.questions import QuestionConfig, load_synthetic_tasks
from envs.tasks import Task


@register_dataset("synthetic")
def load_synthetic(cfg: DatasetConfig) -> list[Task]:
    # With a split, the limit applies after it (load_tasks): generate the whole question set so the
    # split has its share of it (questions are prefix-stable, so ids do not depend on the count).
    count = cfg.limit if cfg.limit and cfg.split == "all" else QuestionConfig().count
    base_url = cfg.url_prefix.removesuffix(PAGE_PREFIX).rstrip("/")
    return load_synthetic_tasks(seed=cfg.seed, n=count, base_url=base_url)
