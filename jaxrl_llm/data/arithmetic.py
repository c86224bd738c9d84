"""The built-in task: arithmetic prompts generated from a seed, with a disjoint held-out split.

"What is 23 + 7? Answer with just the number." with ``answer="30"`` — checked by the
``integer_answer`` reward, no download needed. Operands have ``digits`` digits (``digits=1``:
0–9) or lie in ``[min_operand, max_operand]``; operators come from ``ops`` (``+``, ``-``, ``*``).

Disjointness is by *problem*, not just by text: ``3 + 5`` and ``5 + 3`` are one problem (``+`` and
``*`` commute), so a problem and its mirror never land in different splits. Problems are drawn
without replacement from one seeded stream; the first ``num_eval`` form the evaluation split and
the next ``num_train`` the training split, so the evaluation split depends only on ``seed``,
the operand range, ``ops``, ``nonnegative`` and ``num_eval`` (not on ``num_train``) and stays the
same across runs of different lengths. :func:`num_arithmetic_problems` says how many distinct
problems a setting allows (e.g. 10,100 for operands 0..99 with ``+`` and ``-``).

For DPO, :func:`arithmetic_preference_pairs` turns the problems into preference pairs: the right
answer against a wrong number.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from jaxrl_llm.data.files import DataError

ARITHMETIC_TEMPLATE = "What is {a} {op} {b}? Answer with just the number."
ARITHMETIC_OPS = ("+", "-", "*")

# Problem spaces up to this size are enumerated and permuted; larger ones are sampled.
_ENUMERATE_LIMIT = 4_000_000


def _operand_range(digits: int) -> tuple[int, int]:
    return (0, 9) if digits == 1 else (10 ** (digits - 1), 10**digits - 1)


def _num_problems(op: str, n: int, nonnegative: bool) -> int:
    """Distinct problems with ``n`` possible operands: unordered pairs unless ``-`` may go
    negative (then ordered pairs)."""
    return n * n if (op == "-" and not nonnegative) else n * (n + 1) // 2


def _unordered(op: str, nonnegative: bool) -> bool:
    return op != "-" or nonnegative


def _enumerate_keys(ops: Sequence[str], lo: int, hi: int, nonnegative: bool) -> np.ndarray:
    """All problems as rows ``(op index, x, y)`` with ``x >= y`` for unordered ones."""
    values = np.arange(lo, hi + 1, dtype=np.int64)
    x, y = np.meshgrid(values, values, indexing="ij")
    x, y = x.reshape(-1), y.reshape(-1)
    blocks = []
    for k, op in enumerate(ops):
        keep = x >= y if _unordered(op, nonnegative) else np.ones_like(x, bool)
        blocks.append(np.stack([np.full(int(keep.sum()), k), x[keep], y[keep]], axis=1))
    return np.concatenate(blocks)


def _check_knobs(
    ops: tuple[str, ...],
    digits: int,
    min_operand: int | None,
    max_operand: int | None,
) -> tuple[int, int]:
    """Validates the difficulty knobs; returns the operand range ``(lo, hi)``."""
    if not ops or any(op not in ARITHMETIC_OPS for op in ops) or len(set(ops)) != len(ops):
        raise DataError(f"ops must be distinct operators from {ARITHMETIC_OPS}, got {ops!r}")
    if min_operand is None and max_operand is None:
        if isinstance(digits, bool) or not isinstance(digits, int) or not 1 <= digits <= 9:
            raise DataError(f"digits must be an int from 1 to 9, got {digits!r}")
        return _operand_range(digits)
    if min_operand is None or max_operand is None:
        raise DataError("give both min_operand and max_operand (or neither, to use digits)")
    for name, value in (("min_operand", min_operand), ("max_operand", max_operand)):
        if isinstance(value, bool) or not isinstance(value, int) or abs(value) >= 10**9:
            raise DataError(f"{name} must be an int with |value| < 1e9, got {value!r}")
    if min_operand > max_operand:
        raise DataError(f"min_operand {min_operand} must be <= max_operand {max_operand}")
    return min_operand, max_operand


def num_arithmetic_problems(
    *,
    digits: int = 2,
    ops: Sequence[str] = ("+", "-"),
    nonnegative: bool = True,
    min_operand: int | None = None,
    max_operand: int | None = None,
) -> int:
    """How many distinct problems these knobs allow (``num_train + num_eval`` must not exceed it).

    ``a + b`` and ``b + a`` (also ``*``) are one problem, as are ``a - b`` and ``b - a`` when
    ``nonnegative`` (both are asked as the larger minus the smaller).
    """
    lo, hi = _check_knobs(tuple(ops), digits, min_operand, max_operand)
    return sum(_num_problems(op, hi - lo + 1, nonnegative) for op in ops)


def _sample_keys(
    rng: np.random.Generator, count: int, ops: Sequence[str], lo: int, hi: int, nonnegative: bool
) -> np.ndarray:
    """``count`` distinct problems in draw order (for problem spaces too big to enumerate)."""
    seen: set[tuple[int, int, int]] = set()
    keys: list[tuple[int, int, int]] = []
    while len(keys) < count:
        draws = rng.integers([0, lo, lo], [len(ops), hi + 1, hi + 1], size=(4096, 3))
        for k, x, y in draws.tolist():
            if _unordered(ops[k], nonnegative) and x < y:
                x, y = y, x
            if (k, x, y) not in seen:
                seen.add((k, x, y))
                keys.append((k, x, y))
                if len(keys) == count:
                    break
    return np.asarray(keys, np.int64).reshape(-1, 3)


def _render(key: Sequence[int], flip: bool, ops: Sequence[str], template: str) -> dict[str, str]:
    k, x, y = (int(v) for v in key)
    op = ops[k]
    if op == "-":
        a, b = x, y  # x >= y when nonnegative, so the answer is >= 0
    else:
        a, b = (y, x) if flip else (x, y)
    answer = {"+": a + b, "-": a - b, "*": a * b}[op]
    return {"prompt": template.format(a=a, op=op, b=b), "answer": str(answer)}


def arithmetic_task(
    *,
    num_train: int = 2000,
    num_eval: int = 200,
    digits: int = 2,
    ops: Sequence[str] = ("+", "-"),
    seed: int = 0,
    nonnegative: bool = True,
    template: str = ARITHMETIC_TEMPLATE,
    min_operand: int | None = None,
    max_operand: int | None = None,
) -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    """Generates ``(train_rows, eval_rows)`` of ``{"prompt": ..., "answer": ...}``.

    Args:
      num_train, num_eval: number of problems in each split (disjoint; see module docstring).
      digits: digits per operand, 1 to 9 (``1`` means 0–9).
      ops: operators to draw from, a subset of ``+``, ``-``, ``*``.
      seed: the generator's seed.
      nonnegative: order the operands of ``-`` (larger first) so that ``-`` never gives a
        negative answer.
      template: prompt text with ``{a}``, ``{op}`` and ``{b}``.
      min_operand, max_operand: the operand range, instead of ``digits`` (both or neither).

    Raises:
      DataError: a bad knob, or more problems asked for than exist (the message says how many).
    """
    ops = tuple(ops)
    lo, hi = _check_knobs(ops, digits, min_operand, max_operand)
    for name, value in (("num_train", num_train), ("num_eval", num_eval)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise DataError(f"{name} must be an int >= 0, got {value!r}")
    for placeholder in ("{a}", "{op}", "{b}"):
        if placeholder not in template:
            raise DataError(f"template must contain {placeholder}, got {template!r}")
    total = sum(_num_problems(op, hi - lo + 1, nonnegative) for op in ops)
    wanted = num_train + num_eval
    if wanted > total:
        raise DataError(
            f"asked for {num_train} + {num_eval} = {wanted} arithmetic problems but only {total} "
            f"distinct ones exist with operands {lo}..{hi} and ops {ops} (a + b and b + a are "
            f"one problem); lower the counts or widen the operands"
        )
    rng = np.random.default_rng(seed)
    if total <= _ENUMERATE_LIMIT:
        keys = _enumerate_keys(ops, lo, hi, nonnegative)
        keys = keys[rng.permutation(len(keys))[:wanted]]
    else:
        keys = _sample_keys(rng, wanted, ops, lo, hi, nonnegative)
    flips = np.random.default_rng([seed, 1]).random(wanted) < 0.5
    rows = [_render(key, flip, ops, template) for key, flip in zip(keys, flips, strict=True)]
    return rows[num_eval:], rows[:num_eval]


def arithmetic_preference_pairs(
    columns: Mapping[str, Sequence[str]],
    *,
    seed: int,
    prompt_field: str = "prompt",
    chosen_field: str = "chosen",
    rejected_field: str = "rejected",
) -> dict[str, list[str]]:
    """Arithmetic problems as preference pairs (prompt, chosen, rejected), for DPO.

    The chosen answer is the right one; the rejected answer is a wrong number, the right one plus
    a non-zero offset of at most 10 in size (drawn from a generator seeded with ``[seed, 11]``).

    Args:
      columns: ``prompt`` and ``answer`` lists, e.g. :func:`arithmetic_task`'s rows as columns.
      seed: the offsets' seed.
      prompt_field, chosen_field, rejected_field: the names of the returned columns.

    Returns:
      Columns ``prompt_field``, ``chosen_field``, ``rejected_field`` and ``answer`` (the right
      answer, for the accuracy of held-out pairs).
    """
    rng = np.random.default_rng([seed, 11])
    answers = list(columns["answer"])
    offsets = rng.integers(1, 11, len(answers)) * rng.choice([-1, 1], len(answers))
    wrong = [str(int(a) + int(o)) for a, o in zip(answers, offsets, strict=True)]
    return {
        prompt_field: list(columns["prompt"]),
        chosen_field: answers,
        rejected_field: wrong,
        "answer": list(answers),
    }
