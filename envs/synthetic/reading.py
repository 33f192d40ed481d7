"""Reading tool observations as text: search result lists, visited pages, fact lines, member lists.

The scripted expert knows nothing but what the tools return, so everything it learns goes through
these parsers. They accept the formats of the ``search`` tool (``N. [title](url)`` lines) and the
``visit`` tool (``Content of <url> (goal: ...):`` then the page's main text), with or without the
``<tool_response>`` wrapper, and tolerate the list bullets trafilatura adds (``- Label: value``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from turnstile.envs.protocol import RESPONSE_CLOSE, RESPONSE_OPEN

# A result line: ``N. [title](url)``; the URL may hold balanced parentheses (``/wiki/Tosca_(1956_film)``).
_RESULT = re.compile(r"^\s*\d+\.\s*\[(?P<title>.*)\]\((?P<url>(?:[^()\s]|\([^()\s]*\))+)\)\s*$", re.MULTILINE)
_CONTENT_HEADER = re.compile(r"^Content of (?P<url>\S+) \(goal: .*\):$", re.MULTILINE)
_BULLET = r"^[ \t]*(?:[-*\u2022][ \t]*)?"
_MEMBER = re.compile(_BULLET + r"Member:[ \t]*(?P<name>.+?)[ \t]*\(joined in \d+\)[ \t]*$", re.MULTILINE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


@dataclass(frozen=True)
class SearchResult:
    rank: int
    title: str
    url: str


def unwrap(observation: str) -> str:
    """The tool's text without the ``<tool_response>`` tags around it."""
    text = observation.strip()
    if text.startswith(RESPONSE_OPEN):
        text = text[len(RESPONSE_OPEN):]
    if text.endswith(RESPONSE_CLOSE):
        text = text[: -len(RESPONSE_CLOSE)]
    return text.strip()


def search_results(observation: str) -> list[SearchResult]:
    """Every ``N. [title](url)`` line, in order."""
    return [SearchResult(rank, match["title"].strip(), match["url"])
            for rank, match in enumerate(_RESULT.finditer(unwrap(observation)), start=1)]


def same_name(a: str, b: str) -> bool:
    return " ".join(a.casefold().split()) == " ".join(b.casefold().split())


def find_page(observation: str, name: str) -> str | None:
    """The URL of the first search result titled exactly ``name`` (case and spacing aside)."""
    for result in search_results(observation):
        if same_name(result.title, name):
            return result.url
    return None


def page_text(observation: str) -> str | None:
    """The page text of a successful visit observation, or None (failure, empty page)."""
    text = unwrap(observation)
    header = _CONTENT_HEADER.search(text)
    if header is None:
        return None
    body = text[header.end():].strip()
    return body or None


def fact(text: str, label: str) -> str | None:
    """The value on the first ``Label: value`` line of ``text`` (list bullets allowed)."""
    pattern = re.compile(_BULLET + re.escape(label) + r":[ \t]*(?P<value>\S.*?)[ \t]*$", re.MULTILINE)
    match = pattern.search(text)
    return match["value"] if match else None


def members(text: str) -> list[str]:
    """Names on ``Member: <name> (joined in <year>)`` lines, in page order."""
    return [match["name"] for match in _MEMBER.finditer(text)]


def stated_member_count(text: str) -> int | None:
    """N from the page's sentence "<organisation> has N members.", when present."""
    match = re.search(r" has (\d+) members?\.", text)
    return int(match.group(1)) if match else None


def number(value: str) -> int | None:
    """The integer in a shown value (``12,400`` → 12400, ``183 cm`` → 183); None when there is none."""
    match = _NUMBER.search(value)
    if match is None:
        return None
    try:
        return int(float(match.group(0).replace(",", "")))
    except ValueError:
        return None
