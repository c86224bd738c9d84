"""scripts/fuzz_rollout.py, the engines' randomised differential checks: one drawn case passes
every check (``mp``: in two processes the script launches), a wrong token is reported with its
seed and check, bad arguments are clear errors. (The campaign itself, hundreds of seeds, is
run by hand: docs/rollout.md.)"""

import json
import sys

import numpy as np
import pytest

from tests.scripts import SCRIPTS, load_script

sys.path.insert(0, str(SCRIPTS))  # the script imports scripts/_bench_common.py, as the benches do
try:
    fuzz = load_script("fuzz_rollout")
finally:
    sys.path.remove(str(SCRIPTS))
SEED = 157  # 4 prompts × G=3 (two pairs share pages), page 8, a tight pool: ~3 s a check


def test_one_case_passes_every_check(tmp_path):
    out = tmp_path / "fuzz.json"
    checks = ",".join(fuzz.CHECKS)
    summary = fuzz.main(["--seeds", str(SEED), "--checks", checks, "--out", str(out)])
    assert summary["cases"] == len(fuzz.CHECKS) and summary["failures"] == []
    assert json.loads(out.read_text())["cases"] == len(fuzz.CHECKS)


def test_draws_are_seeded_and_cover_the_options():
    a, b = fuzz.draw(SEED, "engines"), fuzz.draw(SEED, "engines")
    np.testing.assert_array_equal(a.ids, b.ids)
    assert a.describe() == b.describe()
    cases = [fuzz.draw(s, "engines") for s in range(200)]
    assert {c.family for c in cases} == set(fuzz.FAMILIES)
    assert {c.draws["pool"] for c in cases} == {"default", "tight", "roomy"}
    assert {c.options.prefix_sharing for c in cases} == {True, False}
    assert {c.options.work_stealing for c in cases} == {True, False}
    assert {c.kwargs["temperature"] for c in cases} == {0.0, 0.7, 1.0}
    # The kernel check draws only families the Pallas GPU kernel serves.
    assert {fuzz.draw(s, "kernel").family for s in range(50)} == set(fuzz.KERNEL_FAMILIES)
    # The mp check draws every two-process layout, and segments from 1 to past T.
    cases = [fuzz.draw(s, "mp") for s in range(100)]
    mp = [fuzz.mp_draws(c) for c in cases]
    layouts = {(tuple(sorted(sizes.items())), tp) for sizes, tp, _ in mp}
    assert layouts == {(tuple(sorted(sizes.items())), tp) for sizes, tp in fuzz.MP_LAYOUTS}
    segments = [(seg, c.kwargs["max_new_tokens"]) for (_, _, seg), c in zip(mp, cases, strict=True)]
    assert any(seg == 1 < t for seg, t in segments) and any(seg > t for seg, t in segments)


def test_pressure_pools_are_the_smallest_the_engine_accepts():
    """``--pressure``: the case is the seed's usual one but for the pool (at least the engine's
    least, which the engine accepts and one page less it refuses), the slots and prefix
    sharing."""
    import dataclasses

    for seed in range(6):
        usual, tight = fuzz.draw(seed, "engines"), fuzz.draw(seed, "engines", pressure=True)
        np.testing.assert_array_equal(usual.ids, tight.ids)
        assert {k: v for k, v in usual.draws.items() if k not in ("pool", "options")} == {
            k: v for k, v in tight.draws.items() if k not in ("pool", "options")
        }
        d = tight.draws
        least = fuzz.least_pages(
            d["prompt_lengths"],
            d["num_samples"],
            d["max_new_tokens"],
            tight.kwargs["max_new_tokens_bg"],
            tight.options.page_size,
        )
        assert least <= tight.options.num_pages < least + max(2, least // 3)
        assert tight.options.prefix_sharing and d["pool"] == "pressure"
        assert tight.options.num_slots >= d["num_samples"]
        model = fuzz.tiny_model(tight.family)
        smaller = dataclasses.replace(tight.options, num_pages=least - 1)
        with pytest.raises(ValueError, match="num_pages"):
            fuzz.paged_run(model, tight, smaller)
    # The least pool runs (the last seed's case; the campaign checks the tokens).
    _, stats = fuzz.paged_run(model, tight, dataclasses.replace(tight.options, num_pages=least))
    assert stats.pool_pages == least and stats.pages_in_use_at_end == 0


def test_a_wrong_token_is_a_failure_with_its_seed(monkeypatch, capsys):
    real = fuzz.paged_run

    def one_token_off(model, case, options):
        out, stats = real(model, case, options)
        if options is not case.options:
            return out, stats
        tokens = np.asarray(out.tokens).copy()
        tokens[0, 0, 0] = (tokens[0, 0, 0] + 1) % fuzz.VOCAB
        return out._replace(tokens=tokens), stats

    monkeypatch.setattr(fuzz, "paged_run", one_token_off)
    summary = fuzz.main(["--seeds", str(SEED), "--checks", "engines"])
    (failure,) = summary["failures"]
    assert failure["seed"] == SEED and failure["check"] == "engines"
    assert failure["error"].startswith("AssertionError: tokens differ from")
    assert failure["case"]["options"]["page_size"] == fuzz.draw(SEED, "engines").options.page_size
    assert f"FAIL seed {SEED} engines" in capsys.readouterr().out


def test_bad_arguments_are_clear_errors():
    assert fuzz.parse_seeds("3,5:7") == [3, 5, 6]
    with pytest.raises(SystemExit, match="'x' is not a seed"):
        fuzz.main(["--seeds", "x"])
    with pytest.raises(SystemExit, match=r"unknown \['speed'\]"):
        fuzz.main(["--checks", "engines,speed"])


def test_pressure_reaches_the_mp_check_s_processes(monkeypatch):
    """``--pressure --checks mp``: both processes draw the pressured case (a stand-in for the
    processes records their commands and ends at once; the campaign then reports them)."""
    import subprocess

    launched = []

    class Ended:
        def __init__(self, cmd, **kwargs):
            launched.append(cmd)

        def poll(self):
            return 1

        def wait(self, timeout=None):
            return 1

    monkeypatch.setattr(subprocess, "Popen", Ended)
    (seed, _, error), *rest = list(fuzz.mp_campaign([SEED], pressure=True))
    assert seed == SEED and "processes ended [1, 1]" in error and rest == []
    assert [("--pressure" in cmd) for cmd in launched] == [True, True]
    assert [cmd[cmd.index("--mp-child") + 2] for cmd in launched] == ["0", "1"]
