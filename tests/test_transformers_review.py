"""Inputs a user's own loop or a direct call gets wrong: named errors, never a silently unconstrained row."""

import pytest
import torch

from trie_decode import TokenTrie
from trie_decode.errors import ConstraintConfigError
from trie_decode.integrations.fast_forward import fast_forward_generate
from trie_decode.integrations.transformers import TrieLogitsProcessor


@pytest.fixture(scope="module")
def trie(tokenizer):
    return TokenTrie.from_strings(["Paris", "Berlin", "Madrid"], tokenizer)


def test_scores_with_more_rows_than_input_ids_are_refused(tokenizer, trie):
    # The third row of scores had no state: it was returned unmasked (every token allowed).
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    for scores in (torch.zeros(3, len(tokenizer)), torch.zeros(1, len(tokenizer))):
        with pytest.raises(ConstraintConfigError, match=r"one row per sequence, got \(2, 3\) and \((3|1), 49152\)"):
            TrieLogitsProcessor(trie, tokenizer)(ids, scores)
    with pytest.raises(ConstraintConfigError, match=r"one row per sequence, got \(3,\)"):  # was "not enough values"
        TrieLogitsProcessor(trie, tokenizer)(ids[0], torch.zeros(len(tokenizer)))


def test_fast_forward_names_1d_input_ids(tiny_llama, tokenizer, trie):
    # The plain call handed them to generate first, which failed with "IndexError: tuple index out of range".
    with pytest.raises(ConstraintConfigError, match="input_ids must be a 2-D tensor"):
        fast_forward_generate(tiny_llama, torch.tensor([1, 2, 3]), trie=trie, max_new_tokens=3)


def test_fast_forwards_documented_end_token_default_is_the_one_used(tiny_llama, tokenizer, trie):
    # The docs said "defaults to the generation config's first EOS id"; with tokenizer= it is the tokenizer's.
    doc = " ".join(fast_forward_generate.__doc__.split())
    assert "end_token_id (`int`, optional): ends an entry; defaults to the tokenizer's EOS, else the generation" in doc
    other = tokenizer.eos_token_id + 1  # the config's EOS: generate stops there, not at the end token
    inputs = tokenizer(["Capital of Spain?"], return_tensors="pt")
    out = fast_forward_generate(tiny_llama, **inputs, trie=trie, tokenizer=tokenizer, eos_token_id=other,
                                pad_token_id=other, max_new_tokens=6, do_sample=False)
    generated = out[0, inputs["input_ids"].shape[1]:].tolist()
    assert tokenizer.eos_token_id in generated and other not in generated


def test_the_beam_search_fix_named_by_fast_forward_runs_as_written(tiny_llama, tokenizer, trie):
    # It named TrieLogitsProcessor(trie), which fails as written: "no end token" (the tokenizer supplies it).
    inputs = tokenizer(["Capital of Spain?"], return_tensors="pt")
    with pytest.raises(ConstraintConfigError, match=r"logits_processor=\[TrieLogitsProcessor\(trie, tokenizer\)\]"):
        fast_forward_generate(tiny_llama, **inputs, trie=trie, num_beams=2, max_new_tokens=3)
    out = tiny_llama.generate(**inputs, num_beams=2, max_new_tokens=3, logits_processor=[TrieLogitsProcessor(trie, tokenizer)])
    assert out.shape[0] == 1


_END = 2
_ENTRIES = [[100, 200, 300], [100, 250], [400], [400, 401], [500, 501, 502, 503], [500, 501, 600]]
_BEAMS = dict(max_new_tokens=8, pad_token_id=_END, eos_token_id=_END, num_beams=3, num_return_sequences=3)


@pytest.mark.parametrize("lookup", ["unverified", "unknown parents layout"])
@pytest.mark.parametrize("options", [dict(deny=[[0], [2, 4]]), dict(on_complete="release", trigger=[9, 10]),
                                     dict(on_complete="repeat", separator=[7], distinct=True, allow=[[0, 1, 4, 5], [2, 3, 4]])],
                         ids=["per-prompt deny", "trigger in one prompt", "per-prompt distinct lists"])
def test_the_prefix_hash_lookup_keeps_each_prompts_own_state(tiny_llama, monkeypatch, lookup, options):
    """Beam rows found by prefix hash (a transformers outside the verified range, or a running_beam_indices of
    another layout) took the state of another prompt's row with the same generated tokens: the hash held the trie,
    not the prompt. Prompt 1 wrote entries its deny list excludes, or lost the trigger its prompt ends with."""
    from trie_decode.integrations import transformers_internals as internals

    trie = TokenTrie.from_sequences(_ENTRIES, vocab_size=tiny_llama.config.vocab_size)
    inputs = {"input_ids": torch.tensor([[0, 5, 6, 7, 9], [8, 9, 10, 9, 10]]),
              "attention_mask": torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]])}
    ref = tiny_llama.generate(**inputs, logits_processor=[TrieLogitsProcessor(trie, end_token_id=_END, **options)],
                              **_BEAMS)
    if lookup == "unverified":
        monkeypatch.setattr(internals, "_VERIFIED", False)
        monkeypatch.setattr(internals, "_warned", {"TrieLogitsProcessor (caller detection)"})
    else:
        real = internals.beam_parents
        monkeypatch.setattr(internals, "_parent_layout_warned", True)
        monkeypatch.setattr("trie_decode.integrations.transformers.beam_parents",
                            lambda parents, rows, column, check: real(parents % 3, rows, column, check))
    processor = TrieLogitsProcessor(trie, end_token_id=_END, **options)
    out = tiny_llama.generate(**inputs, logits_processor=[processor], **_BEAMS)
    assert torch.equal(out, ref), (ref[:, 5:].tolist(), out[:, 5:].tolist())
    if "deny" in options:
        assert not {e.index for e in processor.match(out)[3:]} & {2, 4}


def test_rank_names_untensored_inputs(tiny_llama, tokenizer, trie):
    # tokenizer(prompts) without return_tensors: "AttributeError: 'list' object has no attribute 'shape'".
    from trie_decode.integrations.transformers import rank

    with pytest.raises(ConstraintConfigError, match='input_ids as a tensor: tokenize with return_tensors="pt"'):
        rank(tiny_llama, tokenizer(["Capital of Spain?"]), trie, k=2, tokenizer=tokenizer)


def test_match_names_what_is_no_rows_of_tokens(tiny_llama, tokenizer, trie):
    # generate's dict output: "AttributeError: 'GenerateDecoderOnlyOutput' object has no attribute 'tolist'" from the
    # processor's match, and from the module's match a replay of its keys' characters ("invalid literal for int()");
    # one row alone: "TypeError: 'int' object is not subscriptable"; 3-D: a numpy "setting an array element" error.
    from trie_decode.integrations.transformers import match

    processor = TrieLogitsProcessor(trie, tokenizer)
    ids = torch.tensor([[1, 2, 3]])
    out = tiny_llama.generate(input_ids=ids, attention_mask=torch.ones_like(ids), logits_processor=[processor],
                              max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    with pytest.raises(ConstraintConfigError, match=r"got generate's GenerateDecoderOnlyOutput: pass out\.sequences"):
        processor.match(out)
    with pytest.raises(ConstraintConfigError, match=r"pass the generated tokens, out\.sequences\[:, prompt_length:\]"):
        match(trie, out, end_token_id=tokenizer.eos_token_id)
    with pytest.raises(ConstraintConfigError, match=r"Shape \(B, L\) with integer ids, got \(\d+,\) torch.int64 \(one row "
                                                    r"alone is sequences\[None\]\)"):
        processor.match(out.sequences[0])
    with pytest.raises(ConstraintConfigError, match=r"got \(1, 1, \d+\) torch.int64"):
        match(trie, out.sequences[None, :, 3:], end_token_id=tokenizer.eos_token_id)
    with pytest.raises(ConstraintConfigError, match=r"got \(1, \d+\) torch.float32"):
        processor.match(out.sequences.float())
    # What it read before still reads alike: a tensor, a list of rows, numpy rows.
    expected = processor.match(out.sequences)
    assert expected[0] is not None
    assert processor.match(out.sequences.tolist()) == processor.match([out.sequences[0].numpy()]) == expected
    assert match(trie, out.sequences[:, 3:], end_token_id=tokenizer.eos_token_id) == expected


def test_prefix_allowed_tokens_fn_checks_what_generate_will_do_with_its_ids(tiny_llama, tokenizer):
    # A trie wider than the logits: "IndexError: index 60000 is out of bounds" inside PrefixConstrainedLogitsProcessor.
    # An entry holding a stop id: generate stopped inside it ([100, END]), no entry and no error, where the processor
    # refuses the same trie at its first step.
    from trie_decode.errors import InvalidTokenError
    from trie_decode.integrations.transformers import prefix_allowed_tokens_fn

    end = tokenizer.eos_token_id
    ids = torch.tensor([[5, 6, 7]])
    run = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, pad_token_id=end, eos_token_id=end)
    wide = TokenTrie.from_sequences([[60000, 5], [400]], vocab_size=60001)
    for length in (None, 3):
        with pytest.raises(InvalidTokenError, match="logits have 49152 columns but the trie uses token ids up to 60000"):
            tiny_llama.generate(**run, prefix_allowed_tokens_fn=prefix_allowed_tokens_fn(wide, end_token_id=end,
                                                                                         prompt_length=length))
    inside = TokenTrie.from_sequences([[100, end, 300], [100]], vocab_size=len(tokenizer))
    fn = prefix_allowed_tokens_fn(inside, end_token_id=end)
    for kwargs in (dict(do_sample=False), dict(num_beams=2)):
        with pytest.raises(ConstraintConfigError, match=rf"tokens \[100, {end}, 300\], contains token {end}, at which "
                                                        r"generation stops.*\(end_token_id= and generate's eos_token_id="):
            tiny_llama.generate(**run, prefix_allowed_tokens_fn=fn, **kwargs)
    # The stop ids are generate's: an end token it does not stop at may sit inside an entry, as for the processor.
    out = tiny_llama.generate(**{**run, "eos_token_id": 3}, prefix_allowed_tokens_fn=fn, do_sample=False)
    assert out[0, 3:].tolist()[:1] == [100]


def test_fast_forward_called_directly_names_its_own_fix_for_text_without_a_tokenizer(tiny_llama, trie):
    # The direct call goes through generate's hook, whose error spoke of generate(custom_generate=...,
    # tokenizer=...), which this call does not make.
    ids = torch.tensor([[1, 2, 3]])
    for option in (dict(on_complete="repeat", separator=", "), dict(trigger="Answer:")):
        key = next(k for k in ("separator", "trigger") if k in option)
        with pytest.raises(ConstraintConfigError, match=rf"^{key} given as text needs a tokenizer; pass tokenizer= or "
                                                        "token ids$"):
            fast_forward_generate(tiny_llama, ids, trie=trie, max_new_tokens=3, **option)


def test_rank_refuses_what_bans_its_end_token_from_the_generation_config_too(tiny_llama, tokenizer):
    # Given as keywords they were refused; set by generation_config= or by the model's own config they emptied the
    # ranking with no error ([[]]: every beam took the end token at the floor).
    import copy

    from transformers import GenerationConfig

    from trie_decode.integrations.transformers import rank

    trie = TokenTrie.from_sequences([[100, 250], [400], [500, 501]], vocab_size=len(tokenizer))
    ids = torch.tensor([[5, 6, 7]])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    assert len(rank(tiny_llama, inputs, trie, k=3, end_token_id=2)[0]) == 3
    own = copy.deepcopy(tiny_llama.generation_config)
    own.min_new_tokens = 4
    fix = r"sets them: set them to None there"
    with pytest.raises(ConstraintConfigError, match=r"rank does not take min_new_tokens= \(they ban the end token.*" + fix):
        rank(tiny_llama, inputs, trie, k=3, end_token_id=2, generation_config=own)
    with pytest.raises(ConstraintConfigError, match=r"rank does not take min_length= .*" + fix):
        rank(tiny_llama, inputs, trie, k=3, end_token_id=2, generation_config=GenerationConfig(min_length=5))
    saved = tiny_llama.generation_config
    tiny_llama.generation_config = own  # the shared model: restored below
    try:
        with pytest.raises(ConstraintConfigError, match=fix):
            rank(tiny_llama, inputs, trie, k=3, end_token_id=2)
    finally:
        tiny_llama.generation_config = saved
    # A min_length the prompt already reaches bans nothing: ranked as without it.
    assert len(rank(tiny_llama, inputs, trie, k=3, end_token_id=2, generation_config=GenerationConfig(min_length=3))[0]) == 3


def test_rank_keeps_the_length_its_caller_gives(tiny_llama, tokenizer):
    # rank set max_new_tokens (deepest entry + 1) beside a given max_length, or over a given generation config's
    # max_new_tokens: generate took rank's, and ranked entries the caller's length had cut.
    from transformers import GenerationConfig

    from trie_decode.integrations.transformers import rank

    trie = TokenTrie.from_sequences([[100, 250, 300], [400], [500, 501]], vocab_size=len(tokenizer))
    ids = torch.tensor([[5, 6, 7]])
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    assert len(rank(tiny_llama, inputs, trie, k=3, end_token_id=2)[0]) == 3  # room for all by default
    for length in (dict(max_length=5), dict(generation_config=GenerationConfig(max_new_tokens=2, pad_token_id=2))):
        ranked = rank(tiny_llama, inputs, trie, k=3, end_token_id=2, **length)[0]  # two new tokens: [400] + end only
        assert [r.entry.tokens for r in ranked] == [(400,)], length


@pytest.mark.parametrize("filters, usable", [
    (dict(allow=["b", "c", "d"], deny=[["b"], ["c"]]), [{"c", "d"}, {"b", "d"}]),
    (dict(allow=[["b", "c"], ["c", "d"]], deny=["c"]), [{"b"}, {"d"}]),
])
def test_one_filter_for_every_prompt_beside_one_per_prompt(tiny_llama, tokenizer, filters, usable):
    # Over one shared trie the shared filter was read as one per prompt: "FilterSpecError: allow[0] must be a list of
    # entry keys or entry indices, got the string 'b'", while fast_forward_generate and one trie per prompt took it.
    from reference import allowed_after

    entries = {"a": (100, 200), "b": (400,), "c": (500, 501), "d": (600,)}
    trie = TokenTrie.from_sequences(list(entries.values()), vocab_size=len(tokenizer), keys=list(entries))
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    for kwargs in (dict(do_sample=False), dict(num_beams=3, num_return_sequences=2)):
        processor = TrieLogitsProcessor(trie, end_token_id=2, **filters)
        seen = []

        def record(input_ids, scores):
            seen.append((input_ids.clone(), scores.isfinite().clone()))
            return scores

        tiny_llama.generate(input_ids=ids, attention_mask=torch.ones_like(ids), logits_processor=[processor, record],
                            max_new_tokens=4, pad_token_id=2, eos_token_id=2, **kwargs)
        per = kwargs.get("num_return_sequences", 1) if "num_beams" not in kwargs else kwargs["num_beams"]
        for input_ids, allowed in seen:
            for row, tokens in enumerate(input_ids[:, 3:].tolist()):
                if 2 not in tokens:
                    expected = allowed_after({entries[k] for k in usable[row // per]}, processor.rules, tokens)
                    assert set(allowed[row].nonzero().flatten().tolist()) == expected, (kwargs, row, tokens)
