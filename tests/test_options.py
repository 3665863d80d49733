"""One home per option check (trie_decode.options): each rule is checked once directly, then through every front
door that has the option, where the message must name the option as that caller wrote it (``on_complete`` for a
keyword, ``extra_args['on_complete']`` in a vLLM request, ``--normalize`` on the command line) and the error must be
that front door's class. The options' other tests (what a valid value does) live with their features."""

from __future__ import annotations

import pytest

from trie_decode import InvalidEntryError, TokenTrie
from trie_decode.constraint import SpanRules, TrieConstraint
from trie_decode.errors import ConstraintConfigError
from trie_decode.integrations.fast_forward import fast_forward_generate
from trie_decode.integrations.transformers import TrieLogitsProcessor
from trie_decode.integrations.vllm_requests import TrieRequestError, TrieResolver, parse_trie_request, trie_args
from trie_decode.fields import Span
from trie_decode.options import (
    KEYWORD_ARGS,
    KEYWORDS,
    NORMAL_FORMS,
    ON_COMPLETE_MODES,
    OptionNames,
    as_tries,
    check_alone,
    check_distinct,
    check_filter_mode,
    check_normalize,
    check_on_complete,
    check_one_source,
    check_separator,
    row_specs,
    text_or_ids,
    tokens_arg,
)

TRIE = TokenTrie.from_sequences([[3, 4], [5]], vocab_size=10, keys=["a", "b"])
VLLM = OptionNames("extra_args[{!r}]", TrieRequestError)


def _refused(error, pattern, call):
    with pytest.raises(error, match=pattern) as info:
        call()
    return info.value


@pytest.mark.parametrize("names, error, prefix", [(KEYWORDS, ConstraintConfigError, "on_complete"),
                                                  (VLLM, TrieRequestError, r"extra_args\['on_complete'\]")])
def test_each_rule_names_the_option_as_its_caller_spells_it(names, error, prefix):
    assert check_on_complete("repeat", names) == "repeat" and ON_COMPLETE_MODES == ("eos", "release", "repeat")
    _refused(error, rf"^{prefix} must be one of \('eos', 'release', 'repeat'\), got 'stop'$",
             lambda: check_on_complete("stop", names))
    _refused(error, rf'^{prefix}="repeat" needs a separator', lambda: check_separator("repeat", False, names))
    _refused(error, rf'is only used with {prefix}="repeat", not \'eos\'$', lambda: check_separator("eos", True, names))
    assert check_normalize(None, names) is None and check_normalize("NFC", names) == "NFC"
    _refused(error, r"normalize.* must be one of \('NFC', 'NFKC', 'NFD', 'NFKD'\)", lambda: check_normalize("nfc", names))
    _refused(error, rf"^filters \(.*allow.*\) need on_complete=\"eos\" or \"repeat\", not {prefix}='release'",
             lambda: check_filter_mode("release", ["allow"], names))
    check_filter_mode("release", [], names)
    _refused(error, rf'distinct.*=True needs {prefix}="repeat"', lambda: check_distinct("eos", True, 8, names))
    _refused(error, r"max_entries.* must be a positive integer, got 0", lambda: check_distinct("repeat", True, 0, names))
    assert check_distinct("eos", False, None, names) == 0 and check_distinct("repeat", True, None, names) == 64
    assert check_distinct("repeat", True, 3, names) == 3
    # max_entries is a distinct list's room: given without one it would do nothing (max_entries=1 did nothing)
    _refused(error, r"max_entries.*=1 is the room of a distinct list and does nothing without one: set "
                    r".*distinct.*=True", lambda: check_distinct("repeat", False, 1, names))
    _refused(error, r"max_entries.*=0 is the room", lambda: check_distinct("eos", False, 0, names))
    _refused(error, r"distinct.* must be True or False, got 'no'", lambda: check_distinct("repeat", "no", None, names))


def test_token_arguments_are_text_or_ids():
    assert text_or_ids(None, "trigger") is None and text_or_ids("A:", "trigger") == "A:"
    assert text_or_ids(7, "trigger") == (7,) and tokens_arg([1, 2], None, "separator") == (1, 2)
    assert tokens_arg(None, None, "separator") == ()
    for bad, pattern in (("", "is the empty string"), ([], "must be text or a non-empty list of token ids"),
                         ([1.5], "must hold integer token ids"), ([-1], "holds a negative token id -1"),
                         (object(), "must be a token id or a sequence")):
        _refused(ConstraintConfigError, rf"^separator {pattern}", lambda: text_or_ids(bad, "separator"))
        _refused(TrieRequestError, rf"^extra_args\['separator'\] {pattern}", lambda: text_or_ids(bad, "separator", VLLM))
    _refused(ConstraintConfigError, "^trigger given as text needs a tokenizer", lambda: tokens_arg("A:", None, "trigger"))


def test_sources_and_per_row_specs():
    assert check_one_source("f", {"trie": TRIE, "template": None}) == "trie"
    _refused(ConstraintConfigError, r"^give either trie= or template=, not both$",
             lambda: check_one_source("f", {"trie": TRIE, "template": 1}))
    _refused(ConstraintConfigError, r"^give only one of a=, b= or c=$", lambda: check_one_source("f", dict(a=1, b=2, c=3)))
    _refused(ConstraintConfigError, r"^template= does not combine with \['trigger'\]: the template is the whole output",
             lambda: check_alone("template", ["trigger"], KEYWORD_ARGS))
    check_alone("spans", [])
    spec = ["a"]
    assert row_specs(None, 2, "allow") == [None, None] and row_specs(spec, 2, "allow") == [spec, spec]
    assert row_specs([spec, None], 2, "deny") == [spec, None]
    _refused(ConstraintConfigError, r"^deny has 1 row specs for 2 rows$", lambda: row_specs([spec], 2, "deny"))
    assert as_tries(TRIE, TokenTrie) == [TRIE]
    _refused(TypeError, r"^trie\[1\] is str, not a TokenTrie$", lambda: as_tries([TRIE, "x"], TokenTrie, key="trie"))
    _refused(ConstraintConfigError, r"^tries is empty", lambda: as_tries([], TokenTrie))


# ------------------------------------------------------------------------------------- through the front doors
def _processor(**kwargs):
    return lambda: TrieLogitsProcessor(TRIE, end_token_id=0, **kwargs)


def _request(**extra):
    return lambda: parse_trie_request({"trie": ["a", "b"], **extra})


@pytest.mark.parametrize("error, pattern, call", [
    # modes
    (ConstraintConfigError, r"^on_complete must be one of", lambda: SpanRules(end_token_id=0, on_complete="stop")),
    (ConstraintConfigError, r"^on_complete must be one of", _processor(on_complete="stop")),
    (TrieRequestError, r"^extra_args\['on_complete'\] must be one of", _request(on_complete="stop")),
    (ConstraintConfigError, r'^on_complete="repeat" needs a separator: set separator ', _processor(on_complete="repeat")),
    (TrieRequestError, r"""^extra_args\['on_complete'\]="repeat" needs a separator: set extra_args\['separator'\] """,
     _request(on_complete="repeat")),
    (TrieRequestError, r"^extra_args\['separator'\] is only used with", _request(separator=", ")),
    # token arguments
    (ConstraintConfigError, r"^trigger must hold integer token ids", _processor(trigger=[1.5])),
    (TrieRequestError, r"^extra_args\['trigger'\] must hold integer token ids", _request(trigger=[1.5])),
    (ConstraintConfigError, r"^end_token_id must be a non-negative token id", lambda: TrieLogitsProcessor(TRIE, end_token_id=-1)),
    (ConstraintConfigError, r"^the separator \[9, 0\] holds the end token 0, which ends the list: a list would end "
                            r"inside its separator", _processor(on_complete="repeat", separator=[9, 0])),
    # filter modes
    (ConstraintConfigError, r'^distinct=True needs on_complete="repeat"', _processor(distinct=True)),
    (ConstraintConfigError, r"^max_entries must be a positive integer",
     _processor(on_complete="repeat", separator=[9], distinct=True, max_entries=0)),
    (ConstraintConfigError, r"^max_entries=1 is the room of a distinct list and does nothing without one: set "
                            r"distinct=True, or leave max_entries out$",
     _processor(on_complete="repeat", separator=[9], max_entries=1)),
    (ConstraintConfigError, r"^max_entries=0 is the room of a distinct list", _processor(max_entries=0)),
    (ConstraintConfigError, r"^distinct must be True or False, got 'no'$",
     _processor(on_complete="repeat", separator=[9], distinct="no")),
    (ConstraintConfigError, r"^max_entries=3 is the room of a distinct list",
     lambda: TrieConstraint(TRIE, SpanRules(end_token_id=0, on_complete="repeat", separator=(9,)), "cpu").filters(
         1, max_entries=3)),
    (TrieRequestError, r"^filters \(extra_args\['deny'\]\) need on_complete=\"eos\" or \"repeat\", "
                       r"not extra_args\['on_complete'\]='release'", _request(on_complete="release", deny=["a"])),
    # sources
    (ConstraintConfigError, r"^TrieLogitsProcessor needs tries= \(a TokenTrie, or one per prompt\), spans= or template=$",
     lambda: TrieLogitsProcessor()),
    (ConstraintConfigError, r"^fast_forward_generate needs trie= \(a TokenTrie, or one per prompt\) or template=$",
     lambda: fast_forward_generate(None, None)),
    (ConstraintConfigError, r"^give either tries= or spans=, not both$",
     lambda: TrieLogitsProcessor(TRIE, spans=[Span(["Paris"], after='"city": "')])),
    (TrieRequestError, r"^extra_args\['spans'\] does not combine with \['trie'\]",
     lambda: parse_trie_request({"trie": ["a"], "spans": [{"after": "x", "values": ["a"]}]})),
    (TrieRequestError, r"^trie_args\(spans=\.\.\.\) does not combine with \['trigger'\]",
     lambda: trie_args(spans=[{"after": "x", "values": ["a"]}], trigger="y")),
    # per-row expansion
    (ConstraintConfigError, r"^allow has 1 row specs for 2 rows$",
     lambda: TrieConstraint(TRIE, SpanRules(end_token_id=0), "cpu").filters(2, allow=[["a"]])),
    (ConstraintConfigError, r"^allow and deny give different numbers of per-prompt filters: \[1, 2\]$",
     _processor(allow=[["a"]], deny=[["a"], ["b"]])),
    (TypeError, r"^tries\[0\] is str, not a TokenTrie$", lambda: TrieLogitsProcessor(["x"], end_token_id=0)),
], ids=["SpanRules-mode", "processor-mode", "vllm-mode", "processor-repeat", "vllm-repeat", "vllm-separator",
        "processor-trigger", "vllm-trigger", "processor-end", "processor-end-in-separator", "processor-distinct", "processor-max_entries",
        "processor-max_entries-alone", "processor-max_entries-0-alone", "processor-distinct-no",
        "constraint-max_entries-alone",
        "vllm-filters", "processor-source", "fast_forward-source", "processor-two-sources", "vllm-spans",
        "trie_args-spans", "constraint-rows", "processor-prompts", "processor-tries"])
def test_front_doors_report_each_rule_with_their_own_option_names(error, pattern, call):
    _refused(error, pattern, call)


def test_normalize_forms_through_every_front_door(tokenizer, smollm2_dir, tmp_path, capsys):
    from trie_decode.cli import main

    _refused(InvalidEntryError, r"^normalize must be one of", lambda: TokenTrie.from_strings(["x"], tokenizer, normalize="NFX"))
    _refused(TrieRequestError, r"^extra_args\['normalize'\] must be one of", _request(normalize="NFX"))
    src = tmp_path / "names.txt"
    src.write_text("France\n", encoding="utf-8")
    with pytest.raises(SystemExit) as exc:
        main(["build", str(src), "--tokenizer", smollm2_dir, "-o", str(tmp_path / "o"), "--normalize", "NFX"])
    assert exc.value.code == 2 and f"--normalize: invalid choice: 'NFX' (choose from {', '.join(map(repr, NORMAL_FORMS))})" \
        in capsys.readouterr().err


def test_vllm_text_options_are_tokenized_with_the_request_names(tokenizer):
    """Text is checked when the request is parsed and tokenized when it is resolved, with the engine's tokenizer."""
    req = parse_trie_request({"trie": ["a"], "on_complete": "repeat", "separator": ", "})
    assert req.separator == ", "
    rules = TrieResolver(tokenizer).rules(req)
    assert rules.separator == tuple(tokenizer(", ", add_special_tokens=False)["input_ids"])


def test_no_end_token_names_only_what_every_caller_takes():
    """The processor takes no model: the refusal named "a tokenizer (or a model)" to a call that cannot pass one."""
    with pytest.raises(ConstraintConfigError) as info:
        TrieLogitsProcessor(TokenTrie.from_sequences([[5]], vocab_size=10))
    assert str(info.value) == "no end token: pass end_token_id=, or a tokenizer that has an eos_token_id"
