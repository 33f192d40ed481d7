"""Small in-process tools for testing the environment's and toolbox's own logic."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from envs.tools.base import JsonObject, ToolError


class EchoTool:
    """Returns its 'text' argument; counts calls."""

    description = "echo the text back"
    parameters: JsonObject = {"type": "object", "properties": {"text": {"type": "string"}}}

    def __init__(self, name: str = "search") -> None:
        self.name = name
        self.calls = 0
        self.closed = 0

    def normalize(self, arguments: Mapping[str, object]) -> JsonObject:
        text = arguments.get("text", "")
        if not isinstance(text, str):
            raise ToolError("bad_arguments", "'text' must be a string")
        return {"text": text.strip()}

    async def call(self, arguments: JsonObject) -> str:
        self.calls += 1
        return f"echo: {arguments['text']}"

    async def aclose(self) -> None:
        self.closed += 1


class FlakyTool(EchoTool):
    """Fails with a given error the first ``failures`` calls, then echoes."""

    def __init__(self, name: str, failures: int, error: Exception) -> None:
        super().__init__(name)
        self.failures = failures
        self.error = error

    async def call(self, arguments: JsonObject) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return f"echo: {arguments['text']}"


class SlowTool(EchoTool):
    def __init__(self, name: str, seconds: float) -> None:
        super().__init__(name)
        self.seconds = seconds

    async def call(self, arguments: JsonObject) -> str:
        self.calls += 1
        await asyncio.sleep(self.seconds)
        return "late"
