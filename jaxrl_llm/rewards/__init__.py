"""Host-side rewards: verifiable answers, format and length shaping, user functions, reward models.

The protocol is ``fn(prompts, completions, **fields) -> list[float]``, batched over ``N``
samples; ``fields`` are per-sample dataset columns. Rewards are plain Python/NumPy and run on the
host between rollout and update. The trainer builds one :class:`WeightedSum` from the config::

    reward = build_reward([{"type": "integer_answer"}, {"type": "regex", "pattern": r"^\\d+$",
                            "mode": "fullmatch", "weight": 0.1}])
    reward_bg, out = score_groups(reward, prompts_b, completions_bg, {"answer": answers_b},
                                  num_tokens_bg=num_tokens_bg)
    out.metrics()  # reward/mean, reward/std, reward/<name>/mean, .../num_errors, accuracy
    out.sample_details()  # per sample: each term's score, the columns the rewards reported

See docs/rewards_and_data.md.
"""

from jaxrl_llm.rewards.answers import (
    BoxedAnswer,
    Gsm8kAnswer,
    IntegerAnswer,
    MathVerifyAnswer,
    expected_number,
    extract_boxed,
    gsm8k_answer,
    last_number,
    math_answers_equal,
    parse_number,
)
from jaxrl_llm.rewards.base import (
    COMPLETION_IDS_FIELD,
    NUM_TOKENS_FIELD,
    ON_ERROR_MODES,
    RAW_PROMPT_FIELD,
    TRAINER_STATE_FIELD,
    Checked,
    RewardConfigError,
    RewardError,
    RewardExited,
    RewardFn,
    RewardTimeout,
    Scores,
    TrainerState,
    checked_call,
    checked_scores,
)
from jaxrl_llm.rewards.combine import (
    CompletionIds,
    RewardOutput,
    RewardTerm,
    WeightedSum,
    score_groups,
)
from jaxrl_llm.rewards.external import RewardModelReward, TrlReward, VerlScore, load_callable
from jaxrl_llm.rewards.registry import (
    COMMON_KEYS,
    REWARD_TYPES,
    TYPE_ALIASES,
    build_reward,
    build_term,
    reward_options,
)
from jaxrl_llm.rewards.route import Routed
from jaxrl_llm.rewards.shaping import LengthPenalty, RegexFormat
from jaxrl_llm.rewards.verify import MathVerifier, VerificationTimeout, VerifierError

__all__ = [
    "COMMON_KEYS",
    "COMPLETION_IDS_FIELD",
    "NUM_TOKENS_FIELD",
    "ON_ERROR_MODES",
    "RAW_PROMPT_FIELD",
    "REWARD_TYPES",
    "TRAINER_STATE_FIELD",
    "TYPE_ALIASES",
    "BoxedAnswer",
    "Checked",
    "CompletionIds",
    "Gsm8kAnswer",
    "IntegerAnswer",
    "LengthPenalty",
    "MathVerifier",
    "MathVerifyAnswer",
    "RegexFormat",
    "RewardConfigError",
    "RewardError",
    "RewardExited",
    "RewardFn",
    "RewardModelReward",
    "RewardOutput",
    "RewardTerm",
    "RewardTimeout",
    "Routed",
    "Scores",
    "TrainerState",
    "TrlReward",
    "VerificationTimeout",
    "VerifierError",
    "VerlScore",
    "WeightedSum",
    "build_reward",
    "build_term",
    "checked_call",
    "checked_scores",
    "expected_number",
    "extract_boxed",
    "gsm8k_answer",
    "last_number",
    "load_callable",
    "math_answers_equal",
    "parse_number",
    "reward_options",
    "score_groups",
]
