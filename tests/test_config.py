"""jaxrl_llm.config: every shipped YAML validates; overrides; every error path; round trip.

The schema and validation end to end, through load_config; the generic engine on a toy schema is
in tests/config/test_engine.py, the schema's own conventions in tests/config/test_schema.py.
"""

from __future__ import annotations

import copy
import dataclasses
import pickle
import re
import textwrap
import types
import typing
from pathlib import Path

import pytest

from jaxrl_llm import algorithms
from jaxrl_llm import config as C
from jaxrl_llm.config import ConfigError, load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
ALL_YAML = sorted(CONFIGS.rglob("*.yaml"))
POD_YAML = sorted((CONFIGS / "experiments").glob("*.yaml"))
POD_OVERRIDES = ["model.path=tiny-random"]


def _overrides(path: Path) -> list[str]:
    return POD_OVERRIDES if path in POD_YAML else []


def _write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def _load(overrides: list[str], base: str = "quickstart.yaml", **kw) -> C.TrainConfig:
    return load_config(CONFIGS / base, overrides, **kw)


def _fails(overrides: list[str], *fragments: str, base: str = "quickstart.yaml") -> ConfigError:
    with pytest.raises(ConfigError) as info:
        _load(overrides, base)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))
    return info.value


# ---------------------------------------------------------------------------------------------
# The shipped configs.


def test_expected_files_exist():
    names = {p.relative_to(CONFIGS).as_posix() for p in ALL_YAML}
    assert {"base.yaml", "quickstart.yaml", "tiny.yaml"} <= names
    assert {f"algorithms/{n}.yaml" for n in algorithms.RECIPES} <= names
    assert {
        "experiments/qwen2.5-1.5b-gsm8k-8gpu.yaml",
        "experiments/qwen2.5-1.5b-gsm8k-tpu-v5e-8.yaml",
    } <= names


@pytest.mark.parametrize("path", ALL_YAML, ids=lambda p: p.relative_to(CONFIGS).as_posix())
def test_every_config_loads_and_fits_8_devices(path):
    config = load_config(path, _overrides(path), device_count=8)
    assert C.check_devices(config, 1)
    recipe = C.build_recipe(config)
    assert recipe.name == config.algorithm.name
    assert (config.rollout is None) == (config.algorithm.name == "dpo")
    assert hash(config)  # frozen all the way down


@pytest.mark.parametrize("name", list(algorithms.RECIPES))
def test_recipe_configs_name_their_recipe(name):
    config = load_config(CONFIGS / "algorithms" / f"{name}.yaml")
    assert config.algorithm.name == name
    assert config.algorithm.hparams, "paper hyperparameters are spelled out"


def test_base_yaml_is_the_defaults():
    assert load_config(CONFIGS / "base.yaml") == C.TrainConfig()
    assert C.validate(C.TrainConfig()) == C.TrainConfig()


def _schema_keys(cls, prefix: str = "", *, absent: dict | None = None) -> set[str]:
    """Every knob's dotted key. A section that is off by default (``wandb: null``) has no
    lines of its own in base.yaml: its knobs go to ``absent`` (documented in the comment)."""
    keys = set()
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        keys.add(key)
        hint = typing.get_type_hints(cls)[f.name]
        options = typing.get_args(hint) if typing.get_origin(hint) is types.UnionType else ()
        inner = [a for a in (hint, *options) if dataclasses.is_dataclass(a)]
        if inner and f.default is None and absent is not None:
            absent[key] = [g.name for g in dataclasses.fields(inner[0])]
        elif inner:
            keys |= _schema_keys(inner[0], key + ".", absent=absent)
    return keys


def test_base_yaml_comments_every_knob_once():
    documented, stack, list_indent = {}, [], None
    previous = ""
    for line in (CONFIGS / "base.yaml").read_text().splitlines():
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if not stripped or stripped.startswith("#"):
            previous = stripped or previous
            continue
        if list_indent is not None and indent > list_indent:
            previous = stripped
            continue
        list_indent = None
        if stripped.startswith("- "):
            list_indent = indent
            previous = stripped
            continue
        key = stripped.split(":", 1)[0]
        stack = [(i, k) for i, k in stack if i < indent] + [(indent, key)]
        path = ".".join(k for _, k in stack)
        assert path not in documented, f"{path} appears twice in base.yaml"
        documented[path] = previous.startswith("#") or " #" in stripped
        previous = stripped
    absent: dict[str, list[str]] = {}
    assert set(documented) == _schema_keys(C.TrainConfig, absent=absent)
    assert all(documented.values()), [k for k, v in documented.items() if not v]
    assert "logging.wandb" in absent
    text = (CONFIGS / "base.yaml").read_text()
    for section, knobs in absent.items():  # named in the section's comment
        missing = [k for k in knobs if not re.search(rf"#.*\b{k}\b", text)]
        assert not missing, f"{section}: base.yaml's comment does not mention {missing}"


def test_quickstart_is_grpo_on_arithmetic_sized_for_cpu():
    c = _load([])
    assert (c.algorithm.name, c.model.path, c.data.source) == ("grpo", "default", "arithmetic")
    assert (c.rollout.prompts_per_step, c.rollout.num_samples, c.rollout.max_new_tokens) == (
        8,
        4,
        24,
    )
    assert 1e-6 <= c.optim.lr <= 2e-5 and c.optim.optimizer == "adamw"
    assert c.data.eval_size == 200
    assert not C.needs_reference_model(c)


def test_tiny_is_the_tiny_random_model():
    c = load_config(CONFIGS / "tiny.yaml", device_count=8)
    assert c.model.path == "tiny-random"
    assert C.check_devices(c, 8) == {"data": 1, "fsdp": 1, "tensor": 1}


def test_rollout_tensor_parallel_divides_each_processs_rollout_devices():
    """Colocated, the engines' t divides each process's devices; split, each process's share
    of the rollout devices (placement.rollout_fraction of its own)."""
    tp = ["rollout.engine=auto", "rollout.tensor_parallel=4"]
    assert C.check_devices(load_config(CONFIGS / "tiny.yaml", tp), 8)
    with pytest.raises(ConfigError, match="each process's 2"):
        C.check_devices(load_config(CONFIGS / "tiny.yaml", tp), 8, process_count=4)
    split = ["placement.mode=split", "placement.rollout_fraction=0.25", "rollout.num_samples=2"]
    with pytest.raises(ConfigError, match="the rollout's 2 devices"):
        C.check_devices(load_config(CONFIGS / "tiny.yaml", [*split, *tp]), 8)
    ok = [*split, "rollout.engine=auto", "rollout.tensor_parallel=2"]
    assert C.check_devices(load_config(CONFIGS / "tiny.yaml", ok), 8)


def test_pod_configs_need_a_model_path():
    for path in POD_YAML:
        with pytest.raises(ConfigError, match=r"model\.path is required"):
            load_config(path)
        c = load_config(path, POD_OVERRIDES, device_count=8)
        assert c.data.source == "file" and c.data.path.endswith("gsm8k/train.jsonl")
        assert c.mesh.preset == "fsdp"
        assert C.check_devices(c, 8) == {"data": 1, "fsdp": 8, "tensor": 1}


# ---------------------------------------------------------------------------------------------
# Overrides and includes.


def test_overrides_parse_yaml_values():
    c = _load(
        [
            "optim.lr=1e-6",
            "rollout.num_samples=8",
            "rollout.stop_token_ids=[2, 3]",
            "data.system_prompt=Be brief.",
            "algorithm.hparams.beta=0",
            "train.max_steps=1e3",
            "run_dir=null",
        ]
    )
    assert c.optim.lr == 1e-6 and isinstance(c.optim.lr, float)
    assert c.rollout.num_samples == 8
    assert c.rollout.stop_token_ids == (2, 3)
    assert c.data.system_prompt == "Be brief."
    assert c.algorithm.hparams["beta"] == 0.0 and isinstance(c.algorithm.hparams["beta"], float)
    assert c.train.max_steps == 1000
    assert c.run_dir is None


def test_later_override_wins_and_apply_overrides():
    c = _load(["optim.lr=1e-5", "optim.lr=2e-6"])
    assert c.optim.lr == 2e-6
    c2 = C.apply_overrides(c, ["train.max_steps=3"])
    assert c2.train.max_steps == 3 and c2.optim.lr == 2e-6


def test_changing_the_algorithm_drops_the_other_recipes_hparams():
    c = _load(["algorithm.name=rloo"])  # quickstart's grpo hparams (clip_eps) don't apply
    assert c.algorithm.name == "rloo" and dict(c.algorithm.hparams) == {}
    c = _load(["algorithm.name=dapo", "algorithm.hparams.clip_high=0.3"])
    assert dict(c.algorithm.hparams) == {"clip_high": 0.3}
    c = _load(["algorithm.name=dpo", "rollout=null"])
    assert c.rollout is None and c.is_offline and c.batch_size == c.preference.pairs_per_step


def test_same_algorithm_name_keeps_hparams(tmp_path):
    _write(tmp_path, "algorithm: {hparams: {beta: 0.5}}\n", "a.yaml")  # name: the default grpo
    path = _write(tmp_path, "base: a.yaml\nalgorithm: {name: grpo}\n")
    assert load_config(path).algorithm.hparams == {"beta": 0.5}


def test_configs_pickle_and_copy():
    c = load_config(CONFIGS / "algorithms/dapo.yaml")
    assert pickle.loads(pickle.dumps(c)) == c
    assert copy.deepcopy(c) == c and dataclasses.replace(c, run_dir="x").run_dir == "x"
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.optim.lr = 1.0
    with pytest.raises(TypeError):
        c.algorithm.hparams["beta"] = 1.0


def test_include_chain_and_defaults_synonym(tmp_path):
    _write(tmp_path, "optim: {lr: 2.0e-6}\ntrain: {max_steps: 7}\n", "a.yaml")
    _write(tmp_path, "defaults: a.yaml\ntrain: {max_steps: 9}\n", "b.yaml")
    sub = tmp_path / "sub"
    sub.mkdir()
    path = _write(sub, "base: [../b.yaml]\nrollout: {num_samples: 2}\n")
    c = load_config(path)
    assert (c.optim.lr, c.train.max_steps, c.rollout.num_samples) == (2e-6, 9, 2)


def test_float_spellings(tmp_path):
    path = _write(tmp_path, "optim: {lr: 3e-6, adam_eps: 1E-8, weight_decay: .5}\n")
    c = load_config(path)
    assert (c.optim.lr, c.optim.adam_eps, c.optim.weight_decay) == (3e-6, 1e-8, 0.5)


# ---------------------------------------------------------------------------------------------
# Round trip.


@pytest.mark.parametrize("path", ALL_YAML, ids=lambda p: p.relative_to(CONFIGS).as_posix())
def test_round_trip(path, tmp_path):
    config = load_config(path, _overrides(path))
    saved = C.save_config(config, tmp_path / "run" / "config.yaml")
    assert load_config(saved) == config
    assert C.from_dict(C.to_dict(config)) == config


def test_round_trip_keeps_odd_strings(tmp_path):
    c = _load(["data.system_prompt='1e-6'", "run_dir='123'", "model.tokenizer='null'"])
    assert c.data.system_prompt == "1e-6" and c.run_dir == "123" and c.model.tokenizer == "null"
    assert load_config(C.save_config(c, tmp_path / "c.yaml")) == c


# ---------------------------------------------------------------------------------------------
# Errors: unknown keys, types, ranges.


def test_typo_suggests_the_nearest_key():
    e = _fails(
        ["rollout.num_sampels=4"], "rollout.num_sampels", "did you mean 'rollout.num_samples'"
    )
    assert e.key == "rollout.num_sampels"
    _fails(["rolout.num_samples=4"], "unknown key 'rolout'", "did you mean 'rollout'")
    _fails(
        ["optim.learning_rate=1e-6"], "optim.learning_rate", "valid keys of optim: optimizer, lr"
    )


def test_unknown_hparam_suggests_from_the_recipe_signature():
    _fails(["algorithm.hparams.bta=0.1"], "'algorithm.hparams.bta'", "'algorithm.hparams.beta'?")
    _fails(["algorithm.hparams.gamma=0.9"], "'gamma' is not a hyperparameter of grpo")
    _fails(["algorithm.hparams.numerics=verl"], "set algorithm.numerics instead")
    _fails(["algorithm.hparams.kl_controller=1"], "set kl.controller instead")


def test_wrong_types():
    _fails(["optim.lr=fast"], "optim.lr = 'fast'", "expected a number, got str")
    _fails(["model.trust_remote_code=maybe"], "model.trust_remote_code", "expected true or false")
    _fails(["rollout.num_samples=2.5"], "rollout.num_samples = 2.5", "expected an integer")
    _fails(["rollout.num_samples=true"], "rollout.num_samples = True", "expected an integer")
    _fails(["optim.lr=.nan"], "optim.lr", "a finite number")
    _fails(["rollout.stop_token_ids=[1, x]"], "rollout.stop_token_ids[1] = 'x'")
    _fails(["optim=3"], "optim = 3", "expected a mapping")
    _fails(["optim.schedule=cosin"], "optim.schedule = 'cosin'", "did you mean 'cosine'")
    _fails(["algorithm.name=grpoo"], "algorithm.name = 'grpoo'", "did you mean 'grpo'")
    _fails(["algorithm.hparams.scale_by_std=yes please"], "algorithm.hparams.scale_by_std")
    _fails(["rewards.terms=[{weight: 1.0}]"], "rewards.terms[0].type is required")


@pytest.mark.parametrize(
    "override, fragment",
    [
        ("rollout.num_samples=0", "an integer ≥ 1"),
        ("rollout.prompts_per_step=-1", "rollout.prompts_per_step = -1"),
        ("rollout.max_new_tokens=0", "rollout.max_new_tokens = 0"),
        ("rollout.temperature=0", "a number > 0"),
        ("rollout.top_p=1.5", "> 0 and ≤ 1"),
        ("optim.lr=0", "optim.lr = 0.0"),
        ("optim.max_grad_norm=-1", "(or null)"),
        ("optim.micro_batch_size=0", "optim.micro_batch_size = 0"),
        ("train.keep_checkpoints=0", "train.keep_checkpoints = 0"),
        ("data.eval_size=-5", "data.eval_size = -5"),
        ("old_logprobs.tis_cap=0.5", "old_logprobs.tis_cap = 0.5"),
        ("mesh.fsdp=0", "mesh.fsdp = 0"),
    ],
)
def test_negative_and_zero_sizes(override, fragment):
    _fails([override], fragment)


# ---------------------------------------------------------------------------------------------
# Errors: impossible combinations.


@pytest.mark.parametrize("name", C.GROUP_RECIPES)
def test_group_recipe_with_one_sample(name):
    _fails(
        [f"algorithm.name={name}", "rollout.num_samples=1"],
        "rollout.num_samples = 1",
        f"≥ 2 for {name}",
    )


def test_group_recipes_are_recipes():
    assert set(C.GROUP_RECIPES) < set(algorithms.RECIPES)
    assert set(typing.get_args(C.RecipeName)) == set(algorithms.RECIPES)


def test_pods_keep_must_be_below_g():
    _fails(["algorithm.hparams.pods_num_keep=4"], "pods_num_keep = 4", "m < G")
    _fails(["algorithm.hparams.pods_num_keep=1"], "pods_num_keep = 1", "2 ≤ m")
    assert _load(["algorithm.hparams.pods_num_keep=2"]).algorithm.hparams["pods_num_keep"] == 2


def test_batch_splits():
    _fails(["optim.num_minibatches=3"], "optim.num_minibatches = 3", "batch of 32")
    _fails(
        ["optim.num_minibatches=2", "optim.micro_batch_size=5"],
        "optim.micro_batch_size = 5",
        "minibatch of 16",
    )


def test_pods_update_batch_splits():
    # PODS keeps m = 3 of G = 4: the update sees B·m = 24 sequences, not B·G = 32.
    pods = "algorithm.hparams.pods_num_keep=3"
    assert _load([pods]).update_batch_size == 24 and _load([pods]).batch_size == 32
    assert _load([]).update_batch_size == 32
    _fails([pods, "optim.num_minibatches=16"], "optim.num_minibatches = 16", "batch of 24")
    err = _fails(
        [pods, "optim.num_minibatches=2", "optim.micro_batch_size=8"],
        "optim.micro_batch_size = 8",
        "minibatch of 12",
        "algorithm.hparams.pods_num_keep",
    )
    assert err.key == "optim.micro_batch_size"
    c = _load([pods])  # 32 sequences split over 16 devices, 24 do not
    with pytest.raises(ConfigError, match=r"the update batch of 24 \(rollout.prompts_per_step × "):
        C.check_devices(c, 16)
    c = _load([pods, "optim.num_minibatches=2"])  # update minibatches of 12 on 8 devices
    with pytest.raises(ConfigError, match=r"each minibatch of 12 \(update batch / optim"):
        C.check_devices(c, 8)
    c = _load(["algorithm.hparams.pods_num_keep=2", "optim.num_minibatches=2"])
    assert C.check_devices(c, 8) == {"data": 8, "fsdp": 1, "tensor": 1}


def test_mesh_must_divide_the_devices():
    c = _load(["mesh.preset=fsdp", "mesh.data=1", "mesh.fsdp=3"])
    with pytest.raises(ConfigError, match="product of the axis sizes, 3, does not divide the 8"):
        C.check_devices(c, 8)
    with pytest.raises(ConfigError, match="does not divide"):
        _load(["mesh.preset=fsdp", "mesh.data=1", "mesh.fsdp=3"], device_count=8)
    assert C.check_devices(_load(["mesh.data=2"]), 8) == {"data": 2, "fsdp": 1, "tensor": 1}
    c = _load(["mesh.preset=fsdp_tp", "mesh.data=1", "mesh.fsdp=-1", "mesh.tensor=2"])
    assert C.mesh_axis_sizes(c.mesh, 8) == {"data": 1, "fsdp": 4, "tensor": 2}


def test_batch_must_split_over_data_parallel_devices():
    c = _load(["rollout.prompts_per_step=3", "rollout.num_samples=2"])  # 6 sequences
    with pytest.raises(ConfigError, match=r"batch of 6 .* not a multiple of the data-parallel"):
        C.check_devices(c, 4)
    c = _load(["optim.num_minibatches=4"])  # minibatches of 8 on 16 devices
    with pytest.raises(ConfigError, match="each minibatch of 8"):
        C.check_devices(c, 16)
    c = _load(["optim.micro_batch_size=4"])
    with pytest.raises(ConfigError, match="each micro-batch of 4"):
        C.check_devices(c, 8)


def test_mesh_shapes():
    _fails(["mesh.data=-1", "mesh.fsdp=-1", "mesh.preset=fsdp"], "at most one axis may be -1")
    _fails(["mesh.fsdp=2"], "mesh.preset = 'dp'", "'fsdp' or 'fsdp_tp'")
    _fails(["mesh.preset=fsdp", "mesh.tensor=2"], "mesh.tensor = 2", "use fsdp_tp")
    _fails(["mesh.preset=fsdp_tp"], "mesh.tensor = 1", "≥ 2")


def test_dpo_and_the_rollout_section():
    e = _fails(["algorithm.name=dpo"], "dpo trains offline", "set `rollout: null`")
    assert "rollout.prompts_per_step" in str(e) and e.key == "rollout"
    _fails(["rollout=null"], "rollout = None", "only dpo takes `rollout: null`")
    c = C.from_dict({"algorithm": {"name": "dpo"}})  # no rollout section: fine
    assert c.rollout is None and C.needs_reference_model(c)
    c = C.from_dict({"algorithm": {"name": "dpo", "hparams": {"loss_type": "simpo"}}})
    assert not C.needs_reference_model(c)


def test_recipe_constructor_errors_are_config_errors():
    _fails(["algorithm.hparams.kl_estimator=k33"], "kl_estimator = 'k33'", "did you mean 'k3'")
    _fails(
        ["algorithm.hparams.beta=0.1", "algorithm.hparams.loss_agg_mode=token-meen"],
        "algorithm.hparams = ",
        "token-meen",
    )
    _fails(
        ["algorithm.name=dpo", "rollout=null", "algorithm.hparams.loss_type=bogus"],
        "loss_type='bogus'",
    )
    _fails(["algorithm.name=dapo", "algorithm.hparams.max_length=20"], "give both")


def test_dapo_overlong_shaping_fits_the_generation_limit():
    base = "algorithms/dapo.yaml"
    limit = "≤ rollout.max_new_tokens = 24"
    _fails(["algorithm.hparams.max_length=64"], "max_length = 64", limit, base=base)
    _fails(["algorithm.hparams.overlong_buffer=24"], "overlong_buffer = 24", base=base)


def test_ratio_free_recipes_are_on_policy_only():
    _fails(
        ["algorithm.name=rloo", "optim.ppo_epochs=2"], "optim.ppo_epochs = 2", "no importance ratio"
    )
    _fails(["algorithm.name=reinforce", "optim.num_minibatches=2"], "optim.num_minibatches = 2")


def test_kl_controller():
    _fails(["kl.controller=adaptive"], "kl.controller = 'adaptive'", "folded into the reward")
    base = "algorithms/ppo.yaml"
    _fails(["kl.controller=adaptive", "algorithm.hparams.beta=0"], "β > 0", base=base)
    c = _load(["kl.controller=adaptive", "kl.target=0.05"], base=base)
    recipe = C.build_recipe(c)
    assert recipe.name == "ppo" and C.needs_reference_model(c)
    assert C.needs_reference_model(load_config(CONFIGS / "algorithms/grpo.yaml"))


def test_data_errors():
    _fails(["data.source=file"], "data.path = None", "data.source=file")
    _fails(["data.source=file", "data.path=x.txt"], "cannot tell the format of 'x.txt'")
    c = _load(["data.source=file", "data.path=x.txt", "data.format=csv"])
    assert C.data_format(c.data, c.data.path) == "csv"
    assert C.data_format(_load(["data.source=file", "data.path=a.PARQUET"]).data, "a.PARQUET")
    _fails(["data.eval_path=test.xlsx"], "test.xlsx")
    _fails(["data.arithmetic.max_operand=9"], "train_size = 250", "≤ 110")
    _fails(["data.arithmetic.min_operand=5", "data.arithmetic.max_operand=1"], "≥ min_operand")
    _fails(["data.arithmetic.operations=['/']"], "data.arithmetic.operations[0] = '/'")
    _fails(["data.arithmetic.operations=[]"], "at least one")


def test_model_folders_are_checked_before_loading(tmp_path, monkeypatch):
    """Each model folder a run reads exists, named by its key: the policy, its tokenizer, a
    critic of a recipe that learns one and reward-model terms; the names need no folder."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "tokenizer.json").write_text("{}")  # load_config looks for one

    def fails(overrides, *fragments, base="tiny.yaml"):
        with pytest.raises(ConfigError) as info:
            C.check_model_paths(_load(overrides, base))
        for fragment in fragments:
            assert fragment in str(info.value), (fragment, str(info.value))
        return info.value

    e = fails(["model.path=no_model"], "model.path = 'no_model'", f"(from {tmp_path})", "'default'")
    assert e.key == "model.path"
    fails(["model.tokenizer=/no/tokenizer"], "model.tokenizer = '/no/tokenizer'", "tokenizer")
    ppo = ["algorithm.name=ppo", "algorithm.hparams={}"]
    e = fails([*ppo, "critic.path=~/no_critic"], "critic.path = '~/no_critic'", "value")
    assert e.key == "critic.path" and "(from" not in str(e)  # ~ is absolute once expanded
    terms = "rewards.terms=[{type: regex, kwargs: {pattern: a}}, {type: reward_model, kwargs: %s}]"
    fails([terms % "{path: rm}"], "rewards.terms[1].kwargs.path = 'rm'", "of a reward model")
    for ok in (
        [],  # tiny-random, the default tokenizer
        ["model.path=default", "model.tokenizer=default"],
        ["model.path=model", "model.tokenizer=model"],  # relative to the current directory
        ["critic.path=/no_critic"],  # grpo learns no critic: the key is not read
        [*ppo, "critic.path=null"],
        [terms % "{path: rm, score: 'my_rm:score'}"],  # a scorer of the user's: no folder read
    ):
        C.check_model_paths(_load(ok, "tiny.yaml"))


def test_reward_errors():
    _fails(["rewards.terms=[{type: integer_answr}]"], "did you mean 'integer_answer'")
    _fails(["rewards.terms=[{type: 'my mod:f'}]"], "'package.module:function'")
    _fails(["rewards.terms=[{type: reward_model}]"], "rewards.terms[0].kwargs.path")
    _fails(["rewards.terms=[]"], "at least one reward")
    _fails(["rewards.terms=[{type: regex}, {type: regex}]"], "rewards.terms[1].name")
    _fails(["rewards.on_error=ignore"], "'raise', 'zero'")
    c = _load(
        [
            "rewards.terms=[{type: 'my_pkg.rewards:score', weight: 0.5, kwargs: {k: [1, 2]}},"
            " {type: regex, name: fmt, kwargs: {pattern: '^\\d+$'}}, {type: regex}]"
        ]
    )
    assert c.rewards.terms[0].kwargs == {"k": (1, 2)} and c.rewards.terms[1].metric_name == "fmt"
    assert C.to_dict(c)["rewards"]["terms"][0]["kwargs"] == {"k": [1, 2]}


# ---------------------------------------------------------------------------------------------
# Errors: files, YAML, overrides.


def test_missing_files(tmp_path):
    with pytest.raises(ConfigError, match=r"config file not found: .*nope\.yaml"):
        load_config(tmp_path / "nope.yaml")
    path = _write(tmp_path, "base: missing.yaml\n")
    with pytest.raises(ConfigError, match=r"missing\.yaml \(included from .*c\.yaml\)"):
        load_config(path)


def test_a_config_anywhere_can_build_on_a_shipped_one(tmp_path):
    grpo = C.load_config("algorithms/grpo", ["train.max_steps=3"])
    for name in ("algorithms/grpo", "algorithms/grpo.yaml", "configs/algorithms/grpo.yaml"):
        mine = _write(tmp_path, f"base: {name}\ntrain: {{max_steps: 3}}\n", "mine.yaml")
        assert load_config(mine) == grpo
    # A file at that path beside the config is what it means (here itself built on a shipped one).
    (tmp_path / "algorithms").mkdir()
    _write(tmp_path, "base: quickstart\nalgorithm: {name: rloo}\n", "algorithms/grpo.yaml")
    assert load_config(_write(tmp_path, "base: algorithms/grpo.yaml\n")).algorithm.name == "rloo"
    assert load_config(_write(tmp_path, "base: algorithms/grpo\n")).algorithm.name == "grpo"
    with pytest.raises(ConfigError, match=r"algorithms/gspoo.*did you mean 'algorithms/gspo'\?"):
        load_config(_write(tmp_path, "base: algorithms/gspoo\n"))


def test_rewards_take_the_spellings_of_build_reward(tmp_path):
    """The reward docs' YAML (a list under `rewards`, options as keys of a term, a bare type, a
    user function as `function`) is the same config as the schema's own form, in a file, in a
    layer over another and as an override; ambiguous or unknown keys are still errors."""
    canonical = load_config(
        _write(
            tmp_path,
            """
            base: quickstart
            rewards:
              on_error: zero
              terms:
                - {type: integer_answer, kwargs: {field: answer}}
                - {type: regex, weight: 0.1, name: format, kwargs: {pattern: "^[0-9]+$"}}
                - {type: gsm8k}
                - {type: "my_rewards.py:score", weight: 0.5, kwargs: {tolerance: 0.01}}
            """,
            "canonical.yaml",
        )
    )
    _write(tmp_path, "base: quickstart\nrewards: {on_error: zero}\n", "zero.yaml")
    short = """
        base: zero.yaml
        rewards:
          - {type: integer_answer, field: answer}
          - {type: regex, weight: 0.1, name: format, pattern: "^[0-9]+$"}
          - gsm8k
          - {type: user, function: "my_rewards.py:score", weight: 0.5, kwargs: {tolerance: 0.01}}
        """
    assert load_config(_write(tmp_path, short)) == canonical  # on_error of the layer below kept
    flow = (
        "rewards=[{type: integer_answer, field: answer}, {type: regex, weight: 0.1, name: format,"
        ' pattern: "^[0-9]+$"}, gsm8k, {type: "my_rewards.py:score", weight: 0.5,'
        " kwargs: {tolerance: 0.01}}]"
    )
    assert load_config(tmp_path / "zero.yaml", [flow]) == canonical
    one = load_config("quickstart", ["rewards={type: gsm8k, strict: false}"]).rewards.terms
    assert [(t.type, dict(t.kwargs)) for t in one] == [("gsm8k", {"strict": False})]
    assert (
        C.from_dict({**C.to_dict(canonical), "rewards": "boxed"}).rewards.terms[0].type == "boxed"
    )

    both = "base: quickstart\nrewards: [{type: regex, pattern: a, kwargs: {pattern: b}}]\n"
    with pytest.raises(ConfigError, match=r"rewards\.terms\[0\]\.pattern is given both"):
        load_config(_write(tmp_path, both))
    # verl and trl terms are told apart by their functions (a `name` only when one repeats)
    two = ["rewards=[{type: trl, function: 'a.py:fmt'}, {type: trl, function: 'a.py:acc'}]"]
    assert [t.kwargs["function"] for t in load_config("quickstart", two).rewards.terms] == [
        "a.py:fmt",
        "a.py:acc",
    ]
    with pytest.raises(ConfigError, match=r"rewards\.terms\[1\]\.name.*not used by another"):
        twice = "{type: verl, function: 'f.py:s'}"
        load_config("quickstart", [f"rewards=[{twice}, {twice}]"])
    # an override value that is not YAML stays text, and text with spaces is no type name
    with pytest.raises(ConfigError, match=r"rewards = '\[\{type: gsm8k\}, \{': expected a mapping"):
        load_config("quickstart", ["rewards=[{type: gsm8k}, {"])
    user = "base: quickstart\nrewards: [{type: 'my_rewards.py:score', tolerance: 0.01}]\n"
    with pytest.raises(ConfigError, match=r"unknown key 'rewards\.terms\[0\]\.tolerance'"):
        load_config(_write(tmp_path, user))  # a user function's arguments go in its kwargs


def test_include_cycle(tmp_path):
    _write(tmp_path, "base: b.yaml\n", "a.yaml")
    _write(tmp_path, "base: a.yaml\n", "b.yaml")
    with pytest.raises(ConfigError, match="include cycle"):
        load_config(tmp_path / "a.yaml")


def test_malformed_yaml_names_line_and_column(tmp_path):
    path = _write(tmp_path, "optim:\n  lr: 1e-6\n  schedule: [cosine\ntrain: {}\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:4:\d+: malformed YAML"):
        load_config(path)
    path = _write(tmp_path, "optim:\n\tlr: 1\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:2:1: malformed YAML"):
        load_config(path)


def test_duplicate_keys_and_bad_top_level(tmp_path):
    path = _write(tmp_path, "optim:\n  lr: 1.0e-6\n  lr: 2.0e-6\n")
    with pytest.raises(ConfigError, match=r"c\.yaml:3:3: .*duplicate key 'lr'"):
        load_config(path)
    with pytest.raises(ConfigError, match="expected a mapping of sections"):
        load_config(_write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match="not UTF-8"):
        (tmp_path / "bin.yaml").write_bytes(b"optim: {lr: \xff}\n")
        load_config(tmp_path / "bin.yaml")
    with pytest.raises(ConfigError, match="not both"):
        load_config(_write(tmp_path, "base: a.yaml\ndefaults: b.yaml\n"))
    assert load_config(_write(tmp_path, "")) == C.TrainConfig()


def test_bad_overrides():
    with pytest.raises(ConfigError, match=re.escape("expected `dotted.key=value`")):
        _load(["optim.lr"])
    with pytest.raises(ConfigError, match="not a dotted key"):
        _load(["optim..lr=1"])
    with pytest.raises(TypeError):
        _load("optim.lr=1")
    assert C.parse_override("a.b=[unclosed") == {"a": {"b": "[unclosed"}}
    assert C.parse_override("a=") == {"a": None}


def test_required_marker(tmp_path):
    path = _write(tmp_path, "data:\n  source: file\n  path: ???\n")
    with pytest.raises(ConfigError, match=re.escape("data.path is required")):
        load_config(path)
    assert load_config(path, ["data.path=x.jsonl"]).data.path == "x.jsonl"


def test_recipe_hparams_fill_in_the_signature_defaults():
    hp = C.recipe_hparams(_load([]))
    # kl_estimator None: k3 in the loss, k1 when the KL goes in the reward (rc.kl_placement)
    assert hp["beta"] == 0.0 and hp["clip_eps"] == 0.2 and hp["kl_estimator"] is None
    assert "numerics" not in hp and "kl_controller" not in hp
    c = _load(["algorithm.numerics=verl"])
    assert C.build_recipe(c).numerics.name == "verl"
