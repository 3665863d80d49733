"""A brute-force model of RTP-LLM's tree decoding, written from its source and tests, for checking our tries.

Why this exists: ``trie_from_prefix_dict`` claims that a trie built from an RTP-LLM prefix dict masks exactly as
RTP-LLM does. This module is the other side of that claim, written independently of ``trie_decode`` and as plainly
as possible: the state is the joined key string, like RTP-LLM's, and every answer is a dict or set lookup.

Which RTP-LLM: revision ``537e984c4d85f58129abff8f1651a830ef39e82b`` of https://github.com/alibaba/rtp-llm, read
there: ``rtp_llm/cpp/models/logits_processor/DFAUtil.h`` and the tests that pin its behaviour,
``rtp_llm/cpp/utils/test/DFAUtilTest.cc`` (``TreeDFATest``: invalid transition enters the error state, the error
state allows only the end token and freezes, a finished DFA ignores input, negative candidates never reach run
time) and ``rtp_llm/cpp/utils/test/PrefixToCandidateTokensTest.cc`` (``[]`` keys stay valid with no candidates,
negative and beyond-int32 candidates skipped, a beyond-int32 start or end id fails the load). Other revisions
differ: older ones throw on an invalid transition instead of entering the error state; the newest loader
(``PrefixToCandidateTokens.cc``, versioned snapshots) refuses ``[]`` lists, negative ids, an empty ``sep`` or
``prefix_dict`` and ``start_token_id == end_token_id``.

What it models (RTP-LLM, ``rtp_llm/cpp/models/logits_processor``):

- loading (``PrefixToCandidateTokens.h``, as pinned by ``rtp_llm/cpp/utils/test/PrefixToCandidateTokensTest.cc``):
  absent ``start_token_id``/``end_token_id``/``sep`` default to 225 / 2 / ``"_"``; each candidate list becomes a
  set; negative ids and ids beyond int32 are dropped; a key with ``[]`` (or only dropped ids) is still a key.
- ``TreeDFA<std::string, int>`` (``DFAUtil.h``): the status starts as ``str(start)``; ``next(t)`` does nothing once
  finished (the last token of its history is the end token; the history starts as ten 0 tokens) or in the error
  state; otherwise it moves to ``status + sep + str(t)`` if that key exists or ``t`` is the end token, and else
  enters the error state, keeping its status. ``getCandidateTokenIds()`` is ``[end]`` in the error state, else the
  status's candidates, or ``[end]`` when there are none (missing key or empty set).
- masking (``BaseLogitsProcessor::generateVocabMask``): ids ``>= vocab_size`` are skipped, so a state whose ids
  are all outside the vocabulary allows nothing (every logit masked).
"""

from __future__ import annotations

from typing import Any, NamedTuple

INT32_MAX = 2**31 - 1


class RtpState(NamedTuple):
    """One TreeDFA: its status key, its error flag, and the last token of its history (all it reads of it)."""

    status: str
    error: bool
    last: int


class RtpTreeDfa:
    """RTP-LLM's TreeDFA over one prefix dict (a parsed JSON object) for a model with ``vocab_size`` logits."""

    def __init__(self, data: dict[str, Any], vocab_size: int) -> None:
        self.start = data.get("start_token_id", 225)
        self.end = data.get("end_token_id", 2)
        self.sep = data.get("sep", "_")
        self.vocab_size = vocab_size
        self.candidates: dict[str, set[int]] = {}
        for key, ids in data["prefix_dict"].items():
            self.candidates[key] = {int(t) for t in ids if 0 <= int(t) <= INT32_MAX}

    def initial(self) -> RtpState:
        return RtpState(status=str(self.start), error=False, last=0)  # history = [0] * 10

    def finished(self, state: RtpState) -> bool:
        return state.last == self.end

    def candidate_ids(self, state: RtpState) -> set[int]:
        """``getCandidateTokenIds()``: what the DFA offers before the mask drops ids outside the logits."""
        if state.error:
            return {self.end}
        ids = self.candidates.get(state.status, set())
        return set(ids) if ids else {self.end}

    def allowed(self, state: RtpState) -> set[int]:
        """The tokens whose logits survive the mask (may be empty: then RTP-LLM masks every logit)."""
        return {t for t in self.candidate_ids(state) if t < self.vocab_size}

    def next(self, state: RtpState, token: int) -> RtpState:
        """``next(token)``."""
        if self.finished(state) or state.error:
            return state
        new_status = state.status + self.sep + str(token)
        if new_status in self.candidates or token == self.end:
            return RtpState(status=new_status, error=False, last=token)
        return RtpState(status=state.status, error=True, last=state.last)

    def run(self, tokens: list[int]) -> RtpState:
        state = self.initial()
        for tok in tokens:
            state = self.next(state, tok)
        return state
