"""The tool contract.

A tool is an object with a name, a JSON schema for its arguments and an async ``call``. A tool does
its one job and raises :class:`ToolError` when it cannot; it never formats failures for the agent,
retries or caches. The :class:`~envs.tools.toolbox.Toolbox` does those things for every tool alike,
so each failure mode is handled once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

JsonValue = str | int | float | bool | None | list["JsonValue"] | dict[str, "JsonValue"]
JsonObject = dict[str, JsonValue]


class ToolError(Exception):
    """A tool could not do its job.

    ``kind`` is a short stable label for metrics ("timeout", "http_status", "blocked", "bad_arguments",
    ...). ``retryable`` says whether trying the same call again may help (network hiccups: yes;
    a refused address or bad arguments: no).
    """

    def __init__(self, kind: str, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.retryable = retryable

    def __repr__(self) -> str:
        return f"ToolError({self.kind!r}, {self.message!r}, retryable={self.retryable})"


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
