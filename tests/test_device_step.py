"""The device step (the torch kernel of CUDA and MPS) has no host synchronization and fixed shapes.

Proved on this CPU-only machine two ways: the step runs under a guard that raises on every host read of a tensor
(``item``, ``tolist``, ``bool``, ``nonzero``, ``cpu``, ``numpy``, ``unique``...), and it compiles with
``torch.compile(fullgraph=True)`` (a graph break would mean Python looked at a tensor's value) and the compiled step
gives the reference's masks. The CUDA-only tests beside them run wherever a GPU exists: the processor inside
``generate`` under ``torch.cuda.set_sync_debug_mode("error")``, and the step captured in a CUDA graph.
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from trie_decode import TokenTrie
from trie_decode.constraint import RowState, SpanRules, TrieConstraint

from reference import SpanReference

V = 40
END = 1
MODES = [
    dict(on_complete="eos"),
    dict(on_complete="release"),
    dict(on_complete="repeat", separator=(3, 4)),
    dict(on_complete="eos", trigger=(5, 6)),
    dict(on_complete="release", trigger=(7,)),
]


class HostSync(AssertionError):
    pass


@contextlib.contextmanager
def no_host_sync():
    """Raise HostSync on any way of reading a tensor's values on the host (the GPU syncs of the issue)."""
    names = ["item", "tolist", "__bool__", "nonzero", "cpu", "numpy", "__int__", "__float__", "__index__", "unique"]
    saved = {n: getattr(torch.Tensor, n) for n in names}
    saved_fns = {n: getattr(torch, n) for n in ("unique", "nonzero", "equal")}

    def boom(name):
        def raiser(*args, **kwargs):
            raise HostSync(f"host sync in the device step: {name}")
        return raiser

    try:
        for n in names:
            setattr(torch.Tensor, n, boom(f"Tensor.{n}"))
        for n in saved_fns:
            setattr(torch, n, boom(f"torch.{n}"))
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)
        for n, f in saved_fns.items():
            setattr(torch, n, f)


def _tries(rng):
    out = []
    for _ in range(3):
        seqs = [[rng.randrange(2, V) for _ in range(rng.randrange(1, 5))] for _ in range(rng.randrange(3, 30))]
        out.append(TokenTrie.from_sequences(seqs + [[8], [8, 9]], vocab_size=V))
    return out


def test_the_guard_catches_a_sync():
    with no_host_sync(), pytest.raises(HostSync):
        torch.tensor([1, 2]).tolist()
    with no_host_sync(), pytest.raises(HostSync):
        bool(torch.tensor([True]).any())


@pytest.mark.parametrize("mode", MODES, ids=lambda m: "-".join(str(v) for v in m.values()))
@pytest.mark.parametrize("dense", [False, True])
def test_torch_step_never_reads_the_device(mode, dense):
    rng = random.Random(str(mode) + str(dense))
    tries = _tries(rng)
    rules = SpanRules(end_token_id=END, **mode)
    c = TrieConstraint(tries, rules, "cpu", dense_min_fanout=3 if dense else None, kernel="torch")
    rows = 7
    tree = torch.tensor([rng.randrange(3) for _ in range(rows)])
    tails = torch.randint(2, V, (rows, 2))
    state = c.start(rows, tree, tails)  # setup may read the device; the step may not
    for _ in range(6):
        logits = torch.randn(rows, V + 3)
        tokens = torch.randint(0, V, (rows,))
        with no_host_sync():
            c.mask_(logits, state)
            c.mask_(logits, state, inplace=False)
            c.mask_(torch.randn(rows + 2, V + 3), state, torch.arange(rows) + 1)  # a row mapping (vLLM)
            tails = torch.cat([tails[:, 1:], tokens.unsqueeze(1)], dim=1)
            state = c.advance(state, tokens, tails)
            c.stop_at_forced(state, torch.full((rows,), 2), torch.zeros(rows, dtype=torch.bool))


def test_torch_step_on_zero_rows_and_fewer_states_than_logits_rows():
    """Zero state rows mask nothing and advance to nothing; without a row map, R < B states mask the first R logits
    rows as the CPU kernels do; more states than logits rows is a named IndexError. Sizes only: no host read."""
    rng = random.Random(3)
    tries = _tries(rng)
    rules = SpanRules(end_token_id=END)
    c = TrieConstraint(tries, rules, "cpu", kernel="torch")
    ref = c.with_kernel("numpy")
    logits = torch.randn(5, V + 3)
    empty = c.start(0, torch.zeros(0, dtype=torch.long))
    state = c.start(3, torch.tensor([0, 2, 1]))
    with no_host_sync():
        untouched = [c.mask_(logits.clone(), empty), c.mask_(logits.clone(), empty, torch.zeros(0, dtype=torch.long))]
        advanced = c.advance(empty, torch.zeros(0, dtype=torch.long))
        got = c.mask_(logits.clone(), state)
    assert all(torch.equal(u, logits) for u in untouched)
    assert advanced.node.shape == (0,)
    assert torch.equal(got, ref.mask_(logits.clone(), state))
    assert torch.equal(got[3:], logits[3:])
    with pytest.raises(IndexError, match="3 states for a batch of 2 logits rows"):
        c.mask_(torch.randn(2, V), state)


@pytest.mark.slow
def test_compiled_step_fullgraph_matches_the_reference():
    """torch.compile(fullgraph=True) of advance + mask: no graph break anywhere in the step, across random tries,
    every on_complete mode, triggers and batches mixing tries; the compiled masks equal the reference's."""
    torch._dynamo.reset()
    rng = random.Random(7)
    for mode in (MODES[0], MODES[2], MODES[4]):
        tries = _tries(rng)
        rules = SpanRules(end_token_id=END, **mode)
        c = TrieConstraint(tries, rules, "cpu", dense_min_fanout=4, kernel="torch")

        def step(node, tree, tokens, tails, logits):
            new = c.advance(RowState(node, tree), tokens, tails)
            return new.node, c.mask_(logits, new, inplace=False)

        compiled = torch.compile(step, fullgraph=True, dynamic=False)
        rows = 6
        tree = torch.tensor([rng.randrange(3) for _ in range(rows)])
        tails = torch.randint(2, V, (rows, 3))
        refs = [SpanReference({tuple(s) for s in tries[t].sequences()}, rules, tuple(tails[i].tolist()))
                for i, t in enumerate(tree.tolist())]
        node = c.start(rows, tree, tails).node
        allowed = [r.allowed() for r in refs]
        for _ in range(8):
            toks = [rng.choice(sorted(a)) if a is not None and rng.random() < 0.9 else rng.randrange(V) for a in allowed]
            if rules.trigger and rng.random() < 0.5:
                toks = [rules.trigger[-1] if a is None else t for t, a in zip(toks, allowed)]
            tokens = torch.tensor(toks)
            tails = torch.cat([tails[:, 1:], tokens.unsqueeze(1)], dim=1)
            for r, t in zip(refs, toks):
                r.step(t)
            node, masked = compiled(node, tree, tokens, tails, torch.randn(rows, V))
            allowed = [r.allowed() for r in refs]
            for i, a in enumerate(allowed):
                got = set(masked[i].isfinite().nonzero().flatten().tolist())
                assert got == (set(range(V)) if a is None else a), (mode, i)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (runs wherever one exists)")


@cuda
def test_cuda_generate_has_no_sync_in_the_processor(tiny_llama):
    from trie_decode.integrations.transformers import TrieLogitsProcessor

    model = tiny_llama.to("cuda")
    trie = TokenTrie.from_sequences([[100, 200, 300], [100, 250], [400]], vocab_size=model.config.vocab_size)
    proc = TrieLogitsProcessor(trie, end_token_id=END)
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]], device="cuda")
    proc(ids, torch.randn(2, model.config.vocab_size, device="cuda"))  # first call: setup may sync
    scores = torch.randn(2, model.config.vocab_size, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for t in (100, 200):
            ids = torch.cat([ids, torch.full((2, 1), t, device="cuda")], dim=1)
            proc(ids, scores)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        model.to("cpu")


@cuda
def test_cuda_graph_capture_of_the_step():
    tries = _tries(random.Random(3))
    c = TrieConstraint(tries, SpanRules(end_token_id=END), "cuda")
    rows = 4
    tree = torch.tensor([0, 1, 2, 0], device="cuda")
    state = c.start(rows, tree)
    tokens = torch.randint(0, V, (rows,), device="cuda")
    logits = torch.randn(rows, V, device="cuda")
    c.mask_(logits, c.advance(state, tokens))  # warm up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        new = c.advance(state, tokens)
        c.mask_(logits, new)
    logits.copy_(torch.randn(rows, V, device="cuda"))
    graph.replay()
    expected = c.mask_(logits.clone(), c.advance(state, tokens))
    assert torch.equal(logits.isfinite(), expected.isfinite())
