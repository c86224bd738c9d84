"""Format and length rewards: a regular-expression check and a linear length penalty."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from jaxrl_llm.rewards._validate import check_bool, check_choice, check_int, check_real
from jaxrl_llm.rewards.base import NUM_TOKENS_FIELD

REGEX_MODES = ("search", "fullmatch", "match")
LENGTH_UNITS = ("tokens", "chars")


@dataclasses.dataclass(frozen=True)
class RegexFormat:
    """Format reward: ``reward`` if the completion matches ``pattern``, else ``penalty``.

    ``mode`` is ``"search"`` (anywhere, the default), ``"match"`` (at the start) or
    ``"fullmatch"`` (the whole completion, after stripping surrounding whitespace when
    ``strip=True``). ``dotall=True`` (default) lets ``.`` cross newlines, so
    ``<think>.*</think>\\s*<answer>.*</answer>`` checks a multi-line reasoning format.
    An invalid pattern fails when the reward is built.
    """

    pattern: str
    mode: str = "search"
    dotall: bool = True
    ignore_case: bool = False
    strip: bool = True
    reward: float = 1.0
    penalty: float = 0.0
    _regex: re.Pattern = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        if not isinstance(self.pattern, str):
            raise TypeError(f"`pattern` must be a string, got {type(self.pattern).__name__}")
        check_choice("mode", self.mode, REGEX_MODES)
        for name in ("dotall", "ignore_case", "strip"):
            check_bool(name, getattr(self, name))
        check_real("reward", self.reward)
        check_real("penalty", self.penalty)
        flags = (re.DOTALL if self.dotall else 0) | (re.IGNORECASE if self.ignore_case else 0)
        try:
            regex = re.compile(self.pattern, flags)
        except re.error as exc:
            raise ValueError(f"`pattern` {self.pattern!r} is not a valid regex: {exc}") from exc
        object.__setattr__(self, "_regex", regex)

    def __call__(self, prompts: list[str], completions: list[str], **fields: Any) -> list[float]:
        match = getattr(self._regex, self.mode)
        out = []
        for completion in completions:
            text = completion.strip() if self.strip else completion
            out.append(self.reward if match(text) is not None else self.penalty)
        return out


@dataclasses.dataclass(frozen=True)
class LengthPenalty:
    """Linear length penalty beyond a target length (≤ 0, never a bonus)::

        reward = -coef * max(0, L - target)          (then clipped at -max_penalty, if set)

    ``L`` is measured in ``unit``:

    * ``"tokens"`` (default): the number of tokens the policy generated, read from the field
      ``completion_num_tokens`` that the trainer passes with every batch (exact, and no
      re-tokenisation on the host). Calling it without that field is an error.
    * ``"chars"``: ``len(completion)`` in characters, for use without a trainer.
    """

    target: int
    coef: float = 0.01
    unit: str = "tokens"
    max_penalty: float | None = None

    def __post_init__(self):
        check_int("target", self.target, minimum=0)
        check_real("coef", self.coef, minimum=0.0)
        check_choice("unit", self.unit, LENGTH_UNITS)
        if self.max_penalty is not None:
            check_real("max_penalty", self.max_penalty, minimum=0.0)

    @property
    def required_fields(self) -> tuple[str, ...]:
        return (NUM_TOKENS_FIELD,) if self.unit == "tokens" else ()

    def __call__(self, prompts: list[str], completions: list[str], **fields: Any) -> list[float]:
        if self.unit == "chars":
            lengths = [len(c) for c in completions]
        else:
            if NUM_TOKENS_FIELD not in fields:
                raise KeyError(
                    f"LengthPenalty(unit='tokens') needs the field {NUM_TOKENS_FIELD!r} (the "
                    f"trainer passes it); use unit='chars' to measure characters instead"
                )
            lengths = fields[NUM_TOKENS_FIELD]
        out = []
        for length in lengths:
            penalty = self.coef * max(0, int(length) - self.target)
            if self.max_penalty is not None:
                penalty = min(penalty, self.max_penalty)
            out.append(-float(penalty))
        return out
