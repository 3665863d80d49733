"""What TrieLogitsProcessor assumes about transformers' generate loops, checked against the installed transformers.

The processor reads, from its caller's frames, which loop calls it (``_GenerateLoop``): in ``_sample`` rows never
move and the scores tensor is kept only as the raw logits of ``output_logits=True``; ``_beam_search`` passes fresh
log-probs. If transformers changes either, these tests fail loudly (the processor would then fall back to its safe
path: lookups by prefix hash and out-of-place masking).
"""

from __future__ import annotations

import inspect

import warnings

import pytest
import torch

from trie_decode import TokenTrie
from trie_decode.integrations.transformers import TrieLogitsProcessor

END = 2
ENTRIES = [[100, 200, 300], [100, 250], [400], [400, 401]]


def test_sample_loop_keeps_the_processed_tensor_only_as_raw_logits():
    from transformers.generation.utils import GenerationMixin

    src = inspect.getsource(GenerationMixin._sample)
    assert "output_logits = generation_config.output_logits" in src
    assert "return_dict_in_generate = generation_config.return_dict_in_generate" in src
    call = src.index("next_token_scores = logits_processor(input_ids, next_token_logits)")
    keep = src.index("raw_logits += (next_token_logits,)")
    assert call < keep
    assert src.count("next_token_logits") == 3, "_sample uses next_token_logits somewhere new: in-place unsafe?"


def test_beam_search_passes_fresh_log_probs():
    from transformers.generation.utils import GenerationMixin

    src = inspect.getsource(GenerationMixin._beam_search)
    assert "log_probs = nn.functional.log_softmax(logits, dim=-1)" in src
    assert "log_probs = logits_processor(flat_running_sequences, log_probs)" in src
    assert "raw_logits += (logits.clone(),)" in src


class _Spy(TrieLogitsProcessor):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []

    def __call__(self, input_ids, scores):
        out = super().__call__(input_ids, scores)
        self.seen.append((self.masks_in_place, out is scores, self._loop.reorders))
        return out


@pytest.mark.parametrize("kwargs, in_place, reorders", [
    (dict(do_sample=False), True, False),
    (dict(do_sample=True), True, False),
    (dict(do_sample=False, return_dict_in_generate=True, output_logits=True), False, False),
    (dict(num_beams=3, num_return_sequences=3, do_sample=False), True, True),
])
def test_processor_masks_in_place_exactly_when_generate_allows(tiny_llama, kwargs, in_place, reorders):
    trie = TokenTrie.from_sequences(ENTRIES, vocab_size=tiny_llama.config.vocab_size)
    spy = _Spy(trie, end_token_id=END)
    inputs = {"input_ids": torch.tensor([[5, 6, 7]]), "attention_mask": torch.tensor([[1, 1, 1]])}
    tiny_llama.generate(**inputs, logits_processor=[spy], max_new_tokens=4, pad_token_id=END, eos_token_id=END, **kwargs)
    assert spy.seen and all(s == (in_place, in_place, reorders) for s in spy.seen), spy.seen


def test_kept_scores_and_raw_logits_are_never_overwritten(tiny_llama):
    """output_scores and output_logits keep every step's tensors: each must hold its own step's values (a reused
    output buffer or an in-place mask would overwrite them)."""
    trie = TokenTrie.from_sequences(ENTRIES, vocab_size=tiny_llama.config.vocab_size)
    proc = TrieLogitsProcessor(trie, end_token_id=END)
    inputs = {"input_ids": torch.tensor([[5, 6, 7], [8, 9, 10]]), "attention_mask": torch.ones(2, 3, dtype=torch.long)}
    out = tiny_llama.generate(**inputs, logits_processor=[proc], max_new_tokens=4, pad_token_id=END, eos_token_id=END,
                              do_sample=False, return_dict_in_generate=True, output_scores=True, output_logits=True)
    assert len({s.data_ptr() for s in out.scores}) == len(out.scores), "a score tensor was reused"
    for step, (scores, raw) in enumerate(zip(out.scores, out.logits)):
        assert raw.isfinite().all(), "raw logits were masked"
        finite = scores.isfinite().sum(dim=1)
        assert (finite < scores.shape[1]).all() and (finite >= 1).all()
        chosen = out.sequences[:, 3 + step]
        assert torch.equal(scores[torch.arange(2), chosen], raw[torch.arange(2), chosen])


def test_direct_calls_leave_the_scores_untouched_and_reuse_a_buffer():
    trie = TokenTrie.from_sequences(ENTRIES, vocab_size=1000)
    proc = TrieLogitsProcessor(trie, end_token_id=END)
    ids = torch.tensor([[1, 2]])
    scores = torch.randn(1, 1000)
    before = scores.clone()
    first = proc(ids, scores)
    assert torch.equal(scores, before) and not proc.masks_in_place
    ptr = first.data_ptr()
    del first  # nothing holds the first output any more: the next call may reuse its memory
    second = proc(torch.tensor([[1, 2, 100]]), scores)
    assert second.data_ptr() == ptr and torch.equal(scores, before)
    held = second
    third = proc(torch.tensor([[1, 2, 100, 250]]), scores)
    assert third.data_ptr() != held.data_ptr(), "a buffer the caller still holds was reused"
    assert second[0].isfinite().nonzero().flatten().tolist() == [200, 250]


def test_beam_search_records_each_beams_parent_row():
    """Beam search keeps, per running beam and generated position, the flat row of the previous step it extends
    (``running_beam_indices``): the processor follows rows by it instead of a lookup."""
    from transformers.generation.utils import GenerationMixin

    loop = inspect.getsource(GenerationMixin._beam_search)
    assert "running_beam_indices = torch.full(" in loop
    assert "running_beam_indices=running_beam_indices" in loop
    top_k = inspect.getsource(GenerationMixin._get_top_k_continuations)
    assert "batch_modified_indices = topk_current_beam_indices + batch_offset" in top_k
    assert "topk_running_beam_indices[:, :, cur_len - decoder_prompt_len] = batch_modified_indices" in top_k


class _ParentSpy(TrieLogitsProcessor):
    """Records how each call followed its rows: ``"fused"`` (one C call reading beam search's parent indices),
    ``"parents"`` (the general path with the same indices) or ``"hash"`` (the prefix-hash lookup of a caller the
    processor does not know); ``how`` forces the last two."""

    def __init__(self, *args, how: str = "fused", **kwargs):
        super().__init__(*args, **kwargs)
        self.how, self.ways = how, []

    def _begin(self, input_ids, device, loop):
        super()._begin(input_ids, device, loop)
        if self.how != "fused":
            self._fused = None

    def _follow(self, input_ids, device, loop):
        if self.how == "hash":
            loop.parents = None
        return super()._follow(input_ids, device, loop)

    def __call__(self, input_ids, scores):
        out = super().__call__(input_ids, scores)
        self.ways.append("fused" if self._fused is not None else "hash" if self._hashes is not None else "parents")
        return out


@pytest.mark.parametrize("on_complete", ["eos", "repeat"])
def test_beam_parents_equal_the_prefix_hash_lookup(tiny_llama, on_complete):
    """Rows followed by beam search's parent indices (in the fused C step and in the general path) and rows found by
    prefix hash give the same beams, scores and matches (the tiny model's random scores reorder beams at every
    step)."""
    entries = [[100, 200, 300], [100, 200, 301], [100, 250], [100, 250, 7], [400], [400, 401, 402], [400, 403]]
    trie = TokenTrie.from_sequences(entries, vocab_size=tiny_llama.config.vocab_size)
    extra = dict(separator=[9]) if on_complete == "repeat" else {}
    inputs = {"input_ids": torch.tensor([[5, 6, 7], [8, 9, 10]]), "attention_mask": torch.ones(2, 3, dtype=torch.long)}
    runs = []
    for how in ("fused", "parents", "hash"):
        spy = _ParentSpy(trie, end_token_id=END, on_complete=on_complete, how=how, **extra)
        out = tiny_llama.generate(**inputs, logits_processor=[spy], max_new_tokens=8, num_beams=4, num_return_sequences=4,
                                  do_sample=False, pad_token_id=END, eos_token_id=END, return_dict_in_generate=True,
                                  output_scores=True)
        assert len(spy.ways) > 2 and set(spy.ways) == {how}, spy.ways
        runs.append((out.sequences, out.sequences_scores, [e and e.tokens for e in spy.match(out.sequences)]))
    for seq, score, match in runs[1:]:
        assert torch.equal(seq, runs[0][0]) and torch.allclose(score, runs[0][1]) and match == runs[0][2]
    assert all(m is not None for m in runs[0][2])


# ------------------------------------------------------------------ the verified range, and the general paths outside it
def test_installed_transformers_is_one_the_internals_were_checked_against():
    """Fails loudly when a transformers outside transformers_internals.VERIFIED is installed: check every internal
    listed in that module's table against the new release, then widen VERIFIED (the fast paths are off until then)."""
    import transformers

    from trie_decode.integrations import transformers_internals as internals

    assert internals.verified(), (
        f"transformers {transformers.__version__} is outside {internals.VERIFIED}: re-check the internals listed in "
        "integrations/transformers_internals.py, then update VERIFIED"
    )


@pytest.mark.parametrize("version, inside", [
    ("5.19.0", True), ("5.24.0", True), ("5.21.3", True), ("5.24.0.dev0", True), ("5.24.0rc1", True),
    ("5.18.9", False), ("5.24.1", False), ("6.0.0", False), ("4.57.1", False),
])
def test_version_range_is_by_release_number(version, inside):
    from trie_decode.integrations.transformers_internals import version_is_verified

    assert version_is_verified(version) is inside


@pytest.fixture
def unverified(monkeypatch):
    """transformers as if outside the verified range (the warnings' once-only memory reset)."""
    from trie_decode.integrations import transformers_internals as internals

    monkeypatch.setattr(internals, "_VERIFIED", False)
    monkeypatch.setattr(internals, "_warned", set())
    return internals


def test_processor_outside_the_range_takes_the_general_path_with_the_same_result(tiny_llama, unverified):
    trie = TokenTrie.from_sequences(ENTRIES, vocab_size=tiny_llama.config.vocab_size)
    inputs = {"input_ids": torch.tensor([[5, 6, 7], [8, 9, 10]]), "attention_mask": torch.ones(2, 3, dtype=torch.long)}
    runs = []
    for kwargs in (dict(do_sample=False), dict(num_beams=3, num_return_sequences=3, do_sample=False)):
        with unverified_off(unverified):
            ref = tiny_llama.generate(**inputs, logits_processor=[TrieLogitsProcessor(trie, end_token_id=END)],
                                      max_new_tokens=5, pad_token_id=END, eos_token_id=END, **kwargs)
        spy = _Spy(trie, end_token_id=END)
        unverified._warned.clear()
        with pytest.warns(unverified.UnverifiedTransformersWarning, match="general path"):
            out = tiny_llama.generate(**inputs, logits_processor=[spy], max_new_tokens=5, pad_token_id=END,
                                      eos_token_id=END, **kwargs)
        assert spy.seen and all(s == (False, False, True) for s in spy.seen), spy.seen  # out of place, looked up
        runs.append(torch.equal(out, ref))
    assert runs == [True, True]


class unverified_off:
    """Temporarily back inside the verified range (the reference run of a test that runs outside it)."""

    def __init__(self, internals):
        self.internals = internals

    def __enter__(self):
        self.internals._VERIFIED = True

    def __exit__(self, *exc):
        self.internals._VERIFIED = False


def test_an_unrecognized_beam_parents_layout_is_not_trusted(tiny_llama, monkeypatch):
    """A running_beam_indices whose values are not the flat parent rows the fast path reads (here: each beam's index
    within its prompt, as a future layout might hold) switches the generation to the prefix-hash lookup, with the
    same beams as a generation that reads the real parents, and one warning."""
    from trie_decode.integrations import transformers_internals as internals

    entries = [[100, 200, 300], [100, 250], [400], [400, 401, 402]]
    trie = TokenTrie.from_sequences(entries, vocab_size=tiny_llama.config.vocab_size)
    inputs = {"input_ids": torch.tensor([[5, 6, 7], [8, 9, 10]]), "attention_mask": torch.ones(2, 3, dtype=torch.long)}
    kwargs = dict(max_new_tokens=6, num_beams=3, num_return_sequences=3, do_sample=False, pad_token_id=END,
                  eos_token_id=END)
    ref = tiny_llama.generate(**inputs, logits_processor=[TrieLogitsProcessor(trie, end_token_id=END)], **kwargs)
    real = internals.beam_parents

    def other_layout(parents, rows, column, check):
        return real(parents % 3, rows, column, check)  # beam within prompt, not the flat row

    monkeypatch.setattr(internals, "_parent_layout_warned", False)
    monkeypatch.setattr("trie_decode.integrations.transformers.beam_parents", other_layout)
    spy = _ParentSpy(trie, end_token_id=END)
    with pytest.warns(internals.UnverifiedTransformersWarning, match="running_beam_indices"):
        out = tiny_llama.generate(**inputs, logits_processor=[spy], **kwargs)
    assert torch.equal(out, ref)
    assert spy.ways[0] == "fused" and set(spy.ways[1:]) == {"hash"}, spy.ways


def test_prefix_hash_fallback_needs_no_layout():
    """beam_parents refuses shapes that do not fit the batch (the caller then looks rows up)."""
    from trie_decode.integrations.transformers_internals import beam_parents

    parents = torch.full((2, 3, 4), -1, dtype=torch.int32)
    parents[:, :, 0] = torch.tensor([[0, 0, 1], [3, 4, 4]])
    assert beam_parents(parents, 6, 0, check=True).tolist() == [0, 0, 1, 3, 4, 4]
    assert beam_parents(parents, 5, 0, check=True) is None  # rows != batch * beams
    assert beam_parents(parents, 6, 4, check=True) is None  # a column past the end
    crossed = parents.clone()
    crossed[0, 0, 0] = 4  # a beam of prompt 0 continuing a row of prompt 1
    with pytest.warns(UserWarning):
        assert beam_parents(crossed, 6, 0, check=True) is None
    for bad, where in ((-2, (1, 2, 1)), (6, (1, 2, 0)), (-1, (0, 1, 0))):
        other = parents.clone()
        other[where] = bad  # a next column already written, a row out of range, an unwritten current column
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # warned once per process, above
            assert beam_parents(other, 6, 0, check=True) is None
    assert beam_parents(parents, 6, 0, check=False).tolist() == [0, 0, 1, 3, 4, 4]  # unchecked: read as it is


def test_the_trie_runs_where_generate_runs_a_users_processors(tiny_llama):
    """around_user_processors splits generate's own list (captured through the custom_generate hook) where it merges
    a user's processors: its penalties before, its warpers, watermark and normalization after."""
    seen = {}

    def capture(model, input_ids, logits_processor=None, stopping_criteria=None, generation_config=None, **kwargs):
        seen["processors"] = list(logits_processor)
        return input_ids

    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    tiny_llama.generate(ids, attention_mask=torch.ones_like(ids), custom_generate=capture, max_new_tokens=2,
                        do_sample=True, top_k=5, repetition_penalty=1.3, min_new_tokens=1, renormalize_logits=True)
    from trie_decode.integrations import transformers_internals as internals

    before, after = internals.around_user_processors(seen["processors"])
    names = [type(p).__name__ for p in before]
    assert "RepetitionPenaltyLogitsProcessor" in names and any("MinNewTokens" in n for n in names), names
    assert [type(p).__name__ for p in after] == ["TopKLogitsWarper", "LogitNormalization"]
    watermark = type("WatermarkLogitsProcessor", (), {})()  # generate appends it after the warpers
    assert internals.around_user_processors([before[0], watermark])[1][0] is watermark
    # per-row state made for the whole batch is found (5.24's penalty keeps each row's padding), none is invented
    holder = type("Holder", (), {})()
    holder.lengths = torch.zeros(2)
    assert internals.holds_batch_state([holder], 2) and not internals.holds_batch_state([holder], 3)


def test_assisted_decoding_calls_the_processors_as_the_processor_reads_it():
    """``_assisted_decoding``: processors run on each candidate prefix of a round (then partly rejected: rewinds),
    on a tensor nothing else keeps (in place is safe); a prompt lookup passes one scores tensor again for each
    candidate (out of place); the assistant model's generate gets the main loop's processors."""
    from transformers.generation import candidate_generator as drafters
    from transformers.generation.utils import GenerationMixin

    from trie_decode.integrations.transformers_internals import _SAME_VOCAB_DRAFTERS

    src = inspect.getsource(GenerationMixin._assisted_decoding)
    assert "candidate_generator = self._get_candidate_generator(" in src
    clone = src.index("next_token_logits = new_logits.clone()")
    call = src.index("new_logits[:, i, :] = logits_processor(candidate_input_ids[:, : cur_len + i], new_logits[:, i, :])")
    assert clone < call
    lookup = inspect.getsource(drafters.PromptLookupCandidateGenerator.get_candidates)
    assert "fake_output_logits = self.logits_processor(sequence_with_candidate, fake_input_logits)" in lookup
    assisted = inspect.getsource(drafters.AssistedCandidateGenerator)
    assert '"logits_processor": self.logits_processor' in assisted
    assert "self.assistant_model.generate(" in assisted
    for name in _SAME_VOCAB_DRAFTERS:
        assert issubclass(getattr(drafters, name), drafters.AssistedCandidateGenerator)


@pytest.mark.parametrize("assist, in_place", [
    (dict(prompt_lookup_num_tokens=2), {True, False}),  # the loop's own calls in place, the lookup's out of place
    ("tiny", {True}),
])
def test_assisted_decoding_masks_in_place_only_where_the_loop_allows(tiny_llama, assist, in_place):
    trie = TokenTrie.from_sequences(ENTRIES, vocab_size=tiny_llama.config.vocab_size)
    spy = _Spy(trie, end_token_id=END)
    assist = dict(assistant_model=tiny_llama) if assist == "tiny" else assist
    inputs = {"input_ids": torch.tensor([[100, 200, 300, 5, 100]]), "attention_mask": torch.ones(1, 5, dtype=torch.long)}
    tiny_llama.generate(**inputs, logits_processor=[spy], max_new_tokens=4, pad_token_id=END, eos_token_id=END,
                        do_sample=False, **assist)
    assert spy.seen and {s[1] for s in spy.seen} == in_place and not any(s[2] for s in spy.seen), spy.seen
