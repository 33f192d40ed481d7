"""The calculator environment's tool and dataset (envs/calculator.py): policy-written expressions
are evaluated as data, bounded, and every refusal is a message; the questions are reproducible."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turnstile.envs.calculator import CalculationError, calculate, render_number
from turnstile.envs.datasets.generic import DatasetError
from turnstile.envs.datasets.registry import DatasetConfig, load_tasks


@pytest.mark.parametrize(("expression", "value"), [
    ("6 * 7", 42), ("(2 + 3) * 4", 20), ("-3 ** 2", -9), ("7 // 2", 3), ("7 / 2", 3.5), ("2 ** 10", 1024),
])
def test_arithmetic(expression: str, value: float) -> None:
    assert calculate(expression) == value


@pytest.mark.parametrize(("expression", "message"), [
    ("9 ** 9 ** 9", "exponents above"),  # would take forever and all memory
    ("10 ** 60", "beyond"),
    ("1 / 0", "division by zero"),
    ("__import__('os').system('id')", "is not allowed"),
    ("x + 1", "is not allowed"),
    ("'a' * 3", "is not allowed"),
    ("[1] * 3", "is not allowed"),
    ("(-8) ** 0.5", "not a real number"),
    ("1 +", "not an arithmetic expression"),
    ("1" * 201, "longer than"),
])
def test_refusals_are_messages(expression: str, message: str) -> None:
    with pytest.raises(CalculationError, match=message):
        calculate(expression)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80))
def test_any_text_is_a_value_or_a_refusal(text: str) -> None:
    try:
        value = calculate(text)
    except CalculationError:
        return
    assert isinstance(value, int | float)


def test_numbers_render_as_answers() -> None:
    assert [render_number(v) for v in (42, 42.0, -3, 0.1 + 0.2)] == ["42", "42", "-3", "0.3"]


def test_questions_are_reproducible_and_answered_exactly() -> None:
    config = DatasetConfig(kind="arithmetic", path="", options={"count": 50, "operands": 3})
    tasks = load_tasks(config)
    assert [t.question for t in tasks] == [t.question for t in load_tasks(config)]
    assert len({t.id for t in tasks}) == 50
    for task in tasks:
        assert task.question == f"What is {task.metadata['expression']}?"
        assert task.answers == (render_number(calculate(str(task.metadata["expression"]))),)
    with pytest.raises(DatasetError, match="unknown option 'min_hops'"):
        load_tasks(DatasetConfig(kind="arithmetic", path="", options={"min_hops": 1}))
