"""Generate suite: end-to-end ``model.generate`` time with and without the trie processor.

Why this exists: the per-step mask cost (the ``step`` suite) matters only relative to the model's own step. Here
SmolLM2-135M-Instruct (float32) generates exactly ``N`` tokens greedily at batch 1 and 8, three ways on the same
prompts, repeats interleaved so that machine noise hits all alike:

    plain        model.generate(...)                                         no constraint
    trie_decode  + TrieLogitsProcessor(countries, on_complete="repeat")      constrained on every step
    trie_decode-general  the same processor with its one-call step turned off (``advance`` then ``mask_``)
    genre        + PrefixConstrainedLogitsProcessor with a nested-dict trie   GENRE's recipe, same constraint
    fill         a processor that only does ``scores.fill_(-inf)`` (the floor, timed where the processors run)

``min_new_tokens = max_new_tokens = N`` keeps every run at N steps ("repeat" mode keeps the constraint active for
all of them: a ";"-separated list of countries). The record holds the medians, the overhead of each constraint
against ``plain``, and the time spent inside the processor itself.

Entry point for the suite runner: :func:`run_generate_suite`.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any, Optional

__all__ = ["run_generate_suite"]

QUESTIONS = [
    "List countries of Europe.", "List countries of Africa.", "List countries of Asia.", "List island countries.",
    "List countries of South America.", "List countries that border Germany.", "List large countries.",
    "List countries where Spanish is spoken.",
]


def _general_processor(*args: Any, **kwargs: Any) -> Any:
    """A TrieLogitsProcessor that never takes its one-call step (TrieConstraint.fused_step): the general path, to
    measure what the fused step saves inside generate."""
    from trie_decode.integrations.transformers import TrieLogitsProcessor

    class General(TrieLogitsProcessor):
        def _begin(self, *a: Any, **k: Any) -> None:
            super()._begin(*a, **k)
            self._fused = None

    return General(*args, **kwargs)


def _fill(input_ids: Any, scores: Any) -> Any:
    """The floor: what any exact mask writes (generate then picks token 0; only the time inside is used)."""
    return scores.fill_(float("-inf"))


class _GenreRepeat:
    """GENRE's prefix_allowed_tokens_fn over a nested dict, restarted after each separator (the same constraint
    as on_complete="repeat")."""

    def __init__(self, sequences: list[list[int]], separator: int, end: int, start: int) -> None:
        self.trie: dict = {}
        for seq in sequences:
            node = self.trie
            for tok in seq:
                node = node.setdefault(tok, {})
            node[None] = {}
        self.sep, self.end, self.start = separator, end, start

    def __call__(self, batch_id: int, sent: Any) -> list[int]:
        gen = sent[self.start :].tolist()
        if self.sep in gen:
            gen = gen[len(gen) - gen[::-1].index(self.sep) :]
        node = self.trie
        for tok in gen:
            node = node.get(tok)
            if node is None:
                return [self.end]
        allowed = [t for t in node if t is not None]
        if None in node:
            allowed += [self.sep, self.end]
        return allowed


def run_generate_suite(quick: bool, out_dir: Path, *, repeats: Optional[int] = None) -> dict:
    """Time ``model.generate`` with each processor (``trie-decode bench --suite generate``); ``repeats``: timed runs
    per (processor, batch) (default 3 with ``quick``, else 7: ``--repeats``)."""
    import pycountry
    import torch

    torch.set_num_threads(1)  # like the step suite's workers: one thread is steadier on a shared small CPU
    from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessorList
    from transformers.generation.logits_process import PrefixConstrainedLogitsProcessor
    from transformers.utils import logging as hf_logging

    from trie_decode import TokenTrie
    from trie_decode.integrations.smollm2 import smollm2_path
    from trie_decode.integrations.transformers import TrieLogitsProcessor

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    path = smollm2_path()
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    names = sorted(c.name for c in pycountry.countries)
    trie = TokenTrie.from_strings(names, tok, leading_space=True)
    # ";" appears in no country name (", " does: "Bolivia, Plurinational State of"), so the GENRE recipe's
    # "restart after the last separator" is the same constraint as on_complete="repeat".
    sep = tok(";", add_special_tokens=False)["input_ids"]
    new_tokens = 16 if quick else 32
    repeats = repeats or (3 if quick else 7)
    records = []
    for batch in (1, 8):
        prompts = [
            tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            + "Countries (separated by semicolons):"
            for q in (QUESTIONS * 2)[:batch]
        ]
        inputs = tok(prompts, return_tensors="pt", padding=True)
        start = inputs["input_ids"].shape[1]
        processor = TrieLogitsProcessor(trie, tok, on_complete="repeat", separator=sep)
        genre = PrefixConstrainedLogitsProcessor(
            _GenreRepeat(trie.sequences(), sep[0], tok.eos_token_id, start), num_beams=1
        )
        general = _general_processor(trie, tok, on_complete="repeat", separator=sep)
        inside = {"trie_decode": 0.0, "trie_decode-general": 0.0, "genre": 0.0, "fill": 0.0}

        def timed(name: str, proc: Any) -> Any:
            def call(input_ids: Any, scores: Any) -> Any:
                t0 = time.perf_counter()
                out = proc(input_ids, scores)
                inside[name] += time.perf_counter() - t0
                return out

            return call

        variants = {
            "plain": None,
            "trie_decode": LogitsProcessorList([timed("trie_decode", processor)]),
            "trie_decode-general": LogitsProcessorList([timed("trie_decode-general", general)]),
            "genre": LogitsProcessorList([timed("genre", genre)]),
            "fill": LogitsProcessorList([timed("fill", _fill)]),
        }
        times: dict[str, list[float]] = {k: [] for k in variants}
        outputs = {}
        for rep in range(repeats + 1):
            for name, procs in variants.items():
                inside_before = dict(inside)
                t0 = time.perf_counter()
                with torch.no_grad():
                    out = model.generate(
                        **inputs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                        logits_processor=procs,
                    )
                elapsed = time.perf_counter() - t0
                if rep == 0:  # warmup
                    inside.update(inside_before)
                    continue
                times[name].append(elapsed)
                outputs[name] = out
        med = {k: statistics.median(v) for k, v in times.items()}
        same = outputs["trie_decode"].tolist() == outputs["genre"].tolist() == outputs["trie_decode-general"].tolist()
        valid = all(len(r) > 0 for r in processor.match_all(outputs["trie_decode"]))
        record = {
            "suite": "generate",
            "status": "ok",
            "batch": batch,
            "new_tokens": new_tokens,
            "repeats": repeats,
            "entries": trie.num_entries,
            "plain_s": med["plain"],
            "trie_decode_s": med["trie_decode"],
            "genre_s": med["genre"],
            "trie_decode_overhead": med["trie_decode"] / med["plain"] - 1,
            "genre_overhead": med["genre"] / med["plain"] - 1,
            "trie_decode_in_processor_ms_per_step": 1e3 * inside["trie_decode"] / (repeats * new_tokens),
            "trie_decode_general_in_processor_ms_per_step": 1e3 * inside["trie_decode-general"] / (repeats * new_tokens),
            "genre_in_processor_ms_per_step": 1e3 * inside["genre"] / (repeats * new_tokens),
            "fill_in_processor_ms_per_step": 1e3 * inside["fill"] / (repeats * new_tokens),
            "same_output_as_genre": same,
            "outputs_valid": valid,
        }
        records.append(record)
        print(
            f"  generate batch {batch}: plain {med['plain']:.2f}s, trie_decode {med['trie_decode']:.2f}s "
            f"(+{100 * record['trie_decode_overhead']:.1f}%, {record['trie_decode_in_processor_ms_per_step']:.3f} ms/step "
            f"in processor), genre {med['genre']:.2f}s (+{100 * record['genre_overhead']:.1f}%, "
            f"{record['genre_in_processor_ms_per_step']:.3f} ms/step); in processor: general path "
            f"{record['trie_decode_general_in_processor_ms_per_step']:.3f}, fill {record['fill_in_processor_ms_per_step']:.3f} "
            f"ms/step; same output: {same}",
            flush=True,
        )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "generate.json").write_text(json.dumps({"records": records}, indent=2))
    return {"records": records}
