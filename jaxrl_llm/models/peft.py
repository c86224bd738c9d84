"""LoRA adapters in Hugging Face PEFT's folder format: export and import.

A PEFT LoRA folder holds ``adapter_config.json`` (a ``peft.LoraConfig``) and
``adapter_model.safetensors`` with, for every adapted ``torch.nn.Linear(in, out)`` of every
layer ``l``::

    base_model.model.model.layers.{l}.self_attn.q_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.{l}.self_attn.q_proj.lora_B.weight   [out, r]

(PEFT strips the adapter name ``default`` when it saves and adds it back when it loads; see
``peft.utils.save_and_load``). PEFT's layer computes ``y = x Wᵀ + s · (x Aᵀ) Bᵀ`` with
``s = lora_alpha / r`` (``lora_alpha / √r`` with ``use_rslora``): the same function as ours,
``y = x W + s · (x a) b`` (:mod:`jaxrl_llm.models.lora`), with

    a[l] = A.T.reshape(*in_shape, r)        b[l] = B.T.reshape(r, *out_shape)

where ``in_shape`` / ``out_shape`` are our kernel's per-head input and output axes (``q_proj``:
``[D] -> [H, Dh]``, ``o_proj``: ``[H, Dh] -> [D]``), flattened in C order exactly as the kernels
are by :mod:`jaxrl_llm.models.weights` (``ours = w.T.reshape(shape)``).

:func:`save_adapter` writes such a folder so that ``peft.PeftModel.from_pretrained(hf_model,
folder)`` on the exported base reproduces our logits; :func:`load_adapter` reads one (ours or
one ``peft`` wrote) into a :class:`~jaxrl_llm.models.lora.LoRAConfig` and the stacked adapter
dict of ``lora.split(model)[2]``; :func:`apply_adapter` puts it on a model to train on or
evaluate. Only what our adapters can express is accepted: plain LoRA on the seven projections
of every layer, one rank and one alpha, no bias, no DoRA, no extra trainable modules; anything
else is an :class:`AdapterError` saying what is unsupported.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl_llm import distributed as dist
from jaxrl_llm.models import lora, weights
from jaxrl_llm.models.config import ModelConfig, UnsafeCheckpointError
from jaxrl_llm.models.transformer import CausalLM

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_FILE = "adapter_model.bin"
#: What an adapter folder may hold; :func:`save_adapter` replaces a folder holding only these.
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE, PICKLE_FILE, "README.md")

_PREFIX = "base_model.model."
# PEFT's key of one adapter matrix: optional wrapper prefix, the HF module path, optional
# adapter name (older writers and ``save_embedding_layers`` variants keep "default").
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])"
    r"(?:\.default)?\.weight$"
)
# init_lora_weights values whose adapter is only valid on a *modified* base (the residual
# W − s·A₀B₀ that PiSSA/OLoRA/CorDA/LoftQ leave), which an unmodified base cannot reproduce.
_RESIDUAL_INITS = ("pissa", "olora", "corda", "loftq")
# Fields of LoraConfig for features our adapters do not have: each must be unset (None, false,
# empty) for the folder to be importable.
_UNSUPPORTED = {
    "modules_to_save": "extra fully trained modules (e.g. a classification head)",
    "layers_to_transform": "adapters on only some layers",
    "rank_pattern": "a different rank per module",
    "alpha_pattern": "a different alpha per module",
    "use_dora": "DoRA (weight-decomposed LoRA)",
    "lora_bias": "a trainable bias on lora_B",
    "exclude_modules": "excluded modules",
    "target_parameters": "LoRA on raw parameters (MoE experts)",
    "trainable_token_indices": "trainable token embeddings",
    "layer_replication": "replicated layers",
    "use_qalora": "QA-LoRA",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
    "use_bdlora": "block-diagonal LoRA",
    "fan_in_fan_out": "fan_in_fan_out (transposed Conv1D weights, GPT-2 style)",
}
# Module names that a regex target_modules may reach but our adapters cannot adapt.
_OTHER_MODULES = ("lm_head", "model.embed_tokens", "score")


class AdapterError(ValueError):
    """A PEFT adapter folder that cannot be read or written as asked: the message names the
    folder, the file, key or field, what was found and what was expected."""


class UnsafeAdapterError(AdapterError, UnsafeCheckpointError):
    """An adapter stored only as a PyTorch pickle (``adapter_model.bin``), read without
    ``allow_pickle``."""


# ---------------------------------------------------------------------------- layouts


def _module(target: str) -> str:
    """``self_attn`` or ``mlp``: where ``target`` lives in a decoder layer."""
    return "self_attn" if target in lora.ATTENTION_TARGETS else "mlp"


def _hf_module(layer: int, target: str) -> str:
    """HF module path of ``target`` in layer ``layer`` (relative to the ``*ForCausalLM``)."""
    return f"model.layers.{layer}.{_module(target)}.{target}"


def peft_key(layer: int, target: str, which: str) -> str:
    """PEFT's saved name of ``lora_A`` (``which="A"``) or ``lora_B`` of ``target`` in
    ``layer``, e.g. ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``."""
    return f"{_PREFIX}{_hf_module(layer, target)}.lora_{which}.weight"


def _layouts(model: Any) -> tuple[int, dict[str, tuple[tuple[int, ...], tuple[int, ...]]]]:
    """``(L, {target: (in_shape, out_shape)})`` of every projection of ``model`` (a CausalLM or
    ValueModel, or a :class:`ModelConfig`: then an abstract CausalLM, no memory)."""
    if isinstance(model, ModelConfig):
        config = model
        model = nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0)))
    layouts, num_layers = {}, None
    for name, proj in lora._projections(model, lora.TARGETS):
        # The leading (layer) axes of the stored kernel: codes [*lead, K, N] when quantised;
        # read without kernel[...] so that an abstract model works too.
        stored = tuple(proj.kernel.get_value().shape)
        n_lead = len(stored) - (2 if proj.quant is not None else len(proj.unstacked_shape))
        shape = (*stored[:n_lead], *proj.unstacked_shape)
        if n_lead != 1:
            raise AdapterError(
                f"{name}: kernel {shape} has {n_lead} leading axes; expected the stacked "
                "layout [L, *in, *out]"
            )
        num_layers = shape[0]
        layouts[name] = (tuple(shape[1 : 1 + proj.n_in]), tuple(shape[1 + proj.n_in :]))
    return num_layers, layouts


def _adapter_tree(arrays: dict[str, tuple[Any, Any]]) -> dict:
    """``{target: (a, b)}`` -> the pure-dict structure of ``lora.split(model)[2]``."""
    layers: dict[str, dict] = {}
    for target, (a, b) in arrays.items():
        layers.setdefault(_module(target), {})[target] = {"lora_a": a, "lora_b": b}
    return {"model": {"layers": layers}}


# ---------------------------------------------------------------------------- export


def _host(x: jax.Array) -> np.ndarray:
    return np.asarray(dist.to_host(x), np.float32)


def _peft_config(
    config: lora.LoRAConfig, base_model_name_or_path: str, task_type: str | None
) -> dict:
    """``adapter_config.json``: the ``peft.LoraConfig`` fields (the unsupported features
    written unset, so the file says what it is not)."""
    alpha = config.alpha
    return {
        "peft_type": "LORA",
        "task_type": task_type,
        "base_model_name_or_path": base_model_name_or_path,
        "revision": None,
        "inference_mode": True,
        "r": config.rank,
        "lora_alpha": int(alpha) if float(alpha).is_integer() else float(alpha),
        "lora_dropout": float(config.dropout),
        "target_modules": list(config.targets),
        "bias": "none",
        "use_rslora": bool(config.use_rslora),
        "fan_in_fan_out": False,
        # Our init is PEFT's default (kaiming-uniform A, zero B); the file's values override it.
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "use_dora": False,
        "lora_bias": False,
        "exclude_modules": None,
    }


def _check_folder(folder: Path) -> None:
    if folder.is_symlink():
        raise AdapterError(
            f"{folder} is a symlink (to {os.path.realpath(folder)}); the adapter would replace "
            "the link, not write into its target. Give a real folder."
        )
    if folder.exists() and not folder.is_dir():
        raise AdapterError(f"{folder} is a file; expected a folder for the adapter")
    if folder.is_dir():
        others = sorted(p.name for p in folder.iterdir() if p.name not in ADAPTER_FILES)
        if others:
            shown = ", ".join(others[:5]) + (", ..." if len(others) > 5 else "")
            raise AdapterError(
                f"{folder} holds files that are not an adapter's ({shown}); expected an empty "
                f"or new folder, or one holding only {', '.join(ADAPTER_FILES)} (replaced)"
            )


def save_adapter(
    model: Any,
    folder: str | os.PathLike,
    *,
    config: lora.LoRAConfig,
    base_model_name_or_path: str,
) -> Path:
    """Writes ``model``'s adapters as a PEFT LoRA folder; returns the folder.

    ``folder/adapter_config.json`` is the ``peft.LoraConfig`` of ``config`` (``task_type``
    ``CAUSAL_LM`` for a CausalLM, unset for a ValueModel) and ``folder/adapter_model.safetensors``
    holds ``lora_A = a[l].reshape(K, r).T`` and ``lora_B = b[l].reshape(r, N).T`` (float32) for
    every layer ``l`` and target, under PEFT's key names (:func:`peft_key`). So
    ``peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), folder)``
    computes our adapted model. The files are written into a temporary sibling folder that then
    replaces ``folder``; a ``folder`` holding anything but adapter files is refused.

    Args:
      model: a LoRA-adapted CausalLM or ValueModel (:func:`lora.apply_lora`).
      folder: the adapter folder to write (e.g. ``RUN_DIR/adapter``).
      config: the adapters' settings; must be the ones ``model`` was adapted with.
      base_model_name_or_path: the base model (folder or hub name), recorded for
        ``peft.AutoPeftModel*``.
    """
    folder = Path(folder)
    arrays = {}
    for name, proj in lora._projections(model, lora.TARGETS):
        if proj.lora_a is None:
            if name in config.targets:
                raise AdapterError(
                    f"{name} has no LoRA adapters but config.targets lists it; save with the "
                    "LoRAConfig the model was adapted with"
                )
            continue
        if name not in config.targets:
            raise AdapterError(
                f"{name} has LoRA adapters but config.targets ({list(config.targets)}) does not "
                "list it; save with the LoRAConfig the model was adapted with"
            )
        a, b = proj.lora_a[...], proj.lora_b[...]
        if a.shape[-1] != config.rank or not math.isclose(proj.lora_scale, config.scale):
            raise AdapterError(
                f"{name}: adapters of rank {a.shape[-1]} with scale {proj.lora_scale}; config "
                f"says rank {config.rank}, scale {config.scale} (alpha {config.alpha}, "
                f"use_rslora={config.use_rslora})"
            )
        arrays[name] = (a, b)
    entries = []
    for target in config.targets:  # every process joins the gathers of sharded adapters
        a, b = (_host(x) for x in arrays[target])
        for layer in range(a.shape[0]):
            mat_a = a[layer].reshape(-1, config.rank).T  # [r, K]
            mat_b = b[layer].reshape(config.rank, -1).T  # [N, r]
            for which, mat in (("A", mat_a), ("B", mat_b)):
                mat = np.ascontiguousarray(mat)
                entries.append(
                    (peft_key(layer, target, which), mat.shape, mat.dtype, lambda m=mat: m)
                )
    if jax.process_index() != 0:
        return folder
    _check_folder(folder)
    task_type = "CAUSAL_LM" if isinstance(model, CausalLM) else None
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}"
    old = folder.parent / f".{folder.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        peft_cfg = _peft_config(config, str(base_model_name_or_path), task_type)
        (tmp / CONFIG_FILE).write_text(json.dumps(peft_cfg, indent=2, sort_keys=True) + "\n")
        weights.write_safetensors(tmp / WEIGHTS_FILE, entries)
        if folder.exists():
            folder.rename(old)
        tmp.rename(folder)
    except BaseException:
        if old.exists() and not folder.exists():
            old.rename(folder)  # the previous adapter stays where it was
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
    return folder


# ---------------------------------------------------------------------------- import


def _read_config(folder: Path) -> dict:
    file = folder / CONFIG_FILE
    if not folder.is_dir():
        raise AdapterError(
            f"{folder}: {'a file' if folder.exists() else 'no such folder'}; expected a PEFT "
            f"adapter folder ({CONFIG_FILE} + {WEIGHTS_FILE})"
        )
    if not file.is_file():
        raise AdapterError(
            f"{folder} has no {CONFIG_FILE}; expected a PEFT adapter folder ({CONFIG_FILE} + "
            f"{WEIGHTS_FILE}, as peft's save_pretrained writes)"
        )
    try:
        raw = json.loads(file.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{file}: not valid JSON ({e}); expected a peft LoraConfig") from None
    if not isinstance(raw, dict):
        raise AdapterError(f"{file}: a JSON {type(raw).__name__}; expected a JSON object")
    return raw


def _targets(file: Path, raw: Any, num_layers: int) -> tuple[str, ...]:
    """Our targets from PEFT's ``target_modules``, matched as PEFT matches them
    (``peft.tuners.tuners_utils.check_target_module_exists``): a string is a regex over the
    full module name; a list entry matches a module it equals or is a dotted suffix of."""
    where = f"{file}: target_modules"
    if raw == "all-linear":
        return lora.TARGETS
    if isinstance(raw, str):
        try:
            pattern = re.compile(raw)
        except re.error as e:
            raise AdapterError(f"{where}: {raw!r} is not a valid regex ({e})") from None
        others = [m for m in _OTHER_MODULES if pattern.fullmatch(m)]
        if others:
            raise AdapterError(
                f"{where}: {raw!r} also matches {others}; only the projections "
                f"{list(lora.TARGETS)} can be adapted"
            )
        per_layer = {
            tuple(t for t in lora.TARGETS if pattern.fullmatch(_hf_module(layer, t)))
            for layer in range(num_layers)
        }
        if len(per_layer) != 1:
            raise AdapterError(
                f"{where}: {raw!r} adapts different projections in different layers; "
                "expected the same projections in every layer"
            )
        (targets,) = per_layer
        if not targets:
            raise AdapterError(
                f"{where}: {raw!r} matches no projection (module names look like "
                f"{_hf_module(0, 'q_proj')!r}); expected some of {list(lora.TARGETS)}"
            )
        return targets
    if not isinstance(raw, list | tuple) or not raw or not all(isinstance(t, str) for t in raw):
        raise AdapterError(
            f"{where} is {raw!r}; expected a non-empty list of module names (some of "
            f"{list(lora.TARGETS)}), a regex string or 'all-linear'"
        )
    targets: list[str] = []
    for entry in raw:
        hits = [
            t for t in lora.TARGETS if (m := _hf_module(0, t)) == entry or m.endswith("." + entry)
        ]
        if not hits:
            raise AdapterError(
                f"{where}: {entry!r} matches no projection of the model; expected names among "
                f"{list(lora.TARGETS)} (LoRA on other modules is not supported)"
            )
        targets += [t for t in hits if t not in targets]
    return tuple(targets)


def _lora_config(file: Path, raw: dict, num_layers: int) -> lora.LoRAConfig:
    if raw.get("peft_type") != "LORA":
        raise AdapterError(
            f"{file}: peft_type is {raw.get('peft_type')!r}; only 'LORA' adapters are supported"
        )
    if raw.get("bias", "none") != "none":
        raise AdapterError(
            f"{file}: bias is {raw['bias']!r}; only 'none' is supported (our adapters train no "
            "biases)"
        )
    for field, what in _UNSUPPORTED.items():
        if raw.get(field) not in (None, False, [], {}, ""):
            raise AdapterError(
                f"{file}: {field} is {raw[field]!r}: {what} is not supported; expected it unset"
            )
    init = raw.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_RESIDUAL_INITS):
        raise AdapterError(
            f"{file}: init_lora_weights is {init!r}: such an adapter belongs to a modified "
            "(residual) base, not to base_model_name_or_path; convert it to a plain LoRA with "
            "peft (save_pretrained(path_initial_model_for_weight_conversion=...)) first"
        )
    rank, alpha = raw.get("r"), raw.get("lora_alpha", 8)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"{file}: r is {rank!r}; expected an integer >= 1")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not alpha > 0:
        raise AdapterError(f"{file}: lora_alpha is {alpha!r}; expected a number > 0")
    dropout = raw.get("lora_dropout", 0.0)
    if not isinstance(dropout, int | float) or not 0.0 <= dropout < 1.0:
        raise AdapterError(f"{file}: lora_dropout is {dropout!r}; expected a number in [0, 1)")
    targets = _targets(file, raw.get("target_modules"), num_layers)
    try:
        return lora.LoRAConfig(
            rank=rank,
            alpha=float(alpha),
            dropout=float(dropout),
            targets=targets,
            use_rslora=bool(raw.get("use_rslora", False)),
        )
    except ValueError as e:
        raise AdapterError(f"{file}: {e}") from None


def _weights_reader(folder: Path, allow_pickle: bool) -> weights.SafetensorsReader | Any:
    file = folder / WEIGHTS_FILE
    if file.is_file():
        try:
            return weights.SafetensorsReader([file])
        except weights.ModelLoadError as e:
            raise AdapterError(str(e)) from None
    pickled = folder / PICKLE_FILE
    if pickled.is_file():
        if not allow_pickle:
            raise UnsafeAdapterError(
                f"{pickled}: the adapter is a PyTorch pickle, and unpickling can run arbitrary "
                "code. Pass allow_pickle=True if you trust it, or re-save it with peft "
                "(save_pretrained(..., safe_serialization=True)) as adapter_model.safetensors."
            )
        import torch

        return weights.DictReader(torch.load(pickled, map_location="cpu", weights_only=True))
    raise AdapterError(
        f"{folder} has {CONFIG_FILE} but no {WEIGHTS_FILE}; expected the adapter weights there"
    )


def load_adapter(
    folder: str | os.PathLike, model: Any, *, allow_pickle: bool = False
) -> tuple[lora.LoRAConfig, dict]:
    """Reads a PEFT LoRA folder (ours or peft's) for ``model``: ``(config, adapters)``.

    ``adapters`` has exactly the structure of ``lora.split(m)[2]`` for ``m`` =
    ``model`` adapted with ``config`` (float32 numpy leaves): ``a[l] = A.T.reshape(*in, r)``
    and ``b[l] = B.T.reshape(r, *out)`` from PEFT's ``lora_A [r, in]`` / ``lora_B [out, r]``.

    Args:
      folder: the adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``).
      model: the CausalLM or ValueModel the adapter is for (its shapes; not changed), or its
        :class:`ModelConfig`.
      allow_pickle: read a PyTorch ``adapter_model.bin`` (pickle; only for trusted files).

    Raises:
      AdapterError: naming the file and field or tensor key, for anything that is not plain
        LoRA on this model's projections in every layer (see the module docstring).
      UnsafeAdapterError: a ``.bin`` adapter without ``allow_pickle`` (also an
        :class:`AdapterError` and a :class:`~jaxrl_llm.models.config.UnsafeCheckpointError`).
    """
    folder = Path(folder)
    raw = _read_config(folder)
    num_layers, layouts = _layouts(model)
    config = _lora_config(folder / CONFIG_FILE, raw, num_layers)
    reader = _weights_reader(folder, allow_pickle)
    file = folder / (WEIGHTS_FILE if (folder / WEIGHTS_FILE).is_file() else PICKLE_FILE)
    found: dict[tuple[str, str, int], str] = {}
    for key in reader.names():
        m = _KEY.match(key)
        if m is None:
            raise AdapterError(
                f"{file}: unexpected tensor {key!r}; expected only LoRA matrices named like "
                f"{peft_key(0, 'q_proj', 'A')!r} (LoRA on other modules, biases, DoRA "
                "magnitudes or embeddings are not supported)"
            )
        layer, module, target, which = int(m[1]), m[2], m[3], m[4]
        if target not in config.targets or _module(target) != module:
            raise AdapterError(
                f"{file}: tensor {key!r} adapts {module}.{target}, which target_modules does "
                f"not list as one of ours ({list(config.targets)})"
            )
        if layer >= num_layers:
            raise AdapterError(
                f"{file}: tensor {key!r} is for layer {layer}; the model has {num_layers} "
                f"layers (0..{num_layers - 1})"
            )
        if (target, which, layer) in found:
            raise AdapterError(f"{file}: {key!r} and {found[target, which, layer]!r} collide")
        found[target, which, layer] = key
    r = config.rank
    arrays = {}
    for target in config.targets:
        ins, outs = layouts[target]
        k, n = math.prod(ins), math.prod(outs)
        a_lkr = np.empty((num_layers, *ins, r), np.float32)
        b_lrn = np.empty((num_layers, r, *outs), np.float32)
        for which, expected, out in (("A", (r, k), a_lkr), ("B", (n, r), b_lrn)):
            missing = [layer for layer in range(num_layers) if (target, which, layer) not in found]
            if missing:
                raise AdapterError(
                    f"{file}: no {peft_key(missing[0], target, which)!r} (lora_{which} of "
                    f"{target} is missing for layers {missing}); expected every layer of the "
                    f"{num_layers} to be adapted"
                )
            for layer in range(num_layers):
                key = found[target, which, layer]
                shape = tuple(reader.shape(key))
                if shape != expected:
                    raise AdapterError(
                        f"{file}: tensor {key!r} has shape {shape}; expected {expected} "
                        f"(r={r}, {target}: {k} inputs -> {n} outputs in this model)"
                    )
                mat = np.asarray(reader.get(key), np.float32)
                out[layer] = mat.T.reshape(out.shape[1:])
        arrays[target] = (a_lkr, b_lrn)
    return config, _adapter_tree(arrays)


def check_expected(
    folder: str | os.PathLike, found: lora.LoRAConfig, expected: lora.LoRAConfig
) -> None:
    """Raises :class:`AdapterError` listing each setting in which the folder's adapter
    (``found``) differs from the ``expected`` one: rank, alpha, use_rslora, the targets (as a
    set). The dropout is not compared (a training setting, not part of the adapted function)."""
    diffs = [
        f"{name}: the folder has {a!r}, expected {b!r}"
        for name, a, b in (
            ("rank (r)", found.rank, expected.rank),
            ("alpha (lora_alpha)", found.alpha, expected.alpha),
            ("use_rslora", found.use_rslora, expected.use_rslora),
            ("targets (target_modules)", sorted(found.targets), sorted(expected.targets)),
        )
        if a != b
    ]
    if diffs:
        raise AdapterError(
            f"{Path(folder) / CONFIG_FILE}: the adapter does not match the configured LoRA ("
            + "; ".join(diffs)
            + "); set the LoRA settings to the adapter's, or use another adapter"
        )


def apply_adapter(
    model: Any,
    folder: str | os.PathLike,
    *,
    expected: lora.LoRAConfig | None = None,
    allow_pickle: bool = False,
) -> Any:
    """Adds the adapters of the PEFT folder to ``model`` (in place; returns it):
    :func:`lora.apply_lora` with the folder's config, then the folder's values, placed like the
    fresh adapters (same sharding). Training continues from them as from any adapter
    (``nnx.LoRAParam``); merging (:func:`lora.merge_into_base`) gives the adapted model.
    With ``expected``, a folder whose rank, alpha, use_rslora or targets differ from it is an
    :class:`AdapterError` (:func:`check_expected`) and ``model`` is left unchanged."""
    config, adapters = load_adapter(folder, model, allow_pickle=allow_pickle)
    if expected is not None:
        check_expected(folder, config, expected)
    lora.apply_lora(model, config, rngs=nnx.Rngs(0))
    layers = adapters["model"]["layers"]
    for name, proj in lora._projections(model, config.targets):
        values = layers[_module(name)][name]
        for attr in ("lora_a", "lora_b"):
            var = getattr(proj, attr)
            current = var[...]
            value = jnp.asarray(values[attr], current.dtype)
            sharding = getattr(current, "sharding", None)
            var[...] = dist.put(value, sharding) if sharding is not None else value
    return model


__all__ = [
    "ADAPTER_FILES",
    "CONFIG_FILE",
    "WEIGHTS_FILE",
    "AdapterError",
    "UnsafeAdapterError",
    "apply_adapter",
    "check_expected",
    "load_adapter",
    "peft_key",
    "save_adapter",
]
