"""A calculator tool and the multi-turn task that offers it.

`calculate(expression)` evaluates arithmetic with a parser of its own (Python's `ast`, no `eval`): integers and
decimals, + - * / // % ** and parentheses, unary signs; anything else (names, calls, attributes, strings, huge powers
or results) is a `CalculatorError`, whose message the environment returns as the observation.

Task `calculator`: "What is a * b + c?" with a tool: a turn that starts with `calc` runs the rest through the
calculator and returns ` = RESULT.` (or ` error: WHY.`), then ` Answer:`; any other turn is the answer, scored with
the toy tasks' partial credit, which ends the trajectory. Tool calls and tool errors are counted per step. With
`chat: true` the same in K3's chat format (`zerokl.tasks.chat`): the `calculator` tool declared in the prompt, called
through the tools channel (parsed by vLLM's kimi_k3 parser), its result a tool message; the response is the answer.
"""

from __future__ import annotations

import ast
import operator
import random
from collections.abc import Callable
from typing import Any

from parity.config import ConfigError
from zerokl.tasks.agent import Turn, answer_tools
from zerokl.tasks.base import Problem
from zerokl.tasks.chat import ChatAction
from zerokl.tasks.toy import partial_credit

MAX_EXPONENT = 64
MAX_MAGNITUDE = 10**30
MAX_LENGTH = 200  # characters of one expression

_BINARY: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY: dict[type, Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """An expression the calculator does not take, or one whose value it refuses to compute."""


def calculate(expression: str) -> int | float:
    """The value of an arithmetic expression (see the module docstring); CalculatorError otherwise."""
    if len(expression) > MAX_LENGTH:
        raise CalculatorError(f"expression longer than {MAX_LENGTH} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise CalculatorError("not an arithmetic expression") from None
    return _value(tree.body)


def _value(node: ast.AST) -> int | float:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_value(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left), _value(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise CalculatorError(f"exponent above {MAX_EXPONENT}")
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("result too large") from None
    raise CalculatorError(f"{type(node).__name__} is not arithmetic")


def _bounded(x: Any) -> int | float:
    if isinstance(x, complex) or abs(x) > MAX_MAGNITUDE:
        raise CalculatorError("result too large" if not isinstance(x, complex) else "complex result")
    return x


def _shown(x: int | float) -> str:
    return str(int(x)) if isinstance(x, float) and x.is_integer() else str(x)


TOOL = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression: numbers, + - * / // % ** and parentheses.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


class CalculatorEpisode:
    """One question: `calc EXPR` turns (in K3's chat format: calls of the `calculator` tool) use the tool, the first
    other turn is the answer."""

    def __init__(self, answer: str):
        self.answer = answer

    def step(self, action: str | ChatAction) -> Turn:
        if isinstance(action, ChatAction):
            if action.tool_calls:  # every call answered, in order
                return answer_tools(action, lambda call: _calculated(str(call.arguments.get("expression", "")),
                                                                     "{}", "error: {}"))
            return Turn("", partial_credit(action.content, self.answer, "0123456789-"), True)
        text = action.strip()
        if text.startswith("calc"):
            answer, failed = _calculated(text[4:], " = {}. Answer:", " error: {}. Answer:")
            return Turn(answer, 0.0, False, tool_calls=1, tool_errors=int(failed))
        return Turn("", partial_credit(action, self.answer, "0123456789-"), True)


def _calculated(expression: str, shown: str, error: str) -> tuple[str, bool]:
    """The calculator's answer to `expression` in the form `shown` (or `error`), and whether it failed."""
    try:
        return shown.format(_shown(calculate(expression))), False
    except CalculatorError as e:
        return error.format(e), True


class Calculator:
    """'What is a * b + c? (calc EXPR computes)' with a, b, c < 10**digits."""

    name = "calculator"
    system = "Use the calculator tool for arithmetic, then reply with the number."

    def __init__(self, digits: int = 1, chat: bool = False):
        if digits < 1:
            raise ConfigError(f"task calculator: digits must be >= 1, got {digits}")
        self.digits, self.chat = digits, chat
        self.tools = [TOOL] if chat else None

    def sample(self, rng: random.Random) -> Problem:
        a, b, c = (rng.randrange(10**self.digits) for _ in range(3))
        if self.chat:
            return Problem(f"What is {a} * {b} + {c}?", str(a * b + c))
        return Problem(f"What is {a} * {b} + {c}? (calc EXPR computes) Answer:", str(a * b + c))

    def episode(self, problem: Problem) -> CalculatorEpisode:
        return CalculatorEpisode(problem.answer)
