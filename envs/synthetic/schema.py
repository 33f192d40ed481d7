"""The vocabulary of the synthetic world: entity kinds, their attributes and their relations.

One table drives everything that must agree with everything else: the generator fills these fields,
the renderer writes each one as a ``Label: value`` fact line and a prose sentence, the question
generator phrases hops with their noun phrases, and the scripted expert knows which fact line to read
for a hop. Keeping the labels here (and nowhere else) is what lets the expert parse pages by label
without ever looking at the world object.
"""

from __future__ import annotations

from dataclasses import dataclass

KINDS = ("person", "organisation", "city", "country", "work", "product", "event")


@dataclass(frozen=True)
class AttributeSpec:
    """A value on an entity's page.

    ``value_type`` is ``year``, ``number`` (shown with thousands separators), ``category`` (a word
    from a fixed list) or ``text``. ``unit`` is appended when shown ("183 cm"). ``phrase`` turns a
    noun phrase for the entity into one for the value: "the birth year of {x}".
    """

    kind: str
    name: str
    label: str
    value_type: str
    phrase: str
    unit: str = ""
    askable: bool = True


@dataclass(frozen=True)
class RelationSpec:
    """A functional link from an entity to exactly one other entity (``optional``: to at most one).

    ``label`` is the fact line ("Founder: Aldo Venmar"); ``phrase`` is the hop as a noun phrase
    ("the founder of {x}"); ``target`` is the kind of entity linked to.
    """

    kind: str
    name: str
    label: str
    target: str
    phrase: str
    optional: bool = False


ATTRIBUTES: tuple[AttributeSpec, ...] = (
    AttributeSpec("person", "born", "Born", "year", "the birth year of {x}"),
    AttributeSpec("person", "occupation", "Occupation", "category", "the occupation of {x}"),
    AttributeSpec("person", "colour", "Favourite colour", "category", "the favourite colour of {x}"),
    AttributeSpec("person", "height", "Height", "number", "the height in centimetres of {x}", "cm"),
    AttributeSpec("organisation", "founded", "Founded", "year", "the founding year of {x}"),
    AttributeSpec("organisation", "sector", "Sector", "category", "the sector of {x}"),
    AttributeSpec("organisation", "colour", "Brand colour", "category", "the brand colour of {x}"),
    AttributeSpec("organisation", "employees", "Employees", "number",
                  "the number of employees of {x}"),
    AttributeSpec("city", "founded", "Founded", "year", "the founding year of {x}"),
    AttributeSpec("city", "population", "Population", "number", "the population of {x}"),
    AttributeSpec("city", "elevation", "Elevation", "number", "the elevation in metres of {x}", "m"),
    AttributeSpec("country", "region", "Region", "category", "the region of {x}"),
    AttributeSpec("country", "population", "Population", "number", "the population of {x}"),
    AttributeSpec("country", "currency", "Currency", "text", "the currency of {x}"),
    AttributeSpec("work", "form", "Form", "category", "the form of {x}", askable=False),
    AttributeSpec("work", "year", "Published", "year", "the publication year of {x}"),
    AttributeSpec("work", "genre", "Genre", "category", "the genre of {x}"),
    AttributeSpec("product", "category", "Category", "category", "the product category of {x}"),
    AttributeSpec("product", "launched", "Launched", "year", "the launch year of {x}"),
    AttributeSpec("product", "price", "Price", "number", "the price in crowns of {x}", "crowns"),
    AttributeSpec("product", "colour", "Colour", "category", "the colour of {x}"),
    AttributeSpec("event", "form", "Form", "category", "the type of event of {x}", askable=False),
    AttributeSpec("event", "year", "Year", "year", "the year of {x}"),
    AttributeSpec("event", "attendance", "Attendance", "number", "the attendance of {x}"),
)

RELATIONS: tuple[RelationSpec, ...] = (
    RelationSpec("person", "born_in", "Birthplace", "city", "the birthplace of {x}"),
    RelationSpec("person", "member_of", "Member of", "organisation",
                 "the organisation joined by {x}"),
    RelationSpec("person", "mentor", "Mentor", "person", "the mentor of {x}", optional=True),
    RelationSpec("organisation", "founder", "Founder", "person", "the founder of {x}"),
    RelationSpec("organisation", "headquarters", "Headquarters", "city",
                 "the headquarters city of {x}"),
    RelationSpec("city", "country", "Country", "country", "the country of {x}"),
    RelationSpec("city", "mayor", "Mayor", "person", "the mayor of {x}"),
    RelationSpec("country", "capital", "Capital", "city", "the capital of {x}"),
    RelationSpec("country", "leader", "Head of state", "person", "the head of state of {x}"),
    RelationSpec("work", "author", "Creator", "person", "the creator of {x}"),
    RelationSpec("work", "publisher", "Publisher", "organisation", "the publisher of {x}"),
    RelationSpec("product", "manufacturer", "Manufacturer", "organisation",
                 "the manufacturer of {x}"),
    RelationSpec("product", "designer", "Designer", "person", "the designer of {x}"),
    RelationSpec("event", "host_city", "Host city", "city", "the host city of {x}"),
    RelationSpec("event", "organiser", "Organiser", "organisation", "the organiser of {x}"),
    RelationSpec("event", "winner", "Winner", "person", "the winner of {x}"),
)

MEMBER_LABEL = "Member"
"""Fact line of each member on an organisation's page: ``Member: <name> (joined in <year>)``."""

COLOURS = ("Crimson", "Amber", "Teal", "Indigo", "Olive", "Scarlet", "Ivory", "Cobalt", "Maroon",
           "Saffron", "Jade", "Violet")
OCCUPATIONS = ("Cartographer", "Engineer", "Botanist", "Composer", "Architect", "Physician",
               "Sculptor", "Astronomer", "Merchant", "Linguist", "Chemist", "Novelist",
               "Glassblower", "Navigator", "Historian", "Weaver")
SECTORS = ("Shipping", "Publishing", "Mining", "Textiles", "Banking", "Optics", "Agriculture",
           "Railways", "Pharmaceuticals", "Clockmaking", "Brewing", "Aviation")
REGIONS = ("Northern Reach", "Amber Coast", "Eastern Steppe", "Southern Isles", "Western March",
           "Central Basin", "High Plateau", "Lake District")
GENRES = ("mystery", "satire", "romance", "tragedy", "fable", "chronicle", "elegy", "thriller",
          "pastoral", "epic")
WORK_FORMS = ("novel", "album", "film", "play", "poem cycle", "opera", "essay collection")
PRODUCT_CATEGORIES = ("Bicycle", "Lantern", "Typewriter", "Telescope", "Loom", "Radio", "Kettle",
                      "Compass", "Camera", "Sewing machine", "Barometer", "Gramophone")
EVENT_FORMS = ("regatta", "chess tournament", "music festival", "trade fair", "marathon",
               "poetry contest", "summit", "horse race", "film festival", "science congress")

CATEGORY_VALUES: dict[tuple[str, str], tuple[str, ...]] = {
    ("person", "occupation"): OCCUPATIONS,
    ("person", "colour"): COLOURS,
    ("organisation", "sector"): SECTORS,
    ("organisation", "colour"): COLOURS,
    ("country", "region"): REGIONS,
    ("work", "form"): WORK_FORMS,
    ("work", "genre"): GENRES,
    ("product", "category"): PRODUCT_CATEGORIES,
    ("product", "colour"): COLOURS,
    ("event", "form"): EVENT_FORMS,
}


def attributes_of(kind: str) -> tuple[AttributeSpec, ...]:
    return tuple(spec for spec in ATTRIBUTES if spec.kind == kind)


def relations_of(kind: str) -> tuple[RelationSpec, ...]:
    return tuple(spec for spec in RELATIONS if spec.kind == kind)


def attribute(kind: str, name: str) -> AttributeSpec:
    for spec in ATTRIBUTES:
        if spec.kind == kind and spec.name == name:
            return spec
    raise KeyError(f"the synthetic world has no attribute {name!r} on kind {kind!r}")


def relation(kind: str, name: str) -> RelationSpec:
    for spec in RELATIONS:
        if spec.kind == kind and spec.name == name:
            return spec
    raise KeyError(f"the synthetic world has no relation {name!r} on kind {kind!r}")


def format_value(spec: AttributeSpec, value: int | str) -> str:
    """How a value is written on pages and in answers: ``12,400``, ``183 cm``, ``1943``, ``Teal``."""
    if spec.value_type == "number" and isinstance(value, int):
        shown = f"{value:,}"
    else:
        shown = str(value)
    return f"{shown} {spec.unit}" if spec.unit else shown


def value_aliases(spec: AttributeSpec, value: int | str) -> tuple[str, ...]:
    """Other accepted spellings of a value: without unit, without thousands separators."""
    canonical = format_value(spec, value)
    options = [str(value)]
    if spec.value_type == "number" and isinstance(value, int):
        options.append(f"{value:,}")
    return tuple(option for option in dict.fromkeys(options) if option != canonical)
