"""Live catalog costs on a 1M-entry base (issue 15 item 6, issue 22): changes, views, compactions, the per-step mask.

A view decodes one trie (the base, or the newest compacted one) with the entries removed since as a deny filter
(trie_decode.live); additions become visible after a background compaction.

Run: ``python -m benchmarks.live_bench`` (about a minute; prints the figures of docs/results/live_catalog.txt).
"""
import statistics
import time

import numpy as np
import torch

from trie_decode.catalogs import catalog_from_codes
from trie_decode.constraint import SpanRules, TrieConstraint
from trie_decode.live import LiveCatalog

torch.set_num_threads(1)
V, N, OFF = 49152, 1_000_000, 49152 - 1024
rng = np.random.default_rng(0)
codes = rng.integers(0, 256, size=(N, 4))
t = time.perf_counter()
base = catalog_from_codes(codes, vocab_size=V, codebook_size=256, token_offset=OFF, keys=[f"item{i}" for i in range(N)])
print(f"base: {base.num_entries} entries, {base.num_nodes} nodes, built in {time.perf_counter() - t:.2f} s")
rules = SpanRules(end_token_id=0)


def fresh(k, tag):
    c = rng.integers(0, 256, size=(k, 4)) + OFF + np.arange(4) * 256
    return c, [f"{tag}{i}" for i in range(k)]


def ms(f):
    t = time.perf_counter(); f(); return (time.perf_counter() - t) * 1e3


def request_setup(cat, b=1):
    """What a request does when it starts: take the view, its constraint and its deny filter."""
    view = cat.snapshot().view(rules)
    c = view.constraint(rules, "cpu")
    return view, c, view.filters(c, b)


cat = LiveCatalog(base)
# One-time costs per base (first use); removals first, so that no background compaction runs meanwhile.
print(f"first remove by key (key index of the base, once per base): {ms(lambda: cat.remove(['item0'])):.1f} ms")
print(f"first view + constraint + deny filter with tombstones (depth-first entry order of the base, once per base): "
      f"{ms(lambda: request_setup(cat)):.1f} ms")
seqs, keys = fresh(10, "warm")
print(f"first add (CPU edge keys of the base, once per base): {ms(lambda: cat.add(seqs, keys=keys)):.1f} ms")
print(f"base identity (delta files, once per base): {ms(cat.identity):.1f} ms")
cat.wait_compacted()
# The timings below wait (untimed) for the background compaction a view asked for before the next one: on a busy
# machine the compaction thread competes for the CPU with the requests (about 1 s per million entries per version).

for delta_size in (1000, 10000):
    cat = LiveCatalog(base)
    s, k = fresh(delta_size, f"d{delta_size}-")
    cat.add(s, keys=k)
    cat.wait_compacted()
    cat.remove([f"item{i}" for i in range(1, delta_size // 10 + 1)])
    request_setup(cat)
    rows = {"add 100": [], "remove 100 base": [], "remove 100 added": [], "snapshot (delta rebuild)": [],
            "view + constraint + deny filter": [], "add 100 + snapshot + request setup": [],
            "remove 100 + snapshot + request setup": []}
    for rep in range(15):
        s2, k2 = fresh(100, f"r{delta_size}-{rep}-")
        rows["add 100"].append(ms(lambda: cat.add(s2, keys=k2)))
        rows["snapshot (delta rebuild)"].append(ms(cat.snapshot))
        rows["view + constraint + deny filter"].append(ms(lambda: request_setup(cat)))
        cat.wait_compacted()
        rows["remove 100 added"].append(ms(lambda: cat.remove(k2, missing_ok=True)))
        base_keys = [f"item{500000 + rep * 100 + i}" for i in range(100)]
        rows["remove 100 base"].append(ms(lambda: cat.remove(base_keys)))
        s3, k3 = fresh(100, f"q{delta_size}-{rep}-")
        rows["add 100 + snapshot + request setup"].append(ms(lambda: (cat.add(s3, keys=k3), request_setup(cat))))
        cat.wait_compacted()
        more = [f"item{700000 + rep * 100 + i}" for i in range(100)]
        rows["remove 100 + snapshot + request setup"].append(ms(lambda: (cat.remove(more), request_setup(cat))))
        cat.remove(k3, missing_ok=True)
    print(f"\ndelta of {delta_size} added (compacted) + {delta_size // 10} removed since (median of 15):")
    for name, v in rows.items():
        print(f"  {name:40s} {statistics.median(v):8.3f} ms")

cat = LiveCatalog(base)
s, k = fresh(10000, "c-"); cat.add(s, keys=k); cat.remove([f"item{i}" for i in range(1, 1001)])
print(f"\ncompact() of the 1M base with +10000/-1000: {ms(cat.compact) / 1e3:.2f} s")
t = time.perf_counter()
cat.snapshot().view(rules)  # asks for the background compaction and returns at once
asked = time.perf_counter() - t
cat.wait_compacted()
print(f"background compaction (+ its entry order and CPU arrays) of the same: {time.perf_counter() - t:.2f} s "
      f"(the view that asked for it returned in {asked * 1e3:.1f} ms)")

# Per-step mask cost.
print("\nper-step mask, V=49152, float32, rows at depth 1 of random live entries; median of 30 steps; x fill = ratio to "
      "logits.fill_(-inf) timed in the same loop")


def states(c, b, f):
    st = c.start(b)
    first = torch.from_numpy(codes[rng.integers(0, N, size=b), 0] + OFF)
    return c.advance(st, first, filters=f)


for kernel in ("native", "torch"):
    plain = TrieConstraint(base, rules, "cpu", kernel=kernel)
    views = {}
    for delta_size in (1000, 10000):
        removed = list(range(0, N, N // (delta_size // 10)))
        c = LiveCatalog(base)  # removals only (additions not compacted yet): the base with its tombstones
        s, k = fresh(delta_size, f"m{delta_size}-")
        c.remove(removed)
        views[f"base -{delta_size // 10}"] = c.snapshot().view(rules)
        c = LiveCatalog(base)  # compacted additions, removals since: the compacted trie with a deny filter
        c.add(s, keys=k)
        c.wait_compacted()
        c.remove(removed)
        views[f"compacted +{delta_size}/-{delta_size // 10}"] = c.snapshot().view(rules)
    for b in (1, 64, 256):
        src = torch.randn(b, V)
        buf = torch.empty_like(src)
        cs = {"base (TrieConstraint)": (plain, states(plain, b, None), None)}
        for name, view in views.items():
            c = view.constraint(rules, "cpu", kernel=kernel)
            f = view.filters(c, b)
            cs[name] = (c, states(c, b, f), f)
        times = {name: [] for name in ["fill"] + list(cs)}
        for rep in range(35):
            buf.copy_(src); t = time.perf_counter(); buf.fill_(float("-inf")); times["fill"].append(time.perf_counter() - t)
            for name, (c, st, f) in cs.items():
                buf.copy_(src); t = time.perf_counter(); c.mask_(buf, st, filters=f); times[name].append(time.perf_counter() - t)
        fill = statistics.median(times["fill"][5:])
        line = f"  {kernel:6s} B={b:3d}  fill {fill * 1e3:7.3f} ms"
        for name in cs:
            m = statistics.median(times[name][5:])
            line += f" | {name} {m * 1e3:7.3f} ms ({m / fill:4.1f}x fill)"
        print(line)
