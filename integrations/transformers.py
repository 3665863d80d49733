"""transformers integration: ``TrieLogitsProcessor`` for ``model.generate``, plus ``match``, ``rank`` and a
``prefix_allowed_tokens_fn`` drop-in.

Why this exists: ``model.generate(logits_processor=[TrieLogitsProcessor(trie, tokenizer)])`` is how most people
will constrain a model to a set of names or ids. transformers' own ``PrefixConstrainedLogitsProcessor`` calls a
Python function per row per step and walks the trie from the root each time; this processor keeps each row's trie
node as a tensor on the logits' device and masks all rows with a handful of tensor ops (see
:mod:`trie_decode.kernels`).

Row state: inside ``generate``'s greedy and sampling loop rows never move, so each row's state simply advances by
its new token (O(1) per row, no lookup). Under beam search transformers reorders rows between steps without
telling the processor; each row's state is then keyed by its generated prefix, a 64-bit polynomial hash of (prompt
index, generated tokens) computed as one integer dot product over the batch, and each row finds its parent row of
the previous step by the hash of its prefix minus the last token (argsort + searchsorted: no host read). Which
loop calls the processor is read from the caller's frames (:class:`GenerateLoop`); an unknown caller gets the
beam-search treatment. Under assisted decoding a call's prefix may be shorter than the last one's (a rejected
draft): the processor keeps the states of the prefix it saw last and resumes from the longest one they share.

Masking writes into the scores in place when ``generate`` allows it (it does not keep them, i.e. not
``output_logits=True`` in greedy/sampling), and otherwise into a reused output buffer, never into a tensor someone
else can still see.
"""

from __future__ import annotations

import inspect
import numbers
import weakref
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np
import torch

from trie_decode.constraint import DONE, RowState, SpanRules, TrieConstraint, check_stop_tokens_outside_entries
from trie_decode.entries import Entry
from trie_decode.fields import SPAN_PROMPT_TAIL, FieldRules, Span
from trie_decode.templates import Template
from trie_decode.errors import ConstraintConfigError, InvalidTokenError
from trie_decode.filters import entry_indices, filtered_restrictions
from trie_decode.forms import entry_identity, warn_prompt
from trie_decode.kernels.rules import ALL_MASKED_FLOOR
from trie_decode.live import CatalogSnapshot, LiveCatalog, constraint_for
from trie_decode.options import (TrieArg, as_tries, check_alone, check_distinct, check_instance, check_no_distinct,
                                  check_not_taken, check_one_source, check_positive, check_prompts, end_token,
                                  filter_rows, first_eos, is_per_row, prompt_filters, prompt_groups, rule_args)
from trie_decode.trie import TokenTrie

from .transformers_internals import GenerateLoop, PrefixCall, beam_parents, prefix_processor_call, reusable_buffer

try:
    from transformers import LogitsProcessor, LogitsProcessorList, PrefixConstrainedLogitsProcessor
except ImportError as exc:  # pragma: no cover - import guard
    raise ImportError("trie_decode.integrations.transformers needs transformers: pip install 'trie-decode[transformers]'") from exc

__all__ = ["TrieLogitsProcessor", "prefix_allowed_tokens_fn", "match", "match_all", "rank", "RankedEntry", "RankedList"]


class _PrefixHasher:
    """64-bit polynomial hashes of token rows, with one random odd weight per position (wrapping int64)."""

    def __init__(self, seed: int = 0x7E1E) -> None:
        self._gen = torch.Generator().manual_seed(seed)
        self._weights = torch.empty(0, dtype=torch.long)
        self._group_weight = int(torch.randint(1, 2**62, (1,), generator=self._gen)) | 1

    def weights(self, n: int, device: torch.device) -> torch.Tensor:
        if self._weights.numel() < n:
            extra = torch.randint(-(2**62), 2**62, (max(n, 64) - self._weights.numel(),), generator=self._gen) | 1
            self._weights = torch.cat([self._weights, extra])
        if self._weights.device != device:
            self._weights = self._weights.to(device)
        return self._weights[:n]

    def hash(self, groups: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Shape: (B,), int64. groups: (B,) int64; tokens: (B, L)."""
        h = groups * self._group_weight
        if tokens.shape[1]:
            w = self.weights(tokens.shape[1], tokens.device)
            if tokens.device.type == "cpu":  # numpy: a tenth of torch's dispatch cost for this tiny product
                h = h + torch.from_numpy((tokens.numpy().astype(np.int64, copy=False) * w.numpy()).sum(axis=1))
            else:
                h = h + (tokens.long() * w).sum(dim=1)
        return h


class _OutputBuffers:
    """Output tensors for out-of-place masking, reused once nothing outside this object can see them.

    A fresh (B, V) tensor per step costs more than the masking itself (first-touch page faults: 27 of 32 ms at 256
    rows). A buffer is reused only when its only Python references are this object's and its storage has no other
    user (no view, no tuple of returned scores holds it); otherwise a new one is allocated.
    """

    def __init__(self, keep: int = 3) -> None:
        self._bufs: list[torch.Tensor] = []
        self._keep = keep

    def get(self, like: torch.Tensor) -> torch.Tensor:
        for buf in self._bufs:
            # References: the list and the loop variable.
            if (buf.shape == like.shape and buf.dtype == like.dtype and buf.device == like.device
                    and reusable_buffer(buf, references=2)):
                return buf
        buf = torch.empty(like.shape, dtype=like.dtype, device=like.device)
        self._bufs = (self._bufs + [buf])[-self._keep :]
        return buf


#: How a user of the processor (or of ``fast_forward_generate``) picks the stop tokens: named in the error of an entry
#: that holds it (:meth:`TrieLogitsProcessor.check_stop_ids`).
_END_TOKEN_OPTIONS = "end_token_id= and generate's eos_token_id="

#: How many (batch size, device) forms of a processor's static filters it keeps built (see ``_begin``).
_STATIC_FILTERS_KEPT = 4

#: What one generation of a processor holds (``_switch`` keeps it aside while another generation calls), and how
#: many generations it keeps aside at most.
_GENERATION = ("_state", "_hashes", "_groups", "_start", "_last_len", "_loop", "_parents_checked", "_filters",
               "_prompt", "_keys", "_trail", "_seen", "steps", "_view", "tries", "_max_depth")
_GENERATIONS_KEPT = 4


def _span_tries(tokenizer: Any, spans: Any, on_complete: str, separator: Any, trigger: Any, allow: Any, deny: Any,
                distinct: bool, check_prompt: bool, end_token_id: Optional[int] = None,
                max_entries: Optional[int] = None) -> tuple[list[TokenTrie], FieldRules]:
    """The tries and field rules of ``spans=`` or ``template=`` (:mod:`trie_decode.fields`,
    :mod:`trie_decode.templates`), or a named error for options that do not combine with them. A template built
    beforehand (``template.build(tok, eos)``) needs no tokenizer when ``end_token_id`` is given (fast-forward's hook,
    where ``generate`` keeps ``tokenizer=``)."""
    key = "template" if isinstance(spans, Template) else "spans"
    prebuilt = isinstance(spans, Template) and end_token_id is not None  # template.build(...) done beforehand
    if tokenizer is None and not prebuilt:
        raise ConstraintConfigError(f"{key}= needs the tokenizer (values and triggers are matched on text)")
    others = {"on_complete": on_complete != "eos", "separator": separator is not None, "trigger": trigger is not None,
              "allow": allow is not None, "deny": deny is not None, "distinct": bool(distinct),
              "max_entries": max_entries is not None, "check_prompt": bool(check_prompt)}
    check_alone(key, [k for k, v in others.items() if v])
    end = end_token(end_token_id, tokenizer)
    if isinstance(spans, Template):
        return spans.build(tokenizer, end) if tokenizer is not None else spans.prebuilt(end)
    return FieldRules.build(spans, tokenizer, end)


class TrieLogitsProcessor(LogitsProcessor):
    r"""Constrain generation to the entries of a token trie (one trie for all prompts, or one per prompt).

    Works with greedy search, sampling, beam search, ``num_return_sequences``, assisted decoding (prompt lookup, an
    assistant model: a call's prefix may be shorter than the last call's), and left-padded batches. Scores
    may be raw logits or log-probs, and may be wider than the trie's vocabulary (padded embeddings). The
    constrained span starts where generation starts (or after ``trigger``); a new ``generate`` call starts afresh
    even when the same instance is reused.

    Args:
        tries (`TokenTrie` or list of `TokenTrie`):
            One trie for every row, or one per prompt (rows of beams / return sequences map back to their prompt).
            Or a live catalog (:class:`~trie_decode.LiveCatalog`, or one :class:`~trie_decode.CatalogSnapshot`):
            each generation decodes the catalog's view when the generation starts, removals at once, additions
            once compacted (see :mod:`trie_decode.live`).
        tokenizer (optional):
            The model's tokenizer: checks every trie's vocabulary fingerprint, supplies the default end token
            (``eos_token_id``) and tokenizes ``trigger``/``separator`` given as text.
        spans (list of :class:`~trie_decode.Span`, *optional*): instead of ``tries``, catalog-valued fields inside
            free text (JSON): each value starts after its span's ``after`` text and ends with its ``end``; outside
            the values the logits are untouched (see docs/spans.md). Needs ``tokenizer``.
        template (:class:`~trie_decode.Template`, *optional*): instead of ``tries``, the whole output as fixed text
            with catalog-valued slots; the fixed text is forced (one token per step) and the template ends with the
            end token. Needs ``tokenizer``.
        end_token_id (`int`, *optional*):
            The token that ends an entry, and the fallback allowed token of any row with nothing else. Defaults to
            the tokenizer's EOS. No entry may hold one of ``generate``'s stop ids (``eos_token_id``; the end token when
            it is one) before its last token: the row would stop inside the entry, so ``generate`` raises
            :class:`~trie_decode.ConstraintConfigError` at its first step (see :meth:`check_stop_ids`).
        on_complete (`str`, defaults to ``"eos"``):
            ``"eos"``: the end token is forced after an entry; ``"release"``: generation continues unconstrained;
            ``"repeat"``: entries separated by ``separator`` until the end token.
        separator (`str` or token ids, *optional*): used by ``"repeat"``.
        trigger (`str` or token ids, *optional*): the constraint starts only after this token sequence.
        allow, deny (*optional*): entries (keys, or names in a trie without keys, or indices) each prompt may use /
            may not use, over one shared trie and with no rebuild: one list for every prompt, or a list of lists, one
            per prompt
            (``None`` items: no filter). See :mod:`trie_decode.filters`. With one trie per prompt, each prompt's
            filter gives it the trie of the entries it leaves (:func:`trie_decode.filters.filtered_tries`, built
            here, O(entries); a filter that leaves a prompt no entry is an error then); ``match`` and ``rank`` still
            report the entries of the tries given (their indices, keys and item keys). A 2-D numpy array is one row
            per prompt, as a list of lists.
        distinct (`bool`, defaults to False): with ``on_complete="repeat"``, an entry appears at most once in a
            row's list; entries that share a key (the forms of one string) count as one.
        max_entries (`int`, defaults to 64 with ``distinct``): with ``distinct`` (only), the most entries a row's
            list holds; a full list ends with the end token (:func:`trie_decode.filters.distinct_capacity` gives the
            most a token budget allows).
        check_prompt (`bool`, defaults to False): at the start of each generation, check every prompt against its
            trie (:func:`trie_decode.check_prompt`; needs ``tokenizer``, and no ``trigger``) and issue a
            :class:`~trie_decode.PromptMismatchWarning` with the exact fix for each disagreement: a prompt that ends
            with a space, or a trie whose ids are not what the model writes after this prompt. It costs one batched
            tokenization of up to 200 entries per distinct prompt.

    Examples:

    ```python
    >>> from transformers import AutoModelForCausalLM, AutoTokenizer
    >>> from trie_decode import TokenTrie
    >>> from trie_decode.integrations.smollm2 import smollm2_path
    >>> from trie_decode.integrations.transformers import TrieLogitsProcessor
    >>> tok = AutoTokenizer.from_pretrained(smollm2_path())
    >>> model = AutoModelForCausalLM.from_pretrained(smollm2_path())
    >>> trie = TokenTrie.from_strings(["Paris", "Berlin", "Madrid"], tok)
    >>> prompt = tok.apply_chat_template([{"role": "user", "content": "Capital of Spain?"}],
    ...                                  tokenize=False, add_generation_prompt=True)
    >>> inputs = tok(prompt, return_tensors="pt")
    >>> processor = TrieLogitsProcessor(trie, tok)
    >>> out = model.generate(**inputs, logits_processor=[processor], max_new_tokens=8, do_sample=False)
    >>> processor.match(out)[0].name
    'Madrid'
    ```
    """

    def __init__(
        self,
        tries: Optional[TrieArg] = None,
        tokenizer: Any = None,
        *,
        spans: Optional[Sequence[Span]] = None,
        template: Optional[Template] = None,
        end_token_id: Optional[int] = None,
        on_complete: str = "eos",
        separator: Any = None,
        trigger: Any = None,
        allow: Any = None,
        deny: Any = None,
        distinct: bool = False,
        max_entries: Optional[int] = None,
        check_prompt: bool = False,
    ) -> None:
        check_one_source("TrieLogitsProcessor", {"tries": tries, "spans": spans, "template": template},
                         hints={"tries": "a TokenTrie, or one per prompt"})
        if template is not None:
            spans = check_instance(template, Template, "template")
        fields = None
        if spans is not None:
            tries, fields = _span_tries(tokenizer, spans, on_complete, separator, trigger, allow, deny, distinct,
                                        check_prompt, end_token_id, max_entries)
            on_complete = "release"
        # Live catalogs (trie_decode.live): every generation takes the catalog's snapshot when it starts.
        self._live = tries if isinstance(tries, (LiveCatalog, CatalogSnapshot)) else None
        if self._live is not None:
            tries = self._live.snapshot().base
        self.tries = as_tries(tries, TokenTrie, tokenizer)
        if check_prompt and (tokenizer is None or trigger is not None):
            raise ConstraintConfigError("check_prompt=True needs the tokenizer and no trigger (the span must start "
                                        "right after the prompt)")
        self._check_with = tokenizer if check_prompt else None
        self.rules = SpanRules(**rule_args(tokenizer, end_token_id, on_complete, separator, trigger), fields=fields)
        check_distinct(self.rules.on_complete, distinct, max_entries)  # a bool; max_entries only with it
        distinct = bool(distinct)
        # With filters over one trie per prompt, each prompt decodes the trie of the entries its filter leaves; the
        # results are reported as the entries of the tries given (match_all: Restriction.source_entry).
        self._restrictions = None
        if len(self.tries) > 1 and (allow is not None or deny is not None) and not distinct:
            self._restrictions = filtered_restrictions(self.tries, allow, deny, self.rules.on_complete)
            self.tries = [r.trie for r in self._restrictions]
            allow = deny = None
        self._filtered = allow is not None or deny is not None or distinct
        self._constraints: dict[str, TrieConstraint] = {}
        self._last_constraint: Optional[TrieConstraint] = None
        self._view = None  # a live catalog's view of the current generation (trie_decode.live.CatalogView)
        # Filters without a distinct list never change: built once per (rows, device), reused by every generation.
        self._static_filters: dict[tuple[int, str], Any] = {}
        self._filter_specs: tuple = (None, None, False, 0, max_entries)
        if self._filtered:  # resolved (keys to entry indices) and checked now, once: a bad key fails here
            if len(self.tries) > 1:
                raise ConstraintConfigError("distinct lists need one trie shared by every prompt (a list's entries "
                                            "are ranked in it), and tries= gives one per prompt")
            n = prompt_filters(allow, deny)

            def resolve(spec: Any, what: str) -> Any:
                if spec is None or self._live is not None:  # a live catalog's keys are resolved per view (_begin)
                    return spec
                if is_per_row(spec):  # one per prompt (the other may be one for every prompt: filter_rows)
                    return [None if s is None else entry_indices(self.tries[0], s, f"{what}[{i}]")
                            for i, s in enumerate(spec)]
                return entry_indices(self.tries[0], spec, what)

            self._filter_specs = (resolve(allow, "allow"), resolve(deny, "deny"), bool(distinct), n, max_entries)
            self._filters_for(n or 1, torch.device("cpu"))  # built once here, so that a bad filter fails now
            self._view = None  # a live catalog's view of this check: each generation takes its own (_begin)
        self._stop_options = _END_TOKEN_OPTIONS  # named by the stop-id check's fix (rank's caller has its own)
        self._hasher = _PrefixHasher()
        self._max_depth = max(t.max_depth for t in self.tries) if self._live is None else self._live.snapshot().max_depth
        self.reset()

    def reset(self) -> None:
        """Forget all rows; the next call starts a new generation (also detected automatically)."""
        self._state: Optional[RowState] = None
        self._hashes: Optional[torch.Tensor] = None
        self._groups: Optional[torch.Tensor] = None
        self._start = 0
        self._last_len = -1
        self._loop: Optional[GenerateLoop] = None
        self._parents_checked: Optional[GenerateLoop] = None
        self._filters = None
        self._fused = None
        self._prompt: Optional[torch.Tensor] = None
        self._trail: Optional[list[RowState]] = None
        self._seen: Optional[torch.Tensor] = None
        self._kept: dict[int, tuple] = {}  # generations kept aside (_switch), by id of their LogitsProcessorList
        self._buffers = _OutputBuffers()
        self.steps = 0

    def constraint(self, device: torch.device) -> TrieConstraint:
        """The :class:`TrieConstraint` on ``device`` (built once per device); for a live catalog, the constraint of
        the current generation's view (:meth:`trie_decode.live.CatalogView.constraint`)."""
        if self._live is not None:
            if self._view is None:
                self._view = self._live.snapshot().view(self.rules)
            return self._view.constraint(self.rules, device)
        last = self._last_constraint
        if last is not None and last.device == device:
            return last
        key = str(device)
        if key not in self._constraints:
            self._constraints[key] = TrieConstraint(self.tries, self.rules, device)
        self._last_constraint = self._constraints[key]
        return self._last_constraint

    @property
    def generation_start(self) -> int:
        """Length of ``input_ids`` at the first call of the current generation (where the span starts)."""
        return self._start

    @property
    def masks_in_place(self) -> bool:
        """Whether the current generation's scores are masked in place (see :class:`GenerateLoop`)."""
        return self._loop is not None and self._loop.in_place

    def _trigger_tails(self, input_ids: torch.Tensor, starting: bool = False) -> Optional[torch.Tensor]:
        """The rows' last tokens the constraint reads: a token trigger's length at every step; with spans, the
        prompt's tail at a generation's start only (``starting``; later steps feed the automaton token by token)."""
        t = SPAN_PROMPT_TAIL if starting and self.rules.fields is not None else self.rules.trigger_len
        if not t:
            return None
        tails = input_ids[:, -t:]
        if self.rules.trigger and tails.shape[1] < t:  # a history shorter than the trigger: -1 never matches it
            tails = torch.nn.functional.pad(tails, (t - tails.shape[1], 0), value=-1)
        return tails

    def _begin(self, input_ids: torch.Tensor, device: torch.device, loop: "GenerateLoop") -> None:
        batch, cur = input_ids.shape
        if self._live is not None:  # a generation decodes the catalog as it is now, to its end
            self._view = self._live.snapshot().view(self.rules)
            self.tries = [self._view.trie]
            self._max_depth = self._view.trie.max_depth
        # Before the first token: generate stops at its own stop ids.
        self.check_stop_ids(loop.stop_ids(), change=self._stop_options)
        constraint = self.constraint(device)
        # One trie (or filter) per prompt: generate's prompts, not just a count that divides its rows.
        check_prompts(batch, loop.rows_per_prompt(), {"tries": len(self.tries) if self.rules.fields is None else 1,
                                                      "allow/deny": self._filter_specs[3]})
        # With spans every row may enter every span's trie: its tree is the span it is in, not its prompt's.
        self._groups = prompt_groups(batch, 1 if self.rules.fields is not None else len(self.tries), device)
        self._state = self._fresh(input_ids, device)
        # Each row's prompt key, once per generation (the prompt rows never change; beams reorder within a prompt).
        self._keys = self._row_keys(input_ids) if loop.reorders else None
        self._hashes = (self._hasher.hash(self._keys, input_ids[:, :0])
                        if loop.reorders and loop.parents is None else None)
        self._start = cur
        self._loop = loop
        self.steps = 0
        # A loop whose calls may rewind keeps each state of the generated prefix it last saw (rows in place, and
        # filters that never change; otherwise a rewind replays the prefix from the start).
        self._prompt, self._seen = input_ids, input_ids[:, cur:]
        keeps = loop.rewinds and not loop.reorders and not self._filter_specs[2]
        self._trail = [self._state] if keeps else None
        # Inside generate's own loops (rows in place, or beam search's recorded parents), with no filters or static
        # ones, the next steps are one C call each on a CPU (see TrieConstraint.fused_step), None elsewhere.
        follows = (not loop.reorders or (loop.parents is not None and self._hashes is None)) and not loop.rewinds
        self._fused = constraint.fused_step(self._state, self._filters) if follows else None
        if self._check_with is not None:
            self._warn_prompts(input_ids)

    def check_stop_ids(self, stop_ids: Optional[Sequence[int]], *, change: str = _END_TOKEN_OPTIONS) -> None:
        """Refuse tries that a stop token would cut short: an entry that holds one of ``stop_ids`` (the tokens the
        generation loop stops a row at: the end token when it is one, or any other) before its last token, in every
        ``on_complete`` mode (:func:`~trie_decode.constraint.check_stop_tokens_outside_entries`, on every trie the
        processor decodes). An entry that ends with a stop token is fine, and so is an end token that is not a stop
        id (the processor then only uses it to end entries).

        ``generate`` calls it at each generation's first step, with its own stop ids (``eos_token_id`` given to
        ``generate``, else the generation config's), before any token is chosen; ``fast_forward_generate`` before
        its prefill. Where the caller is unknown (a loop of one's own, or a transformers outside the verified
        versions) nothing is checked: such a loop may call it with its own stop ids. The check is kept on each
        trie per stop token (:meth:`TokenTrie.derived`): after a trie's first generation it costs nothing. A live
        catalog is checked as it is decoded now, its view's trie with the entries removed since excepted.

        Args:
            stop_ids: the loop's stop tokens; None (unknown): nothing is checked.
            change: the options that pick the stop tokens, named in the error's fix.

        Raises:
            ConstraintConfigError: naming the entry, the stop token and the fix.
        """
        if stop_ids is None:
            return
        tries, denied = self.tries, None
        if self._live is not None:  # the catalog as decoded now: its removed entries are still in the view's trie
            view = self._view if self._view is not None else self._live.snapshot().view(self.rules)
            tries, denied = [view.trie], view.deny
        for trie in tries:
            check_stop_tokens_outside_entries(trie, stop_ids, change=change, denied=denied)

    def _fresh(self, prompts: torch.Tensor, device: torch.device) -> RowState:
        """The rows' state where generation starts after ``prompts`` (Shape: (B, P)), with their filters as they are
        there (a live catalog's view denies the entries removed since the catalog was built: filters even with
        none given)."""
        self._filters = self._filters_for(len(prompts), device)
        return self.constraint(device).start(len(prompts), self._groups, self._trigger_tails(prompts, starting=True))

    def _filters_for(self, batch: int, device: torch.device) -> Any:
        """The filters of a generation of ``batch`` rows on ``device`` (:meth:`TrieConstraint.filters`): a live
        catalog's from its current view, static ones (no distinct list) from the cache of the newest few; None when
        nothing is filtered."""
        if not self._filtered and self._live is None:
            return None
        allow, deny, distinct, n, max_entries = self._filter_specs
        rows = (batch, filter_rows(allow, n, batch), filter_rows(deny, n, batch))
        constraint = self.constraint(device)
        if self._live is not None:
            return self._view.filters(constraint, *rows, distinct=distinct, max_entries=max_entries)
        key = (batch, str(device))
        if key not in self._static_filters:
            built = constraint.filters(*rows, distinct=distinct, max_entries=max_entries)
            if distinct:
                return built
            if len(self._static_filters) >= _STATIC_FILTERS_KEPT:  # batch sizes seen: keep the newest few
                self._static_filters.pop(next(iter(self._static_filters)))
            self._static_filters[key] = built
        return self._static_filters[key]

    def _warn_prompts(self, input_ids: torch.Tensor) -> None:
        """Check each distinct prompt of the batch against its trie (see ``check_prompt`` in the class docs)."""
        pad = getattr(self._check_with, "pad_token_id", None)
        seen: set[tuple] = set()
        for row, tree in zip(input_ids.tolist(), self._groups.tolist()):
            while pad is not None and row and row[0] == pad:
                row = row[1:]  # left padding
            if (tree, tuple(row)) not in seen:
                seen.add((tree, tuple(row)))
                warn_prompt(self.tries[tree], self._check_with, row)

    def _parent_column(self, loop: "GenerateLoop", shape: torch.Size) -> Optional[torch.Tensor]:
        """Each row's parent row for the token it just appended, from beam search's ``running_beam_indices``
        (a view, on its device), or None when the loop records none for this step or its layout is not the one
        the fast path reads (checked at a generation's first use: :func:`.transformers_internals.beam_parents`)."""
        batch, cur = shape
        column = cur - 1 - self._start
        check = not loop.continues(self._parents_checked)  # once per generation
        parents = beam_parents(loop.parents, batch, column, check=check)
        if check:
            self._parents_checked = loop
            if parents is None and loop.parents is not None and column == 0:
                # This generation takes the prefix-hash lookup instead; its previous rows had empty prefixes.
                loop.parents = None
                self._hashes = self._hasher.hash(self._keys, self._prompt[:, :0])
        return parents

    def _row_keys(self, prompts: torch.Tensor) -> torch.Tensor:
        """What a row's state depends on besides its generated tokens, hashed with them by the prefix lookup: its
        trie, its prompt's filter and the prompt tail a trigger or spans read (rows of two prompts may generate the
        same tokens). Shape: (B,), int64."""
        keys, n = self._groups, self._filter_specs[3]
        if n:
            keys = keys * n + prompt_groups(len(keys), n, keys.device)
        tails = self._trigger_tails(prompts, starting=True)
        return keys if tails is None else self._hasher.hash(keys, tails.to(keys.device))

    def _follow(self, input_ids: torch.Tensor, device: torch.device, loop: "GenerateLoop") -> bool:
        """Advance every row from its parent row; False if the rows do not continue the previous call's rows.

        Every way costs O(1) per row, whatever the number of generated tokens. Inside ``generate``'s sampling loop
        (greedy or sampling) rows never move: row i's parent is row i. Beam search names each row's parent (see
        :class:`GenerateLoop`). Elsewhere (a caller this class does not know) rows may be reordered between
        calls; each row finds its parent by a hash of its generated prefix, a lookup with no host read (argsort,
        searchsorted, gather), and the hash is O(generated tokens), except in ``"eos"`` mode past the deepest entry.
        """
        batch, cur = input_ids.shape
        fused, self._fused = self._fused, None  # it holds the rows' nodes: from here on they are this path's
        if fused is not None and fused.filters is not None:  # and their filters, as their parent rows left them
            self._filters = self._filters.following(fused.filters)
        if self._state is None:
            return False
        if not loop.continues(self._loop) and not self._switch(loop):
            return False
        if batch != len(self._state):
            return False
        if loop.rewinds and (self._trail is not None or cur != self._last_len + 1):
            return self._rewind(input_ids, device)
        if cur != self._last_len + 1:
            return False
        ids = input_ids if input_ids.device == device else input_ids.to(device)
        constraint = self.constraint(device)
        if not loop.reorders:
            self._state = constraint.advance(self._state, ids.select(1, -1), self._trigger_tails(ids), filters=self._filters)
            return True
        if loop.parents is not None and self._hashes is None:
            parent = self._parent_column(loop, input_ids.shape)
            if parent is not None:
                parent = parent.to(device, torch.long)
                if self._filters is not None:
                    self._filters = self._filters.select(parent)
                self._state = constraint.advance(self._state.select(parent), ids[:, -1], self._trigger_tails(ids),
                                                 filters=self._filters)
                return True
            if self._hashes is None:
                return False
        if self.rules.plain and cur - 1 - self._start > self._max_depth and self._filters is None:
            # "eos" mode: a prefix longer than every entry has ended its entry (or left the trie): every row is
            # DONE, whatever its parent. So under beam search the lookup costs O(max depth), not O(tokens generated).
            self._state = RowState(torch.full_like(self._state.node, DONE), self._state.tree)
            return True
        prev = self._hasher.hash(self._keys, ids[:, self._start : cur - 1])
        order = torch.argsort(self._hashes)
        sorted_hashes = self._hashes[order]
        pos = torch.searchsorted(sorted_hashes, prev).clamp(max=batch - 1)
        found = sorted_hashes[pos] == prev
        if loop.owner() is None and not bool(found.any()):
            return False  # a caller of its own (no LogitsProcessorList) started a new prompt one token longer
        parent = order[pos]
        if self._filters is not None:
            self._filters = self._filters.select(parent)
        state = constraint.advance(self._state.select(parent), ids[:, -1], self._trigger_tails(ids), filters=self._filters)
        # A row whose prefix was never seen (impossible in generate's own loops) may only end.
        state.node = torch.where(found, state.node, torch.full_like(state.node, DONE))
        self._state = state
        self._hashes = prev + ids[:, -1].long() * self._hasher.weights(cur - self._start, device)[-1]
        return True

    def _switch(self, loop: GenerateLoop) -> bool:
        """Keep the current generation aside and resume ``loop``'s if it was kept aside (True then): another
        ``generate`` may call this processor inside one, as an assistant model's does in assisted decoding."""
        kept = self._kept
        for key in [key for key, (ref, _) in kept.items() if ref() is None]:
            del kept[key]
        owner = self._loop.owner() if self._loop is not None else None
        if owner is not None:
            if len(kept) >= _GENERATIONS_KEPT:
                kept.pop(next(iter(kept)))
            kept[id(owner)] = (weakref.ref(owner), tuple(getattr(self, name) for name in _GENERATION))
        new = loop.owner()
        ref, values = kept.pop(id(new), (None, ())) if new is not None else (None, ())
        if ref is None or ref() is not new:
            return False
        for name, value in zip(_GENERATION, values):
            setattr(self, name, value)
        return True

    def _rewind(self, input_ids: torch.Tensor, device: torch.device) -> bool:
        """Set the rows' state to that of ``input_ids``, a prefix of this generation that may be shorter than the
        last call's (assisted decoding: :class:`GenerateLoop`); False if it is not this generation's (another
        prompt, or longer than the last call's by more than one token).

        With a trail (rows in place, static filters) the state of the longest prefix seen before is kept and only
        the tokens after it are fed; otherwise the generated prefix is fed from the start. Either way it costs
        O(tokens fed) advances, and the state is the one a token-by-token generation of this prefix reaches.
        """
        start, cur = self._start, input_ids.shape[1]
        ids = input_ids if input_ids.device == device else input_ids.to(device)
        if not start <= cur <= self._last_len + 1 or not torch.equal(ids[:, :start], self._prompt):
            return False
        generated, kept = ids[:, start:], 0
        if self._trail is not None:
            n = min(generated.shape[1], self._seen.shape[1])
            differs = (generated[:, :n] != self._seen[:, :n]).any(0).tolist()
            kept = differs.index(True) if True in differs else n
            del self._trail[kept + 1:]
            state = self._trail[kept]
        else:
            state = self._fresh(ids[:, :start], device)
        constraint = self.constraint(device)
        for t in range(start + kept, cur):
            state = constraint.advance(state, ids[:, t], self._trigger_tails(ids[:, : t + 1]), filters=self._filters)
            if self._trail is not None:
                self._trail.append(state)
        self._state = state
        if self._trail is not None:
            self._seen = generated.clone()  # the caller may write into its tensor later
        if self._hashes is not None:
            self._hashes = self._hasher.hash(self._keys, generated)
        return True

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if input_ids.dim() != 2 or len(scores) != len(input_ids):  # a row without its tokens would go unmasked
            raise ConstraintConfigError(f"input_ids (B, L) and scores (B, V) must have one row per sequence, got "
                                        f"{tuple(input_ids.shape)} and {tuple(scores.shape)}")
        loop = GenerateLoop.of_caller(self._loop)
        fused = self._fused
        if fused is not None and loop.continues(self._loop):
            shape = input_ids.shape
            if shape[1] == self._last_len + 1 and shape[0] == fused.rows and input_ids.is_cpu:
                parents = self._parent_column(loop, shape) if loop.parents is not None else None
                if parents is not None or not loop.reorders:
                    self._last_len += 1
                    self.steps += 1
                    return fused(input_ids, scores, None if loop.in_place else self._buffers.get(scores), parents)
        device = scores.device
        if not self._follow(input_ids, device, loop):
            self._begin(input_ids.to(device), device, loop)
        self._last_len = input_ids.shape[1]
        self.steps += 1
        out = None if loop.in_place else self._buffers.get(scores)
        return self.constraint(device).mask_(scores, self._state, out=out, filters=self._filters)

    # LogitsProcessorList reads every processor's signature at every step (``inspect.signature``, ~15 us, more than
    # the whole mask at batch 1); a precomputed ``__signature__`` is inspect's documented shortcut.
    __call__.__signature__ = inspect.signature(__call__)  # type: ignore[attr-defined]
    # Continuous batching (``generate_batch``) calls processors on packed rows this class cannot follow.
    supports_continuous_batching = False

    # ------------------------------------------------------------------ results
    def match(self, sequences: torch.Tensor, *, prompt_length: Optional[int] = None) -> list[Optional[Entry]]:
        """The entry each row generated (the first one, after the trigger if any), or None (not with spans: parse
        the text, e.g. ``json.loads``).

        Args:
            sequences: ``generate``'s output (prompt included). Shape: (B, L).
            prompt_length: where generation started (default: the last generation's start).
        """
        return [spans[0] if spans else None for spans in self.match_all(sequences, prompt_length=prompt_length)]

    def match_all(self, sequences: torch.Tensor, *, prompt_length: Optional[int] = None) -> list[list[Entry]]:
        """Every entry each row generated, in order (several in ``"repeat"`` mode or with a trigger)."""
        if self.rules.fields is not None:
            raise ConstraintConfigError("match/match_all read trie entries; with spans, parse the generated text")
        start = self._start if prompt_length is None else prompt_length
        rows = _token_rows(sequences, "sequences", "out.sequences (the prompt included)")
        tree = prompt_groups(len(rows), len(self.tries)).tolist()
        replayer = self.constraint(torch.device("cpu"))
        found = replayer.replay([r[start:] for r in rows], tree, [r[:start] for r in rows])
        if self._restrictions is not None:  # a filtered trie's entries, as the entries of the trie the user gave
            found = [[self._restrictions[t].source_entry(e) for e in row] for row, t in zip(found, tree)]
        if self._live is not None:  # the view's entries, as the generation's snapshot holds them
            found = self._view.source_entries(found)
        return found


def match(trie: TokenTrie | CatalogSnapshot | LiveCatalog, generated: torch.Tensor | Sequence[Sequence[int]], *,
          end_token_id: Optional[int] = None) -> list[Optional[Entry]]:
    """The entry at the start of each row of ``generated`` (generated tokens only, no prompt), or None.

    The longest entry that the row's tokens walk to is returned; trailing end/pad tokens are ignored.
    """
    rules = SpanRules(end_token_id=0 if end_token_id is None else end_token_id)
    return [found[0] if found else None for found in match_all(trie, generated, rules)]


def match_all(trie: TokenTrie | CatalogSnapshot | LiveCatalog, generated: torch.Tensor | Sequence[Sequence[int]],
              rules: SpanRules) -> list[list[Entry]]:
    """Every entry each row generated under ``rules`` (generated tokens only, no prompt); a live catalog's as its
    snapshot now holds them, read over a trie of exactly its entries (:meth:`CatalogSnapshot.view` ``whole=True``:
    may compact the snapshot, about 1 s per million entries, once)."""
    generated = _token_rows(generated, "generated", "the generated tokens, out.sequences[:, prompt_length:]")
    if isinstance(trie, (LiveCatalog, CatalogSnapshot)):
        view = trie.snapshot().view(rules, whole=True)
        return view.source_entries(view.constraint(rules, "cpu").replay(generated))
    return constraint_for(trie, rules, "cpu").replay(generated)


def _token_rows(sequences: Any, what: str, output: str) -> list[list[int]]:
    """The token rows of ``sequences``: a (B, L) tensor or array, or a list of rows; anything else (``generate``'s
    dict output, one row alone, 3-D logits, float ids) is a named error, not a replay of what is no row of tokens.
    ``output``: what to pass instead of ``generate``'s dict output."""
    if hasattr(sequences, "sequences"):  # generate(..., return_dict_in_generate=True)'s output
        raise ConstraintConfigError(f"{what} must be rows of token ids, got generate's {type(sequences).__name__}: "
                                    f"pass {output}")
    rows = sequences.tolist() if hasattr(sequences, "tolist") else sequences
    if isinstance(rows, (list, tuple)):
        rows = [row.tolist() if hasattr(row, "tolist") else row for row in rows]
        if all(isinstance(row, (list, tuple)) and all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                                                      for t in row) for row in rows):
            return [[int(t) for t in row] for row in rows]
    got = (f"{tuple(sequences.shape)} {sequences.dtype}" if hasattr(sequences, "shape") and hasattr(sequences, "dtype")
           else type(sequences).__name__)
    raise ConstraintConfigError(f"{what} must be rows of token ids, Shape (B, L) with integer ids, got {got} (one row "
                                f"alone is {what}[None])")


class RankedEntry(tuple):
    """``(entry, log_prob)``: an entry and the model's log-probability of its tokens followed by the end token."""

    __slots__ = ()

    def __new__(cls, entry: Entry, log_prob: float) -> "RankedEntry":
        return super().__new__(cls, (entry, log_prob))

    @property
    def entry(self) -> Entry:
        return self[0]

    @property
    def log_prob(self) -> float:
        return self[1]


class RankedList(list):
    """The ranked entries of one prompt (a list of :class:`RankedEntry`, best first).

    Attributes:
        duplicates: beams that ended on an entry already listed (another tokenization of the same string, or an
            entry shared by several items) and were merged into it; 0 when every beam was distinct.
    """

    duplicates: int = 0


@torch.no_grad()
def rank(
    model: Any,
    inputs: dict,
    trie: TrieArg,
    k: int,
    *,
    tokenizer: Any = None,
    end_token_id: Optional[int] = None,
    num_beams: Optional[int] = None,
    length_normalize: bool = False,
    renormalize: bool = False,
    allow: Any = None,
    deny: Any = None,
    **generate_kwargs: Any,
) -> list[RankedList]:
    """Top-``k`` distinct entries per prompt with their sequence log-probabilities, by constrained beam search.

    Args:
        model: a transformers causal LM.
        inputs: the tokenized prompts (``input_ids``, ``attention_mask``), left-padded for a batch.
        trie: one trie, or one per prompt.
        k: number of distinct entries per prompt; fewer are returned when the trie (or the filters) hold fewer.
        num_beams: beams of the search (default ``k``, at least 2: one beam is greedy search, which scores no
            sequence); more beams give more room when beams end on duplicates.
        length_normalize: rank by the mean log-probability per token instead of the sum.
        renormalize: report log-probabilities renormalized within the trie (at each step, over the tokens the
            trie allowed), by rescoring the results in one forward pass: the probability of the entry among the
            trie's entries, summing to 1 over all of them.
        allow, deny: per-prompt or shared entry filters (see :class:`TrieLogitsProcessor`).
        generate_kwargs: passed to ``generate`` (``max_new_tokens`` defaults to the deepest trie + 1, unless
            ``max_length`` or a ``generation_config`` with ``max_new_tokens`` is given). The search
            does not stop early (``early_stopping="never"``: it runs while a longer entry could still outrank the
            finished ones);
            what ``rank`` sets itself (``num_beams``, ``num_return_sequences``, ``do_sample``, ``length_penalty``,
            ``output_scores``, ``return_dict_in_generate``, ``eos_token_id``, ``logits_processor``) is refused here,
            and so are ``distinct``/``max_entries`` (a distinct list is the processor's: its entries are distinct)
            and the processor's other modes (``on_complete``, ``separator``, ``trigger``, ``spans``, ``template``,
            ``check_prompt``), and ``min_new_tokens``/``min_length`` (they ban the end token). A beam that did not
            write its end token (cut by ``max_new_tokens``) is left out, and so is one that took a token at the floor
            (``bad_words_ids``, ``suppress_tokens``, ``begin_suppress_tokens`` banned all the trie allowed there:
            :data:`~trie_decode.kernels.rules.ALL_MASKED_FLOOR`): generate cannot write that entry.

    Raises:
        ConstraintConfigError: besides bad options, an entry that holds the end token before its last token (beam
            search stops at the end token: :meth:`TrieLogitsProcessor.check_stop_ids`).

    Returns:
        Per prompt, a :class:`RankedList` of :class:`RankedEntry`, best first. The log-probability is the sum of the
        model's raw log-probabilities of the entry's tokens and the end token (its mean with ``length_normalize``;
        renormalized within the trie with ``renormalize``). Entries are distinct: beams that end on the same entry
        (or on another form of the same string: same key, else same name) are merged, keeping the best, and counted
        in ``RankedList.duplicates``. Ties keep beam order (transformers' order).

    Example:
        >>> ranked = rank(model, tok(prompts, return_tensors="pt", padding=True), trie, k=10)  # doctest: +SKIP
        >>> [(r.entry.key, round(r.log_prob, 2)) for r in ranked[0]]                              # doctest: +SKIP
    """
    check_positive(k, "k")
    if num_beams is not None:
        check_positive(num_beams, "num_beams")
    beams = int(k if num_beams is None else num_beams)
    if beams < k:
        raise ConstraintConfigError(f"num_beams ({beams}) must be at least k ({k})")
    beams = max(beams, 2)  # one beam is greedy search, which scores no sequence
    check_no_distinct("rank", generate_kwargs, "it returns k distinct entries: beams that end on one entry are merged")
    check_not_taken("rank", generate_kwargs, _RANK_REFUSES, "it ranks whole entries, each closed by the end token",
                    "rank(model, inputs, trie, k, tokenizer=..., end_token_id=..., allow=..., deny=...) takes a trie "
                    "and its filters; other modes are model.generate(..., logits_processor=[TrieLogitsProcessor(...)])")
    check_not_taken("rank", generate_kwargs, _RANK_BANS_END, _BANS_END_WHY, "leave them out")
    own = sorted(set(generate_kwargs) & _RANK_SETS)
    if own:
        raise ConstraintConfigError(f"rank sets {own} itself: use its own options (k, num_beams, length_normalize, "
                                    "end_token_id, allow, deny)")
    if not isinstance(trie, (LiveCatalog, CatalogSnapshot)):
        as_tries(trie, TokenTrie, None, "trie")  # named as rank's argument (the processor's is tries=, refused here)
    processor = TrieLogitsProcessor(
        trie, tokenizer, end_token_id=end_token_id if end_token_id is not None else _model_eos(model), allow=allow, deny=deny
    )
    # generate stops at the end token (eos_token_id below): refused here with rank's own option in the fix (and at
    # the generation's start, where a live catalog's view is taken).
    processor._stop_options = "end_token_id="
    processor.check_stop_ids([processor.rules.end_token_id], change=processor._stop_options)
    if not isinstance(inputs.get("input_ids", torch.empty(0)), torch.Tensor):
        raise ConstraintConfigError("rank's inputs must hold input_ids as a tensor: tokenize with "
                                    "return_tensors=\"pt\"")
    # The same options set by the generation config generate reads (given, else the model's): refused alike (they
    # emptied the ranking silently). min_length counts the prompt: it bans the end token only past the prompt.
    config = generate_kwargs.get("generation_config") or getattr(model, "generation_config", None)
    width = inputs["input_ids"].shape[-1] if "input_ids" in inputs else 0
    check_not_taken("rank", {"min_new_tokens": getattr(config, "min_new_tokens", None) or None,
                             "min_length": (getattr(config, "min_length", None) or 0) > width or None},
                    _RANK_BANS_END, _BANS_END_WHY, "the generation config generate reads (generation_config=, else "
                    "model.generation_config) sets them: set them to None there")
    prompts = inputs["input_ids"].shape[0] if "input_ids" in inputs else None  # one trie per prompt, named as rank's
    if prompts is not None:
        check_prompts(prompts, 1, {"trie": len(processor.tries), "allow/deny": processor._filter_specs[3]})
    depth = processor._max_depth
    given = generate_kwargs.get("generation_config")
    if generate_kwargs.get("max_length") is None and getattr(given, "max_new_tokens", None) is None:
        generate_kwargs.setdefault("max_new_tokens", depth + 1)  # a given length is the user's (not overridden)
    out = model.generate(
        **inputs,
        logits_processor=[processor],
        num_beams=beams,
        num_return_sequences=beams,
        do_sample=False,
        length_penalty=1.0 if length_normalize else 0.0,
        # No early stop: with early_stopping=True the search ended once it held num_beams finished beams, before a
        # longer entry that outranks them could finish. "never" bounds what a running beam may still reach.
        **{"early_stopping": "never", **generate_kwargs},
        output_scores=True,
        return_dict_in_generate=True,
        eos_token_id=processor.rules.end_token_id,
    )
    entries = processor.match(out.sequences)
    # A beam that max_new_tokens cut before its end token did not finish either (its score lacks the end token's).
    closed = (out.sequences[:, processor.generation_start:] == processor.rules.end_token_id).any(1).tolist()
    # A beam that took a token at the floor (another option banned every token the trie allowed there) holds an
    # entry generate cannot write: the floor is that step's score, whatever the sum, its length or renormalizing.
    # (Gathered here, not by compute_transition_scores, which assumes the scores are config.vocab_size wide.)
    floored = torch.zeros(out.sequences.shape[0], dtype=torch.bool, device=out.sequences.device)
    for t in range(out.beam_indices.shape[1]):
        beam = out.beam_indices[:, t]  # -1 once the beam finished
        chosen = out.scores[t][beam.clamp(min=0), out.sequences[:, processor.generation_start + t]]
        floored |= (beam >= 0) & (chosen == ALL_MASKED_FLOOR)
    floored = floored.tolist()
    raw = out.sequences_scores.tolist()
    scores = _renormalized(model, inputs, out.sequences, processor, length_normalize, raw) if renormalize else raw
    batch = out.sequences.shape[0] // beams
    ranked: list[RankedList] = []
    for p in range(batch):
        seen: dict[tuple, RankedEntry] = {}
        merged = 0
        for i in range(p * beams, (p + 1) * beams):
            entry, score = entries[i], scores[i]
            # A beam that did not finish is padding, whatever its renormalized score: its raw score says so.
            if (entry is None or not closed[i] or floored[i] or raw[i] <= _UNFINISHED or raw[i] != raw[i]
                    or score != score):
                continue
            ident = entry_identity(entry)  # the forms of one string (leading_space=[True, False]) are one entry
            if ident in seen:
                merged += 1
                if seen[ident].log_prob >= score:
                    continue
            seen[ident] = RankedEntry(entry, score)
        best = RankedList(sorted(seen.values(), key=lambda r: -r.log_prob)[:k])
        best.duplicates = merged
        ranked.append(best)
    return ranked


#: The generate options rank sets itself.
_RANK_SETS = frozenset(("num_beams", "num_return_sequences", "do_sample", "length_penalty", "output_scores",
                        "return_dict_in_generate", "eos_token_id", "logits_processor"))

#: The generate options rank refuses because they ban its end token at first (given, or set by the generation config).
_RANK_BANS_END = ("min_new_tokens", "min_length")
_BANS_END_WHY = ("they ban the end token that closes each entry, which the trie then emits at the floor: no entry "
                 "could be ranked")

#: TrieLogitsProcessor's options rank does not take (distinct lists aside: check_no_distinct).
_RANK_REFUSES = ("on_complete", "separator", "trigger", "spans", "template", "check_prompt", "tries")

#: transformers' beam search adds -1e9 to a beam it must not return (one that did not finish): such beams are
#: padding, not results.
_UNFINISHED = -1e8


def _renormalized(model: Any, inputs: dict, sequences: torch.Tensor, processor: "TrieLogitsProcessor",
                  length_normalize: bool, raw: list[float]) -> list[float]:
    """Each sequence's log-probability renormalized within the trie: at every generated position, the chosen
    token's log-probability minus the log of the total probability of the tokens the trie allowed there (one
    forward pass over all sequences; the allowed sets come from the processor's own constraint, with its filters:
    allow/deny, a live catalog's removals; so a filter of k entries renormalizes as a trie of those k entries)."""
    start = processor.generation_start
    mask = inputs.get("attention_mask")
    rows, width = sequences.shape
    reps = rows // inputs["input_ids"].shape[0]
    attn = torch.ones_like(sequences)
    if mask is not None:
        attn[:, :start] = mask.repeat_interleave(reps, dim=0)
    end = processor.rules.end_token_id
    gen = sequences[:, start:]
    # Positions after the end token are padding: not scored.
    ended = (gen == end).long().cumsum(1)
    live = (ended == 0) | ((ended == 1) & (gen == end))
    attn[:, start:] = live.long()
    logits = model(input_ids=sequences, attention_mask=attn).logits[:, start - 1 : width - 1].float()
    logp = torch.log_softmax(logits, dim=-1)
    constraint = processor.constraint(torch.device("cpu"))
    filters = processor._filters_for(rows, torch.device("cpu"))  # the generation's filters, for these rows
    state = constraint.start(rows, prompt_groups(rows, len(processor.tries)))
    total = torch.zeros(rows, dtype=torch.float64)
    count = torch.zeros(rows, dtype=torch.float64)
    for j in range(gen.shape[1]):
        allowed = constraint.allowed(state, logp.shape[-1], filters=filters)
        lse = torch.logsumexp(logp[:, j].masked_fill(~allowed, float("-inf")), dim=-1)
        chosen = logp[torch.arange(rows), j, gen[:, j]]
        step = (chosen - lse).double()
        total += torch.where(live[:, j], step, torch.zeros_like(step))
        count += live[:, j].double()
        state = constraint.advance(state, gen[:, j], filters=filters)
    out = (total / count.clamp(min=1)) if length_normalize else total
    return [float(v) if r != float("-inf") else r for v, r in zip(out.tolist(), raw)]


def _model_eos(model: Any) -> Optional[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(getattr(model, "config", None), "eos_token_id", None)
    return first_eos(eos)


#: How many rows and nodes a prefix_allowed_tokens_fn remembers before it forgets them all.
_PREFIX_CACHE = 1 << 14
#: The dtypes whose rows it caches: their tolist() gives ints (a float or bool row would hit an int row's key).
_TOKEN_DTYPES = {torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8}


def prefix_allowed_tokens_fn(
    trie: TokenTrie, *, end_token_id: int, prompt_length: Optional[Union[int, Sequence[int]]] = None
) -> Callable[[int, torch.Tensor], list[int]]:
    """A ``prefix_allowed_tokens_fn`` for code written for GENRE / ``PrefixConstrainedLogitsProcessor``.

    The returned function maps ``(batch_id, input_ids_row)`` to the allowed token ids of that row: the trie's
    step table in ``"eos"`` mode (children, plus the end token where an entry ends; only the end token once the row
    left the trie), as a new list. It remembers the node of each row's generated tokens (a row one token longer than
    one it saw takes one trie step, whichever beam it came from) and each node's allowed tokens (read for all the
    rows of a ``generate`` step at once), yet :class:`TrieLogitsProcessor` stays faster (no list per row). What it
    remembers changes no answer: reuse it across ``generate`` calls, prompt lengths, batch sizes, sampling and beam
    search.

    Args:
        trie: the trie.
        end_token_id: allowed once an entry is complete, and when nothing else is.
        prompt_length: where generation starts in ``input_ids``: one length for every row (left-padded batches
            share it), or one per ``batch_id``. Without it, the start is the length of ``input_ids`` when the
            ``generate`` call's own ``PrefixConstrainedLogitsProcessor`` first calls the function (read from the
            calling frame); a direct call without ``prompt_length`` is an error, since a row alone does not say
            where its prompt ends.

    Raises:
        InvalidTokenError: at a ``generate`` call's first step, a trie (or end token) wider than its scores.
        ConstraintConfigError: at a ``generate`` call's first step, an entry that holds one of its stop ids before
            its last token (a row would stop inside it), as :meth:`TrieLogitsProcessor.check_stop_ids` refuses it.

    Example:
        >>> trie = TokenTrie.from_sequences([[5, 6], [7]], vocab_size=10)
        >>> fn = prefix_allowed_tokens_fn(trie, end_token_id=0, prompt_length=2)
        >>> fn(0, torch.tensor([1, 2])), fn(0, torch.tensor([1, 2, 5])), fn(0, torch.tensor([1, 2, 7]))
        ([5, 7], [6], [0])
    """
    if prompt_length is not None and not isinstance(prompt_length, int):
        prompt_length = [int(n) for n in prompt_length]
    constraint = TrieConstraint(trie, SpanRules(end_token_id=end_token_id), "cpu")
    # The start of each generate call, keyed by that call's PrefixConstrainedLogitsProcessor (a new one per call).
    starts: "weakref.WeakKeyDictionary[Any, int]" = weakref.WeakKeyDictionary()

    def start_of(batch_id: int, call: Optional[PrefixCall]) -> int:
        if call is not None and call.owner not in starts:  # a generate call's first: check what it will mask
            call = prefix_processor_call(depth=2)
            # The allowed ids index its scores, and generate stops at its stop ids (the processor's checks).
            InvalidTokenError.check_logits_width(call.width, constraint.needed_width)
            if call.stop_ids is not None:
                check_stop_tokens_outside_entries(trie, call.stop_ids, change=_END_TOKEN_OPTIONS)
            starts[call.owner] = call.length
        if isinstance(prompt_length, int):
            return prompt_length
        if prompt_length is not None:
            if not 0 <= batch_id < len(prompt_length):
                raise ConstraintConfigError(f"batch_id {batch_id} has no prompt_length (got {len(prompt_length)})")
            return prompt_length[batch_id]
        if call is None:
            raise ConstraintConfigError(
                "prefix_allowed_tokens_fn without prompt_length must be called by generate() "
                "(transformers' PrefixConstrainedLogitsProcessor); pass prompt_length=... to call it directly"
            )
        return starts[call.owner]

    # Caches (emptied together past _PREFIX_CACHE entries): a row's generated tokens -> its node (-1: it left the
    # trie), and a node -> its allowed tokens, which depend on the node alone here (no filter, a fixed width).
    nodes: dict[tuple, int] = {}
    lists: dict[int, list[int]] = {}

    def node_of(gen: tuple) -> int:
        node = nodes.get(gen)
        if node is None:  # one step from the row one token shorter when it was seen, else a walk from the root
            parent = nodes.get(gen[:-1]) if gen else None
            node = trie.walk(gen) if parent is None else -1 if parent < 0 else trie.walk(gen[-1:], parent)
            if len(nodes) + len(lists) >= _PREFIX_CACHE:
                nodes.clear(), lists.clear()
            nodes[gen] = node
        return node

    def allowed(batch_id: int, input_ids: torch.Tensor) -> list[int]:
        # A row of token ids is cached; anything else is walked as a list, so it fails as before (a float or bool
        # row would equal an int row as a key).
        cached = isinstance(input_ids, torch.Tensor) and input_ids.dim() == 1 and input_ids.dtype in _TOKEN_DTYPES
        row = None if cached else input_ids.tolist()
        call = prefix_processor_call(depth=1, read_loop=False)
        start = start_of(int(batch_id), call)
        node = node_of(tuple(input_ids[start:].tolist())) if cached else trie.walk(row[start:])
        if node not in lists:  # one engine call for this row and the step's others (when all rows start where it does)
            shared = cached and call is not None and not isinstance(prompt_length, list)
            rows = call.ids[:, start:].tolist() if shared else []
            todo = sorted({node, *(node_of(tuple(r)) for r in rows)} - lists.keys())
            at = torch.tensor([DONE if n < 0 else n for n in todo])
            lists.update(zip(todo, constraint.allowed_tokens(RowState(at, torch.zeros_like(at)))))
        return list(lists[node])  # a copy: the caller may change it

    return allowed
