"""Fast-forward suite: wall time and forward passes of fast-forward vs step-by-step constrained decoding.

Why this exists: issue 4's goal is >= 1.5x faster than the step-by-step processor wherever at least half of the
emitted tokens are forced by the trie. Both methods run greedily on SmolLM2-135M-Instruct (float32, CPU) with a
real name list (the ~7.9k ISO 639-3 language names of pycountry, tokenized with a leading space), on the same
left-padded prompts, at batch 1 and batch 8:

    step     model.generate(logits_processor=[TrieLogitsProcessor(trie)])   one forward pass per token
    fast     model.generate(custom_generate=fast_forward_generate, trie=trie)  one pass per real decision

Workloads:
    single   "eos" mode: one language name per prompt, then the end token.
    list     "repeat" mode with a "," separator: a comma-separated list of names (up to ``max_new_tokens``).

Per (workload, batch) the record holds the median wall time of each method over interleaved repeats (after a
warmup), the speed-up, both methods' forward passes, the skip ratio (forced tokens / emitted tokens), the median
time of the prefill alone (one forward pass over the prompts: the part fast-forward cannot shorten), the speed-up
of what follows the prefill (``decode_speedup``), and whether the two outputs are token-for-token identical.

Entry point for the suite runner: :func:`run_fastforward_suite`.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

__all__ = ["run_fastforward_suite"]

LANGUAGE_QUESTIONS = [
    "Which language is spoken in Brazil?",
    "What is the official language of Iran?",
    "Which language do most people in Ethiopia speak?",
    "What language is spoken in the Netherlands?",
    "Which language is spoken in Quebec besides English?",
    "What is the national language of Pakistan?",
    "Which language do people in Kenya speak besides English?",
    "What language is spoken in Catalonia besides Spanish?",
]
LIST_QUESTIONS = [
    "List languages spoken in India, separated by commas.",
    "List languages spoken in Europe, separated by commas.",
    "List languages spoken in Africa, separated by commas.",
    "List languages spoken in China, separated by commas.",
    "List languages spoken in Russia, separated by commas.",
    "List languages spoken in Indonesia, separated by commas.",
    "List languages spoken in Nigeria, separated by commas.",
    "List languages spoken in Mexico, separated by commas.",
]


def _chat(tokenizer: Any, question: str, suffix: str, prefill: str) -> str:
    messages = [{"role": "user", "content": question + suffix}]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + prefill


def _median_time(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def run_fastforward_suite(
    quick: bool,
    out_dir: Any,
    *,
    workloads: Optional[Sequence[str]] = None,
    repeats: Optional[int] = None,
    progress: Optional[Callable[[dict[str, Any]], None]] = None,
) -> dict[str, Any]:
    """Run the suite; write ``fastforward.json`` into ``out_dir`` and return its content.

    Args:
        quick: batch 1 and 8 of the ``single`` workload only, 2 repeats (about 2-4 minutes on 2 busy CPU cores);
            otherwise both workloads and 5 repeats.
        out_dir: folder for the JSON result (created if missing; rewritten after every record).
        workloads: run only these (``"single"``, ``"list"``); default: see ``quick``.
        repeats: timed repeats per method and configuration (default 2 quick, 5 otherwise).
        progress: called with each record (without its outputs) as soon as it is measured.

    Returns:
        ``{"suite": "fastforward", "records": [...], "environment": {...}}``; each record has ``workload``,
        ``batch``, ``step_s``, ``fast_s``, ``speedup``, ``prefill_s``, ``decode_speedup``, ``step_passes``, ``fast_passes``,
        ``tokens_emitted``, ``forced_tokens``, ``skip_ratio``, ``identical``, ``goal_met`` (speed-up >= 1.5 where
        the skip ratio is >= 0.5; None where the goal does not apply).
    """
    import pycountry
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trie_decode import TokenTrie
    from trie_decode.integrations.fast_forward import fast_forward_generate
    from trie_decode.integrations.smollm2 import smollm2_path
    from trie_decode.integrations.transformers import TrieLogitsProcessor

    out_path = Path(out_dir)
    out_path.mkdir(parents=True, exist_ok=True)
    path = smollm2_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    names = sorted({lang.name for lang in pycountry.languages})
    trie = TokenTrie.from_strings(names, tokenizer, leading_space=True)
    comma = tokenizer(",", add_special_tokens=False)["input_ids"]

    specs = {
        "single": dict(questions=LANGUAGE_QUESTIONS, suffix=" Answer with the name only.", prefill="The answer is",
                       options=dict(on_complete="eos"), max_new_tokens=24),
        "list": dict(questions=LIST_QUESTIONS, suffix="", prefill="Languages:",
                     options=dict(on_complete="repeat", separator=comma), max_new_tokens=48),
    }
    chosen = workloads if workloads is not None else (["single"] if quick else list(specs))
    unknown = set(chosen) - set(specs)
    if unknown:
        raise ValueError(f"workloads must be among {sorted(specs)}, got {sorted(unknown)}")
    repeats = repeats or (2 if quick else 5)
    records: list[dict[str, Any]] = []
    for workload in chosen:
        spec = specs[workload]
        for batch in (1, 8):
            prompts = [_chat(tokenizer, q, spec["suffix"], spec["prefill"]) for q in spec["questions"][:batch]]
            inputs = tokenizer(prompts, return_tensors="pt", padding=True)
            gen = dict(max_new_tokens=spec["max_new_tokens"], do_sample=False)
            processor = TrieLogitsProcessor(trie, tokenizer, **spec["options"])

            def step() -> Any:
                return model.generate(**inputs, logits_processor=[processor], **gen)

            def fast() -> Any:
                return model.generate(**inputs, custom_generate=fast_forward_generate, trie=trie, **spec["options"], **gen)

            def prefill() -> Any:
                with torch.no_grad():
                    return model(**inputs, logits_to_keep=1)

            ref, out = step(), fast()  # warmup; also the outputs compared
            step_passes = processor.steps
            times: dict[str, list[float]] = {"step": [], "fast": [], "prefill": []}
            for rep in range(repeats):
                order = [("step", step), ("fast", fast)] if rep % 2 == 0 else [("fast", fast), ("step", step)]
                for label, fn in order + [("prefill", prefill)]:
                    seconds, _ = _median_time(fn)
                    times[label].append(seconds)
            stats = out.stats
            step_s, fast_s = statistics.median(times["step"]), statistics.median(times["fast"])
            prefill_s = statistics.median(times["prefill"])
            record = {
                "suite": "fastforward",
                "workload": workload,
                "batch": batch,
                "names": len(names),
                "prompt_tokens": int(inputs["input_ids"].shape[1]),
                "max_new_tokens": spec["max_new_tokens"],
                "step_s": round(step_s, 4),
                "fast_s": round(fast_s, 4),
                "speedup": round(step_s / fast_s, 3),
                "prefill_s": round(prefill_s, 4),
                # Time after the prefill (which both methods pay in full): where fast-forward saves.
                "decode_speedup": round(
                    (step_s - prefill_s) / (fast_s - prefill_s), 3) if fast_s > prefill_s < step_s else None,
                "step_passes": step_passes,
                "fast_passes": stats.forward_passes,
                "tokens_emitted": stats.tokens_emitted,
                "forced_tokens": stats.forced_tokens,
                "skip_ratio": round(stats.skip_ratio, 4),
                "identical": bool(torch.equal(ref, out)),
                "outputs": [
                    tokenizer.decode(row[inputs["input_ids"].shape[1] :], skip_special_tokens=True) for row in out
                ],
                "times": {k: [round(t, 4) for t in v] for k, v in times.items()},
            }
            record["goal_met"] = record["speedup"] >= 1.5 if record["skip_ratio"] >= 0.5 else None
            records.append(record)
            _write(out_path, records, quick, repeats)  # after every record: a long run killed midway keeps its results
            if progress is not None:
                progress({k: v for k, v in record.items() if k not in ("outputs", "times")})
    return _write(out_path, records, quick, repeats)


def _write(out_path: Path, records: list[dict[str, Any]], quick: bool, repeats: int) -> dict[str, Any]:
    import torch

    result = {
        "suite": "fastforward",
        "records": records,
        "environment": {"torch": torch.__version__, "threads": torch.get_num_threads(), "quick": quick, "repeats": repeats},
    }
    (out_path / "fastforward.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":  # pragma: no cover - manual runs
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks.fastforward_suite")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--workload", action="append", choices=["single", "list"])
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--out", default="bench-results")
    args = parser.parse_args()
    run_fastforward_suite(
        args.quick, args.out, workloads=args.workload, repeats=args.repeats, progress=lambda r: print(r, flush=True)
    )
