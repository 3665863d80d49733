"""transformers integration: ``TrieLogitsProcessor`` for ``model.generate``, plus ``match``, ``rank`` and a
``prefix_allowed_tokens_fn`` drop-in.

Why this exists: ``model.generate(logits_processor=[TrieLogitsProcessor(trie, tokenizer)])`` is how most people
will constrain a model to a set of names or ids. transformers' own ``PrefixConstrainedLogitsProcessor`` calls a
Python function per row per step and walks the trie from the root each time; this processor keeps each row's trie
node as a tensor on the logits' device and masks all rows with a handful of tensor ops (see
:mod:`trie_decode.masking`).

Row state under beam search: transformers reorders rows between steps without telling the processor. Each row's
state is therefore keyed by its generated prefix: a 64-bit polynomial hash of (prompt index, generated tokens),
computed as one integer dot product over the batch. At each step a row finds its parent row of the previous step
by the hash of its prefix minus the last token, and advances the parent's state by that token.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from trie_decode.constraint import DONE, RowState, SpanRules, TrieConstraint
from trie_decode.entries import Entry
from trie_decode.errors import ConstraintConfigError
from trie_decode.trie import TokenTrie

try:
    from transformers import LogitsProcessor
except ImportError as exc:  # pragma: no cover - import guard
    raise ImportError("trie_decode.integrations.transformers needs transformers: pip install 'trie-decode[transformers]'") from exc

__all__ = ["TrieLogitsProcessor", "prefix_allowed_tokens_fn", "match", "match_all", "rank", "RankedEntry"]

TrieArg = Union[TokenTrie, Sequence[TokenTrie]]


def _tokens_arg(value: Any, tokenizer: Any, what: str) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        if tokenizer is None:
            raise ConstraintConfigError(f"{what} given as text needs a tokenizer; pass tokenizer= or token ids")
        ids = tokenizer(value, add_special_tokens=False)["input_ids"]
        if not ids:
            raise ConstraintConfigError(f"{what} {value!r} tokenizes to nothing")
        return tuple(int(i) for i in ids)
    if isinstance(value, int):
        return (int(value),)
    return tuple(value)


def build_rules(
    tokenizer: Any,
    end_token_id: Optional[int],
    on_complete: str,
    separator: Any,
    trigger: Any,
) -> SpanRules:
    """Span rules from user-facing options (text is tokenized with ``tokenizer``); shared with fast-forward."""
    if end_token_id is None:
        end_token_id = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        if isinstance(end_token_id, (list, tuple)):
            end_token_id = end_token_id[0] if end_token_id else None
        if end_token_id is None:
            raise ConstraintConfigError("no end token: pass end_token_id=, or a tokenizer that has an eos_token_id")
    return SpanRules(
        end_token_id=int(end_token_id),
        on_complete=on_complete,
        separator=_tokens_arg(separator, tokenizer, "separator"),
        trigger=_tokens_arg(trigger, tokenizer, "trigger"),
    )


def _as_tries(tries: TrieArg, tokenizer: Any) -> list[TokenTrie]:
    if isinstance(tries, TokenTrie):
        tries = [tries]
    tries = list(tries)
    if not tries:
        raise ConstraintConfigError("tries is empty: pass one TokenTrie, or one per prompt")
    for i, t in enumerate(tries):
        if not isinstance(t, TokenTrie):
            raise TypeError(f"tries[{i}] is {type(t).__name__}, not a TokenTrie")
        if tokenizer is not None:
            t.check_tokenizer(tokenizer)
    return tries


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


class TrieLogitsProcessor(LogitsProcessor):
    r"""Constrain generation to the entries of a token trie (one trie for all prompts, or one per prompt).

    Works with greedy search, sampling, beam search, ``num_return_sequences``, and left-padded batches. Scores
    may be raw logits or log-probs, and may be wider than the trie's vocabulary (padded embeddings). The
    constrained span starts where generation starts (or after ``trigger``); a new ``generate`` call starts afresh
    even when the same instance is reused.

    Args:
        tries (`TokenTrie` or list of `TokenTrie`):
            One trie for every row, or one per prompt (rows of beams / return sequences map back to their prompt).
        tokenizer (optional):
            The model's tokenizer: checks every trie's vocabulary fingerprint, supplies the default end token
            (``eos_token_id``) and tokenizes ``trigger``/``separator`` given as text.
        end_token_id (`int`, *optional*):
            The token that ends an entry, and the fallback allowed token of any row with nothing else. Defaults to
            the tokenizer's EOS.
        on_complete (`str`, defaults to ``"eos"``):
            ``"eos"``: the end token is forced after an entry; ``"release"``: generation continues unconstrained;
            ``"repeat"``: entries separated by ``separator`` until the end token.
        separator (`str` or token ids, *optional*): used by ``"repeat"``.
        trigger (`str` or token ids, *optional*): the constraint starts only after this token sequence.

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
        tries: TrieArg,
        tokenizer: Any = None,
        *,
        end_token_id: Optional[int] = None,
        on_complete: str = "eos",
        separator: Any = None,
        trigger: Any = None,
    ) -> None:
        self.tries = _as_tries(tries, tokenizer)
        self.rules = build_rules(tokenizer, end_token_id, on_complete, separator, trigger)
        self._constraints: dict[str, TrieConstraint] = {}
        self._hasher = _PrefixHasher()
        self.reset()

    def reset(self) -> None:
        """Forget all rows; the next call starts a new generation (also detected automatically)."""
        self._state: Optional[RowState] = None
        self._hashes: Optional[torch.Tensor] = None
        self._groups: Optional[torch.Tensor] = None
        self._start = 0
        self._last_len = -1
        self.steps = 0

    def constraint(self, device: torch.device) -> TrieConstraint:
        """The :class:`TrieConstraint` on ``device`` (built once per device)."""
        key = str(device)
        if key not in self._constraints:
            self._constraints[key] = TrieConstraint(self.tries, self.rules, device)
        return self._constraints[key]

    @property
    def generation_start(self) -> int:
        """Length of ``input_ids`` at the first call of the current generation (where the span starts)."""
        return self._start

    def _row_groups(self, batch: int, device: torch.device) -> torch.Tensor:
        n = len(self.tries)
        if n == 1:
            return torch.zeros(batch, dtype=torch.long, device=device)
        if batch % n:
            raise ConstraintConfigError(
                f"{n} tries were given (one per prompt) but the batch has {batch} rows, not a multiple of {n}"
            )
        return torch.arange(batch, device=device) // (batch // n)

    def _trigger_tails(self, input_ids: torch.Tensor) -> Optional[torch.Tensor]:
        t = len(self.rules.trigger)
        return input_ids[:, -t:] if t else None

    def _begin(self, input_ids: torch.Tensor, device: torch.device) -> None:
        batch, cur = input_ids.shape
        constraint = self.constraint(device)
        self._groups = self._row_groups(batch, device)
        self._state = constraint.start(batch, self._groups, self._trigger_tails(input_ids))
        self._hashes = self._hasher.hash(self._groups, input_ids[:, :0])
        self._start = cur
        self.steps = 0

    def _follow(self, input_ids: torch.Tensor, device: torch.device) -> bool:
        """Advance every row from its parent row; False if the rows do not continue the previous call's rows."""
        batch, cur = input_ids.shape
        if self._state is None or cur != self._last_len + 1 or batch != len(self._state):
            return False
        ids = input_ids.to(device)
        prev = self._hasher.hash(self._groups, ids[:, self._start : cur - 1])
        constraint = self.constraint(device)
        if torch.equal(prev, self._hashes):  # rows did not move (greedy, sampling): no lookup needed
            state = constraint.advance(self._state, ids[:, -1], self._trigger_tails(ids))
        else:
            order = torch.argsort(self._hashes)
            sorted_hashes = self._hashes[order]
            pos = torch.searchsorted(sorted_hashes, prev).clamp(max=batch - 1)
            found = sorted_hashes[pos] == prev
            if not bool(found.any()):
                return False
            state = constraint.advance(self._state.select(order[pos]), ids[:, -1], self._trigger_tails(ids))
            # A row whose prefix was never seen (impossible in generate's own loops) may only end.
            state.node = torch.where(found, state.node, torch.full_like(state.node, DONE))
        self._state = state
        self._hashes = prev + ids[:, -1].long() * self._hasher.weights(cur - self._start, device)[-1]
        return True

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        device = scores.device
        if not self._follow(input_ids, device):
            self._begin(input_ids.to(device), device)
        self._last_len = input_ids.shape[1]
        self.steps += 1
        # Out of place: generate() keeps the tensor it passes in as the raw logits (output_logits=True).
        return self.constraint(device).mask_(scores, self._state, inplace=False)

    # ------------------------------------------------------------------ results
    def match(self, sequences: torch.Tensor, *, prompt_length: Optional[int] = None) -> list[Optional[Entry]]:
        """The entry each row generated (the first one, after the trigger if any), or None.

        Args:
            sequences: ``generate``'s output (prompt included). Shape: (B, L).
            prompt_length: where generation started (default: the last generation's start).
        """
        return [spans[0] if spans else None for spans in self.match_all(sequences, prompt_length=prompt_length)]

    def match_all(self, sequences: torch.Tensor, *, prompt_length: Optional[int] = None) -> list[list[Entry]]:
        """Every entry each row generated, in order (several in ``"repeat"`` mode or with a trigger)."""
        start = self._start if prompt_length is None else prompt_length
        batch = sequences.shape[0]
        groups = self._row_groups(batch, torch.device("cpu")).tolist()
        rows = sequences.tolist()
        return [
            replay_entries(self.tries[g], self.rules, row[start:], prompt_tail=row[:start]) for g, row in zip(groups, rows)
        ]


_IN_ENTRY, _FREE, _SEPARATOR = "entry", "free", "separator"


def replay_entries(trie: TokenTrie, rules: SpanRules, generated: Sequence[int], prompt_tail: Sequence[int] = ()) -> list[Entry]:
    """Host-side replay of the span rules over a generated row: the entries it completed, in order."""
    trigger = list(rules.trigger)
    t = len(trigger)
    history = list(prompt_tail[-t:]) if t else []
    phase = _IN_ENTRY if not t or history[-t:] == trigger else _FREE
    node, sep_pos = 0, 0
    found: list[Entry] = []
    for tok in generated:
        if phase == _IN_ENTRY:
            child = trie.step(node, tok)
            if child >= 0:
                node = child
            else:
                entry = trie.entry_at(node)
                if entry is not None:
                    found.append(entry)
                if entry is not None and rules.on_complete == "release":
                    phase = _FREE
                elif entry is not None and rules.on_complete == "repeat" and tok == rules.separator[0]:
                    phase, node, sep_pos = (_IN_ENTRY, 0, 0) if len(rules.separator) == 1 else (_SEPARATOR, -1, 1)
                else:
                    return found
        elif phase == _SEPARATOR:
            if tok != rules.separator[sep_pos]:
                return found
            sep_pos += 1
            if sep_pos == len(rules.separator):
                phase, node = _IN_ENTRY, 0
        if t:
            history = (history + [tok])[-t:]
            if phase == _FREE and history == trigger:
                phase, node = _IN_ENTRY, 0
    if phase == _IN_ENTRY:
        entry = trie.entry_at(node)
        if entry is not None:
            found.append(entry)
    return found


def match(trie: TokenTrie, generated: torch.Tensor | Sequence[Sequence[int]], *, end_token_id: Optional[int] = None) -> list[Optional[Entry]]:
    """The entry at the start of each row of ``generated`` (generated tokens only, no prompt), or None.

    The longest entry that the row's tokens walk to is returned; trailing end/pad tokens are ignored.
    """
    rows = generated.tolist() if isinstance(generated, torch.Tensor) else [list(r) for r in generated]
    rules = SpanRules(end_token_id=0 if end_token_id is None else end_token_id)
    out = []
    for row in rows:
        found = replay_entries(trie, rules, row)
        out.append(found[0] if found else None)
    return out


def match_all(trie: TokenTrie, generated: torch.Tensor | Sequence[Sequence[int]], rules: SpanRules) -> list[list[Entry]]:
    """Every entry each row generated under ``rules`` (generated tokens only, no prompt)."""
    rows = generated.tolist() if isinstance(generated, torch.Tensor) else [list(r) for r in generated]
    return [replay_entries(trie, rules, row) for row in rows]


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


@torch.no_grad()
def rank(model: Any, inputs: dict, trie: TrieArg, k: int, *, tokenizer: Any = None, end_token_id: Optional[int] = None, **generate_kwargs: Any) -> list[list[RankedEntry]]:
    """Top-``k`` entries per prompt with their sequence log-probabilities, by constrained beam search.

    Args:
        model: a transformers causal LM.
        inputs: the tokenized prompts (``input_ids``, ``attention_mask``), left-padded for a batch.
        trie: one trie, or one per prompt.
        k: number of entries per prompt (beams); fewer are returned when the trie has fewer entries.
        generate_kwargs: passed to ``generate`` (``max_new_tokens`` defaults to the deepest trie + 1).

    Returns:
        Per prompt, a list of :class:`RankedEntry` sorted by log-probability, best first. The log-probability is the
        model's (unnormalized by the mask) log-probability of the entry's tokens followed by the end token.
    """
    if k < 1:
        raise ConstraintConfigError(f"k must be at least 1, got {k}")
    processor = TrieLogitsProcessor(trie, tokenizer, end_token_id=end_token_id or _model_eos(model))
    depth = max(t.max_depth for t in processor.tries)
    generate_kwargs.setdefault("max_new_tokens", depth + 1)
    out = model.generate(
        **inputs,
        logits_processor=[processor],
        num_beams=k,
        num_return_sequences=k,
        do_sample=False,
        length_penalty=0.0,
        early_stopping=True,
        output_scores=True,
        return_dict_in_generate=True,
        eos_token_id=processor.rules.end_token_id,
        **generate_kwargs,
    )
    entries = processor.match(out.sequences)
    scores = out.sequences_scores.tolist()
    batch = out.sequences.shape[0] // k
    ranked: list[list[RankedEntry]] = []
    for p in range(batch):
        seen: dict[int, RankedEntry] = {}
        for i in range(p * k, (p + 1) * k):
            entry, score = entries[i], scores[i]
            if entry is None or score == float("-inf") or score != score:
                continue
            if entry.index not in seen or seen[entry.index].log_prob < score:
                seen[entry.index] = RankedEntry(entry, score)
        ranked.append(sorted(seen.values(), key=lambda r: -r.log_prob))
    return ranked


def _model_eos(model: Any) -> Optional[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(getattr(model, "config", None), "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0] if eos else None
    return eos


def prefix_allowed_tokens_fn(trie: TokenTrie, *, end_token_id: int, prompt_length: Optional[int] = None):
    """A ``prefix_allowed_tokens_fn`` for code written for GENRE / ``PrefixConstrainedLogitsProcessor``.

    The returned function maps ``(batch_id, input_ids_row)`` to the allowed token ids of that row. It walks the
    row's generated tokens from the root (as GENRE does), so prefer :class:`TrieLogitsProcessor` for speed.

    Args:
        trie: the trie.
        end_token_id: allowed once an entry is complete, and when nothing else is.
        prompt_length: where generation starts in ``input_ids``; by default the length seen at the first call.
    """
    start: dict[str, int] = {}

    def allowed(batch_id: int, input_ids: torch.Tensor) -> list[int]:
        length = int(input_ids.shape[-1])
        begin = prompt_length
        if begin is None:
            begin = start.get("len")
            if begin is None or length < begin:
                begin = start["len"] = length
        node = trie.walk(input_ids[begin:].tolist())
        if node < 0:
            return [end_token_id]
        tokens = trie.children(node)[0].tolist()
        if trie.is_terminal(node) or not tokens:
            tokens.append(end_token_id)
        return tokens

    return allowed


from .fast_forward import FastForwardOutput, FastForwardStats, fast_forward_generate  # noqa: E402

__all__ += ["fast_forward_generate", "FastForwardStats", "FastForwardOutput"]
