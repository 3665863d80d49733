"""fast_forward_generate: same tokens as the step-by-step processor, fewer forward passes, exact scores."""

from __future__ import annotations

import pytest
import torch

from trie_decode import TokenTrie
from trie_decode.constraint import SpanRules
from trie_decode.errors import ConstraintConfigError, InvalidTokenError
from trie_decode.integrations.fast_forward import FastForwardOutput, fast_forward_generate
from trie_decode.integrations.transformers import TrieLogitsProcessor, match_all

LANGUAGE_QUESTIONS = [
    "Which language is spoken in Brazil?",
    "What is the official language of Iran?",
    "Which language do most people in Ethiopia speak?",
    "What language is spoken in the Netherlands?",
]
COUNTRY_QUESTIONS = [
    "Which country is Paris the capital of?",
    "Which country has Canberra as its capital?",
    "Which country is Nairobi in?",
    "Which country lies directly north of the USA?",
]


def chat(tokenizer, question: str) -> str:
    messages = [{"role": "user", "content": question + " Answer with the name only."}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + "The answer is"


@pytest.fixture(scope="module")
def left_tok(tokenizer):
    tokenizer.padding_side = "left"
    return tokenizer


@pytest.fixture(scope="module")
def languages(tokenizer, language_names):
    return TokenTrie.from_strings(language_names, tokenizer, leading_space=True)


@pytest.fixture(scope="module")
def countries(tokenizer, country_names):
    return TokenTrie.from_strings(country_names, tokenizer, leading_space=True)


def real_choices(trie: TokenTrie, generated: list[int], end: int) -> int:
    """Positions of an "eos"-mode row where the trie offered more than one token (entry end counts as one)."""
    node, count = trie.root, 0
    for tok in generated:
        options = int(trie.fanout[node]) + int(trie.is_terminal(node))
        count += options >= 2
        if tok == end:
            break
        node = trie.step(node, tok)
        assert node >= 0, "the row left the trie"
    return count


def assert_same_or_near_tie(ref, out, prompt_len: int, tol: float = 1e-3) -> None:
    """Token-for-token equality; a difference is accepted only where the reference's top-2 margin is a near-tie
    (batched and one-token forward passes round differently), and then only from that position on."""
    if torch.equal(ref.sequences, out.sequences):
        return
    diff = (ref.sequences != out.sequences)[:, prompt_len:]
    for row in diff.any(dim=1).nonzero().flatten().tolist():
        j = int(diff[row].nonzero()[0])
        top2 = ref.scores[j][row].topk(2).values
        margin = float(top2[0] - top2[1])
        assert margin < tol, f"row {row} differs at generated position {j} with a logit margin of {margin:.4g}"


# ---------------------------------------------------------------------------------------------- real model
@pytest.mark.model
def test_greedy_batch1_matches_processor_with_one_pass_per_choice(model, left_tok, languages):
    inputs = left_tok([chat(left_tok, LANGUAGE_QUESTIONS[0])], return_tensors="pt")
    p = inputs["input_ids"].shape[1]
    eos = left_tok.eos_token_id
    ref = model.generate(
        **inputs, logits_processor=[TrieLogitsProcessor(languages, left_tok)], max_new_tokens=24, do_sample=False
    )
    out = model.generate(
        **inputs, custom_generate=fast_forward_generate, trie=languages, max_new_tokens=24, do_sample=False
    )
    assert out.tolist() == ref.tolist()
    plain = fast_forward_generate(model, **inputs, trie=languages, max_new_tokens=24)
    assert plain.tolist() == ref.tolist()

    row = out[0, p:].tolist()
    stats = out.stats
    choices = real_choices(languages, row, eos)
    # The prefill serves the first decision, each later decision costs one pass, the final block is never fed.
    assert stats.forward_passes == choices == stats.decisions
    assert stats.tokens_emitted == len(row) == stats.step_by_step_passes
    assert stats.forced_tokens == len(row) - choices
    assert stats.skip_ratio == pytest.approx(1 - choices / len(row))
    assert match_all(languages, [row], SpanRules(end_token_id=eos))[0]


@pytest.mark.model
def test_greedy_padded_batch8_different_tries_and_exact_scores(model, left_tok, languages, countries):
    questions = [q for pair in zip(LANGUAGE_QUESTIONS, COUNTRY_QUESTIONS) for q in pair]
    tries = [languages, countries] * 4
    inputs = left_tok([chat(left_tok, q) for q in questions], return_tensors="pt", padding=True)
    assert (inputs["attention_mask"] == 0).any(), "the batch should be padded"
    p = inputs["input_ids"].shape[1]
    eos = left_tok.eos_token_id
    options = dict(max_new_tokens=24, do_sample=False, return_dict_in_generate=True, output_scores=True)
    ref = model.generate(**inputs, logits_processor=[TrieLogitsProcessor(tries, left_tok)], **options)
    out = model.generate(**inputs, custom_generate=fast_forward_generate, trie=tries, **options)
    assert isinstance(out, FastForwardOutput)
    assert_same_or_near_tie(ref, out, p)
    assert torch.equal(ref.sequences, out.sequences)  # no near-tie in this batch

    # Scores: every generated token's score (forced ones from the pass that consumed their predecessor) equals
    # the step-by-step score; forced positions have exactly one finite score, like the processor's.
    stats = out.stats
    assert len(out.scores) == len(ref.scores) == out.sequences.shape[1] - p
    rows = out.sequences[:, p:].tolist()
    block_ends = []
    for r, row in enumerate(rows):
        n = row.index(eos) + 1
        assert stats.row_tokens[r] == n
        for j in range(n):
            tok = row[j]
            assert torch.isfinite(out.scores[j][r]).sum() == torch.isfinite(ref.scores[j][r]).sum()
            assert float(out.scores[j][r, tok]) == pytest.approx(float(ref.scores[j][r, tok]), rel=1e-4, abs=1e-4)
        # Was the row's last decision followed by forced tokens (then its block is fed once more for scores)?
        trie, node, last_decision = tries[r], tries[r].root, 0
        for j, tok in enumerate(row[:n]):
            if int(trie.fanout[node]) + int(trie.is_terminal(node)) >= 2:
                last_decision = j
            if tok != eos:
                node = trie.step(node, tok)
        block_ends.append(n - 1 > last_decision)
    choices = [real_choices(t, row, eos) for t, row in zip(tries, rows)]
    assert stats.decisions == sum(choices)
    assert stats.forward_passes == max(c + int(fed) for c, fed in zip(choices, block_ends))
    entries = [match_all(t, [row], SpanRules(end_token_id=eos))[0] for t, row in zip(tries, rows)]
    assert all(entries)


@pytest.mark.model
def test_sampling_real_model_outputs_are_members(model, left_tok, languages, countries):
    inputs = left_tok([chat(left_tok, q) for q in LANGUAGE_QUESTIONS[:2] + COUNTRY_QUESTIONS[:2]], return_tensors="pt", padding=True)
    p = inputs["input_ids"].shape[1]
    tries = [languages, languages, countries, countries]
    out = model.generate(
        **inputs,
        custom_generate=fast_forward_generate,
        trie=tries,
        max_new_tokens=24,
        do_sample=True,
        temperature=1.5,
        top_k=0,
        num_return_sequences=2,
        generator=torch.Generator().manual_seed(0),
    )
    assert out.shape[0] == 8
    for r, row in enumerate(out[:, p:].tolist()):
        trie = tries[r // 2]
        end = row.index(left_tok.eos_token_id)
        assert trie.lookup(row[:end]) is not None, f"row {r} generated a non-member {row[:end]}"


STOP_QUESTIONS = COUNTRY_QUESTIONS + ["Which country is Port Moresby the capital of?", "Which country is Wellington in?",
                                      "Which country is Pretoria in?", "Which country has Abu Dhabi as its capital?"]


def _forced_cut(trie: TokenTrie, generated: list[int], stops: set) -> bool:
    """Whether a row ended (not at a stop token) where the trie still forced a token: a stop string cut a forced run."""
    while generated and generated[-1] in stops:
        generated = generated[:-1]
    node = trie.root
    for tok in generated:
        node = trie.step(node, tok)
    return node >= 0 and int(trie.fanout[node]) == 1 and not trie.is_terminal(node)


@pytest.mark.model
@pytest.mark.parametrize("stop_strings", [["a"], ["New"], ["Zeal", "Marino"], "Bah"])
def test_stop_strings_give_generates_tokens(model, left_tok, countries, stop_strings):
    """generate(stop_strings=..., tokenizer=...) with the processor, and fast-forward (plain call and hook with a
    bound tokenizer): the same tokens, a stop string inside a forced run included."""
    import functools

    inputs = left_tok([chat(left_tok, q) for q in STOP_QUESTIONS], return_tensors="pt", padding=True)
    options = dict(max_new_tokens=16, do_sample=False, stop_strings=stop_strings)
    ref = model.generate(**inputs, logits_processor=[TrieLogitsProcessor(countries, left_tok)], tokenizer=left_tok,
                         **options)
    plain = fast_forward_generate(model, **inputs, trie=countries, tokenizer=left_tok, **options)
    hooked = model.generate(**inputs, custom_generate=functools.partial(fast_forward_generate, tokenizer=left_tok),
                            trie=countries, **options)
    assert plain.tolist() == ref.tolist() and hooked.tolist() == ref.tolist()
    unstopped = model.generate(**inputs, logits_processor=[TrieLogitsProcessor(countries, left_tok)],
                               max_new_tokens=16, do_sample=False)
    assert ref.shape != unstopped.shape or not torch.equal(ref, unstopped), "no stop string fired"
    if stop_strings == ["a"]:  # " San" ends in "a"... and " Marino" was forced: the run is cut after " San"
        p = inputs["input_ids"].shape[1]
        assert any(_forced_cut(countries, row[p:], {left_tok.eos_token_id}) for row in ref.tolist())


def test_stop_strings_through_generates_tokenizer_name_what_works(tiny_llama, tokenizer, small_tries):
    """generate keeps tokenizer= from a callable custom_generate; transformers then said it "could not locate a
    tokenizer" although one was given."""
    with pytest.raises(ConstraintConfigError, match=r"keeps its tokenizer from the hook: call fast_forward_generate\("
                                                    r"model, \.\.\., stop_strings=\.\.\., tokenizer=tokenizer\) "
                                                    r"directly, or bind it: .*functools\.partial"):
        tiny_llama.generate(**tiny_inputs(tokenizer, n=1), custom_generate=fast_forward_generate, trie=small_tries[0],
                            tokenizer=tokenizer, stop_strings=["a"], max_new_tokens=4)


# ---------------------------------------------------------------------------------------------- tiny model
def tiny_inputs(tokenizer, n: int = 3, length: int = 6, seed: int = 0) -> dict:
    """Left-padded random prompts of different lengths."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, 5000, (n, length), generator=gen)
    mask = torch.ones_like(ids)
    for r in range(n):
        mask[r, : r % length] = 0
        ids[r, : r % length] = tokenizer.pad_token_id
    return {"input_ids": ids, "attention_mask": mask}


@pytest.fixture(scope="module")
def small_tries(tokenizer, country_names, language_names):
    return [
        TokenTrie.from_strings(country_names[:60], tokenizer, leading_space=True),
        TokenTrie.from_strings(language_names[::40], tokenizer, leading_space=True),
        TokenTrie.from_strings(country_names[100:], tokenizer),
    ]


def _both(model, inputs, tries, tokenizer, **options):
    proc_opts = {k: options.pop(k) for k in ("on_complete", "separator", "trigger", "end_token_id", "allow", "deny")
                 if k in options}
    ref = model.generate(
        **inputs, logits_processor=[TrieLogitsProcessor(tries, tokenizer, **proc_opts)], do_sample=False, **options
    )
    out = model.generate(
        **inputs, custom_generate=fast_forward_generate, trie=tries, do_sample=False, **proc_opts, **options
    )
    return ref, out


@pytest.mark.parametrize("max_new_tokens", [1, 3, 24])
def test_tiny_greedy_matches_processor_eos_mode(tiny_llama, tokenizer, small_tries, max_new_tokens):
    inputs = tiny_inputs(tokenizer)
    ref, out = _both(tiny_llama, inputs, small_tries, tokenizer, max_new_tokens=max_new_tokens)
    assert out.tolist() == ref.tolist()
    assert out.stats.tokens_emitted <= 3 * max_new_tokens


def test_tiny_filters_match_processor_and_force_what_they_leave(tiny_llama, tokenizer, small_tries):
    """allow/deny as the processor takes them (per prompt, or one spec for every prompt, keys or indices) give the
    processor's tokens; a filter that leaves one way on forces it (fewer decisions than without the filter); bad
    filters are named errors."""
    from trie_decode.filters import restricted_trie

    inputs = tiny_inputs(tokenizer)
    sep = tokenizer(",", add_special_tokens=False)["input_ids"]
    one = small_tries[0]
    e = one.num_entries
    per_prompt = dict(allow=[list(range(0, e, 3)), None, list(range(5, e))], deny=[[0], list(range(e // 2)), None])
    for spec, extra in ((per_prompt, {}), (dict(deny=[1, 2, 3]), dict(on_complete="repeat", separator=sep))):
        ref, out = _both(tiny_llama, inputs, one, tokenizer, max_new_tokens=16, **spec, **extra)
        assert out.tolist() == ref.tolist(), spec
    # one trie per prompt, each filtered: as those prompts' filtered tries (the processor takes one shared trie)
    deny = [[0, 1], [2], [3, 4, 5]]
    kwargs = dict(max_new_tokens=12, do_sample=False)
    out = fast_forward_generate(tiny_llama, **inputs, trie=small_tries, deny=deny, **kwargs)
    want = fast_forward_generate(tiny_llama, **inputs, trie=[restricted_trie(t, deny=d) for t, d in zip(small_tries, deny)],
                                 **kwargs)
    assert torch.equal(out, want)
    ref = tiny_llama.generate(**inputs, logits_processor=[TrieLogitsProcessor(small_tries, tokenizer, deny=deny)],
                              pad_token_id=tokenizer.eos_token_id, **kwargs)
    assert torch.equal(out, ref)  # the processor filters per-prompt tries the same way
    with pytest.raises(ConstraintConfigError, match="distinct lists need one trie"):
        TrieLogitsProcessor(small_tries, tokenizer, deny=deny, on_complete="repeat", separator=",", distinct=True)
    first = one.sequences()[7]
    alone = dict(max_new_tokens=len(first) + 1, do_sample=False)
    both = inputs["input_ids"][:1], inputs["attention_mask"][:1]
    free = fast_forward_generate(tiny_llama, both[0], attention_mask=both[1], trie=one, **alone)
    only = fast_forward_generate(tiny_llama, both[0], attention_mask=both[1], trie=one, allow=[7], **alone)
    assert only[0, both[0].shape[1]:].tolist()[: len(first)] == list(first)
    assert only.stats.decisions == 0 and free.stats.decisions >= 1  # one entry left: everything is forced
    with pytest.raises(ConstraintConfigError, match=r"^fast_forward_generate does not take distinct= \(what a list"):
        fast_forward_generate(tiny_llama, **inputs, trie=one, distinct=True, max_new_tokens=3)
    with pytest.raises(ConstraintConfigError, match="prompt 0: allow and deny leave none"):  # on every path
        fast_forward_generate(tiny_llama, **inputs, trie=one, deny=[list(range(e)), None, None], max_new_tokens=3)
    with pytest.raises(ConstraintConfigError, match="keys are not entries"):
        fast_forward_generate(tiny_llama, **inputs, trie=small_tries, deny=["no such entry"], max_new_tokens=3)
    with pytest.raises(ConstraintConfigError, match='need on_complete="eos" or "repeat"'):
        fast_forward_generate(tiny_llama, **inputs, trie=small_tries, deny=[0], on_complete="release", max_new_tokens=3)
    with pytest.raises(ConstraintConfigError, match=r"allow/deny gives 2, one per prompt, but the batch has 3 prompts"):
        fast_forward_generate(tiny_llama, **inputs, trie=one, deny=[[0], [1]], max_new_tokens=3)
    with pytest.raises(ConstraintConfigError, match="trie gives 3, one per prompt, but the batch has 2 prompts"):
        fast_forward_generate(tiny_llama, **{k: v[:2] for k, v in inputs.items()}, trie=small_tries, deny=[[0], [1]],
                              max_new_tokens=3)


@pytest.mark.parametrize("stop_strings", [["ru"], ["ia", "e"], "o"])
@pytest.mark.parametrize("verified", [True, False], ids=["fast-forward", "general path"])
@pytest.mark.filterwarnings("ignore::trie_decode.integrations.transformers_internals.UnverifiedTransformersWarning")
def test_tiny_stop_strings_match_processor(tiny_llama, tokenizer, small_tries, stop_strings, verified, monkeypatch):
    """The same tokens as generate(stop_strings=..., tokenizer=...) with the processor, on the fast-forward loop and
    on the general path it takes outside the verified transformers."""
    import functools

    from trie_decode.integrations import transformers_internals as internals

    inputs = tiny_inputs(tokenizer)
    options = dict(max_new_tokens=12, do_sample=False, stop_strings=stop_strings)
    processor = [TrieLogitsProcessor(small_tries, tokenizer)]
    ref = tiny_llama.generate(**inputs, logits_processor=processor, tokenizer=tokenizer, **options)
    unstopped = tiny_llama.generate(**inputs, logits_processor=processor, max_new_tokens=12, do_sample=False)
    assert not torch.equal(ref, unstopped), "no stop string fired"
    monkeypatch.setattr(internals, "_VERIFIED", verified)
    monkeypatch.setattr(internals, "_warned", {"fast_forward_generate (token by token, no fast-forward)"})
    out = fast_forward_generate(tiny_llama, **inputs, trie=small_tries, tokenizer=tokenizer, **options)
    hooked = tiny_llama.generate(**inputs, custom_generate=functools.partial(fast_forward_generate, tokenizer=tokenizer),
                                 trie=small_tries, **options)
    assert out.tolist() == ref.tolist() and hooked.tolist() == ref.tolist()
    assert (out.stats.forced_tokens > 0) == verified


@pytest.mark.parametrize("verified", [True, False], ids=["fast-forward", "general path"])
@pytest.mark.filterwarnings("ignore::trie_decode.integrations.transformers_internals.UnverifiedTransformersWarning")
def test_a_direct_calls_own_processors_and_criteria_run_on_both_paths(tiny_llama, tokenizer, small_tries, verified,
                                                                       monkeypatch):
    """fast_forward_generate(model, ..., logits_processor=..., stopping_criteria=...) called directly: the general
    path (outside the verified transformers) dropped both, the fast path ran them."""
    from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

    from trie_decode.integrations import transformers_internals as internals

    class Ban(LogitsProcessor):  # bans the first choice of every row: the outputs must differ from plain ones
        def __init__(self, token: int) -> None:
            self.token, self.calls = token, 0

        def __call__(self, input_ids, scores):
            self.calls += 1
            scores[:, self.token] = -float("inf")
            return scores

    class AfterTwo(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= start + 2, dtype=torch.bool)

    inputs = tiny_inputs(tokenizer, n=1)
    start = inputs["input_ids"].shape[1]
    plain = fast_forward_generate(tiny_llama, **inputs, trie=small_tries[0], max_new_tokens=6, do_sample=False)
    first = int(plain[0, start])
    monkeypatch.setattr(internals, "_VERIFIED", verified)
    ban = Ban(first)
    out = fast_forward_generate(tiny_llama, **inputs, trie=small_tries[0], max_new_tokens=6, do_sample=False,
                                logits_processor=LogitsProcessorList([ban]),
                                stopping_criteria=StoppingCriteriaList([AfterTwo()]) if not verified else None)
    ref = tiny_llama.generate(**inputs, max_new_tokens=6, do_sample=False, logits_processor=[
        Ban(first), TrieLogitsProcessor(small_tries[0], tokenizer)],
        stopping_criteria=StoppingCriteriaList([AfterTwo()]) if not verified else None)
    assert ban.calls >= 1 and int(out[0, start]) != first
    assert out.tolist() == ref.tolist()
    if not verified:
        assert out.shape[1] == start + 2


def test_tiny_release_mode_continues_as_free_text(tiny_llama, tokenizer, small_tries):
    inputs = tiny_inputs(tokenizer)
    ref, out = _both(tiny_llama, inputs, small_tries, tokenizer, max_new_tokens=12, on_complete="release")
    assert out.tolist() == ref.tolist()
    # After the entry every token is a decision: nothing is forced across the span boundary.
    p = inputs["input_ids"].shape[1]
    for r, row in enumerate(out[:, p:].tolist()):
        entry = match_all(small_tries[r], [row], SpanRules(end_token_id=0, on_complete="release"))[0][0]
        tail = len(row) - len(entry.tokens)
        assert out.stats.row_forced[r] <= len(entry.tokens) - 1
        assert out.stats.row_tokens[r] == len(row) and tail >= 1


def test_tiny_repeat_mode_with_separator(tiny_llama, tokenizer, small_tries):
    inputs = tiny_inputs(tokenizer)
    sep = tokenizer(",", add_special_tokens=False)["input_ids"]
    ref, out = _both(tiny_llama, inputs, small_tries, tokenizer, max_new_tokens=20, on_complete="repeat", separator=sep)
    assert out.tolist() == ref.tolist()


def test_tiny_trigger_fires_mid_generation_and_at_prompt_end(tiny_llama, tokenizer, small_tries):
    inputs = tiny_inputs(tokenizer, n=1)
    free = tiny_llama.generate(**inputs, max_new_tokens=4, do_sample=False)[0, -4:].tolist()
    # The tiny model's own first two tokens: the two-token trigger fires after them, mid-generation.
    ref, out = _both(tiny_llama, inputs, [small_tries[0]], tokenizer, max_new_tokens=12, trigger=free[:2])
    assert out.tolist() == ref.tolist()
    p = inputs["input_ids"].shape[1]
    assert out[0, p : p + 2].tolist() == free[:2]
    assert small_tries[0].lookup(out[0, p + 2 :].tolist()[: out.stats.row_tokens[0] - 3]) is not None
    # A prompt that already ends with the trigger starts inside the entry.
    last = int(inputs["input_ids"][0, -1])
    ref, out = _both(tiny_llama, inputs, [small_tries[0]], tokenizer, max_new_tokens=12, trigger=[last])
    assert out.tolist() == ref.tolist()
    assert small_tries[0].lookup(out[0, p:].tolist()[: out.stats.row_tokens[0] - 1]) is not None


def test_tiny_sampling_members_with_return_sequences(tiny_llama, tokenizer, small_tries):
    inputs = tiny_inputs(tokenizer)
    p = inputs["input_ids"].shape[1]
    eos = tokenizer.eos_token_id
    for seed in range(5):
        out = tiny_llama.generate(
            **inputs,
            custom_generate=fast_forward_generate,
            trie=small_tries,
            max_new_tokens=32,
            do_sample=True,
            top_k=0,
            num_return_sequences=2,
            return_dict_in_generate=True,
            generator=torch.Generator().manual_seed(seed),
        )
        for r, row in enumerate(out.sequences[:, p:].tolist()):
            end = row.index(eos)
            assert small_tries[r // 2].lookup(row[:end]) is not None
        assert out.stats.forced_tokens + out.stats.decisions == out.stats.tokens_emitted


@pytest.mark.parametrize("extra", [{}, {"renormalize_logits": True}, {"repetition_penalty": 5.0}])
def test_tiny_scores_and_logits_match_processor(tiny_llama, tokenizer, small_tries, extra):
    # renormalize_logits: generate runs LogitNormalization after the user's processors, so after the trie mask;
    # repetition_penalty reads each row's tokens before the scored one (forced ones too), as generate's rows have
    inputs = tiny_inputs(tokenizer)
    opts = dict(max_new_tokens=16, return_dict_in_generate=True, output_scores=True, output_logits=True, **extra)
    ref, out = _both(tiny_llama, inputs, small_tries, tokenizer, **opts)
    plain = fast_forward_generate(tiny_llama, **inputs, trie=small_tries, tokenizer=tokenizer, do_sample=False, **opts)
    assert torch.equal(ref.sequences, out.sequences) and torch.equal(ref.sequences, plain.sequences)
    p = inputs["input_ids"].shape[1]
    for r, n in enumerate(out.stats.row_tokens):
        for j in range(n):
            tok = int(out.sequences[r, p + j])
            assert float(out.scores[j][r, tok]) == pytest.approx(float(ref.scores[j][r, tok]), abs=1e-4)
            assert float(plain.scores[j][r, tok]) == pytest.approx(float(ref.scores[j][r, tok]), abs=1e-4)
            # Raw logits are unmasked here; the processor masks generate's logits in place, so compare where the
            # reference kept them.
            assert torch.isfinite(out.logits[j][r]).all()
            kept = torch.isfinite(ref.logits[j][r])
            torch.testing.assert_close(out.logits[j][r][kept], ref.logits[j][r][kept], atol=1e-4, rtol=1e-4)


def _scores_agree(ref, out, p: int) -> None:
    """Each row's chosen tokens have the processor's scores, at every generated position (forced ones included)."""
    for r, n in enumerate(out.stats.row_tokens):
        for j in range(n):
            tok = int(out.sequences[r, p + j])
            assert float(out.scores[j][r, tok]) == pytest.approx(float(ref.scores[j][r, tok]), abs=1e-4), (r, j)


@pytest.mark.parametrize("case", ["entry ends in an EOS id", "stop string inside a forced run"])
def test_scores_of_a_block_cut_inside_its_forced_run(tiny_llama, tokenizer, small_tries, case):
    """A row that stops inside its forced run (an entry whose last token is an EOS id, before the forced end token;
    a stop string) asked the logits of the forced tokens after its stop: IndexError inside the scores."""
    inputs = tiny_inputs(tokenizer, n=2, seed=5)
    opts = dict(max_new_tokens=12, return_dict_in_generate=True, output_scores=True)
    if case.startswith("entry"):
        trie = TokenTrie.from_sequences([[600, 601, 602, tokenizer.eos_token_id], [800, 801]], len(tokenizer))
        ref, out = _both(tiny_llama, inputs, trie, tokenizer, **opts)
    else:
        trie, inputs = small_tries[0], tiny_inputs(tokenizer, n=1)
        opts.update(stop_strings=["a"], do_sample=False)
        ref = tiny_llama.generate(**inputs, logits_processor=[TrieLogitsProcessor(trie, tokenizer)], tokenizer=tokenizer,
                                  **opts)
        out = fast_forward_generate(tiny_llama, **inputs, trie=trie, tokenizer=tokenizer, **opts)
    assert torch.equal(ref.sequences, out.sequences) and out.stats.forced_tokens > 0
    _scores_agree(ref, out, inputs["input_ids"].shape[1])


@pytest.mark.parametrize("prompts", [1, 2])
def test_scores_of_a_row_whose_first_block_is_all_it_writes(tiny_llama, tokenizer, prompts):
    """A row whose whole output is forced in the first block of one token (one entry, max_new_tokens=1) left the
    batch before the prefill, which alone gives that token's logits: scores None for one prompt, -inf beside
    another."""
    one = TokenTrie.from_sequences([[600, 601, 602]], len(tokenizer))
    two = TokenTrie.from_sequences([[600, 601, 602], [700]], len(tokenizer))
    inputs = tiny_inputs(tokenizer, n=prompts, seed=5)
    ref, out = _both(tiny_llama, inputs, [one, two][:prompts], tokenizer, max_new_tokens=1,
                     return_dict_in_generate=True, output_scores=True, output_logits=True)
    assert torch.equal(ref.sequences, out.sequences) and out.stats.row_forced[0] == 1
    assert out.scores is not None and out.logits is not None
    _scores_agree(ref, out, inputs["input_ids"].shape[1])


def test_a_watermark_reads_each_rows_own_tokens(tiny_llama, tokenizer):
    """generate runs a watermark after the warpers, on each row's tokens so far; rows at different lengths were
    right-padded to the longest, so a shorter row's watermark read pad tokens: other tokens than generate's."""
    seqs = [[500, 501, 502, 503, 504, 505], [500, 501], [600, 601, 602], [800], [900, 901], [900, 902, 903],
            [1000, 1001, 1002, 1003, 1004, 1005, 1006, 1007], [1000, 1008]]
    trie = TokenTrie.from_sequences(seqs, len(tokenizer))
    inputs = tiny_inputs(tokenizer, n=4, seed=5)
    ref, out = _both(tiny_llama, inputs, trie, tokenizer, max_new_tokens=20, on_complete="repeat", separator=[11],
                     watermarking_config={"bias": 10.0, "seeding_scheme": "lefthash", "context_width": 1},
                     return_dict_in_generate=True, output_scores=True)
    assert torch.equal(ref.sequences, out.sequences) and out.stats.forced_tokens > 0
    _scores_agree(ref, out, inputs["input_ids"].shape[1])


def test_a_prefix_allowed_tokens_fn_gets_each_rows_own_batch_id(tiny_llama, tokenizer):
    """generate's PrefixConstrainedLogitsProcessor passes each row's index in the batch to prefix_allowed_tokens_fn;
    rows at other lengths, or beside a finished row, were asked as a smaller batch, so a row got another row's index
    (and wrote a token its own call banned)."""
    trie = TokenTrie.from_sequences([[500, 501, 502], [500, 700], [600, 601], [800], [900, 901, 902]], len(tokenizer))
    banned = {0: {800}, 1: {600, 900, 500}, 2: {900, 800, 600}}
    every = torch.arange(len(tokenizer))

    def allowed(batch_id, sent):
        return [t for t in every.tolist() if t not in banned.get(batch_id, ())]

    inputs = tiny_inputs(tokenizer, n=3, seed=5)
    ref, out = _both(tiny_llama, inputs, trie, tokenizer, max_new_tokens=16, on_complete="repeat", separator=[11],
                     prefix_allowed_tokens_fn=allowed)
    assert out.tolist() == ref.tolist() and out.stats.forced_tokens > 0


@pytest.mark.parametrize("option", ["guidance_scale", "watermarking_config"])
def test_processors_that_expect_one_token_per_call_are_refused_by_name(tiny_llama, tokenizer, small_tries, option):
    """Classifier-free guidance (its own forward pass and cache, one token per call) and the SynthID watermark (its
    own context of each row's last tokens) see several tokens per step here: a RuntimeError inside transformers
    for a batch, other tokens than generate's for one prompt."""
    from transformers import SynthIDTextWatermarkingConfig

    value = 2.0 if option == "guidance_scale" else SynthIDTextWatermarkingConfig(keys=[654, 400, 836, 123], ngram_len=3)
    for n in (1, 3):
        inputs = tiny_inputs(tokenizer, n=n)
        with pytest.raises(ConstraintConfigError, match=rf"fast_forward_generate feeds several tokens per step.*"
                                                        rf"{option}=.*logits_processor=\[TrieLogitsProcessor"):
            tiny_llama.generate(**inputs, custom_generate=fast_forward_generate, trie=small_tries[0], max_new_tokens=8,
                                do_sample=True, **{option: value})
        with pytest.raises(ConstraintConfigError, match=rf"{option}="):
            fast_forward_generate(tiny_llama, **inputs, trie=small_tries[0], max_new_tokens=8, do_sample=True,
                                  **{option: value})


def test_plain_function_matches_hook(tiny_llama, tokenizer, small_tries):
    inputs = tiny_inputs(tokenizer)
    hooked = tiny_llama.generate(
        **inputs, custom_generate=fast_forward_generate, trie=small_tries, max_new_tokens=16, do_sample=False
    )
    plain = fast_forward_generate(tiny_llama, **inputs, trie=small_tries, max_new_tokens=16)
    assert plain.tolist() == hooked.tolist()
    assert plain.stats.forward_passes == hooked.stats.forward_passes


# ---------------------------------------------------------------------------------------------- refusals
def test_beam_search_is_refused_with_a_pointer_to_the_processor(tiny_llama, tokenizer, small_tries):
    inputs = tiny_inputs(tokenizer, n=1)
    with pytest.raises(ConstraintConfigError, match="TrieLogitsProcessor"):
        tiny_llama.generate(
            **inputs, custom_generate=fast_forward_generate, trie=small_tries[0], num_beams=2, max_new_tokens=4
        )
    with pytest.raises(ConstraintConfigError, match="num_beams"):
        fast_forward_generate(tiny_llama, **inputs, trie=small_tries[0], num_beams=2, max_new_tokens=4)


def test_beams_from_the_generation_config_are_refused_with_num_beams_1(tiny_llama, tokenizer, small_tries):
    """A model whose generation_config asks for beams: the refusal named only the processor, not num_beams=1, which
    the call lacked (the beams came from the config), and which makes fast-forward run."""
    inputs = tiny_inputs(tokenizer, n=1)
    saved = tiny_llama.generation_config.num_beams
    tiny_llama.generation_config.num_beams = 3
    try:
        with pytest.raises(ConstraintConfigError, match=r"\(num_beams=3, given or from the model's generation_config\): "
                                                        r"pass num_beams=1, or for beam search use model\.generate"):
            fast_forward_generate(tiny_llama, **inputs, trie=small_tries[0], max_new_tokens=4)
        out = fast_forward_generate(tiny_llama, **inputs, trie=small_tries[0], max_new_tokens=4, num_beams=1)
        assert out.shape[0] == 1
    finally:
        tiny_llama.generation_config.num_beams = saved


def test_bad_arguments_are_named(tiny_llama, tokenizer, small_tries):
    inputs = tiny_inputs(tokenizer, n=3)
    with pytest.raises(ConstraintConfigError, match="trie="):
        fast_forward_generate(tiny_llama, **inputs, max_new_tokens=4)
    with pytest.raises(ConstraintConfigError, match="TrieLogitsProcessor"):
        tiny_llama.generate(
            **inputs,
            custom_generate=fast_forward_generate,
            trie=small_tries[0],
            logits_processor=[TrieLogitsProcessor(small_tries[0], tokenizer)],
            max_new_tokens=4,
        )
    # TrieLogitsProcessor's options that fast-forward does not take reached generate ("model_kwargs are not used").
    with pytest.raises(ConstraintConfigError, match=r"^fast_forward_generate does not take tries= \(its trie is "):
        fast_forward_generate(tiny_llama, **inputs, tries=small_tries[0], max_new_tokens=4)
    for options in (dict(spans=[]), dict(check_prompt=True)):
        with pytest.raises(ConstraintConfigError, match=rf"^fast_forward_generate does not take {next(iter(options))}= "
                                                        r".*logits_processor=\[TrieLogitsProcessor\(\.\.\.\)\]\)$"):
            fast_forward_generate(tiny_llama, **inputs, trie=small_tries[0], max_new_tokens=4, **options)
    with pytest.raises(ConstraintConfigError, match=r"trie gives 2, one per prompt, but the batch has 3 prompts"):
        fast_forward_generate(tiny_llama, **inputs, trie=small_tries[:2], max_new_tokens=4)
    with pytest.raises(TypeError, match="TokenTrie"):
        fast_forward_generate(tiny_llama, **inputs, trie=["not a trie"], max_new_tokens=4)
    with pytest.raises(ConstraintConfigError, match=r"stop_strings need the tokenizer .*pass tokenizer= too"):
        fast_forward_generate(tiny_llama, **inputs, trie=small_tries[0], max_new_tokens=4, stop_strings=["."])
    with pytest.raises(ConstraintConfigError, match="streams one prompt.*without streamer"):
        fast_forward_generate(tiny_llama, **inputs, trie=small_tries[0], max_new_tokens=4, streamer=_Collect())
    # Output options are no "model inputs"; the message names what takes them.
    with pytest.raises(ConstraintConfigError, match=r"model inputs or output options: \['output_hidden_states'\]; "
                                                    r"for them use model.generate"):
        fast_forward_generate(tiny_llama, **inputs, trie=small_tries[0], max_new_tokens=4, output_hidden_states=True)


@pytest.mark.parametrize("option", ["tries", "spans", "check_prompt", "distinct", "max_entries"])
def test_processor_options_through_the_hook_are_refused_by_name(tiny_llama, tokenizer, small_tries, option):
    """TrieLogitsProcessor's options that fast-forward does not take were refused by name on the plain call only;
    through generate(custom_generate=...) transformers refused them as "model_kwargs are not used by the model"
    (typos), naming no fix."""
    value = {"tries": small_tries[0], "spans": [], "check_prompt": True, "distinct": True, "max_entries": 2}[option]
    with pytest.raises(ConstraintConfigError, match=rf"^fast_forward_generate does not take {option}= "):
        tiny_llama.generate(**tiny_inputs(tokenizer, n=1), custom_generate=fast_forward_generate, trie=small_tries[0],
                            max_new_tokens=4, **{option: value})


def test_per_prompt_tries_and_filters_must_give_one_per_prompt(tiny_llama, tokenizer, small_tries):
    """2 tries (or per-prompt filters) for 4 prompts divide the 4 rows, and were read as 2 prompts of 2 rows:
    prompt 1 decoded with trie 0, silently. Through the hook the rows per prompt are generate's return sequences."""
    inputs = tiny_inputs(tokenizer, n=4)
    message = r"gives 2, one per prompt, but the batch has 4 prompts \(4 rows, 1 per prompt\)"
    with pytest.raises(ConstraintConfigError, match="trie " + message):
        tiny_llama.generate(**inputs, custom_generate=fast_forward_generate, trie=small_tries[:2], max_new_tokens=4)
    with pytest.raises(ConstraintConfigError, match="allow/deny " + message):
        fast_forward_generate(tiny_llama, **inputs, trie=small_tries[0], allow=[[0], [1]], max_new_tokens=4)
    two = {k: v[:2] for k, v in inputs.items()}  # 2 prompts x 3 return sequences: one trie per prompt
    out = fast_forward_generate(tiny_llama, **two, trie=small_tries[:2], max_new_tokens=4, do_sample=True,
                                num_return_sequences=3)
    assert out.shape[0] == 6


def test_a_live_catalog_or_an_object_that_is_no_trie_is_refused_by_name(tiny_llama, tokenizer, small_tries):
    """A LiveCatalog, which the processor takes, failed deep in the option check ("'LiveCatalog' object is not
    iterable", a TypeError); so did any object that is neither a trie nor a list, for the processor too."""
    from trie_decode import LiveCatalog

    inputs = tiny_inputs(tokenizer, n=2)
    catalog = LiveCatalog(small_tries[0])
    for source in (catalog, catalog.snapshot()):
        with pytest.raises(ConstraintConfigError, match=r"not a live catalog: pass trie=catalog\.compact\(\)"):
            fast_forward_generate(tiny_llama, **inputs, trie=source, max_new_tokens=4)
    out = fast_forward_generate(tiny_llama, **inputs, trie=catalog.compact(), max_new_tokens=4)  # the fix named
    assert out.shape[0] == 2
    with pytest.raises(ConstraintConfigError, match=r"^trie must be a TokenTrie or a list of them .*, got 42$"):
        fast_forward_generate(tiny_llama, **inputs, trie=42, max_new_tokens=4)
    with pytest.raises(ConstraintConfigError, match=r"^tries must be a TokenTrie or a list of them .*, got 42$"):
        TrieLogitsProcessor(42, tokenizer)


def test_an_end_token_that_is_not_eos_is_written_as_generate_writes_it(tiny_llama, tokenizer, small_tries):
    # generate stops at its EOS only: after an entry the end token is forced again and again. fast-forward stopped
    # at the end token instead (shorter output, not generate's tokens).
    inputs = tiny_inputs(tokenizer)
    dot = tokenizer.convert_tokens_to_ids(".")
    ref, out = _both(tiny_llama, inputs, small_tries, tokenizer, end_token_id=dot, max_new_tokens=12)
    assert out.tolist() == ref.tolist()
    assert (out[:, -1] == dot).any()


def test_a_trie_wider_than_the_model_is_refused(tiny_llama, tokenizer):
    # Forced tokens reach the model unmasked: a trie of ids the model has not got was fed (and returned) silently.
    wide = tiny_llama.config.vocab_size + 400
    trie = TokenTrie.from_sequences([[wide - 10, wide - 9]], vocab_size=wide)
    with pytest.raises(InvalidTokenError, match=f"logits have {tiny_llama.config.vocab_size} columns but the trie"):
        fast_forward_generate(tiny_llama, **tiny_inputs(tokenizer, n=1), trie=trie, end_token_id=2, max_new_tokens=4)


def test_text_options_through_the_hook_name_what_to_do(tiny_llama, tokenizer, small_tries):
    # generate keeps tokenizer= from the hook: the message said "pass tokenizer=", which the user had done.
    with pytest.raises(ConstraintConfigError, match=r"keeps its tokenizer from the hook: pass separator as token ids"):
        tiny_llama.generate(**tiny_inputs(tokenizer, n=1), custom_generate=fast_forward_generate, trie=small_tries[0],
                            tokenizer=tokenizer, on_complete="repeat", separator=",", max_new_tokens=4)


class _Collect:
    """A streamer (transformers' ``BaseStreamer`` interface) that keeps what it is given."""

    def __init__(self):
        self.puts, self.ended = [], 0

    def put(self, value):
        assert self.ended == 0, "put after end"
        self.puts.append(value.tolist())

    def end(self):
        self.ended += 1


@pytest.mark.parametrize("call", ["hook", "plain"])
def test_a_streamer_gets_the_prompt_then_each_committed_block(tiny_llama, tokenizer, small_tries, call):
    # generate puts the prompt, then calls a callable custom_generate without the streamer: the hook streams the rest.
    inputs = tiny_inputs(tokenizer, n=1)
    streamer = _Collect()
    if call == "hook":
        out = tiny_llama.generate(**inputs, custom_generate=fast_forward_generate, trie=small_tries[0],
                                  max_new_tokens=16, do_sample=False, streamer=streamer)
    else:
        out = fast_forward_generate(tiny_llama, **inputs, trie=small_tries[0], max_new_tokens=16, streamer=streamer)
    prompt = inputs["input_ids"].shape[1]
    assert streamer.ended == 1 and streamer.puts[0] == inputs["input_ids"].tolist()
    streamed = [t for block in streamer.puts[1:] for t in block]
    assert streamed == out[0, prompt:].tolist()
    assert 1 <= len(streamer.puts) - 1 <= out.stats.forward_passes  # at most a block per pass: forced runs whole


def test_the_end_token_is_found_alike_inside_and_outside_the_verified_transformers(
        tiny_llama, tokenizer, small_tries, monkeypatch):
    """Without end_token_id, fast-forward's end token is the tokenizer's EOS before the generation config's, on the
    verified path and on the general one alike (the rule of options.end_token): here the two differ, and both paths
    give the same tokens."""
    from trie_decode.integrations import transformers_internals as internals

    trie = small_tries[0]
    inputs = tiny_inputs(tokenizer)
    config_eos = tokenizer.eos_token_id + 1
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.eos_token_id, eos_token_id=config_eos)
    verified = fast_forward_generate(tiny_llama, **inputs, trie=trie, tokenizer=tokenizer, **kwargs)
    monkeypatch.setattr(internals, "_VERIFIED", False)
    monkeypatch.setattr(internals, "_warned", set())
    with pytest.warns(internals.UnverifiedTransformersWarning):
        general = fast_forward_generate(tiny_llama, **inputs, trie=trie, tokenizer=tokenizer, **kwargs)
    assert torch.equal(general, verified)
    assert (verified[:, inputs["input_ids"].shape[1]:] == tokenizer.eos_token_id).any()


def test_outside_the_verified_transformers_it_decodes_token_by_token_with_the_same_tokens(
        tiny_llama, tokenizer, small_tries, monkeypatch):
    """On a transformers whose generate internals were not checked, fast-forward runs the general loop (one pass
    per token) and says so once, through the hook and as a plain function: never a failure, never other tokens."""
    from trie_decode.integrations import transformers_internals as internals

    trie = small_tries[0]
    inputs = tiny_inputs(tokenizer)
    end = tokenizer.eos_token_id
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=end, eos_token_id=end)
    ref = tiny_llama.generate(**inputs, logits_processor=[TrieLogitsProcessor(trie, end_token_id=end)], **kwargs)
    monkeypatch.setattr(internals, "_VERIFIED", False)
    monkeypatch.setattr(internals, "VERIFIED", ("0.0.1", "0.0.2"))  # so the warning's text agrees with the flag
    monkeypatch.setattr(internals, "_warned", set())
    with pytest.warns(internals.UnverifiedTransformersWarning) as caught:
        hooked = tiny_llama.generate(**inputs, custom_generate=fast_forward_generate, trie=trie, end_token_id=end,
                                     **kwargs)
    said = " ".join(str(w.message) for w in caught)
    assert "fast_forward_generate" in said and "TrieLogitsProcessor" in said and "(0.0.1 to 0.0.2)" in said, said
    plain = fast_forward_generate(tiny_llama, **inputs, trie=trie, end_token_id=end, **kwargs)
    assert torch.equal(hooked, ref) and torch.equal(plain, ref)
    # filters too, per prompt over per-prompt tries, as the verified path decodes them
    deny = [[0, 1], [2], [3, 4, 5]]
    general = fast_forward_generate(tiny_llama, **inputs, trie=small_tries, deny=deny, end_token_id=end, **kwargs)
    with pytest.raises(ConstraintConfigError, match="prompt 0: allow and deny leave none"):  # as on the fast path
        fast_forward_generate(tiny_llama, **inputs, trie=small_tries[0],
                              deny=[list(range(small_tries[0].num_entries)), None, None], end_token_id=end, **kwargs)
    monkeypatch.setattr(internals, "_VERIFIED", True)
    assert torch.equal(general, fast_forward_generate(tiny_llama, **inputs, trie=small_tries, deny=deny,
                                                      end_token_id=end, **kwargs))
    assert hooked.stats.forced_tokens == 0 and hooked.stats.forward_passes == ref.shape[1] - inputs["input_ids"].shape[1]


def test_tiny_trigger_longer_than_the_prompt(tiny_llama, tokenizer, small_tries):
    """A prompt shorter than the trigger: its history is padded with -1 (the core refuses tails narrower than the
    trigger, where the trigger could never fire), in the processor and the fast-forward loop alike."""
    inputs = {"input_ids": torch.tensor([[5]]), "attention_mask": torch.ones(1, 1, dtype=torch.long)}
    free = tiny_llama.generate(**inputs, max_new_tokens=3, do_sample=False)[0, 1:].tolist()
    ref, out = _both(tiny_llama, inputs, [small_tries[0]], tokenizer, max_new_tokens=12, trigger=free[:3])
    assert out.tolist() == ref.tolist()
    seq = out[0].tolist()
    fired = next(i for i in range(3, len(seq) + 1) if seq[i - 3 : i] == free[:3])  # the prompt's token counts too
    assert fired < len(seq) and small_tries[0].walk(seq[fired : fired + 1]) > 0  # an entry starts there


def test_stop_strings_of_the_models_generation_config_are_found_token_by_token(tiny_llama, tokenizer, small_tries,
                                                                                monkeypatch):
    """A model whose generation config has stop_strings: generate drops tokenizer= before a callable custom_generate
    and refused the plain call ("could not locate a tokenizer"). It now decodes token by token through generate (the
    tokens generate gives with the processor), says so once, and lets stop_strings=... replace the config's."""
    inputs = tiny_inputs(tokenizer)
    processor = [TrieLogitsProcessor(small_tries, tokenizer)]
    options = dict(max_new_tokens=12, do_sample=False)
    monkeypatch.setattr(tiny_llama.generation_config, "stop_strings", ["ia", "e"])
    ref = tiny_llama.generate(**inputs, logits_processor=processor, tokenizer=tokenizer, **options)
    with pytest.warns(UserWarning, match="decodes token by token .*set generation_config.stop_strings = None"):
        out = fast_forward_generate(tiny_llama, **inputs, trie=small_tries, tokenizer=tokenizer, **options)
    assert out.tolist() == ref.tolist() and out.stats.forced_tokens == 0
    monkeypatch.setattr(tiny_llama.generation_config, "stop_strings", None)
    assert not torch.equal(ref, tiny_llama.generate(**inputs, logits_processor=processor, **options)), "none fired"
    # stop_strings=... replaces the config's, as generate(stop_strings=...) does
    mine = tiny_llama.generate(**inputs, logits_processor=processor, tokenizer=tokenizer, stop_strings="o", **options)
    monkeypatch.setattr(tiny_llama.generation_config, "stop_strings", ["ia", "e"])
    out = fast_forward_generate(tiny_llama, **inputs, trie=small_tries, tokenizer=tokenizer, stop_strings="o",
                                **options)
    assert out.tolist() == mine.tolist() and mine.tolist() != ref.tolist()
    with pytest.raises(ConstraintConfigError, match=r"the generation config's stop_strings need the tokenizer .*"
                                                    r"pass tokenizer= too"):
        fast_forward_generate(tiny_llama, **inputs, trie=small_tries, **options)
