"""A tokenizer given by name (``trie_decode.hub.load_tokenizer``: the CLI's ``--tokenizer``, the vLLM processor's
``model_config.tokenizer``): a name that is nowhere fails at once with a named error when the hub is off or does not
answer, a name in the Hugging Face cache loads at once, and an online user's hub names go to ``from_pretrained``
unchanged. Before, transformers retried the hub for about 50 s (a cached name: 2 minutes) on a machine without
network. The hub is made unreachable with ``HF_ENDPOINT`` on a closed local port, so the tests do not depend on the
machine's network."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trie_decode.errors import TokenizerNotFoundError, TrieDecodeError

ROOT = Path(__file__).resolve().parent.parent
CLOSED_PORT = "http://127.0.0.1:9"  # discard: nothing listens, the connection is refused at once
CACHED = "trie-decode-test/smol"
#: How much longer than the same build from a local folder, timed in the same test, a run may take: transformers'
#: retries sleep 50 s and more, which machine load does not shorten (a fixed bound failed under load).
SLACK_S = 20.0


def _fake_cache(cache: Path, smollm2_dir: str) -> Path:
    """A Hugging Face cache holding SmolLM2's tokenizer files as the hub name :data:`CACHED` (main -> one commit)."""
    repo = cache / ("models--" + CACHED.replace("/", "--"))
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "chat_template.jinja"):
        if (Path(smollm2_dir) / name).exists():
            shutil.copy(Path(smollm2_dir) / name, snapshot / name)
    return cache


def _cli(args, **env):
    """``trie-decode`` in a fresh process (the hub's settings are read at import), timed."""
    environ = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    environ.update(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), environ.get("PYTHONPATH")])), **env)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "trie_decode.cli", *args], capture_output=True, text=True,
                          env=environ, timeout=600)
    return done, time.perf_counter() - start


@pytest.fixture
def names(tmp_path):
    path = tmp_path / "names.txt"
    path.write_text("France\nJapan\n")
    return str(path)


def _fast(tmp_path, names, smollm2_dir) -> float:
    """The time bound of a run: the same build from SmolLM2's local folder (torch, transformers loaded), plus
    :data:`SLACK_S`."""
    done, took = _cli(["build", names, "--tokenizer", smollm2_dir, "-o", str(tmp_path / "local.trie")])
    assert done.returncode == 0, done.stderr
    return took + SLACK_S


def test_a_name_found_nowhere_fails_at_once_when_the_hub_does_not_answer(tmp_path, names, smollm2_dir):
    bound = _fast(tmp_path, names, smollm2_dir)
    done, took = _cli(["build", names, "--tokenizer", "no-such-org/no-such-tokenizer", "-o", str(tmp_path / "o.trie")],
                      HF_ENDPOINT=CLOSED_PORT, HF_HUB_CACHE=str(tmp_path / "empty-cache"))
    assert done.returncode == 1, done.stderr
    assert ("--tokenizer no-such-org/no-such-tokenizer: neither a local folder nor a tokenizer in the Hugging Face "
            "cache, and the hub is not reachable (http://127.0.0.1:9 did not answer") in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and took < bound, (took, bound, done.stderr)


def test_a_cached_name_loads_at_once_without_the_hub(tmp_path, names, smollm2_dir, tokenizer):
    from trie_decode import TokenTrie
    from trie_decode.tokenizers import tokenizer_fingerprint

    cache = _fake_cache(tmp_path / "cache", smollm2_dir)
    out = tmp_path / "o.trie.safetensors"
    bound = _fast(tmp_path, names, smollm2_dir)
    done, took = _cli(["build", names, "--tokenizer", CACHED, "-o", str(out)],
                      HF_ENDPOINT=CLOSED_PORT, HF_HUB_CACHE=str(cache))
    assert done.returncode == 0, done.stderr
    assert took < bound, (took, bound, done.stdout)
    assert TokenTrie.load(out).fingerprint == tokenizer_fingerprint(tokenizer)


def test_hf_hub_offline_reads_only_the_cache(monkeypatch, tmp_path, smollm2_dir, tokenizer):
    """Set after huggingface_hub was imported (which read it then): it still counts, and nothing is requested."""
    from huggingface_hub import constants

    from trie_decode import hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(_fake_cache(tmp_path / "cache", smollm2_dir)))
    monkeypatch.setattr(hub, "hub_unreachable", lambda *a, **k: pytest.fail("the hub was asked"))
    assert hub.load_tokenizer(CACHED).get_vocab() == tokenizer.get_vocab()
    start = time.perf_counter()
    with pytest.raises(TokenizerNotFoundError) as err:
        hub.load_tokenizer("no-such-org/no-such-tokenizer")
    assert time.perf_counter() - start < 5.0
    assert isinstance(err.value, (TrieDecodeError, ValueError))
    assert str(err.value).startswith("tokenizer no-such-org/no-such-tokenizer: neither a local folder nor a tokenizer "
                                     "in the Hugging Face cache, and the hub is off (HF_HUB_OFFLINE is set)")


def test_online_false_never_asks_the_hub(monkeypatch, tmp_path):
    from huggingface_hub import constants

    from trie_decode import hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(hub, "hub_unreachable", lambda *a, **k: pytest.fail("the hub was asked"))
    with pytest.raises(TokenizerNotFoundError, match=r"the hub is off \(online=False\)"):
        hub.load_tokenizer("some-org/some-tokenizer", online=False)


def test_a_reachable_hub_gets_the_name_as_from_pretrained_always_did(monkeypatch):
    """An online user: the hub answers, so ``from_pretrained`` runs with the caller's options and nothing else
    (no ``local_files_only``: updates and revisions as before)."""
    from transformers import AutoTokenizer

    from trie_decode import hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(hub, "hub_unreachable", lambda *a, **k: None)
    calls = []
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda name, **kw: calls.append((name, kw)) or "tok")
    assert hub.load_tokenizer("HuggingFaceTB/SmolLM2-135M-Instruct", revision="v1") == "tok"
    assert calls == [("HuggingFaceTB/SmolLM2-135M-Instruct", {"revision": "v1", "trust_remote_code": False})]


def test_the_probe_names_what_stopped_it(monkeypatch):
    from huggingface_hub import constants

    from trie_decode.hub import hub_unreachable

    monkeypatch.setattr(constants, "ENDPOINT", CLOSED_PORT)
    start = time.perf_counter()
    reason = hub_unreachable()
    assert reason is not None and reason.startswith(f"{CLOSED_PORT} did not answer: ConnectError"), reason
    assert time.perf_counter() - start < 5.0


def test_a_folder_loads_and_a_missing_path_is_no_such_folder(smollm2_dir, tokenizer, tmp_path):
    from trie_decode.hub import load_tokenizer

    assert load_tokenizer(smollm2_dir).get_vocab() == tokenizer.get_vocab()
    with pytest.raises(TokenizerNotFoundError, match="no such folder"):
        load_tokenizer(str(tmp_path / "missing"))
