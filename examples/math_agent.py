"""A safe arithmetic evaluator: capability `math.eval@1.0.0` (cost A).

Expressions are parsed with `ast` and walked by hand: only numbers, + - * / //
% **, unary + and -, parentheses, a few functions from `math` and the
constants pi, e and tau. Anything else (names, attributes, calls to other
functions, strings, comprehensions, ...) is refused with a clear reason, and
so are results too large to be useful (huge powers, overflow, inf, nan).

    python -m examples.math_agent      # AGENT_ID, AGENT_PORT, TEMPORAL_ADDRESS, ...
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable, Mapping
from typing import Any

from agentroster.agent.runtime import AgentRuntime, TaskRefused, run_agent

MAX_EXPRESSION_CHARS = 1000
MAX_INT_BITS = 4096  # about 1,233 decimal digits
MAX_DEPTH = 50

Number = int | float

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}
FUNCTIONS: dict[str, Callable[..., Number]] = {
    "sqrt": math.sqrt,
    "sin": math.sin,
    "cos": math.cos,
    "tan": math.tan,
    "asin": math.asin,
    "acos": math.acos,
    "atan": math.atan,
    "log": math.log,
    "log10": math.log10,
    "log2": math.log2,
    "exp": math.exp,
    "abs": abs,
    "floor": math.floor,
    "ceil": math.ceil,
    "round": round,
}
CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e, "tau": math.tau}


class ExpressionError(ValueError):
    """The expression is not allowed, or cannot be evaluated to a finite number."""


def evaluate(expression: str) -> Number:
    """Evaluate an arithmetic expression safely. Raises ExpressionError with the reason."""
    if not isinstance(expression, str) or not expression.strip():
        raise ExpressionError("the expression must be a non-empty string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ExpressionError(f"the expression is {len(expression)} characters, over the {MAX_EXPRESSION_CHARS} limit")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ExpressionError(f"not an expression: {exc.msg}") from exc
    try:
        value = _eval(tree.body, 0)
    except ExpressionError:
        raise
    except ZeroDivisionError as exc:
        raise ExpressionError("division by zero") from exc
    except OverflowError as exc:
        raise ExpressionError(f"the result is too large ({exc})") from exc
    except (ValueError, TypeError) as exc:
        raise ExpressionError(f"cannot evaluate: {exc}") from exc
    if isinstance(value, float) and not math.isfinite(value):
        raise ExpressionError(f"the result is not a finite number ({value})")
    return value


def _check_size(value: Number) -> Number:
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise ExpressionError(f"an intermediate result has more than {MAX_INT_BITS} bits")
    return value


def _eval(node: ast.AST, depth: int) -> Number:
    if depth > MAX_DEPTH:
        raise ExpressionError(f"the expression nests deeper than {MAX_DEPTH} levels")
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise ExpressionError(f"only numbers are allowed, not {node.value!r}")
        return _check_size(node.value)
    if isinstance(node, ast.BinOp):
        op = _BINARY.get(type(node.op))
        if op is None:
            raise ExpressionError(f"the operator {type(node.op).__name__} is not allowed")
        left, right = _eval(node.left, depth + 1), _eval(node.right, depth + 1)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        return _check_size(op(left, right))
    if isinstance(node, ast.UnaryOp):
        op1 = _UNARY.get(type(node.op))
        if op1 is None:
            raise ExpressionError(f"the operator {type(node.op).__name__} is not allowed")
        return op1(_eval(node.operand, depth + 1))
    if isinstance(node, ast.Name):
        if node.id in CONSTANTS:
            return CONSTANTS[node.id]
        raise ExpressionError(f"unknown name {node.id!r} (allowed constants: {', '.join(sorted(CONSTANTS))})")
    if isinstance(node, ast.Call):
        if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS:
            what = node.func.id if isinstance(node.func, ast.Name) else type(node.func).__name__
            raise ExpressionError(f"calling {what!r} is not allowed (allowed functions: {', '.join(sorted(FUNCTIONS))})")
        if node.keywords:
            raise ExpressionError("keyword arguments are not allowed")
        if not 1 <= len(node.args) <= 2:
            raise ExpressionError(f"{node.func.id}() takes one or two arguments")
        args = [_eval(arg, depth + 1) for arg in node.args]
        return _check_size(FUNCTIONS[node.func.id](*args))
    if isinstance(node, ast.Attribute):
        raise ExpressionError("attribute access is not allowed")
    raise ExpressionError(f"{type(node).__name__} is not allowed in an arithmetic expression")


def _check_power(base: Number, exponent: Number) -> None:
    """Refuse integer powers whose result would exceed MAX_INT_BITS, before computing them."""
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 and abs(base) > 1:
        if exponent * (abs(base).bit_length() - 1) > MAX_INT_BITS:
            raise ExpressionError(f"{base}**{exponent} would have more than {MAX_INT_BITS} bits")


INPUT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"expression": {"type": "string", "minLength": 1, "maxLength": MAX_EXPRESSION_CHARS}},
    "required": ["expression"],
    "additionalProperties": False,
}
OUTPUT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"value": {"type": "number"}},
    "required": ["value"],
}


def build_agent(env: Mapping[str, str] | None = None, **defaults: Any) -> AgentRuntime:
    """The math agent, configured from `env` (default: the process environment)."""
    defaults.setdefault("deployment", "math-agent")
    agent = AgentRuntime.from_env(env, **defaults)

    @agent.capability("math.eval", "1.0.0", input_schema=INPUT_SCHEMA, output_schema=OUTPUT_SCHEMA, max_concurrency=4, cost_class="A")
    def math_eval(payload: dict[str, Any]) -> dict[str, Any]:
        try:
            return {"value": evaluate(payload["expression"])}
        except ExpressionError as exc:
            raise TaskRefused(str(exc)) from exc

    return agent


if __name__ == "__main__":
    run_agent(build_agent())
