"""A calculator tool and the rewards of the calculator recipes (smollm2-tools-*.yaml): the tool evaluates an
arithmetic expression; `correct` is 1 when the completion's last message states the right number, `right_call`
scores each of the model's turns that calls the calculator: 1 when the expression's value is the answer."""

import ast
import operator
import re

OPERATORS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
}


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression with +, -, * and / on numbers.

    Args:
        expression: the expression, e.g. "37 * 48"
    """

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {expression}")

    result = value(ast.parse(expression, mode="eval").body)
    return str(int(result) if float(result).is_integer() else round(result, 6))


NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def correct(prompts, completions, answer, **_) -> list[float]:
    """1 when the last number of the completion's last message is the answer, else 0."""
    scores = []
    for completion, want in zip(completions, answer):
        text = completion if isinstance(completion, str) else completion[-1].get("content") or ""
        numbers = NUMBER.findall(text.replace(",", ""))
        scores.append(1.0 if numbers and float(numbers[-1]) == float(want) else 0.0)
    return scores


def right_call(prompts, completions, answer, **_) -> list[list[float | None]]:
    """Per assistant turn: 1 when it calls calculate on an expression whose value is the answer, 0 when its calls
    compute something else or cannot run, None (unscored) for a turn without calls."""
    scores = []
    for completion, want in zip(completions, answer):
        turns = [m for m in completion if m["role"] == "assistant"]
        scores.append([_call_score(m.get("tool_calls") or [], want) for m in turns])
    return scores


def _call_score(calls: list[dict], want) -> float | None:
    if not calls:
        return None
    for call in calls:
        function = call.get("function", call)
        arguments = function.get("arguments")
        expression = arguments.get("expression") if isinstance(arguments, dict) else None
        try:
            if function.get("name") == "calculate" and float(calculate(str(expression))) == float(want):
                return 1.0
        except (ValueError, SyntaxError, ZeroDivisionError, TypeError):
            pass
    return 0.0
