"""build_reward / build_term: every type from config, and every config error."""

import asyncio
import textwrap

import numpy as np
import pytest

from jaxrl_llm.rewards import (
    REWARD_TYPES,
    BoxedAnswer,
    Gsm8kAnswer,
    IntegerAnswer,
    LengthPenalty,
    RegexFormat,
    RewardConfigError,
    RewardError,
    RewardModelReward,
    Routed,
    TrainerState,
    build_reward,
    build_term,
    load_callable,
    reward_options,
)

USER_MODULE = """
def exact(prompts, completions, *, answer, bonus=0.0, **fields):
    return [float(c.strip() == str(a)) + bonus for c, a in zip(completions, answer)]

def score(prompts, completions):
    return [float(len(c)) for c in completions]

class Scorers:
    @staticmethod
    def length(prompts, completions, **fields):
        return [float(len(c)) for c in completions]

NOT_CALLABLE = 3
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_reward_types():
    assert REWARD_TYPES == (
        "integer_answer",
        "gsm8k_answer",
        "boxed_answer",
        "math_verify",
        "regex",
        "length_penalty",
        "user",
        "reward_model",
        "verl",
        "trl",
        "route",
    )
    assert reward_options("regex")[0] == ("pattern",)
    assert reward_options("length_penalty")[0] == ("target",)
    assert reward_options("user") == (("function",), ("kwargs",))


@pytest.mark.parametrize(
    ("config", "cls"),
    [
        ({"type": "integer_answer", "field": "target"}, IntegerAnswer),
        ({"type": "gsm8k_answer", "strict": False}, Gsm8kAnswer),
        ({"type": "boxed_answer"}, BoxedAnswer),
        ({"type": "regex", "pattern": "a+", "mode": "fullmatch"}, RegexFormat),
        ({"type": "length_penalty", "target": 64, "unit": "chars"}, LengthPenalty),
    ],
)
def test_builtin_types(config, cls):
    term = build_term(config)
    assert isinstance(term.fn, cls)
    assert term.name == config["type"] and term.weight == 1.0


def test_weight_name_and_options_reach_the_reward():
    term = build_term({"type": "integer_answer", "weight": 0.5, "name": "acc", "correct": 2.0})
    assert (term.name, term.weight, term.fn.correct) == ("acc", 0.5, 2.0)


def test_string_shorthands(user_module):
    assert isinstance(build_term("boxed_answer").fn, BoxedAnswer)
    term = build_term("my_rewards_mod:exact")
    assert term.name == "exact"
    assert term.fn(["p"], ["3"], answer=[3]) == [1.0]


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (
            {"type": "integer_anwser"},
            "unknown reward type 'integer_anwser'; did you mean 'integer_answer'",
        ),
        ({"weight": 1.0}, "missing `type`"),
        ({"type": "integer_answer", "feild": "x"}, "unknown key 'feild'; did you mean 'field'"),
        ({"type": "integer_answer", "wieght": 2}, "did you mean 'weight'"),
        ({"type": "regex"}, r"rewards\[0\] \(type 'regex'\): missing required key\(s\) pattern"),
        ({"type": "regex", "pattern": "("}, "not a valid regex"),
        ({"type": "integer_answer", "weight": "heavy"}, "`weight` must be a number"),
        ({"type": "integer_answer", "weight": float("nan")}, "`weight` must be finite"),
        ({"type": "integer_answer", "name": "a b"}, "reward name must be"),
        ({"type": "integer_answer", "name": "mean"}, "reserved"),
        ({"type": "length_penalty", "target": "long"}, "`target` must be an integer"),
        ({"type": "user"}, "missing required key"),
        ({"type": "reward_model"}, "needs a scorer"),
        ({"type": "reward_model", "score": "my_rewards_mod:score", "batch_size": 0}, "batch_size"),
        (3, "a reward is a mapping"),
    ],
)
def test_config_errors(config, match, user_module):
    with pytest.raises(RewardConfigError, match=match):
        build_reward([config])


def test_build_reward_list_errors():
    with pytest.raises(RewardConfigError, match="non-empty list"):
        build_reward([])
    with pytest.raises(RewardConfigError, match="rewards: accuracy term 'nope'"):
        build_reward(["integer_answer"], accuracy="nope")
    with pytest.raises(ValueError, match="on_error must be one of"):
        build_reward(["integer_answer"], on_error="ignore")


def test_duplicate_names_get_suffixes():
    patterns = [{"type": "regex", "pattern": p} for p in ("a", "b", "c")]
    assert build_reward(patterns).names == ("regex", "regex_2", "regex_3")


def test_user_function_from_module_with_kwargs(user_module):
    term = build_term(
        {"type": "user", "function": "my_rewards_mod:exact", "kwargs": {"bonus": 0.5}}
    )
    assert term.fn(["p", "p"], ["3", "4"], answer=[3, 3]) == [1.5, 0.5]
    term = build_term({"type": "user", "function": "my_rewards_mod:Scorers.length", "name": "len"})
    assert term.name == "len" and term.fn(["p"], ["abc"]) == [3.0]


def test_user_function_from_file(tmp_path):
    folder = tmp_path / "sub"
    folder.mkdir()
    (folder / "rw.py").write_text(textwrap.dedent(USER_MODULE))
    fn = load_callable("sub/rw.py:exact", base_dir=tmp_path)
    assert fn(["p"], ["3"], answer=[3]) == [1.0]
    assert load_callable(f"{folder / 'rw.py'}:exact") is fn  # imported once per file
    reward = build_reward([{"type": "user", "function": "sub/rw.py:exact"}], base_dir=tmp_path)
    assert reward.names == ("exact",)


VERL_MODULE = """
import asyncio

in_flight = [0, 0]  # now, most

async def judged(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):
    in_flight[0] += 1
    in_flight[1] = max(in_flight)
    await asyncio.sleep(0)
    in_flight[0] -= 1
    return {"score": scale * float(solution_str == ground_truth), "judge": "async"}

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    extra_info["seen"] = True  # verl's own manager adds keys to it too
    if data_source == "dict":
        return {"score": 2.0, "acc": True}
    if data_source == "no_score":
        return {"acc": 1.0}
    return float(solution_str.strip() == ground_truth) + extra_info.get("bonus", 0.0)
"""


def test_a_verl_compute_score_function_is_a_reward_unchanged(tmp_path):
    """verl's custom_reward_function, per sample, with the columns of a verl data file:
    data_source, reward_model.ground_truth and a copy of extra_info; a dict's "score"."""
    (tmp_path / "verl_rw.py").write_text(textwrap.dedent(VERL_MODULE))
    spec = {"type": "verl", "function": "verl_rw.py:compute_score"}
    reward = build_reward([spec], base_dir=tmp_path)
    assert reward.names == ("compute_score",)
    extra = [{"bonus": 0.5}, None, {}]
    fields = {
        "data_source": ["gsm8k", "gsm8k", "dict"],
        "reward_model.ground_truth": ["4", "5", "6"],
        "extra_info": extra,
    }
    out = reward(["p"] * 3, ["4", " 4 ", "x"], **fields)
    np.testing.assert_allclose(out.total_n, [1.5, 0.0, 2.0])
    assert extra == [{"bonus": 0.5}, None, {}]  # the function's writes do not reach the data
    # Without a data_source column the function gets None; other fields may be renamed.
    other = build_reward(
        [{**spec, "ground_truth_field": "answer", "extra_info_field": "meta"}], base_dir=tmp_path
    )
    np.testing.assert_allclose(other(["p"], ["7"], answer=["7"]).total_n, [1.0])
    one = {k: v[:1] for k, v in fields.items()} | {"data_source": ["no_score"]}
    with pytest.raises(RewardError, match=r"returned a dict without 'score' \(keys: acc\)"):
        reward(["p"], ["x"], **one)
    with pytest.raises(RewardError, match=r"needs the field\(s\) \['reward_model.ground_truth'\]"):
        reward(["p"], ["x"], answer=["x"])
    with pytest.raises(RewardConfigError, match=r"type 'verl'.*missing required key\(s\) function"):
        build_term({"type": "verl"})
    # A dict's other keys are verl's reward_extra_info: reported columns (None where a sample's
    # dict lacks the key), whose numeric means reach the metrics.
    assert out.extras == {"compute_score": {"acc": [None, None, True]}}
    assert out.metrics()["reward/compute_score/acc/mean"] == 1.0
    assert [d.get("extra") for d in out.sample_details()] == [
        {"acc": None},
        {"acc": None},
        {"acc": True},
    ]
    # verl's reward loop awaits an async compute_score: every sample of the batch at once, in
    # one event loop; reward_kwargs (custom_reward_function.reward_kwargs) go to each call.
    judged = build_reward(
        [{"type": "verl", "function": "verl_rw.py:judged", "reward_kwargs": {"scale": 2.0}}],
        base_dir=tmp_path,
    )
    out = judged(["p"] * 3, ["4", "5", "x"], **fields)
    np.testing.assert_allclose(out.total_n, [2.0, 2.0, 0.0])
    assert out.extras == {"judged": {"judge": ["async"] * 3}}
    in_flight = load_callable(f"{tmp_path / 'verl_rw.py'}:judged").__globals__["in_flight"]
    assert in_flight == [0, 3]  # all three awaited together


TRL_MODULE = """
def format_reward(completions, **kwargs):  # TRL's docs: conversational completions
    return [1.0 if c[0]["content"].startswith("<think>") else 0.0 for c in completions]

def length_reward(prompts, completions, completion_ids, trainer_state, solution, **kwargs):
    seen.append((prompts, completions, solution))
    return [None if s == "skip" else float(len(ids)) for ids, s in zip(completion_ids, solution)]

seen = []
"""


def test_a_trl_reward_function_is_a_reward_unchanged(tmp_path):
    """TRL's calling convention: prompts and completions as the data's format has them
    (messages for a conversational prompt), completion_ids, trainer_state and the columns;
    None counts 0, as TRL's nansum makes it."""
    (tmp_path / "trl_rw.py").write_text(textwrap.dedent(TRL_MODULE))
    specs = [
        {"type": "trl", "function": f"trl_rw.py:{f}"} for f in ("format_reward", "length_reward")
    ]
    reward = build_reward(specs, base_dir=tmp_path)
    assert reward.names == ("format_reward", "length_reward")
    chat = [[{"role": "user", "content": "2+2?"}], [{"role": "user", "content": "3+3?"}]]
    out = reward(
        ["2+2?", "3+3?"],
        ["<think>4</think>", "6"],
        raw_prompt=chat,
        completion_ids=[[5, 6, 7], [8]],
        completion_num_tokens=[3, 1],
        solution=["4", "skip"],
    )
    np.testing.assert_allclose(out.components["format_reward"], [1.0, 0.0])
    np.testing.assert_allclose(out.components["length_reward"], [3.0, 0.0])
    seen = load_callable(f"{tmp_path / 'trl_rw.py'}:length_reward").__globals__["seen"]
    assert seen[-1] == (
        chat,
        [
            [{"role": "assistant", "content": "<think>4</think>"}],
            [{"role": "assistant", "content": "6"}],
        ],
        ["4", "skip"],
    )
    # Text prompts: text in, text out.
    build_reward(specs[1:], base_dir=tmp_path)(
        ["a"], ["b"], raw_prompt=["a"], completion_ids=[[1]], solution=["x"]
    )
    assert seen[-1] == (["a"], ["b"], ["x"])
    with pytest.raises(RewardConfigError, match=r"type 'trl'.*unknown key 'a'"):
        build_term(
            {"type": "trl", "function": "trl_rw.py:seen", "kwargs": {"a": 1}}, base_dir=tmp_path
        )


TRL_LOGGING_MODULE = """
import asyncio

def curriculum(prompts, completions, trainer_state, log_extra, log_metric, **kwargs):
    # TRL >= 1.x: shape by progress, add completions-table columns and scalar metrics
    log_extra("answer", [c[-1] for c in completions])
    log_extra("length", [len(c) for c in completions])
    log_metric("progress", trainer_state.global_step / trainer_state.max_steps)
    log_metric("calls", 1.0)
    log_metric("calls", 3.0)
    return [float(trainer_state.global_step)] * len(completions)

async def judged(prompts, completions, **kwargs):  # TRL awaits async reward functions
    await asyncio.sleep(0)
    return [float(len(c)) for c in completions]

def bad_column(completions, log_extra, **kwargs):
    log_extra("short", [1])
    return [0.0] * len(completions)

def bad_metric(completions, log_metric, **kwargs):
    log_metric("m", "high")
    return [0.0] * len(completions)

def mean_metric(completions, log_metric, **kwargs):
    log_metric("mean", 1.0)
    return [0.0] * len(completions)
"""


def test_trl_reward_functions_get_trainer_state_log_extra_log_metric_and_may_be_async(tmp_path):
    """What TRL 1.16's _calculate_rewards passes beyond the data: the trainer state (global
    step, max steps), log_extra (one value per completion: columns beside the logged
    completions) and log_metric (scalars, averaged over the batch's calls); async functions
    are awaited, also under a running event loop (a notebook)."""
    (tmp_path / "trl_log.py").write_text(textwrap.dedent(TRL_LOGGING_MODULE))
    spec = lambda f: {"type": "trl", "function": f"trl_log.py:{f}"}
    reward = build_reward([spec("curriculum"), spec("judged")], base_dir=tmp_path)
    state = TrainerState(global_step=3, max_steps=12)
    out = reward(["p", "q"], ["ab", "xyz"], trainer_state=[state, state])
    np.testing.assert_allclose(out.components["curriculum"], [3.0, 3.0])
    np.testing.assert_allclose(out.components["judged"], [2.0, 3.0])
    assert out.extras == {"curriculum": {"answer": ["b", "z"], "length": [2, 3]}}
    assert out.reported == {"curriculum": {"progress": 0.25, "calls": 2.0}}
    metrics = out.metrics()
    assert metrics["reward/curriculum/progress"] == 0.25
    assert metrics["reward/curriculum/calls"] == 2.0
    assert metrics["reward/curriculum/length/mean"] == 2.5
    assert "reward/curriculum/answer/mean" not in metrics  # text: shown, not averaged
    assert out.sample_details()[1] == {
        "rewards": {"curriculum": 3.0, "judged": 3.0},
        "extra": {"answer": "z", "length": 3},
    }

    async def in_a_notebook():  # the caller's thread already runs an event loop
        return reward(["p"], ["abcd"], trainer_state=[state])

    np.testing.assert_allclose(asyncio.run(in_a_notebook()).components["judged"], [4.0])
    for name, match in (
        ("bad_column", r"log_extra\('short', \.\.\.\) got 1 values for 2 completions"),
        ("bad_metric", r"log_metric\('m', \.\.\.\) got 'high'; it takes a number"),
        ("mean_metric", r"reported a metric named 'mean'.*reward/mean_metric/mean"),
    ):
        with pytest.raises(RewardError, match=match):
            build_reward([spec(name)], base_dir=tmp_path)(["p", "q"], ["a", "b"])


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("no_colon_here", "must be 'module:function'"),
        ("mod:", "both module and function"),
        ("surely_not_a_module_xyz:f", "no module named 'surely_not_a_module_xyz'"),
        ("missing/file.py:f", "file .*missing/file.py' does not exist"),
        ("my_rewards_mod:exakt", "has no 'exakt'; did you mean 'exact'"),
        ("my_rewards_mod:NOT_CALLABLE", "is a int, not a callable"),
        ("broken_mod:f", "importing 'broken_mod' failed with ZeroDivisionError"),
        (
            "imports_missing_mod:f",
            "importing 'imports_missing_mod' failed with ModuleNotFoundError",
        ),
    ],
)
def test_load_callable_errors(spec, match, user_module):
    (user_module / "broken_mod.py").write_text("1 / 0\n")
    (user_module / "imports_missing_mod.py").write_text("import surely_not_a_module_abc\n")
    with pytest.raises(RewardConfigError, match=match):
        load_callable(spec, base_dir=user_module)


def test_reward_model_from_trainer_or_spec(user_module):
    calls = []

    def head(prompts, completions):
        calls.append(len(completions))
        return np.arange(len(completions), dtype=np.float32)[:, None]  # [n, 1] like a head

    term = build_term({"type": "reward_model", "batch_size": 2}, reward_model=head)
    assert isinstance(term.fn, RewardModelReward)
    assert term.fn(["p"] * 5, ["a"] * 5) == [0.0, 1.0, 0.0, 1.0, 0.0]
    assert calls == [2, 2, 1]
    term = build_term({"type": "reward_model", "score": "my_rewards_mod:score"})
    assert term.fn(["p", "p"], ["ab", "abc"]) == [2.0, 3.0]


def test_config_layer_spelling(user_module):
    """{type, weight, name, kwargs} terms, as jaxrl_llm.config writes them."""
    reward = build_reward(
        [
            {"type": "integer_answer", "weight": 1.0, "name": None, "kwargs": {"field": "target"}},
            {"type": "gsm8k", "weight": 0.5, "name": None, "kwargs": {"strict": False}},
            {"type": "boxed", "kwargs": {}},
            {"type": "my_rewards_mod:exact", "name": "exact_match", "kwargs": {"bonus": 1.0}},
            {"type": "reward_model", "kwargs": {"path": "/models/rm", "batch_size": 4}},
        ],
        reward_model=lambda p, c: [0.0] * len(c),
    )
    assert reward.names == ("integer_answer", "gsm8k", "boxed", "exact_match", "reward_model")
    assert reward.terms[0].fn.field == "target"
    assert isinstance(reward.terms[1].fn, Gsm8kAnswer) and reward.terms[1].fn.strict is False
    assert reward.terms[4].fn.batch_size == 4
    out = reward(["p"], ["#### 3 \\boxed{3}"], target=[3], answer=["3"])
    np.testing.assert_allclose(out.components["exact_match"], [1.0])  # "..." != "3", + bonus
    np.testing.assert_allclose(out.total_n, [1.0 + 0.5 + 1.0 + 1.0 + 0.0])


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"type": "integer_answer", "field": "a", "kwargs": {"field": "b"}}, "both as keys and in"),
        ({"type": "integer_answer", "kwargs": ["field"]}, "`kwargs` must be a mapping"),
        ({"type": "integer_answer", "kwargs": {"feild": "a"}}, "did you mean 'field'"),
        ({"type": "m:f", "function": "m:g"}, "not both"),
        ({"type": "gsm8", "kwargs": {}}, "did you mean 'gsm8k'"),
    ],
)
def test_config_layer_spelling_errors(config, match):
    with pytest.raises(RewardConfigError, match=match):
        build_term(config)


def test_route_scores_each_sample_with_the_reward_its_data_source_names():
    """verl's default_compute_score dispatches on data_source: a GSM8K sample is checked as
    GSM8K, an arithmetic one as an integer; an unknown source is an error unless a default is
    given; each route's mean is reported; an all-answer route is the accuracy term."""
    spec = {
        "type": "route",
        "by": "source",
        "routes": {"gsm": "gsm8k", "arith": {"type": "integer_answer"}},
    }
    reward = build_reward([spec, {"type": "regex", "pattern": "x", "weight": 0.0}])
    assert reward.accuracy == "route"
    completions = ["so #### 12", "12", "it is 7", "#### 7"]
    fields = {"source": ["gsm", "gsm", "arith", "arith"], "answer": ["12", "12", "7", "8"]}
    out = reward(["p"] * 4, completions, **fields)
    # "12" has no "####" (strict GSM8K); "#### 7" is 7 as an integer answer, not 8
    np.testing.assert_allclose(out.components["route"], [1.0, 0.0, 1.0, 0.0])
    assert out.reported["route"] == {"gsm/mean": 0.5, "arith/mean": 0.5}
    metrics = out.metrics()
    assert metrics["reward/route/gsm/mean"] == 0.5 and metrics["accuracy"] == 0.5
    unknown = {"source": ["gsm", "math"], "answer": ["1", "2"]}
    with pytest.raises(RewardError, match=r"no reward for source = 'math'.*'gsm', 'arith'"):
        reward(["p"] * 2, ["#### 1", "2"], **unknown)
    with_default = build_reward([{**spec, "default": "integer_answer"}])
    np.testing.assert_allclose(
        with_default(["p"] * 2, ["#### 1", "2"], **unknown).total_n, [1.0, 1.0]
    )
    fmt = {"type": "regex", "pattern": "x"}
    shaped = build_reward([{**spec, "routes": {**spec["routes"], "fmt": fmt}}])
    assert shaped.accuracy is None  # a non-answer route: no accuracy term
    arrays = Routed({"a": lambda p, c, **f: np.ones(len(c))}, by="source")  # NumPy scores
    assert arrays(["p"], ["x"], source=["a"]) == [1.0]
    for bad, match in (
        ({"routes": {}}, "`routes` must map values"),
        ({"routes": {"gsm": {"type": "gsm8k", "weight": 2}}}, "has no weight of its own"),
        ({"routes": {"gsm": {"type": "route", "routes": {"a": "gsm8k"}}}}, "do not nest"),
        ({"routes": {"gsm": "gsm9k"}}, r"'route'\): routes\['gsm'\]: unknown reward type 'gsm9k'"),
    ):
        with pytest.raises(RewardConfigError, match=match):
            build_term({**spec, **bad})
