"""The agent's tool set (search + visit) built from one config, inside the process that uses it.

A rollout worker builds one toolbox and shares it across its concurrent episodes: the search index,
HTTP pools, the browser and the cache are built here, from a small picklable :class:`ToolsConfig`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from turnstile.envs.search.base import Document
from turnstile.envs.search.tool import SearchConfig, SearchTool
from turnstile.envs.tools.toolbox import Toolbox, ToolboxConfig
from turnstile.envs.visit.tool import VisitConfig, VisitTool


@dataclass
class ToolsConfig:
    search: SearchConfig = field(default_factory=SearchConfig)
    visit: VisitConfig = field(default_factory=VisitConfig)
    toolbox: ToolboxConfig = field(default_factory=ToolboxConfig)


def build_toolbox(config: ToolsConfig, documents: Sequence[Document] | None = None,
                  allow_hosts: Sequence[str] = ()) -> Toolbox:
    """Search (over ``documents`` when given, else the configured backend) and visit.

    ``allow_hosts`` are added to the visit tool's SSRF allow-list: the address of a local corpus
    server, which is on loopback and would otherwise be refused.
    """
    visit_config = config.visit
    extractor = visit_config.extractor
    if extractor.enabled and extractor.worst_case_s() >= config.toolbox.timeout_s:
        raise ValueError(f"visit.extractor can take up to {extractor.worst_case_s():g} s per page "
                         f"({extractor.max_attempts} attempts of timeout_s={extractor.timeout_s:g} and "
                         f"their backoff), which does not fit toolbox.timeout_s={config.toolbox.timeout_s:g} "
                         "for the whole visit: lower the extractor's timeout_s or max_attempts, or raise "
                         "toolbox.timeout_s")
    if allow_hosts:
        hosts = list(visit_config.guard.allow_hosts) + [h for h in allow_hosts
                                                          if h not in visit_config.guard.allow_hosts]
        visit_config = replace(visit_config, guard=replace(visit_config.guard, allow_hosts=hosts))
    search = SearchTool.from_config(config.search, documents)
    return Toolbox([search, VisitTool(visit_config)], config.toolbox)
