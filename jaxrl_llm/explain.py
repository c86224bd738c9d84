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
from jaxrl_llm.algorithms import Recipe

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


def explain(recipe: Recipe | str) -> Explanation:
    """Answers the five questions for ``recipe`` (a :class:`Recipe` or an algorithm name)."""
    if isinstance(recipe, str):
        recipe = algorithms.get(recipe)
    if recipe.advantage is None:  # offline preference optimisation (DPO family)
        return Explanation(
            recipe=recipe.name,
            reward="implicit: β·log(π/π_ref) of the chosen vs rejected answer of each pair; no "
            "reward model, no rollouts",
            kl=f"implicit in the objective through the reference log-ratio (β = {recipe.beta:g})"
            if recipe.needs_reference
            else "none: reference-free",
            baseline="none: the rejected answer plays the role of a baseline",
            normalization="none",
            objective=f"{recipe.objective}; mean over pairs",
        )
    infos = recipe.advantage.info
    by_kind: dict[str, list[str]] = {}
    for info in infos:
        by_kind.setdefault(info.kind, []).append(info.text)
    source = "the sequence score (verifier or reward model), placed on the last token"
    reward = _join([source, *by_kind.get("reward", [])], "")
    if "kl" in by_kind:
        kl = _join(by_kind["kl"], "")
    elif recipe.kl_loss is not None:
        kl = (
            f"in the loss: + β·{recipe.kl_estimator}(π_θ ‖ π_ref) per token on the current "
            f"policy, β = {recipe.beta:g}"
        )
    else:
        kl = "nowhere (β = 0): no reference model is needed"
    returns = by_kind.get("return", [])
    baseline = _join(by_kind.get("baseline", []), "none")
    if returns:
        baseline = f"{baseline} (credit: {_join(returns, '')})"
    normalization = _join(by_kind.get("normalize", []), "none")
    objective = f"{recipe.objective}; aggregated {recipe.aggregation_name}"
    if recipe.entropy_coef > 0:
        objective += f"; entropy bonus {recipe.entropy_coef:g}"
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


_SHORT = {
    # The seed's comparison in a few words per cell, derived from the recipes' stages.
    "reward": lambda r: (
        "preference pairs" if r.advantage is None else "score" + (" + shaping" * _has(r, "reward"))
    ),
    "kl": lambda r: (
        "in reward"
        if "kl" in _kinds(r)
        else ("in loss" if r.kl_loss is not None else ("implicit" if r.advantage is None else "—"))
    ),
    "baseline": lambda r: _short_baseline(r),
    "normalization": lambda r: _short_norm(r),
    "objective": lambda r: r.loss_name,
}


def _kinds(recipe: Recipe) -> list[str]:
    return [] if recipe.advantage is None else [i.kind for i in recipe.advantage.info]


def _has(recipe: Recipe, kind: str) -> bool:
    return kind in _kinds(recipe)


def _short_baseline(recipe: Recipe) -> str:
    if recipe.advantage is None:
        return "rejected answer"
    texts = [i.text for i in recipe.advantage.info if i.kind == "baseline"]
    if not texts:
        return "none"
    text = texts[0]
    for key, short in (
        ("critic", "critic V(s)"),
        ("leave-one-out", "leave-one-out"),
        ("length-weighted", "length-weighted mean"),
        ("group mean", "group mean"),
        ("given", "given (greedy)"),
    ):
        if key in text:
            return short
    return text[:24]


def _short_norm(recipe: Recipe) -> str:
    if recipe.advantage is None:
        return "none"
    texts = [i.text for i in recipe.advantage.info if i.kind == "normalize"]
    shorts = []
    for text in texts:
        if text.startswith("per group"):
            shorts.append("group std")
        elif text.startswith("batch:"):
            shorts.append("batch std")
        else:
            shorts.append("batch whitening")
    return " + ".join(shorts) or "none"


def comparison_table(names: tuple[str, ...] | None = None) -> str:
    """The seed's side-by-side comparison of recipes (default: all of them)."""
    names = names or tuple(algorithms.RECIPES)
    recipes = [algorithms.get(n) for n in names]
    header = ["algorithm", "reward", "KL", "baseline", "normalisation", "optimises", "agg."]
    rows = [
        [
            r.name,
            _SHORT["reward"](r),
            _SHORT["kl"](r),
            _SHORT["baseline"](r),
            _SHORT["normalization"](r),
            _SHORT["objective"](r),
            r.aggregation_name,
        ]
        for r in recipes
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    fmt = lambda row: " | ".join(
        cell.ljust(w) for cell, w in zip(row, widths, strict=True)
    ).rstrip()
    sep = "-+-".join("-" * w for w in widths)
    return "\n".join([fmt(header), sep, *(fmt(row) for row in rows)])
