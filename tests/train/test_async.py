"""Async RL (``train.max_staleness``, :mod:`jaxrl_llm.train.asynchronous`) on the tiny model.

* the schedule: staleness 1 trains exactly what an explicit replay with the old policies
  trains (batch t sampled by π_{t-2}), and the step's importance weights are those of the
  explicit policies (π_prox = the current parameters, μ = the version that sampled);
* the buffer, the sampler keys and the metrics;
* resume: the buffered batches are part of the checkpoint (a killed async run resumes to the
  parameters of the uninterrupted one, bit for bit; the kill -9 version is in test_faults).
"""

from __future__ import annotations

import json
import time

import jax
import numpy as np
import pytest

from jaxrl_llm.data import BatchIterator
from jaxrl_llm.train import asynchronous as A
from jaxrl_llm.train import forward, loop, setup
from jaxrl_llm.train import metrics as M
from jaxrl_llm.train.checkpoint import HOST_ARRAYS, Checkpointer
from jaxrl_llm.train.collect import collect
from jaxrl_llm.train.step import Groups, make_rl_step
from tests.train import helpers as H

VARIED = [
    "rewards.terms=[{type: length_penalty, kwargs: {target: 10, unit: chars, coef: 0.1}},"
    " {type: regex, weight: 0.5, kwargs: {pattern: '[aeiou]'}}]"
]
# lr 1e-2: consecutive policies differ enough that a wrong version shows in every number
BASE = ["data.eval_size=0", "optim.lr=1.0e-2", "train.save_every=0", *VARIED]


def _quiet(*_):
    pass


def _final_state(config, run_dir):
    with Checkpointer(run_dir / "checkpoints") as ckpt:
        return ckpt.restore(setup.resolve(config).state)[0]


def _assert_same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ---------------------------------------------------------------------------------------------
# Pieces.


def test_key_ahead_follows_the_synchronous_key_chain():
    state = setup.resolve(H.config("tiny.yaml", "data.eval_size=0")).state
    keys, s = [], state
    for _ in range(4):
        s, key = loop._split_key(s)
        keys.append(jax.random.key_data(key))
    after_first = loop._split_key(state)[0].rng  # what the driver sees at step 1
    for ahead in range(3):
        np.testing.assert_array_equal(
            jax.random.key_data(A.key_ahead(after_first, ahead)), keys[ahead + 1]
        )


def _groups(b=2, g=2, t=3, seed=0):
    rng = np.random.default_rng(seed)
    return Groups(
        prompt_ids_bp=rng.integers(0, 50, (b, 4)).astype(np.int32),
        prompt_mask_bp=np.ones((b, 4), bool),
        tokens_bgt=rng.integers(0, 50, (b, g, t)).astype(np.int32),
        mask_bgt=rng.random((b, g, t)) < 0.7,
        logp_sampler_bgt=-rng.random((b, g, t)).astype(np.float32),
        reward_bg=rng.random((b, g)).astype(np.float32),
        member_bg=np.ones((b, g), bool),
    )


def test_the_buffer_round_trips_through_a_checkpoint(tmp_path):
    version_bgt = np.where(_groups(seed=2).mask_bgt, 3, -1).astype(np.int32)
    version_bgt[0, 0, -1] = 4
    entries = [
        A.Pending(5, 3, _groups(seed=1), {"reward/mean": 0.5}),
        A.Pending(
            6, 3, _groups(seed=2)._replace(baseline_b=np.ones(2, np.float32)), {}, version_bgt
        ),
    ]
    arrays, described = A.buffer_to_host(entries)
    state = {"w": jax.numpy.arange(3.0)}
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(4, state, meta={A.BUFFER_META: described}, host=arrays)
        ckpt.save(5, state)  # a later step without a buffer has none
        ckpt.wait()
        _, meta = ckpt.restore(state, step=4)
        back = A.buffer_from_host(meta[HOST_ARRAYS], meta[A.BUFFER_META])
        assert HOST_ARRAYS not in ckpt.restore(state, step=5)[1]
    for a, b in zip(entries, back, strict=True):
        assert (a.step, a.version, a.metrics) == (b.step, b.version, b.metrics)
        _assert_same(a.groups, b.groups)  # None fields stay None
        assert (a.version_bgt is None) == (b.version_bgt is None)
    np.testing.assert_array_equal(back[1].version_bgt, version_bgt)


def test_a_damaged_buffer_is_unreadable_and_the_previous_checkpoint_is_used(tmp_path):
    arrays, described = A.buffer_to_host([A.Pending(3, 1, _groups(), {})])
    state = {"w": jax.numpy.arange(3.0)}
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, state, meta={"x": 1})
        ckpt.save(2, state, meta={A.BUFFER_META: described}, host=arrays)
    meta_file = next((tmp_path / "2" / "meta").glob("*"))
    body = json.loads(meta_file.read_text())
    name = next(iter(body[HOST_ARRAYS]))
    body[HOST_ARRAYS][name][2] = "0" * 64  # the saved digest no longer matches the array
    meta_file.write_text(json.dumps(body))
    with Checkpointer(tmp_path) as ckpt, pytest.warns(Warning, match="buffered host arrays"):
        _, meta = ckpt.restore(state)
    assert meta["x"] == 1


def test_staleness_metrics_count_tokens_by_their_version():
    g = _groups()
    full = A.staleness_metrics(A.Pending(4, 2, g, {}), train_version=3, max_staleness=2)
    assert full["async/staleness_mean"] == full["async/staleness_max"] == 1.0
    assert (full["async/staleness_frac_0"], full["async/staleness_frac_1"]) == (0.0, 1.0)
    assert full["async/staleness_frac_2"] == 0.0
    version_bgt = np.where(g.mask_bgt, 2, -1)
    version_bgt[0, 0] = np.where(g.mask_bgt[0, 0], 3, -1)  # continued under version 3
    assert g.mask_bgt[0, 0].any()
    part = A.staleness_metrics(A.Pending(4, 2, g, {}, version_bgt), 3, 2)
    ages = 3 - version_bgt[g.mask_bgt]
    assert part["async/staleness_mean"] == pytest.approx(ages.mean())
    assert part["async/staleness_frac_0"] == pytest.approx(np.mean(ages == 0))
    assert 0 < part["async/staleness_frac_0"] < 1


# ---------------------------------------------------------------------------------------------
# The schedule against an explicit replay with the old policies.


def test_staleness_one_trains_what_an_explicit_replay_with_old_policies_trains(tmp_path):
    config = H.config("tiny.yaml", "train.max_steps=3", "train.max_staleness=1", *BASE)
    run = tmp_path / "async"
    loop.train(config, run_dir=run, progress=False, log=_quiet)
    got = _final_state(config, run)
    records = M.read_metrics(run)

    # The replay: batch t is sampled by version max(0, t - 2), with the synchronous key chain.
    s = setup.resolve(config)
    assert s.recipe.objective.rollout_correction is not None  # async's default: token TIS, cap 2
    it = BatchIterator(
        s.data.train,
        s.loop.batch_size,
        seed=s.loop.data_seed,
        shuffle=s.loop.shuffle,
        pad_multiple=setup.PAD_MULTIPLE,
    )
    step = make_rl_step(
        s.recipe,
        s.models,
        s.update,
        temperature=s.sampler.temperature,
        old_logprobs=s.old_logprobs,
    )
    logprob = forward.make_logprob_fn(s.models.graphdef, temperature=s.sampler.temperature)
    copy = jax.jit(lambda tree: jax.tree.map(lambda x: x + 0, tree))
    keys, chain = [], s.state
    for _ in range(3):
        chain, key = loop._split_key(chain)
        keys.append(key)
    versions = [copy(s.state.params)]  # versions[k]: the parameters after k updates
    batches = {t: collect(s, versions[0], it, keys[t - 1])[0] for t in (1, 2)}
    state, ratio_means = s.state, []
    for t in (1, 2, 3):
        state, _ = loop._split_key(state)
        if t == 3:
            batches[3] = collect(s, versions[1], it, keys[2])[0]
        g = batches[t]
        b, n_samples, width = g.tokens_bgt.shape
        ids = np.concatenate(
            [np.repeat(g.prompt_ids_bp, n_samples, 0), g.tokens_bgt.reshape(b * n_samples, -1)], 1
        )
        mask = np.concatenate(
            [np.repeat(g.prompt_mask_bp, n_samples, 0), g.mask_bgt.reshape(b * n_samples, -1)], 1
        )

        def logp(params, ids=ids, mask=mask, width=width):
            return np.asarray(logprob(params, ids, mask, completion_len=width))

        m = g.mask_bgt.reshape(b * n_samples, -1)
        mu = g.logp_sampler_bgt.reshape(b * n_samples, -1)[m]
        behaviour = max(0, t - 2)
        np.testing.assert_allclose(mu, logp(versions[behaviour])[m], atol=2e-4)  # μ = π_{t-2}
        prox = logp(state.params)[m]  # π_prox: the parameters about to update (version t-1)
        ratio_means.append(float(np.mean(np.exp(prox - mu))))
        state, _ = step(state, g)
        versions.append(copy(state.params))
    _assert_same(got.params, state.params)
    for r, expect in zip(records, ratio_means, strict=True):
        assert r["rollout_corr/ratio_mean"] == pytest.approx(expect, rel=1e-5)
    assert abs(ratio_means[1] - 1.0) > 1e-3  # step 2's batch is really one version old
    assert [r["async/staleness_max"] for r in records] == [0.0, 1.0, 1.0]
    assert [r["async/behaviour_version"] for r in records] == [0.0, 0.0, 1.0]


def test_staleness_zero_with_a_copy_is_the_synchronous_loop(tmp_path):
    """train.max_staleness=0 colocated is today's loop (no driver); the driver at s = 0 (here
    forced on a colocated copy) trains the same parameters."""
    config = H.config("tiny.yaml", "train.max_steps=2", *BASE)
    assert not loop.is_async(setup.resolve(config))
    loop.train(config, run_dir=tmp_path / "sync", progress=False, log=_quiet)
    sync = _final_state(config, tmp_path / "sync")

    original = loop.is_async
    try:
        loop.is_async = lambda s: True
        loop.train(config, run_dir=tmp_path / "driver", progress=False, log=_quiet)
    finally:
        loop.is_async = original
    _assert_same(sync.params, _final_state(config, tmp_path / "driver").params)
    # the driver logs the completions the loop logs (recorded before each update)
    sampled = (tmp_path / "sync" / "completions.jsonl").read_text()
    assert [json.loads(x)["step"] for x in sampled.splitlines()] == [1, 2]
    assert (tmp_path / "driver" / "completions.jsonl").read_text() == sampled
    lines = (tmp_path / "driver" / A.TIMELINE_FILE).read_text().splitlines()
    timeline = [json.loads(x) for x in lines]
    assert [x["step"] for x in timeline] == [1, 2]
    names = [p["phase"] for p in timeline[1]["phases"]]
    assert names == ["rollout", "update", "sync"], names
    for p in timeline[1]["phases"]:
        assert 0 <= p["start"] <= p["end"]


@pytest.mark.parametrize("serial", [False, True])
def test_the_rollout_overlaps_the_update_unless_collectives_must_run_one_at_a_time(
    tmp_path, monkeypatch, serial
):
    """At staleness 1 the next batch is sampled while the update runs (its metrics read after
    the rollout); where cross-process collectives must run one program at a time (several CPU
    processes: gloo pairs them by order) the update is finished first."""
    from jaxrl_llm import distributed as dist

    events = []

    class Spy:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def dispatch(self, state, groups):
            new_state, wait = self.inner.dispatch(state, groups)
            events.append("update")

            def recorded_wait():
                events.append("wait")
                return wait()

            return new_state, recorded_wait

    init, generate = A.AsyncDriver.__init__, A.AsyncDriver._generate

    def spied_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.rl_step = Spy(self.rl_step)

    def recorded_generate(self, j, *args, **kwargs):
        events.append(f"rollout {j}")
        return generate(self, j, *args, **kwargs)

    monkeypatch.setattr(A.AsyncDriver, "__init__", spied_init)
    monkeypatch.setattr(A.AsyncDriver, "_generate", recorded_generate)
    monkeypatch.setattr(dist, "one_collective_program_at_a_time", lambda: serial)
    config = H.config("tiny.yaml", "train.max_steps=3", "train.max_staleness=1", *BASE)
    loop.train(config, run_dir=tmp_path / "run", progress=False, log=_quiet)
    step_1 = ["rollout 1", "update", "rollout 2", "wait"]  # batch 2 sampled during update 1
    if serial:
        step_1 = ["rollout 1", "update", "wait", "rollout 2"]
    assert events[:4] == step_1, events
    assert events.count("update") == events.count("wait") == 3


class _Killed(Exception):
    pass


def _killed_after(config, run_dir, step, monkeypatch):
    """Trains ``config`` in ``run_dir`` until ``step`` is logged, then raises (a crash)."""
    original = M.MetricsLogger.progress

    def die(self, at, metrics):
        original(self, at, metrics)
        if at == step:
            raise _Killed

    monkeypatch.setattr(M.MetricsLogger, "progress", die)
    with pytest.raises(_Killed):
        loop.train(config, run_dir=run_dir, progress=False, log=_quiet)
    monkeypatch.setattr(M.MetricsLogger, "progress", original)


#: The metrics a resumed run reports as the uninterrupted one did; the KV-cache ones of a batch
#: buffered (or, with partial rollouts, in flight: its first segments') come from the checkpoint.
SAME_AFTER_RESUME = (
    "actor/loss",
    "reward/mean",
    "async/staleness_mean",
    "rollout_corr/ratio_mean",
    "rollout/decode_dispatches",
    "rollout/kv_peak_gib",
)


def test_a_killed_async_run_resumes_with_its_buffer_to_the_same_parameters(tmp_path, monkeypatch):
    config = H.config(
        "tiny.yaml", "train.max_steps=4", "train.max_staleness=2", *BASE, "train.save_every=1"
    )
    loop.train(config, run_dir=tmp_path / "full", progress=False, log=_quiet)
    _killed_after(config, tmp_path / "killed", 3, monkeypatch)  # its last checkpoint: step 2
    with Checkpointer(tmp_path / "killed" / "checkpoints") as ckpt:
        batches = ckpt.read_meta(2)[A.BUFFER_META]["batches"]
    assert [(b["step"], b["version"]) for b in batches] == [(3, 0), (4, 1)]
    loop.train(config, run_dir=tmp_path / "killed", progress=False, log=_quiet)
    _assert_same(_final_state(config, tmp_path / "full"), _final_state(config, tmp_path / "killed"))
    full, killed = M.read_metrics(tmp_path / "full"), M.read_metrics(tmp_path / "killed")
    assert [r["step"] for r in killed] == [1, 2, 3, 4]
    for a, b in zip(full, killed, strict=True):
        for k in SAME_AFTER_RESUME:
            assert a[k] == b[k], (k, a["step"])
    # completions.jsonl: step 3's lines of the killed life dropped on resume, and the batches
    # restored from the checkpoint's buffer logged when trained, under their own steps
    logged = [json.loads(x) for x in (tmp_path / "killed" / "completions.jsonl").open()]
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    assert (tmp_path / "killed" / "completions.jsonl").read_text() == (
        tmp_path / "full" / "completions.jsonl"
    ).read_text()


def test_resuming_with_a_smaller_max_staleness_is_a_clear_error(tmp_path, monkeypatch):
    config = H.config(
        "tiny.yaml", "train.max_steps=3", "train.max_staleness=2", *BASE, "train.save_every=1"
    )
    _killed_after(config, tmp_path / "run", 2, monkeypatch)  # step 1 holds batches 2 and 3
    smaller = H.config("tiny.yaml", "train.max_steps=3", "train.max_staleness=1", *BASE)
    from jaxrl_llm.train.rundir import RunDirError

    with pytest.raises(RunDirError, match=r"train.max_staleness=2"):
        loop.train(smaller, run_dir=tmp_path / "run", progress=False, log=_quiet)


# ---------------------------------------------------------------------------------------------
# Partial rollouts: a batch sampled over its windows, each token tagged with its version.

PARTIAL = ["train.max_staleness=2", "train.partial_rollout_tokens=3", "rollout.max_new_tokens=8"]


def test_partial_rollouts_continue_under_newer_weights_and_resume_exactly(tmp_path, monkeypatch):
    config = H.config("tiny.yaml", "train.max_steps=4", *PARTIAL, *BASE, "train.save_every=1")
    loop.train(config, run_dir=tmp_path / "full", progress=False, log=_quiet)
    full = M.read_metrics(tmp_path / "full")
    # batch 3: its first 3 tokens in window 1 (version 0), the rest in window 2 (version 1);
    # trained by version 2, so its tokens are 2 and 1 versions old
    third = full[2]
    assert third["async/staleness_frac_2"] > 0 and third["async/staleness_frac_1"] > 0
    assert third["async/staleness_frac_0"] == 0
    assert third["async/staleness_frac_1"] + third["async/staleness_frac_2"] == pytest.approx(1)
    assert third["async/behaviour_version"] == 0 and third["async/segments"] == 2
    # the paged engine's KV metrics over the batch's segments (one dispatch or more each)
    assert third["rollout/decode_dispatches"] >= 2 and third["rollout/preemptions"] == 0
    assert 0 < third["rollout/kv_peak_gib"] < third["rollout/kv_pool_gib"]

    _killed_after(config, tmp_path / "killed", 3, monkeypatch)  # the checkpoint of step 2
    with Checkpointer(tmp_path / "killed" / "checkpoints") as ckpt:
        batches = ckpt.read_meta(2)[A.BUFFER_META]["batches"]
    assert [(b["step"], bool(b.get("in_flight"))) for b in batches] == [(3, False), (4, True)]
    loop.train(config, run_dir=tmp_path / "killed", progress=False, log=_quiet)
    _assert_same(_final_state(config, tmp_path / "full"), _final_state(config, tmp_path / "killed"))
    for a, b in zip(full, M.read_metrics(tmp_path / "killed"), strict=True):
        for k in SAME_AFTER_RESUME:
            assert a[k] == b[k], (k, a["step"])


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["train.max_staleness=1", "train.partial_rollout_tokens=3"], "max_staleness >= 2"),
        (["train.max_staleness=2", "train.partial_rollout_tokens=8"], "fewer than"),
        (
            ["train.max_staleness=2", "train.partial_rollout_tokens=3", "algorithm.name=dapo"],
            "refills groups",
        ),
    ],
)
def test_partial_rollout_settings_that_cannot_work_are_clear_errors(overrides, match):
    from jaxrl_llm.config import ConfigError

    with pytest.raises(ConfigError, match=match):
        H.config("tiny.yaml", *overrides)


def test_partial_rollouts_across_processes_run_the_paged_engine():
    """Several processes: ``rollout.engine: static`` is refused, ``auto`` resolves to paged
    for the trainer and for ``jaxrl-llm plan`` (in one process, ``auto`` without stop ids is
    the static engine)."""
    from jaxrl_llm.config import ConfigError, check_devices
    from jaxrl_llm.train import plan

    no_stop = [*PARTIAL, "rollout.stop_token_ids=[]"]
    config = H.config("tiny.yaml", *no_stop)
    assert config.rollout.engine == "auto"
    assert setup.rollout_engine(config, can_stop_early=False, processes=1) == "static"
    assert setup.rollout_engine(config, can_stop_early=False, processes=2) == "paged"
    assert plan.rollout_engine(config) == "static" and plan.rollout_engine(config, 2) == "paged"
    static = H.config("tiny.yaml", *no_stop, "rollout.engine=static")
    check_devices(static, 8, process_count=1)
    with pytest.raises(ConfigError, match=r"rollout\.engine = static in a run of 2 processes"):
        check_devices(static, 8, process_count=2)


# ---------------------------------------------------------------------------------------------
# Split placement: 4 rollout + 4 train of the suite's 8 fake devices (the colocated run's mesh
# must divide 8 too), both meshes data-parallel.

SPLIT = ["mesh.data=4", "rollout.prompts_per_step=4"]


SPLIT_ON = ["placement.mode=split", "placement.rollout_fraction=0.5"]


def test_split_placement_at_staleness_zero_equals_colocated(tmp_path, monkeypatch):
    colocated = H.config("tiny.yaml", "train.max_steps=2", *SPLIT, *BASE)
    split = H.config("tiny.yaml", "train.max_steps=2", *SPLIT, *BASE, *SPLIT_ON)
    loop.train(colocated, run_dir=tmp_path / "colocated", progress=False, log=_quiet)
    loop.train(split, run_dir=tmp_path / "split", progress=False, log=_quiet)
    a = jax.device_get(_final_state(colocated, tmp_path / "colocated"))
    b = jax.device_get(_final_state(split, tmp_path / "split"))
    assert H.tree_max_diff(a.params, b.params) <= 1e-6
    fresh = jax.device_get(setup.resolve(colocated).state.params)
    assert H.tree_max_diff(a.params, fresh) > 1e-4  # it trained
    ra, rb = M.read_metrics(tmp_path / "colocated"), M.read_metrics(tmp_path / "split")
    for x, y in zip(ra, rb, strict=True):
        assert x["reward/mean"] == y["reward/mean"]  # the same completions, sampled elsewhere
        assert x["actor/loss"] == pytest.approx(y["actor/loss"], rel=1e-5, abs=1e-7)
    n_bytes = sum(np.asarray(x).nbytes for x in jax.tree.leaves(a.params))
    assert [r["sync/version"] for r in rb] == [1.0, 2.0]
    assert all(r["sync/bytes"] == n_bytes and r["sync/seconds"] > 0 for r in rb)
    assert all(r["async/staleness_max"] == 0 for r in rb)
    # The rollout devices regrouped into 2 two-device paged engines (rollout.tensor_parallel):
    # the same completions, the same update.
    from jaxrl_llm.rollout import paged_dp

    regrouped, real = [], paged_dp.regroup
    monkeypatch.setattr(paged_dp, "regroup", lambda *a: regrouped.append(a[1]) or real(*a))
    tp = H.config(
        "tiny.yaml", "train.max_steps=2", *SPLIT, *BASE, *SPLIT_ON, "rollout.tensor_parallel=2"
    )
    loop.train(tp, run_dir=tmp_path / "tp", progress=False, log=_quiet)
    assert len(regrouped) == 2 and all(m.size == 4 for m in regrouped)  # the rollout mesh
    c = jax.device_get(_final_state(tp, tmp_path / "tp"))
    assert H.tree_max_diff(a.params, c.params) <= 1e-6
    rc = M.read_metrics(tmp_path / "tp")
    assert [x["reward/mean"] for x in ra] == [z["reward/mean"] for z in rc]


# ---------------------------------------------------------------------------------------------
# Two processes (2 CPU devices each: 1 rollout + 1 train per process), async at staleness 1.

# One and two processes' updates differ in the last bits (the gradient all-reduce adds partial
# sums in another order; see test_multiprocess), and Adam's 1/√v can blow such a difference of
# a near-zero gradient up to a visible fraction of lr. The random model's next-token
# distribution is nearly uniform over 49152 ids, so a changed weight then moves some sampled ids
# across a bin edge of the inverse CDF and the runs part (seen here). SGD keeps the difference
# in the last bits and top_k 20 makes the bins wide, so the two runs sample the same tokens; the
# per-step gradient norms below catch a wrong share of prompts or rows.
MP_CONFIG = """\
base: {tiny}
rollout:
  prompts_per_step: 4
  top_k: 20
optim:
  optimizer: sgd
  lr: 10.0   # gradient norms are ~6e-4 here: updates well above float32's rounding of weights
rewards:
  terms:
    - type: regex
      weight: 1.0
      kwargs: {{pattern: ".{{0,52}}", mode: fullmatch}}
data:
  eval_size: 0
mesh:
  data: 2
placement:
  mode: split
  rollout_fraction: 0.5
  rollout_mesh: {{data: 2}}
train:
  max_steps: 3
  max_staleness: {staleness}
  partial_rollout_tokens: {partial}
  save_every: 1
"""


@pytest.mark.slow
@pytest.mark.parametrize("staleness, partial", [(0, 0), (1, 0), (2, 3)], ids=["0", "1", "2p"])
def test_two_processes_split_train_like_one(tmp_path, staleness, partial):
    """Staleness 0: like one colocated process; staleness 1: like one split process (4 + 4 of
    this process's devices, the same train and rollout mesh shapes); staleness 2 with partial
    rollouts of 3-token segments: each process samples its share of every segment, the run is
    stopped by SIGTERM to process 0 during update 1 (both stop after step 1, whose checkpoint
    holds batch 3 in flight) and relaunched; that second life is killed with SIGKILL, both
    processes, as step 2's checkpoint is being written (a lost node or a preempted slice:
    nothing is saved, a half-written checkpoint may be left), and relaunched again; the run
    ends as the uninterrupted one-process run (the batches, their versions, the updates)."""
    import signal
    import subprocess
    import sys
    import time

    from jaxrl_llm.config import load_config
    from jaxrl_llm.train.faults import PHASE_LOG_ENV
    from tests.train import test_multiprocess as MP

    config_path = tmp_path / "async.yaml"
    tiny = MP.REPO / "configs" / "tiny.yaml"
    config_path.write_text(MP_CONFIG.format(tiny=tiny, staleness=staleness, partial=partial))
    env = MP._child_env(2)  # the suite's XLA flags, two devices each
    children = []
    t0 = time.monotonic()

    def launch(life: int) -> list:
        nonlocal t0
        t0 = time.monotonic()  # the waits' limits count from the life's launch
        phases = tmp_path / f"phases0.{life}.log"  # process 0's phases
        port = MP._free_port()
        logs = [tmp_path / f"process{i}.{life}.log" for i in range(2)]
        for i, log in enumerate(logs):
            # jaxrl_llm.cli, refusing multihost_utils.process_allgather (tests/train/
            # multiprocess_cli.py: its all-gather is not waited for on every device; gloo aborts)
            cmd = [sys.executable, "-m", "tests.train.multiprocess_cli", "train"]
            cmd += ["--config", str(config_path)]
            cmd += ["--run-dir", str(tmp_path / "two"), "--no-progress"]
            cmd += ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
            cmd += ["--process-id", str(i)]
            watched = {PHASE_LOG_ENV: str(phases)} if partial and life < 2 and i == 0 else {}
            with log.open("w") as out:
                children.append(
                    subprocess.Popen(
                        cmd,
                        cwd=MP.REPO,
                        env={**env, **watched},
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    )
                )
        return logs

    def wait_for(life: int, mark: str, logs: list) -> None:
        phases = tmp_path / f"phases0.{life}.log"
        while mark not in (phases.read_text() if phases.exists() else ""):
            assert children[0].poll() is None, MP._tail(logs[0])
            assert time.monotonic() - t0 < MP.TIMEOUT_S, MP._tail(logs[0])
            time.sleep(0.05)

    try:
        logs = launch(0)
        if partial:  # SIGTERM to process 0 once update 1 is dispatched
            wait_for(0, "update 1 ", logs)
            children[0].send_signal(signal.SIGTERM)
            codes = [child.wait(timeout=MP.TIMEOUT_S) for child in children]
            assert codes == [143, 143], (codes, MP._tail(logs[0]), MP._tail(logs[1]))
            with Checkpointer(tmp_path / "two" / "checkpoints") as ckpt:
                assert ckpt.latest_step() == 1
                batches = ckpt.read_meta(1)[A.BUFFER_META]["batches"]
            assert [(b["step"], bool(b.get("in_flight"))) for b in batches] == [
                (2, False),
                (3, True),
            ]
            children.clear()
            logs = launch(1)
            # SIGKILL to both once step 2's checkpoint write has begun (it runs in the
            # background): the relaunch resumes from step 1 or, if the write was done, step 2
            wait_for(1, "save 2 ", logs)
            for child in children:
                child.kill()
            assert [child.wait(timeout=60) for child in children] == [-9, -9]
            with Checkpointer(tmp_path / "two" / "checkpoints") as ckpt:
                assert ckpt.latest_step() in (1, 2), ckpt.all_steps()
            children.clear()
            logs = launch(2)
        # the one-process reference meanwhile
        config = load_config(config_path, [] if staleness else ["placement.mode=colocated"])
        loop.train(config, run_dir=tmp_path / "one", progress=False, log=_quiet)
        MP._wait(children, logs, t0, "async two-process run")
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait(timeout=30)
    # the updates of the two runs agree to 1e-3 of their size (a wrong share of prompts or rows
    # changes them by their own size)
    start = jax.device_get(setup.resolve(config).state.params)
    one, two = (
        jax.device_get(_final_state(config, tmp_path / name).params) for name in ("one", "two")
    )
    d_one = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - b, one, start)
    d_two = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - b, two, start)
    norm = np.sqrt(sum(np.sum(x**2) for x in jax.tree.leaves(d_one)))
    pairs = zip(jax.tree.leaves(d_one), jax.tree.leaves(d_two), strict=True)
    gap = np.sqrt(sum(np.sum((x - y) ** 2) for x, y in pairs))
    assert norm > 0 and gap <= 1e-3 * norm, (gap, norm)
    records = M.read_metrics(tmp_path / "two")
    if partial:  # batch 3: its first segment under version 0, the rest under version 1
        assert [r["async/staleness_max"] for r in records] == [0.0, 1.0, 2.0]
        assert records[2]["async/segments"] == 2 and records[2]["async/staleness_frac_1"] > 0
    else:
        assert [r["async/staleness_max"] for r in records] == [0.0, staleness, staleness]
    assert all(r["sync/seconds"] > 0 for r in records)
    assert any(r["reward/std"] > 0 for r in records), "no reward signal: the test is vacuous"
    for a, b in zip(M.read_metrics(tmp_path / "one"), records, strict=True):
        assert b["reward/mean"] == pytest.approx(a["reward/mean"], abs=1e-6)
        assert b["actor/grad_norm"] == pytest.approx(a["actor/grad_norm"], rel=1e-3)
        # (the colocated reference of staleness 0 has no async metrics)
        same = ("async/staleness_mean", "async/segments", "response_length/mean")
        assert [a.get(k) for k in same if k in a] == [b.get(k) for k in same if k in a]


# ---------------------------------------------------------------------------------------------
# kill -9 at random moments of an async run with partial rollouts, then resume: bit-identical
# to the uninterrupted async run (test_faults' harness: forked lives, one XLA cache).

ASYNC_KILLS = 6
ASYNC_RUN = ("train.max_staleness=2", "train.partial_rollout_tokens=3")


@pytest.mark.slow
def test_kill_9_during_an_async_run_then_resume_ends_with_the_same_state(tmp_path):
    import random
    import signal

    from tests.train import test_faults as F

    lives = F._Lives(tmp_path)
    full = lives.start(tmp_path / "uninterrupted", ASYNC_RUN)
    full.join(300)
    assert full.exitcode == 0, lives.output.read_text()[-3000:]
    config = H.config("tiny.yaml", "data.eval_size=0", *F.VARIED, *ASYNC_RUN)
    template = setup.resolve(config).state

    rng = random.Random(16)
    phases = (["rollout", "update", "save"] * ASYNC_KILLS)[:ASYNC_KILLS]
    rng.shuffle(phases)
    run_dir, history = tmp_path / "killed", []
    for phase in phases:
        process = lives.start(run_dir, ASYNC_RUN)
        start = lives.wait_for("start")
        target = min(start + 1 + rng.randint(0, 2), F.MAX_STEPS)
        if target == F.MAX_STEPS:
            phase = "rollout"
        delay = rng.uniform(0.0, F.DELAY[phase])
        lives.wait_for(phase, target)
        time.sleep(delay)
        process.kill()
        process.join(60)
        assert process.exitcode == -signal.SIGKILL, process.exitcode
        process.close()
        steps, _ = F._check_on_disk(run_dir / "checkpoints", template)
        history.append((start, phase, target, round(delay, 3), steps))
    lives.start(run_dir, ASYNC_RUN).join(300)
    assert lives.process.exitcode == 0, lives.output.read_text()[-3000:]
    print("\nkills (resumed at, phase, step, delay, steps on disk):", *history, sep="\n")
    assert len({h[0] for h in history}) > 1, history  # the lives resumed from several steps
    states = []
    for name in ("uninterrupted", "killed"):
        with Checkpointer(tmp_path / name / "checkpoints") as ckpt:
            states.append(ckpt.restore(template)[0])
    assert int(states[0].step) == F.MAX_STEPS
    _assert_same(*states)
    a, b = M.read_metrics(tmp_path / "uninterrupted"), M.read_metrics(tmp_path / "killed")
    assert [r["step"] for r in b] == list(range(1, F.MAX_STEPS + 1))
    for x, y in zip(a, b, strict=True):
        for k in ("actor/loss", "reward/mean", "async/staleness_mean", "async/segments"):
            assert x[k] == y[k], (k, x["step"])
