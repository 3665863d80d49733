"""An entry that holds the end token before its last token, where ``generate`` stops at that token.

Generation stops at ``generate``'s own stop ids (``eos_token_id``). When the processor's end token is one of them
and an entry holds it before its end (end token "." and the entry " U.S. Virgin Islands"), the row stopped inside
the entry and its output was no entry: a silently wrong answer. ``generate`` now refuses such a trie at its first
step, before any token is chosen (the processor, greedy, sampling, beam search, assisted decoding, ``rank``), and
``fast_forward_generate`` before its prefill, in every ``on_complete`` mode, for every stop id (the end token or
another). An end token that is not a stop id, an entry that ends with it and a caller of one's own run as before.
"""

from __future__ import annotations

import inspect

import numpy as np

import pytest
import torch

from trie_decode import TokenTrie
from trie_decode.errors import ConstraintConfigError
from trie_decode.integrations.fast_forward import fast_forward_generate
from trie_decode.integrations.transformers import TrieLogitsProcessor, rank

END = 30  # "." in SmolLM2's vocabulary (the tiny models share it)
EOS = 2
# Entry 1 holds the end token before its last token; entries 0 and 2 do not.
ENTRIES = [[5071], [7158, END, 7158, 4000], [7158, 4001]]
INSIDE = r"entry 1, tokens \[7158, 30, 7158, 4000\], contains token 30, at which generation stops"


def _inputs(rows: int = 2) -> dict:
    ids = torch.tensor([[5, 6, 7, 8]] * rows) + torch.arange(rows).unsqueeze(1)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _trie(entries=ENTRIES) -> TokenTrie:
    return TokenTrie.from_sequences(entries, vocab_size=49152)


class _Forwards:
    """Counts the model's forward passes (a refusal before the first token leaves at most the prefill)."""

    def __init__(self, model):
        self.n = 0
        self._handle = model.register_forward_pre_hook(self._count)

    def _count(self, *_):
        self.n += 1

    def close(self):
        self._handle.remove()


GENERATE_MODES = {
    "greedy": dict(do_sample=False),
    "sampling": dict(do_sample=True, top_k=5),
    "beams": dict(do_sample=False, num_beams=3, num_return_sequences=2),
    "prompt-lookup": dict(do_sample=False, prompt_lookup_num_tokens=2),
    "assistant": dict(do_sample=False),  # assistant_model= added in the test (the tiny model itself)
}


@pytest.mark.parametrize("mode", list(GENERATE_MODES))
@pytest.mark.parametrize("rules", [dict(), dict(on_complete="repeat", separator=[11])], ids=["eos", "repeat"])
def test_generate_refuses_an_entry_that_holds_its_stop_token(tiny_llama, mode, rules):
    kwargs = dict(GENERATE_MODES[mode])
    rows = 2
    if mode in ("prompt-lookup", "assistant"):
        rows = 1  # assisted decoding takes one prompt
    if mode == "assistant":
        kwargs["assistant_model"] = tiny_llama
    processor = TrieLogitsProcessor(_trie(), end_token_id=END, **rules)
    forwards = _Forwards(tiny_llama)
    try:
        with pytest.raises(ConstraintConfigError, match=INSIDE + r".*stop at a token no entry contains "
                                                               r"\(end_token_id= and generate's eos_token_id=\)"):
            tiny_llama.generate(**_inputs(rows), logits_processor=[processor], max_new_tokens=6, eos_token_id=END,
                                pad_token_id=EOS, **kwargs)
    finally:
        forwards.close()
    assert processor.steps == 0  # refused at the first step, before any token was chosen
    assert forwards.n <= 2  # the prefill (and an assistant's) only


def test_the_stop_ids_come_from_generate(tiny_llama):
    """The end token among several stop ids, or the generation config's EOS (not passed to generate): refused."""
    processor = TrieLogitsProcessor(_trie(), end_token_id=END)
    with pytest.raises(ConstraintConfigError, match=INSIDE):
        tiny_llama.generate(**_inputs(), logits_processor=[processor], max_new_tokens=6, eos_token_id=[EOS, END],
                            pad_token_id=EOS, do_sample=False)
    assert tiny_llama.generation_config.eos_token_id == EOS
    at_eos = _trie([[5071], [7158, EOS, 7158]])
    with pytest.raises(ConstraintConfigError, match=r"entry 1, .*contains token 2, at which"):
        tiny_llama.generate(**_inputs(), logits_processor=[TrieLogitsProcessor(at_eos, end_token_id=EOS)],
                            max_new_tokens=6, pad_token_id=EOS, do_sample=False)


def test_every_trie_of_the_processor_is_checked(tiny_llama):
    tries = [_trie([[5071], [4000]]), _trie()]  # one trie per prompt: the second prompt's holds the end token
    with pytest.raises(ConstraintConfigError, match=INSIDE):
        tiny_llama.generate(**_inputs(), logits_processor=[TrieLogitsProcessor(tries, end_token_id=END)],
                            max_new_tokens=6, eos_token_id=END, pad_token_id=EOS, do_sample=False)


@pytest.mark.parametrize("call", ["hook", "plain"])
def test_fast_forward_refuses_it_before_the_prefill(tiny_llama, call):
    forwards = _Forwards(tiny_llama)
    try:
        with pytest.raises(ConstraintConfigError, match=INSIDE + r".*\(end_token_id= and generate's eos_token_id=\)"):
            if call == "hook":
                tiny_llama.generate(**_inputs(), custom_generate=fast_forward_generate, trie=_trie(), end_token_id=END,
                                    max_new_tokens=6, eos_token_id=END, pad_token_id=EOS, do_sample=False)
            else:
                fast_forward_generate(tiny_llama, **_inputs(), trie=_trie(), end_token_id=END, max_new_tokens=6,
                                      eos_token_id=END, pad_token_id=EOS, do_sample=False)
    finally:
        forwards.close()
    assert forwards.n == 0


def test_rank_names_its_own_option(tiny_llama):
    with pytest.raises(ConstraintConfigError, match=INSIDE + r".*; stop at a token no entry contains \(end_token_id=\), "
                                                             r"or build the trie without such entries$"):
        rank(tiny_llama, _inputs(1), _trie(), 2, end_token_id=END, pad_token_id=EOS)


def test_rank_names_its_own_option_for_a_live_catalogs_added_entry(tiny_llama):
    """A live catalog's entry added since rank's processor was made is checked when the generation takes its view:
    the fix still names rank's option, not generate's eos_token_id (which rank refuses)."""
    from trie_decode import LiveCatalog

    catalog = LiveCatalog(_trie([[5071], [7158, 4001]]))
    catalog.add([ENTRIES[1]])
    assert catalog.wait_compacted()
    with pytest.raises(ConstraintConfigError, match=r"contains token 30, .*; stop at a token no entry contains "
                                                    r"\(end_token_id=\), or build the trie without such entries$"):
        rank(tiny_llama, _inputs(1), catalog, 2, end_token_id=END, pad_token_id=EOS)


def test_a_live_catalog_whose_removed_entry_held_the_end_token_decodes(tiny_llama):
    """Removing the entry that holds the end token is the fix the refusal names: the view still holds it until the
    next compaction (removals alone do not compact), denied, so it is no reason to refuse. An entry that holds it
    and is not removed still is, through the processor and rank."""
    from trie_decode import LiveCatalog

    entries = ENTRIES + [[7158, END, 4002]]
    catalog = LiveCatalog(TokenTrie.from_sequences(entries, vocab_size=49152, keys=["a", "b", "c", "d"]))
    catalog.remove(["b"])
    assert catalog.wait_compacted()
    with pytest.raises(ConstraintConfigError, match=r"entry 3 \('d'\), tokens \[7158, 30, 4002\], contains token 30"):
        rank(tiny_llama, _inputs(1), catalog, 2, end_token_id=END, pad_token_id=EOS)
    processor = TrieLogitsProcessor(catalog, end_token_id=END)
    with pytest.raises(ConstraintConfigError, match=r"entry 3 \('d'\), tokens \[7158, 30, 4002\], contains token 30"):
        tiny_llama.generate(**_inputs(1), logits_processor=[processor], max_new_tokens=5, eos_token_id=END,
                            pad_token_id=EOS, do_sample=False)
    catalog.remove(["d"])
    ranked = rank(tiny_llama, _inputs(1), catalog, 2, end_token_id=END, pad_token_id=EOS)[0]
    assert sorted(e.entry.key for e in ranked) == ["a", "c"]
    out = tiny_llama.generate(**_inputs(2), logits_processor=[processor], max_new_tokens=5, eos_token_id=END,
                              pad_token_id=EOS, do_sample=False)
    assert {e.key for e in processor.match(out)} <= {"a", "c"}


class _OwnCaller:
    """A processor called from a frame that is not one of generate's loops (a caller of one's own)."""

    def __init__(self, processor):
        self.processor = processor

    def __call__(self, input_ids, scores):
        return self.processor(input_ids, scores)


@pytest.mark.parametrize("kwargs", [dict(do_sample=False), dict(do_sample=False, num_beams=3, num_return_sequences=3)],
                         ids=["greedy", "beams"])
def test_an_end_token_that_is_no_stop_id_runs_unchanged(tiny_llama, kwargs):
    """Stopping at EOS only, the end token is the trie's end marker: the rows run through entry 1 (forced) and
    write what an unknown caller's processor (never checked) writes."""
    trie = _trie([[7158, END, 7158, 4000]])
    outs = []
    for wrap in (lambda p: p, _OwnCaller):
        processor = TrieLogitsProcessor(trie, end_token_id=END)
        out = tiny_llama.generate(**_inputs(), logits_processor=[wrap(processor)], max_new_tokens=6,
                                  eos_token_id=EOS, pad_token_id=EOS, **kwargs)
        assert [e.index if e else None for e in processor.match(out)] == [0] * out.shape[0]
        outs.append(out)
    assert outs[0].tolist() == outs[1].tolist()
    assert outs[0][0, 4:].tolist() == [7158, END, 7158, 4000, END, END]  # the end token repeated: not a stop id
    ff = fast_forward_generate(tiny_llama, **_inputs(), trie=trie, end_token_id=END, max_new_tokens=6,
                               eos_token_id=EOS, pad_token_id=EOS, do_sample=False)
    if "num_beams" not in kwargs:
        assert ff.tolist() == outs[0].tolist()


def test_a_caller_of_its_own_is_not_checked():
    """Outside generate's loops the stop ids are unknown: the processor masks as before (the caller may call
    check_stop_ids with its own)."""
    processor = TrieLogitsProcessor(_trie(), end_token_id=END)
    masked = processor(torch.tensor([[5, 6]]), torch.zeros(1, 49152))
    assert masked[0].isfinite().nonzero().flatten().tolist() == [5071, 7158]
    with pytest.raises(ConstraintConfigError, match=INSIDE):
        processor.check_stop_ids([END])
    processor.check_stop_ids([EOS])
    processor.check_stop_ids(None)


def test_an_entry_that_ends_with_the_stop_token_is_fine(tiny_llama):
    trie = _trie([[7158, 4000, END], [7158, END]])  # generation stops where the entry ends
    processor = TrieLogitsProcessor(trie, end_token_id=END)
    out = tiny_llama.generate(**_inputs(), logits_processor=[processor], max_new_tokens=6, eos_token_id=END,
                              pad_token_id=EOS, do_sample=False)
    assert all(e is not None for e in processor.match(out))
    ff = tiny_llama.generate(**_inputs(), custom_generate=fast_forward_generate, trie=trie, end_token_id=END,
                             max_new_tokens=6, eos_token_id=END, pad_token_id=EOS, do_sample=False)
    assert ff.tolist() == out.tolist()


def test_release_is_refused_too(tiny_llama):
    """on_complete="release" stopped inside the entry all the same: generate stops at its stop ids in every mode."""
    processor = TrieLogitsProcessor(_trie(), end_token_id=END, on_complete="release")
    with pytest.raises(ConstraintConfigError, match=INSIDE):
        tiny_llama.generate(**_inputs(), logits_processor=[processor], max_new_tokens=6, eos_token_id=END,
                            pad_token_id=EOS, do_sample=False)
    with pytest.raises(ConstraintConfigError, match=INSIDE):
        fast_forward_generate(tiny_llama, **_inputs(), trie=_trie(), end_token_id=END, on_complete="release",
                              max_new_tokens=6, eos_token_id=END, pad_token_id=EOS, do_sample=False)


def test_a_stop_id_that_is_not_the_end_token_is_checked(tiny_llama):
    """End token EOS, generate stopping at EOS and ".": an entry holding "." was cut at it."""
    processor = TrieLogitsProcessor(_trie(), end_token_id=EOS)
    with pytest.raises(ConstraintConfigError, match=INSIDE):
        tiny_llama.generate(**_inputs(), logits_processor=[processor], max_new_tokens=6, eos_token_id=[EOS, END],
                            pad_token_id=EOS, do_sample=False)
    out = tiny_llama.generate(**_inputs(), logits_processor=[TrieLogitsProcessor(_trie(), end_token_id=EOS)],
                              max_new_tokens=6, eos_token_id=EOS, pad_token_id=EOS, do_sample=False)
    assert out.shape[1] > 4


def test_the_check_is_kept_on_the_trie(tiny_llama):
    """Per trie: a later generation (another processor, the same trie) does not walk the trie again; the trie keeps
    one flag per token (does an entry go on past it?), so any number of stop tokens cost a look-up each."""
    trie = _trie([[5071], [7158, 4000]])
    for _ in range(2):
        tiny_llama.generate(**_inputs(), logits_processor=[TrieLogitsProcessor(trie, end_token_id=END)],
                            max_new_tokens=3, eos_token_id=END, pad_token_id=EOS, do_sample=False)
        inner = trie._derived["inner_tokens"]
        assert inner.shape == (trie.vocab_size,) and np.flatnonzero(inner).tolist() == [7158]


def test_the_loops_keep_their_generation_config():
    """What GenerateLoop reads the stop ids from: each loop's generation_config argument."""
    from transformers.generation.utils import GenerationMixin

    for loop in (GenerationMixin._sample, GenerationMixin._beam_search, GenerationMixin._assisted_decoding):
        assert "generation_config" in inspect.signature(loop).parameters, loop.__name__


def test_the_stop_token_check_names_an_entry_no_filter_denies():
    """With denied entries, the check names the first entry past the stop token that is not denied, under any node
    that holds it; it passes when every such entry is denied (an entry ending with the stop token is fine)."""
    from trie_decode.constraint import check_stop_tokens_outside_entries

    trie = TokenTrie.from_sequences([[1, 2, 3], [1, 2, 4], [5, 2, 6], [7, 2], [1, 2]], vocab_size=8)
    for denied, named in ((None, r"entry 0, tokens \[1, 2, 3\]"), ([0], r"entry 1, tokens \[1, 2, 4\]"),
                          ([0, 1], r"entry 2, tokens \[5, 2, 6\]"), ([1, 0, 4], r"entry 2, tokens \[5, 2, 6\]")):
        with pytest.raises(ConstraintConfigError, match=named):
            check_stop_tokens_outside_entries(trie, [2], denied=None if denied is None else np.array(denied))
    check_stop_tokens_outside_entries(trie, [2], denied=np.array([0, 1, 2]))
    check_stop_tokens_outside_entries(trie, [6, 3])
