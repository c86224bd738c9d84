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

from jaxrl_llm import distributed as dist
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
from jaxrl_llm.models.weights import ModelLoadError

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
        raise ModelLoadError(
            f"{p} is a file; expected a checkpoint folder (config.json and safetensors) or a "
            ".gguf file"
        )
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


def read_config_json(folder: str | os.PathLike) -> dict:
    """``folder/config.json`` as a dict, or a :class:`ModelLoadError` saying what is wrong
    with it (missing, a folder, not UTF-8, not JSON, not a JSON object)."""
    cfg_path = Path(folder) / "config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"{folder} has no config.json")
    if not cfg_path.is_file():
        raise ModelLoadError(f"{cfg_path} is not a file; expected the model's config as JSON")
    return _read_json_object(cfg_path, "the model's config")


def _read_json_object(path: Path, what: str) -> dict:
    """The JSON object in ``path``, or a :class:`ModelLoadError` saying why it is not one
    (not UTF-8, not JSON, another JSON value); ``what`` names what it should hold."""
    try:
        raw = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ModelLoadError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ModelLoadError(
            f"{path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); "
            f"expected {what}, a JSON object"
        ) from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path}: a JSON {type(raw).__name__}; expected {what}, a JSON object")
    return raw


GENERATION_CONFIG = "generation_config.json"


def read_generation_config(path: str | os.PathLike) -> tuple[dict[str, Any], Path | None]:
    """``(settings, file)``: the checkpoint folder's ``generation_config.json``, the file from
    which ``transformers``' ``generate`` and vLLM take their defaults (``do_sample``,
    ``temperature``, ``top_k``, ``top_p``, ``eos_token_id``, ...), as a dict; ``({}, None)``
    where there is none (a ``.gguf`` file, a name such as ``tiny-random``, a folder without
    one). Only the keys the file sets are in the dict.

    Raises:
      ModelLoadError: the file is not UTF-8 JSON holding an object.
    """
    file = Path(path).expanduser() / GENERATION_CONFIG
    if not file.is_file():
        return {}, None
    return _read_json_object(file, "the checkpoint's generation defaults"), file


def eos_token_ids(*values: Any, vocab_size: int) -> tuple[int, ...]:
    """The ids in ``eos_token_id`` values (each ``None``, an int or a list/tuple of ints: a
    tokenizer's, ``config.json``'s, ``generation_config.json``'s, where Llama 3 and Qwen 2.5
    instruct checkpoints list their end-of-turn tokens), those inside the vocabulary, sorted."""
    ids = set()
    for value in values:
        for e in value if isinstance(value, list | tuple) else [value]:
            if isinstance(e, int | np.integer) and not isinstance(e, bool):
                ids.add(int(e))
    return tuple(sorted(i for i in ids if 0 <= i < vocab_size))


def _gguf_metadata(file: Path) -> dict[str, Any]:
    """The GGUF file's scalar and string metadata (``general.architecture``,
    ``llama.context_length``, ...; arrays such as the vocabulary are skipped), read from its
    header without touching the tensors; :class:`ModelLoadError` for a file that is not GGUF.
    Parsed once per file version (the config check and the loader both ask)."""
    stat = file.stat()
    return _gguf_metadata_cached(str(file.resolve()), stat.st_size, stat.st_mtime_ns)


# GGUF metadata value types (ggml's gguf.md): struct formats of the fixed-size ones.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q"}
_GGUF_SCALARS |= {11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


@functools.lru_cache(maxsize=8)
def _gguf_metadata_cached(file: str, size: int, mtime_ns: int) -> dict[str, Any]:
    import mmap
    import struct

    def fail(why: str) -> ModelLoadError:
        return ModelLoadError(
            f"{file}: not a readable GGUF file ({why}); expected a GGUF model (magic 'GGUF', "
            "e.g. from llama.cpp's convert_hf_to_gguf.py)"
        )

    with open(file, "rb") as f:
        if size < 24 or f.read(4) != b"GGUF":
            raise fail("it does not start with the magic bytes 'GGUF'")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        version, _, num_kv = struct.unpack_from("<IQQ", buf, 4)
        if version < 2:
            raise fail(f"GGUF version {version}; expected 2 or later")
        pos = 24

        def take(fmt: str) -> Any:
            nonlocal pos
            (value,) = struct.unpack_from("<" + fmt, buf, pos)
            pos += struct.calcsize("<" + fmt)
            return value

        def string() -> str:
            nonlocal pos
            n = take("Q")
            if pos + n > size:
                raise struct.error("a string runs past the end of the file")
            pos += n
            return bytes(buf[pos - n : pos]).decode("utf-8", "replace")

        def value(kind: int) -> Any:
            nonlocal pos
            if kind in _GGUF_SCALARS:
                return take(_GGUF_SCALARS[kind])
            if kind == _GGUF_STRING:
                return string()
            if kind == _GGUF_ARRAY:
                elem, count = take("I"), take("Q")
                if elem in _GGUF_SCALARS:
                    pos += count * struct.calcsize("<" + _GGUF_SCALARS[elem])
                else:
                    for _ in range(count):
                        value(elem)
                return None
            raise struct.error(f"unknown metadata value type {kind}")

        out: dict[str, Any] = {}
        for _ in range(num_kv):
            key, kind = string(), take("I")
            item = value(kind)
            if item is not None:
                out[key] = item
        if pos > size:
            raise struct.error("the metadata runs past the end of the file")
        return out
    except struct.error as e:
        raise fail(f"corrupt metadata: {e}") from None
    finally:
        buf.close()


def model_context(path: str | os.PathLike) -> tuple[int, str] | None:
    """``(max_position_embeddings, where it was read)`` of the checkpoint at ``path``, read
    cheaply (config.json, or a GGUF file's metadata) without loading any weights; ``None``
    when ``path`` is not a local folder or file (the loader then reports it).

    Raises:
      ModelLoadError: config.json or the GGUF file cannot be read.
    """
    p = Path(path).expanduser()
    if not p.exists():
        return None
    folder, gguf_file = _resolve(p, None)
    if gguf_file is not None:
        meta = _gguf_metadata(folder / gguf_file)
        arch = meta.get("general.architecture")
        value = meta.get(f"{arch}.context_length")
        return (int(value), f"{folder / gguf_file} ({arch}.context_length)") if value else None
    if not (folder / "config.json").exists():
        return None
    raw = read_config_json(folder)
    value = raw.get("max_position_embeddings", 2048)  # ModelConfig.from_hf's default
    if not isinstance(value, int) or isinstance(value, bool):
        return None
    return value, f"{folder / 'config.json'} (max_position_embeddings)"


def _read_hf_config(folder: Path, gguf_file: str | None) -> transformers.PretrainedConfig:
    if gguf_file is None:
        raw = read_config_json(folder)
        if raw.get("model_type") not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"{folder}: architecture {raw.get('architectures')} (model_type "
                f"{raw.get('model_type')!r}) is not supported; supported architectures: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
    else:
        _gguf_metadata(folder / gguf_file)  # a clear error for a file that is not GGUF
        weights.require_gguf_loader(folder / gguf_file)  # and for a missing torch / gguf
    # imported after the checks: with torch installed, transformers' config module imports it
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(str(folder), gguf_file=gguf_file, trust_remote_code=False)
    except Exception as e:
        what = gguf_file or "config.json"
        raise ModelLoadError(
            f"{folder / what}: transformers cannot read this config ({type(e).__name__}: {e})"
        ) from None


def _weights_reader(folder: Path, gguf_file: str | None, allow_pickle: bool, head: str) -> Reader:
    if gguf_file is not None:
        return _gguf_reader(folder, gguf_file, head)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelLoadError(
                f"{index}: not a safetensors index ({type(e).__name__}: {e}); expected JSON "
                'with a "weight_map" of tensor name -> shard file'
            ) from None
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
            try:
                tensors.update(torch.load(b, map_location="cpu", weights_only=True, mmap=True))
            except Exception as e:
                raise ModelLoadError(
                    f"{b}: not a readable PyTorch state dict ({type(e).__name__}: {e})"
                ) from None
        return weights.DictReader(tensors)
    raise FileNotFoundError(f"{folder} has no model.safetensors, sharded safetensors or GGUF")


def _gguf_reader(folder: Path, gguf_file: str, head: str) -> weights.DictReader:
    """Dequantises a GGUF file with transformers (needs ``gguf``, ``torch`` and ``accelerate``,
    which :func:`_read_hf_config`, always called first, has checked)."""
    import transformers

    cls = (
        transformers.AutoModelForSequenceClassification
        if head == "reward"
        else transformers.AutoModelForCausalLM
    )
    try:
        torch_model = cls.from_pretrained(str(folder), gguf_file=gguf_file, trust_remote_code=False)
    except ImportError:
        raise
    except Exception as e:
        raise ModelLoadError(
            f"{folder / gguf_file}: transformers cannot load these GGUF weights "
            f"({type(e).__name__}: {e})"
        ) from None
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
    attention_impl: str = "auto",
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
      attention_impl: auto, reference, splash, cudnn or pallas_gpu (see attention.py).
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
    try:
        config = ModelConfig.from_hf(
            hf_config,
            dtype=jnp.dtype(dtype) if dtype is not None else default_dtype(),
            param_dtype=param_dtype,
            remat=remat,
            attention_impl=attention_impl,
        )
    except (KeyError, TypeError, ZeroDivisionError) as e:
        what = gguf_file or "config.json"
        raise ModelLoadError(
            f"{folder / what}: the model config lacks or mistypes a field ({type(e).__name__}: "
            f"{e}); expected vocab_size, hidden_size, intermediate_size, num_hidden_layers and "
            "num_attention_heads as integers"
        ) from None
    kwargs = {"num_labels": int(getattr(hf_config, "num_labels", 1))} if head == "reward" else {}
    reader = _weights_reader(folder, gguf_file, allow_pickle, head)
    try:
        return load_params(
            _HEADS[head], config, reader, mesh=mesh, rules=rules, seed=seed, **kwargs
        )
    except ModelLoadError as e:
        raise ModelLoadError(f"{folder}: {e}") from None


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
                raise ModelLoadError(
                    f"checkpoint tensor {name} has shape {reader.shape(name)}, but the config "
                    f"(hidden_size={config.hidden_size}, intermediate_size="
                    f"{config.intermediate_size}, num_attention_heads={config.num_heads}, "
                    f"num_key_value_heads={config.num_kv_heads}, vocab_size={config.vocab_size})"
                    f" expects {expected}: the weights do not belong to this config.json"
                )
            host_pieces.append(weights.to_ours(piece_path, reader.get(name), piece_shape))
        host = np.stack(host_pieces) if weights.is_stacked(path) else host_pieces[0]
        values[path] = _place(host.astype(dtype), sharding)
    if missing:
        raise ModelLoadError(
            f"the checkpoint lacks {len(missing)} tensor(s) the config needs, e.g. "
            f"{', '.join(missing[:5])} (it has {len(reader.names())} tensors); is a shard "
            "missing, or do the weights belong to another architecture?"
        )
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


#: Files of which a tokenizer folder holds at least one.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)


def check_tokenizer_folder(folder: str | os.PathLike) -> None:
    """Raises :class:`ModelLoadError` when ``folder`` (an existing folder) holds none of the
    files a tokenizer is saved as; cheap, so callers run it before loading any model."""
    folder = Path(folder)
    if folder.is_dir() and not any((folder / f).is_file() for f in _TOKENIZER_FILES):
        raise ModelLoadError(
            f"{folder}: no tokenizer files (expected one of {', '.join(_TOKENIZER_FILES)}); "
            "save the tokenizer with the model, or name its folder (model.tokenizer=DIR)"
        )


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
    if gguf_file is None:
        check_tokenizer_folder(folder)
    try:
        tok = AutoTokenizer.from_pretrained(
            str(folder), gguf_file=gguf_file, trust_remote_code=trust_remote_code
        )
    except ImportError:
        raise
    except Exception as e:
        text = str(e)
        if "trust_remote_code" in text and not trust_remote_code:
            raise ModelLoadError(
                f"{folder}: the tokenizer is Python code shipped with the checkpoint, which "
                "runs only with trust_remote_code (in a training config: "
                "model.trust_remote_code=true) — set it only if you trust this checkpoint"
            ) from None
        raise ModelLoadError(
            f"{folder / (gguf_file or '')}: transformers cannot load the tokenizer "
            f"({type(e).__name__}: {text.strip().splitlines()[0] if text.strip() else ''})"
        ) from None
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
    return dist.to_host(x)


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
    generation_config: dict[str, Any] | None = None,
) -> Path:
    """Writes config.json, safetensors (sharded past ``max_shard_size`` bytes) and the tokenizer.

    ``transformers.AutoModelForCausalLM`` (or ``AutoModelForSequenceClassification`` for a
    reward/value model) loads the folder. ``dtype`` defaults to the parameter dtype;
    ``tokenizer`` is a tokenizer object or a path to load one from. ``generation_config``
    (a dict, e.g. the source checkpoint's from :func:`read_generation_config`) is written as
    ``generation_config.json``, so that the sampling defaults and end-of-turn ids the source
    shipped go with the weights. Parameters are fetched one at a time (gathered across hosts
    when sharded); only process 0 writes.
    """
    out = Path(out_dir)
    kind, num_labels = _kind(model)
    config: ModelConfig = model.config
    adapted = [
        "/".join(map(str, path))
        for path, node in nnx.iter_graph(model)
        if isinstance(node, nnx.LoRAParam) or getattr(node, "quant", None) is not None
    ]
    if adapted:
        raise ValueError(
            f"save_pretrained: the model has LoRA adapters or a quantised base ({adapted[0]}, "
            "...); a Hugging Face folder holds plain weights: lora.merge_into_base(model) first "
            "(and peft.save_adapter for the adapter alone)"
        )
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
    if generation_config:
        text = json.dumps(generation_config, indent=2, sort_keys=True)
        (out / GENERATION_CONFIG).write_text(text + "\n")
    if tokenizer is not None:
        if isinstance(tokenizer, str | os.PathLike):
            tokenizer = load_tokenizer(tokenizer)
        tokenizer.save_pretrained(str(out))
    return out
