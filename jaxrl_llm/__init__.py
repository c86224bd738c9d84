"""jaxrl_llm: reinforcement learning for language models in JAX.

The public API is the seed documents' chain,

    raw reward -> +KL -> return -> -baseline -> advantage -> normalize -> x grad log pi -> update

as pure, jit-compiled functions: :mod:`jaxrl_llm.core` (the math), :mod:`jaxrl_llm.chain` (the
composable stages), :mod:`jaxrl_llm.recipe` (what a recipe is and how one runs),
:mod:`jaxrl_llm.algorithms` (the named recipes), and :func:`explain` (the five questions for any
recipe).
"""

from jaxrl_llm import algorithms, chain, core, numerics, recipe
from jaxrl_llm.chain import Rollout
from jaxrl_llm.explain import Explanation, comparison_table, explain
from jaxrl_llm.numerics import Numerics
from jaxrl_llm.recipe import (
    PreferenceRecipe,
    Recipe,
    compute_advantages,
    policy_objective,
    select,
)

__version__ = "0.1.0"

__all__ = [
    "Explanation",
    "Numerics",
    "PreferenceRecipe",
    "Recipe",
    "Rollout",
    "algorithms",
    "chain",
    "comparison_table",
    "compute_advantages",
    "core",
    "explain",
    "numerics",
    "policy_objective",
    "recipe",
    "select",
]
