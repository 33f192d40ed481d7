"""The tool contract.

A tool is an object with a name, a JSON schema for its arguments and an async ``call``. A tool does
its one job and raises :class:`ToolError` when it cannot; it never formats failures for the agent,
retries or caches. The :class:`~turnstile.envs.tools.toolbox.Toolbox` does those things for every tool alike,
so each failure mode is handled once.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Protocol, runtime_checkable

JsonValue = str | int | float | bool | None | list["JsonValue"] | dict[str, "JsonValue"]
JsonObject = dict[str, JsonValue]


class Fault(StrEnum):
    """Whose doing a failed tool call was."""

    policy = "policy"  # the call itself: bad or missing arguments, a made-up or refused address, a spent budget
    environment = "environment"  # the world: a time-out, a refused connection, HTTP 5xx or 429, a service down


ENVIRONMENT_KINDS = frozenset({
    "timeout", "connect", "network", "injected", "internal", "bad_response", "browser", "extractor",
    "extractor_unavailable",
})
"""The error kinds that are the environment's by default: the same call may work another time, or
the failure is in our tools or their services (a bug, a crash, a search API or extractor that is
down or misconfigured). Every other kind is the policy's: its arguments, the address it chose (a
404, a refused or unresolvable host, a page that cannot be read), its budget. A raise site that knows
better says so (``fault=``): an HTTP 429 or 5xx is the environment's."""


class ToolError(Exception):
    """A tool could not do its job.

    ``kind`` is a short stable label for metrics ("timeout", "http_status", "blocked", "bad_arguments",
    ...). ``retryable`` says whether trying the same call again may help (network hiccups: yes;
    a refused address or bad arguments: no). ``fault`` says whose doing it was (by default from the
    kind: :data:`ENVIRONMENT_KINDS`).
    """

    def __init__(self, kind: str, message: str, *, retryable: bool = False, fault: Fault | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.retryable = retryable
        self.fault = fault if fault is not None else fault_of(kind)

    def __repr__(self) -> str:
        return f"ToolError({self.kind!r}, {self.message!r}, retryable={self.retryable}, fault={self.fault.value})"


def fault_of(kind: str) -> Fault:
    """Whose doing an error of ``kind`` is, when its raise site does not say."""
    return Fault.environment if kind in ENVIRONMENT_KINDS else Fault.policy


@runtime_checkable
class Tool(Protocol):
    """One tool the agent may call.

    Contract:
    - ``name`` is what the model writes in ``{"name": ...}``; ``parameters`` is a JSON schema object.
    - ``call`` receives the already-normalised arguments (see ``normalize``), returns the text the
      agent reads, and raises :class:`ToolError` on failure. Any other exception is a bug in the tool,
      but the toolbox still turns it into an observation.
    - ``normalize`` validates and canonicalises arguments (wrap a bare string into a list, strip
      whitespace, ...) and raises ``ToolError("bad_arguments", ...)`` naming the problem. Its result
      is the cache key's argument part, so equal calls must normalise equally.
    - ``aclose`` releases clients (HTTP pools, browsers); safe to call twice.
    """

    name: str
    description: str

    @property
    def parameters(self) -> JsonObject:
        """The JSON schema of the arguments: a class constant or an attribute, read and never changed."""

    def normalize(self, arguments: Mapping[str, object]) -> JsonObject: ...

    async def call(self, arguments: JsonObject) -> str: ...

    async def aclose(self) -> None: ...
