"""Task datasets: generic JSONL/parquet files, HotpotQA-style multi-hop files (MuSiQue's shape too)
with their corpus, and published benchmarks (decrypted in memory only). Start from
:func:`load_tasks` with a :class:`DatasetConfig`; add a kind with ``@register_dataset("name")``."""

from turnstile.envs.datasets.benchmarks import (
    BROWSECOMP_ZH_COUNT,
    WEBSHAPER_COUNT,
    WEBWALKERQA_COUNT,
    XBENCH_DEEPSEARCH_COUNTS,
    load_browsecomp_zh,
    load_webshaper,
    load_webwalkerqa,
    load_xbench,
)
from turnstile.envs.datasets.generic import DatasetError, load_jsonl, load_parquet, task_from_record
from turnstile.envs.datasets.hotpotqa import HotpotQA, paragraph_slug, read_hotpotqa, title_slug
from turnstile.envs.datasets.registry import DatasetConfig, known_kinds, load_tasks, register_dataset

__all__ = [
    "BROWSECOMP_ZH_COUNT",
    "WEBSHAPER_COUNT",
    "WEBWALKERQA_COUNT",
    "XBENCH_DEEPSEARCH_COUNTS",
    "DatasetConfig",
    "DatasetError",
    "HotpotQA",
    "known_kinds",
    "load_browsecomp_zh",
    "load_jsonl",
    "load_parquet",
    "load_tasks",
    "load_webshaper",
    "load_webwalkerqa",
    "load_xbench",
    "paragraph_slug",
    "read_hotpotqa",
    "register_dataset",
    "task_from_record",
    "title_slug",
]
