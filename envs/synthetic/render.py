"""Synthetic entities as web pages: the HTML the corpus server serves and the text the index holds.

Every page has the same shape, chosen so that trafilatura (what the visit tool extracts with) keeps
all of it: a title, a prose paragraph with links to related pages, a ``Facts`` list of
``Label: value`` lines (labels from :mod:`turnstile.envs.synthetic.schema`), and for organisations a
``Members`` list of ``Member: <name> (joined in <year>)`` lines. Plain lists of bare links are dropped
by trafilatura as navigation, which is why every list item carries its label.

A share of pages is JavaScript-only (``Entity.js_only``): the served body is an empty ``<div>`` plus a
script that decodes a base64 JSON payload and builds the article, so static extraction finds nothing
and only a real browser reads the page, as on much of the web.
"""

from __future__ import annotations

import base64
import html
import json
from dataclasses import dataclass

from turnstile.envs.search.base import Document
from turnstile.envs.synthetic import schema
from turnstile.envs.synthetic.world import Entity, World

SITE_NAME = "Synthetic Encyclopedia"
MAX_LISTED = 8  # inverse links (works of a person, ...) shown per page


@dataclass(frozen=True)
class Link:
    text: str
    slug: str


Span = str | Link
Line = tuple[Span, ...]


@dataclass(frozen=True)
class Section:
    heading: str
    paragraphs: tuple[Line, ...] = ()
    items: tuple[Line, ...] = ()


@dataclass(frozen=True)
class Article:
    title: str
    sections: tuple[Section, ...]


def page_path(slug: str) -> str:
    return f"/wiki/{slug}"


def link(entity: Entity) -> Link:
    return Link(entity.name, entity.slug)


def fact_value(entity: Entity, name: str) -> str:
    return schema.format_value(schema.attribute(entity.kind, name), entity.attributes[name])


# ---- content ------------------------------------------------------------------------------------

def article(world: World, entity: Entity) -> Article:
    """What a page says about ``entity``, independent of how it is served."""
    facts: list[Line] = [("Type: " + entity.kind.capitalize(),)]
    for spec in schema.attributes_of(entity.kind):
        facts.append((f"{spec.label}: {fact_value(entity, spec.name)}",))
    for relation in schema.relations_of(entity.kind):
        target = world.target(entity, relation.name)
        if target is not None:
            facts.append((f"{relation.label}: ", link(target)))
    sections = [Section("", paragraphs=(_lead(world, entity),)), Section("Facts", items=tuple(facts))]
    related = _related(world, entity)
    if related:
        sections.append(Section("Related", paragraphs=tuple(related)))
    if entity.kind == "organisation":
        members = world.members(entity)
        noun = "member" if len(members) == 1 else "members"
        sections.append(Section(
            "Members",
            paragraphs=((f"{entity.name} has {len(members)} {noun}.",),),
            items=tuple((f"{schema.MEMBER_LABEL}: ", link(person), f" (joined in {person.joined})")
                        for person in members),
        ))
    return Article(entity.name, tuple(sections))


def _lead(world: World, entity: Entity) -> Line:
    def to(relation: str) -> Link:
        target = world.target(entity, relation)
        if target is None:
            raise ValueError(f"{entity.name} has no {relation!r}: the world generator must set it")
        return link(target)

    name, a = entity.name, entity.attributes
    if entity.kind == "person":
        line: list[Span] = [f"{name} is a {str(a['occupation']).lower()} born in {a['born']} in ",
                            to("born_in"), ". ", f"{name} is a member of ", to("member_of"), "."]
        if "mentor" in entity.relations:
            line += [f" {name} was mentored by ", to("mentor"), "."]
        return tuple(line)
    if entity.kind == "organisation":
        return (f"{name} is a {str(a['sector']).lower()} organisation founded in {a['founded']} by ",
                to("founder"), ". Its headquarters are in ", to("headquarters"),
                f". It employs {fact_value(entity, 'employees')} people and its colour is "
                f"{str(a['colour']).lower()}.")
    if entity.kind == "city":
        return (f"{name} is a city in ", to("country"), f", founded in {a['founded']}. It has a "
                f"population of {fact_value(entity, 'population')} and lies "
                f"{fact_value(entity, 'elevation')} above sea level. Its mayor is ", to("mayor"), ".")
    if entity.kind == "country":
        return (f"{name} is a country in the {a['region']} region. Its capital is ", to("capital"),
                " and its head of state is ", to("leader"),
                f". It has a population of {fact_value(entity, 'population')} and pays in the "
                f"{a['currency']}.")
    if entity.kind == "work":
        return (f"{name} is a {a['genre']} {a['form']} by ", to("author"),
                f", published in {a['year']} by ", to("publisher"), ".")
    if entity.kind == "product":
        return (f"{name} is a {str(a['category']).lower()} made by ", to("manufacturer"),
                " and designed by ", to("designer"), f". It was launched in {a['launched']}, "
                f"sells for {fact_value(entity, 'price')} and comes in {str(a['colour']).lower()}.")
    if entity.kind == "event":
        return (f"{name} is a {a['form']} held in ", to("host_city"), f" in {a['year']}, organised "
                "by ", to("organiser"), ". It was won by ", to("winner"),
                f" and drew {fact_value(entity, 'attendance')} visitors.")
    raise ValueError(f"no page template for entity kind {entity.kind!r}")


_INVERSE_SENTENCES = (
    ("person", "author", "{name} created "),
    ("person", "founder", "{name} founded "),
    ("person", "winner", "{name} won "),
    ("person", "mayor", "{name} is the mayor of "),
    ("organisation", "publisher", "{name} published "),
    ("organisation", "manufacturer", "{name} makes "),
    ("organisation", "organiser", "{name} organised "),
    ("city", "host_city", "{name} hosted "),
    ("country", "country", "Cities of {name} include "),
)


def _related(world: World, entity: Entity) -> list[Line]:
    lines: list[Line] = []
    for kind, relation, sentence in _INVERSE_SENTENCES:
        if kind != entity.kind:
            continue
        linked = world.linking(entity, relation)[:MAX_LISTED]
        if not linked:
            continue
        spans: list[Span] = [sentence.format(name=entity.name)]
        for position, other in enumerate(linked):
            if position:
                spans.append(" and " if position == len(linked) - 1 else ", ")
            spans.append(link(other))
        spans.append(".")
        lines.append(tuple(spans))
    return lines


# ---- output -------------------------------------------------------------------------------------

def line_text(line: Line) -> str:
    return "".join(span.text if isinstance(span, Link) else span for span in line)


def line_html(line: Line) -> str:
    return "".join(
        f'<a href="{page_path(span.slug)}">{html.escape(span.text)}</a>' if isinstance(span, Link)
        else html.escape(span)
        for span in line
    )


def article_text(content: Article) -> str:
    """The readable text of a page (what the search index holds)."""
    out = [content.title]
    for section in content.sections:
        if section.heading:
            out.append(section.heading)
        out.extend(line_text(line) for line in section.paragraphs)
        out.extend(line_text(line) for line in section.items)
    return "\n".join(out)


def article_html(content: Article) -> str:
    """The ``<article>`` element of a page."""
    out = [f"<article>\n<h1>{html.escape(content.title)}</h1>"]
    for section in content.sections:
        if section.heading:
            out.append(f"<h2>{html.escape(section.heading)}</h2>")
        out.extend(f"<p>{line_html(line)}</p>" for line in section.paragraphs)
        if section.items:
            out.append("<ul>\n" + "\n".join(f"<li>{line_html(line)}</li>" for line in section.items)
                       + "\n</ul>")
    out.append("</article>")
    return "\n".join(out)


def page_html(content: Article, js_only: bool = False) -> str:
    """A whole served page; ``js_only`` pages carry the article only inside a script payload."""
    title = html.escape(f"{content.title} - {SITE_NAME}")
    body = (
        f'<header><nav><a href="/">{SITE_NAME}</a></nav></header>\n'
        f"<main>\n{article_html(content)}\n</main>\n"
        f"<footer>{SITE_NAME}: a generated world; every fact here is fiction.</footer>"
    )
    if js_only:
        payload = base64.b64encode(json.dumps({"body": body}).encode("utf-8")).decode("ascii")
        body = f'<div id="app"></div>\n<script>\n{_JS_LOADER.replace("PAYLOAD", payload)}\n</script>'
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        f"<title>{title}</title>\n</head>\n<body>\n{body}\n</body>\n</html>\n"
    )


_JS_LOADER = (
    '(function () {\n'
    '  var raw = atob("PAYLOAD");\n'
    '  var bytes = new Uint8Array(raw.length);\n'
    '  for (var i = 0; i < raw.length; i++) { bytes[i] = raw.charCodeAt(i); }\n'
    '  var data = JSON.parse(new TextDecoder("utf-8").decode(bytes));\n'
    '  document.getElementById("app").innerHTML = data.body;\n'
    '})();'
)


def entity_document(world: World, entity: Entity, base_url: str) -> Document:
    content = article(world, entity)
    return Document(doc_id=entity.slug, title=entity.name, text=article_text(content),
                    url=base_url.rstrip("/") + page_path(entity.slug),
                    html=page_html(content, js_only=entity.js_only))


def world_documents(world: World, base_url: str = "") -> list[Document]:
    """One :class:`Document` per entity; ``url`` is ``base_url + /wiki/<slug>``."""
    return [entity_document(world, entity, base_url) for entity in world.entities]
