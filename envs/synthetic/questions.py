"""Questions about a synthetic world, with unique answers and their recorded clue chains.

Two families, both checked for a unique answer when generated (a candidate that fails is resampled):

- *chain* questions follow 2–8 functional relations (``min_hops``/``max_hops``; 0 asks about the
  start itself) from a named start entity and ask for an attribute of (or the name of) the entity
  reached: "What is the birth year of the founder of the
  publisher of the novel "The Hollow Atlas"?". Each hop is one page to read.
- *aggregation* questions ask about every member of a hub organisation ("How many members of
  Quorin Society were born before 1950?"), so a solver reads 50–90 member pages: 100+ tool calls.

Each task records its clue chain (``Clue`` objects with the evidence pages, docs/algorithms.md §6) and, in
``metadata``, the plan's *structure* (start name, relations to follow, attribute or hub + filter).
The scripted expert uses that structure but reads every fact from the pages through the tools.
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, replace

from turnstile.envs.synthetic import schema
from turnstile.envs.synthetic.render import page_path
from turnstile.envs.synthetic.world import Entity, World, WorldConfig, generate_world
from turnstile.envs.tasks import Clue, Task
from turnstile.envs.tools.base import JsonValue

AGGREGATE_OPS = ("count_before", "count_equal", "count_taller", "mode", "earliest")


@dataclass(frozen=True)
class QuestionConfig:
    """How many questions of which kind. Aggregations use hubs of ``aggregation_min_members`` to
    ``aggregation_max_members`` members (about two tool calls per member)."""

    count: int = 200
    seed: int = 0
    aggregation_fraction: float = 0.15
    min_hops: int = 2
    max_hops: int = 8
    entity_answer_fraction: float = 0.25
    aggregation_min_members: int = 50
    aggregation_max_members: int = 90
    max_attempts: int = 200  # per question, before giving up with an error

    def validate(self) -> None:
        if not 0 <= self.min_hops <= self.max_hops:
            raise ValueError("questions.min_hops must be >= 0 and <= questions.max_hops")
        if not 0.0 <= self.aggregation_fraction <= 1.0:
            raise ValueError("questions.aggregation_fraction must lie in [0, 1]")


class _Rejected(Exception):
    """A sampled candidate has no unique answer (or repeats a question); sample another."""


def generate_tasks(world: World, config: QuestionConfig | None = None, base_url: str = "") -> list[Task]:
    """``config.count`` tasks over ``world``; evidence URLs are ``base_url + /wiki/<slug>``."""
    cfg = config or QuestionConfig()
    cfg.validate()
    rng = random.Random(f"turnstile-synthetic-questions-{world.config.seed}-{cfg.seed}")
    n_aggregate = round(cfg.count * cfg.aggregation_fraction)  # checked against the hubs below
    hubs = [hub for hub in world.hubs()
            if cfg.aggregation_min_members <= len(world.members(hub)) <= cfg.aggregation_max_members]
    if n_aggregate and not hubs:
        raise ValueError(
            f"no hub of this world has {cfg.aggregation_min_members}-{cfg.aggregation_max_members} "
            "members: widen questions.aggregation_*_members or raise world.hubs")
    kinds = question_kinds(cfg, world.config.seed)
    builder = _TaskBuilder(world, base_url.rstrip("/"))
    seen: set[str] = set()
    tasks: list[Task] = []
    for number, kind in enumerate(kinds):
        task_id = f"synthetic-s{world.config.seed}-q{number:04d}"
        for _attempt in range(cfg.max_attempts):
            try:
                task = (builder.aggregate(rng, task_id, hubs) if kind == "aggregate"
                        else builder.chain(rng, task_id, cfg))
            except _Rejected:
                continue
            if task.question not in seen:
                break
        else:
            raise RuntimeError(f"could not sample a unique {kind} question after {cfg.max_attempts} "
                               "tries: use a larger world or fewer questions")
        seen.add(task.question)
        tasks.append(task)
    return tasks


KIND_BLOCK = 20


def question_kinds(cfg: QuestionConfig, world_seed: int) -> list[str]:
    """The kind of each question, drawn block by block so that the first n questions are the same
    whatever ``count`` is (a rollout on 8 questions sees the first 8 of the 200): every block of 20
    holds the configured share of aggregation questions at shuffled positions."""
    rng = random.Random(f"turnstile-synthetic-kinds-{world_seed}-{cfg.seed}")
    per_block = round(KIND_BLOCK * cfg.aggregation_fraction)
    kinds: list[str] = []
    while len(kinds) < cfg.count:
        block = ["aggregate"] * per_block + ["chain"] * (KIND_BLOCK - per_block)
        rng.shuffle(block)
        kinds.extend(block)
    return kinds[: cfg.count]


def load_synthetic_tasks(seed: int = 0, n: int = 200, base_url: str = "",
                         world: WorldConfig | None = None,
                         questions: QuestionConfig | None = None) -> list[Task]:
    """Tasks of the synthetic world of ``seed`` (the world config's other fields as given)."""
    world_cfg = replace(world or WorldConfig(), seed=seed)
    question_cfg = replace(questions or QuestionConfig(), count=n)
    return generate_tasks(generate_world(world_cfg), question_cfg, base_url)


def start_description(entity: Entity) -> str:
    """How a question names its start entity."""
    if entity.kind == "city":
        return f"the city of {entity.name}"
    if entity.kind == "work":
        return f'the {entity.attributes["form"]} "{entity.name}"'
    if entity.kind == "product":
        return f'the {str(entity.attributes["category"]).lower()} "{entity.name}"'
    if entity.kind == "event":
        return f'the event "{entity.name}"'
    return entity.name


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


class _TaskBuilder:
    def __init__(self, world: World, base_url: str) -> None:
        self.world = world
        self.base_url = base_url

    def url(self, entity: Entity) -> str:
        return self.base_url + page_path(entity.slug)

    def chain(self, rng: random.Random, task_id: str, cfg: QuestionConfig) -> Task:
        hops = rng.randint(cfg.min_hops, cfg.max_hops)
        start = rng.choice(self.world.of_kind(rng.choice(schema.KINDS)))
        visited, path = [start], []
        for _ in range(hops):
            here = visited[-1]
            options = [spec for spec in schema.relations_of(here.kind)
                       if (target := self.world.target(here, spec.name)) is not None
                       and target not in visited]
            if not options:
                raise _Rejected
            spec = rng.choice(options)
            path.append(spec)
            visited.append(self.world.entities[here.relations[spec.name]])

        phrase, clues = start_description(start), []
        steps = zip(path, visited[:-1], visited[1:], strict=True)
        for number, (spec, source, target) in enumerate(steps):
            phrase = spec.phrase.format(x=phrase)
            clues.append(Clue(f"hop{number + 1}", f"{spec.label} of {source.name}: {target.name}",
                              "bridge", (self.url(source),), (target.name,)))
        end = visited[-1]
        attribute: schema.AttributeSpec | None = None
        if hops and rng.random() < cfg.entity_answer_fraction:  # 0 hops: an attribute of the start
            question = f"What is the name of {phrase}?"
            answers: tuple[str, ...] = (end.name,)
            clues[-1] = Clue(clues[-1].id, clues[-1].text, "answer", clues[-1].evidence_urls,
                             clues[-1].aliases)
        else:
            attribute = rng.choice([spec for spec in schema.attributes_of(end.kind) if spec.askable])
            value = end.attributes[attribute.name]
            answers = (schema.format_value(attribute, value), *schema.value_aliases(attribute, value))
            question = f"What is {attribute.phrase.format(x=phrase)}?"
            clues.append(Clue("answer", f"{attribute.label} of {end.name}: {answers[0]}", "answer",
                              (self.url(end),), answers[1:]))
        question = _sentence(question)
        if any(answer.lower() in question.lower() for answer in answers):
            raise _Rejected  # the question would give its answer away
        plan: dict[str, JsonValue] = {
            "kind": "chain",
            "start": start.name,
            "start_kind": start.kind,
            "path": [[spec.kind, spec.name] for spec in path],
            "attribute": None if attribute is None else [attribute.kind, attribute.name],
            "hops": hops,
            "world_seed": self.world.config.seed,
            "js_pages": sum(entity.js_only for entity in visited),
        }
        return Task(task_id, question, answers, tuple(clues), plan)

    def aggregate(self, rng: random.Random, task_id: str, hubs: list[Entity]) -> Task:
        hub = rng.choice(hubs)
        members = self.world.members(hub)
        op = rng.choice(AGGREGATE_OPS)
        attribute, value, question, answer = self._aggregate_question(rng, op, hub, members)
        spec = schema.attribute("person", attribute)
        clues = [Clue("members", f"{hub.name} has {len(members)} members", "bridge",
                      (self.url(hub),), (str(len(members)),))]
        for number, person in enumerate(members, start=1):
            shown = schema.format_value(spec, person.attributes[attribute])
            clues.append(Clue(f"member{number}", f"{spec.label} of {person.name}: {shown}",
                              "constraint", (self.url(person),), (person.name,)))
        clues.append(Clue("answer", f"Answer: {answer}", "answer", (self.url(hub),), ()))
        plan: dict[str, JsonValue] = {
            "kind": "aggregate",
            "hub": hub.name,
            "op": op,
            "attribute": ["person", attribute],
            "value": value,
            "members": len(members),
            "world_seed": self.world.config.seed,
            "js_pages": sum(entity.js_only for entity in [hub, *members]),
        }
        return Task(task_id, question, (answer,), tuple(clues), plan)

    def _aggregate_question(self, rng: random.Random, op: str, hub: Entity,
                            members: list[Entity]) -> tuple[str, int | str | None, str, str]:
        """(attribute, filter value, question, answer) for one aggregation over ``members``."""
        def values(attribute: str) -> list[int | str]:
            return [person.attributes[attribute] for person in members]

        if op == "count_before":
            years = sorted(int(year) for year in values("born"))
            cut = rng.choice(years[len(years) // 4: 3 * len(years) // 4])
            count = sum(year < cut for year in years)
            return "born", cut, f"How many members of {hub.name} were born before {cut}?", str(count)
        if op == "count_taller":
            heights = sorted(int(height) for height in values("height"))
            cut = rng.choice(heights[len(heights) // 4: 3 * len(heights) // 4])
            count = sum(height > cut for height in heights)
            return ("height", cut, f"How many members of {hub.name} are taller than {cut} cm?",
                    str(count))
        if op == "count_equal":
            attribute = rng.choice(("occupation", "colour"))
            target = str(rng.choice(values(attribute)))
            count = sum(value == target for value in values(attribute))
            what = "occupation" if attribute == "occupation" else "favourite colour"
            return (attribute, target, f"How many members of {hub.name} have {target} as their "
                    f"{what}?", str(count))
        if op == "mode":
            attribute = rng.choice(("occupation", "colour"))
            ranked = Counter(str(value) for value in values(attribute)).most_common()
            if len(ranked) > 1 and ranked[0][1] == ranked[1][1]:
                raise _Rejected  # a tie has no unique answer
            what = "occupation" if attribute == "occupation" else "favourite colour"
            return (attribute, None, f"Which {what} is the most common among the members of "
                    f"{hub.name}?", ranked[0][0])
        if op == "earliest":
            births = sorted((int(person.attributes["born"]), person.name) for person in members)
            if len(births) > 1 and births[0][0] == births[1][0]:
                raise _Rejected  # two members born in the same earliest year
            return "born", None, f"Which member of {hub.name} was born first?", births[0][1]
        raise ValueError(f"unknown aggregation {op!r}: choose one of {AGGREGATE_OPS}")
