"""Verifiable answer rewards: integer/arithmetic, GSM8K ``#### n``, ``\\boxed{...}``, MATH answers.

Each reward compares the answer found in a completion with the expected answer in a dataset
field (``answer`` by default) and scores ``correct`` (1.0) or ``incorrect`` (0.0). A completion
without a parsable answer is simply incorrect; an *expected* answer that cannot be parsed is a
data error (``ValueError``, reported by :func:`jaxrl_llm.rewards.checked_call` with the sample).

Integer and GSM8K answers compare exactly as rationals (``fractions.Fraction``), so ``30``,
``30.0``, ``+30`` and ``30.`` are the same answer, ``1,234`` is ``1234`` and ``0.1`` is exactly
one tenth.
``\\boxed{}`` and ``math_verify`` answers are compared by Hugging Face's math-verify (LaTeX parsed
into sympy, see :mod:`jaxrl_llm.rewards.verify`), with a time limit per answer.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import re
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any

from jaxrl_llm.rewards._validate import check_bool, check_field_name, check_real
from jaxrl_llm.rewards.base import Scores, excerpt
from jaxrl_llm.rewards.verify import VerificationTimeout, shared_verifier

_LOG = logging.getLogger(__name__)

# A number: optional sign (ASCII or Unicode minus) not glued to a preceding word or number,
# digits with optional thousands commas, optional decimals. "5-3" yields 5 and 3, not -3.
_NUMBER_BODY = r"(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?"
_NUMBER_RE = re.compile(rf"(?<![\w.])[-+−]?{_NUMBER_BODY}")
_FULL_NUMBER_RE = re.compile(rf"[-+−]?{_NUMBER_BODY}")
_GSM8K_RE = re.compile(rf"####\s*\$?\s*([-+−]?\s*{_NUMBER_BODY})")


def parse_number(text: str) -> Fraction | None:
    """The number a whole string spells (``"-1,234.50"``), or ``None``.

    Surrounding spaces, a leading ``$`` and a trailing period are allowed (``"$30."``).
    """
    text = text.strip().rstrip(".").strip()
    text = text[1:].strip() if text.startswith("$") else text
    if not _FULL_NUMBER_RE.fullmatch(text):
        return None
    return Fraction(text.replace(",", "").replace("−", "-"))


def last_number(text: str) -> Fraction | None:
    """The last number in ``text`` (``"so 3 - 10 = -7."`` → ``-7``), or ``None``.

    Rules: thousands commas are part of a number (``1,234``), a sign counts only when it is not
    glued to a preceding word or number (``5-3`` is ``5`` then ``3``; ``= -7`` is ``-7``), a
    trailing period ends a sentence, not the number (``30.`` is ``30``).
    """
    matches = _NUMBER_RE.findall(text)
    if not matches:
        return None
    return Fraction(matches[-1].replace(",", "").replace("−", "-"))


def gsm8k_answer(text: str) -> Fraction | None:
    """The number after the last ``####`` marker (GSM8K's answer format), or ``None``."""
    matches = _GSM8K_RE.findall(text)
    if not matches:
        return None
    return Fraction(re.sub(r"[\s,]", "", matches[-1]).replace("−", "-"))


def expected_number(value: Any, *, field: str) -> Fraction:
    """An expected answer as a number: an int/float, ``"72"``, or GSM8K's ``"... #### 72"``."""
    if isinstance(value, bool) or value is None:
        raise ValueError(f"expected answer in field {field!r} is {value!r}, not a number")
    if isinstance(value, numbers.Integral):  # int, numpy ints
        return Fraction(int(value))
    if isinstance(value, numbers.Real):  # float, numpy floats: by their shortest repr
        return Fraction(repr(float(value)))
    if isinstance(value, str):
        number = gsm8k_answer(value) if "####" in value else parse_number(value)
        if number is not None:
            return number
    raise ValueError(f"expected answer {value!r} in field {field!r} is not a number")


def _field(fields: dict[str, Any], field: str, reward: str) -> Sequence[Any]:
    if field not in fields:
        raise KeyError(
            f"{reward} needs the dataset field {field!r} but got fields {sorted(fields)}; set "
            f"`field:` in the reward config to the column holding the expected answer"
        )
    return fields[field]


def _score_numbers(
    completions: Sequence[str],
    fields: dict[str, Any],
    extract: Callable[[str], Fraction | None],
    reward: Any,
) -> list[float]:
    expected = _field(fields, reward.field, type(reward).__name__)
    out = []
    for completion, value in zip(completions, expected, strict=True):
        target = expected_number(value, field=reward.field)
        out.append(reward.correct if extract(completion) == target else reward.incorrect)
    return out


@dataclasses.dataclass(frozen=True)
class _AnswerReward:
    """Shared fields of the answer rewards: which dataset field holds the expected answer, and
    the scores for a correct and an incorrect completion."""

    field: str = "answer"
    correct: float = 1.0
    incorrect: float = 0.0

    def __post_init__(self):
        check_field_name("field", self.field)
        check_real("correct", self.correct)
        check_real("incorrect", self.incorrect)

    @property
    def required_fields(self) -> tuple[str, ...]:
        return (self.field,)


@dataclasses.dataclass(frozen=True)
class IntegerAnswer(_AnswerReward):
    """Integer/arithmetic answer: the last number in the completion equals the expected one.

    ``reward = correct if last_number(completion) == expected else incorrect`` (see
    :func:`last_number` for the parsing rules; the comparison is exact).
    """

    def __call__(self, prompts: list[str], completions: list[str], **fields: Any) -> list[float]:
        return _score_numbers(completions, fields, last_number, self)


@dataclasses.dataclass(frozen=True)
class Gsm8kAnswer(_AnswerReward):
    """GSM8K-style answer: the number after the completion's last ``####`` marker.

    With ``strict=False`` a completion without the marker falls back to its last number.
    The expected field may be the raw GSM8K solution (``"... #### 72"``) or just ``"72"``.
    """

    strict: bool = True

    def __post_init__(self):
        super().__post_init__()
        check_bool("strict", self.strict)

    def _extract(self, completion: str) -> Fraction | None:
        number = gsm8k_answer(completion)
        if number is None and not self.strict:
            number = last_number(completion)
        return number

    def __call__(self, prompts: list[str], completions: list[str], **fields: Any) -> list[float]:
        return _score_numbers(completions, fields, self._extract, self)


# --- \boxed{...} math answers -------------------------------------------------------------


def _read_group(text: str, start: int) -> tuple[str, int] | None:
    """The balanced ``{...}`` group opening at ``text[start]``: (contents, index after it)."""
    if start >= len(text) or text[start] != "{":
        return None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i], i + 1
    return None


def extract_boxed(text: str) -> str | None:
    """Contents of the last ``\\boxed{...}`` (or ``\\fbox{...}``), nested braces kept; or None."""
    best = -1
    for command in ("\\boxed", "\\fbox"):
        best = max(best, text.rfind(command + "{"))
    if best < 0:
        return None
    group = _read_group(text, text.index("{", best))
    return None if group is None else group[0]


def math_answers_equal(answer: str, expected: str, *, timeout: float = 5.0) -> bool:
    """Whether two bare answers are equal by math-verify (LaTeX + sympy; ``expected`` is the gold).

    ``\\frac{1}{2}`` = ``1/2`` = ``0.5``, ``[1,2)`` = ``\\left[1, 2\\right)``, ``\\{1,2\\}`` =
    ``\\{2,1\\}``, ``x = 3`` = ``3``, ``5\\text{ cm}`` = ``5``. Raises
    :class:`~jaxrl_llm.rewards.verify.VerificationTimeout` after ``timeout`` seconds.
    """
    return shared_verifier().verify(expected, answer, extract=False, timeout=timeout)


def _gold_text(value: Any, field: str) -> str:
    """The bare expected answer: the field's text, or the contents of its last ``\\boxed{}``."""
    if value is None or isinstance(value, bool):
        raise ValueError(f"expected answer in field {field!r} is {value!r}")
    target = str(value)
    target = extract_boxed(target) if "\\boxed" in target or "\\fbox" in target else target
    if target is None or not target.strip():
        raise ValueError(f"expected answer {value!r} in field {field!r} is empty")
    return target


@dataclasses.dataclass(frozen=True)
class _MathVerifyReward(_AnswerReward):
    """An answer reward checked by math-verify in a worker process, ``timeout`` seconds per answer.

    A verification that times out scores ``incorrect`` and is counted as an error of the sample
    (:class:`~jaxrl_llm.rewards.base.Scores`), in both ``on_error`` modes.
    """

    timeout: float = 5.0

    def __post_init__(self):
        super().__post_init__()
        check_real("timeout", self.timeout)
        if self.timeout <= 0:
            raise ValueError(f"`timeout` must be > 0 seconds, got {self.timeout!r}")

    def _answer(self, completion: str) -> str | None:
        raise NotImplementedError

    _extract = False  # whether math-verify finds the answer in the completion itself

    def __call__(self, prompts: list[str], completions: list[str], **fields: Any) -> Scores:
        expected = _field(fields, self.field, type(self).__name__)
        verifier = shared_verifier()
        out, timed_out = [], []
        for i, (completion, value) in enumerate(zip(completions, expected, strict=True)):
            gold = _gold_text(value, self.field)
            answer = self._answer(completion)
            ok = False
            if answer is not None and answer.strip():
                try:
                    ok = verifier.verify(gold, answer, extract=self._extract, timeout=self.timeout)
                except VerificationTimeout:
                    _LOG.warning(
                        "%s: verifying %s took more than %gs; scored incorrect",
                        type(self).__name__,
                        excerpt(answer),
                        self.timeout,
                    )
                    timed_out.append(i)
            out.append(self.correct if ok else self.incorrect)
        return Scores(out, soft_errors=timed_out)


@dataclasses.dataclass(frozen=True)
class BoxedAnswer(_MathVerifyReward):
    """``\\boxed{...}`` math answer: the completion's last boxed expression equals the expected.

    The boxed contents (:func:`extract_boxed`) are compared with math-verify
    (:func:`math_answers_equal`); a completion without a ``\\boxed{}`` is incorrect. The expected
    field may itself contain a ``\\boxed{...}`` (e.g. a MATH solution) or be the bare answer.
    """

    def _answer(self, completion: str) -> str | None:
        return extract_boxed(completion)


@dataclasses.dataclass(frozen=True)
class MathVerifyAnswer(_MathVerifyReward):
    """MATH-style answer found and compared by math-verify in the whole completion.

    math-verify's own extraction picks the answer (a ``\\boxed{}`` first, else the last LaTeX
    ``$...$``/``\\[...\\]`` expression or "final answer is ...", else a plain expression such as
    ``0.5``); the expected field is a bare answer or contains a ``\\boxed{...}``.
    """

    _extract = True

    def _answer(self, completion: str) -> str | None:
        return completion
