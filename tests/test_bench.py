"""A quick run of every benchmark suite: it runs, and its JSON holds every peer and the floor (numbers are not
asserted: they belong to the benchmark report, not to tests).

The suites live in the checkout's ``benchmarks/`` folder, not in the installed package; each run goes through the
documented command, ``trie-decode bench``, from a folder outside the checkout, so the command's way of finding the
checkout (and the suites' worker processes finding ``benchmarks``) is tested too. What a wheel install says
instead is tested in tests/test_packaging.py."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks.peers import BUILD_PEERS, STEP_PEERS

# The venv's console script (sys.executable is the venv's python, not resolved: resolving would leave the venv).
TRIE_DECODE = Path(sys.executable).parent / "trie-decode"


def _run_bench(cwd: Path, *args: str, timeout: float = 1500) -> subprocess.CompletedProcess:
    # PYTHONPATH cleared: the command must find the checkout by itself, not through the test's environment.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(TOKENIZERS_PARALLELISM="false", VLLM_CPU_KVCACHE_SPACE="1")
    return subprocess.run([str(TRIE_DECODE), "bench", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _bench(suite: str, out: Path, *extra: str) -> dict:
    proc = _run_bench(out, "--suite", suite, "--quick", "--out", str(out), *extra)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    path = out / f"{suite}.json" if suite != "vllm" else out / "vllm_suite.json"
    return json.loads(path.read_text())


def test_bench_command_finds_the_checkout_from_any_folder(tmp_path):
    proc = _run_bench(tmp_path, "--list-peers", timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "benchmarks.ours:TrieDecodePeer" in proc.stdout, proc.stdout
    assert all(name in proc.stdout for name in STEP_PEERS), proc.stdout


def test_an_out_folder_that_cannot_be_made_is_a_usage_error(tmp_path, capsys):
    import benchmarks

    (tmp_path / "plain").write_text("x")  # was: a FileExistsError traceback from pathlib
    assert benchmarks.main(["--suite", "build", "--quick", "--out", str(tmp_path / "plain" / "out")]) == 2
    assert "error: cannot write the results to --out" in capsys.readouterr().err  # stderr, as argparse's errors


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # a zombie is dead, not yet reaped
    except OSError:
        return False


def _workers(pid: int) -> list[int]:
    """The ``benchmarks.worker`` children of process ``pid``, from /proc."""
    found = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(c) for c in f.read().split()]
        for child in list(found):
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"benchmarks.worker" not in f.read():
                    found.remove(child)
    except OSError:  # a process that ended meanwhile: look again
        return []
    return found


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_bench_stops_its_workers(tmp_path, sig):
    """SIGTERM or SIGINT to the bench kills its worker processes before it ends. A worker runs in a session of its
    own: neither signal reached it, and it ran on, orphaned, until its next write to the closed pipe. (Run as
    ``python -m trie_decode.cli``: the checkout under test, whatever the venv's console script points to.)"""
    proc = subprocess.Popen([sys.executable, "-m", "trie_decode.cli", "bench", "--suite", "step", "--quick", "--out",
                             str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not workers and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
            workers = _workers(proc.pid)
        assert workers, "the bench started no worker"
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == -sig
        deadline = time.monotonic() + 2  # SIGKILL was sent before the bench ended: a moment to take effect
        while any(map(_alive, workers)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in workers if _alive(p)], "a worker outlived the bench"
    finally:
        proc.kill()
        for p in workers:  # a failed run leaves no orphan behind
            if _alive(p):
                os.kill(p, signal.SIGKILL)


@pytest.mark.slow
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


@pytest.mark.slow
def test_build_suite_quick(tmp_path):
    records = _bench("build", tmp_path)["records"]
    peers = {r["peer"] for r in records}
    assert set(BUILD_PEERS) <= peers
    target = [r for r in records if "target" in r["peer"]]
    assert target and target[0]["bytes_per_node"] > 0


@pytest.mark.slow
@pytest.mark.model
def test_generate_and_fastforward_suites_quick(tmp_path):
    # --repeats reaches the hooked suites (it was read by the step suite only: silently ignored here).
    gen = _bench("generate", tmp_path, "--repeats", "1")["records"]
    assert {r["batch"] for r in gen} == {1, 8} and {r["repeats"] for r in gen} == {1}
    assert all(r["outputs_valid"] and r["plain_s"] > 0 for r in gen)
    ff = _bench("fastforward", tmp_path, "--repeats", "1")
    recs = ff["records"] if "records" in ff else ff
    assert recs and all(r["identical"] for r in recs) and ff["environment"]["repeats"] == 1


@pytest.mark.slow
def test_the_step_suites_beam_peer_takes_the_processors_beam_fast_path(tokenizer):
    """The step suite's stand-in for beam search writes ``running_beam_indices`` in generate's layout (each appended
    token's column, later columns -1) between calls, so the processor follows rows by parent (its fast path, no
    fallback warning, no prefix hashes) and masks as the core does."""
    import warnings

    from benchmarks.ours import TrieDecodePeer, TrieDecodeProcessorBeamPeer

    names = ["Bosnia and Herzegovina", "Saint Vincent and the Grenadines", "Democratic Republic of the Congo", "Peru"]
    beam, core = TrieDecodeProcessorBeamPeer(), TrieDecodePeer()
    for peer in (beam, core):
        peer.setup(names, tokenizer)
        peer.start(3, "cpu")
    walk = tokenizer(names[:3], add_special_tokens=False)["input_ids"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for t in range(min(len(w) for w in walk)):
            logits = torch.randn(3, len(tokenizer))
            tokens = None if t == 0 else torch.tensor([w[t - 1] for w in walk])
            if tokens is not None:
                beam.feed(tokens)
            assert torch.equal(beam.step(logits.clone(), tokens).isfinite(), core.step(logits.clone(), tokens).isfinite())
    proc = beam._procs[0]
    assert min(len(w) for w in walk) >= 5 and proc._hashes is None and proc.steps == min(len(w) for w in walk)


def test_retrieval_suite_quick_takes_the_processors_beam_fast_path(tmp_path):
    """The retrieval suite runs from the command line, and its stand-in for beam search hands the processor
    ``running_beam_indices`` in generate's layout, so the fast path is what it measures (no fallback warning)."""
    proc = _run_bench(tmp_path, "--suite", "retrieval", "--quick", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "UnverifiedTransformersWarning" not in proc.stderr + proc.stdout
    assert json.loads((tmp_path / "retrieval.json").read_text())


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_suite_quick(tmp_path):
    data = _bench("vllm", tmp_path, "--repeats", "1")
    assert data["runs"] and data["config"]["reps"] == 1, data
    for n, runs in data["runs"].items():
        assert "error" not in runs, runs
        assert {"unconstrained/fixed", "trie/fixed", "choice/natural_cold"} <= set(runs)
        assert data["ratios"][n]["trie_vs_unconstrained_fixed_tokens_per_s"] > 0


@pytest.mark.parametrize("flags, message", [
    (["--budget", "-1"], "argument --budget: expected a positive number, got '-1'"),
    (["--budget", "0"], "argument --budget: expected a positive number"),
    (["--setup-limit", "nan"], "argument --setup-limit: expected a positive number"),
    (["--mem-limit", "-2"], "argument --mem-limit: expected a positive number"),
    (["--steps", "0"], "argument --steps: expected a positive integer"),
    (["--repeats", "-3"], "argument --repeats: expected a positive integer"),
    (["--threads", "-1"], "argument --threads: expected an integer >= 0"),
    (["--sizes", "0"], "argument --sizes: size must be positive, got '0'"),
    (["--sizes", ","], "argument --sizes: expected comma-separated sizes"),
    (["--batches", "0"], "argument --batches: expected positive integers"),
])
def test_bad_numbers_are_usage_errors(flags, message, capsys):
    # Were accepted (a negative budget, zero steps), or named only as "invalid _size_list value".
    from benchmarks import build_parser

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(flags)
    assert exc.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--suite", "vllm", "--steps", "4"], "--steps is not read by --suite vllm (the vllm suite reads --sizes, "
                                          "--repeats): leave it out, or choose a suite that reads it"),
    (["--suite", "retrieval", "--repeats", "1"], "--repeats is not read by --suite retrieval (the retrieval suite "
                                                 "reads none of them)"),
    (["--suite", "build", "--batches", "1,8"], "--batches is not read by --suite build (the build suite reads --sizes, "
                                               "--peers, --setup-limit, --mem-limit, --tokenizer)"),
])
def test_a_flag_the_chosen_suite_does_not_read_is_a_usage_error(argv, message, tmp_path, capsys):
    # Were ignored without a word: --repeats 5 with the vllm suite ran 2 repeats, --tokenizer with generate SmolLM2.
    import benchmarks

    assert benchmarks.main([*argv, "--quick", "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


def test_a_tokenizer_found_nowhere_is_a_usage_error_at_once(tmp_path, monkeypatch, capsys):
    # Was AutoTokenizer.from_pretrained: the hub's retries (55 s without network), then an OSError traceback.
    import benchmarks

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    argv = ["--suite", "build", "--quick", "--tokenizer", "no-such-org/no-such-tokenizer", "--out", str(tmp_path)]
    assert benchmarks.main(argv) == 2
    err = capsys.readouterr().err
    assert "error: --tokenizer no-such-org/no-such-tokenizer: neither a local folder nor" in err, err


def test_every_documented_bench_command_passes_the_flag_check():
    # The flags each documented command gives are read by its suites (a flag no chosen suite reads is refused).
    import re
    import shlex

    from benchmarks import build_parser
    from benchmarks.suites import SUITES, BenchConfig, given_flags

    root = Path(__file__).resolve().parents[1]
    flag = r"--[a-z-]+(?: [^\s`|#)-][^\s`|#)]*)? ?"  # a flag and its value (a command may wrap a line)
    commands = [m.group(1) for doc in [root / "README.md", *sorted((root / "docs").glob("*.md"))]
                for m in re.finditer(rf"trie-decode bench ((?:{flag})+)", doc.read_text().replace("\n", " "))]
    commands = [c for c in commands if "--help" not in c]
    assert len(commands) >= 15 and any("--tokenizer gemma3" in c for c in commands), commands
    for command in commands:
        args = build_parser().parse_args(shlex.split(command))
        given_flags(BenchConfig(suites=list(SUITES) if args.suite == "all" else [args.suite], sizes=args.sizes,
                                batches=args.batches, peers=args.peers, steps=args.steps, repeats=args.repeats,
                                measure_budget_s=args.budget, setup_limit_s=args.setup_limit,
                                mem_limit_gib=args.mem_limit, tokenizer=args.tokenizer, isolate=args.isolate))
