"""``RUN_DIR/completions.jsonl``: what the policy writes, a few prompts of each logged step.

TRL's ``log_completions`` and verl's generation logs answer the first question of an RL run
that goes wrong: what are the completions, and what did the reward make of them? Every
``train.log_every`` steps (and the last) the first ``logging.completions`` prompt groups of the
step's batch (those of the first process; 0 turns it off) are written as one JSON object each:

    {"step": 12, "prompt": "<|im_start|>user\\nWhat is 7 + 5?...", "reward_mean": 0.5,
     "samples": [{"completion": "7 + 5 = 12", "reward": 1.0, "num_tokens": 9,
                  "truncated": false, "trained": true,
                  "rewards": {"gsm8k": 1.0, "format": 0.0},
                  "extra": {"pred": "12"}}, ...]}

``prompt`` is the prompt as the model read it (chat template and special tokens included,
padding dropped); ``completion`` the sampled text cut at its stop token, special tokens
dropped; ``trained`` whether the sample reaches the update (False for groups dropped by DAPO's
dynamic sampling; with PODS a group lists only the samples it kept); ``truncated`` whether it ran to
``rollout.max_new_tokens`` without a stop id (its text is logged also when
``rollout.mask_truncated_completions`` gives it no loss); ``rewards`` each reward term's
unweighted score (TRL's per-function columns); ``extra``, only when a reward reported columns,
their values (verl's ``reward_extra_info``, TRL's ``log_extra``; see
:class:`~jaxrl_llm.rewards.Scores`). The records come from the step's
groups as the update receives them, so an async run logs each batch under the step that trains
it. Each held-out evaluation adds the same number of its prompts, their records marked
``"eval": true`` (verl's validation generations; no ``trained`` key). On resume from step
``k`` the lines of later steps are dropped, as in ``metrics.jsonl``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from jaxrl_llm.train.metrics import COMPLETIONS_FILE, _truncate
from jaxrl_llm.train.step import Groups


def jsonable(value: Any) -> Any:
    """``json.dumps``' ``default`` for what rewards report: NumPy scalars and arrays as Python
    values, anything else JSON cannot write as its ``str``."""
    if isinstance(value, np.generic | np.ndarray):
        return value.tolist()
    return str(value)


def _plain(details: dict[str, Any]) -> dict[str, Any]:
    """``details`` as JSON will write it (see :func:`jsonable`)."""
    return json.loads(json.dumps(details, default=jsonable))


def group_records(
    tokenizer: Any, groups: Groups, step: int, num_groups: int, *, stop_ids: tuple[int, ...] = ()
) -> list[dict[str, Any]]:
    """The records of the first ``num_groups`` prompt groups of host ``groups`` (see the
    module docstring); ``stop_ids`` end a completion's text (the sampler's)."""
    from jaxrl_llm.rollout.text import completion_ids

    prompt_ids = np.asarray(groups.prompt_ids_bp)
    prompt_mask = np.asarray(groups.prompt_mask_bp, bool)
    tokens = np.asarray(groups.tokens_bgt)
    mask = np.asarray(groups.mask_bgt, bool)
    reward = np.asarray(groups.reward_bg, np.float64)
    member = np.asarray(groups.member_bg, bool)
    details = groups.details_bg
    stops = frozenset(int(s) for s in stop_ids)
    records = []
    for b in range(min(num_groups, tokens.shape[0])):
        samples = []
        for g in range(tokens.shape[1]):
            ids = tokens[b, g]
            # a completion with no loss at all ran to the budget (mask_truncated_completions)
            valid = mask[b, g] if mask[b, g].any() else np.ones_like(mask[b, g])
            kept = completion_ids(ids, valid, stop_ids=stops)
            truncated = not mask[b, g].any() or len(kept) == ids.shape[0]  # no stop id
            samples.append(
                {
                    "completion": tokenizer.decode(kept, skip_special_tokens=True),
                    "reward": float(reward[b, g]),
                    "num_tokens": int(valid.sum()),
                    "truncated": bool(truncated),
                    "trained": bool(member[b, g]),
                    **({} if details is None else json.loads(str(details[b, g]))),
                }
            )
        records.append(
            {
                "step": int(step),
                "prompt": tokenizer.decode(prompt_ids[b][prompt_mask[b]].tolist()),
                "reward_mean": float(reward[b].mean()),
                "samples": samples,
            }
        )
    return records


def eval_records(
    tokenizer: Any,
    prompt_ids_bp: np.ndarray,
    prompt_mask_bp: np.ndarray,
    texts: list[list[str]],
    reward_bg: np.ndarray,
    num_tokens_bg: np.ndarray,
    truncated_bg: np.ndarray,
    step: int,
    *,
    details: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Records of held-out prompts and their evaluation completions (already decoded), marked
    ``"eval": true`` (verl's validation generations log); ``details``: each sample's
    :meth:`~jaxrl_llm.rewards.RewardOutput.sample_details`, in order (sample ``b * G + g``)."""
    reward_bg = np.asarray(reward_bg, np.float64)
    g_count = reward_bg.shape[1]
    records = []
    for b in range(len(texts)):
        mask = np.asarray(prompt_mask_bp[b], bool)
        records.append(
            {
                "step": int(step),
                "eval": True,
                "prompt": tokenizer.decode(np.asarray(prompt_ids_bp[b])[mask].tolist()),
                "reward_mean": float(reward_bg[b].mean()),
                "samples": [
                    {
                        "completion": text,
                        "reward": float(reward_bg[b, g]),
                        "num_tokens": int(num_tokens_bg[b, g]),
                        "truncated": bool(truncated_bg[b, g]),
                        **({} if details is None else _plain(details[b * g_count + g])),
                    }
                    for g, text in enumerate(texts[b])
                ],
            }
        )
    return records


class CompletionLog:
    """Appends :func:`group_records` to ``RUN_DIR/completions.jsonl`` at the logged steps.

    The loop sets :attr:`step` to the step about to run; :meth:`record` is called with the
    step's host groups right before its update (sync and async alike). Construction drops the
    lines of steps after ``start_step`` (a resumed run). :attr:`sink` (the loop's
    ``MetricsLogger.log_completions``) also receives every step's records: the trackers'
    completions tables.
    """

    def __init__(
        self,
        run_dir: str | Path,
        tokenizer: Any,
        *,
        num_groups: int,
        log_every: int,
        max_steps: int,
        start_step: int,
        stop_ids: tuple[int, ...] = (),
    ):
        self.path = Path(run_dir) / COMPLETIONS_FILE
        self.tokenizer, self.num_groups, self.stop_ids = tokenizer, num_groups, stop_ids
        self.log_every, self.max_steps = log_every, max_steps
        self.step = start_step + 1
        self.sink: Callable[[int, list[dict[str, Any]]], None] | None = None
        _truncate(self.path, start_step)

    def due(self, step: int) -> bool:
        return self.num_groups > 0 and (step % self.log_every == 0 or step == self.max_steps)

    def record(self, groups: Groups) -> None:
        """Writes the records of ``groups`` (host arrays) if :attr:`step` is a logged step."""
        if not self.due(self.step):
            return
        self.write(
            group_records(
                self.tokenizer, groups, self.step, self.num_groups, stop_ids=self.stop_ids
            )
        )

    def write(self, records: list[dict[str, Any]]) -> None:
        """Appends ``records`` (e.g. an evaluation's, :func:`eval_records`) as they are."""
        if not records:
            return
        with self.path.open("a", encoding="utf-8") as f:
            f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        if self.sink is not None:
            self.sink(records[0]["step"], records)


__all__ = ["COMPLETIONS_FILE", "CompletionLog", "eval_records", "group_records"]
