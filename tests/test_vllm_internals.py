"""The one place trie_decode relies on vLLM internals rather than its public hooks, checked against the installed vLLM.

``validate_params`` receives only the ``SamplingParams``, so ``_frontend_model_config`` finds the engine's
``model_config`` on the caller's stack, inside ``InputProcessor._validate_params``. If vLLM renames or moves any of
this, these tests fail loudly (the processors would silently fall back to checking only trie files at admission).
"""

from __future__ import annotations

import inspect
from functools import partial
from types import SimpleNamespace

import pytest

import vllm  # noqa: F401  (make venv installs it: a missing vLLM fails the suite)

# No engine is started here (the checks read vLLM's source and drive its classes), so a run that deselects the
# engine tests (-m "not vllm") still checks what trie_decode assumes about vLLM.


def test_input_processor_still_validates_logits_processors_with_model_config_on_self():
    from vllm.v1.engine.input_processor import InputProcessor

    source = inspect.getsource(InputProcessor)
    assert "def _validate_params" in source
    # The frontend calls the custom processors' validate_params from _validate_params (V1 and V2 runners).
    validate_src = inspect.getsource(InputProcessor._validate_params)
    assert "self.validate_logits_processors_params(params)" in validate_src, "vLLM moved custom validate_params"
    assert "self.model_config" in source


def test_stack_walk_finds_the_model_config_through_vllms_validation_helper(smollm2_dir, tokenizer):
    """Call vLLM's real validation helper from a method of an object named InputProcessor, as vLLM does."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.sample.logits_processor import validate_logits_processors_parameters

    from trie_decode.integrations import vllm as ours

    seen = []
    real = ours._resolver_for

    def spy(model_config):
        seen.append(model_config)
        return real(model_config)

    model_config = SimpleNamespace(tokenizer=smollm2_dir, tokenizer_revision=None, trust_remote_code=False,
                                   get_vocab_size=lambda: len(tokenizer))

    class InputProcessor:  # the name the stack walk looks for
        def __init__(self):
            self.model_config = model_config

            self.validate_logits_processors_params = partial(validate_logits_processors_parameters,
                                                             [ours.TrieLogitsProcessor])

        def _validate_params(self, params):
            self.validate_logits_processors_params(params)

    ours._resolver_for = spy
    try:
        InputProcessor()._validate_params(SamplingParams(extra_args={"trie": ["red", "green"]}))
        with pytest.raises(VLLMValidationError, match="empty list"):  # vLLM's 400
            InputProcessor()._validate_params(SamplingParams(extra_args={"trie": []}))
    finally:
        ours._resolver_for = real
    assert seen and seen[0] is model_config
