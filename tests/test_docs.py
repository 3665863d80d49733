"""Code blocks in README.md and docs/*.md that are complete programs run as tests.

A fenced block tagged ```python is a complete program: it runs in a fresh interpreter (this venv's python) from a
temporary folder and must exit 0. Fragments are tagged ```python no-run (or ```text / ```bash) and are not run.
Blocks that load the real model are marked ``model`` (they mention ``smollm2_path``); blocks that need vLLM are
tagged ```python no-run in docs/, since each would start an engine (the examples cover vLLM end to end); the
README's own vLLM example does run (marked ``vllm``): it is the first thing a user copies.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)


def _blocks():
    out = []
    for page in PAGES:
        text = page.read_text()
        for i, m in enumerate(_BLOCK.finditer(text)):
            line = text[: m.start()].count("\n") + 1
            code = m.group(1)
            marks = [pytest.mark.model, pytest.mark.slow] if "smollm2_path" in code else []
            if "from vllm import" in code:
                marks.append(pytest.mark.vllm)
            out.append(pytest.param(code, id=f"{page.name}:{line}", marks=marks))
    return out


BLOCKS = _blocks()


def test_docs_have_runnable_blocks():
    assert len(BLOCKS) >= 5
    docs_blocks = [p for p in BLOCKS if not p.id.startswith("README.md")]
    assert not any("from vllm import" in p.values[0] or "import vllm" in p.values[0] for p in docs_blocks)


@pytest.mark.parametrize("code", BLOCKS)
def test_doc_block_runs(code, tmp_path):
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", MPLBACKEND="Agg")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"


def test_doc_links_resolve():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#:]+(?:\.(?:md|py|ipynb)|/))(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).resolve().exists(), f"{page.name} links to missing {target}"


def _section(page: str, title: str) -> str:
    text = (DOCS / page).read_text()
    return text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_troubleshooting_one_trie_per_prompt_is_exact():
    # Inside generate, 2 tries over 4 prompts (a multiple of 2 rows) is refused: one trie per prompt, exactly.
    from trie_decode.errors import ConstraintConfigError
    from trie_decode.options import check_prompts

    with pytest.raises(ConstraintConfigError, match="one per prompt"):
        check_prompts(4, 1, {"tries": 2})
    assert "exactly one trie per prompt" in _section("troubleshooting.md", "One trie per prompt")

