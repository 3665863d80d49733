#!/usr/bin/env python
"""Load test of ``vllm serve`` with the trie processor, on loopback (issue 13: a request must not read, probe or
stall the server).

Three modes, each printing a JSON report (``--json-out`` also writes it, with a ``meta`` section: command, date,
CPU count and load average, versions; the figures in docs/vllm.md "Security" are docs/results/serve_*.json):

``--mode load`` (default): for ``--duration`` seconds, ``--concurrency`` clients send a mix of requests: a trie
file inside the allowed directory, a named trie, inline lists the server has seen (cached), inline lists it has
not (built, budgeted), token-id lists as JSON strings, unconstrained requests, malformed requests and refused
paths (``/etc/passwd``, ``..`` escapes, a symbolic link out of the allowed directory, a FIFO, a missing file).
Checks: every constrained output that stopped is a member of its set; every bad request is a 400 (a fresh inline
list may be a 400 for the build budget, counted apart); no request takes longer than ``--max-latency``; the
server's processes' RSS stays flat (start, after warm-up, end); the engine refused nothing the front-end admitted
(its log has no "the engine refused" line). Every request carries a client timeout (``--request-timeout``), so a
run lasts at most ``duration + request timeout`` after the server is up. Exits 1 if a check fails.

``--mode stall``: measures what building large inline lists costs *other* requests: victims send small cached
requests back to back; after a quiet phase an attacker sends distinct inline lists at the per-request cap (emoji,
the costliest text per byte). Reports the victims' latency (p50, p95, max) per phase and the attacker's statuses.
``--unbounded`` starts the server with the limits of before issue 13 (100,000 entries / 8 MB per request, no
budget, no handoff to the engine core) to compare.

``--mode build``: no server; what one inline list of the attacker's kind costs to build in one process (as the
front-end does at admission), and in a second process's resolver from the handoff file or rebuilt (as the engine
core does), for each ``--sizes`` entry (entries:bytes).

Examples::

    python scripts/load_test_serve.py --duration 180 --json-out docs/results/serve_load.json
    python scripts/load_test_serve.py --mode stall --phase 30 --json-out docs/results/serve_inline_stall.json
    python scripts/load_test_serve.py --mode stall --phase 30 --unbounded
    python scripts/load_test_serve.py --mode build --json-out docs/results/serve_inline_build.json
    python scripts/load_test_serve.py --base http://127.0.0.1:8000 --spec spec.json --pid 1234   # a running server

The server started here is small (SmolLM2-135M, float32, ``--max-num-seqs 8``, ``--max-model-len 512``) and
listens on 127.0.0.1 only; it is stopped at the end, even on errors.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import signal
import socket
import statistics
import string
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

COLORS = ["red", "green", "blue", "yellow", "purple", "orange", "black", "white"]
NUMBERS = ["one", "two", "three", "four", "five"]
WORDS = [
    "apple", "banana", "cherry", "grape", "lemon", "mango", "melon", "olive", "peach", "pear", "plum", "kiwi", "lime",
    "fig", "date", "guava", "papaya", "quince", "apricot", "coconut", "walnut", "almond", "hazelnut", "pecan",
]
PROMPTS = {
    "file": "The largest country in the world is",
    "named": "My favourite color is",
    "inline": "My favourite fruit is",
    "inline_fresh": "My favourite fruit is",
    "tokens": "I have this many cats:",
    "plain": "Once upon a time",
}
UNBOUNDED_ENV = {  # the limits before issue 13, for comparison
    "TRIE_DECODE_VLLM_MAX_INLINE_ENTRIES": "100000",
    "TRIE_DECODE_VLLM_MAX_INLINE_BYTES": str(8 * 1024 * 1024),
    "TRIE_DECODE_VLLM_BUILD_BUDGET": "inf",
    "TRIE_DECODE_VLLM_HANDOFF_DIR": "off",
}


# ---------------------------------------------------------------------------------------------- server
class Server:
    """A ``vllm serve`` subprocess on a loopback port (its own process group: stopped with its engine)."""

    def __init__(self, model: str, workdir: Path, env: dict[str, str], *, max_num_seqs: int = 8,
                 max_model_len: int = 512, timeout: float = 900) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.base = f"http://127.0.0.1:{port}"
        self.log_path = workdir / "server.log"
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", "smol",
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", str(max_model_len),
            "--max-num-seqs", str(max_num_seqs), "--enforce-eager",
            "--logits-processors", "trie_decode.integrations.vllm:TrieLogitsProcessor",
        ]
        full_env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                        TOKENIZERS_PARALLELISM="false", **env)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)
        try:
            wait_healthy(self.base, self.proc, timeout, self.log_path)
        except BaseException:
            self.stop()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def wait_healthy(base: str, proc: Optional[subprocess.Popen], timeout: float, log: Optional[Path] = None) -> None:
    deadline = time.time() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-4000:] if log else ""
            raise RuntimeError(f"vllm serve exited with {proc.returncode}:\n{tail}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
            pass
        if time.time() > deadline:
            raise TimeoutError(f"vllm serve did not come up in {timeout:.0f} s")
        time.sleep(2)


def server_rss(root_pid: int) -> dict[str, int]:
    """RSS in KiB of every process of the server's session (the API server and the engine core), by pid:name."""
    out: dict[str, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            sid = int(fields[3])  # session id (the server was started with start_new_session)
            if sid != root_pid:
                continue
            with open(f"/proc/{entry}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
            out[f"{entry}:{status['Name'].strip()}"] = int(status.get("VmRSS", "0 kB").split()[0])
        except (OSError, ValueError, IndexError, KeyError):
            continue
    return out


# ---------------------------------------------------------------------------------------------- requests
#: Status recorded for a request that got no HTTP answer (client timeout, connection error).
NO_ANSWER = 0
#: The server log line of an engine-side refusal (trie_decode.integrations.vllm_requests.TrieResolver.refused_in_engine).
ENGINE_REFUSAL_LINE = "the engine refused a request the front-end had admitted"


def post(base: str, body: dict, timeout: float = 300) -> tuple[int, dict]:
    """POST a completion; ``(NO_ANSWER, {"error": ...})`` when no HTTP answer came within ``timeout`` seconds (the
    socket timeout bounds each read; the caller's deadline is what bounds the request as a whole)."""
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        raw = e.read() or b"{}"
        try:
            return e.code, json.loads(raw)
        except json.JSONDecodeError:
            return e.code, {"raw": raw[:500].decode(errors="replace")}
    except (urllib.error.URLError, OSError, ValueError) as e:  # timeouts are OSErrors (TimeoutError)
        reason = getattr(e, "reason", e)
        return NO_ANSWER, {"error": {"message": f"no answer: {type(reason).__name__}: {reason}"}}


def error_message(body: dict) -> str:
    """The message of vLLM's error body (``{"error": {"message": ...}}``), or the body as JSON."""
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"]
    return json.dumps(body)


def complete(base: str, prompt: str, xargs: Optional[dict], *, max_tokens: int = 16, temperature: float = 0.8,
             seed: Optional[int] = None, timeout: float = 300) -> tuple[int, dict, float]:
    body: dict[str, Any] = {"model": "smol", "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature}
    if seed is not None:
        body["seed"] = seed
    if xargs is not None:
        body["vllm_xargs"] = xargs
    t = time.perf_counter()
    status, out = post(base, body, timeout)
    return status, out, time.perf_counter() - t


def meta(argv: Optional[list[str]] = None) -> dict:
    """Where and how a report was made (the machine is shared: the load average says how busy it was)."""
    out: dict[str, Any] = {
        "command": "python scripts/load_test_serve.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(), "loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(), "machine": platform.machine(),
    }
    for name in ("vllm", "torch", "transformers"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - a report without a version is still a report
            out[name] = None
    return out


def engine_refusals(log_path: Optional[Path]) -> Optional[int]:
    """How many engine-side refusals the server log reports (None without a log)."""
    if log_path is None or not Path(log_path).exists():
        return None
    return Path(log_path).read_text(errors="replace").count(ENGINE_REFUSAL_LINE)


def prepare(workdir: Path, tokenizer: Any, country_names: list[str]) -> tuple[dict, dict[str, str]]:
    """Trie files, the refused paths and the server environment for a load test; returns (spec, env)."""
    from trie_decode import TokenTrie

    allowed = workdir / "allowed"
    allowed.mkdir(parents=True, exist_ok=True)
    outside = workdir / "outside"
    outside.mkdir(exist_ok=True)
    countries = allowed / "countries.trie"
    TokenTrie.from_strings(country_names, tokenizer).save(countries)
    colors = allowed / "colors.trie"
    TokenTrie.from_strings(COLORS, tokenizer).save(colors)
    secret = outside / "secret.trie"
    TokenTrie.from_strings(["secret"], tokenizer).save(secret)
    for name, target in (("escape.trie", secret), ("passwd.trie", "/etc/passwd")):
        if not (allowed / name).is_symlink():
            (allowed / name).symlink_to(target)
    if not (allowed / "fifo.trie").exists():
        os.mkfifo(allowed / "fifo.trie")
    (allowed / "junk.trie").write_bytes(b"not a trie file at all\n" * 20)
    spec = {
        "file": {"trie": str(countries), "members": sorted(country_names)},
        "named": {"trie": "colors", "members": COLORS},
        "tokens": {"seqs": [tokenizer(" " + n, add_special_tokens=False)["input_ids"] for n in NUMBERS]},
        "refused": ["/etc/passwd", "/etc/hostname", "/proc/self/environ", str(allowed / ".." / "outside" / "secret.trie"),
                    str(allowed / "escape.trie"), str(allowed / "passwd.trie"), str(secret), "~/.bashrc",
                    str(outside / "missing.trie")],
        "bad_inside": [str(allowed / "fifo.trie"), str(allowed / "junk.trie"), str(allowed / "missing.trie"), str(allowed)],
    }
    spec["tokens"]["members"] = [tokenizer.decode(s) for s in spec["tokens"]["seqs"]]
    env = {
        "TRIE_DECODE_ALLOWED_DIRS": str(allowed),
        "TRIE_DECODE_NAMED_TRIES": f"colors={colors}",
        "TRIE_DECODE_VLLM_HANDOFF_DIR": str(workdir / "handoff"),
    }
    return spec, env


MALFORMED = [
    {"trie": COLORS, "on_complete": "sometimes"},
    {"trie": COLORS, "trie_mode": "x"},
    {"trie": "[[1, 2"},
    {"trie": []},
    {"trie": ["a", ""]},
    {"trie": [[1, -2]]},
    {"trie": 12},
    {"trie": ["x"] * 10_001},
    {"trie": "[" * 5000 + "]" * 5000},
]


def _request_plan(spec: dict, rng: random.Random) -> tuple[str, Optional[dict], Optional[list]]:
    """(kind, xargs, members): the next request of the mix."""
    r = rng.random()
    if r < 0.18:
        return "file", {"trie": spec["file"]["trie"]}, spec["file"]["members"]
    if r < 0.34:
        return "named", {"trie": spec["named"]["trie"]}, spec["named"]["members"]
    if r < 0.50:  # one of a few lists the server keeps cached
        k = rng.randrange(4)
        words = WORDS[k * 6 : k * 6 + 6]
        return "inline", {"trie": json.dumps(words)}, words
    if r < 0.56:  # a list the server has not seen: built (and budgeted) at admission
        words = rng.sample(WORDS, 5) + ["".join(rng.choice(string.ascii_lowercase) for _ in range(8)) for _ in range(200)]
        return "inline_fresh", {"trie": json.dumps(words)}, words
    if r < 0.66:
        return "tokens", {"trie": json.dumps(spec["tokens"]["seqs"])}, spec["tokens"]["members"]
    if r < 0.74:
        return "plain", None, None
    if r < 0.84:
        return "malformed", rng.choice(MALFORMED), None
    if r < 0.94:
        return "refused", {"trie": rng.choice(spec["refused"])}, None
    return "bad_inside", {"trie": rng.choice(spec["bad_inside"])}, None


def run_load(base: str, spec: dict, duration: float, *, concurrency: int = 8, seed: int = 0,
             root_pid: Optional[int] = None, max_latency: float = 30.0, max_rss_growth_mb: float = 150.0,
             warmup: float = 10.0, request_timeout: Optional[float] = None, log_path: Optional[Path] = None) -> dict:
    """Run the mix for ``duration`` seconds; return the report (``report["ok"]`` tells whether every check held).

    Every request carries a client timeout (``request_timeout``, default ``max_latency`` + 5 s: a request slower
    than the bound fails the run anyway), so the run ends at most ``duration + request_timeout`` seconds after it
    starts. ``log_path``: the server's log, checked for engine-side refusals.
    """
    timeout = float(request_timeout if request_timeout is not None else max_latency + 5.0)
    results: list[dict] = []
    lock = threading.Lock()
    stop_at = time.time() + duration
    rss = {"start": server_rss(root_pid) if root_pid else {}}
    sampler_stop = threading.Event()
    rss_series: list[tuple[float, int]] = []

    def sample() -> None:
        t0 = time.time()
        while not sampler_stop.wait(2.0):
            if root_pid:
                snap = server_rss(root_pid)
                rss_series.append((time.time() - t0, sum(snap.values())))
                if "warm" not in rss and time.time() - t0 >= warmup:
                    rss["warm"] = snap

    def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        n = 0
        while time.time() < stop_at:
            kind, xargs, members = _request_plan(spec, rng)
            started = time.time() - t_start
            status, body, latency = complete(base, PROMPTS.get(kind, "Hi"), xargs, max_tokens=16, seed=rng.randrange(1 << 30),
                                             timeout=timeout)
            rec: dict[str, Any] = {"kind": kind, "status": status, "latency": latency, "start": started}
            if status == 200:
                choice = body["choices"][0]
                rec["finish"] = choice.get("finish_reason")
                if members is not None and rec["finish"] == "stop":
                    rec["member"] = choice["text"] in members
                    if not rec["member"]:
                        rec["text"] = choice["text"][:80]
            else:
                rec["message"] = error_message(body)[:400]
            with lock:
                results.append(rec)
            n += 1

    t_start = time.time()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        list(pool.map(client, range(concurrency)))
    elapsed = time.time() - t_start
    sampler_stop.set()
    sampler.join()
    if root_pid:
        rss["end"] = server_rss(root_pid)
    report = summarize(results, rss, rss_series, elapsed, max_latency, max_rss_growth_mb)
    report["bounds"] = {"duration_s": duration, "concurrency": concurrency, "max_latency_s": max_latency,
                        "request_timeout_s": timeout, "max_rss_growth_mb": max_rss_growth_mb}
    refused = engine_refusals(log_path)
    report["engine_refusals"] = refused
    if refused:
        report["failures"].append(f"the server log reports {refused} engine-side refusal(s): see {log_path}")
        report["ok"] = False
    return report


def summarize(results: list[dict], rss: dict, rss_series: list, elapsed: float, max_latency: float,
              max_rss_growth_mb: float) -> dict:
    kinds: dict[str, dict] = {}
    for rec in results:
        k = kinds.setdefault(rec["kind"], {"n": 0, "status": {}, "latency": []})
        k["n"] += 1
        k["status"][str(rec["status"])] = k["status"].get(str(rec["status"]), 0) + 1
        k["latency"].append(rec["latency"])
    for k in kinds.values():
        k["latency_s"] = latency_stats(k.pop("latency"))
    failures: list[str] = []
    good_kinds = ("file", "named", "inline", "tokens", "plain")
    bad_kinds = ("malformed", "refused", "bad_inside")
    for rec in results:
        if rec["status"] == NO_ANSWER:
            failures.append(f"{rec['kind']}: {rec.get('message', 'no answer')[:200]} after {rec['latency']:.1f} s")
        elif rec["kind"] in good_kinds and rec["status"] != 200:
            failures.append(f"{rec['kind']}: status {rec['status']} {rec.get('message', '')[:200]}")
        if rec["kind"] in bad_kinds and rec["status"] != 400:
            failures.append(f"{rec['kind']}: status {rec['status']} (expected 400)")
        if rec["kind"] == "inline_fresh" and rec["status"] not in (200, 400):
            failures.append(f"inline_fresh: status {rec['status']}")
        if rec["kind"] == "inline_fresh" and rec["status"] == 400 and "busy building" not in rec.get("message", ""):
            failures.append(f"inline_fresh: 400 not from the build budget: {rec.get('message', '')[:200]}")
        if rec.get("member") is False:
            failures.append(f"{rec['kind']}: output {rec.get('text')!r} is not a member")
        if rec["latency"] > max_latency:
            failures.append(f"{rec['kind']}: took {rec['latency']:.1f} s > {max_latency} s ({_overlap(rec, results)})")
    # Refusals must not depend on the path: one message per refused request, once the path is taken out.
    refused_msgs = set()
    for rec in results:
        if rec["kind"] == "refused" and rec["status"] == 400:
            msg = rec["message"]
            refused_msgs.add(msg.split("' is not a trie file", 1)[-1] if "' is not a trie file" in msg else msg)
    if len(refused_msgs) > 1:
        failures.append(f"refusals differ by path: {sorted(refused_msgs)[:3]}")
    rss_mb = {k: round(sum(v.values()) / 1024, 1) for k, v in rss.items() if v}
    if "warm" in rss_mb and "end" in rss_mb and rss_mb["end"] - rss_mb["warm"] > max_rss_growth_mb:
        failures.append(f"server RSS grew {rss_mb['end'] - rss_mb['warm']:.0f} MB after warm-up (> {max_rss_growth_mb})")
    members = [r for r in results if "member" in r]
    report = {
        "requests": len(results),
        "elapsed_s": round(elapsed, 1),
        "throughput_rps": round(len(results) / max(elapsed, 1e-9), 2),
        "by_kind": kinds,
        "status": {s: sum(1 for r in results if str(r["status"]) == s) for s in sorted({str(r["status"]) for r in results})},
        "member_checked": len(members),
        "member_ok": sum(1 for r in members if r["member"]),
        "truncated": sum(1 for r in results if r.get("finish") == "length" and r["kind"] not in ("plain",)),
        "budget_refusals": sum(1 for r in results if r["kind"] == "inline_fresh" and r["status"] == 400),
        "max_latency_s": round(max((r["latency"] for r in results), default=0.0), 3),
        "slowest": [{"kind": r["kind"], "status": r["status"], "start_s": round(r["start"], 1),
                     "latency_s": round(r["latency"], 3)} for r in sorted(results, key=lambda r: -r["latency"])[:3]],
        "latency_s": latency_stats([r["latency"] for r in results]),
        "constrained_latency_s": latency_stats([r["latency"] for r in results if r["kind"] in
                                                ("file", "named", "inline", "inline_fresh", "tokens") and r["status"] == 200]),
        "refusal_latency_s": latency_stats([r["latency"] for r in results if r["status"] == 400]),
        "rss_mb": rss_mb,
        "rss_by_process_kb": {k: v for k, v in rss.items()},
        "rss_series_mb": [(round(t), round(v / 1024)) for t, v in rss_series[:: max(1, len(rss_series) // 30)]],
        "failures": failures[:50],
        "ok": not failures,
    }
    return report


def _overlap(slow: dict, results: list[dict]) -> str:
    """What the requests running beside a slow one saw: a server that stalls slows them all, a request that
    blocks on its own (a file open, a lock) slows only itself."""
    end = slow["start"] + slow["latency"]
    beside = [r for r in results if r is not slow and r["start"] < end and r["start"] + r["latency"] > slow["start"]]
    if not beside:
        return f"started at {slow['start']:.1f} s; no request overlapped it"
    worst = max(beside, key=lambda r: r["latency"])
    return (f"started at {slow['start']:.1f} s; {len(beside)} requests overlapped it, the slowest "
            f"({worst['kind']}, started at {worst['start']:.1f} s) took {worst['latency']:.1f} s")


def latency_stats(values: list[float]) -> dict:
    """p50 / p95 / p99 / max of latencies in seconds ({"n": 0} when empty)."""
    lat = sorted(values)
    if not lat:
        return {"n": 0}
    at = lambda q: round(lat[int(q * (len(lat) - 1))], 3)  # noqa: E731
    return {"n": len(lat), "p50": round(statistics.median(lat), 3), "p95": at(0.95), "p99": at(0.99),
            "max": round(lat[-1], 3)}


# ---------------------------------------------------------------------------------------------- stall measurement
def attacker_list(rng: random.Random, max_entries: int, max_bytes: int) -> list[str]:
    """Distinct text at the per-request caps, of the costliest kind per byte to tokenize (random emoji)."""
    alphabet = [chr(c) for c in range(0x1F300, 0x1F5FF)]
    per_entry = max(1, min(max_bytes // max_entries, 400) // 4)
    out, size = [], 0
    while len(out) < max_entries:
        s = "".join(rng.choice(alphabet) for _ in range(per_entry))
        if size + 4 * len(s) > max_bytes:
            break
        out.append(s)
        size += 4 * len(s)
    return out


def run_stall(base: str, phase: float, *, victims: int = 4, attack_entries: int, attack_bytes: int,
              attack_gap: float = 0.0, seed: int = 0) -> dict:
    """Victims send small cached constrained requests; after ``phase`` quiet seconds an attacker sends distinct
    inline lists for ``phase`` seconds; then ``phase`` seconds of recovery. Latencies per phase."""
    records: list[tuple[float, float]] = []  # (start offset, latency) of victim requests
    attacks: list[dict] = []
    t0 = time.time()
    end = t0 + 3 * phase
    lock = threading.Lock()

    def victim(i: int) -> None:
        rng = random.Random(seed + i)
        while time.time() < end:
            start = time.time() - t0
            status, body, latency = complete(base, PROMPTS["named"], {"trie": json.dumps(COLORS)}, max_tokens=8,
                                             seed=rng.randrange(1 << 30), timeout=120)
            with lock:
                records.append((start, latency if status == 200 else float("nan")))

    def attacker() -> None:
        rng = random.Random(seed + 999)
        time.sleep(phase)
        while time.time() < t0 + 2 * phase:
            words = attacker_list(rng, attack_entries, attack_bytes)
            start = time.time() - t0
            status, body, latency = complete(base, "Hi", {"trie": json.dumps(words)}, max_tokens=4, timeout=300)
            attacks.append({"start": round(start, 2), "status": status, "latency": round(latency, 3),
                            "entries": len(words), "message": "" if status == 200 else error_message(body)[:160]})
            time.sleep(attack_gap)

    threads = [threading.Thread(target=victim, args=(i,)) for i in range(victims)] + [threading.Thread(target=attacker)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    def stats(lo: float, hi: float) -> dict:
        out = latency_stats([l for s, l in records if lo <= s < hi and l == l])
        out["failed"] = sum(1 for s, l in records if lo <= s < hi and l != l)
        return out

    served = [a for a in attacks if a["status"] == 200]
    refused = [a for a in attacks if a["status"] != 200]
    return {
        "victims": {"quiet": stats(0, phase), "attack": stats(phase, 2 * phase), "after": stats(2 * phase, 3 * phase)},
        "attacks": {"n": len(attacks), "status": {str(s): sum(1 for a in attacks if a["status"] == s) for s in {a["status"] for a in attacks}},
                    "entries": attacks[0]["entries"] if attacks else None,
                    "served_latency_s": latency_stats([a["latency"] for a in served]),
                    "refused_latency_s": latency_stats([a["latency"] for a in refused]),
                    "latency_max": max((a["latency"] for a in attacks), default=None), "first": attacks[:6]},
    }


# ---------------------------------------------------------------------------------------------- build costs
def run_build(tokenizer: Any, sizes: list[tuple[int, int]], workdir: Path, *, reps: int = 2, seed: int = 0) -> dict:
    """Seconds to build one attacker list (:func:`attacker_list`) per size: in a front-end resolver (admission),
    then in a second resolver (the engine core's) from the handoff file, and rebuilt without it. No server: the
    resolvers are the ones the processor uses (trie_decode.integrations.vllm_requests.TrieResolver)."""
    os.environ["TRIE_DECODE_VLLM_BUILD_BUDGET"] = "inf"
    from trie_decode.integrations.vllm_access import ENV_HANDOFF_DIR
    from trie_decode.integrations.vllm_requests import TrieResolver, parse_trie_request

    rng = random.Random(seed)
    out = []
    for entries, nbytes in sizes:
        row: dict[str, Any] = {"entries": entries, "max_bytes": nbytes, "frontend_s": [], "engine_handoff_s": [],
                               "engine_rebuild_s": []}
        for rep in range(reps):
            words = attacker_list(rng, entries, nbytes)
            args = {"trie": words}
            row["entries_sent"] = len(words)
            row["utf8_bytes"] = sum(len(w.encode()) for w in words)
            os.environ[ENV_HANDOFF_DIR] = str(workdir / f"handoff-{entries}-{rep}")
            for label, admit in (("frontend_s", True), ("engine_handoff_s", False)):
                resolver = TrieResolver(tokenizer)  # a fresh cache: the other process's view
                req = parse_trie_request(args, max_entries=entries, max_bytes=nbytes)
                t = time.perf_counter()
                trie = resolver.trie(req, admit=admit)
                row[label].append(round(time.perf_counter() - t, 4))
            os.environ[ENV_HANDOFF_DIR] = "off"
            t = time.perf_counter()
            TrieResolver(tokenizer).trie(parse_trie_request(args, max_entries=entries, max_bytes=nbytes))
            row["engine_rebuild_s"].append(round(time.perf_counter() - t, 4))
            row["nodes"] = trie.num_nodes
        out.append(row)
        print(json.dumps(row), file=sys.stderr)
    return {"sizes": out, "reps": reps, "kind": "random emoji (U+1F300..U+1F5FE), the costliest text per byte"}


# ---------------------------------------------------------------------------------------------- main
def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("load", "stall", "build"), default="load")
    p.add_argument("--duration", type=float, default=180.0, help="load mode: seconds of load (default 180)")
    p.add_argument("--phase", type=float, default=30.0, help="stall mode: seconds per phase (quiet, attack, after)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-latency", type=float, default=30.0, help="fail if any request takes longer (seconds)")
    p.add_argument("--request-timeout", type=float, default=None,
                   help="load mode: client timeout of every request (default: --max-latency + 5 s)")
    p.add_argument("--max-rss-growth-mb", type=float, default=150.0)
    p.add_argument("--unbounded", action="store_true", help="start the server with the limits of before issue 13")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="an extra environment variable for the server started here (repeatable)")
    p.add_argument("--attack-entries", type=int, default=None, help="stall mode: entries per attack list (default: the cap)")
    p.add_argument("--attack-bytes", type=int, default=None, help="stall mode: bytes per attack list (default: the cap)")
    p.add_argument("--sizes", default="2000:65536,10000:262144,100000:1572864",
                   help="build mode: entries:bytes of the lists to build, comma-separated")
    p.add_argument("--reps", type=int, default=2, help="build mode: distinct lists per size")
    p.add_argument("--base", help="use a running server at this URL instead of starting one")
    p.add_argument("--spec", help="with --base: the JSON spec (trie paths and members) the server was prepared with")
    p.add_argument("--pid", type=int, help="with --base: the server's session id, for RSS")
    p.add_argument("--log", help="with --base: the server's log, checked for engine-side refusals")
    p.add_argument("--json-out", help="also write the report here")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    workdir = Path(tempfile.mkdtemp(prefix="trie_load_"))
    server: Optional[Server] = None
    info = meta(argv)
    try:
        env: dict[str, str] = {}
        log_path = Path(args.log) if args.log else None
        if args.mode == "build":
            from transformers import AutoTokenizer

            from trie_decode.integrations.smollm2 import smollm2_path

            sizes = [tuple(int(x) for x in item.split(":")) for item in args.sizes.split(",") if item.strip()]
            report = run_build(AutoTokenizer.from_pretrained(smollm2_path()), sizes, workdir, reps=args.reps,
                               seed=args.seed)
            report["tokenizer"] = "SmolLM2-135M-Instruct"
        else:
            if args.base:
                base = args.base
                spec = json.loads(Path(args.spec).read_text()) if args.spec else None
                root_pid = args.pid
            else:
                import pycountry
                from transformers import AutoTokenizer

                from trie_decode.integrations.smollm2 import smollm2_path

                model = smollm2_path()
                tok = AutoTokenizer.from_pretrained(model)
                spec, env = prepare(workdir, tok, sorted({c.name for c in pycountry.countries}))
                if args.unbounded:
                    env.update(UNBOUNDED_ENV)
                env.update(dict(item.split("=", 1) for item in args.env))
                t = time.time()
                server = Server(model, workdir, env)
                up = time.time() - t
                print(f"server up at {server.base} in {up:.0f} s (log {server.log_path})", file=sys.stderr)
                base, root_pid, log_path = server.base, server.pid, server.log_path
                info["server"] = {"model": "SmolLM2-135M-Instruct", "dtype": "float32", "max_num_seqs": 8,
                                  "max_model_len": 512, "startup_s": round(up, 1),
                                  "env": {k: v for k, v in env.items() if not k.endswith(("_DIRS", "_TRIES"))
                                          and not (k.endswith("_DIR") and v != "off")}}
            from trie_decode.integrations.vllm_access import DEFAULT_MAX_INLINE_BYTES, DEFAULT_MAX_INLINE_ENTRIES

            caps_entries = int(env.get("TRIE_DECODE_VLLM_MAX_INLINE_ENTRIES", DEFAULT_MAX_INLINE_ENTRIES))
            caps_bytes = int(env.get("TRIE_DECODE_VLLM_MAX_INLINE_BYTES", DEFAULT_MAX_INLINE_BYTES))
            if args.mode == "load":
                if spec is None:
                    raise SystemExit("--base needs --spec for the load mode")
                report = run_load(base, spec, args.duration, concurrency=args.concurrency, seed=args.seed,
                                  root_pid=root_pid, max_latency=args.max_latency, max_rss_growth_mb=args.max_rss_growth_mb,
                                  request_timeout=args.request_timeout, log_path=log_path)
            else:
                rss_start = round(sum(server_rss(root_pid).values()) / 1024, 1) if root_pid else None
                report = run_stall(base, args.phase, attack_entries=args.attack_entries or caps_entries,
                                   attack_bytes=args.attack_bytes or caps_bytes, seed=args.seed)
                report["limits"] = {"entries": caps_entries, "bytes": caps_bytes, "unbounded": args.unbounded}
                report["engine_refusals"] = engine_refusals(log_path)
                if root_pid:
                    report["rss_mb"] = {"start": rss_start, "end": round(sum(server_rss(root_pid).values()) / 1024, 1),
                                        "by_process_end_kb": server_rss(root_pid)}
        info["loadavg_1_5_15_end"] = [round(x, 2) for x in os.getloadavg()]
        report = {"meta": info, **report}
        text = json.dumps(report, indent=1)
        print(text)
        if args.json_out:
            Path(args.json_out).write_text(text + "\n")
        return 0 if report.get("ok", True) else 1
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
