"""The five questions, answered from each recipe's composition."""

from __future__ import annotations

import pytest

import jaxrl_llm as jrl
from jaxrl_llm import algorithms as alg
from jaxrl_llm import chain as ch
from jaxrl_llm import cli


@pytest.mark.parametrize("name", list(alg.RECIPES))
def test_every_recipe_answers_all_five(name):
    e = jrl.explain(name)
    assert e.recipe == name
    for field in ("reward", "kl", "baseline", "normalization", "objective"):
        assert getattr(e, field), field


def test_answers_follow_the_composition():
    assert jrl.explain("grpo").kl.startswith("in the loss")
    assert "k3" in jrl.explain("grpo").kl
    assert jrl.explain("ppo").kl.startswith("in the reward")
    assert "critic" in jrl.explain("ppo").baseline
    assert "leave-one-out" in jrl.explain("rloo").baseline
    assert "whitening" in jrl.explain("reinforce_pp").normalization
    assert jrl.explain("dr_grpo").normalization == "none"
    assert "nowhere" in jrl.explain("dapo").kl
    assert "dynamic sampling" in jrl.explain("dapo").objective
    assert "PODS" in jrl.explain(alg.grpo(pods_num_keep=4)).objective
    assert "ddof = 1" in jrl.explain(alg.grpo(numerics="verl")).normalization


def test_a_custom_chain_is_explained_too():
    custom = alg.grpo()
    custom = custom.__class__(**{**custom.__dict__, "name": "remax"})
    object.__setattr__(custom, "advantage", ch.chain(ch.outcome_return(), ch.given_baseline()))
    e = jrl.explain(custom)
    assert "greedy" in e.baseline
    assert e.normalization == "none"


def test_cli_explain_prints_a_table(capsys):
    assert cli.main(["explain", "grpo"]) == 0
    out = capsys.readouterr().out
    assert "Where does the KL go?" in out and "k3" in out


def test_cli_explain_all_compares_every_recipe(capsys):
    assert cli.main(["explain", "--all"]) == 0
    table = capsys.readouterr().out.split("\n\n")[0]
    for name in alg.RECIPES:
        assert f"\n{name} " in table
    assert "leave-one-out" in table and "batch whitening" in table


def test_cli_unknown_algorithm(capsys):
    assert cli.main(["explain", "grpoo"]) == 2
    assert "available" in capsys.readouterr().err
