"""The seed documents' five questions, answered for any recipe from its composition.

The seed asks of every algorithm: (1) where does the reward come from, (2) where does the KL go,
(3) where does the baseline come from, (4) where does normalisation happen, (5) what is finally
optimised. :func:`explain` reads the answers off the recipe's chain (each stage carries a
:class:`~jaxrl_llm.chain.StageInfo`), its loss and its aggregation, so a custom composition is
explained as faithfully as a named one.
"""

from __future__ import annotations

import textwrap
from typing import NamedTuple

from jaxrl_llm import algorithms
from jaxrl_llm.recipe import AnyRecipe, PreferenceRecipe, Recipe

QUESTIONS = (
    ("reward", "Where does the reward come from?"),
    ("kl", "Where does the KL go?"),
    ("baseline", "Where does the baseline come from?"),
    ("normalization", "Where does normalisation happen?"),
    ("objective", "What is finally optimised?"),
)


class Explanation(NamedTuple):
    """The five answers for one recipe."""

    recipe: str
    reward: str
    kl: str
    baseline: str
    normalization: str
    objective: str


def _join(texts: list[str], empty: str) -> str:
    return "; then ".join(texts) if texts else empty


def explain(recipe: AnyRecipe | str) -> Explanation:
    """Answers the five questions for ``recipe`` (a recipe or an algorithm name)."""
    if isinstance(recipe, str):
        recipe = algorithms.get(recipe)
    if isinstance(recipe, PreferenceRecipe):  # offline preference optimisation (DPO family)
        return Explanation(
            recipe=recipe.name,
            reward="implicit: β·log(π/π_ref) of the chosen vs rejected answer of each pair; no "
            "reward model, no rollouts",
            kl=f"implicit in the objective through the reference log-ratio (β = {recipe.beta:g})"
            if "reference_logprobs" in recipe.requires
            else "none: reference-free",
            baseline="none: the rejected answer plays the role of a baseline",
            normalization="none",
            objective=f"{recipe.text}; mean over pairs",
        )
    by_kind: dict[str, list[str]] = {}
    for info in recipe.advantage.info:
        by_kind.setdefault(info.kind, []).append(info.text)
    source = "the sequence score (verifier or reward model), placed on the last token"
    reward = _join([source, *by_kind.get("reward", [])], "")
    obj = recipe.objective
    if "kl" in by_kind:
        kl = _join(by_kind["kl"], "")
    elif obj.kl is not None:
        kl = (
            f"in the loss: + β·{obj.kl.label}(π_θ ‖ π_ref) per token on the current "
            f"policy, β = {obj.kl.beta:g}"
        )
        if obj.kl.importance_weighted:
            kl += ", times the ratio π_θ/π_old (bias-corrected off-policy)"
        if obj.mixed_aggregation and obj.token_mean_kl:
            kl += f"; a token mean, not {obj.aggregation_label}"
    else:
        kl = "nowhere (β = 0): no reference model is needed"
    returns = by_kind.get("return", [])
    baseline = _join(by_kind.get("baseline", []), "none")
    if returns:
        baseline = f"{baseline} (credit: {_join(returns, '')})"
    normalization = _join(by_kind.get("normalize", []), "none")
    objective = f"{obj.text}; aggregated {obj.aggregation_label}"
    if obj.entropy_coef > 0:
        objective += f"; entropy bonus {obj.entropy_coef:g}"
        if obj.mixed_aggregation and obj.token_mean_entropy:
            objective += " (a token mean)"
    if recipe.selection.dynamic_sampling:
        objective += "; all-equal groups dropped (dynamic sampling)"
    if recipe.selection.pods_num_keep is not None:
        objective += f"; PODS keeps {recipe.selection.pods_num_keep} per prompt"
    return Explanation(recipe.name, reward, kl, baseline, normalization, objective)


def format_explanation(explanation: Explanation, width: int = 100) -> str:
    """The five answers as a two-column table."""
    label_width = max(len(q) for _, q in QUESTIONS) + 2
    lines = [f"{explanation.recipe}", "=" * len(explanation.recipe)]
    for field, question in QUESTIONS:
        answer = getattr(explanation, field)
        wrapped = textwrap.wrap(answer, width=max(20, width - label_width)) or [""]
        lines.append(question.ljust(label_width) + wrapped[0])
        lines.extend(" " * label_width + more for more in wrapped[1:])
    return "\n".join(lines)


def _labels(recipe: Recipe, kind: str) -> list[str]:
    return [i.label for i in recipe.advantage.info if i.kind == kind]


def _short_row(recipe: AnyRecipe) -> list[str]:
    """The seed's comparison in a few words per cell, read off the stages' labels."""
    if isinstance(recipe, PreferenceRecipe):
        cells = ("preference pairs", "implicit", "rejected answer", "none", recipe.label)
        return [recipe.name, *cells, "mean over pairs"]
    if _labels(recipe, "kl"):
        kl = "in reward"
    else:
        kl = "in loss" if recipe.objective.kl is not None else "—"
    return [
        recipe.name,
        "score" + " + shaping" * bool(_labels(recipe, "reward")),
        kl,
        (_labels(recipe, "baseline") or ["none"])[0],
        " + ".join(_labels(recipe, "normalize")) or "none",
        recipe.objective.label,
        recipe.objective.aggregation_label,
    ]


def comparison_table(names: tuple[str, ...] | None = None) -> str:
    """The seed's side-by-side comparison of recipes (default: all of them)."""
    names = names or tuple(algorithms.RECIPES)
    recipes = [algorithms.get(n) for n in names]
    header = ["algorithm", "reward", "KL", "baseline", "normalisation", "optimises", "agg."]
    rows = [_short_row(r) for r in recipes]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    fmt = lambda row: " | ".join(
        cell.ljust(w) for cell, w in zip(row, widths, strict=True)
    ).rstrip()
    sep = "-+-".join("-" * w for w in widths)
    return "\n".join([fmt(header), sep, *(fmt(row) for row in rows)])
