"""Seven tokenizer families, real files: the trie holds the ids each model writes in context.

Families (see ``model_fixtures.tokenizer_zoo``): SmolLM2, Llama 3.2, DeepSeek V4, Qwen 3.6 (byte-level
BPE), Mistral SentencePiece v1 and v3, Mistral Tekken (each through a transformers fast tokenizer and through
``MistralCommonBackend``), Gemma 3 (BPE with ``"▁"`` and byte fallback). Per family:

- round trip: the bytes of every form's tokens are the entry's text (with its leading space where the form has one);
- in-context agreement in four places: after text (``"The answer is"``), after the family's chat header, after a
  newline, after an opening quote. The reference is the tokenization of the whole text (for chat headers, the chat
  template's own encoding of an assistant reply where the family has one). The right ``leading_space`` agrees for
  100% of the names, the wrong one for 0%, ``context=`` for 100%, and ``check_prompt`` says which is which;
- a prompt ending with a space is reported (and healed);
- fingerprints: the same ids give the same fingerprint through either loader, and a trie built with one loads with
  the other; legacy fingerprints still match;
- ``generate`` with a tiny random model as wide as the vocabulary (262,144 for Gemma).

The width tests (a tokenizer wider than the model's logits: Llama 3.2 has 128,257 ids for 128,256 logits) pass
once the constraint accepts logits narrower than the trie's vocabulary when every trie token fits.
"""

from __future__ import annotations

import functools
import unicodedata

import numpy as np
import pytest
import torch

from trie_decode import InvalidEntryError, InvalidTokenError, TokenizerMismatchError, TokenTrie
from trie_decode.constraint import SpanRules, TrieConstraint
from trie_decode.forms import check_prompt, heal_prompt
from trie_decode.tokenizers import (
    ContextError,
    byte_scheme,
    encode_texts,
    legacy_tokenizer_fingerprint,
    token_bytes,
    tokenizer_fingerprint,
    tokenizer_vocab_size,
)

pytestmark = [pytest.mark.slow]

# (family, loader). The Mistral families are loaded both ways: vLLM serves Mistral models with MistralCommonBackend.
CASES = [
    ("smollm2", "hf"),
    ("llama3.2", "hf"),
    ("deepseek", "hf"),
    ("qwen3.6", "hf"),
    ("mistral-v1", "hf"),
    ("mistral-v1", "mistral-common"),
    ("mistral-v3", "hf"),
    ("mistral-v3", "mistral-common"),
    ("mistral-tekken", "hf"),
    ("mistral-tekken", "mistral-common"),
    ("gemma3", "hf"),
]
IDS = [f"{f}-{b}" if b != "hf" else f for f, b in CASES]
SENTENCEPIECE = {"mistral-v1", "mistral-v3"}

QUESTION = "Which country is Rome in?"
TEXT_PROMPT = f"Q: {QUESTION}\nA: The answer is"
NEWLINE_PROMPT = f"Q: {QUESTION}\nA:\n"
QUOTE_PROMPT = f'Q: {QUESTION}\nA: "'
# Chat headers of the families whose tokenizer here has no chat template (what their models' templates end with).
MANUAL_HEADERS = {
    "llama3.2": "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "deepseek": "<｜Assistant｜>",
    "gemma3": "<start_of_turn>model\n",
}


def rule(family: str, place: str) -> bool:
    """The documented rule: which ``leading_space`` a family writes an entry with, in each place."""
    if place == "text":
        return True
    if place == "chat":
        return family in SENTENCEPIECE  # mistral_common encodes the reply with SentencePiece's dummy prefix
    return False  # after a newline or an opening quote


@functools.lru_cache(maxsize=None)
def load(family: str, backend: str):
    from model_fixtures.tokenizer_zoo import load_tokenizer

    return load_tokenizer(family, backend=backend)


@pytest.fixture(scope="module")
def names() -> list[str]:
    """The 249 country names plus every 80th language name (diacritics, apostrophes, parentheses)."""
    import pycountry

    countries = sorted({c.name for c in pycountry.countries})
    languages = sorted({lang.name for lang in pycountry.languages})
    return countries + [n for n in languages[::80] if n not in countries]


def _normalize(family: str) -> str | None:
    return "NFC" if family == "qwen3.6" else None


def _after(tok, prompt: str, texts: list[str]) -> list[list[int] | None]:
    """Reference: tokenize the whole text, keep the ids after the prompt's (None where the prompt's ids change)."""
    head = encode_texts(tok, [prompt])[0]
    full = encode_texts(tok, [prompt + t for t in texts])
    return [f[len(head):] if f[: len(head)] == head else None for f in full]


def _chat_reference(family: str, backend: str, names: list[str]) -> tuple[list[list[int]], str]:
    """(the ids of each name as an assistant reply, the chat prompt as text for check_prompt)."""
    tok = load(family, backend)
    if family.startswith("mistral"):
        tok = load(family, "mistral-common")  # the model's own chat encoding (same ids through either loader)
    elif family in MANUAL_HEADERS:
        header = MANUAL_HEADERS[family]
        refs = _after(tok, header, names)
        assert all(r is not None for r in refs)
        return refs, header
    user = [{"role": "user", "content": QUESTION}]

    def encode(messages, **kw):
        out = tok.apply_chat_template(messages, tokenize=True, **kw)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    prompt = encode(user, add_generation_prompt=True)
    refs = []
    for name in names:
        ids = encode(user + [{"role": "assistant", "content": name}], continue_final_message=True)
        assert ids[: len(prompt)] == prompt
        refs.append(ids[len(prompt):])
    if family.startswith("mistral"):
        text = f"[INST] {QUESTION} [/INST]"
    else:
        text = tok.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    return refs, text


def _agreement(trie: TokenTrie, refs: list[list[int] | None], names: list[str]) -> float:
    hits = 0
    for name, ids in zip(names, refs):
        entry = trie.lookup(ids) if ids is not None else None
        hits += entry is not None and entry.name == name
    return hits / len(names)


def _texts(family: str, names: list[str], space: bool) -> list[str]:
    norm = _normalize(family)
    return [(" " if space else "") + (unicodedata.normalize(norm, n) if norm else n) for n in names]


# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family,backend", CASES, ids=IDS)
def test_round_trip(family, backend, names):
    tok = load(family, backend)
    table = token_bytes(tok)
    assert len(table) == tokenizer_vocab_size(tok)
    for space in (True, False):
        trie = TokenTrie.from_strings(names, tok, leading_space=space, normalize=_normalize(family))
        trie.validate()
        assert trie.num_entries == len(names)
        for i, text in enumerate(_texts(family, names, space)):
            tokens = trie.entry(i).tokens
            assert b"".join(table[t] for t in tokens).decode("utf-8") == text, (family, text, tokens)
            if backend == "hf":  # MistralCommonBackend.decode() of SentencePiece ids shows raw pieces ("<0xC7>")
                assert tok.decode(list(tokens)).strip() == text.strip(), (family, text)
            if space and text[1:2].isascii() and text[1:2].isalpha():
                # No lone space token before a word (MistralCommonBackend's " " + s gave one to every entry).
                assert table[tokens[0]].strip(b" ") != b"", (family, text, tokens)


@pytest.mark.parametrize("place", ["text", "chat", "newline", "quote"])
@pytest.mark.parametrize("family,backend", CASES, ids=IDS)
def test_in_context_agreement(family, backend, place, names):
    tok = load(family, backend)
    if place == "quote":  # a name that starts with punctuation merges with the quote ('"' + "'Are'are"): see below
        names = [n for n in names if n[0].isalpha()]
    norm = _normalize(family)
    if place == "chat":
        refs, prompt = _chat_reference(family, backend, names)
    else:
        prompt = {"text": TEXT_PROMPT, "newline": NEWLINE_PROMPT, "quote": QUOTE_PROMPT}[place]
        refs = _after(tok, prompt, _texts(family, names, place == "text"))
    right = rule(family, place)
    good = TokenTrie.from_strings(names, tok, leading_space=right, normalize=norm)
    bad = TokenTrie.from_strings(names, tok, leading_space=not right, normalize=norm)
    in_context = TokenTrie.from_strings(names, tok, context=prompt, normalize=norm)
    assert _agreement(good, refs, names) == 1.0
    assert _agreement(bad, refs, names) == 0.0
    assert _agreement(in_context, refs, names) == 1.0
    assert check_prompt(good, tok, prompt) == []
    assert check_prompt(in_context, tok, prompt) == []
    findings = check_prompt(bad, tok, prompt)
    assert [f.code for f in findings] == ["form_mismatch"] and findings[0].share == 1.0
    assert f"leading_space={right}" in findings[0].fix or "context=" in findings[0].fix
    both = TokenTrie.from_strings(names, tok, leading_space=[True, False], normalize=norm)
    assert _agreement(both, refs, names) == 1.0 and check_prompt(both, tok, prompt) == []


@pytest.mark.parametrize("family", ["smollm2", "llama3.2", "qwen3.6", "mistral-v3"])
def test_a_name_that_merges_with_the_prompt_is_reported(family):
    tok = load(family, "hf")
    names = ["'Are'are", "France"]
    trie = TokenTrie.from_strings(names, tok)
    with pytest.raises(ContextError, match="not a stable prefix of entry 0"):
        TokenTrie.from_strings(names, tok, context=QUOTE_PROMPT)
    findings = check_prompt(trie, tok, QUOTE_PROMPT)
    assert [f.code for f in findings] == ["merges_with_prompt"] and findings[0].share == 0.5


@pytest.mark.parametrize("family,backend", CASES, ids=IDS)
def test_prompt_ending_with_a_space(family, backend, names):
    tok = load(family, backend)
    spaced = TokenTrie.from_strings(names, tok, leading_space=True, normalize=_normalize(family))
    findings = check_prompt(spaced, tok, TEXT_PROMPT + " ")
    assert findings and findings[0].code == "trailing_space" and "rstrip" in findings[0].fix
    assert heal_prompt(TEXT_PROMPT + " ") == TEXT_PROMPT and check_prompt(spaced, tok, heal_prompt(TEXT_PROMPT + " ")) == []
    with pytest.raises(ContextError, match="ends with whitespace"):
        TokenTrie.from_strings(names, tok, context=TEXT_PROMPT + " ")
    ids = heal_prompt(encode_texts(tok, [TEXT_PROMPT + " "])[0], tok)
    assert ids == encode_texts(tok, [TEXT_PROMPT])[0]


def test_heal_prompt_reads_ids_as_check_prompt_does(names):
    """Ids as a tensor batch of one (what a tokenizer returns) are that prompt's ids, as :func:`check_prompt` reads
    them; a batch of several, or ids that are not integers, is a named error, not a TypeError from a comparison."""
    tok = load("smollm2", "hf")
    ids = encode_texts(tok, [TEXT_PROMPT + " "])[0]
    assert heal_prompt(torch.tensor([ids]), tok) == heal_prompt(np.array(ids), tok) == ids[:-1]
    with pytest.raises(InvalidEntryError, match="one prompt at a time, got a batch of 2"):
        heal_prompt(torch.tensor([ids, ids]), tok)
    with pytest.raises(InvalidEntryError, match="text or a list of token ids"):
        heal_prompt([1.5, 2.0], tok)


@pytest.mark.parametrize("family", ["mistral-v1", "mistral-v3", "mistral-tekken"])
def test_fingerprint_is_the_same_through_either_loader(family, names):
    hf, mc = load(family, "hf"), load(family, "mistral-common")
    assert tokenizer_fingerprint(hf) == tokenizer_fingerprint(mc)
    assert token_bytes(hf) == token_bytes(mc)
    for space in (True, False):
        a = TokenTrie.from_strings(names, hf, leading_space=space)
        b = TokenTrie.from_strings(names, mc, leading_space=space)
        assert a.sequences() == b.sequences() and a.fingerprint == b.fingerprint
        a.check_tokenizer(mc)
        b.check_tokenizer(hf)
    if family == "mistral-tekken":  # why get_vocab() could not be the fingerprint: it is lossy through mistral-common
        assert len(mc.get_vocab()) < len(mc) == len(hf.get_vocab()) == 131072
        assert legacy_tokenizer_fingerprint(hf) != legacy_tokenizer_fingerprint(mc)


def test_fingerprints_differ_between_families_and_legacy_ones_still_match(names, tmp_path):
    seen = {}
    for family, backend in CASES:
        tok = load(family, backend)
        fp = tokenizer_fingerprint(tok)
        assert len(fp) == 32 and int(fp, 16) >= 0
        seen.setdefault(fp, set()).add(family)
    assert all(len(families) == 1 for families in seen.values()) and len(seen) == 8
    tok = load("llama3.2", "hf")
    trie = TokenTrie.from_strings(names[:20], tok)
    old = TokenTrie.from_sequences(trie.sequences(), trie.vocab_size, fingerprint=legacy_tokenizer_fingerprint(tok))
    old.check_tokenizer(tok)  # a trie saved before token-bytes fingerprints still works with its tokenizer
    old.save(tmp_path / "old.trie")
    TokenTrie.load(tmp_path / "old.trie", tokenizer=tok)
    with pytest.raises(TokenizerMismatchError):
        old.check_tokenizer(load("deepseek", "hf"))
    with pytest.raises(TokenizerMismatchError):
        trie.check_tokenizer(load("smollm2", "hf"))


def test_byte_schemes():
    expected = {"smollm2": "bytelevel", "llama3.2": "bytelevel", "deepseek": "bytelevel", "qwen3.6": "bytelevel",
                "mistral-v1": "sentencepiece", "mistral-v3": "sentencepiece", "mistral-tekken": "bytelevel",
                "gemma3": "sentencepiece"}
    for family, backend in CASES:
        want = "mistral-common" if backend == "mistral-common" else expected[family]
        assert byte_scheme(load(family, backend)) == want, family
    # SentencePiece byte fallback: a newline is the byte piece <0x0A>, and its bytes are b"\n".
    table = token_bytes(load("mistral-v3", "hf"))
    assert table[load("mistral-v3", "hf").convert_tokens_to_ids("<0x0A>")] == b"\n"


def test_qwen_entries_are_nfc_normalized(names):
    tok = load("qwen3.6", "hf")
    decomposed = [unicodedata.normalize("NFD", n) for n in names if unicodedata.normalize("NFD", n) != n]
    assert len(decomposed) >= 5
    table = token_bytes(tok)
    plain = TokenTrie.from_strings(decomposed, tok, leading_space=True)
    nfc = TokenTrie.from_strings(decomposed, tok, leading_space=True, normalize="NFC")
    assert nfc.options["normalize"] == "NFC" and "normalize" not in plain.options
    for i, name in enumerate(decomposed):
        text = b"".join(table[t] for t in nfc.entry(i).tokens).decode()
        assert text == " " + unicodedata.normalize("NFC", name) != " " + name  # decoding gives the NFC text
        assert nfc.entry(i).name == name  # the name stays as given
    with pytest.raises(InvalidEntryError, match="normalize must be one of"):
        TokenTrie.from_strings(["x"], tok, normalize="NFX")


def _tiny_model(tok, vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    eos = int(tok.eos_token_id)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         bos_token_id=eos, eos_token_id=eos, pad_token_id=eos, tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("family,backend", CASES, ids=IDS)
def test_generate_with_a_tiny_model_as_wide_as_the_vocabulary(family, backend, names):
    from trie_decode.integrations.transformers import TrieLogitsProcessor

    tok = load(family, backend)
    trie = TokenTrie.from_strings(names, tok, context=TEXT_PROMPT, normalize=_normalize(family))
    model = _tiny_model(tok, tokenizer_vocab_size(tok))
    ids = torch.tensor([encode_texts(tok, [TEXT_PROMPT])[0]])
    proc = TrieLogitsProcessor(trie, tok)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), logits_processor=[proc],
                         max_new_tokens=trie.max_depth + 1, do_sample=False, pad_token_id=tok.eos_token_id)
    entry = proc.match(out)[0]
    assert entry is not None and entry.name in names
    generated = out[0, ids.shape[1]:].tolist()
    assert generated[: len(entry.tokens)] == list(entry.tokens) and generated[len(entry.tokens)] == tok.eos_token_id


# ---------------------------------------------------------------------------------------------------------------
# Width: a tokenizer wider than the model's logits


def test_llama_tokenizer_is_wider_than_its_model(names):
    tok = load("llama3.2", "hf")
    trie = TokenTrie.from_strings(names, tok, leading_space=True)
    assert trie.vocab_size == tokenizer_vocab_size(tok) == 128257  # the text model has 128,256 logits
    assert int(trie.token[1:].max()) < 128000


def test_logits_narrower_than_the_vocabulary_are_accepted_when_every_trie_token_fits(names):
    tok = load("llama3.2", "hf")
    trie = TokenTrie.from_strings(names, tok, leading_space=True)
    width = int(trie.token[1:].max()) + 1
    assert width < trie.vocab_size
    constraint = TrieConstraint(trie, SpanRules(end_token_id=0), "cpu")
    state = constraint.start(2)
    masked = constraint.mask_(torch.zeros(2, width), state)
    allowed = masked[0].isfinite().nonzero().flatten().tolist()
    assert allowed == trie.children(trie.root)[0].tolist()
    # Llama 3.2's own width (128,256 logits), end token <|eot_id|>: a whole entry, step by step.
    constraint = TrieConstraint(trie, SpanRules(end_token_id=128009), "cpu")
    state = constraint.start(1)
    for t in trie.entry(0).tokens:
        row = constraint.mask_(torch.zeros(1, 128256), state)[0]
        assert row[t].isfinite()
        state = constraint.advance(state, torch.tensor([t]))
    row = constraint.mask_(torch.zeros(1, 128256), state)[0]
    assert row.isfinite().nonzero().flatten().tolist() == [128009]


def test_generate_with_the_llama_text_model_width(names):
    from trie_decode.integrations.transformers import TrieLogitsProcessor

    tok = load("llama3.2", "hf")
    trie = TokenTrie.from_strings(names, tok, context=TEXT_PROMPT)
    model = _tiny_model(tok, 128256)  # Llama 3.2 text model: one logit fewer than the tokenizer has ids
    ids = torch.tensor([encode_texts(tok, [TEXT_PROMPT])[0]])
    proc = TrieLogitsProcessor(trie, tok)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), logits_processor=[proc],
                         max_new_tokens=trie.max_depth + 1, do_sample=False, pad_token_id=tok.eos_token_id)
    assert proc.match(out)[0].name in names


# ---------------------------------------------------------------------------------------------------------------
# Several forms per entry


def test_forms_share_the_name_and_key_and_rank_reports_each_entry_once(tiny_llama, tokenizer):
    from trie_decode.integrations.transformers import rank

    countries = ["France", "Spain", "Italy", "Japan"]
    trie = TokenTrie.from_strings(countries, tokenizer, leading_space=[True, False], keys=["FR", "ES", "IT", "JP"])
    assert trie.num_entries == 8 and trie.options["leading_space"] == [True, False] and trie.options["forms"] == 2
    for name, key in zip(countries, ["FR", "ES", "IT", "JP"]):
        for text in (name, " " + name):
            entry = trie.lookup(tokenizer(text, add_special_tokens=False)["input_ids"])
            assert (entry.name, entry.key) == (name, key)
    inputs = tokenizer(["The answer is"], return_tensors="pt")
    ranked = rank(tiny_llama, inputs, trie, 8, tokenizer=tokenizer)[0]
    keys = [r.entry.key for r in ranked]
    assert len(keys) == len(set(keys)) and set(keys) <= {"FR", "ES", "IT", "JP"}
    assert [r.log_prob for r in ranked] == sorted((r.log_prob for r in ranked), reverse=True)


def test_bad_form_arguments_are_named_errors(tokenizer):
    with pytest.raises(InvalidEntryError, match="leading_space"):
        TokenTrie.from_strings(["a"], tokenizer, leading_space="yes")
    with pytest.raises(InvalidEntryError, match="context"):
        TokenTrie.from_strings(["a"], tokenizer, context=[1, 2])
    with pytest.raises(InvalidEntryError, match="empty list"):
        TokenTrie.from_strings(["a"], tokenizer, context=[])
    with pytest.raises(InvalidEntryError, match="keys has 1 items"):
        TokenTrie.from_strings(["a", "b"], tokenizer, keys=["x"])
    with pytest.raises(InvalidEntryError, match="sample"):
        check_prompt(TokenTrie.from_strings(["a"], tokenizer), tokenizer, "x", sample=0)
    with pytest.raises(InvalidEntryError, match="one prompt at a time"):
        check_prompt(TokenTrie.from_strings(["a"], tokenizer), tokenizer, [[1], [2]])
    no_names = TokenTrie.from_sequences([[5]], len(tokenizer))
    assert [f.code for f in check_prompt(no_names, tokenizer, "x")] == ["no_names"]


@pytest.mark.parametrize("prompt, error, message", [
    (None, InvalidEntryError, "prompt must be text or a list of token ids, got NoneType"),  # was: not iterable
    (b"Answer: ", InvalidEntryError, "got bytes"),  # was: read as the ids [65, 110, ...]
    ([504, -1], InvalidTokenError, r"prompt id -1 is outside the tokenizer's vocabulary \[0, 49152\)"),
    ([2**40], InvalidTokenError, r"prompt id 1099511627776 is outside"),  # was: OverflowError inside decode
])
def test_a_bad_prompt_is_named(tokenizer, prompt, error, message):
    trie = TokenTrie.from_strings(["France"], tokenizer, leading_space=True)
    with pytest.raises(error, match=message):
        check_prompt(trie, tokenizer, prompt)
    if prompt is not None and not isinstance(prompt, list):
        with pytest.raises(error, match=message):
            heal_prompt(prompt, tokenizer)


@pytest.mark.parametrize("family,backend", CASES, ids=IDS)
def test_raw_form_of_an_entry_that_merges_with_its_context_spells_the_entry(family, backend):
    """``on_unstable="raw"`` keeps the entry's own tokens where it merges with its context: the ids of the entry
    itself, never with SentencePiece's dummy-prefix space in front (after '"', "'Are'are" was "▁'Are'are": the
    model would write '" \\'Are\\'are'; after "Answer: ", "Paris" was "▁Paris", two spaces)."""
    tok = load(family, backend)
    table = token_bytes(tok)
    for context, strings in (('"', ["'Are'are", "-hello", ".NET"]), ("Answer: ", ["Paris", "  two"])):
        trie = TokenTrie.from_strings(strings, tok, context=context, on_unstable="raw")
        for i, text in enumerate(strings):
            assert b"".join(table[t] for t in trie.entry(i).tokens) == text.encode(), (family, context, text)


SPECIAL_TEXTS = ["<s>", "</s>", "<unk>", "[INST]", "<|endoftext|>", "<|im_end|>", "x <|im_start|>", "<start_of_turn>",
                 "<|begin_of_text|>"]


@pytest.mark.parametrize("family,backend", CASES, ids=IDS)
def test_an_entry_that_spells_a_special_token_is_text_not_markup(family, backend):
    """A special token's text inside an entry (``"<s>"``, the HTML tag, or ``"</s>"``) is text the model writes with
    ordinary tokens: the trie never holds a special id (a fast tokenizer read ``"</s>"`` as the end token, id 2, where
    ``MistralCommonBackend`` of the same files reads text, and the two loaders' tries load with each other)."""
    from trie_decode.tokenizers import markup_ids

    tok = load(family, backend)
    table, markup = token_bytes(tok), markup_ids(tok)
    # Each family's own special tokens too ("▁" in one is a space to a SentencePiece tokenizer: left out there).
    texts = list(dict.fromkeys(SPECIAL_TEXTS + [t for t in (tok.bos_token, tok.eos_token) if isinstance(t, str) and (
        "\u2581" not in t or byte_scheme(tok) == "bytelevel")]))
    for form in (dict(leading_space=True), dict(leading_space=False), dict(context="The tag is"),
                 dict(context="[/INST]"), dict(context='"', on_unstable="raw")):
        trie = TokenTrie.from_strings(texts, tok, **form)
        for i, text in enumerate(texts):
            tokens = trie.entry(i).tokens
            assert not markup.intersection(tokens), (family, form, text, tokens)
            assert b"".join(table[t] for t in tokens).decode().strip() == text, (family, form, text, tokens)
        if backend == "hf" and family.startswith("mistral"):
            assert trie.sequences() == TokenTrie.from_strings(texts, load(family, "mistral-common"),
                                                              **form).sequences(), (family, form)
