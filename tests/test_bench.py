"""A quick run of every benchmark suite: it runs, and its JSON holds every peer and the floor (numbers are not
asserted: they belong to the benchmark report, not to tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trie_decode.bench.peers import BUILD_PEERS, STEP_PEERS

pytestmark = pytest.mark.slow


def _bench(suite: str, out: Path, *extra: str) -> dict:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", VLLM_CPU_KVCACHE_SPACE="1")
    proc = subprocess.run(
        [sys.executable, "-m", "trie_decode.bench", "--suite", suite, "--quick", "--out", str(out), *extra],
        env=env, capture_output=True, text=True, timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    path = out / f"{suite}.json" if suite != "vllm" else out / "vllm_suite.json"
    return json.loads(path.read_text())


def test_step_suite_quick(tmp_path):
    data = _bench("step", tmp_path)
    records = data["records"]
    assert {r["peer"] for r in records} == set(STEP_PEERS)
    ours = [r for r in records if r["peer"] == "trie_decode"]
    assert ours and all(r["status"] == "ok" and r["violations"] == 0 for r in ours)
    for r in records:
        if r.get("status") == "ok":
            assert r["floor_ms"] > 0 and r["step_ms"] > 0 and r["ratio"] == pytest.approx(r["step_ms"] / r["floor_ms"])
        elif r.get("status") == "wrong":  # a peer that masked a valid next token is reported, not dropped
            assert r["violations"] > 0
        else:
            assert r.get("error") or r.get("status") in ("skipped", "unavailable", "timeout"), r


def test_build_suite_quick(tmp_path):
    records = _bench("build", tmp_path)["records"]
    peers = {r["peer"] for r in records}
    assert set(BUILD_PEERS) <= peers
    target = [r for r in records if "target" in r["peer"]]
    assert target and target[0]["bytes_per_node"] > 0


@pytest.mark.model
def test_generate_and_fastforward_suites_quick(tmp_path):
    gen = _bench("generate", tmp_path)["records"]
    assert {r["batch"] for r in gen} == {1, 8}
    assert all(r["outputs_valid"] and r["plain_s"] > 0 for r in gen)
    ff = _bench("fastforward", tmp_path)
    recs = ff["records"] if "records" in ff else ff
    assert recs and all(r["identical"] for r in recs)


@pytest.mark.vllm
def test_vllm_suite_quick(tmp_path):
    data = _bench("vllm", tmp_path)
    assert data["runs"], data
    for n, runs in data["runs"].items():
        assert "error" not in runs, runs
        assert {"unconstrained/fixed", "trie/fixed", "choice/natural_cold"} <= set(runs)
        assert data["ratios"][n]["trie_vs_unconstrained_fixed_tokens_per_s"] > 0
