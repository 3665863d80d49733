"""Every transformers (and torch) internal the transformers integration relies on, in one place.

Why this exists: the fast paths of :class:`~trie_decode.integrations.transformers.TrieLogitsProcessor` and
:func:`~trie_decode.integrations.fast_forward.fast_forward_generate` read things ``generate`` does not promise to
keep: which private loop calls a logits processor, that loop's locals, the cache's layer objects, the name of the
cache model input. Those move between minor releases. Here each one is stated with the versions it was checked
against (``VERIFIED``); outside them :func:`verified` is False, every fast path switches to its general path
(correct, slower) and :func:`warn_unverified` says so once. ``tests/test_transformers_internals.py`` fails loudly
when an installed version inside the range no longer matches what is written here.

What is relied on, and what happens without it:

============================================  ==========================================================
internal                                      outside the verified range / when it does not match
============================================  ==========================================================
caller frames: ``GenerationMixin._sample``    every call is treated as an unknown caller: rows found
(locals ``output_logits``,                    by prefix hash, scores masked out of place (a reused
``return_dict_in_generate``) and              buffer); the ``LogitsProcessorList`` calling (type-checked
``GenerationMixin._beam_search``              on any version) still tells one generation from another
``GenerationMixin._assisted_decoding``        calls under one ``LogitsProcessorList`` are one generation
(locals ``logits_processor``,                 whose prefixes may rewind; an assistant model's calls
``candidate_generator``) and an assistant's   are a generation of their own (kept apart, correct;
``generate`` below it                         its drafts are accepted less often)
the loops' local ``generation_config`` (its   no stop ids known: an entry holding the end token is not
stop ids, :func:`eos_token_ids`; its rows per refused (``TrieLogitsProcessor.check_stop_ids``); rows per
prompt, :func:`rows_per_prompt`)              prompt unknown: per-prompt tries and filters are checked
                                              only to divide the batch
``_beam_search``'s ``running_beam_indices``   checked (:func:`beam_parents`) before it is trusted: shape
(batch, beams, new tokens), int, flat parent  (batch, beams, n), values in each row's own prompt, the
rows of each step                             next column unwritten; else the prefix-hash lookup
``PrefixConstrainedLogitsProcessor.__call__`` type-checked on any version; when they do not match,
locals (``self``, ``input_ids``, ``scores``)  ``prefix_allowed_tokens_fn`` asks for ``prompt_length=`` and
and its loop's ``generation_config`` (two     checks nothing; without the loop's config no entry holding
frames up: ``_sample``, ``_beam_search``,     a stop id is refused
``_assisted_decoding``)
``torch._C._storage_Use_Count``               output buffers are never reused (a new tensor per step)
the cache model input: ``cache`` (5.24) or    read from ``model.forward``'s signature; both names are
``past_key_values`` (5.19)                    accepted from ``generate``
``GenerationConfig._eos_token_tensor``        ``eos_token_id``
``DynamicCache.layers[i].is_sliding`` /       no sliding-window check (a model without sliding layers
``.sliding_window``, ``batch_select_indices`` is unaffected); finished rows stay in the batch
``custom_generate`` calling convention        ``fast_forward_generate`` runs the plain loop
(``logits_processor``, ``stopping_criteria``, (``generate`` with a ``TrieLogitsProcessor``): same tokens,
``generation_config`` + model inputs; the     one forward pass per token; ``stop_strings`` go to that
keywords it declares beyond ``_sample``'s,    ``generate`` as its ``StopStringCriteria``
``stop_strings`` included, are handed to it
and ``tokenizer=`` is not)
a generation config with ``stop_strings``:     ``fast_forward_generate`` called directly decodes token
``generate`` refuses a callable               by token through ``generate``, with the tokenizer, and
``custom_generate`` then (it dropped          says so once (:func:`warn_token_by_token`); the hook
``tokenizer=``; it fills a config's ``None``  cannot run (transformers' own error). Checked on 5.19
``stop_strings`` from the model's own)        and 5.24
``generate``'s local ``streamer`` (not passed ``fast_forward_generate`` refuses a ``streamer`` (the
to a callable ``custom_generate``)            plain call) or streams nothing after the prompt (the hook)
where ``generate`` merges a user's            (:func:`around_user_processors`, read on every version)
processors: after its own, before the
``*LogitsWarper`` s and ``LogitNormalization``
============================================  ==========================================================
"""

from __future__ import annotations

import inspect
import sys
import warnings
import weakref
from typing import Any, NamedTuple, Optional

import torch
from packaging.version import Version

try:
    import transformers
    from transformers import LogitNormalization, LogitsProcessorList, PrefixConstrainedLogitsProcessor
except ImportError as exc:  # pragma: no cover - import guard
    raise ImportError("trie_decode.integrations needs transformers: pip install 'trie-decode[transformers]'") from exc

__all__ = [
    "VERIFIED",
    "around_user_processors",
    "generate_streamer",
    "holds_batch_state",
    "UnverifiedTransformersWarning",
    "verified",
    "warn_unverified",
    "warn_token_by_token",
    "GenerateLoop",
    "beam_parents",
    "reusable_buffer",
    "prefix_processor_call",
    "PrefixCall",
    "cache_input_name",
    "CACHE_INPUT_NAMES",
    "output_cache",
    "eos_token_ids",
    "rows_per_prompt",
    "sliding_window_slots",
    "drop_cache_rows",
]

#: The transformers releases every internal below was checked against: the one vLLM 0.32 pins (5.19.0) and the
#: newest on PyPI when this was written (5.24.0), both run by ``make test``.
VERIFIED = ("5.19.0", "5.24.0")


class UnverifiedTransformersWarning(UserWarning):
    """The installed transformers is outside :data:`VERIFIED`: the fast paths are off, the general ones run."""


def _release(version: str) -> tuple[int, ...]:
    """(major, minor, patch) of a version ("5.24.0.dev0" -> (5, 24, 0)): a pre-release counts as its release."""
    return (tuple(Version(version).release) + (0, 0, 0))[:3]


def version_is_verified(version: str) -> bool:
    """Whether ``version`` lies within :data:`VERIFIED` (inclusive, by release number)."""
    low, high = (_release(v) for v in VERIFIED)
    return low <= _release(version) <= high


_VERIFIED = version_is_verified(transformers.__version__)
_warned: set[str] = set()


def verified() -> bool:
    """Whether the installed transformers is one the fast paths were checked against (see the module docs)."""
    return _VERIFIED


def warn_unverified(feature: str) -> None:
    """Say once per ``feature`` that it runs its general path on an unverified transformers."""
    if feature in _warned:
        return
    _warned.add(feature)
    warnings.warn(
        f"trie_decode: transformers {transformers.__version__} is outside the versions its fast paths were checked "
        f"against ({VERIFIED[0]} to {VERIFIED[1]}); {feature} uses its general path (same results, slower)",
        UnverifiedTransformersWarning,
        stacklevel=3,
    )


def warn_token_by_token(reason: str) -> None:
    """Say once per ``reason`` that ``fast_forward_generate`` decodes token by token on a verified transformers
    (same tokens, one forward pass per token)."""
    if reason in _warned:
        return
    _warned.add(reason)
    warnings.warn(f"trie_decode: fast_forward_generate decodes token by token (the same tokens, no fast-forward): "
                  f"{reason}", UserWarning, stacklevel=4)  # the caller of fast_forward_generate


class GenerateLoop:
    """What a logits processor may assume about the ``generate`` loop calling it, read once per call from the
    caller's frames.

    - ``_sample`` (greedy and sampling) never reorders rows, and keeps the tensor it passes to the processors only
      as the raw logits of ``output_logits=True``: rows need no lookup, and the scores are masked in place unless
      raw logits are kept.
    - ``_beam_search`` reorders rows, and passes fresh log-probs (it keeps raw logits separately): in place. It
      records each running beam's parent row of every step in ``running_beam_indices`` (see :func:`beam_parents`).
    - ``_assisted_decoding`` (``prompt_lookup_num_tokens``, ``assistant_model``; one row) calls the processors of
      one generation from three places: itself, on each candidate prefix of a round (in place); a prompt-lookup
      ``get_candidates``, on the prefixes it proposes (its scores are reused: out of place); and the assistant
      model's own ``generate``, whose ``_sample`` calls are this generation's too (found by walking up from it).
      Each call's prefix may rewind to a shorter one (``rewinds``): the processor finds the state of the longest
      prefix it has seen, not its last call's.
    - Any other caller (a user's own loop, or any loop of an unverified transformers): rows may be reordered, and
      the scores are left untouched. Called by a ``LogitsProcessorList`` (that it is one is checked on any version),
      a call whose prefix is not the previous one plus a token is a rewind of the same generation.

    A new ``generate`` call is recognized by its new ``LogitsProcessorList``. Reading the frames costs a few
    microseconds: the sampling loop's many locals are read only when a generation starts.

    ``config`` is the loop's ``generation_config`` (an assistant model's loop: the main loop's), from which
    :meth:`stop_ids` reads the tokens ``generate`` stops at; None for any other caller.
    """

    __slots__ = ("reorders", "in_place", "parents", "rewinds", "config", "_owner")

    def __init__(self, reorders: bool, in_place: bool, owner: Any, parents: Optional[torch.Tensor] = None,
                 rewinds: bool = False, config: Any = None) -> None:
        self.reorders, self.in_place, self.parents, self.rewinds = reorders, in_place, parents, rewinds
        self.config = config
        self._owner = weakref.ref(owner) if owner is not None else None

    def stop_ids(self) -> Optional[list[int]]:
        """The tokens the calling ``generate`` loop stops a row at (:func:`eos_token_ids` of its generation config),
        or None when the caller is not one of ``generate``'s loops (a loop of one's own: its stops are unknown)."""
        return None if self.config is None else eos_token_ids(self.config)

    def rows_per_prompt(self) -> Optional[int]:
        """How many rows the calling ``generate`` gives each prompt (:func:`rows_per_prompt`), or None (a loop of
        one's own)."""
        return None if self.config is None else rows_per_prompt(self.config)

    def owner(self) -> Any:
        """The ``LogitsProcessorList`` whose generation this call belongs to, or None (unknown, or no longer alive)."""
        return self._owner() if self._owner is not None else None

    def continues(self, previous: Optional["GenerateLoop"]) -> bool:
        """Whether this call belongs to the same generation as ``previous``."""
        if previous is None or (self._owner is None) != (previous._owner is None):
            return False
        return self._owner is None or self._owner() is previous._owner()

    @classmethod
    def of_caller(cls, previous: Optional["GenerateLoop"], depth: int = 2) -> "GenerateLoop":
        """The loop calling the processor (``depth``: frames between this call and the processor's caller;
        ``previous``: the loop of the processor's last call, reused when the same generation calls again)."""
        frame = sys._getframe(depth)
        owner, above = None, 0  # the LogitsProcessorList calling, and the frames walked above its __call__
        for _ in range(4):
            if frame is None:
                break
            code = frame.f_code.co_name
            if owner is None:
                if code == "__call__" and isinstance(frame.f_locals.get("self"), LogitsProcessorList):
                    owner = frame.f_locals["self"]
                    if not _VERIFIED:
                        break
            elif not _VERIFIED:
                break
            elif code == "_sample" and "output_logits" in frame.f_code.co_varnames:
                if (previous is not None and not previous.reorders and previous._owner is not None
                        and previous._owner() is owner):
                    return previous  # the same generation: its locals were read at its first call
                local = frame.f_locals
                keeps_raw = bool(local.get("return_dict_in_generate")) and bool(local.get("output_logits"))
                # An assistant model's generate inside assisted decoding: the main loop's generation.
                outer, config = _assisted_owner(frame.f_back)
                assisted = outer is not None
                return cls(reorders=False, in_place=not keeps_raw, owner=outer if assisted else owner,
                           rewinds=assisted, config=config if assisted else local.get("generation_config"))
            elif code == "_beam_search":
                # Read at every call: the loop rebinds running_beam_indices to a new tensor at every step.
                local = frame.f_locals
                return cls(reorders=True, in_place=True, owner=owner,
                           parents=_checked_parents(local.get("running_beam_indices")),
                           config=local.get("generation_config"))
            elif code == "_assisted_decoding":
                # Called by the loop itself the scores are a fresh slice; by a prompt lookup's get_candidates
                # (one frame between) they are a tensor it passes again for its next candidate.
                return cls(reorders=False, in_place=above == 1, owner=owner, rewinds=True,
                           config=frame.f_locals.get("generation_config"))
            above += owner is not None
            frame = frame.f_back
        if not _VERIFIED:
            warn_unverified("TrieLogitsProcessor (caller detection)")
        # The general caller: rows may move, scores are not ours to overwrite; called by a LogitsProcessorList
        # (owner), its calls may rewind.
        return cls(reorders=True, in_place=False, owner=owner, rewinds=owner is not None)


#: The candidate generators whose assistant model drafts in the main model's vocabulary through its own ``generate``
#: (with the main loop's processors): their drafts are masked as the main generation's. Any other one (different
#: tokenizers, multi-token heads) calls the processor as a generation of its own, kept apart.
_SAME_VOCAB_DRAFTERS = frozenset(("AssistedCandidateGenerator", "EarlyExitCandidateGenerator"))


def _assisted_owner(frame: Any, levels: int = 10) -> tuple[Optional[LogitsProcessorList], Any]:
    """The ``LogitsProcessorList`` and the ``generation_config`` of the ``_assisted_decoding`` loop ``frame`` runs
    under (an assistant model's ``generate`` is a few frames below it) when its drafter shares the main model's
    vocabulary, or (None, None)."""
    for _ in range(levels):
        if frame is None:
            return None, None
        if frame.f_code.co_name == "_assisted_decoding":
            local = frame.f_locals
            found = local.get("logits_processor")
            drafter = type(local.get("candidate_generator")).__name__
            if isinstance(found, LogitsProcessorList) and drafter in _SAME_VOCAB_DRAFTERS:
                return found, local.get("generation_config")
            return None, None
        frame = frame.f_back
    return None, None


_parent_layout_warned = False
_INDEX_DTYPES = frozenset((torch.int64, torch.int32, torch.int16, torch.int8))  # signed: -1 marks unwritten


def _checked_parents(parents: Any) -> Optional[torch.Tensor]:
    """``running_beam_indices`` if it has the layout :func:`beam_parents` reads, else None (with one warning)."""
    global _parent_layout_warned
    ok = isinstance(parents, torch.Tensor) and parents.dim() == 3 and parents.dtype in _INDEX_DTYPES
    if not ok and not _parent_layout_warned:
        _parent_layout_warned = True
        warnings.warn(
            "trie_decode: beam search's running_beam_indices does not have the layout the processor's fast path "
            f"reads (got {type(parents).__name__} {getattr(parents, 'shape', '')}); rows are found by prefix hash "
            "instead (same results, slower)",
            UnverifiedTransformersWarning,
            stacklevel=4,
        )
    return parents if ok else None


def beam_parents(parents: torch.Tensor, rows: int, column: int, check: bool) -> Optional[torch.Tensor]:
    """Each row's parent row for the token it just appended, from beam search's ``running_beam_indices``.

    ``parents`` (Shape: (batch, beams, new tokens), int) holds at ``[:, :, j]`` the flat row (``prompt * beams +
    beam``) of the previous step each running beam continued at its ``j``-th new token; columns not written yet
    hold -1. ``column`` is the current token's index. With ``check`` (a generation's first use) the layout is
    verified on the host: every value of the column in range and in its row's own prompt, the next column
    unwritten; None (the caller takes its general path) when it is not so, or when the shapes do not fit.

    Returns: Shape: (rows,), a view on ``parents``' device, or None.
    """
    batch, beams, width = parents.shape
    if batch * beams != rows or not 0 <= column < width:
        return None
    flat = parents.reshape(rows, width)
    col = flat[:, column]
    if check:  # one host read of this column and the next
        # Python on the host list, not numpy: right after the mask pass has flushed the caches, a few numpy calls
        # on a tiny array cost more (measured: 67 against 33 us at 64 beams).
        cols = flat[:, column : column + 2].tolist()
        # A value in its row's own prompt (row // beams) is in range and crosses no prompt; -1 is unwritten.
        ok = all(c[0] // beams == r // beams and c[1:] in ([], [-1]) for r, c in enumerate(cols))
        if not ok:
            _checked_parents(None)  # the one warning
            return None
    return col


_HAS_STORAGE_COUNT = hasattr(torch._C, "_storage_Use_Count")


def reusable_buffer(buf: torch.Tensor, references: int) -> bool:
    """Whether nothing outside its owner can see ``buf``: exactly ``references`` Python references held by the
    caller (this call's own argument and ``sys.getrefcount``'s are not counted) and no other tensor on its storage.
    Without torch's private storage count, never (the caller allocates a new tensor)."""
    # Users of buf's storage: buf itself (no view) and the probe's own handle (untyped_storage()).
    return (_HAS_STORAGE_COUNT and sys.getrefcount(buf) == references + 2
            and torch._C._storage_Use_Count(buf.untyped_storage()._cdata) == 2)


class PrefixCall(NamedTuple):
    """A ``PrefixConstrainedLogitsProcessor`` call seen from the prefix function it calls (:func:`prefix_processor_call`).

    Attributes:
        owner: that processor (``generate`` makes a new one per call).
        length: the length of its ``input_ids``.
        width: the width of its ``scores`` (the columns it will index with the allowed tokens).
        stop_ids: the stop tokens of the ``generate`` loop calling it (:func:`eos_token_ids` of its
            ``generation_config``), or None (another caller, or a transformers outside :data:`VERIFIED`).
        ids: its ``input_ids``, every row of the step. Shape: (B, length).
    """

    owner: Any
    length: int
    width: int
    stop_ids: Optional[list[int]]
    ids: torch.Tensor


#: The loops of ``generate`` that call a ``PrefixConstrainedLogitsProcessor`` (through their ``LogitsProcessorList``).
_PREFIX_LOOPS = ("_sample", "_beam_search", "_assisted_decoding")


def prefix_processor_call(depth: int, read_loop: bool = True) -> Optional[PrefixCall]:
    """The ``PrefixConstrainedLogitsProcessor`` calling a prefix function ``depth`` frames up, or None when the caller
    is not one. Its own reads (``self``, ``input_ids``, ``scores``) are type-checked, so they hold on any version whose
    processor keeps those names; with ``read_loop`` (once per ``generate`` call: it reads the loop's many locals) the
    stop ids of the loop two frames above it are read too, on the verified versions only."""
    caller = sys._getframe(depth + 1)
    local = caller.f_locals if caller.f_code.co_name == "__call__" else {}
    owner, ids, scores = local.get("self"), local.get("input_ids"), local.get("scores")
    if not (isinstance(owner, PrefixConstrainedLogitsProcessor) and isinstance(ids, torch.Tensor)
            and isinstance(scores, torch.Tensor)):
        return None
    stop_ids = None
    frame = caller.f_back
    for _ in range(2 if read_loop and _VERIFIED else 0):  # its LogitsProcessorList, then the loop
        frame = frame.f_back if frame is not None else None
        if frame is not None and frame.f_code.co_name in _PREFIX_LOOPS:
            config = frame.f_locals.get("generation_config")
            stop_ids = eos_token_ids(config) if config is not None else None
            break
    return PrefixCall(owner, int(ids.shape[-1]), int(scores.shape[-1]), stop_ids, ids)


# ------------------------------------------------------------------------------------------ fast-forward's model use
#: Names ``generate`` gives the cache among the model inputs: 5.24 renamed ``past_key_values`` to ``cache``.
CACHE_INPUT_NAMES = ("cache", "past_key_values")


def cache_input_name(model: Any) -> str:
    """The keyword ``model.forward`` takes its cache by: ``cache`` (transformers >= 5.24) or ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def output_cache(out: Any) -> Any:
    """The cache a forward pass returned (``out.cache`` from 5.24, ``out.past_key_values`` before)."""
    cache = out.get("cache") if hasattr(out, "get") else None
    return cache if cache is not None else getattr(out, "past_key_values", None)


def eos_token_ids(config: Any) -> list[int]:
    """The stop tokens ``generate`` prepared (``_eos_token_tensor``), else the config's ``eos_token_id``."""
    for value in (getattr(config, "_eos_token_tensor", None), config.eos_token_id):
        if value is None:
            continue
        ids = value.flatten().tolist() if isinstance(value, torch.Tensor) else [value] if isinstance(value, int) else list(value)
        if ids:
            return [int(v) for v in ids]
    return []


def rows_per_prompt(config: Any) -> int:
    """The rows ``generate`` gives each prompt: it repeats every prompt ``max(num_beams, num_return_sequences)``
    times (``_expand_inputs_for_generation``) before its loop runs and before it calls a ``custom_generate``."""
    return max(int(getattr(config, "num_beams", None) or 1), int(getattr(config, "num_return_sequences", None) or 1))


def sliding_window_slots(cache: Any) -> Optional[int]:
    """How many slots a sliding-window layer of ``cache`` keeps (its window minus one: the current token), or None
    (no sliding layer, or a cache whose layers this version does not expose)."""
    windows = [int(layer.sliding_window) for layer in getattr(cache, "layers", ()) if getattr(layer, "is_sliding", False)]
    return min(windows) - 1 if windows else None


def drop_cache_rows(cache: Any, keep: torch.Tensor) -> bool:
    """Keep only rows ``keep`` (Shape: (R,), int64) of ``cache``; False when the cache cannot (rows then stay)."""
    select = getattr(cache, "batch_select_indices", None)
    if select is None:
        return False
    select(keep)
    return True


def generate_streamer(levels: int = 4) -> Any:
    """The ``streamer`` of the ``generate`` call that called a ``custom_generate`` hook (the caller of the caller of
    this function, through ``torch.no_grad``'s wrapper), or None. ``generate`` puts the prompt into it, then calls a
    callable hook without it (5.19, 5.24: ``_extract_generation_mode_kwargs`` keeps only the hook's own options):
    the hook streams the rest and ends it. None outside the verified versions."""
    if not _VERIFIED:
        return None
    frame = sys._getframe(2)
    for _ in range(levels):
        if frame is None:
            return None
        if frame.f_code.co_name == "generate" and "streamer" in frame.f_code.co_varnames:
            streamer = frame.f_locals.get("streamer")
            return streamer if streamer is not None and callable(getattr(streamer, "put", None)) else None
        frame = frame.f_back
    return None


def around_user_processors(processors: Any) -> tuple[LogitsProcessorList, LogitsProcessorList]:
    """``generate``'s prepared processors split where it merges a user's (where a ``TrieLogitsProcessor`` runs):
    after its own (min_new_tokens, bad_words, ...), before what it appends after them (the sampling
    ``*LogitsWarper`` s, a watermark, then ``LogitNormalization`` for ``renormalize_logits``). Checked against 5.19 and 5.24
    (``GenerationMixin._get_logits_processor``).

    Example:
        >>> from transformers import MinNewTokensLengthLogitsProcessor, TopKLogitsWarper
        >>> before, after = around_user_processors([MinNewTokensLengthLogitsProcessor(1, 2, 0), TopKLogitsWarper(5),
        ...                                         LogitNormalization()])
        >>> [type(p).__name__ for p in before], [type(p).__name__ for p in after]
        (['MinNewTokensLengthLogitsProcessor'], ['TopKLogitsWarper', 'LogitNormalization'])
    """
    procs = list(processors or ())
    at = next((i for i, p in enumerate(procs) if type(p).__name__.endswith("LogitsWarper")
               or type(p).__name__ in _AFTER_USER_PROCESSORS or isinstance(p, LogitNormalization)), len(procs))
    return LogitsProcessorList(procs[:at]), LogitsProcessorList(procs[at:])


#: What ``generate`` appends after the warpers, before ``LogitNormalization`` (watermarks: "after all logits processing").
_AFTER_USER_PROCESSORS = ("WatermarkLogitsProcessor", "SynthIDTextWatermarkLogitsProcessor")


def holds_batch_state(processors: Any, batch: int) -> bool:
    """Whether a processor keeps per-row state sized for ``generate``'s whole batch (a tensor attribute whose first
    dimension is the batch: 5.24's repetition penalty keeps each row's prompt padding) or tells a row by its place in
    the batch (``PrefixConstrainedLogitsProcessor`` passes it to ``prefix_allowed_tokens_fn`` as ``batch_id``), so
    that it must be called on every row of the batch, never on some of them."""
    return any(isinstance(p, PrefixConstrainedLogitsProcessor) for p in processors) or any(
        isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == batch
        for p in processors for v in getattr(p, "__dict__", {}).values())
