"""What trie_decode assumes about vLLM beyond its public hooks (``integrations/vllm_internals.py``), checked against
the installed vLLM, and what happens on a vLLM that module was not verified against.

``validate_params`` receives only the ``SamplingParams``, so ``vllm_internals.frontend_model_config`` finds the
engine's ``model_config`` on the caller's stack, inside ``InputProcessor._validate_params``; one processor class
serves both runners, told apart by the constructor's arguments; Model Runner V2's token buffers are read through
their 0.32 layout; V1's async placeholders are -1. If vLLM renames or moves any of this, these tests fail loudly
(the processors would otherwise fall back to the general path without anyone noticing). The fallback tests run the
general path (fast paths off, as on an unverified vLLM, and buffers of another layout) against the shared
brute-force reference.
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
    # The model's generation-config EOS ids join a request's stop tokens after validation, from this attribute.
    assert "update_from_generation_config(\n                self.generation_config_fields," in source


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
        def __init__(self, generation_config_fields=None):
            self.model_config = model_config
            self.generation_config_fields = generation_config_fields or {}

            self.validate_logits_processors_params = partial(validate_logits_processors_parameters,
                                                             [ours.TrieLogitsProcessor])

        def _validate_params(self, params):
            self.validate_logits_processors_params(params)

    ours._resolver_for = spy
    try:
        InputProcessor()._validate_params(SamplingParams(extra_args={"trie": ["red", "green"]}))
        with pytest.raises(VLLMValidationError, match="empty list"):  # vLLM's 400
            InputProcessor()._validate_params(SamplingParams(extra_args={"trie": []}))
        # A request's stop_token_ids would stop it inside an entry (" Republic of Korea" came out " Republic"): a 400.
        korea = {"trie": ["Republic of Korea", "Japan"], "leading_space": True}
        of, korea_id = tokenizer.encode(" Republic of Korea", add_special_tokens=False)[1:]
        with pytest.raises(VLLMValidationError, match=rf"contains token {of}, at which generation stops: .*"
                                                      r"\(stop_token_ids\), or build the trie"):
            InputProcessor()._validate_params(SamplingParams(extra_args=korea, stop_token_ids=[7, of]))
        InputProcessor()._validate_params(SamplingParams(extra_args=korea, stop_token_ids=[korea_id]))  # at its end
        # An EOS id of the model's generation config, which vLLM adds to the stop tokens after this check, likewise;
        # not under ignore_eos (vLLM then leaves it out).
        eos_of = InputProcessor({"eos_token_id": [tokenizer.eos_token_id, of]})
        with pytest.raises(VLLMValidationError, match=rf"contains token {of}, at which generation stops: .*"
                                                      r"; build the trie without such entries"):
            eos_of._validate_params(SamplingParams(extra_args=korea))
        eos_of._validate_params(SamplingParams(extra_args=korea, ignore_eos=True))
        InputProcessor({"eos_token_id": of + 1})._validate_params(SamplingParams(extra_args=korea))
    finally:
        ours._resolver_for = real
    assert seen and seen[0] is model_config


# ---------------------------------------------------------------------------------------------- the installed layout
def test_installed_vllm_is_one_the_internals_were_verified_against():
    """An upgraded vLLM fails here first: read its source for every item of vllm_internals' docstring, then add its
    version to VERIFIED_VERSIONS (until then the integration runs its general path and says so once)."""
    from trie_decode.integrations import vllm_internals as internals

    assert internals.is_verified(), (
        f"vLLM {internals.installed_version()} is not in vllm_internals.VERIFIED_VERSIONS {internals.VERIFIED_VERSIONS}: "
        "re-verify integrations/vllm_internals.py against its source")


def test_both_runners_still_construct_processors_the_way_the_internals_expect():
    """V1 runner: ``ctor(vllm_config, device, is_pin_memory)``; Model Runner V2: ``ctor(vllm_config, lp_req_state)``
    (vllm_internals.constructed_by_v2 tells them apart by the argument count on verified versions)."""
    import vllm.v1.sample.logits_processor as v1
    import vllm.v1.worker.gpu.sample.logits_processor.loader as v2

    assert "ctor(vllm_config, device, is_pin_memory)" in inspect.getsource(v1.build_logitsprocs)
    assert "ctor(vllm_config, lp_req_state)" in inspect.getsource(v2.build_custom_logits_processors)
    params = list(inspect.signature(v2.LogitsProcessor.__init__).parameters)
    assert params == ["self", "vllm_config", "req_states"], params


def test_v2_request_state_buffers_have_the_known_layout(monkeypatch, tokenizer):
    """``LogitsProcRequestState`` still wraps ``all_token_ids`` (a 2-D device tensor in ``.gpu``) and ``prompt_len``
    (a host array in ``.np``), the way vllm_internals reads them, built from the runner's real ``RequestState``."""
    import numpy as np
    import torch
    import vllm.v1.worker.gpu.buffer_utils as bu
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcRequestState
    from vllm.v1.worker.gpu.states import RequestState

    from trie_decode.integrations import vllm_internals as internals

    fields = {f for f in LogitsProcRequestState.__dataclass_fields__}
    assert {"all_token_ids", "prompt_len", "total_len"} <= fields, fields
    monkeypatch.setattr(bu, "is_uva_available", lambda: False)
    rs = RequestState(max_num_reqs=3, max_model_len=16, max_num_batched_tokens=16, num_speculative_steps=0,
                      vocab_size=len(tokenizer), device=torch.device("cpu"))
    lp = LogitsProcRequestState.from_request_state(rs)
    assert isinstance(lp.all_token_ids, bu.StagedWriteTensor) and isinstance(lp.prompt_len, bu.UvaBackedTensor)
    assert lp.all_token_ids.gpu.shape == (3, 16) and isinstance(lp.prompt_len.np, np.ndarray)
    lp.prompt_len.np[:] = [4, 7, 9]
    assert internals.v2_token_ids(lp) is lp.all_token_ids.gpu
    assert internals.v2_prompt_lengths(lp, np.array([2, 0])).tolist() == [9, 4]


def test_v1_async_scheduling_placeholders_are_minus_one():
    """vLLM 0.32 fills a request's output list with -1 until the sampled ids arrive (vllm_internals item 4)."""
    from vllm.v1.worker import gpu_input_batch

    from trie_decode.integrations.vllm_internals import real_output_count

    source = inspect.getsource(gpu_input_batch)
    assert "req_output_token_ids[first_placeholder - 1] == -1" in source
    assert real_output_count([3, 4, -1, -1]) == 2 and real_output_count([]) == 0


def test_the_integration_reaches_vllm_internals_only_through_vllm_internals():
    """No frame walk, private vLLM module or private attribute of a vLLM object outside vllm_internals.py."""
    import re
    from pathlib import Path

    folder = Path(__file__).resolve().parent.parent / "integrations"
    for path in sorted(folder.glob("vllm*.py")):
        if path.name == "vllm_internals.py":
            continue
        text = path.read_text()
        assert "_getframe" not in text and "f_locals" not in text and "f_back" not in text, path.name
        assert not re.search(r"from vllm[\w.]*\._|import vllm[\w.]*\._", text), path.name
        # Model Runner V2's buffer attributes (.gpu/.np; a module path such as vllm.v1.worker.gpu.sample is fine)
        assert not re.search(r"\.(gpu|np)\b(?![.\w])", text), path.name


# ---------------------------------------------------------------------------------------------- the general path
@pytest.fixture()
def unverified_vllm(monkeypatch, caplog):
    """The integration as it runs on a vLLM it was not verified against (the installed one, presented as 0.99.0)."""
    import logging

    from trie_decode.integrations import vllm_internals as internals

    monkeypatch.setattr(internals, "installed_version", lambda: "0.99.0")
    # fast_paths() decides once per process and caches the answer in `_state`: a fresh cache for this test (decided
    # again, on the version above), the process's own put back afterwards.
    monkeypatch.setattr(internals, "_state", {})
    caplog.set_level(logging.WARNING, logger="trie_decode.vllm")
    yield caplog


def test_unverified_vllm_warns_once_and_skips_the_stack_walk(unverified_vllm, smollm2_dir, tokenizer, tmp_path,
                                                             monkeypatch):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.sample.logits_processor import validate_logits_processors_parameters

    from trie_decode import TokenTrie
    from trie_decode.integrations import vllm as ours
    from trie_decode.integrations.vllm_access import ENV_ALLOWED_DIRS, STAMP_KEY

    seen = []
    monkeypatch.setattr(ours, "_resolver_for", lambda config: seen.append(config))
    model_config = SimpleNamespace(tokenizer=smollm2_dir, tokenizer_revision=None, trust_remote_code=False,
                                   get_vocab_size=lambda: len(tokenizer))

    class InputProcessor:
        def __init__(self):
            self.model_config = model_config
            self.validate_logits_processors_params = partial(validate_logits_processors_parameters,
                                                             [ours.TrieLogitsProcessor])

        def _validate_params(self, params):
            self.validate_logits_processors_params(params)

    sp = SamplingParams(extra_args={"trie": ["red", "green"]})
    InputProcessor()._validate_params(sp)  # admitted, checked without the engine's tokenizer
    assert STAMP_KEY in sp.extra_args and not seen
    with pytest.raises(VLLMValidationError, match="empty list"):  # what needs no tokenizer is still a 400
        InputProcessor()._validate_params(SamplingParams(extra_args={"trie": []}))
    monkeypatch.setenv(ENV_ALLOWED_DIRS, str(tmp_path))
    TokenTrie.from_strings(["red"], tokenizer).save(tmp_path / "ok.trie")
    InputProcessor()._validate_params(SamplingParams(extra_args={"trie": str(tmp_path / "ok.trie")}))
    with pytest.raises(VLLMValidationError):  # a trie file is still checked on its own
        InputProcessor()._validate_params(SamplingParams(extra_args={"trie": str(tmp_path / "missing.trie")}))
    warnings = [r.getMessage() for r in unverified_vllm.records if "not a version" in r.getMessage()]
    assert len(warnings) == 1 and "0.99.0" in warnings[0] and "0.32.0" in warnings[0], warnings


def test_unverified_vllm_processors_match_the_reference(unverified_vllm, smollm2_dir, tokenizer, monkeypatch):
    """With the fast paths off, both runners' processors are recognized by their arguments' kinds (V1 by keyword
    here, V2 from vLLM's own loader) and mask every step as the shared reference says, filters and repeat lists
    included. Model Runner V2's buffers are handed over as plain tensors (another layout vllm_internals accepts)."""
    import random

    import numpy as np
    import torch
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext

    from trie_decode.integrations.vllm import TrieLogitsProcessor
    from trie_decode.integrations import vllm_internals as internals

    from test_vllm_filters_reference import _case, _finite

    model_config = SimpleNamespace(tokenizer=smollm2_dir, tokenizer_revision=None, trust_remote_code=False,
                                   get_vocab_size=lambda: len(tokenizer))
    cfg = SimpleNamespace(model_config=model_config, speculative_config=None)
    eos, v = tokenizer.eos_token_id, len(tokenizer)
    with pytest.raises(TypeError, match="expects the V1 runner"):
        TrieLogitsProcessor(cfg, 3.5)
    for seed in (8, 10, 13):  # cases whose repeat lists pass a separator that is also a denied entry's token
        # V1, constructed with keywords (the arity rule is off)
        case = _case(seed, eos)
        v1 = TrieLogitsProcessor(cfg, device=torch.device("cpu"), is_pin_memory=False)
        assert v1._v2 is False
        outs = [[] for _ in case]
        v1.update_state(BatchUpdate(batch_size=4, removed=[], moved=[], added=[
            (i, SamplingParams(extra_args=extra), [1] + prefix, outs[i]) for i, (extra, _, prefix) in enumerate(case)]))
        rng = random.Random(seed)
        for step in range(12):
            logits = v1.apply(torch.zeros(4, v))
            for i, (_, ref, _) in enumerate(case):
                assert _finite(logits[i]) == ref.allowed(), (seed, step, i)
                tok = rng.choice(sorted(ref.allowed()))
                ref.step(tok)
                outs[i].append(tok)
            v1.update_state(None)
        # V2 with plain tensors for its buffers
        case = _case(seed, eos)
        tokens = torch.zeros(4, 64, dtype=torch.int32)
        prompt_len = torch.zeros(4, dtype=torch.int32)
        req_states = SimpleNamespace(device=torch.device("cpu"), all_token_ids=tokens, prompt_len=prompt_len)
        v2 = TrieLogitsProcessor(cfg, req_states)
        assert v2._v2 is True
        lengths = []
        for slot, (extra, _, prefix) in enumerate(case):
            assert v2.add_request(slot, SamplingParams(extra_args=extra))
            ids = [1] + prefix
            tokens[slot, : len(ids)] = torch.tensor(ids)
            prompt_len[slot] = len(ids)
            lengths.append(len(ids))
        order = np.array([3, 1, 0, 2], dtype=np.int64)
        for step in range(12):
            idx = torch.from_numpy(order)
            ctx = LogitsContext(idx, idx, order, torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64),
                                torch.zeros(4, dtype=torch.int64), np.array([lengths[s] for s in order]))
            logits = v2.apply(torch.zeros(4, v), ctx)
            for row, slot in enumerate(order.tolist()):
                ref = case[slot][1]
                assert _finite(logits[row]) == ref.allowed(), (seed, step, slot)
                tok = rng.choice(sorted(ref.allowed()))
                ref.step(tok)
                tokens[slot, lengths[slot]] = tok
                lengths[slot] += 1
            order = order[::-1].copy()
    assert not internals.fast_paths()
    # A layout vllm_internals does not know is refused when the processor is built, with the way out named.
    with pytest.raises(TypeError, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        TrieLogitsProcessor(cfg, SimpleNamespace(device=torch.device("cpu"), all_token_ids=object(), prompt_len=None))


def test_the_api_key_middleware_is_where_the_beam_search_guard_looks():
    """``TrieBeamSearchGuard`` lets vLLM's ``--api-key`` check answer first (``vllm_internals`` item 5): the class is
    where that module says, vLLM adds it before the ``--middleware`` classes (so it runs inside them), and the chain
    walk finds it behind other layers. tests/test_vllm_beam_guard.py runs it in vLLM's own app."""
    import importlib
    from types import SimpleNamespace

    from vllm.entrypoints.serve.middleware import register

    from trie_decode.integrations import vllm_internals

    module, name = vllm_internals._AUTH_CLASS
    cls = getattr(importlib.import_module(module), name)
    source = inspect.getsource(register.init_entrypoints_middleware)
    assert source.index(f"add_middleware({name}") < source.index("for middleware in args.middleware")
    auth = cls(SimpleNamespace(), tokens=["key"])
    assert vllm_internals.api_key_middleware(SimpleNamespace(app=SimpleNamespace(app=auth))) is auth
    assert vllm_internals.api_key_middleware(SimpleNamespace(app=None)) is None
