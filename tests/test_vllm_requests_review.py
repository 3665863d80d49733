"""What a hostile client or an odd server setting sends to the vLLM front-end's request checks: every bad value is a
named ``TrieRequestError`` (an HTTP 400) or a configuration error, never an exception from deep inside, never an
engine core stopped by a value the front-end admitted. No engine: the parser, the resolver and the policy directly."""

from __future__ import annotations

import io
import os
import types

import numpy as np
import pytest
import torch

from trie_decode import TokenTrie
from trie_decode.integrations import vllm_access
from trie_decode.integrations.vllm_access import ENV_ALLOWED_DIRS, TrieAccessError, current_limits, current_policy
from trie_decode.integrations.vllm_requests import TrieRequestError, TrieResolver, parse_trie_request

COLORS = ["red", "green", "blue"]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for name in vllm_access._ALL_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(vllm_access.ENV_HANDOFF_DIR, "off")


@pytest.fixture(scope="module")
def resolver(tokenizer):
    return TrieResolver(tokenizer)


def admit(resolver, extra):
    return resolver.admit(parse_trie_request(extra))


@pytest.mark.parametrize("extra", [
    {"trie": [[5, 6, 7]], "stop_at_forced": 2**63},
    {"template": "x{a}", "slots": {"a": ["b"]}, "stop_at_forced": 2**64 - 1},
])
def test_a_stop_at_forced_the_engine_cannot_hold_is_refused_at_admission(resolver, extra):
    # msgpack carries ints up to 2**64 - 1 to the engine core, whose step layout is int64: admitted, such a value
    # raised OverflowError in the processor's apply and stopped the engine core for every request.
    with pytest.raises(TrieRequestError, match=r"extra_args\['stop_at_forced'\] must be a non-negative integer"):
        admit(resolver, extra)
    admit(resolver, {"trie": [[5, 6, 7]], "stop_at_forced": 2**31 - 1})


def test_the_engine_steps_with_the_largest_admitted_stop_at_forced(resolver):
    from trie_decode.integrations.vllm import _SlotTable

    extra = {"trie": [[5, 6, 7]], "stop_at_forced": 2**31 - 1}
    admit(resolver, extra)
    table = _SlotTable(resolver, "cpu")
    table.rows[0] = table.new_row(types.SimpleNamespace(extra_args=extra), [1, 2], [])
    logits = table.mask_(torch.zeros(1, resolver.vocab_size), [0], [0])  # no OverflowError in the step layout
    assert torch.isfinite(logits[0]).sum() == 1


@pytest.mark.parametrize("extra, where", [
    ({"trie": ["red", "\ud800"]}, r"extra_args\['trie'\]: entry 1 '\\ud800' holds the lone surrogate"),
    ({"trie": COLORS, "context": "The answer\ud800"}, r"extra_args\['context'\] .* holds the lone surrogate"),
    ({"trie": COLORS, "trigger": "\udc00:"}, r"extra_args\['trigger'\] .* holds the lone surrogate"),
    ({"trie": COLORS, "on_complete": "repeat", "separator": ",\ud800"},
     r"extra_args\['separator'\] .* holds the lone surrogate"),
])
def test_a_lone_surrogate_from_a_json_escape_is_named(resolver, extra, where):
    # JSON's "\ud800" decodes to a lone surrogate: it hashed (UnicodeEncodeError) or reached the tokenizer (TypeError).
    with pytest.raises(TrieRequestError, match=where):
        admit(resolver, extra)


def test_a_context_is_bounded_like_the_other_texts(resolver):
    # Every entry is tokenized after every context: 7 contexts of 69 KB before 2,000 entries took 90 s of the
    # front-end's event loop, outside the inline caps.
    with pytest.raises(TrieRequestError, match=r"extra_args\['context'\] holds 257 bytes of text, over the limit of 256"):
        parse_trie_request({"trie": COLORS, "context": ["Answer:", "x" * 257]})
    admit(resolver, {"trie": COLORS, "context": "y " * 127 + "is"})


@pytest.fixture()
def allowed(tmp_path, tokenizer, monkeypatch):
    folder = tmp_path / "allowed"
    folder.mkdir()
    TokenTrie.from_strings(COLORS, tokenizer).save(folder / "colors.trie")
    monkeypatch.setenv(ENV_ALLOWED_DIRS, str(folder))
    return folder


def _npy_header(shape) -> bytes:
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, {"descr": "<i8", "fortran_order": False, "shape": shape})
    return out.getvalue() + b"\0" * 16


@pytest.mark.parametrize("name, write", [
    ("archive.npy", lambda p: np.savez(open(p, "wb"), a=np.arange(2))),  # np.load reads a zip whatever its name
    ("huge.npy", lambda p: p.write_bytes(_npy_header((2**50,)))),  # a header whose shape the data does not hold
    ("huger.npy", lambda p: p.write_bytes(_npy_header((2**70,)))),
])
def test_a_filter_file_that_is_no_npy_array_is_a_named_refusal(resolver, allowed, name, write):
    write(allowed / name)
    with pytest.raises(TrieRequestError, match=r"extra_args\['deny'\]: .* is not a filter file"):
        admit(resolver, {"trie": str(allowed / "colors.trie"), "deny": {"file": str(allowed / name)}})


def test_a_missing_file_and_a_fifo_are_told_apart_whatever_their_names(allowed):
    # The category came from the error's text, which holds the path: a missing file under a folder named
    # "directory..." was "cannot be opened", a FIFO named "not found" was "no trie file".
    (allowed / "directory").mkdir()
    os.mkfifo(allowed / "not found.trie")
    policy = current_policy()
    for missing in ("directory/gone.trie", "a directory.trie", "no_such_folder/x.trie"):
        with pytest.raises(TrieAccessError, match="no trie file .* in the allowed directories"):
            policy.open(policy.resolve(str(allowed / missing)))
    with pytest.raises(TrieAccessError, match=r"cannot be opened as a trie file \(not a regular readable file\)"):
        policy.open(policy.resolve(str(allowed / "not found.trie")))


@pytest.mark.parametrize("name", ["TRIE_DECODE_VLLM_BUILD_BUDGET", "TRIE_DECODE_VLLM_BUILD_WINDOW"])
def test_a_nan_setting_is_a_configuration_error(monkeypatch, name):
    # NaN passed "at least 0": a NaN budget refused every uncached list as "busy", a NaN window never expired.
    monkeypatch.setenv(name, "nan")
    with pytest.raises(ValueError, match=f"{name}='nan' must be at least"):
        current_limits()


def test_a_boolean_sent_over_http_is_taken_as_vllm_parses_it():
    # vLLM's vllm_xargs values are ``str | int | float | list``: JSON ``true`` arrives as 1, which forced_tail_only
    # refused ("must be a boolean, got 1") while leading_space took it.
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    sent = CompletionRequest(model="m", prompt="p", vllm_xargs={
        "trie": '[[5, 6, 7]]', "stop_at_forced": 2, "forced_tail_only": True}).vllm_xargs
    assert sent["forced_tail_only"] == 1 and not isinstance(sent["forced_tail_only"], bool)
    assert parse_trie_request(sent).forced_tail_only is True
    with pytest.raises(TrieRequestError, match=r"extra_args\['forced_tail_only'\] must be a boolean, got 2"):
        parse_trie_request({**sent, "forced_tail_only": 2})


@pytest.mark.parametrize("extra, option", [
    ({"spans": [{"after": '"c": "', "values": ["Paris", "Rome"]}]}, "spans"),
    ({"template": "x{c}", "slots": {"c": ["Paris", "Rome"]}}, "slots"),
    ({"trie": ["Paris", "Rome"]}, "trie"),
])
def test_a_spent_build_budget_names_the_option_the_request_sent(monkeypatch, tokenizer, extra, option):
    # A spans or template request over the budget got a TrieAccessError (admit documents TrieRequestError) naming
    # extra_args['trie'], which it does not have.
    monkeypatch.setenv("TRIE_DECODE_VLLM_BUILD_BUDGET", "0")
    with pytest.raises(TrieRequestError, match=rf"^extra_args\['{option}'\]: the server is busy building tries"):
        admit(TrieResolver(tokenizer), extra)


@pytest.mark.parametrize("spec", [{"trie": ["Paris", "Rome"]}, None, 5])
def test_the_fast_forward_driver_refuses_a_spec_that_is_no_trie(spec):
    # list() of trie_args(["Paris", "Rome"]) is ["trie"]: the requests were constrained to the text "trie".
    from trie_decode.integrations.vllm_fastforward import generate

    with pytest.raises(ValueError, match=r"tries\[1\] is a .*: pass a trie file path or an inline list"):
        generate(None, ["a", "b"], tries=[["Paris"], spec])


def test_a_filter_file_s_lines_never_reach_the_client(resolver, allowed):
    # Any UTF-8 file inside an allowed directory may be named as a filter: its lines that were no entries were
    # quoted ("3 keys are not entries of the trie, e.g. ['db_password=hunter2', ...]"), its numbers too.
    (allowed / "notes.txt").write_text("db_password=hunter2\napi_key=sk-123\n")
    np.save(allowed / "n.npy", np.array([123456789]))
    for name in ("notes.txt", "n.npy"):
        with pytest.raises(TrieRequestError, match="are not entries of the trie") as info:
            admit(resolver, {"trie": COLORS, "deny": {"file": str(allowed / name)}})
        assert "hunter2" not in str(info.value) and "123456789" not in str(info.value)
    with pytest.raises(TrieRequestError, match=r"e\.g\. \['purple'\]"):  # what the client sent itself is named
        admit(resolver, {"trie": COLORS, "deny": ["purple"]})


@pytest.mark.parametrize("value", ["false", ["no", False], 2])
def test_trie_args_checks_leading_space_instead_of_taking_its_truth(value):
    # bool("false") is True: trie_args(..., leading_space="false") asked for " " + s, silently.
    from trie_decode.integrations.vllm_requests import trie_args

    with pytest.raises(TrieRequestError, match=r"leading_space'\] must be a boolean or a list of them"):
        trie_args(COLORS, leading_space=value)
    assert trie_args(COLORS, leading_space=np.True_)["leading_space"] is True


def test_a_template_s_text_is_within_the_inline_limit(resolver, monkeypatch):
    # The text was unbounded: 400 KB of it took 2.2 s to build on the front-end's event loop (and again in the engine).
    monkeypatch.setenv("TRIE_DECODE_VLLM_MAX_INLINE_BYTES", "1000")
    with pytest.raises(TrieRequestError, match=r"extra_args\['template'\] holds 1003 bytes of text, over the limit of 1000"):
        parse_trie_request({"template": "w" * 1000 + "{c}", "slots": {"c": COLORS}})
    admit(resolver, {"template": "w" * 997 + "{c}", "slots": {"c": COLORS}})


def test_a_request_with_more_spans_than_the_limit_is_refused_before_building():
    """Spans (and a template's slots) are built on the front-end's event loop and again in the engine: 1,000 slots
    of two values took 17.6 s within every other limit. More than MAX_SPANS is refused when parsed."""
    from trie_decode.integrations.vllm_requests import MAX_SPANS

    n = MAX_SPANS + 1
    with pytest.raises(TrieRequestError, match=f"{n} slots, over the limit of {MAX_SPANS}"):
        parse_trie_request({"template": "".join(f"{{s{i}}}," for i in range(n)),
                            "slots": {f"s{i}": ["x", "y"] for i in range(n)}})
    with pytest.raises(TrieRequestError, match=f"{n} spans, over the limit of {MAX_SPANS}"):
        parse_trie_request({"spans": [{"values": ["x"], "after": f"<{i}>"} for i in range(n)]})
    assert len(parse_trie_request({"spans": [{"values": ["x"], "after": f"<{i}>"} for i in range(MAX_SPANS)]}).spans) \
        == MAX_SPANS


def test_both_drivers_read_tries_by_one_rule():
    """beam_search and the fast-forward driver take ``tries=`` through prompt_trie_values: a trie_args() dict, as the
    whole argument or as one prompt's spec, was read as the list of its keys (the entry "trie") by beam_search."""
    from pathlib import Path

    from trie_decode.integrations.vllm_requests import prompt_trie_values, trie_args

    assert prompt_trie_values(Path("/data/a.trie"), 2) == ["/data/a.trie", "/data/a.trie"]
    assert prompt_trie_values([["Paris"], [(5, 6), np.array([7])]], 2) == [["Paris"], [[5, 6], [7]]]
    with pytest.raises(ValueError, match="tries is a dict"):
        prompt_trie_values(trie_args(["Paris", "Rome"]), 1)
    with pytest.raises(ValueError, match=r"tries\[0\] is a dict"):
        prompt_trie_values([trie_args(["Paris", "Rome"])], 1)
    with pytest.raises(ValueError, match="tries has 1 items for 2 prompts"):
        prompt_trie_values([["Paris"]], 2)


def test_without_the_engine_tokenizer_a_span_file_refusal_names_the_span(monkeypatch, tmp_path):
    """validate_trie_params on a vLLM it was not verified against checks a request's files alone; a span's or slot's
    file outside the policy is named by its own option there too, as the resolver names it."""
    from vllm import SamplingParams

    from trie_decode.integrations import vllm as vllm_processor
    from trie_decode.integrations import vllm_internals

    monkeypatch.setattr(vllm_internals, "frontend_model_config", lambda: None)
    outside = str(tmp_path / "elsewhere" / "cities.trie")
    cases = [({"spans": [{"values": ["a"], "after": "x"}, {"trie": outside, "after": "y"}]},
              r"extra_args\['spans'\]\[1\]\['trie'\]"),
             ({"template": "{city}.", "slots": {"city": outside}}, r"extra_args\['slots'\]\['city'\]"),
             ({"trie": outside}, r"extra_args\['trie'\]")]
    for extra, option in cases:
        with pytest.raises(TrieRequestError, match=option):
            vllm_processor.validate_trie_params(SamplingParams(extra_args=extra))
