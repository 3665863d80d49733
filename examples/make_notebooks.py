"""Generate the example notebooks from the example scripts, and optionally execute them (outputs saved).

Why this exists: the scripts are the source of truth; each notebook is its script split into cells at ``# %%``
markers (jupytext's percent format), so the two never drift (tests/test_examples.py checks the cells match).

    python examples/make_notebooks.py              # write every notebook, without outputs
    python examples/make_notebooks.py --execute    # write and execute them (outputs saved in the .ipynb)
    python examples/make_notebooks.py --execute entity_linking
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import nbformat

HERE = Path(__file__).resolve().parent
SCRIPTS = ["entity_linking", "generative_retrieval", "fast_forward", "action_spans", "json_fields", "vllm_offline",
           "vllm_serve"]
_MARKER = re.compile(r"^# %%(?P<md> \[markdown\])?\s*$")


def split_cells(source: str) -> list[tuple[str, str]]:
    """(kind, text) per cell: kind is "code" or "markdown" (markdown lines lose their leading ``# ``)."""
    cells: list[tuple[str, list[str]]] = []
    for line in source.splitlines():
        m = _MARKER.match(line)
        if m:
            cells.append(("markdown" if m.group("md") else "code", []))
        elif cells:
            cells[-1][1].append(line)
    out = []
    for kind, lines in cells:
        if kind == "markdown":
            lines = [ln[2:] if ln.startswith("# ") else ln.lstrip("#") for ln in lines]
        text = "\n".join(lines).strip("\n")
        if text:
            out.append((kind, text))
    return out


def notebook_for(script: Path) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    for kind, text in split_cells(script.read_text()):
        nb.cells.append(nbformat.v4.new_markdown_cell(text) if kind == "markdown" else nbformat.v4.new_code_cell(text))
    return nb


def execute(nb: nbformat.NotebookNode, timeout: int = 1800) -> None:
    """Run every cell in a fresh kernel of the current interpreter's ``python3`` kernelspec (ipykernel)."""
    from nbclient import NotebookClient

    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}).execute()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help=f"scripts to convert (default: all of {SCRIPTS})")
    parser.add_argument("--execute", action="store_true", help="execute the notebooks and save their outputs")
    args = parser.parse_args(argv)
    for name in args.names or SCRIPTS:
        script = HERE / f"{name}.py"
        nb = notebook_for(script)
        if args.execute:
            print(f"executing {name}.ipynb ...", flush=True)
            execute(nb)
        nbformat.write(nb, HERE / f"{name}.ipynb")
        print(f"wrote {name}.ipynb ({len(nb.cells)} cells)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
