"""Retrieval suite: wide beams over big catalogs, with per-request filters, through the path users run.

Why this exists: generative retrieval and recommendation decode item ids with wide beams (16-256) over catalogs of
millions of items, often restricted per request (a category: allow; already seen items: deny). This suite
measures, per (catalog, beams, filter):

- ``step_ms``: one step of ``TrieLogitsProcessor.__call__`` as ``generate``'s beam search calls it (every row
  looks up its parent; masking in place), on a (beams, V) float32 buffer refreshed outside the timed region;
- ``floor_ms``: ``fill_(-inf)`` of the same buffer, timed in the same loop (the least any masking can cost);
- ``filter_setup_ms``: turning the request's filter (10k denied keys, or 1k allowed keys) into device state, for
  all the request's beams (``index_once_s``: the per-trie indexes it uses, built once per trie and cached), its
  node flags counted (cold); ``filter_setup_warm_ms``: the same for a filter the trie saw last (flags kept);
- ``step_ms`` is the median over every step of repeated generations by one processor, so it includes each
  generation's first step (the rows' start; a reused processor keeps its static filters built);
- ``genre_ms``: GENRE's recipe on the same rows (a nested-dict trie + ``PrefixConstrainedLogitsProcessor``), at the
  smaller beam widths (it is a Python loop over rows);
- ``rank_items_per_s``: distinct items per second from :func:`~trie_decode.integrations.transformers.rank` on a
  tiny random model of the catalog's vocabulary (the decode cost without the LM's own cost dominating);
- ``trie_bytes`` and the process's peak RSS;
- ``distinct``: a list without repeats (``on_complete="repeat"``, ``distinct=True``, alone and beside a 10k-key deny
  filter) at 1 and 64 rows, on ``titles`` and on ``words`` (20k of the tokenizer's words in two forms, with and
  without a leading space: 40k entries under a root of ~20k children): ``step_ms``, mask and state update of the
  processor's constraint, greedy over random logits, against ``floor_ms`` (a list's filter changes every step).

Catalogs: ``semantic-ids`` (1M items, 4 levels x 256 codes, Zipf-distributed first level, built with
:func:`trie_decode.catalogs.catalog_from_codes`) and ``titles`` (>= 100k synthetic titles from the step suite's
name generator, tokenized with SmolLM2's tokenizer). ``--quick``: 100k items and 16/64 beams.

Goals (issue 15): filtered step <= 1.5x unfiltered; filter setup of 10k keys on a 1M trie <= 10 ms; per-step cost
at 256 beams <= 2x the in-loop fill.
"""

from __future__ import annotations

import json
import resource
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Optional

__all__ = ["run_retrieval_suite"]


def _timed(fn: Callable[[], Any], reset: Callable[[], Any], steps: int) -> float:
    times = []
    for _ in range(steps):
        reset()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def _catalogs(quick: bool, tokenizer: Any) -> list[tuple[str, Any]]:
    import numpy as np

    from trie_decode.catalogs import catalog_from_codes
    from trie_decode.trie import TokenTrie
    from .data import make_names

    n = 100_000 if quick else 1_000_000
    rng = np.random.default_rng(0)
    first = (rng.zipf(1.2, size=n) - 1) % 256
    codes = np.column_stack([first] + [rng.integers(0, 256, size=n) for _ in range(3)])
    vocab = len(tokenizer)
    sem = catalog_from_codes(codes, vocab_size=vocab + 1024, codebook_size=256, token_offset=vocab,
                             keys=[f"item{i}" for i in range(n)])
    titles_n = 100_000
    names = make_names("titles", titles_n, 0, tokenizer)
    titles = TokenTrie.from_strings(names, tokenizer, keys=[f"doc{i}" for i in range(len(names))])
    return [("semantic-ids", sem), ("titles", titles)]


def _walk_tokens(trie: Any, beams: int, steps: int, seed: int) -> list[list[int]]:
    """Per step, each row's next token along a random entry (rows restart at EOS-free random entries)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    rows = [list(trie.entry(int(i)).tokens) for i in rng.integers(0, trie.num_entries, size=beams)]
    return [[r[s] if s < len(r) else r[-1] for r in rows] for s in range(steps)]


def run_retrieval_suite(quick: bool, out_dir: Any, *, progress: Optional[Callable[[dict], None]] = None) -> dict:
    import numpy as np
    import torch
    from transformers import AutoTokenizer, LogitsProcessorList, PrefixConstrainedLogitsProcessor

    from trie_decode.integrations.smollm2 import smollm2_path
    from trie_decode.integrations.transformers import TrieLogitsProcessor
    from .ours import _beam_search

    torch.set_num_threads(1)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(smollm2_path())
    records: list[dict] = []
    beams_list = [16, 64] if quick else [16, 64, 256]
    for cat_name, trie in _catalogs(quick, tok):
        vocab = trie.vocab_size
        rng = np.random.default_rng(1)
        deny = rng.choice(trie.num_entries, size=min(10_000, trie.num_entries // 2), replace=False)
        allow = rng.choice(trie.num_entries, size=1_000, replace=False)
        keys = [trie.entry(int(i)).key for i in deny]
        filters = {"none": {}, "deny10k": {"deny": keys}, "allow1k": {"allow": [trie.entry(int(i)).key for i in allow]}}
        # Once per trie, not per request: the depth-first entry order and the key index (both cached on the trie).
        t = time.perf_counter()
        TrieLogitsProcessor(trie, end_token_id=0).constraint(torch.device("cpu")).filters(1, deny=keys[:1])
        index_s = time.perf_counter() - t
        for beams in beams_list:
            for fname, spec in filters.items():
                proc = TrieLogitsProcessor(trie, end_token_id=0, **spec)
                procs = LogitsProcessorList([proc])
                constraint = proc.constraint(torch.device("cpu"))
                # A filter's setup, cold (its node flags counted) and warm (a filter the trie saw last: its flags
                # are kept on the trie, keyed by content; the processor above has just built them).
                t = time.perf_counter()
                if spec:
                    constraint.filters(beams, **{k: [v] * beams for k, v in spec.items()})
                setup_warm_ms = (time.perf_counter() - t) * 1e3
                trie._derived.pop("NodeFlagCache", None)
                t = time.perf_counter()
                if spec:
                    constraint.filters(beams, **{k: [v] * beams for k, v in spec.items()})
                setup_ms = (time.perf_counter() - t) * 1e3
                # Walk entries the filters allow: allowed ones for allow1k, otherwise any.
                pool = trie if fname != "allow1k" else None
                steps = trie.max_depth
                walk = _walk_tokens(trie, beams, steps, beams) if pool is not None else [
                    [list(trie.entry(int(i)).tokens)[min(s, len(trie.entry(int(i)).tokens) - 1)]
                     for i in allow[:beams]] for s in range(steps)]
                base = torch.randn(beams, vocab)
                buf = torch.empty_like(base)
                ids = torch.zeros((beams, steps + 1), dtype=torch.long)
                # generate's beam search names each beam's parent row (running_beam_indices), column by column, the
                # columns not written yet -1 (the layout the processor checks); here each beam continues itself
                parents = torch.full((1, beams, steps + 1), -1, dtype=torch.int32)
                reps = 3 if quick else 5
                proc_t, floor_t = [], []
                for _ in range(reps):
                    proc.reset()
                    parents.fill_(-1)
                    for s in range(steps):
                        ids[:, s + 1] = torch.tensor(walk[s])
                    for s in range(steps):
                        if s:
                            parents[0, :, s - 1] = torch.arange(beams, dtype=torch.int32)
                        buf.copy_(base)
                        t0 = time.perf_counter()
                        _beam_search(procs, ids[:, : s + 1], buf, parents)
                        proc_t.append(time.perf_counter() - t0)
                        buf.copy_(base)
                        t0 = time.perf_counter()
                        buf.fill_(float("-inf"))
                        floor_t.append(time.perf_counter() - t0)
                rec = {"catalog": cat_name, "entries": trie.num_entries, "beams": beams, "filter": fname,
                       "step_ms": statistics.median(proc_t) * 1e3, "floor_ms": statistics.median(floor_t) * 1e3,
                       "filter_setup_ms": setup_ms if spec else 0.0,
                       "filter_setup_warm_ms": setup_warm_ms if spec else 0.0, "trie_bytes": trie.nbytes,
                       "index_once_s": index_s}
                rec["ratio"] = rec["step_ms"] / rec["floor_ms"]
                records.append(rec)
                if progress:
                    progress(rec)
        # GENRE's recipe on the same rows (unfiltered), at the smaller widths.
        seqs = trie.sequences()
        dict_trie: dict = {}
        for s in seqs:
            node = dict_trie
            for t_ in s:
                node = node.setdefault(t_, {})
        def allowed(batch_id: int, sent: Any) -> list[int]:
            node = dict_trie
            for t_ in sent.tolist()[1:]:
                node = node.get(t_, {})
            return list(node.keys()) or [0]
        for beams in beams_list[:2]:
            genre = PrefixConstrainedLogitsProcessor(allowed, num_beams=1)
            walk = _walk_tokens(trie, beams, trie.max_depth, beams)
            ids = torch.zeros((beams, len(walk) + 1), dtype=torch.long)
            for s in range(len(walk)):
                ids[:, s + 1] = torch.tensor(walk[s])
            base = torch.randn(beams, vocab)
            times = []
            for s in range(len(walk)):
                x = base.clone()
                t0 = time.perf_counter()
                genre(ids[:, : s + 1], x)
                times.append(time.perf_counter() - t0)
            for r in records:
                if r["catalog"] == cat_name and r["beams"] == beams and r["filter"] == "none":
                    r["genre_ms"] = statistics.median(times) * 1e3
        if cat_name == "titles":
            _distinct_steps(records, cat_name, trie, keys, tok, quick, progress)
        # rank() throughput on a tiny random model of this vocabulary.
        records.append({"catalog": cat_name, **_rank_throughput(trie, quick)})
        if progress:
            progress(records[-1])
    from trie_decode.trie import TokenTrie

    words = [w for w in tok.get_vocab() if w.isalpha() and len(w) > 3][:20_000]
    trie = TokenTrie.from_strings(words, tok, leading_space=[True, False])
    deny = np.random.default_rng(1).choice(trie.num_entries, 10_000, replace=False).tolist()  # entry indices
    _distinct_steps(records, "words", trie, deny, tok, quick, progress)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    data = {"suite": "retrieval", "records": records, "peak_rss_mb": peak}
    (out_dir / "retrieval.json").write_text(json.dumps(data, indent=1))
    return data


def _distinct_steps(records: list, cat_name: str, trie: Any, deny_keys: list, tokenizer: Any, quick: bool,
                    progress: Optional[Callable[[dict], None]]) -> None:
    """A distinct list's step (``mask_`` then ``advance``, greedy over random logits), alone and with a deny filter:
    one record each, appended to ``records``."""
    import torch

    from trie_decode.integrations.transformers import TrieLogitsProcessor

    comma = tokenizer.encode(",", add_special_tokens=False)
    for rows in (1, 64):
        for fname, spec in (("distinct", {}), ("distinct+deny10k", {"deny": deny_keys})):
            proc = TrieLogitsProcessor(trie, end_token_id=tokenizer.eos_token_id, on_complete="repeat", separator=comma,
                                       distinct=True, **spec)
            c = proc.constraint(torch.device("cpu"))
            f = c.filters(rows, distinct=True, **{k: [v] * rows for k, v in spec.items()})
            state, gen = c.start(rows), torch.Generator().manual_seed(0)
            logits, step_t, floor_t = torch.empty(rows, trie.vocab_size), [], []
            for _ in range(10 if quick else 30):
                logits.normal_(generator=gen)
                t0 = time.perf_counter()
                masked = c.mask_(logits, state, filters=f)
                state = c.advance(state, masked.argmax(1), filters=f)
                step_t.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                logits.fill_(float("-inf"))
                floor_t.append(time.perf_counter() - t0)
            rec = {"catalog": cat_name, "entries": trie.num_entries, "beams": rows, "filter": fname,
                   "step_ms": statistics.median(step_t) * 1e3, "floor_ms": statistics.median(floor_t) * 1e3}
            records.append({**rec, "ratio": rec["step_ms"] / rec["floor_ms"]})
            if progress:
                progress(records[-1])


def _rank_throughput(trie: Any, quick: bool) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from trie_decode.integrations.transformers import rank

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=trie.vocab_size, hidden_size=32, intermediate_size=64,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=64, eos_token_id=0, pad_token_id=0)).eval()
    inputs = {"input_ids": torch.tensor([[5, 6, 7]]), "attention_mask": torch.ones(1, 3, dtype=torch.long)}
    k = 10 if quick else 50
    t = time.perf_counter()
    ranked = rank(model, inputs, trie, k, end_token_id=0, num_beams=2 * k)[0]
    seconds = time.perf_counter() - t
    return {"rank_k": k, "rank_distinct": len(ranked), "rank_duplicates": ranked.duplicates,
            "rank_s": seconds, "rank_items_per_s": len(ranked) / seconds}
