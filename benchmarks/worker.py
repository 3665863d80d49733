"""The measuring side of the benchmark: runs one peer in its own process and reports JSON lines.

Why a separate process: peers can hang in native code, panic, or take all the memory at large sizes; the parent
(:mod:`benchmarks.suites`) watches the time and memory of this process and kills it when a limit is passed,
then records the failure with the size and the time spent. A crash of one peer never takes the run down.

Protocol: the job is one JSON object on stdin; every event is one JSON object per line on the original stdout
(libraries' own prints are redirected to stderr so they cannot corrupt it):

- ``{"event": "phase", "peer": p, "size": n, "phase": "prepare|setup|check|measure|build", "batch": B,
  "limit_s": s}``: the parent allows ``limit_s`` seconds until the next event.
- ``{"event": "record", "record": {...}}``: a finished (or failed-in-Python) measurement.
- ``{"event": "peer_done", "peer": p, "elapsed_s": s}``: a step job runs its peers one after the other.
- ``{"event": "done"}``.

The step measurement (one peer, one list of N names, batch B, vocabulary V), per repeat:

1. ``floor``: S steps of ``logits.fill_(-inf)`` on the same (B, V) tensor, each step timed, inside the very decode
   loop of step 2 (the same reset before each step, the same checks after it). Timing the floor in the loop
   matters on a CPU: the checks between steps evict the caches, and a fill timed back to back with nothing in
   between (also reported, as ``floor_tight_ms`` and ``ratio_tight``) was measured 1.6x cheaper than the same fill
   inside the loop, which would charge every peer for the protocol's own cache traffic.
2. ``peer``: ``start(B)``, then S steps. Before each step the logits are reset to the same random scores
   (untimed); the step (advance by the previous tokens + mask) is timed. Each row walks a random name's canonical
   tokenization then EOS, and takes a new random name after EOS. After each step (untimed) the walk checks that
   the row's next token kept its score, and counts the tokens left allowed.

A warmup decode comes first; its first step is reported as ``first_step_ms`` (peers that defer work to the first
step pay it there). The headline is the median over repeats of each repeat's mean step time (a decode mixes shallow
and deep steps; the mean is what a decode costs), against the floor measured in the same process (the median of its
steps: one constant op), and their ratio.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from typing import Any

__all__ = ["main", "measure_step", "RowWalk"]

_PROTO: Any = None


def _emit(obj: dict[str, Any]) -> None:
    _PROTO.write(json.dumps(obj, default=_jsonable) + "\n")
    _PROTO.flush()


def _jsonable(x: Any) -> Any:
    try:
        import numpy as np

        if isinstance(x, np.generic):
            return x.item()
    except ImportError:
        pass
    return str(x)


def _phase(size: int, phase: str, limit_s: float, batch: int | None = None, peer: str | None = None) -> None:
    _emit({"event": "phase", "peer": peer, "size": size, "phase": phase, "batch": batch, "limit_s": limit_s})


class RowWalk:
    """B rows, each walking random names' canonical tokenizations followed by EOS, restarting after EOS.

    Args:
        flat, offsets: the names' canonical tokenizations (see :class:`benchmarks.data.NameList`).
        pool: indices of the names rows may draw (names a peer is known to reject are left out).
        batch_size: B.
        eos: the EOS id.
        rng: a ``numpy.random.Generator``.
    """

    def __init__(self, flat: Any, offsets: Any, pool: Any, batch_size: int, eos: int, rng: Any) -> None:
        self._flat = flat
        self._offsets = offsets
        self._pool = pool
        self._eos = eos
        self._rng = rng
        self._draws: list[int] = []
        self.current: list[int] = [0] * batch_size
        self.rows: list[list[int]] = []
        for i in range(batch_size):
            self.rows.append(self._new_name(i))
        self.pos = [0] * batch_size
        self.names_started = batch_size

    def _new_name(self, row: int) -> list[int]:
        if not self._draws:
            self._draws = self._rng.choice(self._pool, size=1024).tolist()
        i = self._draws.pop()
        self.current[row] = i
        return self._flat[self._offsets[i] : self._offsets[i + 1]].tolist() + [self._eos]

    def expected(self) -> list[int]:
        """Each row's next token (its name's next token, or EOS at the end)."""
        return [row[p] for row, p in zip(self.rows, self.pos)]

    def advance(self, chosen: list[int]) -> None:
        """Move every row past its chosen token; rows that chose EOS start a new name."""
        for i, t in enumerate(chosen):
            if t == self._eos:
                self.rows[i] = self._new_name(i)
                self.pos[i] = 0
                self.names_started += 1
            else:
                self.pos[i] += 1


def measure_step(
    peer: Any,
    flat: Any,
    offsets: Any,
    pool: Any,
    names: list[str],
    batch_size: int,
    vocab: int,
    eos: int,
    device: Any,
    *,
    steps: int,
    repeats: int,
    warm_steps: int,
    budget_s: float,
    seed: int,
) -> dict[str, Any]:
    """Measure one peer at one batch size against the floor (see the module docstring). Returns a record dict."""
    import numpy as np
    import torch

    from .peers import FloorPeer
    from .timing import Stopwatch, device_sync, summarize

    sync = device_sync(device)
    rng = np.random.default_rng(seed * 1009 + batch_size)
    gen = torch.Generator(device="cpu").manual_seed(seed * 7919 + batch_size)
    base = torch.randn((batch_size, vocab), generator=gen, dtype=torch.float32).to(device)
    logits = torch.empty_like(base)
    floor = FloorPeer()
    rows_idx = torch.arange(batch_size, device=device)
    checks = {"violations": 0, "checked": 0, "allowed_sum": 0.0, "unconstrained": 0, "corrupted": 0}
    examples: dict[str, list[Any]] = {}

    def decode(stepper: Any, n_steps: int, watch: Stopwatch, tally: dict[str, Any], deadline: float) -> None:
        walk = RowWalk(flat, offsets, pool, batch_size, eos, rng)
        tokens = None
        feed = getattr(stepper, "feed", None)  # what the caller's own loop does with the tokens (not timed)
        for _ in range(n_steps):
            logits.copy_(base)
            if feed is not None:
                feed(tokens)
            watch.start()
            out = stepper.step(logits, tokens)
            watch.stop()
            expected = walk.expected()
            exp_t = torch.tensor(expected, device=device)
            kept = out[rows_idx, exp_t]
            ok = torch.isfinite(kept) & (kept == base[rows_idx, exp_t])
            ok_list = ok.tolist()
            allowed = torch.isfinite(out).sum(dim=1)
            tally["checked"] += batch_size
            tally["violations"] += ok_list.count(False)
            tally["corrupted"] += int((torch.isfinite(kept) & ~ok).sum())
            tally["allowed_sum"] += float(allowed.sum())
            tally["unconstrained"] += int((allowed == vocab).sum())
            if tally is checks:
                for i, good in enumerate(ok_list):
                    if not good and len(examples) < 5:
                        # (name, position in its tokenization, the masked token, the tokens before it)
                        row, p = walk.rows[i], walk.pos[i]
                        examples.setdefault(names[walk.current[i]], [p, row[p], row[:p]])
            chosen = [t if good else eos for t, good in zip(expected, ok_list)]
            walk.advance(chosen)
            tokens = torch.tensor(chosen, dtype=torch.long, device=device)
            if time.perf_counter() > deadline:
                return

    def floor_decode(n_steps: int) -> tuple[list[float], list[float]]:
        """The floor twice: inside the decode loop (same reset and checks around each step as the peer: the
        reference of every ratio), and back to back (``copy_`` then ``fill_``, no work in between)."""
        in_loop = Stopwatch(sync)
        decode(floor, n_steps, in_loop, {k: 0 for k in checks}, float("inf"))
        tight = Stopwatch(sync)
        for _ in range(n_steps):
            logits.copy_(base)
            tight.start()
            floor.step(logits, None)
            tight.stop()
        return in_loop.times, tight.times

    t_begin = time.perf_counter()
    hard_deadline = t_begin + budget_s
    # Warm the floor (the first torch ops of a process are slow) and the peer; keep the peer's cold first step.
    for _ in range(5):
        logits.copy_(base)
        floor.step(logits, None)
    t0 = time.perf_counter()
    peer.start(batch_size, device)
    first_start = time.perf_counter() - t0
    warm = Stopwatch(sync)
    # The warmup always runs all its steps (only the parent's hard limit stops it): a peer that fails after a few
    # steps must fail here, not slip through as a one-step measurement.
    decode(peer, max(1, warm_steps), warm, checks, deadline=float("inf"))
    first_step = warm.times[0]

    floor_runs: list[list[float]] = []
    tight_runs: list[list[float]] = []
    peer_runs: list[list[float]] = []
    starts: list[float] = []
    truncated = False
    for _ in range(repeats):
        if time.perf_counter() > hard_deadline:
            truncated = True
            break
        in_loop, tight = floor_decode(steps)
        floor_runs.append(in_loop)
        tight_runs.append(tight)
        t0 = time.perf_counter()
        peer.start(batch_size, device)
        starts.append(time.perf_counter() - t0)
        pw = Stopwatch(sync)
        decode(peer, steps, pw, checks, deadline=hard_deadline)
        peer_runs.append(pw.times)
        if len(pw.times) < steps:
            truncated = True
            break
    if not peer_runs:  # the warmup alone used the budget: report what it measured
        peer_runs = [warm.times[1:] or warm.times]
        in_loop, tight = floor_decode(steps)
        floor_runs.append(in_loop)
        tight_runs.append(tight)
        truncated = True
    ps, fs, ts = summarize(peer_runs), summarize(floor_runs), summarize(tight_runs)
    # The floor is one constant op: the median step is its cost (a mean would carry the GC pauses and scheduler
    # hiccups of a noisy machine into the denominator of every ratio).
    floor_ms = fs.step_median * 1e3
    tight_ms = ts.step_median * 1e3
    rec: dict[str, Any] = {
        **ps.as_dict("step"),
        "floor_ms": floor_ms,
        "floor_mean_ms": fs.value * 1e3,
        "ratio": ps.value * 1e3 / floor_ms if floor_ms > 0 else None,
        "floor_tight_ms": tight_ms,
        "ratio_tight": ps.value * 1e3 / tight_ms if tight_ms > 0 else None,
        "first_step_ms": first_step * 1e3,
        "first_start_s": first_start,
        "start_s": sorted(starts)[len(starts) // 2] if starts else first_start,
        "truncated": truncated,
        "measure_s": time.perf_counter() - t_begin,
        "violations": checks["violations"],
        "corrupted": checks["corrupted"],
        "checked_rows": checks["checked"],
        "allowed_mean": checks["allowed_sum"] / max(1, checks["checked"]),
        "unconstrained_rows": checks["unconstrained"],
        "violation_examples": examples,
    }
    return rec


# ---------------------------------------------------------------------------------------------------------------


def _run_step_job(job: dict[str, Any]) -> None:
    """Run the job's peers one after the other (each over all sizes and batch sizes)."""
    import torch
    from transformers import AutoTokenizer

    if job.get("threads"):
        torch.set_num_threads(int(job["threads"]))
    tokenizer = AutoTokenizer.from_pretrained(job["tokenizer"])
    for name in job["peers"]:
        t0 = time.perf_counter()
        _run_step_peer(job, name, tokenizer)
        _emit({"event": "peer_done", "peer": name, "elapsed_s": time.perf_counter() - t0})
        gc.collect()


def _run_step_peer(job: dict[str, Any], name: str, tokenizer: Any) -> None:
    import numpy as np
    import torch

    from . import data
    from .peers import STEP_PEERS, load_peer, vocab_size_of
    from .timing import fresh_memory_baseline, rss_bytes

    device = torch.device(job["device"])
    registry = dict(STEP_PEERS)
    registry.update(job.get("extra_peers", {}))
    common = {"suite": "step", "peer": name, "device": str(device)}
    first_size = job["sizes"][0]["n"]

    _phase(first_size, "prepare", job["prepare_limit_s"], peer=name)
    try:
        cls = load_peer(name, registry)
    except Exception as exc:
        _emit({"event": "record", "record": {**common, "size": None, "status": "unavailable", "error": str(exc)}})
        return
    vocab = vocab_size_of(tokenizer)
    eos = int(tokenizer.eos_token_id)
    peer = cls()
    t_prep = time.perf_counter()
    try:
        peer.prepare(tokenizer)
    except Exception as exc:
        _emit({"event": "record", "record": {**common, "size": first_size, "status": "failed", "phase": "prepare",
                                             "error": _err(exc), "spent_s": time.perf_counter() - t_prep}})
        return
    prepare_s = time.perf_counter() - t_prep
    prepare_parts = dict(getattr(peer, "prepare_parts", {}))

    for spec in job["sizes"]:
        n = spec["n"]
        nl = data.read_names_file(spec["path"])
        size_common = {**common, "size": n, "names": nl.kind, "mean_tokens": nl.mean_tokens(), "vocab": vocab,
                       "prepare_s": prepare_s, "prepare_parts": prepare_parts}
        _phase(n, "setup", job["setup_limit_s"], peer=name)
        peer.setup_parts, peer.info = {}, {}
        rss0 = fresh_memory_baseline()
        t_setup = time.perf_counter()
        try:
            peer.setup(nl.names, tokenizer)
        except BaseException as exc:  # pyo3 panics are BaseException
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            _emit({"event": "record", "record": {**size_common, "status": "failed", "phase": "setup",
                                                 "error": _err(exc), "spent_s": time.perf_counter() - t_setup}})
            return
        setup_s = time.perf_counter() - t_setup
        setup_mb = (rss_bytes() - rss0) / 2**20

        _phase(n, "check", job["check_limit_s"], peer=name)
        rng = np.random.default_rng(job["seed"])
        m = min(n, job["check_names"])
        sample = np.sort(rng.choice(n, size=m, replace=False)) if m < n else np.arange(n)
        t_check = time.perf_counter()
        try:
            rejected = peer.rejects([nl.tokens(int(i)) for i in sample])
        except BaseException as exc:
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            rejected = None
            peer.info["rejects_error"] = _err(exc)
        check_s = time.perf_counter() - t_check
        pool = np.arange(n)
        if rejected:
            bad = set(sample[rejected].tolist())
            pool = np.array([i for i in range(n) if i not in bad]) if len(bad) < n else pool
            peer.info["rejected_examples"] = [nl.names[int(sample[i])] for i in rejected[:5]]

        size_common.update({
            "setup_s": setup_s, "setup_parts": dict(peer.setup_parts), "setup_rss_mb": setup_mb,
            "rejected_names": None if rejected is None else len(rejected), "rejected_checked": int(m),
            "check_s": check_s,
        })
        for b in job["batches"]:
            _phase(n, "measure", job["measure_budget_s"] + job["measure_grace_s"], batch=b, peer=name)
            t_m = time.perf_counter()
            try:
                rec = measure_step(peer, nl.flat, nl.offsets, pool, nl.names, b, vocab, eos, device,
                                   steps=job["steps"], repeats=job["repeats"], warm_steps=job["warm_steps"],
                                   budget_s=job["measure_budget_s"], seed=job["seed"])
                status = "ok" if rec["violations"] == 0 and rec["corrupted"] == 0 else "wrong"
                out = {**size_common, "batch": b, "status": status, **rec, "info": _info(peer)}
            except BaseException as exc:
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                out = {**size_common, "batch": b, "status": "failed", "phase": "measure", "error": _err(exc),
                       "spent_s": time.perf_counter() - t_m, "info": _info(peer)}
            _emit({"event": "record", "record": out})
            try:
                peer.close()
            except Exception:
                pass
        gc.collect()
    del peer


def _info(peer: Any) -> dict[str, Any]:
    return {k: v for k, v in getattr(peer, "info", {}).items()}


def _err(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) < 2000 else text[:2000] + "..."


def _run_build_job(job: dict[str, Any]) -> None:
    from . import data
    from .peers import BUILD_PEERS, load_peer
    from .timing import fresh_memory_baseline, peak_rss_bytes, rss_bytes

    name = job["peer"]
    registry = dict(BUILD_PEERS)
    registry.update(job.get("extra_peers", {}))
    spec = job["size"]
    n = spec["n"]
    common = {"suite": "build", "peer": name, "size": n}
    _phase(n, "build", job["build_limit_s"])
    try:
        cls = load_peer(name, registry)
    except Exception as exc:
        _emit({"event": "record", "record": {**common, "status": "unavailable", "error": str(exc)}})
        return
    nl = data.read_names_file(spec["path"])
    seqs = nl.token_lists()
    common.update({"names": nl.kind, "mean_tokens": nl.mean_tokens()})
    peer = cls()
    rss0 = fresh_memory_baseline()
    peak0 = peak_rss_bytes()
    t0 = time.perf_counter()
    try:
        obj = peer.build(seqs, job["vocab"], job["eos"])
    except BaseException as exc:
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        _emit({"event": "record", "record": {**common, "status": "failed", "phase": "build", "error": _err(exc),
                                             "spent_s": time.perf_counter() - t0}})
        return
    first = time.perf_counter() - t0
    mem_mb = (rss_bytes() - rss0) / 2**20
    peak_mb = max(0, peak_rss_bytes() - peak0) / 2**20
    times = [first]
    spent = first
    while len(times) < job["repeats"] and spent < job["build_budget_s"]:
        del obj
        gc.collect()
        t0 = time.perf_counter()
        obj = peer.build(seqs, job["vocab"], job["eos"])
        dt = time.perf_counter() - t0
        times.append(dt)
        spent += dt
    # The first build is cold (allocator growth, imports); the median includes it only when it is the only one.
    timed = times[1:] or times
    timed.sort()
    _emit({"event": "record", "record": {
        **common, "status": "ok", "build_s": timed[len(timed) // 2], "first_build_s": first, "builds": len(times),
        "rss_mb": mem_mb, "peak_rss_growth_mb": peak_mb,
        "bytes_per_entry": mem_mb * 2**20 / max(1, n), "info": dict(getattr(obj, "info", {}) or {}),
    }})


def main() -> int:
    global _PROTO
    # Keep the protocol channel private: anything a library prints goes to stderr.
    _PROTO = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    job = json.loads(sys.stdin.read())
    try:
        if job["suite"] == "step":
            _run_step_job(job)
        elif job["suite"] == "build":
            _run_build_job(job)
        else:
            raise ValueError(f"unknown worker suite {job['suite']!r}")
    except BaseException:
        traceback.print_exc()
        _emit({"event": "error", "error": traceback.format_exc(limit=5)})
        return 1
    _emit({"event": "done"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
