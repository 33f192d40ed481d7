"""The ``synthetic`` dataset kind: questions about the procedurally generated world.

``DatasetConfig(kind="synthetic", path="", seed=S, limit=N, url_prefix=PREFIX, options={...})``
gives the first N questions (200 when ``limit`` is unset) of the world of seed S, with evidence URLs
under ``PREFIX``, the page prefix of the corpus server serving that world
(``http://host:port/wiki/``, as for every served corpus). ``options`` sets the question mix: any
field of :class:`~turnstile.envs.synthetic.questions.QuestionConfig` but ``seed`` (``count`` questions before
the split, ``min_hops``, ``max_hops``, ``aggregation_fraction``, ``entity_answer_fraction``, ...);
an unknown one is an error naming the known ones. ``path`` is not used. The kind is found through
the ``turnstile.datasets`` entry point.
"""

from __future__ import annotations

from turnstile.envs.corpus_server import PAGE_PREFIX
from turnstile.envs.datasets.generic import DatasetError
from turnstile.envs.datasets.registry import DatasetConfig, register_dataset
from turnstile.envs.plugins import typed_options
from turnstile.envs.synthetic.questions import QuestionConfig, load_synthetic_tasks
from turnstile.envs.tasks import Task

FIXED = ("seed",)  # the dataset config's own seed


def question_config(options: dict[str, object]) -> QuestionConfig:
    """The question mix ``options`` asks for, over the defaults (DatasetError when it cannot be):
    read like every plugin's options (:func:`turnstile.envs.plugins.typed_options`), ``seed`` excepted (the
    dataset config's own)."""
    fixed = sorted(set(options) & set(FIXED))
    if fixed:
        raise DatasetError(f"synthetic dataset: option {fixed[0]!r} is set by the dataset config "
                           f"(data.{fixed[0]}), not in its options")
    config = typed_options(QuestionConfig, options, "synthetic dataset", error=DatasetError)
    try:
        config.validate()
    except ValueError as error:
        raise DatasetError(f"synthetic dataset: {error}") from None
    return config


@register_dataset("synthetic")
def load_synthetic(cfg: DatasetConfig) -> list[Task]:
    questions = question_config(dict(cfg.options))
    # With a split, the limit applies after it (load_tasks): generate the whole question set so the
    # split has its share of it (questions are prefix-stable, so ids do not depend on the count).
    count = cfg.limit if cfg.limit and cfg.split == "all" else questions.count
    base_url = cfg.url_prefix.removesuffix(PAGE_PREFIX).rstrip("/")
    return load_synthetic_tasks(seed=cfg.seed, n=count, base_url=base_url, questions=questions)
