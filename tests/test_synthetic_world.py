"""The synthetic world and its pages: determinism, names, relations, hubs, and what extraction keeps."""

from __future__ import annotations

import base64
import json
import re

import pytest

from turnstile.envs.synthetic import schema
from turnstile.envs.synthetic.render import article, line_text, world_documents
from turnstile.envs.synthetic.world import World, WorldConfig, generate_world, slugify
from turnstile.envs.visit.extract import ExtractConfig, extract_text


@pytest.fixture(scope="module")
def world() -> World:
    return generate_world(WorldConfig(seed=0))


def _fingerprint(world: World) -> list[tuple[str, str, dict[str, int | str], dict[str, int], bool]]:
    return [(e.kind, e.name, e.attributes, e.relations, e.js_only) for e in world.entities]


def test_same_seed_same_world_and_pages(world: World) -> None:
    again = generate_world(WorldConfig(seed=0))
    assert _fingerprint(again) == _fingerprint(world)
    assert [d.html for d in world_documents(again)[:50]] == [d.html for d in world_documents(world)[:50]]


def test_other_seed_other_names(world: World) -> None:
    other = generate_world(WorldConfig(seed=1))
    shared = {e.name for e in world.entities} & {e.name for e in other.entities}
    assert len(shared) < 0.01 * len(world), "names must not carry over between seeds"


def test_default_size_kinds_and_unique_names(world: World) -> None:
    assert len(world) == 3000
    assert {e.kind for e in world.entities} == set(schema.KINDS)
    names = [e.name.casefold() for e in world.entities]
    assert len(set(names)) == len(names)
    assert len({e.slug for e in world.entities}) == len(world)
    assert all(e.slug == slugify(e.name) and re.fullmatch(r"[A-Za-z0-9_]+", e.slug) for e in world.entities)


def test_every_required_relation_points_at_the_right_kind(world: World) -> None:
    for entity in world.entities:
        for spec in schema.relations_of(entity.kind):
            target = world.target(entity, spec.name)
            if target is None:
                assert spec.optional, f"{entity.name} lacks {spec.name}"
                continue
            assert target.kind == spec.target and target is not entity
        for spec in schema.attributes_of(entity.kind):
            assert spec.name in entity.attributes
    for country in world.of_kind("country"):
        capital = world.target(country, "capital")
        assert capital is not None and capital.relations["country"] == country.index


def test_hubs_have_50_to_150_members(world: World) -> None:
    sizes = [len(world.members(hub)) for hub in world.hubs()]
    assert len(sizes) == WorldConfig().hubs
    assert all(50 <= size <= 150 for size in sizes)
    assert sum(size <= 90 for size in sizes) >= 5, "aggregation questions need hubs of 50-90"


def test_js_fraction_is_a_minority(world: World) -> None:
    share = sum(e.js_only for e in world.entities) / len(world)
    assert 0.08 <= share <= 0.16


def test_too_many_hub_members_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"raise world.entities"):
        generate_world(WorldConfig(entities=300, hubs=10))


def test_documents_urls_text_and_html(world: World) -> None:
    docs = world_documents(world, "http://127.0.0.1:9/")
    person = next(e for e in world.of_kind("person") if not e.js_only)
    doc = docs[person.index]
    assert doc.doc_id == person.slug and doc.title == person.name
    assert doc.url == f"http://127.0.0.1:9/wiki/{person.slug}"
    born_in = world.target(person, "born_in")
    assert born_in is not None
    assert f"Birthplace: {born_in.name}" in doc.text
    assert f'<a href="/wiki/{born_in.slug}">' in (doc.html or "")


def test_static_extraction_keeps_every_fact_line(world: World) -> None:
    """What trafilatura returns for a static page holds each fact and member line verbatim."""
    docs = world_documents(world)
    static = [e for e in world.entities if not e.js_only]
    sample = static[::9] + [hub for hub in world.hubs() if not hub.js_only]
    for favor in ("balanced", "precision"):
        for entity in sample[:: 1 if favor == "balanced" else 4]:
            text = extract_text(docs[entity.index].html or "", config=ExtractConfig(favor=favor))
            lines = {line.lstrip("-* ").strip() for line in text.splitlines()}
            wanted = [line_text(item) for section in article(world, entity).sections
                      for item in section.items]
            missing = [line for line in wanted if line not in lines]
            assert not missing, f"{favor}: {entity.name} lost {missing[:3]}"
            assert len(text) >= 200, "static pages must not look empty to the visit tool"


def test_js_only_pages_have_no_static_text_but_carry_the_article(world: World) -> None:
    docs = world_documents(world)
    for entity in [e for e in world.entities if e.js_only][:40]:
        page = docs[entity.index].html or ""
        assert extract_text(page) == ""
        assert entity.name not in page.split("<body>", 1)[1]  # nothing readable in the markup
        payload = re.search(r'atob\("([^"]+)"\)', page)
        assert payload is not None
        body = json.loads(base64.b64decode(payload.group(1)))["body"]
        assert f"<h1>{entity.name}</h1>" in body
        assert docs[entity.index].text.startswith(entity.name)  # the index still holds the text
