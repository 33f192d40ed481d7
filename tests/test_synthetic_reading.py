"""Parsing of tool observations by the scripted expert."""

from __future__ import annotations

from turnstile.envs.protocol import render_tool_response
from turnstile.envs.search.base import SearchHit
from turnstile.envs.search.tool import format_results
from turnstile.envs.synthetic import reading

SEARCH = render_tool_response(format_results("Aldo Venmar", [
    SearchHit("Venmar Institute", "http://h/wiki/venmar-institute", "Founded by Aldo Venmar."),
    SearchHit("Aldo Venmar", "http://h/wiki/aldo-venmar", "Aldo Venmar is a botanist."),
]))

PAGE = render_tool_response(
    "Content of http://h/wiki/korvath-institute (goal: Find the members of Korvath Institute):\n"
    "Korvath Institute\nKorvath Institute is a shipping organisation founded in 1873.\nFacts\n"
    "- Type: Organisation\n- Founded: 1873\n- Founder: Aldo Venmar\n- Brand colour: Teal\n"
    "- Employees: 12,400\nMembers\nKorvath Institute has 2 members.\n"
    "- Member: Lira Quon (joined in 1990)\n- Member: Bex Tarrow-Ode (joined in 2001)"
)


def test_search_results_and_exact_title_match() -> None:
    results = reading.search_results(SEARCH)
    assert [(r.rank, r.title) for r in results] == [(1, "Venmar Institute"), (2, "Aldo Venmar")]
    assert reading.find_page(SEARCH, "aldo  venmar") == "http://h/wiki/aldo-venmar"
    assert reading.find_page(SEARCH, "Aldo") is None
    assert reading.search_results(render_tool_response("No results found for 'x'.")) == []


def test_a_result_address_may_hold_parentheses() -> None:
    """Wikipedia's addresses do (HotpotQA's pages live at them): the whole address is read."""
    listing = render_tool_response(format_results("Tosca", [
        SearchHit("Tosca (1956 film)", "http://h/wiki/Tosca_(1956_film)", "Tosca is a 1956 Italian film."),
        SearchHit("Tosca", "http://h/wiki/Tosca", "An opera by Puccini."),
    ]))
    assert [r.url for r in reading.search_results(listing)] == ["http://h/wiki/Tosca_(1956_film)", "http://h/wiki/Tosca"]
    assert reading.find_page(listing, "Tosca (1956 film)") == "http://h/wiki/Tosca_(1956_film)"


def test_page_text_facts_and_members() -> None:
    text = reading.page_text(PAGE)
    assert text is not None and text.startswith("Korvath Institute")
    assert reading.fact(text, "Founder") == "Aldo Venmar"
    assert reading.fact(text, "Founded") == "1873"
    assert reading.fact(text, "Colour") is None  # labels match whole, from the line start
    assert reading.fact(text, "Brand colour") == "Teal"
    assert reading.members(text) == ["Lira Quon", "Bex Tarrow-Ode"]
    assert reading.fact(text, "Member of") is None
    assert reading.stated_member_count(text) == 2


def test_failed_or_empty_visits_have_no_text() -> None:
    assert reading.page_text(render_tool_response("[visit] failed (http_status): 404")) is None
    assert reading.page_text(render_tool_response("Content of http://h/x (goal: g):\n")) is None


def test_numbers() -> None:
    assert reading.number("12,400") == 12400
    assert reading.number("183 cm") == 183
    assert reading.number("Teal") is None
