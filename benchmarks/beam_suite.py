"""Beam suite: trie-constrained beam search on vLLM against transformers' ``rank`` and vLLM's own beam search.

Why this exists: issue 17 adds :func:`trie_decode.integrations.vllm_beam.beam_search`; its claims are quality (every
result is an entry, the top-k agrees with transformers' ``rank`` on the same model and trie) and time. The three
contenders run on the same catalog (country names and ISO 639-1 language names from pycountry, a few hundred), the
same chat prompts, the same beam width, SmolLM2-135M-Instruct in float32 on the CPU:

    trie_beam     ``beam_search`` on an engine built with ``beam_engine_kwargs()`` (``TrieBeamLogitsProcessor``,
                  ``logprobs_mode="processed_logprobs"``, prefix caching, block size 32)
    vllm_choice   ``LLM.beam_search`` with ``BeamSearchParams(structured_outputs=..., length_penalty=0)`` on a default
                  engine (xgrammar). vLLM 0.32's beam search rejects ``choice=names`` (it resolves neither the "auto"
                  backend nor the choice), so it gets the EBNF grammar vLLM builds for that choice
                  (``choice_as_grammar``): the same constraint.
    rank          ``trie_decode.integrations.transformers.rank`` (transformers' beam search with the trie processor),
                  all prompts in one left-padded batch

Each runs in its own process (``python -m benchmarks.beam_suite --worker spec.json``). Reported per
contender: the wall time for all prompts of every repeated run (``reps``, 3 by default), with the first (cold), the
best and the median (speed-ups are taken on the best and on the median, the same basis for every contender), results
per prompt, the share of results that are catalog
entries (``valid``), agreement with ``rank`` (same top-1; share of rank's entries found; mean absolute difference of
the log-probs of common entries), and for ``trie_beam`` the engine rounds, beam requests and the prefix-cache hit
rate. Entry point: :func:`run_beam_suite`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional

from . import child_env

__all__ = ["run_beam_suite", "catalog", "QUESTIONS"]

QUESTIONS = [
    "Which country is Sarajevo in?",
    "Which country has Nairobi as its capital?",
    "Where is the Eiffel tower?",
    "Name a country in South America.",
    "Which country is famous for sushi?",
    "Which country is Oslo the capital of?",
    "What language is spoken in Brazil?",
    "What is the official language of Iran?",
    "Which language do people in Germany speak?",
    "What language is spoken in the Netherlands?",
    "Which language is spoken in Quebec besides English?",
    "What is the national language of Pakistan?",
]


def catalog() -> list[str]:
    """Country names (249) and ISO 639-1 language names (those with a two-letter code), deduplicated, sorted."""
    import pycountry

    names = {c.name for c in pycountry.countries}
    names |= {lang.name for lang in pycountry.languages if getattr(lang, "alpha_2", None)}
    return sorted(names)


def _chat(tok: Any, question: str) -> list[int]:
    msg = [{"role": "user", "content": question + " Answer with the name only."}]
    text = tok.apply_chat_template(msg, tokenize=False, add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def _run_worker(spec: dict, out_dir: Path, timeout: float) -> dict:
    name = spec["contender"]
    spec_path, result_path, log_path = (out_dir / f"beam_{name}_{k}" for k in ("spec.json", "result.json", "log.txt"))
    spec = dict(spec, result=str(result_path))
    spec_path.write_text(json.dumps(spec))
    env = child_env()
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env["TRIE_DECODE_ALLOWED_DIRS"] = str(out_dir)  # requests name the suite's trie file (docs/vllm.md, "Security")
    t0 = time.perf_counter()
    try:
        with open(log_path, "wb") as log:
            proc = subprocess.run([sys.executable, "-m", "benchmarks.beam_suite", "--worker", str(spec_path)],
                                  stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    if rc != 0 or not result_path.is_file():
        return {"error": f"worker ended with {rc}", "log_tail": log_path.read_text(errors="replace")[-3000:],
                "seconds": time.perf_counter() - t0}
    return json.loads(result_path.read_text())


def run_beam_suite(quick: bool, out_dir: Any, *, beam_width: int = 4, questions: Optional[list[str]] = None,
                   reuse: bool = False, reps: Optional[int] = None) -> dict:
    """Run the three contenders and write ``out_dir/beam.json``; returns the result dict.

    Args:
        quick: 4 prompts instead of 12.
        beam_width: beams (and entries) per prompt.
        reuse: keep a contender's result file from an earlier run in ``out_dir`` instead of running it again.
        reps: timed runs per contender (default 3, 2 with ``quick``).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()
    from transformers import AutoTokenizer

    from trie_decode import TokenTrie
    from trie_decode.integrations.smollm2 import smollm2_path

    model = smollm2_path()
    tok = AutoTokenizer.from_pretrained(model)
    names = catalog()
    qs = questions or (QUESTIONS[::3] if quick else QUESTIONS)
    trie_path = out_dir / "beam_catalog.trie"
    TokenTrie.from_strings(names, tok).save(trie_path)
    names_path = out_dir / "beam_catalog.json"
    names_path.write_text(json.dumps(names))
    common = {"model": model, "trie": str(trie_path), "names": str(names_path), "questions": qs, "beam_width": beam_width,
              "reps": reps or (2 if quick else 3)}
    runs = {}
    for c in ("rank", "trie_beam", "vllm_choice"):
        done = out_dir / f"beam_{c}_result.json"
        runs[c] = json.loads(done.read_text()) if reuse and done.is_file() else _run_worker(dict(common, contender=c), out_dir, 3600)
    trie = TokenTrie.load(trie_path)
    result = {"suite": "beam", "config": {**{k: v for k, v in common.items() if k not in ("trie", "names")},
                                          "catalog_size": len(names), "trie_depth": trie.max_depth},
              "machine": {"cpus": os.cpu_count(), "load_average_at_start": load_start, "load_average_at_end": os.getloadavg(),
                          "date": time.strftime("%Y-%m-%d %H:%M")},
              "runs": runs, "summary": _summary(runs, beam_width)}
    (out_dir / "beam.json").write_text(json.dumps(result, indent=2))
    # One row per contender for the suite runner's table (benchmarks.suites).
    result["records"] = [{"suite": "beam", "peer": name, "status": "failed" if "error" in row else "ok", **row}
                         for name, row in result["summary"].items()]
    return result


PADDING = -1e8  # rank's scores at or below this are transformers' padding (-1e9 + score), not log-probs


def _summary(runs: dict, width: int) -> dict:
    ref = runs.get("rank", {}).get("results")
    if ref is not None:  # compare against rank's real results only
        ref = [[r for r in per if r["log_prob"] is None or r["log_prob"] > PADDING] for per in ref]
    out: dict[str, Any] = {}
    for name, run in runs.items():
        if "results" not in run:
            out[name] = {"error": run.get("error")}
            continue
        res = run["results"]
        flat = [r for per in res for r in per]
        s: dict[str, Any] = {
            "best_s": run["best_s"], "median_s": run["median_s"], "cold_s": run["cold_s"], "warm_s": run["warm_s"],
            "reps_s": run["reps_s"],
            "results_per_prompt": sum(len(p) for p in res) / len(res),
            "prompts_with_k_results": sum(len(p) == width for p in res),
            "valid": sum(r["valid"] for r in flat) / max(len(flat), 1),
            "padding_results": sum(1 for r in flat if r["log_prob"] is not None and r["log_prob"] <= PADDING),
        }
        if ref is not None:
            top1 = found = total = 0
            diffs = []
            for mine, theirs in zip(res, ref):
                if mine and theirs and mine[0]["name"] == theirs[0]["name"]:
                    top1 += 1
                got = {r["name"]: r for r in mine if r["valid"]}
                for r in theirs:
                    total += 1
                    if r["name"] in got:
                        found += 1
                        if got[r["name"]].get("log_prob") is not None:
                            diffs.append(abs(got[r["name"]]["log_prob"] - r["log_prob"]))
            s["top1_agrees_with_rank"] = top1 / len(res)
            s["rank_entries_found"] = found / max(total, 1)
            s["max_abs_logprob_diff_vs_rank"] = max(diffs) if diffs else None
        for k in ("steps", "requests", "prefix_cache_hit_rate", "boot_s"):
            if k in run:
                s[k] = run[k]
        out[name] = s
    if "best_s" in out.get("trie_beam", {}):  # the same basis for every contender: best and median of all runs
        for other in ("rank", "vllm_choice"):
            if "best_s" in out.get(other, {}):
                for basis in ("best_s", "median_s"):
                    out["trie_beam"][f"speedup_vs_{other}_{basis[:-2]}"] = out[other][basis] / out["trie_beam"][basis]
    return out


# ------------------------------------------------------------------------------------------------- worker side
def _timing(times: list[float]) -> dict:
    """Wall times of the repeated runs: the first (cold), the best and the median of all runs (the basis every
    contender is compared on), and the best of the runs after the first (warm)."""
    import statistics

    return {"cold_s": times[0], "warm_s": min(times[1:] or times), "best_s": min(times),
            "median_s": statistics.median(times), "reps_s": times}


def _record(trie: Any, names: set, name: Optional[str], tokens: list, log_prob: Optional[float]) -> dict:
    entry = trie.lookup(tokens)
    return {"name": name if name is not None else (entry.name if entry else None), "tokens": list(tokens),
            "log_prob": log_prob, "valid": entry is not None or (name in names)}


def _worker(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    from transformers import AutoTokenizer

    from trie_decode import TokenTrie

    tok = AutoTokenizer.from_pretrained(spec["model"])
    trie = TokenTrie.load(spec["trie"])
    names = json.loads(Path(spec["names"]).read_text())
    name_set = set(names)
    prompts = [_chat(tok, q) for q in spec["questions"]]
    width = spec["beam_width"]
    eos = tok.eos_token_id
    out: dict[str, Any] = {"contender": spec["contender"]}
    c = spec["contender"]
    if c == "rank":
        import torch
        from transformers import AutoModelForCausalLM

        from trie_decode.integrations.transformers import rank

        model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32).eval()
        n = max(len(p) for p in prompts)
        pad = tok.pad_token_id if tok.pad_token_id is not None else eos
        ids = torch.tensor([[pad] * (n - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (n - len(p)) + [1] * len(p) for p in prompts])

        def run() -> list:
            return rank(model, {"input_ids": ids, "attention_mask": mask}, trie, width, tokenizer=tok, pad_token_id=pad)

        times = []
        for _ in range(spec["reps"]):
            t = time.perf_counter()
            got = run()
            times.append(time.perf_counter() - t)
        out["results"] = [[_record(trie, name_set, r.entry.name, list(r.entry.tokens), r.log_prob) for r in per] for per in got]
        out.update(_timing(times))
    elif c == "trie_beam":
        from vllm import LLM

        from trie_decode.integrations.vllm_beam import BeamStats, beam_engine_kwargs, beam_search

        t = time.perf_counter()
        llm = LLM(spec["model"], dtype="float32", max_model_len=1024, max_num_seqs=64, enforce_eager=True, seed=0,
                  disable_log_stats=False, **beam_engine_kwargs())
        out["boot_s"] = time.perf_counter() - t

        def counters() -> tuple[float, float]:
            q = h = 0.0
            for m in llm.get_metrics():
                if m.name == "vllm:prefix_cache_queries":
                    q += m.value
                elif m.name == "vllm:prefix_cache_hits":
                    h += m.value
            return q, h

        times, stats = [], []
        for i in range(spec["reps"]):
            st = BeamStats()
            q0, h0 = counters()
            t = time.perf_counter()
            got = beam_search(llm, prompts, spec["trie"], width, stats=st)
            times.append(time.perf_counter() - t)
            q1, h1 = counters()
            stats.append({"steps": st.steps, "requests": st.requests, "prompt_tokens": st.prompt_tokens,
                          "cache_queries": q1 - q0, "cache_hits": h1 - h0,
                          "per_step_s": [round(x, 4) for x in st.per_step_seconds]})
        out["results"] = [[_record(trie, name_set, b.entry.name, list(b.entry.tokens), b.log_prob) for b in per] for per in got]
        out.update(_timing(times))
        out["steps"], out["requests"] = stats[-1]["steps"], stats[-1]["requests"]
        last = stats[-1]
        out["prefix_cache_hit_rate"] = last["cache_hits"] / last["cache_queries"] if last["cache_queries"] else None
        out["stats"] = stats
    elif c == "vllm_choice":
        from vllm import LLM
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import BeamSearchParams, StructuredOutputsParams

        t = time.perf_counter()
        # "auto" (vLLM's default backend) is not resolved by LLM.beam_search in vLLM 0.32: name the backend.
        llm = LLM(spec["model"], dtype="float32", max_model_len=1024, max_num_seqs=64, enforce_eager=True, seed=0,
                  structured_outputs_config={"backend": "xgrammar"})
        out["boot_s"] = time.perf_counter() - t
        from vllm.v1.structured_output.utils import choice_as_grammar

        # LLM.beam_search in vLLM 0.32 passes StructuredOutputsParams(choice=...) to the backend unconverted
        # ("grammar is not of valid supported types"): give it the grammar vLLM itself builds for a choice.
        params = BeamSearchParams(beam_width=width, max_tokens=trie.max_depth + 1, length_penalty=0.0,
                                  structured_outputs=StructuredOutputsParams(grammar=choice_as_grammar(names)))
        times = []
        for _ in range(spec["reps"]):
            t = time.perf_counter()
            got = llm.beam_search([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
            times.append(time.perf_counter() - t)
        res = []
        for p, o in zip(prompts, got):
            per = []
            for seq in o.sequences:
                gen = list(seq.tokens[len(p):])
                while gen and gen[-1] == eos:
                    gen.pop()
                text = tok.decode(gen, skip_special_tokens=True)
                # vLLM's sequences end without the end token when the grammar terminates: not comparable log-probs
                per.append(_record(trie, name_set, text if text in name_set else None, gen, None)
                           | {"text": text, "cum_logprob": seq.cum_logprob})
            res.append(per)
        out["results"] = res
        out.update(_timing(times))
    Path(spec["result"]).write_text(json.dumps(out))


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        _worker(sys.argv[2])
    else:
        import argparse

        ap = argparse.ArgumentParser(prog="python -m benchmarks.beam_suite",
                                     description="trie beam search on vLLM vs transformers' rank vs vLLM's beam search")
        ap.add_argument("out_dir", nargs="?", default="bench-results")
        ap.add_argument("--quick", action="store_true", help="4 prompts, 2 runs each")
        ap.add_argument("--reuse", action="store_true", help="keep contenders' results already in OUT_DIR")
        ap.add_argument("--reps", type=int, default=None, help="timed runs per contender (default 3)")
        a = ap.parse_args()
        if a.reps is not None and a.reps < 1:
            ap.error(f"--reps must be at least 1, got {a.reps}")
        res = run_beam_suite(a.quick, Path(a.out_dir), reuse=a.reuse, reps=a.reps)
        print(json.dumps(res["summary"], indent=2))
