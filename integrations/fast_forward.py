"""Fast-forward (jump-forward) decoding for transformers: forced runs of a trie cost no forward pass of their own.

Why this exists: inside a trie most steps have no choice. Once a name's prefix is unique, every remaining token
is forced, and token-by-token decoding spends one forward pass on each of them. Here each step makes one real
decision per row (argmax or a sample from the masked logits), appends the run of tokens the trie forces after it
(:meth:`~trie_decode.constraint.TrieConstraint.forced_tokens`, built on ``TokenTrie.forced_runs``), and feeds all
rows' new tokens through *one* forward pass. SGLang's jump-forward decoding does the same for JSON schemas.

A step of the loop, for a batch whose rows emit different numbers of tokens (ragged blocks):

    1. Decide: run ``generate``'s logits processors, mask the logits of every unfinished row with its trie state
       (the same :class:`~trie_decode.constraint.TrieConstraint` the processor uses), run the sampling warpers
       (the order ``generate`` gives a ``TrieLogitsProcessor``), and take the argmax or a sample.
    2. Fast-forward: append each row's forced run (including a forced end token where an entry ends with no way
       on, and the rest of a separator in ``"repeat"`` mode), advancing the row state through it.
    3. Commit: cut rows at a stop token or at ``max_new_tokens``; finished rows leave the batch (their KV-cache
       rows are dropped) once nothing more is needed from them.
    4. Feed: right-pad the rows' new tokens to the longest, extend ``attention_mask`` with 0 for the pads, give
       every real token its row's running position (``position_ids``), and run one forward pass with the
       model's ``DynamicCache``. The pad slots stay in the cache, masked forever; positions count real tokens
       only, so each row sees exactly the keys and positions of token-by-token decoding.

Forward passes: the prefill serves a row's first decision and every later decision costs one pass, so a batch
takes ``max over rows of (decisions)`` passes; the final block, which ends in the end token, is never fed (it is
fed, minus its last token, only when ``output_scores``/``output_logits`` need its forced tokens' logits).
Token-by-token decoding takes one pass per generated position of the longest row.

Canonical tokenization is kept: forced tokens are the entries' own tokens, and nothing is forced across a span
boundary (a released span continues as free text, chosen token by token).

Dimension letters: B rows (prompts x return sequences), P prompt width, L block width of a step, V logits width.

Example (both ways of calling it):

    >>> out = model.generate(**inputs, custom_generate=fast_forward_generate, trie=trie,          # doctest: +SKIP
    ...                      max_new_tokens=32, do_sample=False)
    >>> out = fast_forward_generate(model, **inputs, trie=trie, max_new_tokens=32)               # doctest: +SKIP
    >>> out.stats.skip_ratio, out.stats.forward_passes                                           # doctest: +SKIP
"""

from __future__ import annotations

import copy
import functools
import inspect
import time
from dataclasses import dataclass, field, fields
from typing import Any, Optional, Sequence, Union

import torch

from trie_decode.constraint import RowState, TrieConstraint
from trie_decode.errors import ConstraintConfigError, InvalidTokenError
from trie_decode.filters import filtered_tries
from trie_decode.live import CatalogSnapshot, LiveCatalog
from trie_decode.options import (TrieArg, as_tries, check_no_distinct, check_not_taken, check_one_source, check_prompts,
                                  end_token, first_eos, prompt_filters, prompt_groups, tokens_arg)
from trie_decode.templates import Template
from trie_decode.trie import TokenTrie

try:
    from transformers import DynamicCache, GenerationConfig, LogitsProcessorList
    from transformers.generation.utils import GenerateDecoderOnlyOutput
    from transformers.generation import (EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria, StoppingCriteriaList,
                                         StopStringCriteria, SynthIDTextWatermarkLogitsProcessor,
                                         UnbatchedClassifierFreeGuidanceLogitsProcessor)
    from .transformers import TrieLogitsProcessor
    from .transformers_internals import (
        CACHE_INPUT_NAMES,
        around_user_processors,
        generate_streamer,
        holds_batch_state,
        cache_input_name,
        drop_cache_rows,
        eos_token_ids,
        output_cache,
        rows_per_prompt,
        sliding_window_slots,
        verified,
        warn_token_by_token,
        warn_unverified,
    )
except ImportError as exc:  # pragma: no cover - import guard
    raise ImportError("trie_decode.integrations.fast_forward needs transformers: pip install 'trie-decode[transformers]'") from exc

__all__ = ["fast_forward_generate", "FastForwardStats", "FastForwardOutput"]

# Model kwargs that generate() hands to a custom_generate callable and that this loop understands; anything else
# (images, token_type_ids, ...) is refused rather than silently ignored.
_KNOWN_MODEL_KWARGS = {"attention_mask", "position_ids", "use_cache", "logits_to_keep", "cache_position", *CACHE_INPUT_NAMES}


@dataclass
class FastForwardStats:
    """Counters of one :func:`fast_forward_generate` call.

    Attributes:
        forward_passes: model forward calls, the prefill included (one call serves every row of the batch).
        tokens_emitted: generated tokens over all rows (padding after a row's end excluded).
        forced_tokens: of those, tokens appended from the trie without a decision of the model.
        decisions: tokens chosen from the logits (``tokens_emitted - forced_tokens``).
        step_by_step_passes: forward passes token-by-token decoding takes for the same output: one per generated
            position of the longest row.
        row_tokens, row_forced: per row, tokens emitted and tokens forced.
        seconds: wall time of the call.
    """

    forward_passes: int = 0
    tokens_emitted: int = 0
    forced_tokens: int = 0
    decisions: int = 0
    step_by_step_passes: int = 0
    row_tokens: list[int] = field(default_factory=list)
    row_forced: list[int] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def skip_ratio(self) -> float:
        """Share of the emitted tokens that were forced, i.e. that cost no forward pass of their own."""
        return self.forced_tokens / self.tokens_emitted if self.tokens_emitted else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        out["skip_ratio"] = round(self.skip_ratio, 4)
        return out


@dataclass
class FastForwardOutput(GenerateDecoderOnlyOutput):
    """``generate``'s dict output plus :class:`FastForwardStats` in ``stats``.

    ``scores[j]`` / ``logits[j]`` (Shape: (B, V)) hold, for each row, the processed / raw logits that produced its
    ``j``-th generated token, forced tokens included; positions after a row's end hold ``-inf``.
    ``past_key_values`` is None: the loop's cache holds masked pad slots and drops finished rows, so it is not a
    cache ``generate`` could continue from.
    """

    stats: Optional[FastForwardStats] = None


# ---------------------------------------------------------------------------------------------------- helpers
def _where_state(keep_new: torch.Tensor, new: RowState, old: RowState) -> RowState:
    """Row-wise choice between two states. keep_new: Shape: (R,), bool."""
    return RowState(*(None if getattr(new, f.name) is None else torch.where(keep_new, getattr(new, f.name), getattr(old, f.name))
                      for f in fields(RowState)))


#: Processors that keep their own state of each row, advanced by one token per call (classifier-free guidance runs
#: its own forward pass and cache; the SynthID watermark keeps each row's last tokens), with the option that adds them.
_ONE_TOKEN_PER_CALL = ((UnbatchedClassifierFreeGuidanceLogitsProcessor, "guidance_scale"),
                       (SynthIDTextWatermarkLogitsProcessor, "watermarking_config"))


def _check_hooked_inputs(logits_processor: Any, stopping_criteria: Any) -> None:
    for proc in logits_processor or ():
        if isinstance(proc, TrieLogitsProcessor):
            raise ConstraintConfigError(
                "fast_forward_generate masks with its own trie state: pass trie= instead of a TrieLogitsProcessor "
                "in logits_processor"
            )
    for crit in stopping_criteria or ():
        if not isinstance(crit, (MaxLengthCriteria, EosTokenCriteria, MaxTimeCriteria, StopStringCriteria)):
            raise ConstraintConfigError(
                f"fast_forward_generate supports max_length/max_new_tokens, eos_token_id, max_time and stop_strings as "
                f"stopping criteria, not {type(crit).__name__}: use generate(logits_processor=[TrieLogitsProcessor(...)])"
            )


def _check_one_token_per_call(logits_processor: Any) -> None:
    """Refuse the processors (:data:`_ONE_TOKEN_PER_CALL`) that the fast path, which feeds several tokens per step and
    asks about some rows only, would give other tokens than ``generate`` (token by token they work)."""
    for proc in logits_processor or ():
        for kind, option in _ONE_TOKEN_PER_CALL:
            if isinstance(proc, kind):
                raise ConstraintConfigError(
                    f"fast_forward_generate feeds several tokens per step and some rows only, and {kind.__name__} "
                    f"(from {option}= or given in logits_processor) expects every row and one token per call: "
                    f"use model.generate(..., {option}=..., logits_processor=[TrieLogitsProcessor(...)])"
                )


def _check_stop_strings(stop_strings: Union[str, Sequence[str], None], tokenizer: Any, hooked: bool,
                        what: str = "stop_strings") -> None:
    """Refuse stop strings without the tokenizer they are found with.

    ``stop_strings`` are a parameter of :func:`fast_forward_generate`, not left to ``generate``, because ``generate``
    drops its ``tokenizer=`` before calling a callable ``custom_generate`` and then fails on stop strings with
    "could not locate a tokenizer" although one was given; declared, they are handed to the hook instead.

    Raises:
        ConstraintConfigError: stop strings without a tokenizer, naming the calls that carry one.
    """
    if stop_strings and tokenizer is None:
        where = ("generate(custom_generate=fast_forward_generate, tokenizer=...) keeps its tokenizer from the hook: call "
                 "fast_forward_generate(model, ..., stop_strings=..., tokenizer=tokenizer) directly, or bind it: "
                 "generate(..., custom_generate=functools.partial(fast_forward_generate, tokenizer=tokenizer))"
                 if hooked else "pass tokenizer= too")
        raise ConstraintConfigError(f"{what} need the tokenizer (to find them in the tokens); {where}")


# ---------------------------------------------------------------------------------------------------- the loop
class _Run:
    """State of one fast-forward generation. All per-row bookkeeping that the forward pass needs is in tensors;
    the ragged blocks are short host lists (one per row) because the forced runs come from the host-side trie."""

    def __init__(
        self,
        model: Any,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        cache: Any,
        constraint: TrieConstraint,
        groups: torch.Tensor,
        tails: Optional[torch.Tensor],
        config: GenerationConfig,
        processors: LogitsProcessorList,
        stop_ids: list[int],
        pad_id: int,
        max_new: int,
        generator: Optional[torch.Generator],
        streamer: Any = None,
        string_stops: Sequence[Any] = (),
    ) -> None:
        self.model, self.cache, self.constraint = model, cache, constraint
        self.string_stops = list(string_stops)  # StopStringCriteria: checked after every token, forced ones too
        self.streamer = streamer  # gets each committed block of the one row (generate put the prompt)
        self.window = sliding_window_slots(cache)
        self.device = input_ids.device
        b, p = input_ids.shape
        self.b, self.p = b, p
        self.input_ids = input_ids
        self.attn = attention_mask.long() if attention_mask is not None else torch.ones_like(input_ids)
        self.padded = bool((self.attn == 0).any())  # once True, the 2-D mask is always passed
        self.next_pos = self.attn.sum(1)  # (B,) position of each row's next token
        self.generator = generator
        self.before, self.after = around_user_processors(processors)
        self.batch_state = holds_batch_state(self.before, b)
        self.after_batch_state = holds_batch_state(self.after, b)
        self.stop_set = set(stop_ids)
        self.pad_id, self.max_new, self.max_time = pad_id, max_new, config.max_time
        self.do_sample = bool(config.do_sample)
        self.want_scores = bool(config.return_dict_in_generate and config.output_scores)
        self.want_logits = bool(config.return_dict_in_generate and config.output_logits)
        self.trig = constraint.rules.trigger_len
        # (B, t) last tokens, for triggers; a prompt shorter than the trigger padded with -1 (a copy: _tails writes it)
        self.hist = tails.clone() if self.trig else None
        self.state = constraint.start(b, groups, self.hist)
        self.gen = torch.full((b, max(max_new, 1)), pad_id, dtype=torch.long, device=self.device)
        self.n_gen = [0] * b
        self.decided = [0] * b
        self.finished = [max_new <= 0] * b
        self.batch_rows = list(range(b))  # original row of each row of the model batch (and of the cache)
        self.passes = 0
        self.keep_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.cache_name = cache_input_name(model)
        self.pieces: list[tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]] = []
        self.next_logits: Optional[torch.Tensor] = None  # (len(batch_rows), V) logits for the next decision

    # -- 1. decide ------------------------------------------------------------------------------------------------
    def _current_ids(self, rows: list[int], n: int) -> torch.Tensor:
        """The rows' tokens so far for logits processors: the prompt and the first ``n`` generated tokens. Shape:
        (R, P + n)."""
        idx = torch.tensor(rows, device=self.device)
        return torch.cat([self.input_ids[idx], self.gen[idx, :n]], dim=1)

    def decide(self, blocks: list[list[int]]) -> None:
        rows = [r for r in self.batch_rows if not self.finished[r]]
        pos = torch.tensor([self.batch_rows.index(r) for r in rows], device=self.device)
        idx = torch.tensor(rows, device=self.device)
        raw = self.next_logits[pos].float()
        state = self.state.select(idx)
        # raw is already a copy (advanced indexing); keep it unmasked only when raw logits are returned.
        scores = self._process(rows, raw.clone() if self.want_logits else raw, state, [self.n_gen[r] for r in rows])
        if self.do_sample:
            probs = torch.softmax(scores, dim=-1)
            tokens = torch.multinomial(probs, 1, generator=self.generator).squeeze(1)
        else:
            tokens = torch.argmax(scores, dim=-1)
        self._record(idx, torch.tensor([self.n_gen[r] for r in rows], device=self.device), scores, raw)
        self.state.assign(idx, self.constraint.advance(state, tokens, self._tails(idx, tokens)))
        for r, tok in zip(rows, tokens.tolist()):
            blocks[r].append(tok)
            self.decided[r] += 1

    def _process(self, rows: list[int], scores: torch.Tensor, state: RowState, at: list[int]) -> torch.Tensor:
        """The logits processors in ``generate``'s order (:func:`~.transformers_internals.around_user_processors`):
        its own processors and a user's, the trie mask (where ``generate`` runs a user's ``TrieLogitsProcessor``),
        then the sampling warpers, a watermark and normalization. ``at``: each row's generated tokens before the
        scored one."""
        scores = self._at_lengths(self.before, self.batch_state, rows, scores, at)
        scores = self.constraint.mask_(scores, state)
        return self._at_lengths(self.after, self.after_batch_state, rows, scores, at)

    def _at_lengths(self, processors: LogitsProcessorList, batch_state: bool, rows: list[int], scores: torch.Tensor,
                    at: list[int]) -> torch.Tensor:
        """``processors`` on each row's tokens before the scored one, as ``generate``'s rows would be.

        A processor may read the tokens so far (repetition penalty, min_new_tokens, a watermark, a user's).
        Fast-forward's rows are at different lengths, so they run once per length, on the rows at that length; a
        processor holding per-row state made for the whole batch (5.24's repetition penalty,
        :func:`~.transformers_internals.holds_batch_state`) runs on the whole batch at that length, and only those
        rows are kept."""
        if not processors:
            return scores
        groups: dict[int, list[int]] = {}
        for i, n in enumerate(at):
            groups.setdefault(n, []).append(i)
        whole = None
        for n, pos in groups.items():
            if len(pos) == len(rows) and (not batch_state or rows == list(range(self.b))):  # one call
                scores = processors(self._current_ids(rows, n), scores)
                continue
            sel, idx = torch.tensor(pos, device=self.device), [rows[i] for i in pos]
            if not batch_state:
                scores[sel] = processors(self._current_ids(idx, n), scores[sel])
                continue
            if whole is None:
                whole = scores.new_zeros((self.b, scores.shape[1]))
            whole[idx] = scores[sel]
            scores[sel] = processors(self._current_ids(list(range(self.b)), n), whole)[idx]
        return scores

    def _tails(self, idx: torch.Tensor, tokens: torch.Tensor, valid: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """Update the trigger history of rows ``idx`` with ``tokens`` (where ``valid``) and return it."""
        if not self.trig:
            return None
        hist = self.hist[idx]
        new = torch.cat([hist[:, 1:], tokens.unsqueeze(1)], dim=1)
        if valid is not None:
            new = torch.where(valid.unsqueeze(1), new, hist)
        self.hist[idx] = new
        return new

    def _record(self, idx: torch.Tensor, gen_pos: torch.Tensor, scores: torch.Tensor, raw: torch.Tensor) -> None:
        if self.want_scores or self.want_logits:
            self.pieces.append(
                (idx, gen_pos, scores if self.want_scores else None, raw.clone() if self.want_logits else None)
            )

    # -- 2. fast-forward ------------------------------------------------------------------------------------------
    def fast_forward(self, blocks: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor, RowState]]:
        """Append every unfinished row's forced run to its block, advancing its state.

        Returns, per forced column, (original rows, their block index, their state before the token): what the
        scores of the forced tokens are computed from once the forward pass has produced their logits.
        """
        columns: list[tuple[torch.Tensor, torch.Tensor, RowState]] = []
        rows = [r for r in range(self.b) if not self.finished[r] and not self._stops(blocks[r])]
        # A separator or a fired trigger can lead to a new forced run, so repeat until nothing is forced.
        while rows:
            idx = torch.tensor(rows, device=self.device)
            state = self.state.select(idx)
            runs = self.constraint.forced_tokens(state, self.max_new)
            runs = [run[: max(self.max_new - self.n_gen[r] - len(blocks[r]), 0)] for r, run in zip(rows, runs)]
            width = max(len(run) for run in runs)
            if width == 0:
                break
            padded = torch.tensor([run + [self.pad_id] * (width - len(run)) for run in runs], device=self.device)
            lengths = torch.tensor([len(run) for run in runs], device=self.device)
            starts = torch.tensor([len(blocks[r]) for r in rows], device=self.device)
            for k in range(width):
                valid = lengths > k
                if self.want_scores or self.want_logits:
                    columns.append((idx[valid], (starts + k)[valid], state.select(valid.nonzero().squeeze(1))))
                new = self.constraint.advance(state, padded[:, k], self._tails(idx, padded[:, k], valid))
                state = _where_state(valid, new, state)
            self.state.assign(idx, state)
            for r, run in zip(rows, runs):
                blocks[r].extend(run)
            if not (self.constraint.rules.on_complete == "repeat" or self.trig or self.constraint.rules.fields):
                break
            rows = [r for r, run in zip(rows, runs) if run and not self._stops(blocks[r])]
        return columns

    def _stops(self, block: list[int]) -> bool:
        return bool(block) and block[-1] in self.stop_set

    # -- 3. commit ------------------------------------------------------------------------------------------------
    def commit(self, blocks: list[list[int]]) -> list[int]:
        """Cut blocks after the first stop token or stop string, write them out; return the block starts. (Blocks
        are within max_new_tokens already: :meth:`fast_forward` cuts each forced run to the row's room.)"""
        starts = list(self.n_gen)
        string_ends = self._string_stops(blocks) if self.string_stops else {}
        for r in range(self.b):
            block = blocks[r]
            if self.finished[r] or not block:
                continue
            stop = next((i for i, tok in enumerate(block) if tok in self.stop_set), None)
            if r in string_ends and (stop is None or string_ends[r] < stop):
                stop = string_ends[r]
            if stop is not None:
                del block[stop + 1 :]
                self.finished[r] = True
            n = len(block)
            self.gen[r, self.n_gen[r] : self.n_gen[r] + n] = torch.tensor(block, device=self.device)
            self.n_gen[r] += n
            if self.streamer is not None and n:
                self.streamer.put(torch.tensor(block))
            if self.n_gen[r] >= self.max_new:
                self.finished[r] = True
        return starts

    def _string_stops(self, blocks: list[list[int]]) -> dict[int, int]:
        """Each unfinished row's first block index after which a stop string has been written, where there is one.

        ``generate`` asks its ``StopStringCriteria`` after every token, on the row so far (prompt, left pads
        included, and generated tokens); a block holds several tokens (a decision and its forced run), so every
        prefix of it is asked, batched by length (the criterion reads the last ``maximum_token_len`` tokens)."""
        width = max((getattr(crit, "maximum_token_len", 0) for crit in self.string_stops), default=0)
        by_length: dict[int, list[tuple[int, int, list[int]]]] = {}
        for r, block in enumerate(blocks):
            if self.finished[r] or not block:
                continue
            before = self._current_ids([r], self.n_gen[r])[0].tolist()
            if width:
                before = before[-width:]
            tokens = before + block
            for i in range(len(block)):
                end = len(before) + i + 1
                window = tokens[max(0, end - width) if width else 0 : end]
                by_length.setdefault(len(window), []).append((r, i, window))
        found: dict[int, int] = {}
        for group in by_length.values():
            ids = torch.tensor([window for _, _, window in group], dtype=torch.long, device=self.device)
            hit = torch.zeros(len(group), dtype=torch.bool, device=self.device)
            for crit in self.string_stops:
                hit |= crit(ids, None).to(self.device)
            for (r, i, _), stopped in zip(group, hit.tolist()):
                if stopped and i < found.get(r, len(blocks[r])):
                    found[r] = i
        return found

    # -- 4. feed --------------------------------------------------------------------------------------------------
    def feed(self, blocks: list[list[int]], first: bool, columns: list, starts: list[int]) -> bool:
        """One forward pass over the batch rows' new tokens; False when nothing needed feeding."""
        need_forced_logits = self.want_scores or self.want_logits
        feeds: dict[int, list[int]] = {}
        keep = []  # rows the pass serves: unfinished ones, and those whose forced tokens' logits it gives
        for r in self.batch_rows:
            feeds[r] = []  # a row the cache cannot drop stays in the batch, fed nothing
            if not self.finished[r]:
                feeds[r] = blocks[r]
            elif need_forced_logits and len(blocks[r]) > 1 - int(first):
                # Only the logits of its forced tokens are still needed (the prefill gives the first block's first).
                feeds[r] = blocks[r][:-1]
            else:
                continue
            keep.append(r)
        # Rows with nothing to feed leave the batch (and the cache, once there is one) before the pass.
        if first:
            self.batch_rows = keep
        else:
            self._prune(keep)
        rows = self.batch_rows
        if not rows:
            return False
        width = max(len(feeds[r]) for r in rows)
        if width == 0 and not first:
            return False
        idx = torch.tensor(rows, device=self.device)
        tokens = torch.tensor([feeds[r] + [self.pad_id] * (width - len(feeds[r])) for r in rows], dtype=torch.long, device=self.device).reshape(len(rows), width)
        lengths = torch.tensor([len(feeds[r]) for r in rows], device=self.device)
        valid = torch.arange(width, device=self.device).unsqueeze(0) < lengths.unsqueeze(1)  # (R, L)
        if width and not bool(valid.all()):
            self.padded = True
        positions = self.next_pos[idx].unsqueeze(1) + torch.arange(width, device=self.device).unsqueeze(0)
        if first:
            attn = self.attn[idx]
            prompt_pos = (attn.cumsum(1) - 1).clamp(min=0)
            tokens = torch.cat([self.input_ids[idx], tokens], dim=1)
            positions = torch.cat([prompt_pos, positions], dim=1)
            self.attn = torch.cat([attn, valid.long()], dim=1)
        else:
            self.attn = torch.cat([self.attn, valid.long()], dim=1)
        if self.window is not None and self.attn.shape[1] > self.window:
            raise ConstraintConfigError(
                f"fast_forward_generate: the cache would hold {self.attn.shape[1]} slots (prompt, generated tokens and "
                f"the pad slots of ragged blocks), more than the model's sliding window keeps ({self.window}); "
                "generate fewer tokens, or use generate(logits_processor=[TrieLogitsProcessor(...)])"
            )
        self.next_pos[idx] += lengths
        offset = self.p if first else 0  # input index of block token 0
        # Input indices whose logits are needed: each unfinished row's last fed token (its next decision), and,
        # for scores, the token before each forced token.
        last = offset + lengths - 1
        lowest = int(last.min())
        forced_pos = [int(c[1].min()) for c in columns if c[1].numel()] if need_forced_logits else []
        if forced_pos:
            lowest = min(lowest, offset - 1 + min(forced_pos))
        total = tokens.shape[1]
        keep = total - max(lowest, 0)
        kwargs: dict[str, Any] = dict(
            input_ids=tokens,
            attention_mask=self.attn if self.padded else None,
            position_ids=positions,
            use_cache=True,
        )
        kwargs[self.cache_name] = self.cache
        if self.keep_logits:
            kwargs["logits_to_keep"] = keep
        out = self.model(**kwargs, return_dict=True)
        self.passes += 1
        returned = output_cache(out)
        if returned is not None:
            self.cache = returned
        logits = out.logits  # (R, keep or total, V)
        base = total - logits.shape[1]
        row_of = {r: i for i, r in enumerate(rows)}
        self.next_logits = logits[torch.arange(len(rows), device=self.device), (last - base).clamp(min=0)]
        if need_forced_logits:
            self._forced_scores(logits, base, offset, row_of, columns, starts)
        return True

    def _forced_scores(self, logits, base, offset, row_of, columns, starts) -> None:
        """Scores of the forced tokens, from the logits of the pass that consumed the token before each; only of
        those committed (a stop token or a stop string can cut a block inside its forced run)."""
        for rows, block_pos, state in columns:
            keep = [i for i, (r, k) in enumerate(zip(rows.tolist(), block_pos.tolist())) if starts[r] + k < self.n_gen[r]]
            if not keep:
                continue
            sel = torch.tensor(keep, device=self.device)
            rows, block_pos = rows[sel], block_pos[sel]
            state = state.select(sel)
            batch_idx = torch.tensor([row_of[r] for r in rows.tolist()], device=self.device)
            raw = logits[batch_idx, offset + block_pos - 1 - base].float()
            gen_pos = torch.tensor([starts[r] for r in rows.tolist()], device=self.device) + block_pos
            scores = self._process(rows.tolist(), raw.clone(), state, gen_pos.tolist())
            self._record(rows, gen_pos, scores, raw)

    def _prune(self, keep_rows: list[int]) -> None:
        if keep_rows == self.batch_rows:
            return
        keep = torch.tensor([self.batch_rows.index(r) for r in keep_rows], dtype=torch.long, device=self.device)
        if keep_rows and drop_cache_rows(self.cache, keep):
            self.attn = self.attn[keep]
            if self.next_logits is not None:
                self.next_logits = self.next_logits[keep]
            self.batch_rows = keep_rows
        elif not keep_rows:
            self.batch_rows = []

    # -- results --------------------------------------------------------------------------------------------------
    def sequences(self) -> torch.Tensor:
        g = max(self.n_gen) if self.n_gen else 0
        return torch.cat([self.input_ids, self.gen[:, :g]], dim=1)

    def stacked(self, which: int) -> Optional[tuple[torch.Tensor, ...]]:
        pieces = [p for p in self.pieces if p[which] is not None]
        g = max(self.n_gen) if self.n_gen else 0
        if not pieces or g == 0:
            return None
        width = pieces[0][which].shape[1]
        out = torch.full((g, self.b, width), float("-inf"), device=self.device)
        for rows, gen_pos, *vals in pieces:  # committed tokens only (_forced_scores)
            out[gen_pos, rows] = vals[which - 2]
        return tuple(out.unbind(0))

    def run(self) -> None:
        t0 = time.perf_counter()
        first = True
        while True:
            blocks: list[list[int]] = [[] for _ in range(self.b)]
            if not first:
                self.decide(blocks)
            columns = self.fast_forward(blocks)
            starts = self.commit(blocks)
            if not self.feed(blocks, first, columns, starts):
                break
            first = False
            if all(self.finished):
                break
            if self.max_time is not None and time.perf_counter() - t0 > self.max_time:
                break


# ---------------------------------------------------------------------------------------------------- public
#: How a template gets its tokenizer here: ``generate(custom_generate=fast_forward_generate, tokenizer=...)`` keeps
#: ``tokenizer=`` from the hook, so "pass tokenizer=" alone would not do.
_TEMPLATE_FIX = ("call template.build(tokenizer, {end}) once before generate, or give fast_forward_generate the "
                 "tokenizer: fast_forward_generate(model, ..., tokenizer=tokenizer), or through generate (which keeps "
                 "its own tokenizer= from the hook) custom_generate=functools.partial(fast_forward_generate, "
                 "tokenizer=tokenizer)")


def _processor(trie: Optional[TrieArg], template: Optional[Template], tokenizer: Any, end: int, on_complete: str,
               separator: Any, trigger: Any, allow: Any, deny: Any, rows: int, per_prompt: int) -> TrieLogitsProcessor:
    """The options as a :class:`TrieLogitsProcessor`, with its checks (a template combines with none of
    on_complete, separator, trigger, allow, deny): the general path decodes with it, the fast path reads its tries,
    rules and constraint. Filters are decoded as the filtered tries (their forced runs are the filtered trie's),
    for ``rows`` rows, ``per_prompt`` of each prompt (per-prompt tries and filters give one per prompt)."""
    if template is not None and tokenizer is None:  # refused with this function's own ways to give a tokenizer
        template.prebuilt(end, fix=_TEMPLATE_FIX)
    if isinstance(trie, (LiveCatalog, CatalogSnapshot)):
        raise ConstraintConfigError(
            "fast_forward_generate decodes tries, not a live catalog: pass trie=catalog.compact() (its entries now, "
            "as one trie), or constrain generate with logits_processor=[TrieLogitsProcessor(catalog, tokenizer)]")
    if template is None:
        trie = as_tries(trie, TokenTrie, tokenizer, "trie")
        check_prompts(rows, per_prompt, {"trie": len(trie), "allow/deny": prompt_filters(allow, deny)})
        if allow is not None or deny is not None:
            trie = filtered_tries(trie, allow, deny, on_complete, rows)
            allow = deny = None
    return TrieLogitsProcessor(trie, tokenizer, template=template, end_token_id=end, on_complete=on_complete,
                               separator=separator, trigger=trigger, allow=allow, deny=deny)


def _general_path(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    processor: TrieLogitsProcessor,
    processors: Optional[LogitsProcessorList],
    stopping_criteria: Any,
    config: GenerationConfig,
    model_kwargs: dict[str, Any],
    hooked: bool,
    string_stops: Sequence[Any] = (),
    tokenizer: Any = None,
) -> Union[FastForwardOutput, torch.Tensor]:
    """Token-by-token decoding with ``processor``, for a transformers whose ``custom_generate`` convention this
    module was not checked against (:mod:`.transformers_internals`): the same tokens, one pass per token.

    Called by ``generate`` (``hooked``: ``processors`` and ``stopping_criteria`` are the prepared ones), it runs the
    sampling loop ``generate`` would have run, with the trie processor placed before the sampling warpers; called
    directly (``processors`` and ``stopping_criteria``: the caller's own, or None), it calls ``model.generate`` with
    them and the trie processor after the caller's processors. ``string_stops``: the stop strings' criteria, for the
    direct call; ``tokenizer``: for the stop strings of ``config`` (the direct call hands it to ``generate``).
    """
    if not verified():
        warn_unverified("fast_forward_generate (token by token, no fast-forward)")
    if not hooked:
        _check_hooked_inputs(processors, None)  # token by token, any stopping criterion works
        criteria = [*(stopping_criteria or ()), *string_stops]
        if criteria:
            model_kwargs = {**model_kwargs, "stopping_criteria": StoppingCriteriaList(criteria)}
        if config.stop_strings and tokenizer is not None:
            model_kwargs = {**model_kwargs, "tokenizer": tokenizer}
        out = model.generate(input_ids, attention_mask=attention_mask, generation_config=config,
                             logits_processor=LogitsProcessorList([*(processors or ()), processor]), **model_kwargs)
    else:
        sample = getattr(model, "_sample", None)
        if sample is None:
            raise ConstraintConfigError(
                "fast_forward_generate cannot run inside this transformers' generate (it has no sampling loop to fall "
                "back to): call model.generate(..., logits_processor=[TrieLogitsProcessor(trie, tokenizer)]) instead"
            )
        before, after = around_user_processors(processors)
        merged = LogitsProcessorList([*before, processor, *after])
        if attention_mask is not None:
            model_kwargs = {**model_kwargs, "attention_mask": attention_mask}
        out = sample(input_ids, logits_processor=merged, stopping_criteria=stopping_criteria,
                     generation_config=config, synced_gpus=False, streamer=None, **model_kwargs)
    sequences = out if isinstance(out, torch.Tensor) else out.sequences
    generated = sequences.shape[1] - input_ids.shape[1]
    stats = FastForwardStats(forward_passes=generated, tokens_emitted=generated * sequences.shape[0],
                             decisions=generated * sequences.shape[0], step_by_step_passes=generated)
    if isinstance(out, torch.Tensor):
        out.stats = stats
        return out
    return FastForwardOutput(sequences=sequences, scores=getattr(out, "scores", None),
                             logits=getattr(out, "logits", None), stats=stats)


@torch.no_grad()
def fast_forward_generate(
    model: Any,
    input_ids: torch.Tensor,
    logits_processor: Optional[LogitsProcessorList] = None,
    stopping_criteria: Any = None,
    generation_config: Optional[GenerationConfig] = None,
    *,
    trie: Optional[TrieArg] = None,
    template: Optional[Template] = None,
    tokenizer: Any = None,
    end_token_id: Optional[int] = None,
    on_complete: str = "eos",
    separator: Any = None,
    trigger: Any = None,
    allow: Any = None,
    deny: Any = None,
    stop_strings: Union[str, Sequence[str], None] = None,
    generator: Optional[torch.Generator] = None,
    tries: Any = None,
    spans: Any = None,
    check_prompt: Any = None,
    distinct: Any = None,
    max_entries: Any = None,
    **kwargs: Any,
) -> Union[FastForwardOutput, torch.Tensor]:
    r"""Constrained generation that feeds each trie-forced run through the model in the same pass as its decision.

    Two ways to call it:

    * as transformers' callable hook: ``model.generate(**inputs, custom_generate=fast_forward_generate,
      trie=trie, max_new_tokens=..., do_sample=...)``; ``generate`` validates the options, expands
      ``num_return_sequences``, builds the logits processors (temperature, top-k, top-p, ...) and the cache,
      then calls this function;
    * as a plain function: ``fast_forward_generate(model, input_ids, attention_mask=..., trie=trie,
      max_new_tokens=..., do_sample=..., temperature=...)``, which is that hook call: ``generate`` takes every
      option it knows (``GenerationConfig`` fields, ``logits_processor``), the trie options are bound to the hook
      (``tokenizer=`` included).

    The output is the one ``generate(logits_processor=[TrieLogitsProcessor(trie, ...)])`` would give: with greedy
    decoding, the same tokens (up to float differences of batched vs one-token forward passes, which can only
    matter on exact near-ties), padded with the pad token after each row's end.

    Args:
        model: a transformers decoder-only LM whose cache is a ``DynamicCache``. With sliding-window layers
            (Gemma 3), prompt + generated tokens + pad slots must fit in the window (checked: a named error).
        input_ids: the prompts, left-padded. Shape: (B, P), int64.
        logits_processor, stopping_criteria, generation_config: supplied by ``generate`` when used as the hook.
            Supported stopping criteria: max length / ``max_new_tokens``, EOS, ``max_time`` and stop strings.
        trie (`TokenTrie` or list): one trie for every row, or one per prompt.
        template (:class:`~trie_decode.Template`, optional): instead of ``trie``, the whole output as fixed text with
            catalog-valued slots; its fixed text is forced, so it is fed without decisions. It needs ``tokenizer``,
            or (through the hook, where ``generate`` keeps ``tokenizer=``) a ``template.build(tok, eos)`` beforehand.
        tokenizer (optional): checks the tries' fingerprints and tokenizes ``separator``/``trigger`` given as text.
            ``generate`` consumes its own ``tokenizer=`` argument before calling the hook, so through the hook
            pass token ids for ``separator``/``trigger``.
        end_token_id (`int`, optional): ends an entry; defaults to the tokenizer's EOS, else the generation
            config's first EOS id.
            Generation stops at the EOS ids, as ``generate``'s does: to stop at another end token, pass it as
            ``eos_token_id=`` too (otherwise it is repeated to ``max_new_tokens``, as with the processor). No entry
            may hold an EOS id before its last token (refused before the prefill, as by the processor:
            ``TrieLogitsProcessor.check_stop_ids``).
        on_complete (`str`, defaults to ``"eos"``), separator, trigger: as for
            :class:`~trie_decode.integrations.transformers.TrieLogitsProcessor`.
        allow, deny (optional): entries a row may / may not use, as for
            :class:`~trie_decode.integrations.transformers.TrieLogitsProcessor`: entry keys or indices, one spec for
            every row or one per prompt. Each distinct filter decodes as the trie of the entries it leaves
            (:func:`trie_decode.filters.filtered_tries`, built once per call, O(entries)), so its forced runs are
            the filtered trie's: a node with one usable child forces it. A filter that leaves a prompt no entry is
            an error here (over a shared trie the processor lets such rows only end). For per-request filters over
            a catalog of millions, the processor, which filters a shared trie without a rebuild, starts faster.
        stop_strings (`str` or list of `str`, optional): end a row once its text ends with one of them, as
            ``generate(stop_strings=..., tokenizer=...)`` does (its ``StopStringCriteria``, asked after every token,
            forced ones included). Needs ``tokenizer``: ``generate`` keeps its own ``tokenizer=`` from a callable
            ``custom_generate``, so through the hook bind it
            (``custom_generate=functools.partial(fast_forward_generate, tokenizer=tok)``) or call this function.
        generator (`torch.Generator`, optional): the random source of sampling.
        tries, spans, check_prompt, distinct, max_entries: options of ``TrieLogitsProcessor`` this function does not
            take, refused by name; parameters so that ``generate`` hands them to the hook (it refuses keywords that
            are not as model kwargs the model does not use, naming no fix).
        kwargs: ``attention_mask`` (Shape: (B, P)), and on the plain path any ``generate`` option
            (``max_new_tokens``, ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``repetition_penalty``,
            ``output_scores``, ``output_logits``, ``return_dict_in_generate``, ``eos_token_id``, ``streamer`` (one
            prompt: it gets each block of tokens as it is committed), ...).

    Returns:
        With ``return_dict_in_generate``, a :class:`FastForwardOutput` (``sequences``, ``scores``, ``logits``,
        ``stats``); otherwise the sequences (Shape: (B, P + G), int64) with the :class:`FastForwardStats` attached
        as ``.stats`` (an attribute of that tensor object only: copies and slices do not carry it).

    Raises:
        ConstraintConfigError: beam search (use the processor instead), an unsupported stopping criterion, a
            ``TrieLogitsProcessor`` in ``logits_processor``, a cache or model input this loop cannot handle, an
            entry that holds an EOS id before its last token, ``stop_strings`` without ``tokenizer``, a live catalog
            (``trie=catalog.compact()`` decodes its entries now), ``guidance_scale`` or a SynthID watermark (their
            processors expect one token per call), an option of ``TrieLogitsProcessor`` it does not take.

    Examples:

    ```python
    >>> from transformers import AutoModelForCausalLM, AutoTokenizer
    >>> from trie_decode import TokenTrie
    >>> from trie_decode.integrations.smollm2 import smollm2_path
    >>> from trie_decode.integrations.fast_forward import fast_forward_generate
    >>> tok = AutoTokenizer.from_pretrained(smollm2_path())
    >>> model = AutoModelForCausalLM.from_pretrained(smollm2_path())
    >>> trie = TokenTrie.from_strings(["United Kingdom", "United States", "France"], tok)
    >>> prompt = tok.apply_chat_template([{"role": "user", "content": "Where is Texas? Answer with the name only."}],
    ...                                  tokenize=False, add_generation_prompt=True)
    >>> inputs = tok(prompt, return_tensors="pt")
    >>> out = model.generate(**inputs, custom_generate=fast_forward_generate, trie=trie, max_new_tokens=8,
    ...                      do_sample=False, return_dict_in_generate=True)
    >>> tok.decode(out.sequences[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    'United States'
    >>> out.stats.forward_passes < out.stats.tokens_emitted
    True
    ```
    """
    refused = dict(tries=tries, spans=spans, check_prompt=check_prompt, distinct=distinct, max_entries=max_entries)
    check_not_taken("fast_forward_generate", refused, ("tries",), "its trie is trie=", "pass trie=...")
    check_one_source("fast_forward_generate", {"trie": trie, "template": template},
                     hints={"trie": "a TokenTrie, or one per prompt"})
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ConstraintConfigError("input_ids must be a 2-D tensor of token ids (batch, prompt length)")
    hooked = logits_processor is not None and stopping_criteria is not None and generation_config is not None
    if hooked and tokenizer is None:
        text = [name for name, value in (("separator", separator), ("trigger", trigger)) if isinstance(value, str)]
        if text:  # generate keeps tokenizer= for itself, so it never reaches the hook
            raise ConstraintConfigError(
                f"{text[0]} given as text needs a tokenizer, and generate(custom_generate=fast_forward_generate, "
                f"tokenizer=...) keeps its tokenizer from the hook: pass {text[0]} as token ids, or call "
                "fast_forward_generate(model, ..., tokenizer=tokenizer) directly")
    check_no_distinct("fast_forward_generate", refused, "what a list may emit changes at every entry")
    check_not_taken("fast_forward_generate", refused, ("spans", "check_prompt"), "its constraint is trie= or template=",
                    "spans and the prompt check are model.generate(..., logits_processor=[TrieLogitsProcessor(...)])")
    base = generation_config if generation_config is not None else model.generation_config
    # A generation config with stop strings: generate drops tokenizer= before calling a callable custom_generate, so
    # it cannot find them and refuses the hook; the direct call then decodes token by token through generate.
    config_stops = not hooked and bool(getattr(base, "stop_strings", None))
    _check_stop_strings(stop_strings or (base.stop_strings if config_stops else None), tokenizer, hooked,
                        "stop_strings" if stop_strings else "the generation config's stop_strings")
    if not hooked and verified() and not config_stops:
        if tokenizer is None:  # text needs the tokenizer: refused as given to this call, before generate keeps it
            tokens_arg(separator, None, "separator"), tokens_arg(trigger, None, "trigger")
        # The plain call is the hook's: generate prepares the processors (repetition penalty, min_new_tokens,
        # renormalize_logits, the warpers ...), the stopping criteria and the cache from the options as for any
        # call, then calls back with them; the options it does not know ride in the bound hook.
        hook = functools.partial(fast_forward_generate, trie=trie, template=template, tokenizer=tokenizer,
                                 end_token_id=end_token_id, on_complete=on_complete, separator=separator,
                                 trigger=trigger, allow=allow, deny=deny, stop_strings=stop_strings,
                                 generator=generator)
        return model.generate(input_ids, generation_config=generation_config, logits_processor=logits_processor,
                              stopping_criteria=stopping_criteria, custom_generate=hook, **kwargs)
    # stop_strings as the criterion generate builds from them (none without stop strings)
    string_stops = [StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings)] if stop_strings else []
    attention_mask = kwargs.pop("attention_mask", None)
    streamer = generate_streamer() if hooked else None  # generate put the prompt into it, and keeps it from the hook
    if streamer is not None and input_ids.shape[0] != 1:
        raise ConstraintConfigError(f"fast_forward_generate streams one prompt ({input_ids.shape[0]} given; rows "
                                    "advance by different numbers of tokens per pass): call it without streamer")
    if hooked:
        config, model_kwargs = generation_config, kwargs
        stopping_criteria = StoppingCriteriaList([*stopping_criteria, *string_stops])
        _check_hooked_inputs(logits_processor, stopping_criteria)
    else:  # generate with the processor (_general_path): outside the verified transformers, or config_stops
        config = copy.deepcopy(base)
        model_kwargs = config.update(**kwargs)
        config.validate()
        if config_stops and stop_strings:  # they replace the config's, as generate(stop_strings=...) does
            config.stop_strings, string_stops = stop_strings, ()
    if (config.num_beams or 1) > 1:
        raise ConstraintConfigError(
            f"fast_forward_generate does not do beam search (num_beams={config.num_beams}, given or from the model's "
            "generation_config): pass num_beams=1, or for beam search use model.generate(..., num_beams=..., "
            "logits_processor=[TrieLogitsProcessor(trie, tokenizer)])"
        )
    eos_ids = eos_token_ids(config)
    end = end_token(end_token_id, tokenizer, eos_ids[0] if eos_ids else None)  # on both paths alike
    # Through the hook generate has repeated each prompt for its return sequences; the plain path's rows are prompts.
    processor = _processor(trie, template, tokenizer, end, on_complete, separator, trigger, allow, deny,
                           input_ids.shape[0], rows_per_prompt(config) if hooked else 1)
    # Both paths stop a row at the EOS ids only: an entry holding the end token, when it is one, is refused here.
    processor.check_stop_ids(eos_ids)
    if config_stops and verified():
        warn_token_by_token("the generation config has stop_strings, and generate, which drops tokenizer= before "
                            "calling a callable custom_generate, cannot find them. To fast-forward, set "
                            "generation_config.stop_strings = None and pass stop_strings=... to fast_forward_generate")
    if not verified() or config_stops:
        return _general_path(model, input_ids, attention_mask, processor, logits_processor, stopping_criteria, config,
                             model_kwargs, hooked, () if hooked else string_stops, tokenizer)
    max_length, processors = config.max_length, logits_processor
    _check_one_token_per_call(processors)
    unknown = set(model_kwargs) - _KNOWN_MODEL_KWARGS
    if unknown:
        raise ConstraintConfigError(f"fast_forward_generate does not handle these model inputs or output options: "
                                    f"{sorted(unknown)}; for them use model.generate(..., logits_processor="
                                    "[TrieLogitsProcessor(trie, tokenizer)])")
    if getattr(model.config, "is_encoder_decoder", False):
        raise ConstraintConfigError("fast_forward_generate supports decoder-only models, not encoder-decoders")

    caches = [model_kwargs[name] for name in CACHE_INPUT_NAMES if model_kwargs.get(name) is not None]
    cache = caches[0] if caches else DynamicCache(config=model.config)
    if not isinstance(cache, DynamicCache):
        raise ConstraintConfigError(f"fast_forward_generate needs a DynamicCache, got {type(cache).__name__}")
    window = sliding_window_slots(cache)
    if window is not None and max_length > window:
        raise ConstraintConfigError(
            f"fast_forward_generate: prompt ({input_ids.shape[1]}) + max_new_tokens ({max_length - input_ids.shape[1]}) "
            f"exceed the model's sliding window ({window} tokens kept); fast-forward's pad slots count against the "
            "window, so it runs only while everything fits in it: generate fewer tokens, or use "
            "generate(logits_processor=[TrieLogitsProcessor(...)])"
        )
    if cache.get_seq_length() > 0:
        raise ConstraintConfigError("fast_forward_generate starts from an empty cache; do not pass a filled one")

    # Forced tokens reach the model without a mask that would check the logits' width: check the trie against it.
    width = getattr(model.config, "vocab_size", None)
    if isinstance(width, int):
        InvalidTokenError.check_logits_width(width, processor.constraint(input_ids.device).needed_width)
    # generate stops at its EOS only: an end token that is not one is written as generate writes it (repeated).
    stop_ids = sorted(set(eos_ids))
    pad_id = first_eos(config.pad_token_id)
    if pad_id is None:
        pad_id = eos_ids[0] if eos_ids else processor.rules.end_token_id

    # With a template every row starts at the template's start (its tree is the slot it is in, not its prompt's).
    groups = prompt_groups(input_ids.shape[0], 1 if template is not None else len(processor.tries), input_ids.device)
    constraint = processor.constraint(input_ids.device)
    run = _Run(
        model,
        input_ids,
        attention_mask,
        cache,
        constraint,
        groups,
        processor._trigger_tails(input_ids),
        config,
        processors,
        stop_ids,
        pad_id,
        max_length - input_ids.shape[1],
        generator,
        streamer,
        [crit for crit in stopping_criteria if isinstance(crit, StopStringCriteria)],
    )
    t0 = time.perf_counter()
    run.run()
    if streamer is not None:
        streamer.end()
    row_forced = [n - d for n, d in zip(run.n_gen, run.decided)]
    stats = FastForwardStats(
        forward_passes=run.passes,
        tokens_emitted=sum(run.n_gen),
        forced_tokens=sum(row_forced),
        decisions=sum(run.decided),
        step_by_step_passes=max(run.n_gen) if run.n_gen else 0,
        row_tokens=list(run.n_gen),
        row_forced=row_forced,
        seconds=time.perf_counter() - t0,
    )
    sequences = run.sequences()
    if config.return_dict_in_generate:
        return FastForwardOutput(
            sequences=sequences,
            scores=run.stacked(2) if run.want_scores else None,
            logits=run.stacked(3) if run.want_logits else None,
            stats=stats,
        )
    sequences.stats = stats
    return sequences
