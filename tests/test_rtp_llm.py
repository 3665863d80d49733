"""RTP-LLM prefix dicts: the trie masks exactly as RTP-LLM's TreeDFA does.

The reference is ``tests/rtp_reference.py``, a brute-force model of RTP-LLM's TreeDFA written from its source (state
= the joined key string, error state included). Random walks through an RTP-shaped dict of realistic size, and
every path of small hand-made dicts, compare the trie's allowed tokens (``TrieConstraint`` in ``"eos"`` mode) with
the reference's at every step, after the end token and in the error state too. Then RTP-LLM's own fixtures
(``tests/fixtures/rtp_llm``), strict mode, the range checks of the start and end ids, the documented divergences,
the build time and the ``trie-decode build --prefix-dict`` command.
"""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from rtp_reference import INT32_MAX, RtpState, RtpTreeDfa

from trie_decode import DescriptorError, InvalidTokenError, TokenTrie, TrieDecodeError
from trie_decode.cli import main as cli_main
from trie_decode.constraint import SpanRules, TrieConstraint
from trie_decode.descriptors import trie_from_prefix_dict

FIXTURES = Path(__file__).parent / "fixtures" / "rtp_llm"
SPARSE = FIXTURES / "logits_processor" / "gir_prefix_sparse_dict.json"
WEIGHTED = FIXTURES / "logits_processor" / "gir_prefix_with_weight_dict.json"
UTILS = FIXTURES / "utils" / "gir_prefix_dict.json"


GIR_LISTING = FIXTURES / "logits_processor" / "gir_prefix_dict.txt"


def _gir_prefix_dict() -> dict:
    """RTP-LLM's ``gir_prefix_dict`` listing (``key<TAB>id,id,...`` per line) as a prefix dict. The listing has no
    ``start_token_id``/``end_token_id``/``sep``: RTP-LLM's defaults (225, 2, ``"_"``) apply, as in its test."""
    prefix = {}
    for line in GIR_LISTING.read_text().splitlines():
        key, ids = line.split("\t")
        prefix[key] = [int(t) for t in ids.split(",")]
    return {"prefix_dict": prefix}


# ------------------------------------------------------------------ comparing with the reference


class _Compare:
    """The trie's allowed tokens and the reference's, side by side, for batches of token paths."""

    def __init__(self, data: dict, vocab_size: int, trie: TokenTrie | None = None, *, after_end: bool = True) -> None:
        self.ref = RtpTreeDfa(data, vocab_size)
        self.after_end = after_end  # False: after the end token, expect the end token only (keys after it diverge)
        self.trie = trie if trie is not None else trie_from_prefix_dict(data, vocab_size)
        self.constraint = TrieConstraint(self.trie, SpanRules(end_token_id=self.ref.end), "cpu")
        self._expected: dict[RtpState, list[int]] = {}
        self._keyed: dict[RtpState, list[int]] = {}
        self._kind: dict[RtpState, str] = {}
        self.kinds: Counter = Counter()

    def expected(self, state: RtpState) -> list[int]:
        """The reference's allowed tokens, except where the trie documents another answer: a state that allows
        nothing in RTP-LLM (every logit masked) allows the end token in the trie."""
        found = self._expected.get(state)
        if found is None:
            allowed = self.ref.allowed(state) if self.after_end or not self.ref.finished(state) else {self.ref.end}
            found = self._expected[state] = sorted(allowed) if allowed else [self.ref.end]
        return found

    def keyed(self, state: RtpState) -> list[int]:
        """The allowed tokens that lead to a key (the way deeper)."""
        found = self._keyed.get(state)
        if found is None:
            ref = self.ref
            live = not state.error and not ref.finished(state)
            found = self._keyed[state] = [
                t for t in self.expected(state) if live and state.status + ref.sep + str(t) in ref.candidates
            ]
        return found

    def classify(self, state: RtpState) -> str:
        found = self._kind.get(state)
        if found is None:
            ref = self.ref
            if state.error:
                found = "error"
            elif ref.finished(state):
                found = "after_end"
            elif not ref.allowed(state):
                found = "nothing"
            elif state.status not in ref.candidates:
                found = "no_key"
            elif not ref.candidates[state.status]:
                found = "no_candidates"
            else:
                found = f"key_depth_{state.status.count(ref.sep)}"
            self._kind[state] = found
        return found

    def check(self, paths: list[list[int]]) -> None:
        """Advance one row per path token by token; at every step the allowed tokens must agree."""
        c, ref = self.constraint, self.ref
        state = c.start(len(paths))
        refs = [ref.initial() for _ in paths]
        for step in range(max(map(len, paths)) + 1):
            mask = c.allowed(state).numpy()
            for r, path in enumerate(paths):
                if step > len(path):
                    continue
                got = np.flatnonzero(mask[r]).tolist()
                want = self.expected(refs[r])
                assert got == want, f"after {path[:step]}: trie allows {got[:20]}, RTP-LLM {want[:20]} ({refs[r]})"
                self.kinds[self.classify(refs[r])] += 1
            tokens = [path[step] if step < len(path) else ref.end for path in paths]
            refs = [ref.next(s, t) if step < len(p) else s for s, t, p in zip(refs, tokens, paths)]
            state = c.advance(state, torch.tensor(tokens))

    def random_walks(self, *, rows: int, steps: int, batches: int, seed: int, toward_keys: float = 0.8,
                     end_rate: float = 0.15) -> None:
        """Random paths through the reference, biased toward tokens that lead to a key (to reach deep keys)."""
        ref, rng = self.ref, random.Random(seed)
        for _ in range(batches):
            paths = []
            for _ in range(rows):
                state, path = ref.initial(), []
                for _ in range(steps):
                    options, keyed = self.expected(state), self.keyed(state)
                    if ref.end in options and rng.random() < end_rate:
                        tok = ref.end
                    elif keyed and rng.random() < toward_keys:
                        tok = rng.choice(keyed)
                    else:
                        tok = rng.choice(options)
                    path.append(tok)
                    state = ref.next(state, tok)
                paths.append(path)
            self.check(paths)

    def all_paths(self, max_len: int) -> None:
        """Every path of allowed tokens up to ``max_len`` tokens (small dicts only)."""
        ref, paths, frontier = self.ref, [], [([], self.ref.initial())]
        for _ in range(max_len):
            frontier = [(p + [t], ref.next(s, t)) for p, s in frontier for t in self.expected(s)]
            paths += [p for p, _ in frontier]
        for i in range(0, len(paths), 512):
            self.check(paths[i : i + 512])


def _rtp_shaped_dict(seed: int, vocab: int = 50_000, start: int = 1_000, end: int = 2, root_size: int = 4_000) -> dict:
    """A prefix dict shaped like RTP-LLM's real ones: thousands of first-step candidates, few of them with a key;
    keys with ``[]``, with only skipped ids, with only ids outside the vocabulary; candidates that are negative,
    beyond int32, outside the vocabulary or repeated; the end token among candidates; keys nothing reaches."""
    rng = np.random.default_rng(seed)
    tokens = np.arange(3, vocab)  # 0..2 are special (2 is the end token)
    root = rng.choice(tokens, size=root_size, replace=False).tolist()
    root_key = str(start)
    noise = root[:40] + [-1, -7, INT32_MAX + 5, 2**40, vocab, vocab + 1000]
    prefix: dict[str, list[int]] = {root_key: root + noise}
    frontier = [root_key + "_" + str(t) for t in rng.choice(root, size=300, replace=False).tolist()]
    for depth in range(1, 6):
        below = []
        for key in frontier:
            kind = rng.random()
            if kind < 0.06:
                prefix[key] = []  # end only
            elif kind < 0.09:
                prefix[key] = [-3, 2**33]  # only ids RTP-LLM skips at load: end only
            elif kind < 0.12:
                prefix[key] = [vocab + 5, vocab + 9]  # nothing inside the vocabulary
            else:
                cands = rng.choice(tokens, size=int(rng.integers(1, 21)), replace=False).tolist()
                extra = []
                if rng.random() < 0.35:
                    extra.append(end)
                if rng.random() < 0.1:
                    extra += cands[:2]
                if rng.random() < 0.1:
                    extra.append(-2)
                if rng.random() < 0.1:
                    extra.append(vocab + 77)
                prefix[key] = cands + extra
                keyed = [t for t in cands if rng.random() < 0.15 / depth]
                below += [key + "_" + str(t) for t in keyed]
        frontier = below
    prefix["999_5"] = [6, 2]  # another start token
    prefix[root_key + "_0" + str(root[0])] = [7, 2]  # a leading zero: never spelled by RTP-LLM
    prefix[root_key + "_" + str(next(t for t in range(3, vocab) if t not in set(root)))] = [5, 2]  # not a candidate
    return {"start_token_id": start, "end_token_id": end, "sep": "_", "prefix_dict": prefix}


@pytest.fixture(scope="module")
def rtp_shaped():
    data = _rtp_shaped_dict(seed=7)
    return data, _Compare(data, 50_000)


def test_rtp_shaped_dict_has_the_real_shape(rtp_shaped):
    data, compare = rtp_shaped
    prefix = data["prefix_dict"]
    assert len(set(prefix[str(data["start_token_id"])])) > 4_000
    assert 1_000 < len(prefix) < 5_000  # thousands of keys, far fewer than the candidates
    trie = compare.trie
    assert trie.fanout[0] == 4_000  # repeats, negatives, beyond-int32 and out-of-vocabulary ids skipped
    assert trie.options["strict"] is False and "end_at_start" not in trie.options
    trie.validate()


def test_random_walks_agree_with_rtp_llm_at_every_step(rtp_shaped):
    _, compare = rtp_shaped
    compare.random_walks(rows=64, steps=8, batches=8, seed=1)
    kinds = compare.kinds
    # The walks went through every kind of state, the divergent one ("nothing": RTP-LLM masks every logit) too.
    for kind in ("error", "after_end", "nothing", "no_candidates", "key_depth_0", "key_depth_2", "key_depth_4"):
        assert kinds[kind] > 0, (kind, kinds)


def test_every_path_of_a_small_dict_agrees_with_rtp_llm():
    data = {
        "start_token_id": 7,
        "end_token_id": 2,
        "prefix_dict": {
            "7": [3, 4, 5, 6, 2, 9, 9, -1, 40, 2**31],  # the end token right after the start: an empty answer
            "7_3": [2, 8, 4],  # an entry that goes on
            "7_3_8": [],  # end only
            "7_3_4": [30, 31],  # nothing inside the vocabulary (20)
            "7_4": [-5],  # only a skipped id: end only
            "7_5": [5, 7],  # the start token as a candidate
            "7_5_5": [2],
            "7_5_7": [3, 2],
            "7_5_7_3": [6],
            "8": [1],  # unreachable
        },
    }
    compare = _Compare(data, 20)
    compare.all_paths(max_len=6)
    assert sorted(compare.trie.sequences()) == [
        (2,), (3,), (3, 4), (3, 8), (4,), (5, 5), (5, 7), (5, 7, 3, 6), (6,), (9,),
    ]
    assert compare.trie.options["end_at_start"] is True
    assert {"error", "after_end", "nothing", "no_candidates"} <= set(compare.kinds)


@pytest.mark.parametrize("sep", ["_", "-", "::", " ", "|x|"])
def test_separators(sep):
    prefix = {"3": [4, 5], "3?4": [6, 2], "3?4?6": [2], "3?5": [7]}
    data = {"start_token_id": 3, "end_token_id": 2, "sep": sep,
            "prefix_dict": {k.replace("?", sep): v for k, v in prefix.items()}}
    compare = _Compare(data, 10)
    compare.all_paths(max_len=5)
    assert sorted(compare.trie.sequences()) == [(4,), (4, 6), (5, 7)]


def test_a_separator_with_digits_is_followed_path_by_path():
    # With sep "1", the paths (5, 3) and (513) both spell the key "91513": RTP-LLM reaches it both ways.
    data = {"start_token_id": 9, "end_token_id": 2, "sep": "1",
            "prefix_dict": {"9": [5, 513], "915": [3], "91513": [2, 4]}}
    compare = _Compare(data, 600)
    compare.all_paths(max_len=4)
    assert sorted(compare.trie.sequences()) == [(5, 3), (5, 3, 4), (513,), (513, 4)]
    with pytest.raises(DescriptorError, match=r"(?s)sep '1' holds a digit.*1 keys are spelled by more than one"):
        trie_from_prefix_dict(data, 600, strict=True)


def test_missing_fields_take_rtp_llm_defaults():
    data = {"prefix_dict": {"225": [5, 6], "225_5": [2]}}
    trie = trie_from_prefix_dict(data, 10)
    assert trie.options == {"source": "rtp_llm_prefix_dict", "start_token_id": 225, "end_token_id": 2, "sep": "_",
                            "strict": False}
    _Compare(data, 10, trie).all_paths(max_len=3)
    with pytest.raises(DescriptorError, match=r"start_token_id is missing \(RTP-LLM silently uses 225\)"):
        trie_from_prefix_dict(data, 10, strict=True)


@st.composite
def _small_dicts(draw):
    """Small prefix dicts with everything in them: keys along random paths, junk keys, [] lists, repeats, ids that
    are negative, beyond int32 or outside the vocabulary (8), the end token anywhere (even right after the start)."""
    start = draw(st.integers(0, 9))
    end = draw(st.integers(1, 7))  # end 0 is RTP-LLM's quirk, tested on its own
    ids = st.one_of(st.integers(0, 9), st.integers(0, 9), st.sampled_from([-1, 2**31, 2**40]))
    prefix = {}
    paths = draw(st.lists(st.lists(st.integers(0, 9), max_size=3), max_size=12))
    for path in [[]] * draw(st.integers(0, 1)) + paths:
        prefix[str(start) + "".join(f"_{t}" for t in path)] = draw(st.lists(ids, max_size=4))
    return {"start_token_id": start, "end_token_id": end, "prefix_dict": prefix}


@settings(max_examples=80, deadline=None)
@given(_small_dicts())
def test_small_random_dicts_agree_with_rtp_llm(data):
    for strict in (False, True):
        try:
            trie = trie_from_prefix_dict(data, 8, strict=strict)
        except DescriptorError:
            assert strict
            continue
        _Compare(data, 8, trie, after_end=False).all_paths(max_len=4)


def test_an_empty_prefix_dict_allows_only_the_end_token():
    data = {"start_token_id": 1, "end_token_id": 2, "prefix_dict": {}}
    trie = trie_from_prefix_dict(data, 10)
    assert trie.sequences() == [(2,)] and trie.options["end_at_start"] is True
    _Compare(data, 10, trie).all_paths(max_len=3)


# ------------------------------------------------------------------ RTP-LLM's own fixtures


def test_fixture_sparse_dict():
    trie = trie_from_prefix_dict(SPARSE, 100_000)
    assert sorted(trie.sequences()) == [(64000, 64001), (64003, 64001), (64006, 64004), (64008, 64001), (64011,)]
    compare = _Compare(json.loads(SPARSE.read_text()), 100_000, trie)
    compare.all_paths(max_len=5)
    # TreeLogitsProcessorTest.testUpdateStatus: these paths reach these statuses, and a token after the end
    # token changes nothing.
    ref = compare.ref
    for path, status in [([64000, 64001, 2], "225_64000_64001_2"), ([64006, 64004, 2, 1], "225_64006_64004_2")]:
        assert ref.run(path).status == status
    # testProcess: at the start 64000 survives the mask, 64001 does not.
    allowed = compare.constraint.allowed(compare.constraint.start(1))[0]
    assert allowed[64000] and not allowed[64001] and int(allowed.sum()) == 5


def test_fixture_with_weights_masks_like_the_sparse_one():
    sparse, weighted = trie_from_prefix_dict(SPARSE, 100_000), trie_from_prefix_dict(WEIGHTED, 100_000)
    for name in ("child_ptr", "token", "node_entry", "level_ptr"):
        assert getattr(weighted, name).tolist() == getattr(sparse, name).tolist()
    with pytest.raises(DescriptorError, match=r"fields this reader ignores: \['weight_dict'\]"):
        trie_from_prefix_dict(WEIGHTED, 100_000, strict=True)


def test_fixture_utils_dict_allows_only_the_end_token():
    # RTP-LLM's loader test data: its keys do not start at the start token 225, so RTP-LLM allows only the end
    # token from the first step on. The trie says the same with the one-token entry [2].
    trie = trie_from_prefix_dict(str(UTILS), 16)
    assert trie.sequences() == [(2,)] and trie.options["end_at_start"] is True
    _Compare(json.loads(UTILS.read_text()), 16, trie).all_paths(max_len=3)
    with pytest.raises(DescriptorError) as info:
        trie_from_prefix_dict(UTILS, 16, strict=True)
    message = str(info.value)
    assert "the start key '225' is missing: RTP-LLM allows only the end token" in message
    assert "2 keys are not reachable from the start key '225'" in message
    assert "fields this reader ignores: ['prefix_weight_dict']" in message


def test_fixture_gir_prefix_dict():
    data = _gir_prefix_dict()
    prefix = data["prefix_dict"]
    # The listing as reconstructed (tests/fixtures/rtp_llm/README.md): 7,835 sorted start-key candidates, eight keys
    # below them; 48,685 characters like the original.
    assert len(GIR_LISTING.read_text()) == 48_685 and len(prefix) == 9
    root = prefix["225"]
    assert len(root) == 7_835 and root == sorted(set(root)) and (root[0], root[-1]) == (64000, 92530)
    start = time.perf_counter()
    trie = trie_from_prefix_dict(json.dumps(data), 100_000)
    assert time.perf_counter() - start < 0.5
    assert trie.options["start_token_id"] == 225 and trie.options["end_token_id"] == 2 and trie.options["sep"] == "_"
    # 7,835 first-step candidates, four of them with a key; each first-step key has one keyed candidate.
    assert trie.fanout[0] == 7_835
    assert trie.num_entries == (7_835 - 4) + 5 + 3 + 2 + 250
    assert trie.children(trie.walk([64000]))[0].tolist() == [64001, 64004, 64026, 64035, 64060]
    assert trie.lookup([64011]) is not None and trie.lookup([64000, 64035]) is not None
    assert trie.lookup([64000]) is None  # RTP-LLM does not allow the end token there
    compare = _Compare(data, 100_000, trie)
    compare.random_walks(rows=32, steps=5, batches=4, seed=3)
    # TreeLogitsProcessorTest.testUpdateStatus's paths (to the end token and one token past it) and the rows of
    # testProcess: at the start key 64000, 64003 and 64011 stay, 64001 is masked.
    compare.check([[64000, 64001, 2, 1], [64003, 64001, 2, 1], [64006, 64004, 2, 1], [64008, 64001, 2, 1],
                   [64008, 68956, 2], [92530, 2]])
    assert [compare.ref.run(p).status for p in ([64000, 64001, 2, 1], [64008, 64001, 2])] == [
        "225_64000_64001_2", "225_64008_64001_2"]
    first = compare.constraint.allowed(compare.constraint.start(1))[0]
    assert first[[64000, 64003, 64011]].all() and not first[64001]
    assert {"error", "after_end", "key_depth_0", "key_depth_1", "key_depth_2"} <= set(compare.kinds)
    with pytest.raises(DescriptorError, match=r"8087 candidates lead to a missing key"):
        trie_from_prefix_dict(data, 100_000, strict=True)


# ------------------------------------------------------------------ strict mode

CLEAN = {"start_token_id": 1, "end_token_id": 2, "sep": "_",
         "prefix_dict": {"1": [5, 6], "1_5": [2], "1_6": [7, 2], "1_6_7": [2]}}


def _with(prefix_dict=None, **fields):
    data = json.loads(json.dumps(CLEAN))
    if prefix_dict is not None:
        data["prefix_dict"] = prefix_dict
    for name, value in fields.items():
        if value is None:
            data.pop(name)
        else:
            data[name] = value
    return data


def test_strict_accepts_a_clean_dict():
    strict = trie_from_prefix_dict(CLEAN, 10, strict=True)
    assert sorted(strict.sequences()) == [(5,), (6,), (6, 7)]
    assert strict.options["strict"] is True


@pytest.mark.parametrize(
    "data, pattern",
    [
        (_with(start_token_id=None), r"start_token_id is missing \(RTP-LLM silently uses 225\)"),
        (_with(end_token_id=None), r"end_token_id is missing \(RTP-LLM silently uses 2\)"),
        (_with(extra={"a": 1}), r"fields this reader ignores: \['extra'\]"),
        (_with({"1": [5], "1_5": [0]}, end_token_id=0), r"end_token_id is 0: RTP-LLM's TreeDFA starts with ten 0"),
        (_with({"2": [5], "2_5": [2]}, start_token_id=2), r"start_token_id and end_token_id are both 2"),
        (_with({"12": [5], "12_5": [2]}, start_token_id=12), r"start_token_id 12 is outside the vocabulary"),
        (_with({"1": [5], "1-5": [2]}, sep="-"), None),  # a clean dict with another separator
        (_with({"1": [5], "1955": [2]}, sep="9"), r"sep '9' holds a digit"),
        (_with({"5": [6]}), r"the start key '1' is missing"),
        (_with({"1": [5, 2], "1_5": [2]}), r"end token is allowed right after the start token \(key '1'\)"),
        (_with({"1": [5], "1_5": []}), r"1 keys without a usable candidate .*e\.g\. '1_5'"),
        (_with({"1": [5], "1_5": [-4]}), r"1 negative candidate ids \(RTP-LLM skips them\), e\.g\. '1_5': -4"),
        (_with({"1": [5, 2**31], "1_5": [2]}), r"1 candidate ids beyond int32 .*'1': 2147483648"),
        (_with({"1": [5, 11], "1_5": [2]}), r"1 candidate ids outside the vocabulary \[0, 10\) .*'1': 11"),
        (_with({"1": [5], "1_5": [12, 13]}), r"1 reachable keys allow no token inside the vocabulary .*'1_5'"),
        (_with({"1": [5, 5, 5], "1_5": [2, 2]}), r"3 repeated candidates \(RTP-LLM keeps one\)"),
        (_with({"1": [5, 6], "1_5": [2]}), r"1 candidates lead to a missing key .*candidate 6 of '1' -> '1_6'"),
        (_with({"1": [5], "1_5": [2, 6], "1_5_2": [7]}), r"1 keys continue after the end token.*'1_5_2'"),
        (_with({"1": [5], "1_5": [2], "3_5": [2], "1_6": [2]}), r"2 keys are not reachable .*'3_5', '1_6'"),
    ],
)
def test_strict_names_what_rtp_llm_accepts_silently(data, pattern):
    trie_from_prefix_dict(data, 10)  # the default mode reads every one of these the way RTP-LLM does
    if pattern is None:
        trie_from_prefix_dict(data, 10, strict=True)
        return
    with pytest.raises(DescriptorError, match=pattern):
        trie_from_prefix_dict(data, 10, strict=True)


def test_strict_lists_every_kind_at_once():
    data = _with({"1": [5, 6, -1, 6], "1_5": [], "9": [2]}, end_token_id=None)
    with pytest.raises(DescriptorError) as info:
        trie_from_prefix_dict(data, 10, strict=True)
    lines = str(info.value).splitlines()
    assert lines[0] == "prefix dict (strict): 6 kinds of input RTP-LLM accepts silently:"
    assert len(lines) == 7 and all(line.startswith("  - ") for line in lines[1:])


def test_strict_examples_are_capped():
    data = _with({"1": list(range(3, 10)), **{f"1_{t}": [2] for t in range(3, 4)}})
    with pytest.raises(DescriptorError, match=r"6 candidates lead to a missing key \(RTP-LLM then allows only the end token\), e\.g\. (candidate \d of '1' -> "
                                              r"'1_\d', ){4}candidate \d of '1' -> '1_\d', \.\.\.$"):
        trie_from_prefix_dict(data, 10, strict=True)


# ------------------------------------------------------------------ range checks and malformed input


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize(
    "fields, error, pattern",
    [
        ({"start_token_id": -1}, InvalidTokenError, r"start_token_id -1 is negative"),
        ({"end_token_id": -3_000_000_000}, InvalidTokenError, r"end_token_id -3000000000 is negative"),
        ({"start_token_id": 3_000_000_000}, InvalidTokenError, r"start_token_id 3000000000 does not fit in int32"),
        ({"end_token_id": 2**31}, InvalidTokenError, r"end_token_id 2147483648 does not fit in int32"),
        ({"end_token_id": 2**70}, InvalidTokenError, r"does not fit in int32"),
        ({"end_token_id": 10}, InvalidTokenError, r"end_token_id 10 is outside the vocabulary \[0, 10\)"),
        ({"start_token_id": "1"}, DescriptorError, r"start_token_id must be an integer, got '1'"),
        ({"end_token_id": True}, DescriptorError, r"end_token_id must be an integer, got True"),
        ({"end_token_id": 2.0}, DescriptorError, r"end_token_id must be an integer, got 2.0"),
        ({"sep": ""}, DescriptorError, r"'sep' must be a non-empty string, got ''"),
        ({"sep": 5}, DescriptorError, r"'sep' must be a non-empty string, got 5"),
        ({"prefix_dict": None}, DescriptorError, r"'prefix_dict' must be an object"),
        ({"prefix_dict": {"1": 5}}, DescriptorError, r"candidates of '1' must be a list of token ids, got int"),
        ({"prefix_dict": {"1": [5, "x"]}}, DescriptorError, r"candidates of '1' holds 'x', not an integer"),
        ({"prefix_dict": {"1": [[5]]}}, DescriptorError, r"candidates of '1' holds \[5\], not an integer"),
        ({"prefix_dict": {"1": [5, 2.5]}}, DescriptorError, r"candidates of '1' holds 2.5, not an integer"),
        ({"prefix_dict": {"1": [False]}}, DescriptorError, r"candidates of '1' holds False, not an integer"),
        ({"prefix_dict": {1: [5]}}, DescriptorError, r"key 1 is int, not a string"),
    ],
)
def test_bad_fields(fields, error, pattern, strict):
    data = dict(CLEAN, **fields)
    with pytest.raises(error, match=pattern) as info:
        trie_from_prefix_dict(data, 10, strict=strict)
    assert isinstance(info.value, TrieDecodeError)


def test_start_and_end_at_the_int32_limit_are_accepted():
    data = {"start_token_id": INT32_MAX, "end_token_id": 2, "prefix_dict": {str(INT32_MAX): [5]}}
    assert trie_from_prefix_dict(data, 10).sequences() == [(5,)]


@pytest.mark.parametrize("vocab", [0, -1, True, 2**31 + 1, 10.0])
def test_bad_vocab_size(vocab):
    with pytest.raises(InvalidTokenError, match="vocab_size must be an integer"):
        trie_from_prefix_dict(CLEAN, vocab)


@pytest.mark.parametrize(
    "payload, pattern",
    [
        ([1, 2], r"prefix dict must be a JSON object, got list"),
        ({"start_token_id": 1, "end_token_id": 2}, r"field 'prefix_dict' is missing"),
        ('{"start_token_id": 1,', r"prefix dict: invalid JSON"),
        ("not/a/file.json", r"prefix dict: no such file 'not/a/file.json'"),
    ],
)
def test_malformed_payload(payload, pattern):
    with pytest.raises(DescriptorError, match=pattern):
        trie_from_prefix_dict(payload, 10)


def test_huge_candidate_ids_are_skipped():
    data = _with({"1": [5, 2**70, -(2**70)], "1_5": [2]})
    assert trie_from_prefix_dict(data, 10).sequences() == [(5,)]
    with pytest.raises(DescriptorError, match=r"1 negative .*\n.*1 candidate ids beyond int32"):
        trie_from_prefix_dict(data, 10, strict=True)


# ------------------------------------------------------------------ where a trie cannot say what RTP-LLM does


def test_divergence_keys_after_the_end_token():
    data = _with({"1": [5], "1_5": [2, 6], "1_5_2": [7], "1_5_6": [2]})
    compare = _Compare(data, 10)
    after_end = compare.ref.run([5, 2])
    assert compare.ref.allowed(after_end) == {7}  # RTP-LLM: the key "1_5_2" after the end token
    row = compare.constraint.advance(compare.constraint.advance(compare.constraint.start(1), torch.tensor([5])),
                                     torch.tensor([2]))
    assert np.flatnonzero(compare.constraint.allowed(row)[0]).tolist() == [2]  # the trie: the end token only


def test_divergence_end_token_zero():
    data = _with({"1": [5, 6], "1_5": [0, 6], "1_6": [0]}, end_token_id=0)
    ref = RtpTreeDfa(data, 10)
    # RTP-LLM's TreeDFA starts with ten 0 tokens in its history: with end 0 it is "finished" before the first
    # token, never moves, and allows the start key's candidates at every step.
    assert ref.run([5, 6, 0]).status == "1" and ref.allowed(ref.run([5, 6, 0])) == {5, 6}
    # The trie reads the dict as intended.
    assert sorted(trie_from_prefix_dict(data, 10).sequences()) == [(5,), (5, 6), (6,)]


def test_divergence_nothing_inside_the_vocabulary():
    data = _with({"1": [5], "1_5": [12]})
    compare = _Compare(data, 10)
    assert compare.ref.allowed(compare.ref.run([5])) == set()  # RTP-LLM masks every logit
    assert compare.trie.sequences() == [(5,)]  # the trie allows the end token there (what _Compare expects)
    compare.all_paths(max_len=3)


# ------------------------------------------------------------------ size and speed


def test_ten_thousand_keys_build_well_under_a_second():
    rng = np.random.default_rng(0)
    prefix = {"5": rng.choice(np.arange(10, 60_000), 3_000, replace=False).tolist()}
    frontier = ["5_" + str(t) for t in prefix["5"][:2_500]]
    while len(prefix) < 10_000:
        key = frontier.pop(0)
        cands = rng.choice(np.arange(10, 60_000), 12, replace=False).tolist() + [2]
        prefix[key] = cands
        frontier += [key + "_" + str(t) for t in cands[:3]]
    data = json.dumps({"start_token_id": 5, "end_token_id": 2, "prefix_dict": prefix})
    trie_from_prefix_dict(data, 60_000)  # warm-up
    start = time.perf_counter()
    trie = trie_from_prefix_dict(data, 60_000)
    elapsed = time.perf_counter() - start
    assert trie.num_entries > 100_000
    assert elapsed < 0.8, f"{elapsed:.2f}s"  # about 0.25 s on a quiet machine


def test_repeated_candidates_do_not_multiply_paths():
    depth = 40
    prefix = {"0" + "".join(f"_{t}" for t in range(1, d + 1)): [d + 1] * 6 for d in range(depth)}
    prefix["0" + "".join(f"_{t}" for t in range(1, depth + 1))] = [99] * 6
    trie = trie_from_prefix_dict({"start_token_id": 0, "end_token_id": 99, "prefix_dict": prefix}, 100)
    assert trie.sequences() == [tuple(range(1, depth + 1))]


# ------------------------------------------------------------------ the command line


def test_cli_build_prefix_dict(tmp_path, capsys):
    out = tmp_path / "sparse.trie.safetensors"
    assert cli_main(["build", "--prefix-dict", str(SPARSE), "--vocab-size", "100000", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "5 entries" in printed and "RTP-LLM" in printed
    trie = TokenTrie.load(out)
    assert sorted(trie.sequences()) == sorted(trie_from_prefix_dict(SPARSE, 100_000).sequences())
    assert trie.options["source"] == "rtp_llm_prefix_dict" and trie.vocab_size == 100_000


def test_cli_build_prefix_dict_strict(tmp_path, capsys):
    out = tmp_path / "x.trie"
    assert cli_main(["build", "--prefix-dict", str(SPARSE), "--vocab-size", "100000", "-o", str(out),
                     "--strict"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("trie-decode build: error: prefix dict (strict)") and "sparse_mask" in err
    assert not out.exists()
    clean = tmp_path / "clean.json"
    clean.write_text(json.dumps(CLEAN))
    assert cli_main(["build", "--prefix-dict", str(clean), "--vocab-size", "10", "-o", str(out), "--strict"]) == 0


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prefix-dict", "d.json", "-o", "x"], "--prefix-dict needs --vocab-size"),
        (["names.txt", "--prefix-dict", "d.json", "--vocab-size", "9", "-o", "x"], "exactly one of: an entries file"),
        (["-o", "x", "--vocab-size", "9"], "exactly one of: an entries file"),
        (["names.txt", "-o", "x"], "--tokenizer is required"),
        (["names.txt", "--tokenizer", "t", "--strict", "-o", "x"], "--strict only applies to --prefix-dict"),
        (["--prefix-dict", "d.json", "--vocab-size", "0", "-o", "x"], "--vocab-size must be an integer in [1, 2**31]"),
    ],
)
def test_cli_build_usage_errors(args, message, capsys):
    with pytest.raises(SystemExit) as info:
        cli_main(["build", *args])
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_build_prefix_dict_missing_file(tmp_path, capsys):
    assert cli_main(["build", "--prefix-dict", str(tmp_path / "nope.json"), "--vocab-size", "10",
                     "-o", str(tmp_path / "x")]) == 1
    assert "no such file" in capsys.readouterr().err
