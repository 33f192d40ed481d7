"""The one task format every dataset loader produces."""

from __future__ import annotations

from dataclasses import dataclass, field

from turnstile.envs.tools.base import JsonValue


@dataclass(frozen=True)
class Clue:
    """A fact any solution must establish (docs/algorithms.md §6)."""

    id: str
    text: str
    role: str  # "bridge" | "constraint" | "answer"
    evidence_urls: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class Task:
    """A question with its accepted answers (first = canonical) and optional clue chain."""

    id: str
    question: str
    answers: tuple[str, ...]
    clues: tuple[Clue, ...] | None = None
    metadata: dict[str, JsonValue] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.id:
            raise ValueError("Task.id must be a non-empty string")
        if not self.question.strip():
            raise ValueError(f"task {self.id!r}: the question is empty")
        if isinstance(self.answers, str):
            raise TypeError(f"task {self.id!r}: answers must be a sequence of strings, not one string")
