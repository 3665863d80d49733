"""Live catalog costs on a 1M-entry base (issue 15, item 6): changes, snapshots, and the per-step mask.

Run: ``python -m trie_decode.bench.live_bench`` (about a minute; prints the figures of docs/results/live_catalog.txt).
"""
import statistics
import time

import numpy as np
import torch

from trie_decode.catalogs import catalog_from_codes
from trie_decode.constraint import SpanRules, TrieConstraint
from trie_decode.live import LiveCatalog, SnapshotConstraint

torch.set_num_threads(1)
V, N, OFF = 49152, 1_000_000, 49152 - 1024
rng = np.random.default_rng(0)
codes = rng.integers(0, 256, size=(N, 4))
t = time.perf_counter()
base = catalog_from_codes(codes, vocab_size=V, codebook_size=256, token_offset=OFF, keys=[f"item{i}" for i in range(N)])
print(f"base: {base.num_entries} entries, {base.num_nodes} nodes, built in {time.perf_counter() - t:.2f} s")

def fresh(k, tag):
    c = rng.integers(0, 256, size=(k, 4)) + OFF + np.arange(4) * 256
    return c, [f"{tag}{i}" for i in range(k)]

def ms(f):
    t = time.perf_counter(); f(); return (time.perf_counter() - t) * 1e3

cat = LiveCatalog(base)
# One-time costs per base (first use).
seqs, keys = fresh(10, "warm")
print(f"first add (CPU edge keys of the base, once per base): {ms(lambda: cat.add(seqs, keys=keys)):.1f} ms")
print(f"first remove by key (key index of the base, once per base): {ms(lambda: cat.remove(['item0'])):.1f} ms")
print(f"first snapshot + constraint with tombstones (depth-first entry order of the base, once per base): "
      f"{ms(lambda: cat.snapshot().constraint(SpanRules(0), 'cpu')):.1f} ms")
print(f"base identity (delta files, once per base): {ms(cat.identity):.1f} ms")

rules = SpanRules(end_token_id=0)
for delta_size in (1000, 10000):
    cat = LiveCatalog(base)
    s, k = fresh(delta_size, f"d{delta_size}-")
    cat.add(s, keys=k)
    cat.remove([f"item{i}" for i in range(1, delta_size // 10 + 1)])
    cat.snapshot().constraint(rules, "cpu")
    rows = {"add 100": [], "remove 100 base": [], "remove 100 added": [], "snapshot (delta rebuild)": [],
            "snapshot constraint (cpu)": [], "add 100 + snapshot + constraint": []}
    for rep in range(15):
        s2, k2 = fresh(100, f"r{delta_size}-{rep}-")
        rows["add 100"].append(ms(lambda: cat.add(s2, keys=k2)))
        rows["snapshot (delta rebuild)"].append(ms(cat.snapshot))
        rows["snapshot constraint (cpu)"].append(ms(lambda: cat.snapshot().constraint(rules, "cpu")))
        rows["remove 100 added"].append(ms(lambda: cat.remove(k2, missing_ok=True)))
        base_keys = [f"item{500000 + rep * 100 + i}" for i in range(100)]
        rows["remove 100 base"].append(ms(lambda: cat.remove(base_keys)))
        s3, k3 = fresh(100, f"q{delta_size}-{rep}-")
        def full():
            cat.add(s3, keys=k3); cat.snapshot().constraint(rules, "cpu")
        rows["add 100 + snapshot + constraint"].append(ms(full))
        cat.remove(k3, missing_ok=True)
    print(f"\ndelta of {delta_size} added + {delta_size // 10} removed (median of 15):")
    for name, v in rows.items():
        print(f"  {name:36s} {statistics.median(v):8.3f} ms")

cat = LiveCatalog(base)
s, k = fresh(10000, "c-"); cat.add(s, keys=k); cat.remove([f"item{i}" for i in range(1, 1001)])
print(f"\ncompact() of the 1M base with +10000/-1000: {ms(cat.compact) / 1e3:.2f} s")

# Per-step mask cost.
print("\nper-step mask, V=49152, float32, rows at depth 1 of random live entries; median of 30 steps; x fill = ratio to "
      "logits.fill_(-inf) timed in the same loop")
def states(c, b):
    st = c.start(b)
    first = torch.from_numpy(codes[rng.integers(0, N, size=b), 0] + OFF)
    return c.advance(st, first)
for kernel in ("native", "torch"):
    plain = TrieConstraint(base, rules, "cpu", kernel=kernel)
    cats = {}
    for delta_size in (1000, 10000):
        c = LiveCatalog(base)
        s, k = fresh(delta_size, f"m{delta_size}-")
        c.add(s, keys=k)
        c.remove(list(range(0, N, N // (delta_size // 10))))
        cats[delta_size] = SnapshotConstraint(c.snapshot(), rules, "cpu", kernel=kernel)
    for b in (1, 64, 256):
        src = torch.randn(b, V)
        buf = torch.empty_like(src)
        cs = {"base (TrieConstraint)": (plain, states(plain, b))}
        for d, c in cats.items():
            cs[f"snapshot +{d}/-{d // 10}"] = (c, states(c, b))
        times = {name: [] for name in ["fill"] + list(cs)}
        for rep in range(35):
            buf.copy_(src); t = time.perf_counter(); buf.fill_(float("-inf")); times["fill"].append(time.perf_counter() - t)
            for name, (c, st) in cs.items():
                buf.copy_(src); t = time.perf_counter(); c.mask_(buf, st); times[name].append(time.perf_counter() - t)
        fill = statistics.median(times["fill"][5:])
        line = f"  {kernel:6s} B={b:3d}  fill {fill * 1e3:7.3f} ms"
        for name in cs:
            m = statistics.median(times[name][5:])
            line += f" | {name} {m * 1e3:7.3f} ms ({m / fill:4.1f}x fill)"
        print(line)
