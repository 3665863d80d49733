"""The vLLM processors (V1 and Model Runner V2) with allow/deny filters against the shared brute-force reference
(tests/reference.py), without an engine: every step, every constrained row allows exactly what the reference over
the row's usable entries allows, and the row then advances by a token that set holds (issue 22: the processors
masked with the filters but advanced without them, so a separator that is also an excluded child's token walked
into the excluded subtree).

The V1 processor is driven with vLLM's own ``BatchUpdate`` (outputs sometimes grow by two tokens between steps, as
after a preemption, and one request resumes at a ``prefix``); the V2 processor with a real ``RequestState`` whose
rows move every step.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest

import vllm  # noqa: F401  (make venv installs it: a missing vLLM fails the suite)

from reference import SpanReference
from trie_decode.constraint import SpanRules

pytestmark = [pytest.mark.vllm, pytest.mark.model]

PARIS, COMMA, FRANCE = 7042, 28, 4649  # SmolLM2: " Paris", ",", " France"
BASE = 100  # entries use tokens BASE..BASE+5 (real vocabulary ids; which ones does not matter)
SEP = BASE + 1  # entries may hold the separator's token: a terminal node may have a child that is its separator


def _model_config(smollm2_dir, tokenizer):
    return SimpleNamespace(tokenizer=smollm2_dir, tokenizer_revision=None, trust_remote_code=False,
                           get_vocab_size=lambda: len(tokenizer))


def _v1(smollm2_dir, tokenizer):
    import torch

    from trie_decode.integrations.vllm import TrieLogitsProcessor

    cfg = SimpleNamespace(model_config=_model_config(smollm2_dir, tokenizer))
    return TrieLogitsProcessor(cfg, torch.device("cpu"), False)


def _finite(row) -> set[int]:
    import torch

    return set(torch.isfinite(row).nonzero().flatten().tolist())


def _case(seed: int, eos: int, count: int = 4) -> list[tuple[dict, SpanReference, list[int]]]:
    """``count`` requests over one random trie: (extra_args, the reference over the row's usable entries, prefix).
    The first four of a seed are the same whatever the count."""
    from trie_decode import TokenTrie

    rng = random.Random(seed)
    seqs = {tuple(BASE + rng.randrange(6) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(2, 9))}
    repeat = seed % 3 != 0
    # An entry that goes on past another's end with the separator's token (issue 22's " Paris" / " Paris, France").
    short = rng.choice(sorted(seqs))
    trap = short + (SEP,) + tuple(BASE + rng.randrange(6) for _ in range(rng.randint(0, 2)))
    seqs = sorted(seqs | {trap})
    trie = TokenTrie.from_sequences([list(s) for s in seqs], vocab_size=BASE + 6)
    entries = [tuple(trie.entry(i).tokens) for i in range(trie.num_entries)]
    rules = SpanRules(end_token_id=eos, **(dict(on_complete="repeat", separator=(SEP,)) if repeat else {}))
    out = []
    for r in range(count):
        while True:
            allow = None if rng.random() < 0.4 else rng.sample(range(len(entries)), rng.randint(1, len(entries)))
            deny = rng.sample(range(len(entries)), rng.randint(0, max(len(entries) // 2, 1)))
            if rng.random() < 0.6:
                deny = sorted(set(deny) | {entries.index(trap)})
            usable = (set(range(len(entries))) if allow is None else set(allow)) - set(deny)
            if usable:
                break
        extra = {"trie": [list(s) for s in seqs], "deny": deny}
        if allow is not None:
            extra["allow"] = allow
        if repeat:
            extra.update(on_complete="repeat", separator=[SEP])
        ref = SpanReference({entries[i] for i in usable}, rules)
        prefix: list[int] = []
        if not repeat and r == 3:  # a resubmitted request (beam search, fast-forward) resumes at its prefix
            while len(prefix) < 2 and ref.allowed() and ref.allowed() != {eos}:
                tok = rng.choice(sorted(ref.allowed() - {eos}))
                ref.step(tok)
                prefix.append(tok)
            if prefix:
                extra["prefix"] = list(prefix)
        out.append((extra, ref, prefix))
    return out


@pytest.mark.parametrize("seed", range(24))
def test_v1_rows_with_filters_follow_the_reference(smollm2_dir, tokenizer, seed):
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    import torch

    eos = tokenizer.eos_token_id
    proc = _v1(smollm2_dir, tokenizer)
    case = _case(seed, eos)
    outputs: list[list[int]] = [[] for _ in case]
    added = [(i, SamplingParams(extra_args=extra), [1, 5] + prefix, outputs[i]) for i, (extra, _, prefix) in enumerate(case)]
    proc.update_state(BatchUpdate(batch_size=len(case), removed=[], moved=[], added=added))
    rng = random.Random(seed)
    for step in range(14):
        logits = proc.apply(torch.zeros(len(case), len(tokenizer)))
        for i, (_, ref, _) in enumerate(case):
            got = _finite(logits[i])
            assert got == ref.allowed(), (seed, step, i, outputs[i], ref.state)
            tok = rng.choice(sorted(got))
            ref.step(tok)
            outputs[i].append(tok)
            if rng.random() < 0.25:  # two tokens before the next apply (a preemption): the catch-up runs them both
                tok = rng.choice(sorted(ref.allowed()))
                ref.step(tok)
                outputs[i].append(tok)
        proc.update_state(None)


def test_v1_repeat_separator_that_is_a_denied_entrys_token_continues_the_list(smollm2_dir, tokenizer):
    """Issue 22's measured case, without the engine: entries " Paris" and " Paris, France", the second denied,
    ``on_complete="repeat"`` with separator ",". After " Paris," the row is at the start of the next entry."""
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    import torch

    eos = tokenizer.eos_token_id
    proc = _v1(smollm2_dir, tokenizer)
    extra = {"trie": [" Paris", " Paris, France"], "deny": [" Paris, France"], "on_complete": "repeat",
             "separator": ","}
    out: list[int] = []
    proc.update_state(BatchUpdate(batch_size=1, removed=[], moved=[], added=[(0, SamplingParams(extra_args=extra), [1], out)]))
    ref = SpanReference({(PARIS,)}, SpanRules(end_token_id=eos, on_complete="repeat", separator=(COMMA,)))
    for tok in (PARIS, COMMA, PARIS, COMMA):
        assert _finite(proc.apply(torch.zeros(1, len(tokenizer)))[0]) == ref.allowed()
        ref.step(tok)
        out.append(tok)
        proc.update_state(None)
    assert _finite(proc.apply(torch.zeros(1, len(tokenizer)))[0]) == ref.allowed() == {PARIS}


@pytest.mark.parametrize("kernel", ["native", "torch"])
@pytest.mark.parametrize("seed", range(12))
def test_v1_a_request_replacing_another_in_its_slot_is_masked_as_by_a_fresh_processor(smollm2_dir, tokenizer,
                                                                                      monkeypatch, seed, kernel):
    """vLLM fills a finished request's slot with a new one (the slot is in ``added``, not in ``removed``): one row's
    filter changes, and the processor counts only the new filter (the other rows' are found as they were). Every
    step, each row allows exactly what the reference over its own usable entries allows, and the batch is masked
    exactly as by a fresh processor given the same requests and outputs: nothing of a replaced request's filter
    stays in its slot."""
    import torch
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    from trie_decode import kernels

    if kernel == "torch":  # the kernel CUDA and MPS logits get (the padded rank sets, no node flags)
        select = kernels.select
        monkeypatch.setattr(kernels, "select", lambda device, name=None: select(device, name or "torch"))
    eos, width = tokenizer.eos_token_id, len(tokenizer)
    case = _case(seed, eos, count=12)
    proc = _v1(smollm2_dir, tokenizer)
    slots: dict[int, tuple[dict, SpanReference, list[int], list[int]]] = {}  # slot -> (extra, ref, prompt, outputs)

    def add(slot: int, request: tuple) -> tuple:
        extra, ref, prefix = request
        slots[slot] = (extra, ref, [1, 5] + prefix, [])
        return (slot, SamplingParams(extra_args=extra), slots[slot][2], slots[slot][3])

    proc.update_state(BatchUpdate(batch_size=4, removed=[], moved=[], added=[add(i, case[i]) for i in range(4)]))
    waiting = case[4:]
    rng = random.Random(seed)
    for step in range(16):
        logits = proc.apply(torch.zeros(4, width))
        fresh = _v1(smollm2_dir, tokenizer)
        fresh.update_state(BatchUpdate(batch_size=4, removed=[], moved=[], added=[
            (s, SamplingParams(extra_args=extra), prompt, list(out)) for s, (extra, _, prompt, out) in slots.items()]))
        assert torch.equal(fresh.apply(torch.zeros(4, width)), logits), (seed, step)
        for slot, (_, ref, _, out) in slots.items():
            got = _finite(logits[slot])
            assert got == ref.allowed(), (seed, step, slot, out, ref.state)
            tok = rng.choice(sorted(got))
            ref.step(tok)
            out.append(tok)
        added = []
        if waiting and step % 2 == 0:  # a new request where one finished (sometimes two at once)
            for slot in rng.sample(range(4), 1 + (rng.random() < 0.3)):
                if waiting:
                    added.append(add(slot, waiting.pop(0)))
        proc.update_state(BatchUpdate(batch_size=4, removed=[], moved=[], added=added) if added else None)
    assert not waiting


@pytest.fixture()
def req_states(monkeypatch, tokenizer):
    import torch
    import vllm.v1.worker.gpu.buffer_utils as bu
    from vllm.v1.worker.gpu.states import RequestState

    monkeypatch.setattr(bu, "is_uva_available", lambda: False)  # CPU: no pinned memory, use the copy fallback
    return RequestState(max_num_reqs=4, max_model_len=128, max_num_batched_tokens=128, num_speculative_steps=0,
                        vocab_size=len(tokenizer), device=torch.device("cpu"))


@pytest.mark.parametrize("kernel", ["native", "torch"])
@pytest.mark.parametrize("seed", range(24))
def test_v2_rows_with_filters_follow_the_reference(req_states, smollm2_dir, tokenizer, monkeypatch, seed, kernel):
    """With the torch kernel (the one CUDA and MPS logits get) every ``apply`` runs under a guard that raises on any
    read of a tensor's values on the host: advancing with the filters adds no device-to-host sync."""
    import contextlib

    import torch
    from vllm import SamplingParams
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext, build_custom_logits_processors

    from test_device_step import no_host_sync
    from trie_decode import kernels

    if kernel == "torch":  # the kernel CUDA and MPS logits get, run on this CPU
        select = kernels.select
        monkeypatch.setattr(kernels, "select", lambda device, name=None: select(device, name or "torch"))
    cfg = SimpleNamespace(model_config=_model_config(smollm2_dir, tokenizer), speculative_config=None)
    (proc,) = build_custom_logits_processors(cfg, req_states, False, ["trie_decode.integrations.vllm:TrieLogitsProcessorV2"])
    eos = tokenizer.eos_token_id
    case = _case(seed, eos)
    for slot, (extra, _, prefix) in enumerate(case):
        assert proc.add_request(slot, SamplingParams(extra_args=extra))
        ids = [1, 5] + prefix
        req_states.all_token_ids.gpu[slot, : len(ids)] = torch.tensor(ids)
        req_states.prompt_len.np[slot] = len(ids)
        req_states.total_len.gpu[slot] = len(ids)
    rng = random.Random(seed)
    order = np.arange(len(case), dtype=np.int64)
    for step in range(14):
        rng.shuffle(order)  # rows move every step
        idx = torch.from_numpy(order.copy())
        bound = np.array([int(req_states.total_len.gpu[s]) for s in order], dtype=np.int64)
        ctx = LogitsContext(idx, idx, order.copy(), torch.zeros(len(order), dtype=torch.int64),
                            torch.zeros(len(order), dtype=torch.int64), torch.zeros(len(order), dtype=torch.int64), bound)
        logits = torch.zeros(len(order), len(tokenizer))
        with no_host_sync() if kernel == "torch" else contextlib.nullcontext():
            logits = proc.apply(logits, ctx)
        for row, slot in enumerate(order.tolist()):
            ref = case[slot][1]
            got = _finite(logits[row])
            assert got == ref.allowed(), (seed, step, slot, ref.state)
            tok = rng.choice(sorted(got))
            ref.step(tok)
            pos = int(req_states.total_len.gpu[slot])
            req_states.all_token_ids.gpu[slot, pos] = tok
            req_states.total_len.gpu[slot] = pos + 1
