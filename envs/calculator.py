"""A second, small environment: arithmetic questions answered with a calculator tool.

It exists to keep the :class:`~turnstile.envs.env.Env` contract honest: nothing in it searches or browses,
and it runs through ``turnstile rollout`` and ``turnstile train`` with ``episode.env.kind:
calculator`` and ``data.kind: arithmetic`` (``examples/rollout_calculator.yaml``). The policy
speaks the same agent protocol (think, one tool call or the answer) with one tool,
``calculate(expression)``, which the environment runs itself (it ignores the worker's toolbox).

The expression comes from the policy, so it is evaluated as data, never as code: it is parsed with
:mod:`ast` and only numbers, ``+ - * / // % **`` and parentheses are allowed; exponents, operand
sizes and results are bounded (``9**9**9`` is refused, not computed), and every refusal is a text
the policy reads, never an exception.

The ``arithmetic`` dataset draws questions such as "What is 17 * (4 + 38)?" from a seed; the answer
is the exact integer, so the exact-match reward and the accuracy rule apply unchanged.
"""

from __future__ import annotations

import ast
import operator
import random
from collections.abc import Callable
from dataclasses import dataclass

from turnstile.envs.datasets.generic import DatasetError
from turnstile.envs.datasets.registry import DatasetConfig
from turnstile.envs.env import EnvConfig, ProtocolEnv, StepInfo, register_env
from turnstile.envs.plugins import typed_options
from turnstile.envs.protocol import ParsedTurn
from turnstile.envs.tasks import Task
from turnstile.envs.tools.base import JsonObject
from turnstile.envs.tools.toolbox import Toolbox

MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 10**18  # operands and results beyond this are refused
MAX_EXPONENT = 64

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY: dict[type[ast.unaryop], Callable[[int | float], int | float]] = {
    ast.UAdd: operator.pos, ast.USub: operator.neg}

CALCULATE_SCHEMA: JsonObject = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}


class CalculationError(ValueError):
    """The expression is refused; the message is what the policy reads."""


def calculate(expression: str) -> int | float:
    """The value of ``expression`` (see the module docstring); raises CalculationError."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculationError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError):
        raise CalculationError("not an arithmetic expression") from None
    return _evaluate(tree.body)


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculationError(f"exponents above {MAX_EXPONENT} are not computed")
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculationError("division by zero") from None
        except OverflowError:
            raise CalculationError("the result is too large") from None
    raise CalculationError(f"{type(node).__name__} is not allowed: only numbers, + - * / // % ** "
                           "and parentheses")


def _bounded(value: int | float | complex) -> int | float:
    if isinstance(value, complex):
        raise CalculationError("the result is not a real number")
    if abs(value) > MAX_MAGNITUDE:
        raise CalculationError(f"numbers beyond {MAX_MAGNITUDE:.0e} are not computed")
    return value


def render_number(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.10g}"


@register_env("calculator")
class CalculatorEnv(ProtocolEnv):
    """The agent protocol with one tool, ``calculate``, run in-process."""

    role = ("You are a careful assistant. Answer the user's arithmetic question exactly: think step "
            "by step and check your arithmetic with the calculator, one tool call per message.")

    def __init__(self, task: Task, toolbox: Toolbox | None = None, config: EnvConfig | None = None) -> None:
        super().__init__(task, config or EnvConfig(kind="calculator"))
        self.calls = 0

    def tool_schemas(self) -> list[JsonObject]:
        return [CALCULATE_SCHEMA]

    def tool_names(self) -> list[str]:
        return ["calculate"]

    async def call_tool(self, turn: int, parsed: ParsedTurn) -> tuple[StepInfo, str]:
        name = parsed.tool or ""
        if name != "calculate":
            return (StepInfo(turn, parsed, tool=name, tool_ok=False, tool_error="unknown_tool"),
                    f"[{name}] is not a tool here; the only tool is calculate.")
        self.calls += 1
        expression = parsed.arguments.get("expression")
        if not isinstance(expression, str):
            return (StepInfo(turn, parsed, tool=name, tool_ok=False, tool_error="bad_arguments"),
                    "[calculate] needs {\"expression\": \"...\"}, a string.")
        try:
            text = f"{expression.strip()} = {render_number(calculate(expression))}"
        except CalculationError as error:
            return StepInfo(turn, parsed, tool=name, tool_ok=False, tool_error="refused"), f"[calculate] {error}"
        return StepInfo(turn, parsed, tool=name, tool_ok=True), text

    def tools_spent(self) -> bool:
        return self.calls >= self.tool_budget

    def tool_state(self) -> dict[str, object]:
        return {"calls": self.calls}

    def restore_tools(self, state: dict[str, object]) -> None:
        calls = state.get("calls")
        if not isinstance(calls, int) or isinstance(calls, bool) or calls < 0:
            raise ValueError(f"not a calculator snapshot: {state!r}")
        self.calls = calls


@dataclass
class ArithmeticOptions:
    count: int = 512  # questions generated (before split and limit)
    operands: int = 3  # numbers in each expression (2 or more)
    max_operand: int = 99

    def __post_init__(self) -> None:
        if self.count < 1 or self.operands < 2 or self.max_operand < 2:
            raise ValueError("arithmetic options: count >= 1, operands >= 2 and max_operand >= 2")


def load_arithmetic(cfg: DatasetConfig) -> list[Task]:
    """``count`` questions drawn from ``cfg.seed`` (the same seed gives the same questions)."""
    options = typed_options(ArithmeticOptions, cfg.options, "dataset 'arithmetic'", error=DatasetError)
    rng = random.Random(f"arithmetic/{cfg.seed}")
    tasks = []
    for index in range(options.count):
        expression = str(rng.randint(2, options.max_operand))
        for _ in range(options.operands - 1):
            term = f"{rng.choice('+-*')} {rng.randint(2, options.max_operand)}"
            grouped = " " in expression and rng.random() < 0.5  # (a + b) * c as well as a + b * c
            expression = f"({expression}) {term}" if grouped else f"{expression} {term}"
        value = calculate(expression)
        tasks.append(Task(id=f"arith-{cfg.seed}-{index}", question=f"What is {expression}?",
                          answers=(render_number(value),), metadata={"expression": expression}))
    return tasks
