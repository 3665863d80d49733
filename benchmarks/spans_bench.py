"""Text spans' per-step cost (issue 23 item 7): free rows, rows inside a 133k-value span, 1 vs 100 spans, and the
transformers processor, as ratios to ``logits.fill_(-inf)`` timed in the same loop.

SmolLM2's tokenizer (V = 49,152), float32 logits, one torch thread, CPU, median of the timed steps:

- ``free``: rows outside every span (FREE): ``TrieConstraint.advance`` (the trigger automaton's gather) plus
  ``mask_`` (dead trigger tokens only) per step, fed the tokens of prose that completes no ``after``;
- ``in span``: rows inside the span of 133k titles (``benchmarks.data``, kind ``titles``): ``mask_`` at the trie's
  root (just after ``"city": "``) and at depth 1 (a random entry's first token per row);
- ``100 spans``: the same two measurements with 100 spans (100 ``after`` keys, 249 country names each) and with
  1 span of the same names;
- ``processor``: ``TrieLogitsProcessor(tokenizer=tok, spans=...)`` called as ``generate`` calls it (the ids grow
  by one token per call) over a JSON answer, batch 1.

Run: ``python -m benchmarks.spans_bench`` (about two minutes, most of it tokenizing the 133k values), or
``python -m benchmarks --suite spans``.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

__all__ = ["run_spans_suite", "main"]

PROSE = ("The weather in the north was mild this year, and the harvest came early; farmers said the rain had "
         "been kind to them. ") * 4


def _median_ratio(fn: Callable[[], None], buf: Any, src: Any, steps: int) -> tuple[float, float]:
    """(median seconds of ``fn``, median seconds of ``buf.fill_(-inf)``), each step timed beside the fill."""
    ours, fill = [], []
    for _ in range(steps + 5):
        buf.copy_(src); t = time.perf_counter(); buf.fill_(float("-inf")); fill.append(time.perf_counter() - t)
        buf.copy_(src); t = time.perf_counter(); fn(); ours.append(time.perf_counter() - t)
    return statistics.median(ours[5:]), statistics.median(fill[5:])


def _record(name: str, batch: int, ours: float, fill: float) -> dict:
    return {"case": name, "batch": batch, "ms_per_step": round(ours * 1e3, 4), "fill_ms": round(fill * 1e3, 4),
            "x_fill": round(ours / fill, 2), "us_per_step": round(ours * 1e6, 1)}


def _constraint(spans: list, tok: Any) -> Any:
    from trie_decode.constraint import SpanRules, TrieConstraint
    from trie_decode.fields import FieldRules

    tries, fields = FieldRules.build(spans, tok)
    return TrieConstraint(tries, SpanRules(end_token_id=tok.eos_token_id, on_complete="release", fields=fields), "cpu")


def _free_cost(c: Any, tok: Any, batch: int, steps: int, V: int) -> tuple[float, float]:
    """advance + mask_ for FREE rows fed prose tokens (one token per step, every row the same)."""
    import torch

    ids = tok(PROSE, add_special_tokens=False)["input_ids"]
    box = {"s": c.start(batch), "i": 0}
    src, buf = torch.randn(batch, V), torch.empty(batch, V)

    def step() -> None:
        t = ids[box["i"] % len(ids)]
        box["i"] += 1
        box["s"] = c.advance(box["s"], torch.full((batch,), t, dtype=torch.long))
        c.mask_(buf, box["s"])

    ours, fill = _median_ratio(step, buf, src, steps)
    assert bool((box["s"].node < 0).all()), "prose must leave every row FREE"
    return ours, fill


def _span_states(c: Any, tok: Any, batch: int, after: str, k: int, seed: int) -> tuple[Any, Any]:
    """Rows just after span ``k``'s ``after`` (at its root) and at depth 1 (a random root child each)."""
    import numpy as np
    import torch

    tail = tok('{"x": 1, ' + after, add_special_tokens=False)["input_ids"]
    root = c.start(batch, tails=torch.tensor([tail] * batch))
    assert bool((root.node >= 0).all()) and bool((root.tree == k).all()), "the prompt must end inside the span"
    tokens, _ = c.tries[k].children(c.tries[k].root)
    pick = np.random.default_rng(seed).integers(0, len(tokens), size=batch)
    depth1 = c.advance(root, torch.from_numpy(tokens[pick].astype(np.int64)))
    return root, depth1


def _mask_cost(c: Any, state: Any, batch: int, steps: int, V: int) -> tuple[float, float]:
    import torch

    src, buf = torch.randn(batch, V), torch.empty(batch, V)
    return _median_ratio(lambda: c.mask_(buf, state), buf, src, steps)


def _template_cost(c: Any, path: list[int], batch: int, steps: int, V: int) -> tuple[float, float]:
    """advance + mask_ of rows writing a template's whole output ``path`` (fixed text forced, the slots' values),
    from its start again after the end token; every row the same."""
    import torch

    box = {"s": c.start(batch), "i": 0}
    src, buf = torch.randn(batch, V), torch.empty(batch, V)

    def step() -> None:
        i = box["i"] % len(path)
        box["i"] += 1
        if i == 0:
            box["s"] = c.start(batch)
        c.mask_(buf, box["s"])
        assert bool(torch.isfinite(buf[:, path[i]]).all()), "the template blocked its own path"
        box["s"] = c.advance(box["s"], torch.full((batch,), path[i], dtype=torch.long))

    return _median_ratio(step, buf, src, steps)


def _processor_cost(tok: Any, spans: list, text: str, V: int) -> tuple[float, float, int]:
    """Per call of the processor over ``text``'s tokens after a prompt, ids growing by one per call (batch 1)."""
    import torch

    from trie_decode.integrations.transformers import TrieLogitsProcessor

    from .ours import _sample  # generate's greedy/sampling loop, as the processor recognizes it

    processor = TrieLogitsProcessor(tokenizer=tok, spans=spans)
    prompt = tok("Answer in JSON.\n", add_special_tokens=False)["input_ids"]
    ids = torch.tensor([prompt + tok(text, add_special_tokens=False)["input_ids"]])
    src, buf = torch.randn(1, V), torch.empty(1, V)
    ours, fill = [], []
    for rep in range(3):
        processor = TrieLogitsProcessor(tokenizer=tok, spans=spans) if rep else processor
        for n in range(len(prompt), ids.shape[1] + 1):
            buf.copy_(src); t = time.perf_counter(); buf.fill_(float("-inf")); fill.append(time.perf_counter() - t)
            buf.copy_(src); t = time.perf_counter(); _sample(processor, ids[:, :n], buf); ours.append(time.perf_counter() - t)
            chosen = int(ids[0, n]) if n < ids.shape[1] else None
            assert chosen is None or bool(torch.isfinite(buf[0, chosen])), "the processor blocked the text's token"
    return statistics.median(ours[3:]), statistics.median(fill[3:]), ids.shape[1] - len(prompt)


def run_spans_suite(quick: bool = False, out_dir: Path | None = None) -> dict:
    """Measure every case; returns ``{"records": [...]}`` and writes ``spans.json`` into ``out_dir`` if given."""
    import pycountry
    import torch
    from transformers import AutoTokenizer

    from trie_decode.fields import Span
    from trie_decode.integrations.smollm2 import smollm2_path

    from .data import make_names

    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(smollm2_path())
    V = len(tok)
    steps = 30 if quick else 200
    records = []

    t = time.perf_counter()
    titles = make_names("titles", 20_000 if quick else 133_000, seed=0)
    big = [Span(titles, after='"city": "')]
    c_big = _constraint(big, tok)
    print(f"span of {len(titles):,} titles: {c_big.tries[0].num_nodes:,} nodes, built in {time.perf_counter() - t:.1f} s")

    for b in (1, 64):
        records.append(_record(f"free rows, 1 span of {len(titles) // 1000}k (advance + mask_)", b,
                               *_free_cost(c_big, tok, b, steps, V)))
    for b in (1, 64):
        root, depth1 = _span_states(c_big, tok, b, '"city": "', 0, seed=b)
        records.append(_record(f"in span of {len(titles) // 1000}k, at the root (mask_)", b, *_mask_cost(c_big, root, b, steps, V)))
        records.append(_record(f"in span of {len(titles) // 1000}k, depth 1 (mask_)", b, *_mask_cost(c_big, depth1, b, steps, V)))

    countries = sorted({c.name for c in pycountry.countries})
    t = time.perf_counter()
    many = _constraint([Span(countries, after=f'"key{i}": "') for i in range(100)], tok)
    print(f"100 spans of {len(countries)} countries built in {time.perf_counter() - t:.1f} s; "
          f"automaton states: {many.rules.fields.triggers.num_states}")
    one = _constraint([Span(countries, after='"key0": "')], tok)
    for name, c, k in (("1 span", one, 0), ("100 spans", many, 57)):
        b = 64
        records.append(_record(f"{name}: free rows (advance + mask_)", b, *_free_cost(c, tok, b, steps, V)))
        _, depth1 = _span_states(c, tok, b, f'"key{k}": "', k, seed=1)
        records.append(_record(f"{name}: in span, depth 1 (mask_)", b, *_mask_cost(c, depth1, b, steps, V)))
    # The worst layout for 100 spans: every row of the batch in another span (row i in span 37 * i % 100).
    spread = [_span_states(many, tok, 1, f'"key{37 * i % 100}": "', 37 * i % 100, seed=i)[1] for i in range(64)]
    from trie_decode.constraint import RowState

    mixed = RowState(*(torch.cat([getattr(s, f) for s in spread]) for f in ("node", "tree", "text")))
    records.append(_record("100 spans: in span, depth 1, every row in another span (mask_)", 64,
                           *_mask_cost(many, mixed, 64, steps, V)))

    from trie_decode.constraint import TrieConstraint
    from trie_decode.templates import Template

    t = time.perf_counter()
    template = Template('{"city": "{city}", "country": "{country}"}', city=titles, country=countries)
    c_tpl = TrieConstraint(*template.rules(tok, tok.eos_token_id), "cpu")
    print(f"template with {len(titles):,} cities and {len(countries)} countries built in {time.perf_counter() - t:.1f} s")
    out = json.dumps({"city": titles[7], "country": countries[3]}, ensure_ascii=False)
    path = tok(out, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    forced = len(c_tpl.forced_tokens(c_tpl.start(1))[0])
    for b in (1, 64):
        records.append(_record(f"template, whole output ({len(path)} tokens, {forced}+ forced; advance + mask_)", b,
                               *_template_cost(c_tpl, path, b, steps, V)))

    # Written as the span writes its values (escape="json": JSON-escaped, non-ASCII kept), as is the template's.
    answer = json.dumps({"city": titles[7], "population": 120000, "note": "founded in the twelfth century"},
                        ensure_ascii=False)
    ours, fill, n = _processor_cost(tok, big, answer, V)
    records.append(_record(f"processor, JSON answer ({n} tokens, mixed free/in span)", 1, ours, fill))
    ours, fill, n = _processor_cost(tok, big, PROSE[:300], V)
    records.append(_record(f"processor, prose ({n} tokens, all free)", 1, ours, fill))

    print(f"\nper step, V={V}, float32, 1 thread; x fill = ratio to logits.fill_(-inf) timed in the same loop")
    for r in records:
        print(f"  B={r['batch']:3d}  {r['case']:58s} {r['us_per_step']:9.1f} us  fill {r['fill_ms'] * 1e3:7.1f} us  "
              f"{r['x_fill']:6.2f}x fill")
    result = {"suite": "spans", "vocab_size": V, "records": records}
    if out_dir is not None:
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "spans.json").write_text(json.dumps(result, indent=2))
    return result


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="20k values and 30 steps per case")
    p.add_argument("--out", type=Path, default=None, help="folder for spans.json")
    args = p.parse_args()
    run_spans_suite(args.quick, args.out)


if __name__ == "__main__":
    main()
