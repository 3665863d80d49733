"""Inline string tries in vLLM requests take the same tokenization options as ``TokenTrie.from_strings`` (forms,
a context, Unicode normalization), checked at admission with named errors. No engine: the resolver directly."""

from __future__ import annotations

import pytest

import vllm  # noqa: F401  (make venv installs it: a missing vLLM fails the suite)

from trie_decode import TokenTrie
from trie_decode.integrations.vllm_requests import TrieRequestError, TrieResolver, parse_trie_request, trie_args

NAMES = ["France", "Japan", "Côte d'Ivoire"]


@pytest.fixture(scope="module")
def resolver(tokenizer):
    return TrieResolver(tokenizer)


@pytest.mark.parametrize("options, kwargs", [
    (dict(context="The answer is"), dict(context="The answer is")),
    (dict(context=["The answer is", "Answer:\n"]), dict(context=["The answer is", "Answer:\n"])),
    (dict(leading_space=[True, False]), dict(leading_space=[True, False])),
    (dict(leading_space=True, normalize="NFD"), dict(leading_space=True, normalize="NFD")),
    (dict(context='"country": "', on_unstable="raw"), dict(context='"country": "', on_unstable="raw")),
])
def test_inline_strings_are_the_python_builders_trie(resolver, tokenizer, options, kwargs):
    req = parse_trie_request(trie_args(NAMES, **options))
    trie, _ = resolver.resolve(req)
    ref = TokenTrie.from_strings(NAMES, tokenizer, **kwargs)
    assert trie.sequences() == ref.sequences() and trie.options == ref.options
    assert req.trie_key() != parse_trie_request(trie_args(NAMES)).trie_key()  # forms are part of the cache key


@pytest.mark.parametrize("extra, message", [
    ({"trie": [[1, 2]], "context": "x"}, "apply only to an inline list of strings"),
    ({"trie": NAMES, "context": ""}, "must be a non-empty string"),
    ({"trie": NAMES, "context": []}, "must be a non-empty string"),
    ({"trie": NAMES, "leading_space": []}, "empty list"),
    ({"trie": NAMES, "leading_space": [True, "no"]}, "must be a boolean"),
    ({"trie": NAMES, "normalize": "NFX"}, r"extra_args\['normalize'\] must be one of"),
    ({"trie": NAMES, "on_unstable": "keep"}, r"extra_args\['on_unstable'\] must be one of"),
    ({"trie": NAMES, "on_unstable": "raw"}, r"extra_args\['on_unstable'\]='raw' only applies with a context"),
    ({"trie": NAMES, "context": [f"c{i}" for i in range(9)]}, "over the limit of 8"),
])
def test_bad_tokenization_options_are_named(extra, message):
    with pytest.raises(TrieRequestError, match=message):
        parse_trie_request(extra)


def test_a_context_that_merges_with_the_entries_is_refused_with_the_fix(resolver):
    req = parse_trie_request({"trie": NAMES, "context": "The answer is "})
    with pytest.raises(TrieRequestError, match=r"extra_args\['trie'\]: context 'The answer is ' .*rstrip.*"
                                               r"extra_args\['context'\]='The answer is' or extra_args\['leading_space"):
        resolver.admit(req)
    # A context whose last token merges with an entry: the fix is the request's on_unstable, which builds it.
    req = parse_trie_request({"trie": ["-hello"], "context": '"country": "'})
    with pytest.raises(TrieRequestError, match=r"build with extra_args\['on_unstable'\]='raw'"):
        resolver.admit(req)
    resolver.admit(parse_trie_request({"trie": ["-hello"], "context": '"country": "', "on_unstable": "raw"}))


# ---------------------------------------------------------------------------------------------- requests that would run unconstrained
@pytest.mark.parametrize("extra, match", [
    ({"tries": NAMES, "leading_space": True}, r"extra_args\['tries'\] \(did you mean 'trie'\?\)"),
    ({"Trie": NAMES}, r"did you mean 'trie'"),
    ({"span": [{"after": "x=", "values": ["a"]}]}, r"did you mean 'spans'"),
    ({"templates": "A: {x}.", "slots": {"x": ["a"]}}, r"did you mean 'template'"),
    ({"leading_space": True, "deny": ["Italy"]}, r"has \['leading_space'\] but none of 'trie'"),
    ({"on_complete": "repeat", "separator": ","}, r"has \['on_complete'\] but none of 'trie'"),
])
def test_trie_options_without_a_trie_are_refused(extra, match):
    """A misspelt ``trie`` (or options with no trie) used to leave the request unconstrained, with no error."""
    with pytest.raises(TrieRequestError, match=match):
        parse_trie_request(extra)


@pytest.mark.parametrize("extra, match", [
    ({"trie": NAMES, "denylist": ["Japan"]}, r"extra_args\['denylist'\] \(did you mean 'deny'\?\)"),
    ({"trie": NAMES, "allow_list": ["Japan"]}, r"did you mean 'allow'"),
    ({"trie": NAMES, "distinct": True}, r"extra_args\['distinct'\] is not a vLLM request option: distinct lists"),
    ({"trie": NAMES, "max_entries": 3}, r"extra_args\['max_entries'\] is not a vLLM request option"),
    ({"trie": NAMES, "end_token_id": 5}, r"the end token is the model's EOS"),
])
def test_misspelt_or_python_only_options_of_a_trie_request_are_refused(extra, match):
    """They were left to other processors: the filter or list the client asked for was silently not applied."""
    with pytest.raises(TrieRequestError, match=match):
        parse_trie_request(extra)


@pytest.mark.parametrize("extra, match", [
    ({"trie": NAMES, "trigger": [5] * 257, "on_complete": "release"}, r"\['trigger'\] holds 257 token ids, over the limit of 256"),
    ({"trie": NAMES, "trigger": "x" * 257}, r"\['trigger'\] holds 257 bytes of text, over the limit of 256"),
    ({"trie": NAMES, "on_complete": "repeat", "separator": [11] * 5000}, r"\['separator'\] holds 5000 token ids"),
])
def test_a_trigger_or_separator_is_bounded(resolver, extra, match):
    """The engine reads a row's last len(trigger) tokens at every step: a trigger of 50,000 ids cost 24 ms per step
    (every request of the batch waits), for as long as the request ran. Refused at admission; 256 pass."""
    with pytest.raises(TrieRequestError, match=match):
        parse_trie_request(extra)
    resolver.admit(parse_trie_request({"trie": NAMES, "trigger": [5] * 256, "on_complete": "release"}))


def test_a_separator_holding_the_eos_is_a_400(resolver, tokenizer):
    """The list ends at the model's EOS: a separator holding it would end the list inside the separator."""
    eos = tokenizer.eos_token_id
    with pytest.raises(TrieRequestError, match=rf"^extra_args: the separator \[11, {eos}\] holds the end token {eos}"):
        resolver.admit(parse_trie_request({"trie": NAMES, "on_complete": "repeat", "separator": [11, eos]}))


def test_other_processors_keys_pass():
    assert parse_trie_request({"denylist": ["x"], "my_plugin": 1}) is None  # no trie option of ours, not ours
    # Names another processor may take as well: without trie, spans or template the request is not ours.
    assert parse_trie_request({"allow": [1, 2], "deny": [3], "prefix": [4], "distinct": True, "keys": ["a"]}) is None
    assert parse_trie_request({"trie": NAMES, "my_plugin": 1, "raw_logprobs": True}) is not None
    # Words one letter off 'trie' or 'deny', or near 'spans', are other processors' keys, not misspellings: they
    # were refused ("did you mean 'trie'?"), in requests that ask for no trie too.
    others = {"tier": "gold", "time": 3, "true": 1, "tree": [1], "trip": 2, "stripe": 1, "plans": 2, "spawn": 1}
    assert parse_trie_request(others) is None
    assert parse_trie_request({"trie": NAMES, "tier": "gold", "time": 3, "true": 1, "tree": [1], "dent": 1}) is not None


def test_the_front_end_refuses_what_would_run_unconstrained_or_fail_in_the_grammar():
    """vLLM's validator of custom processors' params (HTTP 400): options without a trie; a trie or template beside
    structured outputs, which vLLM's grammar ended with an error (500) once no token was allowed by both; a beam
    request's raw log-probs beyond one step (its sampled token is not constrained)."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.v1.worker.gpu.sample.logits_processor import build_custom_logits_processors_params_validator

    validate = build_custom_logits_processors_params_validator(["trie_decode.integrations.vllm:TrieLogitsProcessor"])
    beam = build_custom_logits_processors_params_validator(["trie_decode.integrations.vllm_beam:TrieBeamLogitsProcessor"])
    json_schema = StructuredOutputsParams(json={"type": "object"})
    validate(SamplingParams(max_tokens=4, extra_args={"my_plugin": 1}))
    validate(SamplingParams(max_tokens=4, structured_outputs=json_schema,
                            extra_args={"spans": [{"after": '"city": "', "values": ["Paris"]}]}))
    beam(SamplingParams(max_tokens=1, extra_args={"trie": NAMES, "raw_logprobs": True}))
    for check, params, match in [
        (validate, SamplingParams(max_tokens=4, extra_args={"tries": NAMES}), "did you mean 'trie'"),
        (validate, SamplingParams(max_tokens=4, extra_args={"trie": NAMES}, structured_outputs=json_schema),
         r"extra_args\['trie'\] decides the whole output, and so do structured outputs"),
        (validate, SamplingParams(max_tokens=4, extra_args={"template": "A: {x}.", "slots": {"x": ["a"]}},
                                  structured_outputs=json_schema), r"extra_args\['template'\] decides the whole"),
        (beam, SamplingParams(max_tokens=8, extra_args={"trie": NAMES, "raw_logprobs": True}),
         r"needs max_tokens=1 \(got 8\)"),
    ]:
        with pytest.raises(VLLMValidationError, match=match):
            check(params)


def test_an_entry_holding_the_end_token_is_refused_at_admission(resolver, tokenizer):
    """The engine's constraint refuses it (generation would stop inside the entry): the front end answers 400."""
    eos = tokenizer.eos_token_id
    for mode in ("eos", "release"):  # vLLM stops at EOS in every mode
        with pytest.raises(TrieRequestError, match=rf"extra_args\['trie'\]: entry 0.*contains token {eos}, at which"):
            resolver.admit(parse_trie_request({"trie": [[7158, eos, 7158]], "on_complete": mode}))


# ---------------------------------------------------------------------------------------------- filters: the one spec rule
def test_a_filter_may_mix_keys_and_indices_as_the_transformers_processor_takes_it(resolver, tokenizer):
    """allow=["Japan", 0] worked with TrieLogitsProcessor and was refused by a vLLM request ("must hold only entry
    keys (strings) or only entry indices"): both read a spec by one rule (filters.spec_items), so the request's
    filter is the processor's entries."""
    from trie_decode.filters import entry_indices

    for extra in ({"allow": ["Japan", 0]}, {"deny": [2, "Japan"]}, {"allow": '["Japan", 0]'}):
        req = parse_trie_request({"trie": NAMES, **extra})
        trie, _ = resolver.resolve(req)
        allow, deny = resolver.filters(req, trie)
        name = "allow" if "allow" in extra else "deny"
        got = (allow if name == "allow" else deny).tolist()
        spec = extra[name] if not isinstance(extra[name], str) else ["Japan", 0]
        assert sorted(got) == sorted(entry_indices(TokenTrie.from_strings(NAMES, tokenizer), spec, name).tolist())
    assert parse_trie_request(trie_args(NAMES, allow=["Japan", 0])).allow == ("Japan", 0)
    for bad, pattern in (([True], r"must hold entry keys \(str\) or entry indices \(int\), got True"),
                         (["Japan", 1.5], "got 1.5"), ([None], "got None")):
        with pytest.raises(TrieRequestError, match=r"extra_args\['allow'\] .*" + pattern):
            parse_trie_request({"trie": NAMES, "allow": bad})
        with pytest.raises(TrieRequestError, match=r"trie_args\(allow=\.\.\.\) .*" + pattern):
            trie_args(NAMES, allow=bad)


def test_a_numpy_filter_is_one_spec_and_a_2d_one_is_refused():
    """A request is one prompt: a 1-D numpy array is its filter (as plain JSON values); a 2-D array (one row per
    prompt, which trie_args flattened into one filter: [[0], [2]] became [0, 2]) is refused by name."""
    import numpy as np

    assert trie_args(NAMES, allow=np.array([0, 2]))["allow"] == [0, 2]
    assert trie_args(NAMES, deny=np.array(["Japan"]))["deny"] == ["Japan"]
    assert type(trie_args(NAMES, allow=np.array([1]))["allow"][0]) is int
    assert parse_trie_request({"trie": NAMES, "allow": np.array([0, 2])}).allow == (0, 2)
    for spec in (np.array([[0], [2]]), np.array([["France"], ["Japan"]])):
        with pytest.raises(TrieRequestError, match=r"^trie_args\(allow=\.\.\.\) must be one list \(or 1-D array\) of "
                                                   r"entry keys or entry indices, got an array of shape \(2, 1\)"):
            trie_args(NAMES, allow=spec)
        with pytest.raises(TrieRequestError, match=r"^extra_args\['deny'\] must be one list \(or 1-D array\)"):
            parse_trie_request({"trie": NAMES, "deny": spec})


def test_the_inline_limit_counts_the_values_of_every_span():
    values = ["x" * 1000 + str(i) for i in range(40)]  # about 40 kB per span
    one = {"spans": [{"after": "a0", "values": values}]}
    assert parse_trie_request(one, max_entries=10_000, max_bytes=64 * 1024) is not None
    two = {"spans": [{"after": f"a{i}", "values": values} for i in range(2)]}
    with pytest.raises(TrieRequestError, match=r"holds 80140 bytes of inline values, over the limit of 65536"):
        parse_trie_request(two, max_entries=10_000, max_bytes=64 * 1024)


@pytest.mark.parametrize("allow", [{"file": "/tmp/x"}, '{"file": "/tmp/x"}', '{"x": 1}'])
def test_a_span_filter_file_is_refused_as_an_object_or_as_its_json(allow):
    with pytest.raises(TrieRequestError, match=r"\['allow'\] must be a list of entry keys or indices \(a span takes "
                                               r"no filter file\)"):
        parse_trie_request({"spans": [{"after": "a", "values": ["x"], "allow": allow}]})


def test_a_template_prefix_is_refused_unless_the_template_writes_it(resolver, tokenizer):
    template = {"template": '{"city": "{city}"}', "slots": {"city": ["Paris", "Rome"]}}
    ids = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    for prefix in ([99999], ids("Hello"), ids('{"city": "Lyon"}')):
        with pytest.raises(TrieRequestError, match=r"extra_args\['prefix'\] .* is not what the template writes"):
            resolver.admit(parse_trie_request({**template, "prefix": prefix}))
    for prefix in (ids('{"city": "'), ids('{"city": "Rome"}')):
        resolver.admit(parse_trie_request({**template, "prefix": prefix}))
