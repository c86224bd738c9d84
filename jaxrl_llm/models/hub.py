"""Load HF checkpoints into our models and write them back as folders ``transformers`` loads.

``from_pretrained`` reads the config through ``transformers`` (so old and new config formats
agree), builds the model abstractly (no memory), then streams the checkpoint tensor by tensor:
each tensor is memory-mapped, re-laid out and cast on the host, and placed straight into its
target sharding with ``jax.make_array_from_callback`` (each device receives only its shard). No
full-precision copy of the model is ever built on one host.

Sources: a local folder with ``model.safetensors`` or sharded safetensors plus
``model.safetensors.index.json``; PyTorch ``.bin`` pickles only with ``allow_pickle=True``
(unpickling can run code); and any single file ``transformers`` itself reads, GGUF included
(``transformers`` dequantises it to float32 with torch, so that path does hold the whole model
on the host once).
"""

from __future__ import annotations

import functools
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_llm.models import weights
from jaxrl_llm.models.config import (
    SUPPORTED_ARCHITECTURES,
    SUPPORTED_MODEL_TYPES,
    ModelConfig,
    UnsafeCheckpointError,
    UnsupportedModelError,
)
from jaxrl_llm.models.heads import RewardModel, ValueModel
from jaxrl_llm.models.sharding import DEFAULT_RULES, Rules, param_shardings
from jaxrl_llm.models.transformer import CausalLM

if TYPE_CHECKING:
    import transformers

log = logging.getLogger(__name__)

AnyModel = CausalLM | RewardModel | ValueModel
Reader = weights.SafetensorsReader | weights.DictReader
_HEADS = {"causal_lm": CausalLM, "reward": RewardModel, "value": ValueModel}


def default_dtype() -> jnp.dtype:
    """Compute dtype when none is given: bfloat16 on accelerators, float32 on CPU."""
    return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)


def _resolve(path: str | os.PathLike, gguf_file: str | None) -> tuple[Path, str | None]:
    """(folder, gguf file name or None) for a folder, a ``.gguf`` file or a folder of one."""
    p = Path(path).expanduser()
    if p.is_file():
        if p.suffix == ".gguf":
            return p.parent, p.name
        raise ValueError(f"{p} is a file; pass a checkpoint folder or a .gguf file")
    if not p.is_dir():
        raise FileNotFoundError(
            f"no checkpoint folder at {p} (this package loads local folders only; for the "
            "default model use jaxrl_llm.models.default_model_path())"
        )
    if gguf_file is None and not (p / "config.json").exists():
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            gguf_file = ggufs[0].name
    return p, gguf_file


def _read_hf_config(folder: Path, gguf_file: str | None) -> transformers.PretrainedConfig:
    from transformers import AutoConfig

    if gguf_file is None:
        cfg_path = folder / "config.json"
        if not cfg_path.exists():
            raise FileNotFoundError(f"{folder} has no config.json")
        raw = json.loads(cfg_path.read_text())
        if raw.get("model_type") not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"{folder}: architecture {raw.get('architectures')} (model_type "
                f"{raw.get('model_type')!r}) is not supported; supported architectures: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
    return AutoConfig.from_pretrained(str(folder), gguf_file=gguf_file, trust_remote_code=False)


def _weights_reader(folder: Path, gguf_file: str | None, allow_pickle: bool, head: str) -> Reader:
    if gguf_file is not None:
        return _gguf_reader(folder, gguf_file, head)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return weights.SafetensorsReader(folder / f for f in files)
    if (folder / "model.safetensors").exists():
        return weights.SafetensorsReader([folder / "model.safetensors"])
    st = sorted(folder.glob("*.safetensors"))
    if st:
        return weights.SafetensorsReader(st)
    bins = sorted(folder.glob("pytorch_model*.bin"))
    if bins:
        if not allow_pickle:
            raise UnsafeCheckpointError(
                f"{folder} holds only PyTorch pickle weights ({bins[0].name}); unpickling can "
                "run arbitrary code. Pass allow_pickle=True (in a training config: "
                "model.allow_pickle=true) if you trust this checkpoint, or convert it to "
                "safetensors."
            )
        import torch

        tensors: dict[str, Any] = {}
        for b in bins:
            tensors.update(torch.load(b, map_location="cpu", weights_only=True, mmap=True))
        return weights.DictReader(tensors)
    raise FileNotFoundError(f"{folder} has no model.safetensors, sharded safetensors or GGUF")


def _gguf_reader(folder: Path, gguf_file: str, head: str) -> weights.DictReader:
    """Dequantises a GGUF file with transformers (needs the ``gguf`` and ``torch`` packages)."""
    import transformers

    cls = (
        transformers.AutoModelForSequenceClassification
        if head == "reward"
        else transformers.AutoModelForCausalLM
    )
    torch_model = cls.from_pretrained(str(folder), gguf_file=gguf_file, trust_remote_code=False)
    return weights.DictReader(dict(torch_model.state_dict()))


def _flatten(tree: dict, prefix: tuple = ()) -> dict[tuple, Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, (*prefix, key)))
        else:
            flat[(*prefix, key)] = value
    return flat


def _unflatten(flat: dict[tuple, Any]) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def _place(value: np.ndarray, sharding: jax.sharding.Sharding | None) -> jax.Array:
    if sharding is None:
        return jax.device_put(value)
    return jax.make_array_from_callback(
        value.shape, sharding, lambda index: np.ascontiguousarray(value[index])
    )


def from_pretrained(
    path: str | os.PathLike,
    *,
    dtype: Any = None,
    param_dtype: Any = jnp.float32,
    mesh: jax.sharding.Mesh | None = None,
    rules: Rules = DEFAULT_RULES,
    head: str | None = None,
    remat: str = "none",
    allow_pickle: bool = False,
    gguf_file: str | None = None,
    seed: int = 0,
) -> AnyModel:
    """Loads an HF checkpoint as a :class:`CausalLM`, :class:`RewardModel` or :class:`ValueModel`.

    Args:
      path: a local checkpoint folder, a ``.gguf`` file, or a folder holding one GGUF file.
      dtype: compute dtype; default bfloat16 on accelerators, float32 on CPU.
      param_dtype: dtype parameters are stored in (float32 master weights by default; pass
        bfloat16 for a frozen reference or reward model to halve its memory).
      mesh, rules: shard parameters over ``mesh`` by ``rules`` as they load (see sharding.py).
      head: ``"causal_lm"``, ``"reward"`` or ``"value"``; default from the checkpoint's
        architecture (``*ForSequenceClassification`` -> reward). ``"value"`` on a causal-LM
        checkpoint gives a critic with the policy's trunk and a fresh head.
      remat: activation checkpointing per layer: none, full, dots or dots_no_batch.
      allow_pickle: permit PyTorch ``.bin`` weights (pickle; only for trusted checkpoints).
      gguf_file: name of a GGUF file inside ``path``.
      seed: initialises parameters the checkpoint lacks (a new value head).
    """
    folder, gguf_file = _resolve(path, gguf_file)
    hf_config = _read_hf_config(folder, gguf_file)
    archs = list(getattr(hf_config, "architectures", None) or [])
    is_cls = any(a.endswith("ForSequenceClassification") for a in archs)
    head = head or ("reward" if is_cls else "causal_lm")
    if head not in _HEADS:
        raise ValueError(f"head must be one of {sorted(_HEADS)}, got {head!r}")
    config = ModelConfig.from_hf(
        hf_config,
        dtype=jnp.dtype(dtype) if dtype is not None else default_dtype(),
        param_dtype=param_dtype,
        remat=remat,
    )
    kwargs = {"num_labels": int(getattr(hf_config, "num_labels", 1))} if head == "reward" else {}
    reader = _weights_reader(folder, gguf_file, allow_pickle, head)
    return load_params(_HEADS[head], config, reader, mesh=mesh, rules=rules, seed=seed, **kwargs)


def load_params(
    cls: type[AnyModel],
    config: ModelConfig,
    reader: Reader,
    *,
    mesh: jax.sharding.Mesh | None = None,
    rules: Rules = DEFAULT_RULES,
    seed: int = 0,
    **kwargs: Any,
) -> AnyModel:
    """Builds ``cls(config)`` abstractly and fills it from ``reader`` one tensor at a time."""
    abstract = nnx.eval_shape(lambda: cls(config, rngs=nnx.Rngs(seed), **kwargs))
    graphdef, state = nnx.split(abstract)
    flat_shardings = _flatten(param_shardings(state, mesh, rules)) if mesh is not None else {}
    missing = []
    used = set()
    values: dict[tuple, jax.Array] = {}
    for path, var in nnx.to_flat_state(state):
        path = tuple(path)
        abstract_value = var.get_value()
        shape, dtype = tuple(abstract_value.shape), abstract_value.dtype
        sharding = flat_shardings.get(path)
        pieces = weights.unstack(path, shape)  # one per layer for a stacked layer parameter
        names = [weights.hf_name(piece_path) for piece_path, _ in pieces]
        absent = [name for name in names if name not in reader]
        if absent:
            if path[0] == "score" and cls is ValueModel:  # a critic from a policy checkpoint
                host = 0.02 * jax.random.normal(jax.random.key(seed), shape, jnp.float32)
                values[path] = _place(np.asarray(host).astype(dtype), sharding)
                continue
            missing.extend(absent)
            continue
        host_pieces = []
        for (piece_path, piece_shape), name in zip(pieces, names, strict=True):
            used.add(name)
            expected = weights.hf_shape(piece_path, piece_shape)
            if reader.shape(name) != expected:
                raise ValueError(
                    f"checkpoint tensor {name} has shape {reader.shape(name)}, expected "
                    f"{expected} for config {config}"
                )
            host_pieces.append(weights.to_ours(piece_path, reader.get(name), piece_shape))
        host = np.stack(host_pieces) if weights.is_stacked(path) else host_pieces[0]
        values[path] = _place(host.astype(dtype), sharding)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:5]}")
    unused = [
        n
        for n in reader.names()
        if n not in used
        and not n.endswith(weights.IGNORED_SUFFIXES)
        and not (n == "lm_head.weight" and config.tie_word_embeddings)
        and not (n == "lm_head.weight" and cls is not CausalLM)
        and not (n.startswith("score.") and cls is CausalLM)
    ]
    if unused:
        log.warning("ignoring %d checkpoint tensors, e.g. %s", len(unused), unused[:5])
    nnx.replace_by_pure_dict(state, _unflatten(values))
    return nnx.merge(graphdef, state)


def load_tokenizer(
    path: str | os.PathLike, *, gguf_file: str | None = None, trust_remote_code: bool = False
) -> transformers.PreTrainedTokenizerBase:
    """The checkpoint's tokenizer (``transformers.AutoTokenizer``), padding on the left.

    Generation pads on the left so every sequence ends at the same slot; a tokenizer without a
    pad token gets its EOS token as pad (the mask, not the id, marks padding in this package).
    ``trust_remote_code`` lets transformers run a tokenizer class shipped as Python code with
    the checkpoint (off by default; only for checkpoints you trust).
    """
    from transformers import AutoTokenizer

    folder, gguf_file = _resolve(path, gguf_file)
    tok = AutoTokenizer.from_pretrained(
        str(folder), gguf_file=gguf_file, trust_remote_code=trust_remote_code
    )
    tok.padding_side = "left"
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    return tok


def _kind(model: nnx.Module) -> tuple[str, int]:
    if isinstance(model, CausalLM):
        return "causal_lm", 1
    if isinstance(model, RewardModel | ValueModel):
        return "sequence_cls", model.num_labels
    raise TypeError(
        f"cannot export {type(model).__name__}; expected CausalLM, RewardModel or ValueModel"
    )


def _host_value(x: jax.Array) -> np.ndarray:
    if not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))


def _fetch_piece(path: tuple, value: jax.Array, layer: int | None) -> np.ndarray:
    """One HF tensor of the parameter ``value``: layer ``layer`` of a stacked one, or all of it.

    A layer is sliced on device first (by every process: the slice of a global array is a
    collective), so the host holds one layer's tensor at a time.
    """
    return weights.to_hf(path, _host_value(value if layer is None else value[layer]))


def save_pretrained(
    model: AnyModel,
    out_dir: str | os.PathLike,
    tokenizer: Any = None,
    *,
    dtype: Any = None,
    max_shard_size: int = 5 * 2**30,
) -> Path:
    """Writes config.json, safetensors (sharded past ``max_shard_size`` bytes) and the tokenizer.

    ``transformers.AutoModelForCausalLM`` (or ``AutoModelForSequenceClassification`` for a
    reward/value model) loads the folder. ``dtype`` defaults to the parameter dtype;
    ``tokenizer`` is a tokenizer object or a path to load one from. Parameters are fetched one
    at a time (gathered across hosts when sharded); only process 0 writes.
    """
    out = Path(out_dir)
    kind, num_labels = _kind(model)
    config: ModelConfig = model.config
    save_dtype = np.dtype(jnp.dtype(dtype or config.param_dtype))
    entries = []
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        path = tuple(path)
        value = var.get_value()
        stacked = weights.is_stacked(path)
        for layer, (piece_path, piece_shape) in enumerate(weights.unstack(path, value.shape)):
            entries.append(
                (
                    weights.hf_name(piece_path),
                    weights.hf_shape(piece_path, piece_shape),
                    save_dtype,
                    functools.partial(_fetch_piece, piece_path, value, layer if stacked else None),
                )
            )
    if jax.process_index() != 0:
        for *_, fetch in entries:  # every process joins the gathers
            fetch()
        return out
    out.mkdir(parents=True, exist_ok=True)
    hf = config.replace(param_dtype=jnp.dtype(save_dtype).name).to_hf_dict(kind, num_labels)
    (out / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True))
    weights.write_checkpoint(out, entries, max_shard_size)
    if tokenizer is not None:
        if isinstance(tokenizer, str | os.PathLike):
            tokenizer = load_tokenizer(tokenizer)
        tokenizer.save_pretrained(str(out))
    return out
