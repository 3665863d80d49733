"""The V1 processor's batch bookkeeping, driven with vLLM's own BatchUpdate (no engine): requests are added,
removed, moved one way and swapped, output lists grow between steps (sometimes by several tokens, as after a
preemption), and every constrained row's allowed set must match the trie at the row's own position."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

import vllm  # noqa: E402,F401  (make venv installs it: a missing vLLM fails the suite)

from reference import allowed_after
from trie_decode.constraint import SpanRules
from trie_decode.integrations.vllm_requests import TrieRequestError, parse_trie_request

pytestmark = [pytest.mark.vllm, pytest.mark.model]

COLORS = ["red", "green", "blue", "yellow", "purple", "orange", "black", "white"]


def _proc(smollm2_dir, tokenizer):
    import torch

    from trie_decode.integrations.vllm import TrieLogitsProcessor

    model_config = SimpleNamespace(tokenizer=smollm2_dir, tokenizer_revision=None, trust_remote_code=False,
                                   get_vocab_size=lambda: len(tokenizer))
    cfg = SimpleNamespace(model_config=model_config, scheduler_config=SimpleNamespace(max_num_seqs=4))
    return TrieLogitsProcessor(cfg, torch.device("cpu"), False)


def _allowed(proc, batch, vocab):
    import torch

    logits = torch.zeros(batch, vocab)
    out = proc.apply(logits)
    return [set(torch.isfinite(out[i]).nonzero().flatten().tolist()) for i in range(batch)]


def _expect(trie, generated, eos):
    return allowed_after(trie.sequences(), SpanRules(end_token_id=eos), generated)


def test_v1_batch_updates_follow_requests(smollm2_dir, tokenizer, tmp_path):
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality

    from trie_decode import TokenTrie

    eos = tokenizer.eos_token_id
    v = len(tokenizer)
    proc = _proc(smollm2_dir, tokenizer)
    assert proc.is_argmax_invariant() is False
    colors = TokenTrie.from_strings(COLORS, tokenizer)
    words = ["Bosnia and Herzegovina", "Botswana", "Brazil"]
    places = TokenTrie.from_strings(words, tokenizer)
    a_out, b_out, c_out = [], [], []
    sp_a = SamplingParams(extra_args={"trie": COLORS})
    sp_b = SamplingParams(extra_args={"trie": words})
    proc.update_state(BatchUpdate(batch_size=3, removed=[], moved=[],
                                  added=[(0, sp_a, [1, 2], a_out), (1, SamplingParams(), [1], c_out), (2, sp_b, [3], b_out)]))
    allowed = _allowed(proc, 3, v)
    assert allowed[0] == _expect(colors, [], eos) and allowed[1] == set(range(v)) and allowed[2] == _expect(places, [], eos)

    # Each request appends a token (several for b: as if it had been preempted and resumed).
    a_out.append(tokenizer("blue", add_special_tokens=False)["input_ids"][0])
    b_out.extend(tokenizer("Bosnia", add_special_tokens=False)["input_ids"])
    c_out.append(5)
    proc.update_state(None)
    allowed = _allowed(proc, 3, v)
    assert allowed[0] == _expect(colors, a_out, eos) and allowed[2] == _expect(places, b_out, eos)

    # Swap a (0) and b (2), then remove the unconstrained request and move b from 0 to 1.
    proc.update_state(BatchUpdate(batch_size=3, removed=[], added=[], moved=[(0, 2, MoveDirectionality.SWAP)]))
    allowed = _allowed(proc, 3, v)
    assert allowed[2] == _expect(colors, a_out, eos) and allowed[0] == _expect(places, b_out, eos)
    proc.update_state(BatchUpdate(batch_size=2, removed=[1], added=[], moved=[(0, 1, MoveDirectionality.UNIDIRECTIONAL)]))
    allowed = _allowed(proc, 3, v)
    assert allowed[1] == _expect(places, b_out, eos) and allowed[0] == set(range(v))

    # A request that reaches the engine without validation (its file vanished) only gets the end token.
    missing = SamplingParams(extra_args={"trie": str(tmp_path / "gone.trie")})
    proc.update_state(BatchUpdate(batch_size=3, removed=[], moved=[], added=[(0, missing, [1], [])]))
    allowed = _allowed(proc, 3, v)
    assert allowed[0] == {eos} and allowed[1] == _expect(places, b_out, eos)


def test_v1_stop_at_forced_and_prefix(smollm2_dir, tokenizer):
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    from trie_decode import TokenTrie

    eos = tokenizer.eos_token_id
    words = ["Bosnia and Herzegovina", "Botswana"]
    trie = TokenTrie.from_strings(words, tokenizer)
    seq = tokenizer(words[0], add_special_tokens=False)["input_ids"]
    proc = _proc(smollm2_dir, tokenizer)
    # After the first token of "Bosnia ..." (if the split leaves a forced run), stop_at_forced=1 allows only EOS.
    node = trie.walk(seq[:2])
    run = trie.forced_run(node)
    sp = SamplingParams(extra_args={"trie": words, "prefix": seq[:2], "stop_at_forced": 1})
    proc.update_state(BatchUpdate(batch_size=1, removed=[], moved=[], added=[(0, sp, [1], [])]))
    allowed = _allowed(proc, 1, len(tokenizer))[0]
    assert allowed == ({eos} if run else _expect(trie, seq[:2], eos))


def test_v1_allow_and_deny_filters_per_request(smollm2_dir, tokenizer):
    """Two requests over one shared trie with different filters: each row allows only its usable entries."""
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    from trie_decode import TokenTrie
    from trie_decode.integrations.vllm_requests import parse_trie_request

    eos = tokenizer.eos_token_id
    proc = _proc(smollm2_dir, tokenizer)
    trie = TokenTrie.from_strings(COLORS, tokenizer)
    allow = ["red", "blue", "black"]
    sp_allow = SamplingParams(extra_args={"trie": COLORS, "allow": allow, "deny": ["black"]})
    sp_deny = SamplingParams(extra_args={"trie": COLORS, "deny": json.dumps(COLORS[1:])})  # JSON text, as over HTTP
    outs = [[], []]
    proc.update_state(BatchUpdate(batch_size=2, removed=[], moved=[],
                                  added=[(0, sp_allow, [1], outs[0]), (1, sp_deny, [1], outs[1])]))
    allowed = _allowed(proc, 2, len(tokenizer))
    rules = SpanRules(end_token_id=eos)
    first = lambda names: {tokenizer(n, add_special_tokens=False)["input_ids"][0] for n in names}  # noqa: E731
    assert allowed[0] == first(["red", "blue"]) and allowed[1] == first(["red"])
    assert allowed[0] == allowed_after([trie.entry(i).tokens for i in range(len(COLORS))
                                        if trie.entry(i).name in ("red", "blue")], rules, [])
    resolver = proc._table.resolver
    for bad, message in (({"allow": ["nope"]}, "not entries of the trie"), ({"allow": ["red"], "deny": ["red"]}, "leaves no entry"),
                         ({"deny": [99]}, "outside the trie"), ({"allow": [1.5]}, "must hold entry keys"),
                         ({"deny": "[1,"}, "invalid JSON"), ({"allow": ["red"], "on_complete": "release"}, "need on_complete")):
        with pytest.raises(ValueError, match=message):
            req = parse_trie_request({"trie": COLORS, **bad})
            resolver.filters(req, resolver.resolve(req)[0])


def test_v1_engine_refusal_of_an_admitted_request_is_logged_and_counted(smollm2_dir, tokenizer, tmp_path, monkeypatch,
                                                                       caplog):
    """The front-end admits a file under its TRIE_DECODE_ALLOWED_DIRS; the engine process lacks the setting. The
    request only gets the end token (vLLM has no way for a processor to fail it), and the operator gets an ERROR that
    names the mismatch and the fix, once, while every refusal is counted."""
    import logging

    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    from trie_decode import TokenTrie
    from trie_decode.integrations.vllm import TrieLogitsProcessor
    from trie_decode.integrations.vllm_access import ENV_ALLOWED_DIRS, STAMP_KEY

    proc = _proc(smollm2_dir, tokenizer)

    class InputProcessor:  # where validate_params finds the engine's model config, as in vLLM's front-end
        model_config = SimpleNamespace(tokenizer=smollm2_dir, tokenizer_revision=None, trust_remote_code=False,
                                       get_vocab_size=lambda: len(tokenizer))

        def validate(self, sp):
            TrieLogitsProcessor.validate_params(sp)

    allowed = tmp_path / "allowed"
    allowed.mkdir()
    TokenTrie.from_strings(COLORS, tokenizer).save(allowed / "colors.trie")
    monkeypatch.setenv(ENV_ALLOWED_DIRS, str(allowed))
    client_args = {"trie": str(allowed / "colors.trie"), STAMP_KEY: "sent by the client"}
    sp = SamplingParams(extra_args=client_args)
    InputProcessor().validate(sp)
    assert json.loads(sp.extra_args[STAMP_KEY])["file"][0] == str((allowed / "colors.trie").resolve())
    assert client_args[STAMP_KEY] == "sent by the client"  # the caller's dict is not modified

    resolver = proc._table.resolver
    before = resolver.engine_refusals["settings_mismatch"]
    monkeypatch.delenv(ENV_ALLOWED_DIRS)  # the engine's environment differs from the front-end's
    eos = tokenizer.eos_token_id
    with caplog.at_level(logging.ERROR, logger="trie_decode.vllm"):
        proc.update_state(BatchUpdate(batch_size=2, removed=[], moved=[], added=[(0, sp, [1], []), (1, sp, [1], [])]))
        allowed_now = _allowed(proc, 2, len(tokenizer))
    assert allowed_now == [{eos}, {eos}]
    assert resolver.engine_refusals["settings_mismatch"] == before + 2
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR and "settings_mismatch" in r.getMessage()]
    assert len(errors) == 1, errors  # once per distinct cause
    assert "TRIE_DECODE_ALLOWED_DIRS" in errors[0] and "before starting the server" in errors[0]

    # With the engine's setting back, the same stamped request is served from the trie.
    monkeypatch.setenv(ENV_ALLOWED_DIRS, str(allowed))
    proc.update_state(BatchUpdate(batch_size=1, removed=[1], moved=[], added=[(0, sp, [1], [])]))
    trie = TokenTrie.from_strings(COLORS, tokenizer)
    assert _allowed(proc, 1, len(tokenizer))[0] == _expect(trie, [], eos)


def test_a_trie_file_narrower_than_a_separator_is_a_400_and_never_takes_the_engine_down(smollm2_dir, tokenizer, tmp_path,
                                                                                        monkeypatch):
    """A valid trie file built with a small vocab_size (no fingerprint) and a request whose separator (or trigger)
    token lies past it: the constraint refuses such rules. Before, the front-end admitted it and the engine core
    raised while adding the request (EngineDeadError for every request). Now: a 400 naming the trie's vocab_size,
    and an engine that is handed it anyway ends that request alone."""
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    from trie_decode import TokenTrie
    from trie_decode.integrations.vllm_access import ENV_ALLOWED_DIRS

    monkeypatch.setenv(ENV_ALLOWED_DIRS, str(tmp_path))
    TokenTrie.from_sequences([[5, 6], [7]], vocab_size=10).save(tmp_path / "small.trie")
    proc = _proc(smollm2_dir, tokenizer)
    resolver = proc._table.resolver
    eos = tokenizer.eos_token_id
    bad = [{"trie": str(tmp_path / "small.trie"), "on_complete": "repeat", "separator": ","},
           {"trie": str(tmp_path / "small.trie"), "trigger": "Answer:"}]
    for extra in bad:
        with pytest.raises(TrieRequestError, match=r"^extra_args\['trie'\]: the trie was built with vocab_size=10, too "
                                                   r"narrow for the request's tokens \((separator|trigger) token \d+ is"):
            resolver.admit(parse_trie_request(extra))
    resolver.admit(parse_trie_request({"trie": str(tmp_path / "small.trie")}))  # the end token fits: served
    before = sum(resolver.engine_refusals.values())
    good = SamplingParams(extra_args={"trie": COLORS})
    proc.update_state(BatchUpdate(batch_size=3, removed=[], moved=[], added=[
        (0, SamplingParams(extra_args=bad[0]), [1], []), (1, good, [1], []), (2, SamplingParams(extra_args=bad[1]), [1], [])]))
    allowed = _allowed(proc, 3, len(tokenizer))
    assert allowed[0] == allowed[2] == {eos} and allowed[1] == _expect(TokenTrie.from_strings(COLORS, tokenizer), [], eos)
    assert sum(resolver.engine_refusals.values()) == before + 2


def test_v1_idle_constraints_are_bounded_in_bytes(smollm2_dir, tokenizer, monkeypatch):
    """Distinct tries come and go: the idle ones' constraints stay under TRIE_DECODE_VLLM_GROUP_CACHE_MB (and are
    freed), while a constraint a running request uses is kept however large."""
    import gc
    import weakref

    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    monkeypatch.setenv("TRIE_DECODE_VLLM_GROUP_CACHE_MB", "1")
    proc = _proc(smollm2_dir, tokenizer)
    table = proc._table
    eos = tokenizer.eos_token_id
    bound = 1 << 20

    def tokens(i):  # a distinct list of 1,500 two- and three-token entries per i
        return [[i + 1, 100 + j] if j % 2 else [i + 1, 100 + j, 7] for j in range(1500)]

    keep = SamplingParams(extra_args={"trie": tokens(0)})
    proc.update_state(BatchUpdate(batch_size=1, removed=[], moved=[], added=[(0, keep, [1], [])]))
    pinned = table.rows[0].group
    sizes, refs = [], []
    for i in range(1, 13):
        sp = SamplingParams(extra_args={"trie": tokens(i)})
        proc.update_state(BatchUpdate(batch_size=2, removed=[], moved=[], added=[(1, sp, [1], [])]))
        assert _allowed(proc, 2, len(tokenizer))[1] == {i + 1}
        group = table.groups[table.rows[1].group]
        sizes.append(group.nbytes)
        refs.append(weakref.ref(group.constraint.dtries[0]))
        del group
        proc.update_state(BatchUpdate(batch_size=1, removed=[1], moved=[], added=[]))
    assert min(sizes) > 100_000 and 12 * min(sizes) > bound  # the bound binds
    assert pinned in table.groups and 1 < len(table.groups) < 13
    idle = table.groups.nbytes - table.groups.items[pinned][1]
    assert idle <= bound, (idle, len(table.groups))
    gc.collect()
    assert sum(r() is None for r in refs) >= 12 - len(table.groups)  # dropped constraints are freed
    # The pinned request still masks by its own trie.
    assert _allowed(proc, 1, len(tokenizer))[0] == {1}


def test_v1_template_resumes_after_a_prefix_and_stops_at_its_fixed_text(smollm2_dir, tokenizer):
    """A template request resubmitted by the fast-forward driver (the output so far appended to the prompt and sent
    as ``prefix``) starts where the core's replay of those tokens stands, and ``stop_at_forced`` ends it (EOS only)
    where the fixed text between slots begins; with ``forced_tail_only`` it stops only before the output's end."""
    import torch
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    from trie_decode.constraint import TrieConstraint
    from trie_decode.integrations.vllm_requests import TrieResolver, parse_trie_request, trie_args

    eos = tokenizer.eos_token_id
    extra = trie_args(template='{"city": "{city}", "country": "{country}"}',
                      slots={"city": ["Paris", "Rome"], "country": ["France", "Italy"]})
    core = TrieConstraint(*TrieResolver(tokenizer).spans(parse_trie_request(extra)), "cpu")
    out = tokenizer('{"city": "Paris", "country": "France"}', add_special_tokens=False)["input_ids"] + [eos]
    states = [core.start(1)]
    for t in out:
        allowed = core.allowed_tokens(states[-1])[0]
        assert t in allowed and (len(allowed) == 1 or int(states[-1].node[0]) >= 0)  # fixed text: one token
        states.append(core.advance(states[-1], torch.tensor([t])))
    closed = out.index(tokenizer('",', add_special_tokens=False)["input_ids"][0]) + 1  # after the city's closing token
    last = len(out) - 2  # before the country's closing token '"}' (or '"', which the template's text follows)
    for cut, options, want in [
        (closed, {}, {out[closed]}),
        (closed, {"stop_at_forced": 2}, {eos}),  # the fixed text ' "country": "' is forced
        (closed, {"stop_at_forced": 2, "forced_tail_only": True}, {out[closed]}),  # it does not end the output
        (closed - 3, {"stop_at_forced": 2}, set(core.allowed_tokens(states[closed - 3])[0])),  # inside the value
        (last, {"stop_at_forced": 2}, set(core.allowed_tokens(states[last])[0])),  # the value's end tokens
    ]:
        proc = _proc(smollm2_dir, tokenizer)
        sp = SamplingParams(extra_args={**extra, "prefix": out[:cut], **options})
        proc.update_state(BatchUpdate(batch_size=1, removed=[], moved=[], added=[(0, sp, [1, 2] + out[:cut], [])]))
        assert _allowed(proc, 1, len(tokenizer))[0] == want, (cut, options)


def test_v1_refuses_speculative_decoding_by_name(smollm2_dir, tokenizer):
    """vLLM's V1 rejection sampler runs custom logits processors on the bonus token's logits only, never on the
    draft tokens' (vllm/v1/sample/rejection_sampler.py, ``apply_logits_processors``): a draft token the trie refuses
    is accepted as it is. Before, the V1 processor was built under speculative decoding and the output silently
    left the trie; now it refuses the engine with a ValueError that says so, as the V2 processor does."""
    import torch

    from trie_decode.integrations.vllm import TrieLogitsProcessor, TrieLogitsProcessorV1
    from trie_decode.integrations.vllm_beam import TrieBeamLogitsProcessor

    model_config = SimpleNamespace(tokenizer=smollm2_dir, tokenizer_revision=None, trust_remote_code=False,
                                   get_vocab_size=lambda: len(tokenizer))
    spec = SimpleNamespace(method="ngram", num_speculative_tokens=3)
    cfg = SimpleNamespace(model_config=model_config, speculative_config=spec)
    for cls in (TrieLogitsProcessor, TrieLogitsProcessorV1, TrieBeamLogitsProcessor):
        with pytest.raises(ValueError, match=r"do not support speculative decoding \(the V1 runner would accept "
                                             r"draft tokens the trie refuses\)"):
            cls(cfg, torch.device("cpu"), False)
    cls(SimpleNamespace(model_config=model_config, speculative_config=None), torch.device("cpu"), False)  # no spec: built


def test_v1_an_output_list_cut_back_and_decoded_again_is_replayed(smollm2_dir, tokenizer):
    """vLLM 0.32's V1 runner truncates a request's live output list in place when output tokens are discarded
    (``del req_state.output_token_ids[num_output_tokens:]`` in ``_update_states``, after a KV-load failure), masks
    the step that decodes them again with the shorter list, and that step may pick other tokens. Before, the
    processor kept the state of the discarded tokens (it only counted how many it had folded in): after "dark red"
    was cut back to "dark", the row still allowed only " wine" (the continuation of "dark red wine"), never " blue".
    Now the row is replayed from its history and masks as the reference does after the tokens the list holds."""
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    from trie_decode import TokenTrie

    eos = tokenizer.eos_token_id
    names = ["dark red wine", "dark blue", "red"]
    trie = TokenTrie.from_strings(names, tokenizer)
    ids = {n: tokenizer(n, add_special_tokens=False)["input_ids"] for n in names}
    assert ids["dark red wine"][0] == ids["dark blue"][0] and ids["dark red wine"][1] != ids["dark blue"][1]
    proc = _proc(smollm2_dir, tokenizer)
    out, other = [], []
    proc.update_state(BatchUpdate(batch_size=2, removed=[], moved=[], added=[
        (0, SamplingParams(extra_args={"trie": names}), [1], out), (1, SamplingParams(extra_args={"trie": COLORS}), [1], other)]))
    colors = TokenTrie.from_strings(COLORS, tokenizer)
    for tok in ids["dark red wine"][:2]:
        assert _allowed(proc, 2, len(tokenizer))[0] == _expect(trie, out, eos)
        out.append(tok)
        other.append(sorted(_expect(colors, other, eos))[0])
        proc.update_state(None)
    assert _allowed(proc, 2, len(tokenizer))[0] == _expect(trie, out, eos) == {ids["dark red wine"][2]}
    del out[1:]  # the runner discards the second token (the step that computes it again is masked first) ...
    proc.update_state(None)
    assert _allowed(proc, 2, len(tokenizer))[0] == _expect(trie, out, eos) == {ids["dark red wine"][1], ids["dark blue"][1]}
    out.append(ids["dark blue"][1])  # ... and that step picks another
    proc.update_state(None)
    allowed = _allowed(proc, 2, len(tokenizer))
    assert allowed[0] == _expect(trie, out, eos) == _expect(trie, ids["dark blue"], eos)
    assert allowed[1] == _expect(colors, other, eos)  # the other row is not replayed


def test_staging_never_overwrites_a_host_buffer_a_queued_copy_still_reads(monkeypatch):
    """On CUDA the processors copy each step's small blocks (each trie's history block, then the mask layout) from
    pinned host buffers without blocking, and such a copy runs only when the stream reaches it (behind the forward
    pass). Before, two buffers alternated, so a step with two tries in the batch wrote its third block into the
    buffer the first block's copy had not read yet: the first trie's rows advanced over the mask layout's numbers.
    Played here with a stand-in CUDA whose copies read their host buffer only when the test runs the stream: every
    copy must deliver the block that was put, and the buffers are reused once their copies are done."""
    import numpy as np
    import torch

    from trie_decode.integrations.vllm import _Staging

    queued = []  # (host view, what the copy delivers) in stream order

    class Delivered:
        value = None

    class Event:  # torch.cuda.Event: done once the stream has run past its record()
        def __init__(self):
            self.done = False

        def record(self):
            queued.append((None, self))

        def query(self):
            return self.done

    to = torch.Tensor.to

    def lagging_to(self, *args, **kwargs):
        device = args[0] if args else kwargs.get("device")
        if isinstance(device, torch.device) and device.type == "cuda":
            got = Delivered()
            queued.append((self, got))
            return got
        return to(self, *args, **kwargs)

    def run_stream():
        for host, item in queued:
            if host is None:
                item.done = True
            else:
                item.value = host.clone().numpy()
        queued.clear()

    empty = torch.empty
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))  # no pinned allocator here
    monkeypatch.setattr(torch.Tensor, "to", lagging_to)
    staging = _Staging(torch.device("cuda"))
    for step in range(2):
        blocks = [np.arange(8, dtype=np.int64).reshape(2, 4) + 100 * k + 1000 * step for k in range(3)]
        copies = [staging.put(b) for b in blocks]  # two tries' history blocks, then the layout
        run_stream()
        for k, (copy, block) in enumerate(zip(copies, blocks)):
            assert np.array_equal(copy.value, block), (step, k)
    assert len(staging._pool) <= 3  # the second step reused the first step's buffers


def test_fast_forward_takes_a_trie_file_as_a_path_object(smollm2_dir, tokenizer, tmp_path, monkeypatch):
    """``vllm_fastforward.generate(tries=[...])`` takes "a trie file path" per prompt, as ``beam_search`` does.
    Before, a ``pathlib.Path`` went through ``list(spec)`` (the inline-list branch) and failed with "'PosixPath'
    object is not iterable"; now it is sent as the path's text. A one-entry trie is forced from its root to its
    end token, so the driver answers without an engine round."""
    from pathlib import Path

    from trie_decode import TokenTrie
    from trie_decode.integrations.vllm_access import ENV_ALLOWED_DIRS
    from trie_decode.integrations.vllm_fastforward import generate

    monkeypatch.setenv(ENV_ALLOWED_DIRS, str(tmp_path))
    path = Path(tmp_path) / "one.trie"
    TokenTrie.from_strings(["Paris"], tokenizer).save(path)
    model_config = SimpleNamespace(tokenizer=smollm2_dir, tokenizer_revision=None, trust_remote_code=False,
                                   get_vocab_size=lambda: len(tokenizer))

    class NoEngine:  # every token is forced: the driver must not call generate
        llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(model_config=model_config,
                                                                 cache_config=SimpleNamespace(block_size=128)))

        def get_tokenizer(self):
            return tokenizer

        def generate(self, *args, **kwargs):
            raise AssertionError("no engine round expected")

    (got,) = generate(NoEngine(), ["The capital of France is"], [path])
    assert got.token_ids == tokenizer("Paris", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert got.text == "Paris" and got.rounds == 0


def test_v1_trigger_request_without_prompt_ids_is_logged(smollm2_dir, tokenizer, caplog):
    """V1 gives a request made of prompt embeddings no prompt token ids: a span its prompt's end opens cannot be
    seen (a trigger's or a span's), which the processor says once in the log instead of running unconstrained in
    silence."""
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import BatchUpdate

    proc = _proc(smollm2_dir, tokenizer)
    spans = SamplingParams(extra_args={"trie": COLORS, "trigger": "Color:"})
    with caplog.at_level("WARNING", logger="trie_decode.vllm"):
        proc.update_state(BatchUpdate(batch_size=2, removed=[], moved=[],
                                      added=[(0, spans, None, []), (1, spans, None, [])]))
    said = [r for r in caplog.records if "without prompt token ids" in r.getMessage()]
    assert len(said) == 1
    caplog.clear()
    with caplog.at_level("WARNING", logger="trie_decode.vllm"):
        proc.update_state(BatchUpdate(batch_size=3, removed=[], moved=[], added=[(2, spans, [1, 2], [])]))
    assert not caplog.records
