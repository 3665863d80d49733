"""The examples: every notebook executes and is its script's cells (so every script's code runs); the vLLM scripts
also run as processes.

Scripts run as subprocesses of this interpreter (``sys.executable``, the venv's python), from a temporary working
folder. Notebooks execute with nbclient in the ``python3`` kernel of ipykernel; jupyter_client launches a kernelspec
whose command is ``python`` with *this* interpreter, so the kernel is the venv's python on a fresh machine too
(no registered kernelspec needed). The vLLM examples start one engine each and are marked ``vllm``.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))
from make_notebooks import SCRIPTS, split_cells  # noqa: E402

sys.path.remove(str(EXAMPLES))

# Script-only examples (no notebook: executing one costs minutes of Ray and engine start-up). Each is run, and its
# EXPECTED lines checked, by its own test module: vllm_batch_pipeline by tests/test_vllm_batch.py.
SCRIPT_ONLY = ["vllm_batch_pipeline"]
TRANSFORMERS = ["entity_linking", "generative_retrieval", "fast_forward", "action_spans", "json_fields"]
VLLM = ["vllm_offline", "vllm_serve"]
assert sorted(TRANSFORMERS + VLLM) == sorted(SCRIPTS)
TIMEOUT = {"vllm_offline": 1200, "vllm_serve": 1200}
# What each example must print: its answers, not just something. A wrong answer, a missing row or a refusal that
# did not happen fails the test (the model is greedy and the data fixed, so these lines are stable).
EXPECTED = {
    "entity_linking": [r"Mexico\?.*-> entry #\d+ +Spanish", r"Germany\?.*-> entry #\d+ +German "],
    "generative_retrieval": [
        r"without a filter, 3 of the 10 are already seen: ESP ITA FRA",
        r"with deny=\['FRA', 'ITA', 'ESP'\]: 10 distinct items, 0 seen\n +1\. MAR +Morocco +log p",
        r"with deny=\['JPN', 'THA', 'VNM'\]: 10 distinct items, 0 seen\n +1\. IDN +Indonesia +log p",
        r"distinct=False: (\d+) items, (?!\1 )\d+ distinct",  # greedy lists loop without distinct=True
        r"distinct=True: (\d+) items, \1 distinct: EGY, MAR, IND, CHN, JPN, KOR",
        r"249 items -> \d+ distinct codes \([1-9]\d* items share a code\)",
        r"seen items among the results: 0\n",
    ],
    "fast_forward": [r"'Latin\.' .*identical: True", r"skip_ratio"],
    "action_spans": [r"Action: convert_currency\n +-> actions: \['convert_currency'\]", r"allowed next tokens: +1 of"],
    "json_fields": [r"Eiffel Tower.*-> \{'city': 'Paris', 'country': 'France'\}  in catalogs: True",
                    r"Machu Picchu.*in catalogs: True", r"10000 tool names", r"German.*known tool: True"],
    "vllm_offline": [r"Germany\? +' German' +ends with EOS: True", r"refused: ", r"next request: ' French'"],
    "vllm_serve": [r"200 Which country is Paris the capital of\? +' France'", r"\n400 \{", r"server stopped with 0"],
    "vllm_batch_pipeline": [r"Which country is Rome in\? +' Italy'", r"people in Germany speak\? +' German'",
                            r"\n8 rows in "],
}
assert sorted(EXPECTED) == sorted(SCRIPTS + SCRIPT_ONLY)


def _check_printed(name: str, printed: str) -> None:
    import re

    for pattern in EXPECTED[name]:
        assert re.search(pattern, printed), f"examples/{name} did not print /{pattern}/:\n{printed[-3000:]}"
    assert "identical: False" not in printed
    assert "in catalogs: False" not in printed and "known tool: False" not in printed


def _params(names):
    marks = {"vllm_offline": [pytest.mark.vllm], "vllm_serve": [pytest.mark.vllm]}
    return [pytest.param(n, marks=[pytest.mark.model, pytest.mark.slow, *marks.get(n, [])], id=n) for n in names]


def _env() -> dict:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", MPLBACKEND="Agg", PYTHONUNBUFFERED="1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


def _needs_vllm(name: str) -> None:
    """The test environment installs vLLM (make venv); a missing vLLM must fail, not skip."""
    if name in VLLM:
        import vllm  # noqa: F401


@pytest.mark.parametrize("name", SCRIPTS)
def test_notebook_is_its_script(name):
    import nbformat

    nb = nbformat.read(EXAMPLES / f"{name}.ipynb", as_version=4)
    committed = [(c.cell_type, c.source.strip("\n")) for c in nb.cells]
    assert committed == split_cells((EXAMPLES / f"{name}.py").read_text()), (
        f"examples/{name}.ipynb is out of date: run `python examples/make_notebooks.py --execute {name}`"
    )


@pytest.mark.parametrize("name", SCRIPTS)
def test_committed_notebook_has_outputs_and_no_errors(name):
    import nbformat

    nb = nbformat.read(EXAMPLES / f"{name}.ipynb", as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code), f"examples/{name}.ipynb was saved without executing it"
    assert any(c.outputs for c in code)
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors, errors[0].get("evalue")


# A transformers example's notebook is its script's cells (test_notebook_is_its_script), executed in a kernel whose
# __name__ is "__main__" too: executing it runs the script's code, so only the vLLM scripts also run as processes
# (an engine started from a script and from a kernel spawn its workers differently).
@pytest.mark.parametrize("name", _params(VLLM))
def test_script_runs(name, smollm2_dir, tmp_path):
    _needs_vllm(name)
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py")],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=TIMEOUT.get(name, 600),
    )
    assert proc.returncode == 0, f"examples/{name}.py failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    _check_printed(name, proc.stdout)
    print(f"{name}.py: {time.perf_counter() - start:.0f} s")


@pytest.mark.parametrize("name", _params(SCRIPTS))
def test_notebook_executes(name, smollm2_dir, tmp_path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    _needs_vllm(name)
    for key, value in _env().items():
        monkeypatch.setenv(key, value)  # the kernel inherits this process's environment
    nb = nbformat.read(EXAMPLES / f"{name}.ipynb", as_version=4)
    fresh = copy.deepcopy(nb)
    for cell in fresh.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    start = time.perf_counter()
    client = NotebookClient(
        fresh, timeout=TIMEOUT.get(name, 600), kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()  # raises CellExecutionError with the cell and the traceback on the first failing cell
    printed = "".join(o.get("text", "") for c in fresh.cells if c.cell_type == "code" for o in c.outputs)
    _check_printed(name, printed)
    print(f"{name}.ipynb: {time.perf_counter() - start:.0f} s")
