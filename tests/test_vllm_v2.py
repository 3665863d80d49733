"""Model Runner V2 interface, driven through vLLM's own classes (no engine: MRV2 needs Triton to run end to end).

vLLM's loader instantiates the processor from its FQCN with a real ``RequestState`` (on CPU, with the non-pinned
buffer fallback); the test then plays the runner: it writes prompts and committed tokens into
``all_token_ids``/``total_len``, reorders the batch every step (``LogitsContext.idx_mapping``), samples greedily
from random logits after ``apply`` and checks every constrained row against the trie, and that unconstrained rows
are untouched.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import vllm  # noqa: E402,F401  (make venv installs it: a missing vLLM fails the suite)

pytestmark = [pytest.mark.vllm, pytest.mark.model]

COLORS = ["red", "green", "blue", "yellow", "purple", "orange", "black", "white"]


@pytest.fixture()
def req_states(monkeypatch, tokenizer):
    import torch
    import vllm.v1.worker.gpu.buffer_utils as bu
    from vllm.v1.worker.gpu.states import RequestState

    monkeypatch.setattr(bu, "is_uva_available", lambda: False)  # CPU: no pinned memory, use the copy fallback
    return RequestState(
        max_num_reqs=4,
        max_model_len=256,
        max_num_batched_tokens=256,
        num_speculative_steps=0,
        vocab_size=len(tokenizer),
        device=torch.device("cpu"),
    )


def _vllm_config(smollm2_dir, tokenizer):
    model_config = SimpleNamespace(tokenizer=smollm2_dir, tokenizer_revision=None, trust_remote_code=False,
                                   get_vocab_size=lambda: len(tokenizer))
    return SimpleNamespace(model_config=model_config, speculative_config=None)


def test_loader_accepts_v2_and_dual_rejects_v1():
    from vllm.v1.worker.gpu.sample.logits_processor.loader import _load_v2_logitsprocs_by_fqcns

    from trie_decode.integrations.vllm import FQCN, TrieLogitsProcessor, TrieLogitsProcessorV1, TrieLogitsProcessorV2

    assert _load_v2_logitsprocs_by_fqcns([FQCN]) == [TrieLogitsProcessor]
    assert _load_v2_logitsprocs_by_fqcns([TrieLogitsProcessorV2]) == [TrieLogitsProcessorV2]
    with pytest.raises(ValueError):
        _load_v2_logitsprocs_by_fqcns([TrieLogitsProcessorV1])
    from vllm.v1.sample.logits_processor import _load_logitsprocs_by_fqcns

    assert _load_logitsprocs_by_fqcns([FQCN]) == [TrieLogitsProcessor]
    with pytest.raises(ValueError):
        _load_logitsprocs_by_fqcns([TrieLogitsProcessorV2])


def test_v2_params_validator_rejects_bad_requests(tmp_path):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.worker.gpu.sample.logits_processor import build_custom_logits_processors_params_validator

    from trie_decode.integrations.vllm import FQCN

    validate = build_custom_logits_processors_params_validator([FQCN])
    validate(SamplingParams(max_tokens=4))
    validate(SamplingParams(max_tokens=4, extra_args={"other_processor": 1}))
    validate(SamplingParams(max_tokens=4, extra_args={"trie": ["a", "b"]}))
    for extra in ({"trie": str(tmp_path / "missing.trie")}, {"trie": []}, {"trie": ["a"], "trie_x": 1},
                  {"trie": ["a"], "on_complete": "never"}):
        with pytest.raises(VLLMValidationError):
            validate(SamplingParams(max_tokens=4, extra_args=extra))


@pytest.mark.parametrize("fqcn", ["trie_decode.integrations.vllm:TrieLogitsProcessor",
                                  "trie_decode.integrations.vllm:TrieLogitsProcessorV2"])
def test_v2_apply_through_vllm_classes(req_states, smollm2_dir, tokenizer, fqcn):
    import torch
    from vllm import SamplingParams
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext, build_custom_logits_processors

    from trie_decode import TokenTrie
    from trie_decode.integrations.vllm import trie_args

    (proc,) = build_custom_logits_processors(_vllm_config(smollm2_dir, tokenizer), req_states, False, [fqcn])
    eos = tokenizer.eos_token_id
    nums = [tokenizer(" " + w, add_special_tokens=False)["input_ids"] for w in ("one", "two", "three", "twenty")]
    tries = {0: TokenTrie.from_strings(COLORS, tokenizer), 1: TokenTrie.from_sequences(nums, len(tokenizer))}
    trigger = tokenizer("Answer:", add_special_tokens=False)["input_ids"]
    params = {
        0: SamplingParams(extra_args=trie_args(COLORS)),
        1: SamplingParams(extra_args={"trie": nums, "trigger": "Answer:"}),
        3: SamplingParams(),
    }
    prompts = {0: tokenizer("Pick a color:")["input_ids"], 1: tokenizer("Pick a number.")["input_ids"] + trigger,
               3: tokenizer("Hello")["input_ids"]}
    for slot, sp in params.items():
        assert proc.add_request(slot, sp) is (slot != 3)
        ids = prompts[slot]
        req_states.all_token_ids.gpu[slot, : len(ids)] = torch.tensor(ids)
        req_states.prompt_len.np[slot] = len(ids)
        req_states.prefill_len.np[slot] = len(ids)
        req_states.total_len.gpu[slot] = len(ids)

    gen = torch.Generator().manual_seed(0)
    out = {s: [] for s in params}
    active = [0, 1, 3]
    for step in range(12):
        order = np.array(active if step % 2 == 0 else active[::-1], dtype=np.int64)  # rows move every step
        idx = torch.from_numpy(order)
        logits = torch.randn(len(order), len(tokenizer), generator=gen)
        before = logits.clone()
        ctx = LogitsContext(
            expanded_idx_mapping=idx, idx_mapping=idx, idx_mapping_np=order,
            expanded_local_pos=torch.zeros(len(order), dtype=torch.int64),
            input_ids=torch.zeros(len(order), dtype=torch.int64), pos=torch.zeros(len(order), dtype=torch.int64),
            # what the runner passes: num_computed_tokens + scheduled tokens, i.e. each row's committed tokens
            seq_lens_upper_bound_np=np.array([int(req_states.total_len.gpu[s]) for s in order], dtype=np.int64),
        )
        logits = proc.apply(logits, ctx)
        picked = logits.argmax(dim=1).tolist()
        for row, slot in enumerate(order.tolist()):
            if slot == 3:
                assert torch.equal(logits[row], before[row]), "unconstrained rows are untouched"
            else:
                trie = tries[slot]
                node = trie.walk(out[slot])
                finite = set(torch.isfinite(logits[row]).nonzero().flatten().tolist())
                if out[slot] and out[slot][-1] == eos:
                    assert finite == {eos}
                else:
                    expect = set(trie.children(node)[0].tolist()) | ({eos} if trie.is_terminal(node) else set())
                    assert finite == expect, (slot, step)
            tok = picked[row]
            out[slot].append(tok)
            pos = int(req_states.total_len.gpu[slot])
            req_states.all_token_ids.gpu[slot, pos] = tok
            req_states.total_len.gpu[slot] = pos + 1
    for slot in (0, 1):
        ids = out[slot][: out[slot].index(eos)]
        assert tries[slot].lookup(ids) is not None

    # Slot recycling: a new request in slot 0 starts fresh (and an unconstrained one is left alone).
    assert proc.add_request(0, SamplingParams()) is False
    assert proc.add_request(0, SamplingParams(extra_args=trie_args(["purple"]))) is True
    req_states.total_len.gpu[0] = len(prompts[0])
    idx = torch.tensor([0])
    logits = torch.zeros(1, len(tokenizer))
    ctx = LogitsContext(idx, idx, np.array([0]), torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                        torch.zeros(1, dtype=torch.int64), np.array([len(prompts[0])], dtype=np.int64))
    first = tokenizer("purple", add_special_tokens=False)["input_ids"][0]
    assert torch.isfinite(proc.apply(logits, ctx)[0]).nonzero().flatten().tolist() == [first]


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_v2_apply_reads_nothing_back_from_the_device(req_states, smollm2_dir, tokenizer, monkeypatch, kernel):
    """Every step of ``apply`` (catch-up and mask) runs under a guard that raises on any read of a tensor's values
    on the host: the state stays on the device, the tokens are gathered there, and only host-side bookkeeping
    (vLLM's own ``idx_mapping_np`` and ``seq_lens_upper_bound_np``) decides shapes. With the torch kernel this is
    the GPU path, run on this CPU."""
    import torch
    from vllm import SamplingParams
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext, build_custom_logits_processors

    from test_device_step import no_host_sync
    from trie_decode import TokenTrie, kernels
    from trie_decode.integrations.vllm import trie_args

    if kernel == "torch":  # the kernel CUDA and MPS logits get
        select = kernels.select
        monkeypatch.setattr(kernels, "select", lambda device, name=None: select(device, name or "torch"))
    (proc,) = build_custom_logits_processors(_vllm_config(smollm2_dir, tokenizer), req_states, False,
                                             ["trie_decode.integrations.vllm:TrieLogitsProcessorV2"])
    eos = tokenizer.eos_token_id
    trigger = tokenizer("Answer:", add_special_tokens=False)["input_ids"]
    params = {0: SamplingParams(extra_args=trie_args(COLORS)),
              2: SamplingParams(extra_args={"trie": COLORS, "trigger": "Answer:"})}
    prompts = {0: tokenizer("Pick a color:")["input_ids"], 2: tokenizer("Pick one.")["input_ids"] + trigger}
    for slot, sp in params.items():
        assert proc.add_request(slot, sp)
        ids = prompts[slot]
        req_states.all_token_ids.gpu[slot, : len(ids)] = torch.tensor(ids)
        req_states.prompt_len.np[slot] = len(ids)
        req_states.total_len.gpu[slot] = len(ids)
    trie = TokenTrie.from_strings(COLORS, tokenizer)
    out = {s: [] for s in params}
    order = np.array([2, 0], dtype=np.int64)
    for step in range(8):
        idx = torch.from_numpy(order)
        bound = np.array([len(prompts[s]) + len(out[s]) for s in order.tolist()], dtype=np.int64)
        ctx = LogitsContext(idx, idx, order, torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64),
                            torch.zeros(2, dtype=torch.int64), bound)
        logits = torch.randn(2, len(tokenizer))
        with no_host_sync():
            logits = proc.apply(logits, ctx)
        for row, slot in enumerate(order.tolist()):
            done = bool(out[slot]) and out[slot][-1] == eos
            node = trie.walk(out[slot][:-1] if done else out[slot])
            expect = {eos} if done else set(trie.children(node)[0].tolist()) | ({eos} if trie.is_terminal(node) else set())
            assert set(torch.isfinite(logits[row]).nonzero().flatten().tolist()) == expect, (slot, step)
            tok = int(logits[row].argmax())
            out[slot].append(tok)
            req_states.all_token_ids.gpu[slot, len(prompts[slot]) + len(out[slot]) - 1] = tok
        order = order[::-1].copy()  # rows move every step
    assert all(trie.lookup(out[s][: out[s].index(eos)]) is not None for s in params)


def test_v2_chunked_prefill_starts_a_row_only_once_its_prompt_is_in(req_states, smollm2_dir, tokenizer):
    """Chunked prefill: Model Runner V2 calls ``apply`` for a request whose prompt is only partly computed (its
    ``seq_lens_upper_bound`` is below the prompt length; the runner drops that row's token). Before, the processor
    started such a row there, reading its trigger or span tail cut at the chunk's end: a prompt that ends with the
    trigger (or a span's ``after``) then left the whole entry unconstrained (all 49,152 tokens open). Now the row
    starts at the step where its prompt is in, and masks exactly as if the prompt had come in one piece."""
    import torch
    from vllm import SamplingParams
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext, build_custom_logits_processors

    from reference import allowed_after
    from trie_decode import TokenTrie
    from trie_decode.constraint import SpanRules

    eos = tokenizer.eos_token_id
    trigger = tuple(tokenizer("Answer:", add_special_tokens=False)["input_ids"])
    params = {0: SamplingParams(extra_args={"trie": COLORS, "trigger": "Answer:"}),
              1: SamplingParams(extra_args={"spans": [{"after": '"city": "', "values": ["Paris", "Rome"], "end": '"'}]}),
              2: SamplingParams(extra_args={"trie": COLORS})}
    prompts = {0: tokenizer("Pick a color, then write it after the colon.")["input_ids"] + list(trigger),
               1: tokenizer('Write the JSON. {"city": "')["input_ids"],
               2: tokenizer("Pick a color:")["input_ids"]}
    (proc,) = build_custom_logits_processors(_vllm_config(smollm2_dir, tokenizer), req_states, False,
                                             ["trie_decode.integrations.vllm:TrieLogitsProcessorV2"])
    for slot, sp in params.items():
        assert proc.add_request(slot, sp)
        ids = prompts[slot]
        req_states.all_token_ids.gpu[slot, : len(ids)] = torch.tensor(ids)
        req_states.prompt_len.np[slot] = req_states.prefill_len.np[slot] = len(ids)

    def step(ends):
        order = np.array([2, 0, 1], dtype=np.int64)
        idx = torch.from_numpy(order)
        ctx = LogitsContext(idx, idx, order, torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64),
                            torch.zeros(3, dtype=torch.int64), np.array([ends[s] for s in order.tolist()]))
        out = proc.apply(torch.zeros(3, len(tokenizer)), ctx)
        return {s: set(torch.isfinite(out[i]).nonzero().flatten().tolist()) for i, s in enumerate(order.tolist())}

    full = {s: len(p) for s, p in prompts.items()}
    step({0: 3, 1: 4, 2: 2})  # first chunks of every prompt
    step({0: full[0] - 1, 1: full[1] - 2, 2: full[2]})  # slot 2 is in and samples; 0 and 1 still prefill
    got = step(full)
    colors = TokenTrie.from_strings(COLORS, tokenizer)
    assert got[0] == allowed_after(colors.sequences(), SpanRules(end_token_id=eos, trigger=trigger), [],
                                   prompt_tail=tuple(prompts[0]))
    assert len(got[0]) == len(COLORS)
    assert got[1] == {tokenizer(c, add_special_tokens=False)["input_ids"][0] for c in ("Paris", "Rome")}
    assert got[2] == allowed_after(colors.sequences(), SpanRules(end_token_id=eos), [])
