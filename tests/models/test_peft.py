"""PEFT adapter folders: our export loads in peft with our logits, peft's loads in ours, errors."""

import json
import shutil

import jax
import numpy as np
import pytest
import safetensors.numpy as safetensors_numpy
import torch
import transformers
from flax import nnx

from jaxrl_llm import models
from jaxrl_llm.models import lora, sharding
from jaxrl_llm.models import peft as adapters
from tests.models import hf_tiny

peft = pytest.importorskip("peft")

VOCAB = 96
TOL = 1e-4
CONFIG = models.tiny_random_config(vocab_size=VOCAB)
L = CONFIG.num_layers


def base_model():
    """The same random base every call (a fresh copy to adapt)."""
    return models.CausalLM(CONFIG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return models.save_pretrained(base_model(), tmp_path_factory.mktemp("base"))


def randomize(model, seed):
    """Non-zero A and B (B = 0 at init would make any comparison vacuous)."""
    rng = np.random.RandomState(seed)
    for _, var in nnx.iter_graph(model):
        if isinstance(var, nnx.LoRAParam):
            var[...] = rng.normal(0.0, 0.2, var[...].shape).astype(np.float32)
    return model


def adapted(config, seed=1):
    return randomize(lora.apply_lora(base_model(), config, rngs=nnx.Rngs(seed)), seed)


@nnx.jit
def forward(model, tokens_bt, mask_bt):
    return model(tokens_bt, mask_bt)


def batch():
    tokens, mask = hf_tiny.left_padded_batch(np.random.RandomState(0), [9, 4], 9, VOCAB)
    return tokens, mask, hf_tiny.positions_from_mask(mask)


def hf_base(base_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(
        base_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def assert_logits_equal(ours, hf):
    tokens, mask, positions = batch()
    got = np.asarray(forward(ours, tokens, mask))
    want = hf_tiny.hf_logits(hf, tokens, mask, positions)
    np.testing.assert_allclose(got[mask], want[mask], atol=TOL, rtol=0)
    return got[mask]


@pytest.mark.parametrize(
    "config",
    [
        lora.LoRAConfig(rank=4, alpha=8.0),
        lora.LoRAConfig(
            rank=3, alpha=5.0, targets=("v_proj", "o_proj", "up_proj"), use_rslora=True
        ),
    ],
    ids=["all-targets", "subset-rslora"],
)
def test_our_adapter_in_peft_gives_our_logits(config, base_dir, tmp_path):
    ours = adapted(config)
    folder = adapters.save_adapter(
        ours, tmp_path / "adapter", config=config, base_model_name_or_path=str(base_dir)
    )
    assert sorted(p.name for p in folder.iterdir()) == [adapters.CONFIG_FILE, adapters.WEIGHTS_FILE]
    saved = json.loads((folder / adapters.CONFIG_FILE).read_text())
    assert saved["base_model_name_or_path"] == str(base_dir)
    assert saved["task_type"] == "CAUSAL_LM" and saved["peft_type"] == "LORA"
    hf = hf_base(base_dir)
    plain = hf_tiny.hf_logits(hf, *batch())  # before peft adapts hf in place
    peft_model = peft.PeftModel.from_pretrained(hf, folder).eval()
    assert peft_model.peft_config["default"].r == config.rank
    got = assert_logits_equal(ours, peft_model)
    # The adapters matter: the base alone is far from the adapted model.
    assert np.abs(got - plain[batch()[1]]).max() > 100 * TOL
    # And merging them into our base gives the same function (what RUN_DIR/export holds).
    merged = lora.merge_into_base(ours)
    np.testing.assert_allclose(
        np.asarray(forward(merged, *batch()[0:2]))[batch()[1]], got, atol=TOL
    )


def test_peft_written_adapter_gives_peft_logits_in_ours(base_dir, tmp_path):
    targets = ["q_proj", "k_proj", "down_proj", "gate_proj"]
    torch.manual_seed(0)
    peft_model = peft.get_peft_model(
        hf_base(base_dir),
        peft.LoraConfig(r=4, lora_alpha=16, target_modules=targets, init_lora_weights=False),
    ).eval()
    peft_model.save_pretrained(tmp_path / "peft")
    ours = adapters.apply_adapter(base_model(), tmp_path / "peft")
    assert set(ours.model.layers.self_attn.k_proj.lora_a[...].shape) == {L, 64, 4}
    assert ours.model.layers.self_attn.v_proj.lora_a is None
    assert_logits_equal(ours, peft_model)
    config, _ = adapters.load_adapter(tmp_path / "peft", CONFIG)
    # peft writes target_modules in a set's order
    assert config == lora.LoRAConfig(rank=4, alpha=16.0, targets=config.targets)
    assert sorted(config.targets) == sorted(targets)


def test_load_of_save_is_exact_and_has_split_structure(tmp_path):
    config = lora.LoRAConfig(rank=2, alpha=3.5, targets=("o_proj", "q_proj", "down_proj"))
    ours = adapted(config, seed=4)
    folder = adapters.save_adapter(ours, tmp_path / "a", config=config, base_model_name_or_path="b")
    want = lora.split(ours)[2]
    for like in (CONFIG, ours, base_model()):
        got_config, got = adapters.load_adapter(folder, like)
        assert got_config == config
        assert jax.tree.structure(got) == jax.tree.structure(want)
        jax.tree.map(np.testing.assert_array_equal, got, want)
    # Saving again over the adapter replaces it.
    randomize(ours, seed=5)
    adapters.save_adapter(ours, folder, config=config, base_model_name_or_path="b")
    jax.tree.map(
        np.testing.assert_array_equal, adapters.load_adapter(folder, CONFIG)[1], lora.split(ours)[2]
    )


def test_value_model_adapter_in_peft_and_back(tmp_path):
    """A critic's adapter: PEFT on the exported AutoModelForSequenceClassification gives our
    last-token value; importing it into a fresh critic gives the same values."""
    config = lora.LoRAConfig(rank=2, alpha=4.0, targets=("q_proj", "up_proj"))
    critic = models.ValueModel(CONFIG, rngs=nnx.Rngs(0))
    base_dir = models.save_pretrained(critic, tmp_path / "base")
    randomize(lora.apply_lora(critic, config, rngs=nnx.Rngs(1)), 2)
    folder = adapters.save_adapter(
        critic, tmp_path / "a", config=config, base_model_name_or_path=str(base_dir)
    )
    assert json.loads((folder / adapters.CONFIG_FILE).read_text())["task_type"] is None
    tokens = np.random.RandomState(0).randint(3, VOCAB, (2, 7)).astype(np.int32)
    values_bt = np.asarray(nnx.jit(lambda m, x: m(x))(critic, tokens))
    hf = transformers.AutoModelForSequenceClassification.from_pretrained(
        base_dir, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        plain = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()[:, 0]
        peft_model = peft.PeftModel.from_pretrained(hf, folder).eval()
        want = peft_model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()[:, 0]
    np.testing.assert_allclose(values_bt[:, -1], want, atol=TOL, rtol=0)
    assert np.abs(want - plain).max() > 10 * TOL
    fresh = adapters.apply_adapter(models.ValueModel(CONFIG, rngs=nnx.Rngs(0)), folder)
    np.testing.assert_array_equal(np.asarray(nnx.jit(lambda m, x: m(x))(fresh, tokens)), values_bt)


def test_sharded_model_takes_and_gives_the_same_adapter(good, tmp_path):
    mesh, rules = sharding.preset("fsdp_tp")  # 8 fake CPU devices (tests/conftest.py)
    config, want = adapters.load_adapter(good, CONFIG)
    model = adapters.apply_adapter(sharding.shard_model(base_model(), mesh, rules), good)
    fresh = lora.apply_lora(
        sharding.shard_model(base_model(), mesh, rules), config, rngs=nnx.Rngs(0)
    )
    placed = jax.tree.map(lambda x: x.sharding, lora.split(model)[2])
    assert placed == jax.tree.map(lambda x: x.sharding, lora.split(fresh)[2])
    assert any(not s.is_fully_replicated for s in jax.tree.leaves(placed))
    jax.tree.map(np.testing.assert_array_equal, lora.split(model)[2], want)
    again = adapters.save_adapter(model, tmp_path / "a", config=config, base_model_name_or_path="b")
    jax.tree.map(np.testing.assert_array_equal, adapters.load_adapter(again, CONFIG)[1], want)


# ---------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A valid adapter (q_proj and o_proj) to break in copies."""
    config = lora.LoRAConfig(rank=2, alpha=4.0, targets=("q_proj", "o_proj"))
    folder = tmp_path_factory.mktemp("good") / "adapter"
    return adapters.save_adapter(
        adapted(config), folder, config=config, base_model_name_or_path="b"
    )


def broken(good, tmp_path, *, fields=None, tensors=None):
    """A copy of ``good`` with ``fields`` set in its config and its tensors mapped by
    ``tensors(dict) -> dict``."""
    folder = tmp_path / "broken"
    shutil.copytree(good, folder)
    if fields is not None:
        file = folder / adapters.CONFIG_FILE
        file.write_text(json.dumps({**json.loads(file.read_text()), **fields}))
    if tensors is not None:
        file = str(folder / adapters.WEIGHTS_FILE)
        safetensors_numpy.save_file(tensors(safetensors_numpy.load_file(file)), file)
    return folder


def key(layer, target, which):
    return adapters.peft_key(layer, target, which)


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"peft_type": "PREFIX_TUNING"}, "peft_type is 'PREFIX_TUNING'; only 'LORA'"),
        ({"bias": "lora_only"}, "bias is 'lora_only'; only 'none'"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save .* not supported"),
        ({"layers_to_transform": [0]}, "layers_to_transform .* adapters on only some layers"),
        ({"rank_pattern": {"q_proj": 4}}, "rank_pattern .* not supported"),
        ({"alpha_pattern": {"q_proj": 4}}, "alpha_pattern .* not supported"),
        ({"use_dora": True}, "use_dora .* DoRA .* not supported"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "'embed_tokens' matches no projection"),
        ({"target_modules": r"model\.layers\.0\..*_proj"}, "different projections in different"),
        ({"target_modules": []}, "expected a non-empty list"),
        ({"r": 0}, "r is 0; expected an integer >= 1"),
        ({"init_lora_weights": "pissa"}, "residual"),
        # Tensors for a projection the config does not list.
        ({"target_modules": ["q_proj"]}, "adapts self_attn.o_proj, which target_modules"),
        # A rank that the tensors do not have.
        ({"r": 3}, r"has shape \(2, 64\); expected \(3, 64\)"),
    ],
)
def test_bad_adapter_config_is_a_clear_error(good, tmp_path, fields, match):
    folder = broken(good, tmp_path, fields=fields)
    with pytest.raises(adapters.AdapterError, match=match) as info:
        adapters.load_adapter(folder, CONFIG)
    assert str(folder) in str(info.value)


def _reshape(name, shape):
    def edit(t):
        return {**t, name: np.zeros(shape, np.float32)}

    return edit


@pytest.mark.parametrize(
    "tensors, match",
    [
        (
            _reshape(key(1, "o_proj", "B"), (64, 3)),
            r"'base_model.model.model.layers.1.self_attn.o_proj.lora_B.weight' has shape "
            r"\(64, 3\); expected \(64, 2\)",
        ),
        (_reshape(key(2, "q_proj", "A"), (2, 64)), "is for layer 2; the model has 2 layers"),
        (
            lambda t: {k: v for k, v in t.items() if ".layers.1." not in k},
            r"no '.*layers\.1\.self_attn\.q_proj\.lora_A\.weight' .* missing for layers \[1\]",
        ),
        (_reshape("base_model.model.lm_head.lora_A.weight", (2, 64)), "unexpected tensor"),
    ],
    ids=["wrong-shape", "layer-beyond-L", "missing-layer", "other-module"],
)
def test_bad_adapter_tensors_are_a_clear_error(good, tmp_path, tensors, match):
    folder = broken(good, tmp_path, tensors=tensors)
    with pytest.raises(adapters.AdapterError, match=match):
        adapters.load_adapter(folder, CONFIG)


def test_missing_files_and_pickles(good, tmp_path):
    with pytest.raises(adapters.AdapterError, match="no such folder"):
        adapters.load_adapter(tmp_path / "nowhere", CONFIG)
    folder = broken(good, tmp_path)
    (folder / adapters.CONFIG_FILE).unlink()
    with pytest.raises(adapters.AdapterError, match=r"has no adapter_config\.json"):
        adapters.load_adapter(folder, CONFIG)
    shutil.rmtree(folder)
    folder = broken(good, tmp_path)
    want = adapters.load_adapter(folder, CONFIG)
    tensors = safetensors_numpy.load_file(str(folder / adapters.WEIGHTS_FILE))
    (folder / adapters.WEIGHTS_FILE).unlink()
    with pytest.raises(adapters.AdapterError, match=r"but no adapter_model\.safetensors"):
        adapters.load_adapter(folder, CONFIG)
    torch.save({k: torch.from_numpy(v) for k, v in tensors.items()}, folder / "adapter_model.bin")
    with pytest.raises(models.UnsafeCheckpointError, match=r"pickle.*allow_pickle=True"):
        adapters.load_adapter(folder, CONFIG)
    got = adapters.load_adapter(folder, CONFIG, allow_pickle=True)
    assert got[0] == want[0]
    jax.tree.map(np.testing.assert_array_equal, got[1], want[1])


def test_save_refuses_mismatched_config_and_foreign_folders(good, tmp_path):
    config = lora.LoRAConfig(rank=2, alpha=4.0, targets=("q_proj", "o_proj"))
    model = adapted(config)
    for wrong, match in [
        (lora.LoRAConfig(rank=2, alpha=4.0, targets=("q_proj",)), "o_proj has LoRA adapters"),
        (lora.LoRAConfig(rank=2, alpha=4.0, targets=("q_proj", "o_proj", "v_proj")), "v_proj"),
        (lora.LoRAConfig(rank=2, alpha=8.0, targets=("q_proj", "o_proj")), "scale"),
    ]:
        with pytest.raises(adapters.AdapterError, match=match):
            adapters.save_adapter(model, tmp_path / "a", config=wrong, base_model_name_or_path="b")
    assert not (tmp_path / "a").exists()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(adapters.AdapterError, match=r"notes\.txt"):
        adapters.save_adapter(model, foreign, config=config, base_model_name_or_path="b")
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["foreign"]  # no temporary left


def test_apply_adapter_checks_the_expected_config(good):
    config, want = adapters.load_adapter(good, CONFIG)
    model = adapters.apply_adapter(base_model(), good, expected=config)
    jax.tree.map(np.testing.assert_array_equal, lora.split(model)[2], want)
    same = lora.LoRAConfig(rank=2, alpha=4.0, targets=("o_proj", "q_proj"), dropout=0.1)
    adapters.apply_adapter(base_model(), good, expected=same)  # order and dropout do not matter
    wrong = lora.LoRAConfig(rank=4, alpha=4.0, targets=("q_proj", "v_proj"))
    model = base_model()
    with pytest.raises(
        adapters.AdapterError,
        match=r"rank \(r\): the folder has 2, expected 4; .*targets .*'o_proj', 'q_proj'\], "
        r"expected \['q_proj', 'v_proj'\]",
    ):
        adapters.apply_adapter(model, good, expected=wrong)
    assert not lora.has_lora(model)
