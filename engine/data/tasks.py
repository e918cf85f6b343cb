"""Built-in verifiable tasks: deterministic generators, difficulty 1-5, and verifiers.

A task turns ``(difficulty, split, size)`` into items (prompt, answer, metadata) and scores
completions with ``score(completion, answer, metadata) -> float`` (1.0 correct, 0.0 not).
Generation is seeded by task, difficulty and split only (never by the run's seed), so
every run sees the same eval set; train items that equal an eval item are skipped, and
the split builder checks the two are disjoint.

``get_task(name)`` is the entry point the reward module uses for the reward named
``"task"``: ``get_task(metadata["task"]).score(completion, answer, metadata)``.
"""

from __future__ import annotations

import ast
import hashlib
import random
import re
from collections import Counter
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Protocol


@dataclass(frozen=True)
class TaskItem:
    """One generated problem. ``solution`` is a correct completion (used for the SFT warm-up)."""

    prompt: str
    answer: str
    solution: str
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        """Identity used to keep train and eval disjoint."""
        return self.prompt


class Task(Protocol):
    name: str

    def sample(self, rng: random.Random, difficulty: int) -> TaskItem: ...

    def score(self, completion: str, answer: str | None, metadata: dict[str, Any]) -> float: ...

    def reference_completion(self, answer: str | None, metadata: dict[str, Any]) -> str: ...


def check_difficulty(difficulty: int) -> None:
    """Refuse a difficulty outside 1..5 (the levels every built-in task defines)."""
    if not isinstance(difficulty, int) or not 1 <= difficulty <= 5:
        raise ValueError(f"difficulty must be an integer from 1 to 5, got {difficulty!r}")


def _first_line(completion: str) -> str:
    return completion.strip().split("\n", 1)[0] if completion else ""


# ----------------------------------------------------------------------------- arithmetic

_LEADING_INT = re.compile(r"^\s*(-?\d+)(?![\d.]\d)")


class ArithmeticTask:
    """``"12+34="`` -> ``"46"``. Difficulty grows from 2-digit addition to 2x2-digit products.

    1: a+b, a,b in 10..99          2: a+b or a-b (a >= b), 2-digit
    3: 3-digit +/- (may be negative) 4: 3-digit +/- or 2-digit x 1-digit
    5: 4-digit +/- or 2-digit x 2-digit
    """

    name = "arithmetic"

    def sample(self, rng: random.Random, difficulty: int) -> TaskItem:
        check_difficulty(difficulty)
        if difficulty == 1:
            a, b, op = rng.randint(10, 99), rng.randint(10, 99), "+"
        elif difficulty == 2:
            a, b, op = rng.randint(10, 99), rng.randint(10, 99), rng.choice("+-")
            if op == "-" and a < b:
                a, b = b, a
        elif difficulty == 3:
            a, b, op = rng.randint(100, 999), rng.randint(100, 999), rng.choice("+-")
        elif difficulty == 4:
            op = rng.choice("+-*")
            if op == "*":
                a, b = rng.randint(10, 99), rng.randint(2, 9)
            else:
                a, b = rng.randint(100, 999), rng.randint(100, 999)
        else:
            op = rng.choice("+-*")
            if op == "*":
                a, b = rng.randint(10, 99), rng.randint(10, 99)
            else:
                a, b = rng.randint(1000, 9999), rng.randint(1000, 9999)
        value = a + b if op == "+" else a - b if op == "-" else a * b
        answer = str(value)
        return TaskItem(
            prompt=f"{a}{op}{b}=",
            answer=answer,
            solution=answer,
            metadata={"task": self.name, "difficulty": difficulty},
        )

    def score(self, completion: str, answer: str | None, metadata: dict[str, Any]) -> float:
        """1.0 if the completion starts with the right integer (trailing text is ignored)."""
        if answer is None or not re.fullmatch(r"\s*-?\d+\s*", str(answer)):
            raise ValueError(f"arithmetic answer must be an integer string, got {answer!r}")
        m = _LEADING_INT.match(_first_line(completion))
        if m is None:
            return 0.0
        return 1.0 if int(m.group(1)) == int(answer) else 0.0

    def reference_completion(self, answer: str | None, metadata: dict[str, Any]) -> str:
        if answer is None:
            raise ValueError("arithmetic items need an answer")
        return str(answer)


# ----------------------------------------------------------------------------- countdown

_EXPR_PREFIX = re.compile(r"^[\d\s+\-*/()]*")
_MAX_EXPR_CHARS = 200

# difficulty -> (how many numbers are given, range of each, how many the solution uses, operators)
_COUNTDOWN_LEVELS: dict[int, tuple[int, int, tuple[int, int], str]] = {
    1: (3, 9, (2, 2), "+-*"),
    2: (3, 20, (3, 3), "+-*"),
    3: (4, 20, (3, 4), "+-*/"),
    4: (4, 50, (4, 4), "+-*/"),
    5: (5, 100, (4, 5), "+-*/"),
}


class CountdownTask:
    """``"3 5 7 -> 22:"`` -> ``"3*5+7"``: reach the target using each given number at most once.

    The expression is read from the first line of the completion (up to the first character
    that cannot be part of an expression, so ``"3*5+7 = 22"`` counts), parsed with ``ast``
    (never ``eval``): integers, ``+ - * /`` and parentheses only, exact rational arithmetic,
    division by zero scores 0.
    """

    name = "countdown"

    def sample(self, rng: random.Random, difficulty: int) -> TaskItem:
        check_difficulty(difficulty)
        count, high, (use_lo, use_hi), ops = _COUNTDOWN_LEVELS[difficulty]
        while True:
            numbers = [rng.randint(1, high) for _ in range(count)]
            used = rng.sample(numbers, rng.randint(use_lo, use_hi))
            expr, value = str(used[0]), Fraction(used[0])
            prec = 3  # precedence of the expression built so far (3 = atom)
            for n in used[1:]:
                op = rng.choice(ops)
                if op == "/" and (n == 0 or value % n != 0):
                    op = rng.choice("+*")
                p = 1 if op in "+-" else 2
                left = f"({expr})" if prec < p else expr
                expr = f"{left}{op}{n}"
                prec = p
                value = _apply(op, value, Fraction(n))
            if value.denominator == 1 and 0 < value <= 1000 and value not in numbers:
                break
        target = int(value)
        assert _eval_expression(expr) == target
        return TaskItem(
            prompt=f"{' '.join(map(str, numbers))} -> {target}:",
            answer=str(target),
            solution=expr,
            metadata={
                "task": self.name,
                "difficulty": difficulty,
                "numbers": numbers,
                "target": target,
                "solution": expr,
            },
        )

    def score(self, completion: str, answer: str | None, metadata: dict[str, Any]) -> float:
        """1.0 if the expression uses only the given numbers (each at most once) and hits the target."""
        numbers = metadata.get("numbers")
        target = metadata.get("target", answer)
        if not isinstance(numbers, list | tuple) or target is None:
            raise ValueError("countdown metadata needs 'numbers' (a list) and 'target' (or an answer)")
        try:
            target_value = Fraction(int(str(target).strip()))
        except ValueError:
            raise ValueError(f"countdown target must be an integer, got {target!r}") from None
        m = _EXPR_PREFIX.match(_first_line(completion))
        expr = m.group(0).strip() if m else ""
        if not expr or len(expr) > _MAX_EXPR_CHARS:
            return 0.0
        try:
            tree = ast.parse(expr, mode="eval")
        except SyntaxError:
            return 0.0
        literals = _literals(tree.body)
        if literals is None:
            return 0.0
        available = Counter(int(n) for n in numbers)
        if any(available[v] < c for v, c in Counter(literals).items()):
            return 0.0
        value = _eval_node(tree.body)
        return 1.0 if value is not None and value == target_value else 0.0

    def reference_completion(self, answer: str | None, metadata: dict[str, Any]) -> str:
        solution = metadata.get("solution")
        if not solution:
            raise ValueError("countdown items need metadata['solution'] for a reference completion")
        return str(solution)


def _apply(op: str, left: Fraction, right: Fraction) -> Fraction:
    if op == "+":
        return left + right
    if op == "-":
        return left - right
    if op == "*":
        return left * right
    return left / right


def _literals(node: ast.expr) -> list[int] | None:
    """The integer literals of an allowed expression, or None if it uses anything else."""
    if isinstance(node, ast.Constant):
        return [node.value] if type(node.value) is int else None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub | ast.Mult | ast.Div):
        left, right = _literals(node.left), _literals(node.right)
        return None if left is None or right is None else left + right
    return None


def _eval_node(node: ast.expr) -> Fraction | None:
    """Exact value of an allowed expression (None on division by zero)."""
    if isinstance(node, ast.Constant):
        return Fraction(node.value)
    assert isinstance(node, ast.BinOp)
    left, right = _eval_node(node.left), _eval_node(node.right)
    if left is None or right is None:
        return None
    if isinstance(node.op, ast.Add):
        return left + right
    if isinstance(node.op, ast.Sub):
        return left - right
    if isinstance(node.op, ast.Mult):
        return left * right
    return None if right == 0 else left / right


def _eval_expression(expr: str) -> Fraction | None:
    tree = ast.parse(expr, mode="eval")
    if _literals(tree.body) is None:
        raise ValueError(f"not an arithmetic expression: {expr!r}")
    return _eval_node(tree.body)


# ----------------------------------------------------------------------------- registry and splits

TASKS: dict[str, Task] = {t.name: t for t in (ArithmeticTask(), CountdownTask())}


def get_task(name: str) -> Task:
    """The built-in task called ``name`` (``.name``, ``.score(completion, answer, metadata)``)."""
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown built-in task '{name}'; use one of {', '.join(TASKS)}") from None


def _rng(task: str, difficulty: int, split: str) -> random.Random:
    digest = hashlib.sha256(f"tributary/{task}/d{difficulty}/{split}".encode()).digest()
    return random.Random(int.from_bytes(digest[:8], "big"))


def _draw(
    task: str, difficulty: int, split: str, size: int, exclude: set[str], *, distinct: bool, too_few: str
) -> list[TaskItem]:
    """``size`` items of the fixed stream of ``split``, skipping those whose key is in ``exclude``
    (and, if ``distinct``, those drawn before); ValueError ``too_few`` when the skips run past a
    budget of ``50 * size + 1000`` (the problem space is too small)."""
    t = get_task(task)
    check_difficulty(difficulty)
    rng = _rng(task, difficulty, split)
    skip = set(exclude) if distinct else exclude
    items: list[TaskItem] = []
    misses = 0
    while len(items) < size:
        item = t.sample(rng, difficulty)
        if item.key in skip:
            misses += 1
            if misses > 50 * size + 1000:
                raise ValueError(too_few)
            continue
        if distinct:
            skip.add(item.key)
        items.append(item)
    return items


def generate_eval(task: str, difficulty: int, size: int) -> list[TaskItem]:
    """``size`` distinct eval items (a prefix of a fixed stream: growing ``size`` keeps the first ones)."""
    too_few = (
        f"{task} difficulty {difficulty} has too few distinct problems for {size} eval prompts; "
        "lower data.eval_size or raise data.difficulty"
    )
    return _draw(task, difficulty, "eval", size, set(), distinct=True, too_few=too_few)


def generate_train(task: str, difficulty: int, size: int, exclude: set[str]) -> list[TaskItem]:
    """``size`` train items (repeats allowed when the problem space is small), none of them in ``exclude``."""
    too_few = (
        f"{task} difficulty {difficulty}: the eval set covers almost every problem; lower data.eval_size"
    )
    return _draw(task, difficulty, "train", size, exclude, distinct=False, too_few=too_few)


def generate_splits(
    task: str, difficulty: int, train_size: int, eval_size: int
) -> tuple[list[TaskItem], list[TaskItem]]:
    """Train and eval items of a built-in task, checked to be disjoint."""
    eval_items = generate_eval(task, difficulty, eval_size)
    eval_keys = {it.key for it in eval_items}
    train_items = generate_train(task, difficulty, train_size, eval_keys)
    overlap = eval_keys.intersection(it.key for it in train_items)
    if overlap:  # generate_train excludes them; this guards the invariant itself
        raise AssertionError(f"train/eval overlap in {task}: {sorted(overlap)[:3]}")
    return train_items, eval_items
