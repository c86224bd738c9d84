# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # From reward to advantage: the seed's worked example, through every recipe
#
# The seed documents describe every RL algorithm for LLMs as one chain:
#
# ```
# raw reward ─► +KL ─► return ─► −baseline ─► advantage ─► normalize ─► × ∇log π ─► update
# ```
#
# This notebook runs the seed's worked example (one prompt, three answers scored 8.2 / 6.5 / 9.1)
# through that chain with `jaxrl_llm`, then a small batch of several prompts with ragged lengths
# through every recipe, asks the five questions of two recipes, shows the failure case (every
# answer right → no signal) and plots the advantages. The seed's numbers are asserted, so running
# the file is a test (`tests/test_notebook.py` does).
#
# This `.py` file is the notebook (jupytext percent format): open it in Jupyter with jupytext,
# or `jupytext --to notebook examples/signal_chain.py`, or just `python examples/signal_chain.py`.
# The plot is saved to `$SIGNAL_CHAIN_PLOT` when that is set.

# %%
import os
import sys

import matplotlib

if "ipykernel" not in sys.modules:
    matplotlib.use("Agg")  # a script or a test: no display

import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

import jaxrl_llm as jrl
from jaxrl_llm import algorithms
from jaxrl_llm import chain as ch
from jaxrl_llm.core import baselines
from jaxrl_llm.explain import format_explanation

np.set_printoptions(precision=4, suppress=True)

# %% [markdown]
# ## 1. The seed's example: one prompt, three answers
#
# | answer | RM score $r_i$ |
# |---|---|
# | A | 8.2 |
# | B | 6.5 |
# | C | 9.1 |
#
# A `Rollout` holds the scores `reward_bg` (`[B, G]` = 1 prompt × 3 answers) and the mask of
# completion tokens `mask_bgt` (here 4 tokens each). The chain's input puts each score on the
# last token of its answer.

# %%
SCORES = [8.2, 6.5, 9.1]
ANSWERS = ["A", "B", "C"]
T = 4
rollout = jrl.Rollout(reward_bg=jnp.array([SCORES]), mask_bgt=jnp.ones((1, 3, T), bool))
print("token rewards [answer, token]:\n", np.asarray(ch.token_rewards(rollout))[0])

# %% [markdown]
# ### RLOO: the baseline is the mean of the *other* answers
#
# For A the baseline is (6.5 + 9.1) / 2 = 7.8, so A's advantage is 8.2 − 7.8 = +0.4; for B it is
# 6.5 − 8.65 = −2.15. Default `rloo()` folds a KL penalty into the reward (β = 0.05), which needs
# the rollout's log-probs; the seed's example has none, so we take β = 0 here.

# %%
score_bg = jnp.array([SCORES])
loo_baseline = np.asarray(baselines.leave_one_out_baseline(score_bg, jnp.ones((1, 3), bool)))[0]
rloo_adv = np.asarray(jrl.compute_advantages(algorithms.rloo(beta=0.0), rollout))[0]
for name, b, a in zip(ANSWERS, loo_baseline, rloo_adv[:, 0], strict=True):
    print(f"answer {name}: baseline {b:.2f}, advantage {a:+.2f}")

np.testing.assert_allclose(loo_baseline, [7.8, 8.65, 7.35], atol=1e-5)
np.testing.assert_allclose(rloo_adv[:, 0], [0.4, -2.15, 1.75], atol=1e-5)
# an outcome return: every token of an answer carries the same advantage
np.testing.assert_allclose(rloo_adv, np.repeat(rloo_adv[:, :1], T, axis=1))

# %% [markdown]
# ### GRPO: z-scores within the group
#
# The seed writes $A_i = (r_i − 7.93) / 1.07$. The mean is 7.933; the std depends on a
# convention. `jaxrl_llm`'s default numerics use the **population** std (ddof 0), 1.078 — the
# seed's 1.07 (the seed truncates). The `"verl"` preset reproduces verl's `torch.std`
# (ddof 1, the sample std), 1.320, so its advantages are smaller by √(2/3).

# %%
r = np.array(SCORES)
mean, std_pop, std_sample = r.mean(), r.std(), r.std(ddof=1)
print(f"mean {mean:.3f}, population std {std_pop:.3f}, sample std (ddof 1) {std_sample:.3f}")

grpo_adv = np.asarray(jrl.compute_advantages(algorithms.grpo(), rollout))[0, :, 0]
grpo_verl = np.asarray(jrl.compute_advantages(algorithms.grpo(numerics="verl"), rollout))[0, :, 0]
print("GRPO, default numerics:", grpo_adv)
print("GRPO, numerics='verl': ", grpo_verl)
print("the seed's (r − 7.93)/1.07:", (r - 7.93) / 1.07)

assert round(mean, 2) == 7.93
assert abs(std_pop - 1.078) < 5e-4 and int(std_pop * 100) / 100 == 1.07
assert abs(std_sample - 1.320) < 5e-4
np.testing.assert_allclose(grpo_adv, (r - mean) / (std_pop + 1e-6), rtol=1e-5)
np.testing.assert_allclose(grpo_adv, (r - 7.93) / 1.07, atol=0.02)  # the seed's rounded numbers
np.testing.assert_allclose(grpo_verl, (r - mean) / (std_sample + 1e-6), rtol=1e-5)

# %% [markdown]
# ## 2. The same three answers through every recipe
#
# Recipes that put the KL in the reward (`reinforce`, `ppo`, `rloo`, `reinforce_pp`) need the
# rollout's and the reference's log-probs: we give equal ones (the policy has not moved yet, KL
# = 0). PPO needs critic values: an untrained critic, V = 0. ReMax needs the reward of a greedy
# answer (its baseline). Each recipe runs with its defaults.
# The table shows each answer's advantage on its first and its last token.

# %%
RECIPES = algorithms.ONLINE_RECIPES
recipes = {name: algorithms.get(name) for name in RECIPES}
zeros = jnp.zeros((1, 3, T))
# ReMax's baseline is the reward of a greedy answer to the prompt: say it scored 7.0.
seed_rollout = rollout._replace(
    logp_old_bgt=zeros, logp_ref_bgt=zeros, value_bgt=zeros, baseline_b=jnp.array([7.0])
)
seed_adv = {n: np.asarray(jrl.compute_advantages(rc, seed_rollout))[0] for n, rc in recipes.items()}


def print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(row[i])) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(str(c).rjust(w) for c, w in zip(row, widths, strict=True)))


header = ["recipe"] + [f"{a} t=0" for a in ANSWERS] + [f"{a} t={T - 1}" for a in ANSWERS]
print_table(
    header,
    [[n] + [f"{x:+.3f}" for x in [*adv[:, 0], *adv[:, -1]]] for n, adv in seed_adv.items()],
)

# %% [markdown]
# What the table says, chain stage by chain stage:
#
# * `reinforce` has no baseline: every token gets the raw score (γ = 1), so all three answers
#   are pushed up, C most.
# * `rloo` is the seed's +0.4 / −2.15 / +1.75; `dr_grpo` subtracts the plain group mean
#   (7.93), so its advantages are (G−1)/G = 2/3 of RLOO's.
# * `grpo`, `dapo` and `gspo` share GRPO's advantage (they differ in the loss), the z-scores.
# * `reinforce_pp` and `reinforce_pp_baseline` whiten over every token of the batch; with one
#   prompt and equal lengths that is GRPO's z-score again.
# * `ppo`: GAE with V = 0 and λ = 0.95 discounts the score towards the first token, then whitens
#   over all tokens, so t = 0 and t = 3 differ.

# %%
a = {n: adv[:, 0] for n, adv in seed_adv.items()}
np.testing.assert_allclose(a["reinforce"], r, rtol=1e-6)
np.testing.assert_allclose(a["rloo"], [0.4, -2.15, 1.75], atol=1e-5)
np.testing.assert_allclose(a["dr_grpo"], r - mean, atol=1e-5)
np.testing.assert_allclose(a["dr_grpo"], a["rloo"] * 2 / 3, atol=1e-5)
for name in ("dapo", "gspo", "reinforce_pp", "reinforce_pp_baseline"):
    np.testing.assert_allclose(a[name], a["grpo"], atol=1e-4, err_msg=name)
for name, adv in seed_adv.items():
    if name != "ppo":  # every other recipe gives each answer one number on all its tokens
        np.testing.assert_allclose(adv, np.repeat(adv[:, :1], T, axis=1), err_msg=name)
assert not np.allclose(seed_adv["ppo"][:, 0], seed_adv["ppo"][:, -1])

# %% [markdown]
# ## 3. A small batch: several prompts, ragged lengths
#
# Three prompts with four answers each, completions of 1 to 6 tokens (padding after), random
# log-probs (so the KL-in-reward recipes see a real KL) and random critic values. Prompt 0 has
# binary rewards, prompt 1 graded ones, and prompt 2's answers are all right. The table lists
# each answer's advantage on its first token.

# %%
rng = np.random.default_rng(0)
B, G, T2 = 3, 4, 6
reward_bg = np.array([[1.0, 0.0, 0.0, 1.0], [0.2, 0.9, 0.5, 0.4], [1.0, 1.0, 1.0, 1.0]])
length_bg = np.array([[6, 2, 4, 5], [3, 6, 1, 4], [5, 5, 2, 6]])
mask_bgt = np.arange(T2) < length_bg[..., None]
logp_old = -rng.exponential(1.0, (B, G, T2))
batch = jrl.Rollout(
    reward_bg=jnp.asarray(reward_bg, jnp.float32),
    mask_bgt=jnp.asarray(mask_bgt),
    logp_old_bgt=jnp.asarray(logp_old, jnp.float32),
    logp_ref_bgt=jnp.asarray(logp_old + rng.normal(0.0, 0.3, (B, G, T2)), jnp.float32),
    value_bgt=jnp.asarray(rng.normal(0.0, 0.5, (B, G, T2)), jnp.float32),
    baseline_b=jnp.asarray([0.5, 0.6, 1.0], jnp.float32),  # ReMax: the greedy answers' rewards
)
batch_adv = {n: np.asarray(jrl.compute_advantages(rc, batch)) for n, rc in recipes.items()}

print_table(
    ["prompt", "answer", "len", "reward", *RECIPES],
    [
        [b, g, length_bg[b, g], reward_bg[b, g]]
        + [f"{batch_adv[n][b, g, 0]:+.2f}" for n in RECIPES]
        for b in range(B)
        for g in range(G)
    ],
)

# %% [markdown]
# Checks that hold for any batch: padding gets exactly 0; the group-relative advantages sum to 0
# within each prompt (GRPO's and Dr. GRPO's around the group mean; RLOO's too, since
# Σᵢ(Rᵢ − mean of the others) = 0, KL included); prompt 0's binary rewards give GRPO ±1 with the
# population std and ±0.866 with verl's sample std; prompt 2 (all right) gets no GRPO signal.
# Two effects of the chain show up in the table. RLOO's small advantages on prompt 2 come only
# from the KL folded into the reward (it differs per answer). `reinforce_pp_baseline` whitens
# over every *token* of the batch, and with ragged lengths the token mean of the group-centred
# advantages is not 0: its whitening shifts every answer of prompt 2 by the same −μ/σ, so an
# all-right prompt gets a (uniform) negative advantage in a mixed batch.

# %%
for name, adv in batch_adv.items():
    assert np.all(adv[~mask_bgt] == 0.0), name
    assert np.all(np.isfinite(adv)), name
for name in ("grpo", "dr_grpo", "rloo", "dapo", "gspo"):
    np.testing.assert_allclose(batch_adv[name][..., 0].sum(-1), 0.0, atol=1e-5, err_msg=name)
np.testing.assert_allclose(batch_adv["grpo"][0, :, 0], [1, -1, -1, 1], atol=1e-5)
grpo_verl_batch = np.asarray(jrl.compute_advantages(algorithms.grpo(numerics="verl"), batch))
np.testing.assert_allclose(grpo_verl_batch[0, :, 0], np.array([1, -1, -1, 1]) * 0.866025, atol=1e-5)
for name in ("grpo", "dr_grpo", "dapo", "gspo"):
    np.testing.assert_array_equal(batch_adv[name][2], 0.0)
shifted = batch_adv["reinforce_pp_baseline"][2][mask_bgt[2]]
assert np.ptp(shifted) < 1e-5 and abs(shifted[0]) > 0.01  # one constant, not 0

# %% [markdown]
# ## 4. The five questions
#
# The seed asks five questions of any algorithm: where the reward comes from, where the KL goes,
# where the baseline comes from, where normalisation happens, and what is finally optimised.
# `jrl.explain` reads the answers off a recipe's chain, loss and aggregation.

# %%
for name in ("grpo", "rloo"):
    print(format_explanation(jrl.explain(name)), end="\n\n")

grpo_q, rloo_q = jrl.explain("grpo"), jrl.explain("rloo")
assert "loss" in grpo_q.kl and "reward" in rloo_q.kl
assert "group mean" in grpo_q.baseline and "leave-one-out" in rloo_q.baseline
assert grpo_q.normalization.startswith("per group") and rloo_q.normalization == "none"

# %%
print(jrl.comparison_table())

# %% [markdown]
# ## 5. The failure case: every answer right
#
# When the three answers all score the same (all correct, reward 1), every group-relative
# baseline equals the reward and the advantage is 0 on every token: the prompt teaches nothing.
# DAPO's dynamic sampling drops such a prompt (and refills the batch); `reinforce`, with no
# baseline, still pushes all three answers up by the same amount.

# %%
all_right = seed_rollout._replace(reward_bg=jnp.ones((1, 3)))
for name in ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "dapo", "gspo"):
    adv = np.asarray(jrl.compute_advantages(recipes[name], all_right))
    print(f"{name:22s} advantages {adv[0, :, 0]}")
    np.testing.assert_array_equal(adv, 0.0, err_msg=name)

kept = np.asarray(jrl.select(recipes["dapo"], all_right).mask_bg)
print("DAPO dynamic sampling keeps", kept[0], "→ the prompt is dropped")
assert not kept.any()
no_baseline = np.asarray(jrl.compute_advantages(recipes["reinforce"], all_right))
print("reinforce (no baseline) advantages", no_baseline[0, :, 0])
np.testing.assert_allclose(no_baseline[0], 1.0)

# %% [markdown]
# ## 6. The advantages, plotted
#
# Left: the seed's three answers, each recipe's advantage on the first token (`reinforce` has no
# baseline, so its bars are the raw scores, cut off and labelled). Right: the ragged batch, each
# answer's first-token advantage per recipe (rows) and answer (columns).

# %%
Y_LIMIT = 2.6
fig, (left, right) = plt.subplots(1, 2, figsize=(15, 5.5), gridspec_kw={"width_ratios": [1, 1.3]})
x = np.arange(len(RECIPES))
for i, (answer, color) in enumerate(
    zip(ANSWERS, ["tab:blue", "tab:red", "tab:green"], strict=True)
):
    values = np.array([seed_adv[n][i, 0] for n in RECIPES])
    offset = x + (i - 1) * 0.27
    left.bar(offset, values, 0.27, label=f"{answer} (r = {SCORES[i]})", color=color)
    for xi, value in zip(offset, values, strict=True):
        if abs(value) > Y_LIMIT:  # off the scale: say how far
            left.text(
                xi,
                Y_LIMIT * 0.96,
                f"{value:.1f} ↑",
                ha="center",
                va="top",
                rotation=90,
                color="white",
                fontsize=9,
                fontweight="bold",
            )
left.set_ylim(-Y_LIMIT, Y_LIMIT)
left.axhline(0.0, color="black", linewidth=0.8)
left.set_xticks(x, RECIPES, rotation=35, ha="right")
left.set_ylabel("advantage (first token)")
left.set_title("Seed example: one prompt, answers scored 8.2 / 6.5 / 9.1")
left.legend()
left.grid(axis="y", alpha=0.3)

grid = np.array([[batch_adv[n][b, g, 0] for b in range(B) for g in range(G)] for n in RECIPES])
limit = float(np.abs(grid).max())
image = right.imshow(grid, cmap="RdBu", vmin=-limit, vmax=limit, aspect="auto")
for (row, col), value in np.ndenumerate(grid):
    ink = "white" if abs(value) > 0.6 * limit else "black"
    right.text(col, row, f"{value:+.2f}", ha="center", va="center", fontsize=7.5, color=ink)
right.set_yticks(np.arange(len(RECIPES)), RECIPES)
labels = [
    f"p{b} a{g}\nr={reward_bg[b, g]:g}\nlen {length_bg[b, g]}" for b in range(B) for g in range(G)
]
right.set_xticks(np.arange(B * G), labels, fontsize=7.5)
for edge in range(G, B * G, G):
    right.axvline(edge - 0.5, color="black", linewidth=1.5)
right.set_title("Ragged batch: 3 prompts × 4 answers (prompt 2: all right)")
fig.colorbar(image, ax=right, label="advantage (first token)")
fig.tight_layout()

plot_path = os.environ.get("SIGNAL_CHAIN_PLOT")
if plot_path:
    fig.savefig(plot_path, dpi=110)
    print(f"saved {plot_path}")
elif "ipykernel" in sys.modules:
    plt.show()
else:
    fig.canvas.draw()
