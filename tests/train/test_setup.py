"""jaxrl_llm.train.setup: ``resolve`` maps a config onto the frozen values the trainer reads.

Sampler, UpdateShape, OldLogprobs, LoopPlan, CheckpointPlan, EvalPlan, Models (reference and
critic) and Setup.offline, each against the config keys it comes from; and the layering rule
that below the loop and the CLI only ``setup.py`` reads the config.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import jaxrl_llm.train
from jaxrl_llm.config import ConfigError
from jaxrl_llm.data import DataError
from jaxrl_llm.recipe import PreferenceRecipe, Recipe
from jaxrl_llm.train import setup as S
from tests.train import helpers as H

SMALL = ("rollout.prompts_per_step=2", "rollout.num_samples=2", "data.eval_size=4")


def resolve(*overrides: str, name: str = "tiny.yaml", run_dir=None) -> S.Setup:
    return S.resolve(H.config(name, *overrides), run_dir)


# ---------------------------------------------------------------------------------------------
# Online runs.


def test_sampler_and_eval_plan_from_the_rollout_section():
    setup = resolve(
        "rollout.prompts_per_step=2",
        "rollout.num_samples=3",
        "rollout.max_new_tokens=5",
        "rollout.temperature=0.7",
        "rollout.top_k=5",
        "rollout.top_p=0.9",
        "rollout.cache_dtype=bfloat16",
        "train.eval_every=3",
        "train.seed=11",
        "data.eval_size=4",
    )
    eos = setup.tokenizer.eos_token_id
    assert eos == setup.policy().config.eos_token_id == 2  # SmolLM2's <|im_end|>
    assert setup.sampler == S.Sampler(
        num_samples=3,
        max_new_tokens=5,
        temperature=0.7,
        top_k=5,
        top_p=0.9,
        stop_ids=(eos,),  # rollout.stop_token_ids = null: the tokenizer's eos
        cache_dtype=jnp.dtype("bfloat16"),
        engine="paged",  # rollout.engine = auto, and completions stop at the eos
        max_prompt_length=128,  # data.max_prompt_length: the paged pool sized once for it
    )
    assert not setup.offline and isinstance(setup.recipe, Recipe)
    # Evaluation: greedy by default, one completion per prompt of the rollout's length.
    plan = setup.evaluation
    assert (plan.every, plan.mode, plan.seed) == (3, "greedy", 12)
    assert plan.sampler.num_samples == 1 and plan.sampler.max_new_tokens == 5
    assert plan.sampler.stop_ids == (eos,)
    greedy = plan.sampler.greedy()
    assert (greedy.temperature, greedy.top_k, greedy.top_p, greedy.num_samples) == (0.0, 0, 1.0, 1)


def _paged_options_of_the_rollout(setup: S.Setup):
    """The ``paged_options`` the trainer's rollout (``collect.sample_completions``) hands
    ``rollout.generate`` (a stand-in records them and stops the call)."""
    from jaxrl_llm import rollout
    from jaxrl_llm.train import collect

    seen = []

    def generate(*args, paged_options, **kwargs):
        seen.append(paged_options)
        raise RuntimeError("enough")

    with pytest.MonkeyPatch.context() as m:
        m.setattr(rollout, "generate", generate)
        with pytest.raises(RuntimeError, match="enough"):
            collect.sample_completions(
                setup.models, setup.state.params, setup.sampler, None, None, None
            )
    return seen[0]


def test_rollout_work_stealing_reaches_the_paged_engine_and_must_be_a_bool():
    assert _paged_options_of_the_rollout(resolve(*SMALL)).work_stealing  # on by default
    off = resolve(*SMALL, "rollout.work_stealing=false")
    assert not off.sampler.paged_options().work_stealing
    assert not off.sampler.greedy().paged_options().work_stealing  # evaluation too
    assert not _paged_options_of_the_rollout(off).work_stealing
    with pytest.raises(ConfigError, match=r"rollout\.work_stealing"):
        resolve(*SMALL, "rollout.work_stealing=7")


def test_rollout_tensor_parallel_reaches_the_paged_engine_and_bad_values_are_config_errors():
    """``rollout.tensor_parallel`` becomes the sampler's (and its evaluation's) paged options;
    a value that does not divide the devices, a negative one, or one with the static engine
    is a ConfigError naming the key, before anything runs."""
    setup = resolve(*SMALL, "rollout.tensor_parallel=2")
    assert setup.sampler.paged_options().tensor_parallel == 2
    assert setup.sampler.greedy().paged_options().tensor_parallel == 2
    assert _paged_options_of_the_rollout(setup).tensor_parallel == 2
    assert resolve(*SMALL).sampler.paged_options().tensor_parallel == 0
    for bad, fragment in (
        ("rollout.tensor_parallel=3", "expected a divisor of the rollout's 8 devices"),
        ("rollout.tensor_parallel=-1", "rollout.tensor_parallel"),
    ):
        with pytest.raises(ConfigError, match=fragment):
            resolve(*SMALL, bad)
    with pytest.raises(ConfigError, match=r"rollout\.engine = static"):
        resolve(*SMALL, "rollout.tensor_parallel=2", "rollout.engine=static")
    with pytest.raises(ConfigError, match=r"auto with stop_token_ids = \[\] \(static\)"):
        resolve(*SMALL, "rollout.tensor_parallel=2", "rollout.stop_token_ids=[]")


def test_paged_kernel_tuning_reaches_the_sampler_and_bad_keys_are_config_errors():
    """``rollout.paged_kernel_tuning`` becomes the sampler's sorted pairs (what the loop hands
    ``PagedOptions.kernel_tuning``); an unknown key or a non-positive value is a ConfigError
    naming the key, at load time."""
    setup = resolve(
        *SMALL,
        "rollout.paged_kernel_tuning.num_warps=4",
        "rollout.paged_kernel_tuning.pages_per_compute_block=16",
    )
    assert setup.sampler.paged_kernel_tuning == (("num_warps", 4), ("pages_per_compute_block", 16))
    assert resolve(*SMALL).sampler.paged_kernel_tuning == ()
    # the rollout hands them to the paged engine
    assert _paged_options_of_the_rollout(setup).kernel_tuning == setup.sampler.paged_kernel_tuning
    for bad, fragment in (
        ("rollout.paged_kernel_tuning.warps=4", "has an unknown key 'warps'; expected some of"),
        ("rollout.paged_kernel_tuning.num_stages=0", "['num_stages'] must be an int >= 1, got 0"),
    ):
        with pytest.raises(ConfigError, match=r"^rollout\.paged_kernel_tuning") as info:
            resolve(*SMALL, bad)
        assert fragment in str(info.value) and info.value.key == "rollout.paged_kernel_tuning"


def test_stop_ids_override_cache_dtype_auto_and_eval_length():
    setup = resolve(
        *SMALL,
        "rollout.stop_token_ids=[7, 5]",
        "train.eval_max_new_tokens=12",
        "train.eval_mode=sampled",
    )
    assert setup.sampler.stop_ids == (7, 5)
    assert setup.sampler.cache_dtype is None  # auto: the model's dtype
    assert setup.sampler.max_new_tokens == 8  # configs/tiny.yaml
    plan = setup.evaluation
    assert plan.mode == "sampled" and plan.sampler.max_new_tokens == 12
    assert plan.sampler.stop_ids == (7, 5) and plan.sampler.temperature == 1.0
    never = resolve(*SMALL, "rollout.stop_token_ids=[]")
    assert never.sampler.stop_ids == ()  # [] = never stop early


def test_update_shape_old_logprobs_loop_and_checkpoint_plans(tmp_path):
    setup = resolve(
        "rollout.prompts_per_step=2",
        "rollout.num_samples=4",
        "optim.ppo_epochs=3",
        "optim.num_minibatches=2",
        "optim.micro_batch_size=2",
        "old_logprobs.source=sampler",
        "old_logprobs.tis_cap=3.0",
        "train.max_steps=7",
        "train.log_every=3",
        "train.on_nonfinite=skip",
        "train.max_refill_batches=1",
        "train.save_every=5",
        "train.keep_checkpoints=4",
        "data.seed=5",
        "data.shuffle=false",
        "data.eval_size=4",
        "logging.completions=3",
        run_dir=tmp_path / "run",
    )
    # Packed (the default) with micro_batch_size 2: the per-device budget it implies.
    u = setup.update
    assert (u.epochs, u.num_minibatches, u.micro_batch_size, u.packing) == (3, 2, 2, True)
    assert u.micro_batch_tokens == 2 * (128 + 8)  # configs/tiny.yaml: prompt and completion slots
    assert u.shared_prompts and u.attn_per_width > 0 and u.width_multiple == 1
    assert setup.update.updates_per_step == 6
    assert setup.old_logprobs == S.OldLogprobs(source="sampler", tis_cap=3.0)
    assert setup.loop == S.LoopPlan(
        max_steps=7,
        batch_size=2,  # prompts per step, not sequences
        log_every=3,
        on_nonfinite="skip",
        max_refill_batches=1,
        data_seed=5,
        shuffle=False,
        log_completions=3,
    )
    assert setup.run_dir == tmp_path / "run"
    assert setup.checkpoint == S.CheckpointPlan(
        directory=tmp_path / "run" / S.CHECKPOINT_DIR, save_every=5, keep=4
    )


def test_defaults_and_run_dir_from_the_config(tmp_path, monkeypatch):
    setup = resolve(*SMALL, f"run_dir={tmp_path / 'from_config'}")
    shape = setup.update
    assert (shape.epochs, shape.num_minibatches, shape.micro_batch_size) == (1, 1, None)
    assert shape.packing and shape.micro_batch_tokens is None and shape.updates_per_step == 1
    assert setup.old_logprobs == S.OldLogprobs("recompute", 2.0)  # base.yaml
    assert setup.run_dir == tmp_path / "from_config"
    assert setup.checkpoint.directory == tmp_path / "from_config" / "checkpoints"
    assert (setup.checkpoint.save_every, setup.checkpoint.keep) == (2, 2)  # configs/tiny.yaml
    assert setup.loop.on_nonfinite == "raise" and setup.loop.max_steps == 4
    # An explicit run_dir wins over the config's, and a relative one is made absolute.
    monkeypatch.chdir(tmp_path)
    rel = S.resolve(H.config("tiny.yaml", *SMALL, "run_dir=/elsewhere"), "rel")
    assert rel.run_dir == tmp_path / "rel" and rel.run_dir.is_absolute()
    assert rel.checkpoint.directory == tmp_path / "rel" / "checkpoints"
    nowhere = S.resolve(H.config("tiny.yaml", *SMALL, "old_logprobs.tis_cap=null"))
    assert nowhere.old_logprobs.tis_cap is None
    assert nowhere.run_dir == tmp_path  # no run_dir anywhere: the working directory


# ---------------------------------------------------------------------------------------------
# Models.


def test_verl_style_nested_answers_and_a_missing_answer_field_is_caught_at_setup(tmp_path):
    """A verl data file keeps the answer in a struct column (``reward_model.ground_truth``):
    data.answer_field names it with a dot. A reward field the prompts lack is an error at setup,
    before any step, naming the field and the fields there are."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
            "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
            "extra_info": {"index": i},
        }
        for i in range(6)
    ]
    path = tmp_path / "gsm8k.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    data = ("data.source=file", f"data.path={path}", "data.eval_size=2", "rewards=[gsm8k]")
    setup = resolve(*data, "data.answer_field=reward_model.ground_truth")
    fields = setup.data.train.fields
    assert len(fields["extra_info.index"]) == 4  # 2 held out
    assert fields["reward_model.ground_truth"] == [str(i + 1) for i in fields["extra_info.index"]]
    with pytest.raises(
        DataError, match=r"the reward 'gsm8k' reads the field 'answer'.*reward_model\.ground_truth"
    ):
        resolve(*data)
    # Every answer reward follows data.answer_field (math_verify did not), and a verl
    # compute_score function scores the file's rows as verl would.
    rw = tmp_path / "verl_rw.py"
    rw.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
        "    return float(solution_str == ground_truth) + extra_info['index']\n"
    )
    terms = f"rewards=[math_verify, {{type: verl, function: '{rw}:compute_score'}}]"
    setup = resolve(*data[:-1], terms, "data.answer_field=reward_model.ground_truth")
    assert setup.reward.terms[0].fn.field == "reward_model.ground_truth"
    ds = setup.data.train
    out = setup.reward(ds.prompts, ds.fields["reward_model.ground_truth"], **ds.fields)
    np.testing.assert_allclose(
        out.components["compute_score"], np.add(fields["extra_info.index"], 1)
    )
    # A mixed file routes each row by its data_source (verl's default_compute_score); the
    # routed answer rewards follow data.answer_field too, and a missing `by` column is caught
    # at setup.
    route = "rewards=[{type: route, routes: {easy: integer_answer, hard: {type: gsm8k}}}]"
    with pytest.raises(DataError, match=r"the reward 'route' reads the field 'data_source'"):
        resolve(*data[:-1], route, "data.answer_field=reward_model.ground_truth")
    for i, row in enumerate(rows):
        row["data_source"] = "easy" if i % 2 else "hard"
    pq.write_table(pa.Table.from_pylist(rows), path)
    setup = resolve(*data[:-1], route, "data.answer_field=reward_model.ground_truth")
    routed = setup.reward.terms[0].fn
    assert {r.field for r in routed.routes.values()} == {"reward_model.ground_truth"}
    ds = setup.data.train
    answers = [
        f"#### {a}" if s == "hard" else a
        for a, s in zip(
            ds.fields["reward_model.ground_truth"], ds.fields["data_source"], strict=True
        )
    ]
    out = setup.reward(ds.prompts, answers, **ds.fields)
    np.testing.assert_allclose(out.components["route"], 1.0)  # each checked its own way
    assert set(out.reported["route"]) == {"easy/mean", "hard/mean"}


def test_reference_only_with_a_kl_and_a_critic_only_for_ppo():
    grpo = resolve(*SMALL, "algorithm.hparams.beta=0.04")
    assert grpo.models.ref_params is not None
    assert grpo.models.critic_graphdef is None and grpo.models.critic_tx is None
    assert grpo.models.critic_schedule is None and grpo.state.critic_params is None
    no_kl = resolve(*SMALL, "algorithm.hparams.beta=0.0")
    assert no_kl.models.ref_params is None
    ppo = resolve(*SMALL, "algorithm.name=ppo", "algorithm.hparams.beta=0.0", "critic.lr=3e-3")
    assert ppo.recipe.critic is not None and ppo.models.ref_params is None
    m = ppo.models
    assert m.critic_graphdef is not None and m.critic_tx is not None
    assert ppo.state.critic_params is not None and ppo.state.critic_opt_state is not None
    assert float(m.critic_schedule(0)) == pytest.approx(3e-3)
    assert float(m.schedule(0)) == pytest.approx(1e-4)  # the policy's: configs/tiny.yaml


# ---------------------------------------------------------------------------------------------
# DPO.


def test_dpo_is_offline_with_an_eval_sampler_of_the_pairs_length():
    dpo = resolve(
        "preference.pairs_per_step=2",
        "preference.max_response_length=16",
        "data.eval_size=4",
        "data.arithmetic.train_size=16",
        name="algorithms/dpo.yaml",
    )
    assert dpo.offline and isinstance(dpo.recipe, PreferenceRecipe)
    assert dpo.sampler is None
    assert dpo.loop.batch_size == 2  # pairs per step
    assert dpo.loop.log_completions == 0  # nothing is sampled to log
    assert dpo.models.ref_params is not None  # sigmoid DPO: a reference
    assert dpo.models.critic_graphdef is None and dpo.state.kl_state == ()
    plan = dpo.evaluation
    assert plan.mode == "greedy" and plan.sampler.num_samples == 1
    assert plan.sampler.max_new_tokens == 16  # preference.max_response_length
    assert plan.sampler.stop_ids == (dpo.tokenizer.eos_token_id,)
    longer = resolve(
        "preference.pairs_per_step=2",
        "preference.max_response_length=16",
        "train.eval_max_new_tokens=9",
        "data.eval_size=4",
        "data.arithmetic.train_size=16",
        "algorithm.hparams.loss_type=simpo",
        "algorithm.hparams.beta=2.0",
        name="algorithms/dpo.yaml",
    )
    assert longer.evaluation.sampler.max_new_tokens == 9
    assert longer.models.ref_params is None  # SimPO is reference-free


# ---------------------------------------------------------------------------------------------
# Layering.


def _imported_modules(path: Path) -> set[str]:
    """Every module a source file imports (absolute names; relative imports resolved)."""
    package = "jaxrl_llm.train"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def test_the_import_scan_sees_every_spelling(tmp_path):
    src = tmp_path / "probe.py"
    spellings = {
        "import jaxrl_llm.config.schema": True,
        "from jaxrl_llm.config import TrainConfig": True,
        "from jaxrl_llm import config": True,
        "from .. import config": True,
        "from ..config.engine import ConfigError": True,
        "def f():\n    from jaxrl_llm.config import load_config": True,
        "from jaxrl_llm import chain": False,
        "from jaxrl_llm.train import setup": False,
        "from . import config_notes": False,
    }
    for line, reads in spellings.items():
        src.write_text(line + "\n", encoding="utf-8")
        assert _reads_config(_imported_modules(src)) is reads, line


def _reads_config(modules: set[str]) -> bool:
    return any(m == "jaxrl_llm.config" or m.startswith("jaxrl_llm.config.") for m in modules)


def test_only_setup_loop_and_cli_import_the_config():
    folder = Path(jaxrl_llm.train.__file__).parent
    files = sorted(folder.glob("*.py"))
    assert len(files) > 10
    readers = set()
    for path in files:
        if _reads_config(_imported_modules(path)):
            readers.add(path.name)
    assert "setup.py" in readers  # the scan sees setup's own import
    # plan.py is setup's abstract sibling: it resolves a config into shapes for `jaxrl-llm plan`
    assert readers <= {"setup.py", "plan.py", "loop.py", "cli.py"}, sorted(readers)


def test_the_checkpoints_generation_config_adds_stop_ids_and_goes_into_the_export(
    tmp_path, smollm2_path
):
    """Llama 3 and Qwen 2.5 instruct checkpoints list their end-of-turn ids in
    generation_config.json; the sampler stops at them as transformers' generate does, and the
    export carries the file on (as HF's save_pretrained does)."""
    from flax import nnx

    from jaxrl_llm import models
    from jaxrl_llm.train.loop import export_policy

    source = tmp_path / "source"
    generation = {"do_sample": True, "eos_token_id": [2, 7, 10**6], "temperature": 0.6}
    lm = models.CausalLM(models.tiny_random_config(), rngs=nnx.Rngs(0))
    models.save_pretrained(lm, source, tokenizer=smollm2_path, generation_config=generation)
    assert json.loads((source / "generation_config.json").read_text()) == generation
    setup = resolve(*SMALL, f"model.path={source}", "rollout.max_new_tokens=4")
    assert setup.sampler.stop_ids == (2, 7)  # the tokenizer's and config.json's 2, and 7
    assert setup.evaluation.sampler.stop_ids == (2, 7)
    assert resolve(
        *SMALL, f"model.path={source}", "rollout.stop_token_ids=[5]"
    ).sampler.stop_ids == (5,)  # an explicit list wins
    out = export_policy(setup, setup.state.params, tmp_path / "export")
    assert json.loads((out / "generation_config.json").read_text()) == generation
    # A source without one: none is written, and the export of a run that had one is replaced.
    (source / "generation_config.json").unlink()
    plain = resolve(*SMALL, f"model.path={source}", "rollout.max_new_tokens=4")
    assert plain.sampler.stop_ids == (2,)
    export_policy(plain, plain.state.params, out)
    assert not (out / "generation_config.json").exists()
    (source / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"generation_config\.json: a JSON list; expected"):
        resolve(*SMALL, f"model.path={source}")
