"""A scripted expert that solves synthetic-world questions through the real search and visit tools.

It is the reference policy for the synthetic world: it proves every question is answerable through
the tools (the acceptance run in :mod:`turnstile.envs.synthetic.evaluate`), gives load tests and the
``scripted`` policy engine a deterministic agent that makes 10–190 tool calls, and writes
trajectories in the exact turn format of docs/algorithms.md §1.

The expert uses only the *structure* of a task's plan (``Task.metadata``: the start entity's name and
the relations to follow, or the hub and the filter). Every fact — the name of the next entity, the
list of members, each value — is read from the text of tool observations: search for a name, visit
the result titled with it, read the ``Label: value`` line the schema names. If a search misses it
retries with other queries; if a fact cannot be read it says so and answers with what it has.

Usage: ``expert = ScriptedExpert(task)``; ``text = expert.next_turn(None)`` for the first turn, then
``expert.next_turn(observation)`` with each observation until it returns an answer turn.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from urllib.parse import unquote

from turnstile.envs.protocol import FINAL_ANSWER_INSTRUCTION, render_answer, render_tool_call
from turnstile.envs.synthetic import reading, schema
from turnstile.envs.tasks import Task
from turnstile.envs.tools.base import JsonValue

Script = Generator[str, str, None]
"""Yields assistant turns, receives the observation that follows each."""


@dataclass(frozen=True)
class ExpertConfig:
    """How hard the expert tries before giving up on a page."""

    max_search_attempts: int = 3
    max_visit_attempts: int = 2
    # The share of chain questions answered from the first search listing, without opening a page:
    # the expert then answers with the first result that is not the question's entity (a guess, as
    # an agent that stops early makes). Which questions is a function of the task id alone.
    hasty_fraction: float = 0.0
    # The share of chain questions of two or more hops on which the expert stops the chain early:
    # after reading k of its n hops (k from 1 to n - 1, drawn from the task id) it answers with the
    # entity it has reached, the wrong answer of an agent that takes a bridge for the end.
    early_fraction: float = 0.0

    def __post_init__(self) -> None:
        for name in ("hasty_fraction", "early_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)!r}")

    def hasty(self, task_id: str) -> bool:
        """Whether the expert answers ``task_id`` from the search listing (see ``hasty_fraction``)."""
        return _draw("0", task_id) < self.hasty_fraction

    def stops_after(self, task_id: str, hops: int) -> int | None:
        """After how many hops of ``task_id``'s ``hops`` the expert answers, if it stops early (see
        ``early_fraction``); None when it follows the whole chain. Never for a hasty question."""
        if hops < 2 or self.hasty(task_id) or _draw("1", task_id) >= self.early_fraction:
            return None
        return 1 + int(_draw("2", task_id) * (hops - 1))


def _draw(salt: str, task_id: str) -> float:
    """A number in [0, 1) that depends on the task id and the salt alone."""
    return int(hashlib.sha256(f"{salt}:{task_id}".encode()).hexdigest()[:8], 16) / 16**8


class _GiveUp(Exception):
    """A fact could not be established; answer with what is known."""


class ScriptedExpert:
    """See the module docstring. One instance per episode."""

    def __init__(self, task: Task, config: ExpertConfig | None = None) -> None:
        self.task = task
        self.config = config or ExpertConfig()
        self.tool_calls = 0
        self.finished = False
        kind = task.metadata.get("kind")
        if kind == "chain":
            self._script = self._chain()
        elif kind == "aggregate":
            self._script = self._aggregate()
        elif task.clues and all(clue.evidence_urls for clue in task.clues):
            self._script = self._clue_chain()
        else:
            raise ValueError(f"task {task.id!r} has no synthetic plan (metadata.kind is {kind!r}) and no "
                             "clue chain with evidence pages; the scripted expert solves tasks from "
                             "envs.synthetic.questions and tasks whose clues name their pages (HotpotQA, "
                             "MuSiQue)")
        self._started = False
        self._fallback = "unknown"

    def next_turn(self, observation: str | None) -> str:
        """The next assistant turn given the last observation (None before the first turn)."""
        if self.finished:
            raise RuntimeError("the expert already answered; start a new expert for a new episode")
        if observation is not None and FINAL_ANSWER_INSTRUCTION in observation:
            return self._answer(self._fallback, "I have no tool calls left; I answer with what I "
                                                "have established so far.")
        try:
            turn = next(self._script) if not self._started else self._script.send(observation or "")
        except StopIteration:
            return self._answer(self._fallback, "I could not establish the answer.")
        self._started = True
        if "<answer>" in turn:
            self.finished = True
        return turn

    def _answer(self, answer: str, think: str) -> str:
        self.finished = True
        return render_answer(answer, think)

    # ---- tool use ----------------------------------------------------------------------------

    def _search(self, query: str, think: str) -> str:
        self.tool_calls += 1
        return render_tool_call("search", {"query": [query]}, think)

    def _visit(self, url: str, goal: str, think: str) -> str:
        self.tool_calls += 1
        return render_tool_call("visit", {"url": url, "goal": goal}, think)

    def _open(self, name: str, kind: str, want: str, why: str) -> Generator[str, str, str]:
        """Find ``name``'s page by search and read it; returns its text (raises _GiveUp)."""
        queries = list(dict.fromkeys([name, f"{name} {kind}", f"{name} {want}"]))
        url = None
        for attempt, query in enumerate(queries[: self.config.max_search_attempts]):
            think = (f"{why} I search for {name} to find its page." if attempt == 0 else
                     f"No result was titled exactly {name}; I try the query '{query}'.")
            url = reading.find_page((yield self._search(query, think)), name)
            if url is not None:
                break
        if url is None:
            raise _GiveUp(f"no search result is titled {name}")
        goal = f"Find the {want} of {name}"
        for attempt in range(self.config.max_visit_attempts):
            # the result as the search listed it, so its address follows what the turn just wrote
            think = (f"The search lists [{name}]({url}), the page of {name}. I open it to read "
                     f"the {want}."
                     if attempt == 0 else f"The visit did not return the page text; I try {url} again.")
            text = reading.page_text((yield self._visit(url, goal, think)))
            if text is not None:
                return text
        raise _GiveUp(f"the page of {name} could not be read")

    # ---- chain questions ---------------------------------------------------------------------

    def _chain(self) -> Script:
        plan = self.task.metadata
        path = [_pair(step) for step in _list(plan.get("path"))]
        attribute = plan.get("attribute")
        name, kind = str(plan.get("start")), str(plan.get("start_kind"))
        read = ""  # the fact the last page gave, quoted as the page wrote it
        if self.config.hasty(self.task.id):
            yield from self._guess(name, path)
            return
        stop = self.config.stops_after(self.task.id, len(path))
        try:
            for hop, (source_kind, relation_name) in enumerate(path, start=1):
                spec = schema.relation(source_kind, relation_name)
                why = (f"{read}Step {hop} of {len(path)}: I need {spec.phrase.format(x=name)}."
                       if hop > 1 else f"The question starts from {name}; I need "
                                       f"{spec.phrase.format(x=name)}.")
                text = yield from self._open(name, kind, spec.label.lower(), why)
                target = reading.fact(text, spec.label)
                if target is None:
                    raise _GiveUp(f"the page of {name} has no '{spec.label}' line")
                self._fallback = target
                read = f"The page of {name} gives {spec.label}: {target}. "
                name, kind = target, spec.target
                if hop == stop:  # an agent that takes this bridge for the end of the chain
                    yield render_answer(name, f"{read}That is what the question asks for, so the "
                                              f"answer is {name}.")
                    return
            if attribute is None:
                yield render_answer(name, f"{read}Following every relation of the question leads to "
                                          f"{name}, so that is the answer.")
                return
            attribute_kind, attribute_name = _pair(attribute)
            value_spec = schema.attribute(attribute_kind, attribute_name)
            wanted = value_spec.label.lower()
            text = yield from self._open(name, kind, wanted,
                                         f"{read}The chain ends at {name}; I need its {wanted}.")
            value = reading.fact(text, value_spec.label)
            if value is None:
                raise _GiveUp(f"the page of {name} has no '{value_spec.label}' line")
            yield render_answer(value, f"The page of {name} gives {value_spec.label}: {value}.")
        except _GiveUp as stuck:
            yield render_answer(self._fallback, f"I could not finish the chain ({stuck}); I answer "
                                                "with the last entity I established.")

    def _guess(self, name: str, path: Sequence[tuple[str, str]]) -> Script:
        """Search for the start entity once and answer with the first other result, unread."""
        spec = schema.relation(*path[0])
        listing = reading.search_results((yield self._search(
            name, f"The question starts from {name}; I need {spec.phrase.format(x=name)}. "
                  f"I search for {name}.")))
        others = [result for result in listing if not reading.same_name(result.title, name)]
        if not others:
            yield render_answer(self._fallback, "I answer from the search listing without opening "
                                                "a page; it lists nothing else.")
            return
        guess = others[0]
        yield render_answer(guess.title, f"I answer from the search listing without opening a page: "
                                         f"[{guess.title}]({guess.url}) is listed with {name}.")

    # ---- clue chains (HotpotQA, MuSiQue: a data set's evidence pages) ----------------------------

    def _clue_chain(self) -> Script:
        """Follow the task's clues in hop order: search for each evidence page by its title, open the
        result at the clue's address, and quote the clue's sentence; answer with the first accepted
        answer after the last page. It uses what the data set knows (which page holds each hop) as
        the synthetic chain uses its plan: an oracle, reading the pages through the real tools."""
        clues = self.task.clues or ()
        answer = self.task.answers[0]
        read = ""
        try:
            for hop, clue in enumerate(clues, start=1):
                address = _address(clue.evidence_urls[0])
                title = _title_of(address)
                why = (f"{read}Next I need the page of {title}." if hop > 1 else
                       f"To answer this I need the page of {title} first.")
                yield from self._open_address(title, address, clue.text, why)
                if clue.role == "answer":
                    self._fallback = answer
                read = f"The page of {title} says: {clue.text} "  # the clue is the page's sentence
            yield render_answer(answer, f"{read}So the answer is {answer}.")
        except _GiveUp as stuck:
            yield render_answer(self._fallback, f"I could not read every page I needed ({stuck}); I "
                                                "answer with what I have.")

    def _open_address(self, title: str, address: str, fact: str, why: str) -> Generator[str, str, str]:
        """Find the result whose address ends in ``address`` (searching the title, then the fact)
        and read it; returns its text (raises _GiveUp)."""
        url = None
        for attempt, query in enumerate(dict.fromkeys([title, fact[:120]])):
            think = (f"{why} I search for {title}." if attempt == 0 else
                     f"The search did not list the page of {title}; I search for what it should say.")
            listing = reading.search_results((yield self._search(query, think)))
            url = next((result.url for result in listing if _address(result.url) == address), None)
            if url is not None:
                break
        if url is None:
            raise _GiveUp(f"no search listed the page of {title}")
        for attempt in range(self.config.max_visit_attempts):
            think = (f"The search lists [{title}]({url}). I open it." if attempt == 0 else
                     f"The visit did not return the page text; I try {url} again.")
            text = reading.page_text((yield self._visit(url, f"Find what {title} says", think)))
            if text is not None:
                return text
        raise _GiveUp(f"the page of {title} could not be read")

    # ---- aggregation questions ---------------------------------------------------------------

    def _aggregate(self) -> Script:
        plan = self.task.metadata
        hub = str(plan.get("hub"))
        op = str(plan.get("op"))
        spec = schema.attribute(*_pair(plan.get("attribute")))
        label = spec.label
        try:
            text = yield from self._open(hub, "organisation", "members",
                                         f"The question is about every member of {hub}; I need its "
                                         "member list first.")
        except _GiveUp as stuck:
            yield render_answer(self._fallback, f"I could not read the member list ({stuck}).")
            return
        names = reading.members(text)
        stated = reading.stated_member_count(text)
        note = "" if stated in (None, len(names)) else f" (the page says {stated}, I see {len(names)})"
        values: dict[str, str] = {}
        for position, member in enumerate(names, start=1):
            why = (f"{hub} lists {len(names)} members{note}. I check each one's {label.lower()}; "
                   f"member {position} of {len(names)} is {member}.")
            try:
                page = yield from self._open(member, "person", label.lower(), why)
            except _GiveUp:
                continue
            value = reading.fact(page, label)
            if value is not None:
                values[member] = value
        answer, think = _aggregate_answer(op, spec, plan.get("value"), values, len(names))
        yield render_answer(answer, think)


def _aggregate_answer(op: str, spec: schema.AttributeSpec, filter_value: JsonValue,
                      values: dict[str, str], listed: int) -> tuple[str, str]:
    """The answer from the values read, and a think text saying how it was computed."""
    read = f"I read the {spec.label.lower()} of {len(values)} of the {listed} members."
    if op in ("count_before", "count_taller"):
        cut = int(filter_value) if isinstance(filter_value, int | float | str) else 0
        numbers = [reading.number(value) for value in values.values()]
        if op == "count_before":
            count = sum(1 for n in numbers if n is not None and n < cut)
            return str(count), f"{read} {count} of them were born before {cut}."
        count = sum(1 for n in numbers if n is not None and n > cut)
        return str(count), f"{read} {count} of them are taller than {cut} cm."
    if op == "count_equal":
        count = sum(1 for value in values.values() if reading.same_name(value, str(filter_value)))
        return str(count), f"{read} {count} of them have {filter_value}."
    if op == "mode":
        ranked = Counter(values.values()).most_common()
        if not ranked:
            return "unknown", f"{read} I found no values to compare."
        tally = ", ".join(f"{value}: {count}" for value, count in ranked[:3])
        return ranked[0][0], f"{read} The most common are {tally}."
    if op == "earliest":
        dated = [(reading.number(value), name) for name, value in values.items()]
        known = [(year, name) for year, name in dated if year is not None]
        if not known:
            return "unknown", f"{read} I found no birth years."
        year, name = min(known)
        return name, f"{read} The earliest birth year is {year}, that of {name}."
    raise ValueError(f"unknown aggregation {op!r} in the task plan")


def _address(url: str) -> str:
    """A page address's last part, unquoted (``Big_Stone_Gap_(film)``, however it was escaped)."""
    return unquote(url.rstrip("/").rsplit("/", 1)[-1])


def _title_of(address: str) -> str:
    """A page's title from its address (``Kiss_and_Tell_(1945_film)``; a hashed address's readable
    part, which is a good query though not always the exact title)."""
    return address.split("~", 1)[0].replace("_", " ").strip() or address


def _list(value: JsonValue) -> Sequence[JsonValue]:
    if not isinstance(value, list):
        raise ValueError(f"the task plan holds {value!r} where a list was expected")
    return value


def _pair(value: JsonValue) -> tuple[str, str]:
    items = _list(value)
    if len(items) != 2:
        raise ValueError(f"the task plan holds {value!r} where a [kind, name] pair was expected")
    return str(items[0]), str(items[1])
