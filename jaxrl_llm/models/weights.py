"""Tensor names and layouts between our parameters and HF checkpoints; safetensors without torch.

Our parameter paths are the HF module paths, except that the decoder layers are stacked: the
parameter ``model/layers/self_attn/q_proj/kernel`` has a leading ``[L]`` axis and slice ``l``
is the HF tensor ``model.layers.{l}.self_attn.q_proj.weight`` (:func:`unstack` lists the
per-layer paths, e.g. ``model/layers/0/self_attn/q_proj/kernel``). Otherwise only layouts
differ: a torch ``Linear`` stores ``[out, in]``; our kernels are input-first and split per
head, e.g. ``q_proj.kernel`` is ``[D, H, Dh]`` and ``o_proj.kernel`` is ``[H, Dh, D]``. So
``ours = w.T.reshape(shape)`` and ``w = ours.reshape(n_in, n_out).T`` for every kernel, and
biases only reshape.

The safetensors format (an 8-byte header length, a JSON header, raw little-endian data) is read
through ``numpy.memmap`` and written tensor by tensor, so a checkpoint streams through host
memory one tensor at a time and bf16 works without torch.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

# ---------------------------------------------------------------------------- names and layouts

# Checkpoint tensors that carry no parameter of ours (RoPE buffers some exporters save).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)

STACKED_PREFIX = ("model", "layers")  # parameters under it have a leading [num_layers] axis


def is_stacked(path: tuple) -> bool:
    """Whether the parameter at ``path`` is a stacked layer parameter (leading ``[L]`` axis)."""
    return tuple(str(p) for p in path[: len(STACKED_PREFIX)]) == STACKED_PREFIX


def unstack(path: tuple, shape: tuple[int, ...]) -> list[tuple[tuple, tuple[int, ...]]]:
    """The per-layer ``(path, shape)`` pieces our parameter at ``path`` is made of.

    A stacked layer parameter ``[L, *s]`` gives ``L`` pieces ``model/layers/l/...`` of shape
    ``s`` (one HF tensor each, stacked in order); any other parameter is its own one piece.
    """
    if not is_stacked(path):
        return [(path, tuple(shape))]
    n = len(STACKED_PREFIX)
    return [((*path[:n], layer, *path[n:]), tuple(shape[1:])) for layer in range(shape[0])]


def hf_name(path: tuple) -> str:
    """HF tensor name of the parameter at ``path`` (a pure-dict path)."""
    parts = [str(p) for p in path]
    if parts == ["lm_head"]:
        return "lm_head.weight"
    if parts[-1] in ("kernel", "embedding"):
        parts[-1] = "weight"
    return ".".join(parts)


def _n_in(path: tuple, shape: tuple[int, ...]) -> int:
    """Number of leading (input) dims of a kernel: two for o_proj ``[H, Dh, D]``, else one."""
    return 2 if len(shape) == 3 and str(path[-2]) == "o_proj" else 1


def to_ours(path: tuple, w: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """HF tensor -> our layout for the parameter at ``path`` with ``shape``."""
    if path[-1] == "kernel":
        return w.T.reshape(shape)
    return w.reshape(shape)


def to_hf(path: tuple, x: np.ndarray) -> np.ndarray:
    """Our parameter at ``path`` -> the HF tensor layout."""
    if path[-1] == "kernel":
        n_in = _n_in(path, x.shape)
        rows = math.prod(x.shape[:n_in])
        return x.reshape(rows, -1).T
    if path[-1] == "bias":
        return x.reshape(-1)
    return x


def hf_shape(path: tuple, shape: tuple[int, ...]) -> tuple[int, ...]:
    if path[-1] == "kernel":
        n_in = _n_in(path, shape)
        return (math.prod(shape[n_in:]), math.prod(shape[:n_in]))
    if path[-1] == "bias":
        return (math.prod(shape),)
    return tuple(shape)


# ---------------------------------------------------------------------------- safetensors

_DTYPES: dict[str, Any] = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
_CODES = {np.dtype(v): k for k, v in _DTYPES.items()}


class ModelLoadError(ValueError):
    """A model folder or file that cannot be read: the message names the path, the file, what
    is wrong and what was expected (invalid config.json, a truncated or corrupt safetensors
    file, a tensor of the wrong shape or missing, an unreadable GGUF, no tokenizer, ...)."""


# transformers' GGUF loader needs these; none is a dependency of jaxrl_llm itself (the `test`
# extra installs them), so a plain install reads HF folders but cannot dequantise a GGUF file.
GGUF_LOADER_PACKAGES = {"torch": "torch==2.13.0", "gguf": "gguf>=0.10", "accelerate": "accelerate"}


def require_gguf_loader(gguf_path: str | os.PathLike) -> None:
    """Raises ModelLoadError naming the file, every package GGUF loading lacks, and the fix."""
    missing = {n: pin for n, pin in GGUF_LOADER_PACKAGES.items() if not importlib.util.find_spec(n)}
    if missing:
        pins = " ".join(f'"{pin}"' for pin in missing.values())
        raise ModelLoadError(
            f"{gguf_path}: reading a GGUF checkpoint (the default model ships as one) uses "
            f"transformers' GGUF loader, which needs {', '.join(missing)}, not installed here; "
            f"install with `pip install {pins}` (or the `test` extra), or set model.path to an "
            "HF model folder"
        )


#: The largest safetensors JSON header read (the format's own reference reader caps it at
#: 100 MB); a larger claimed length is a corrupt file, refused before anything is read.
MAX_HEADER_BYTES = 100 * 2**20


def _read_header(file: Path) -> tuple[dict, int]:
    """The tensors' entries of a safetensors file's header and where its data starts, every
    entry checked against the file: a known dtype, ``data_offsets`` inside the data and as
    long as ``shape`` × the dtype's size."""
    size = file.stat().st_size
    if size < 8:
        raise ModelLoadError(
            f"{file}: {size} bytes, too short for a safetensors file (expected an 8-byte header "
            "length, a JSON header and the tensor data); is the file truncated?"
        )
    with open(file, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n == 0 or n > min(MAX_HEADER_BYTES, size - 8):
            why = (
                "0 (a zero-filled file?)"
                if n == 0
                else f"{n:,} bytes, but the file has {size - 8:,} bytes after it"
                if n <= MAX_HEADER_BYTES
                else f"{n:,} bytes (more than the {MAX_HEADER_BYTES:,} allowed)"
            )
            raise ModelLoadError(
                f"{file}: not a valid safetensors file: the header length is {why}; expected "
                "a JSON header of a few KB. Is the file truncated or corrupt?"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(
            f"{file}: not a valid safetensors file: its {n:,}-byte header is not JSON ({e}); "
            "is the file truncated or corrupt?"
        ) from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{file}: the safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    data_bytes = size - 8 - n
    for name, info in header.items():
        where = f"{file}: tensor {name!r}"
        try:
            code, shape = info["dtype"], [int(d) for d in info["shape"]]
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ModelLoadError(
                f"{where}: header entry {info!r} lacks a dtype, shape or data_offsets [begin, end]"
            ) from None
        if code not in _DTYPES:
            raise ModelLoadError(
                f"{where} has dtype {code!r}; expected one of {', '.join(_DTYPES)}"
            )
        nbytes = math.prod(shape) * np.dtype(_DTYPES[code]).itemsize
        if not 0 <= begin <= end <= data_bytes or end - begin != nbytes:
            raise ModelLoadError(
                f"{where}: data_offsets [{begin}, {end}] do not hold its {code} {tuple(shape)} "
                f"({nbytes:,} bytes) inside the file's {data_bytes:,} bytes of data; is the file "
                "truncated or corrupt?"
            )
    return header, 8 + n


class SafetensorsReader:
    """Lazy reader over one or more ``.safetensors`` files (a sharded checkpoint).

    Each file's header is checked against the file when it is opened (:func:`_read_header`), so
    a truncated, zero-filled or corrupt file is a :class:`ModelLoadError` naming it, not a
    crash at the first tensor.
    """

    def __init__(self, files: Iterable[str | os.PathLike]):
        self._where: dict[str, tuple[np.memmap, dict, int]] = {}
        for file in files:
            file = Path(file)
            if not file.is_file():
                raise ModelLoadError(
                    f"{file}: {'a folder' if file.is_dir() else 'missing'}; expected a "
                    "safetensors file"
                )
            header, base = _read_header(file)
            data = np.memmap(file, dtype=np.uint8, mode="r") if header else None
            for name, info in header.items():
                self._where[name] = (data, info, base)

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name][1]["shape"])

    def get(self, name: str) -> np.ndarray:
        data, info, base = self._where[name]
        begin, end = info["data_offsets"]
        code = info["dtype"]
        raw = data[base + begin : base + end]
        return raw.view(_DTYPES[code]).reshape(info["shape"])


class DictReader:
    """The reader interface over an in-memory ``{name: array}`` (GGUF or ``.bin`` weights)."""

    def __init__(self, tensors: dict[str, Any]):
        self._tensors = tensors

    def names(self) -> list[str]:
        return list(self._tensors)

    def __contains__(self, name: str) -> bool:
        return name in self._tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._tensors[name].shape)

    def get(self, name: str) -> np.ndarray:
        t = self._tensors[name]
        if hasattr(t, "detach"):  # a torch tensor
            import torch

            t = t.detach().cpu()
            if t.dtype == torch.bfloat16:
                return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
            return t.numpy()
        return np.asarray(t)


TensorSource = tuple[str, tuple[int, ...], np.dtype, Callable[[], np.ndarray]]


def _header(entries: list[TensorSource], metadata: dict[str, str]) -> tuple[bytes, int]:
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, shape, dtype, _ in entries:
        size = math.prod(shape) * np.dtype(dtype).itemsize
        header[name] = {
            "dtype": _CODES[np.dtype(dtype)],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
    return raw, offset


def write_safetensors(
    path: str | os.PathLike, entries: list[TensorSource], metadata: dict[str, str] | None = None
) -> int:
    """Writes ``entries`` (name, shape, dtype, fetch) one tensor at a time; returns data bytes."""
    raw, total = _header(entries, {"format": "pt", **(metadata or {})})
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape, dtype, fetch in entries:
            arr = np.ascontiguousarray(fetch(), dtype=dtype)
            if tuple(arr.shape) != tuple(shape):
                raise ValueError(f"{name}: fetched shape {arr.shape}, declared {shape}")
            f.write(arr.tobytes())
    return total


def write_checkpoint(
    out_dir: str | os.PathLike, entries: list[TensorSource], max_shard_bytes: int = 5 * 2**30
) -> list[str]:
    """Writes ``model.safetensors`` or, past ``max_shard_bytes``, shards plus the HF index."""
    out = Path(out_dir)
    shards: list[list[TensorSource]] = [[]]
    size = 0
    for entry in entries:
        nbytes = math.prod(entry[1]) * np.dtype(entry[2]).itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    if len(shards) == 1:
        write_safetensors(out / "model.safetensors", shards[0])
        return ["model.safetensors"]
    names, weight_map, total = [], {}, 0
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        total += write_safetensors(out / name, shard)
        names.append(name)
        weight_map.update({e[0]: name for e in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return names
