"""A seeded, procedurally generated encyclopedia world: the project's offline default corpus.

The demo and every test need a corpus with known answers, multi-hop structure and large lists, and
no internet. :func:`generate_world` builds one from a seed alone (pure Python, ``random.Random``):
people, organisations, cities, countries, works, products and events, each with attributes
(years, numbers, categories) and functional relations (founder, birthplace, publisher, ...). A few
organisations are *hubs* with 50–150 members, the material of aggregation questions.

The same seed gives the same world, byte for byte; another seed gives other names and facts, so
nothing can be memorised across seeds. Rendering to pages is :mod:`turnstile.envs.synthetic.render`.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from turnstile.envs.synthetic import schema
from turnstile.envs.synthetic.names import NameBook

_KIND_SHARES = {"organisation": 0.093, "city": 0.107, "country": 0.012, "work": 0.14,
                "product": 0.067, "event": 0.048}  # people take the rest (about 53%)
_MIN_COUNTS = {"organisation": 4, "city": 8, "country": 2, "work": 4, "product": 4, "event": 4}
LAST_YEAR = 2024


@dataclass(frozen=True)
class WorldConfig:
    """Size and shape of a synthetic world.

    ``hubs`` organisations get between ``hub_min_members`` and ``hub_max_members`` members (sizes
    spread over the range, more of them near the low end); ``js_fraction`` of the pages are served
    as JavaScript-only pages that only a real browser can read.
    """

    seed: int = 0
    entities: int = 3000
    js_fraction: float = 0.12
    hubs: int = 14
    hub_min_members: int = 50
    hub_max_members: int = 150

    def validate(self) -> None:
        if self.entities < 100:
            raise ValueError(f"world.entities={self.entities} is too small: use at least 100")
        if not 0.0 <= self.js_fraction <= 1.0:
            raise ValueError(f"world.js_fraction={self.js_fraction} must lie in [0, 1]")
        if self.hubs < 0 or not 1 <= self.hub_min_members <= self.hub_max_members:
            raise ValueError("world.hubs must be >= 0 and 1 <= hub_min_members <= hub_max_members")
        people = self.entities - sum(_counts(self.entities).values())
        if sum(nominal_hub_sizes(self)) + 2 * self.hubs > people:
            raise ValueError(
                f"{self.hubs} hubs of {self.hub_min_members}-{self.hub_max_members} members need more "
                f"people than the "
                f"{people} a world of {self.entities} entities has: raise world.entities or lower "
                "world.hubs / world.hub_max_members")


@dataclass
class Entity:
    """One thing in the world, with its own page.

    ``relations`` maps a relation name of :mod:`turnstile.envs.synthetic.schema` to the index of the linked
    entity. ``joined`` is, for a person, the year they joined the organisation they are a member of.
    """

    index: int
    kind: str
    name: str
    slug: str
    attributes: dict[str, int | str] = field(default_factory=dict)
    relations: dict[str, int] = field(default_factory=dict)
    js_only: bool = False
    hub: bool = False
    joined: int = 0


@dataclass
class World:
    config: WorldConfig
    entities: list[Entity]

    def __post_init__(self) -> None:
        self._by_name = {entity.name: entity for entity in self.entities}
        self._by_slug = {entity.slug: entity for entity in self.entities}
        self._members: dict[int, list[Entity]] = {}
        self._inverse: dict[tuple[int, str], list[Entity]] = {}
        for entity in self.entities:
            for relation, target in entity.relations.items():
                self._inverse.setdefault((target, relation), []).append(entity)
                if relation == "member_of":
                    self._members.setdefault(target, []).append(entity)
        for members in self._members.values():
            members.sort(key=lambda person: (person.joined, person.name))

    def __len__(self) -> int:
        return len(self.entities)

    def by_name(self, name: str) -> Entity:
        return self._by_name[name]

    def by_slug(self, slug: str) -> Entity | None:
        return self._by_slug.get(slug)

    def of_kind(self, kind: str) -> list[Entity]:
        return [entity for entity in self.entities if entity.kind == kind]

    def target(self, entity: Entity, relation: str) -> Entity | None:
        index = entity.relations.get(relation)
        return None if index is None else self.entities[index]

    def members(self, organisation: Entity) -> list[Entity]:
        """The members of an organisation in the order its page lists them (by year joined)."""
        return list(self._members.get(organisation.index, []))

    def linking(self, entity: Entity, relation: str) -> list[Entity]:
        """Entities whose ``relation`` points at ``entity`` (e.g. the works a person created)."""
        return list(self._inverse.get((entity.index, relation), []))

    def hubs(self) -> list[Entity]:
        return [entity for entity in self.entities if entity.hub]


def nominal_hub_sizes(cfg: WorldConfig) -> list[int]:
    """Hub sizes spread over [min, max], denser at the low end (the generator adds +-2 jitter)."""
    n, low, high = cfg.hubs, cfg.hub_min_members, cfg.hub_max_members
    return [round(low + (high - low) * (i / max(n - 1, 1)) ** 1.6) for i in range(n)]


def slugify(name: str) -> str:
    """A page's path segment as Wikipedia writes it: the name with underscores for spaces and
    punctuation ("Kratro Labyrinth" -> "Kratro_Labyrinth"). The address then holds the name's own
    tokens, so a policy copies the page it wants from the name it is reading about."""
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_")


def _counts(entities: int) -> dict[str, int]:
    return {kind: max(_MIN_COUNTS[kind], round(share * entities))
            for kind, share in _KIND_SHARES.items()}


def generate_world(config: WorldConfig | None = None) -> World:
    """Build the world for ``config`` (deterministic in ``config``)."""
    cfg = config or WorldConfig()
    cfg.validate()
    return _Builder(cfg).build()


class _Builder:
    def __init__(self, cfg: WorldConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(f"turnstile-synthetic-world-{cfg.seed}")
        self.names = NameBook(self.rng)
        self.entities: list[Entity] = []
        counts = _counts(cfg.entities)
        self.counts = {"person": cfg.entities - sum(counts.values()), **counts}

    def new(self, kind: str, name: str, hub: bool = False) -> Entity:
        slug = slugify(name)
        entity = Entity(len(self.entities), kind, name, slug, hub=hub,
                        js_only=self.rng.random() < self.cfg.js_fraction)
        self.entities.append(entity)
        return entity

    def category(self, entity: Entity, attribute: str) -> str:
        return self.rng.choice(schema.CATEGORY_VALUES[(entity.kind, attribute)])

    def build(self) -> World:
        countries = [self.new("country", self.names.country()) for _ in range(self.counts["country"])]
        cities = [self.new("city", self.names.city()) for _ in range(self.counts["city"])]
        given, family = self.names.pools(max(40, self.counts["person"] // 4),
                                         max(60, self.counts["person"] // 2))
        people = [self.new("person", self.names.person(given, family))
                  for _ in range(self.counts["person"])]
        hub_count = self.cfg.hubs
        organisations = [self.new("organisation", self.names.organisation(hub=i < hub_count),
                                  hub=i < hub_count)
                         for i in range(max(self.counts["organisation"], hub_count))]
        works = [self.new("work", self.names.work()) for _ in range(self.counts["work"])]
        products = [self.new("product", self.names.product()) for _ in range(self.counts["product"])]
        events = [self.new("event", self.names.event()) for _ in range(self.counts["event"])]

        self.place_cities(countries, cities)
        self.describe_people(people, cities)
        self.found_organisations(organisations, people, cities)
        self.enrol_members(organisations, people)
        self.assign_mentors(people)
        self.govern(countries, cities, people)
        self.create_works(works, people, organisations)
        self.make_products(products, people, organisations)
        self.hold_events(events, people, organisations, cities)
        return World(self.cfg, self.entities)

    def place_cities(self, countries: list[Entity], cities: list[Entity]) -> None:
        for position, city in enumerate(cities):
            country = countries[position] if position < len(countries) else self.rng.choice(countries)
            city.relations["country"] = country.index
            city.attributes["founded"] = self.rng.randint(900, 1950)
            city.attributes["population"] = int(10 ** self.rng.uniform(3.3, 6.9))
            city.attributes["elevation"] = self.rng.randint(0, 3200)

    def describe_people(self, people: list[Entity], cities: list[Entity]) -> None:
        for person in people:
            person.attributes["born"] = self.rng.randint(1890, 2004)
            person.attributes["occupation"] = self.category(person, "occupation")
            person.attributes["colour"] = self.category(person, "colour")
            person.attributes["height"] = self.rng.randint(150, 201)
            person.relations["born_in"] = self.rng.choice(cities).index

    def adult_in(self, people: list[Entity], year: int) -> Entity:
        """Someone at least 20 in ``year`` (anyone, when nobody is)."""
        for _ in range(50):
            person = self.rng.choice(people)
            if int(person.attributes["born"]) <= year - 20:
                return person
        return self.rng.choice(people)

    def found_organisations(self, organisations: list[Entity], people: list[Entity],
                            cities: list[Entity]) -> None:
        for organisation in organisations:
            founded = self.rng.randint(1915, 2015)
            organisation.attributes["founded"] = founded
            organisation.attributes["sector"] = self.category(organisation, "sector")
            organisation.attributes["colour"] = self.category(organisation, "colour")
            organisation.attributes["employees"] = int(10 ** self.rng.uniform(1.2, 5.3))
            organisation.relations["founder"] = self.adult_in(people, founded).index
            organisation.relations["headquarters"] = self.rng.choice(cities).index

    def hub_sizes(self) -> list[int]:
        low, high = self.cfg.hub_min_members, self.cfg.hub_max_members
        return [min(high, max(low, size + self.rng.randint(-2, 2)))
                for size in nominal_hub_sizes(self.cfg)]

    def enrol_members(self, organisations: list[Entity], people: list[Entity]) -> None:
        pool = list(people)
        self.rng.shuffle(pool)
        hubs = [organisation for organisation in organisations if organisation.hub]
        others = [organisation for organisation in organisations if not organisation.hub] or hubs
        start = 0
        for hub, size in zip(hubs, self.hub_sizes(), strict=True):
            # Societies attract like-minded people: a skew makes "most common" questions decidable.
            favoured = {attribute: self.rng.choice(schema.CATEGORY_VALUES[("person", attribute)])
                        for attribute in ("colour", "occupation")}
            for person in pool[start:start + size]:
                self.join(person, hub)
                for attribute, value in favoured.items():
                    if self.rng.random() < 0.15:
                        person.attributes[attribute] = value
            start += size
        for person in pool[start:]:
            self.join(person, self.rng.choice(others))

    def join(self, person: Entity, organisation: Entity) -> None:
        person.relations["member_of"] = organisation.index
        earliest = max(int(person.attributes["born"]) + 16, int(organisation.attributes["founded"]))
        person.joined = self.rng.randint(min(earliest, LAST_YEAR), LAST_YEAR)

    def assign_mentors(self, people: list[Entity]) -> None:
        for person in people:
            if self.rng.random() < 0.6:
                mentor = self.rng.choice(people)
                if int(mentor.attributes["born"]) <= int(person.attributes["born"]) - 10:
                    person.relations["mentor"] = mentor.index

    def govern(self, countries: list[Entity], cities: list[Entity], people: list[Entity]) -> None:
        for city in cities:
            city.relations["mayor"] = self.adult_in(people, LAST_YEAR).index
        for country in countries:
            own = [city for city in cities if city.relations["country"] == country.index]
            capital = self.rng.choice(own)
            country.relations["capital"] = capital.index
            country.relations["leader"] = self.adult_in(people, LAST_YEAR).index
            country.attributes["region"] = self.category(country, "region")
            total = sum(int(city.attributes["population"]) for city in own)
            country.attributes["population"] = int(total * self.rng.uniform(1.5, 4.0))
            country.attributes["currency"] = self.names.currency(country.name)

    def create_works(self, works: list[Entity], people: list[Entity],
                     organisations: list[Entity]) -> None:
        for work in works:
            author = self.rng.choice(people)
            born = int(author.attributes["born"])
            work.attributes["form"] = self.category(work, "form")
            work.attributes["year"] = self.rng.randint(min(born + 18, LAST_YEAR), LAST_YEAR)
            work.attributes["genre"] = self.category(work, "genre")
            work.relations["author"] = author.index
            work.relations["publisher"] = self.rng.choice(organisations).index

    def make_products(self, products: list[Entity], people: list[Entity],
                      organisations: list[Entity]) -> None:
        for product in products:
            maker = self.rng.choice(organisations)
            founded = int(maker.attributes["founded"])
            product.attributes["category"] = self.category(product, "category")
            product.attributes["launched"] = self.rng.randint(founded, LAST_YEAR)
            product.attributes["price"] = self.rng.randint(12, 9_800)
            product.attributes["colour"] = self.category(product, "colour")
            product.relations["manufacturer"] = maker.index
            designer = self.adult_in(people, int(product.attributes["launched"]))
            product.relations["designer"] = designer.index

    def hold_events(self, events: list[Entity], people: list[Entity], organisations: list[Entity],
                    cities: list[Entity]) -> None:
        for event in events:
            year = self.rng.randint(1950, LAST_YEAR)
            event.attributes["form"] = self.category(event, "form")
            event.attributes["year"] = year
            event.attributes["attendance"] = self.rng.randint(150, 250_000)
            event.relations["host_city"] = self.rng.choice(cities).index
            event.relations["organiser"] = self.rng.choice(organisations).index
            event.relations["winner"] = self.adult_in(people, year).index
