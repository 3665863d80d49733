"""The V1 processor's batch bookkeeping, driven with vLLM's own BatchUpdate (no engine): requests are added,
removed, moved one way and swapped, output lists grow between steps (sometimes by several tokens, as after a
preemption), and every constrained row's allowed set must match the trie at the row's own position."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import vllm  # noqa: E402,F401  (make venv installs it: a missing vLLM fails the suite)

pytestmark = [pytest.mark.vllm, pytest.mark.model]

COLORS = ["red", "green", "blue", "yellow", "purple", "orange", "black", "white"]


def _proc(smollm2_dir, tokenizer):
    import torch

    from trie_decode.integrations.vllm import TrieLogitsProcessor

    model_config = SimpleNamespace(tokenizer=smollm2_dir, tokenizer_revision=None, trust_remote_code=False,
                                   get_vocab_size=lambda: len(tokenizer))
    cfg = SimpleNamespace(model_config=model_config, scheduler_config=SimpleNamespace(max_num_seqs=4))
    return TrieLogitsProcessor(cfg, torch.device("cpu"), False)


def _allowed(proc, batch, vocab):
    import torch

    logits = torch.zeros(batch, vocab)
    out = proc.apply(logits)
    return [set(torch.isfinite(out[i]).nonzero().flatten().tolist()) for i in range(batch)]


def _expect(trie, generated, eos):
    if generated and generated[-1] == eos:
        return {eos}
    node = trie.walk(generated)
    return set(trie.children(node)[0].tolist()) | ({eos} if trie.is_terminal(node) else set())


def test_v1_batch_updates_follow_requests(smollm2_dir, tokenizer, tmp_path):
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

    from trie_decode import TokenTrie

    eos = tokenizer.eos_token_id
    v = len(tokenizer)
    proc = _proc(smollm2_dir, tokenizer)
    assert proc.is_argmax_invariant() is False
    colors = TokenTrie.from_strings(COLORS, tokenizer)
    words = ["Bosnia and Herzegovina", "Botswana", "Brazil"]
    places = TokenTrie.from_strings(words, tokenizer)
    a_out, b_out, c_out = [], [], []
    sp_a = SamplingParams(extra_args={"trie": COLORS})
    sp_b = SamplingParams(extra_args={"trie": words})
    proc.update_state(BatchUpdate(batch_size=3, removed=[], moved=[],
                                  added=[(0, sp_a, [1, 2], a_out), (1, SamplingParams(), [1], c_out), (2, sp_b, [3], b_out)]))
    allowed = _allowed(proc, 3, v)
    assert allowed[0] == _expect(colors, [], eos) and allowed[1] == set(range(v)) and allowed[2] == _expect(places, [], eos)

    # Each request appends a token (several for b: as if it had been preempted and resumed).
    a_out.append(tokenizer("blue", add_special_tokens=False)["input_ids"][0])
    b_out.extend(tokenizer("Bosnia", add_special_tokens=False)["input_ids"])
    c_out.append(5)
    proc.update_state(None)
    allowed = _allowed(proc, 3, v)
    assert allowed[0] == _expect(colors, a_out, eos) and allowed[2] == _expect(places, b_out, eos)

    # Swap a (0) and b (2), then remove the unconstrained request and move b from 0 to 1.
    proc.update_state(BatchUpdate(batch_size=3, removed=[], added=[], moved=[(0, 2, MoveDirectionality.SWAP)]))
    allowed = _allowed(proc, 3, v)
    assert allowed[2] == _expect(colors, a_out, eos) and allowed[0] == _expect(places, b_out, eos)
    proc.update_state(BatchUpdate(batch_size=2, removed=[1], added=[], moved=[(0, 1, MoveDirectionality.UNIDIRECTIONAL)]))
    allowed = _allowed(proc, 3, v)
    assert allowed[1] == _expect(places, b_out, eos) and allowed[0] == set(range(v))

    # A request that reaches the engine without validation (its file vanished) only gets the end token.
    missing = SamplingParams(extra_args={"trie": str(tmp_path / "gone.trie")})
    proc.update_state(BatchUpdate(batch_size=3, removed=[], moved=[], added=[(0, missing, [1], [])]))
    allowed = _allowed(proc, 3, v)
    assert allowed[0] == {eos} and allowed[1] == _expect(places, b_out, eos)


def test_v1_stop_at_forced_and_prefix(smollm2_dir, tokenizer):
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    from trie_decode import TokenTrie

    eos = tokenizer.eos_token_id
    words = ["Bosnia and Herzegovina", "Botswana"]
    trie = TokenTrie.from_strings(words, tokenizer)
    seq = tokenizer(words[0], add_special_tokens=False)["input_ids"]
    proc = _proc(smollm2_dir, tokenizer)
    # After the first token of "Bosnia ..." (if the split leaves a forced run), stop_at_forced=1 allows only EOS.
    node = trie.walk(seq[:2])
    run = trie.forced_run(node)
    sp = SamplingParams(extra_args={"trie": words, "prefix": seq[:2], "stop_at_forced": 1})
    proc.update_state(BatchUpdate(batch_size=1, removed=[], moved=[], added=[(0, sp, [1], [])]))
    allowed = _allowed(proc, 1, len(tokenizer))[0]
    assert allowed == ({eos} if run else _expect(trie, seq[:2], eos))
