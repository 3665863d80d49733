"""Packaging: the repo's top-level ``integrations/`` folder is shipped as ``trie_decode.integrations``.

pyproject.toml maps it with ``package-dir``; that mapping has to work both for the editable install that
``make venv`` creates and for a normal wheel install (what users get), and the console script must exist.
The wheel ships the product only: the benchmarks (``benchmarks/``), the model and tokenizer fixtures
(``model_fixtures/``) and the demo (``examples/demo.py``) stay in the checkout, and the package never imports them
(except ``trie-decode bench``, which finds the checkout first and says so when there is none).
"""

from __future__ import annotations

import importlib
import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DIST = "trie-decode"
# Top-level packages of the checkout that the wheel does not ship.
CHECKOUT_ONLY = ("benchmarks", "model_fixtures")

# Things in a work tree that are not sources: never copied into the build.
_NOT_SOURCES = shutil.ignore_patterns(
    ".git", ".venv", "venv", "build", "dist", "*.egg-info", "__pycache__", "*.pyc", ".hypothesis",
    ".pytest_cache", ".cache", "bench-results", "*.safetensors", "*.gguf",
)


def _is_under(path: str | os.PathLike[str], folder: Path) -> bool:
    return Path(path).resolve().is_relative_to(folder.resolve())


# --- (a) the editable install of the current environment -------------------------------------------------


def _installed_dist() -> md.Distribution:
    """The distribution pip installed into this environment's site-packages.

    Not ``md.distribution(DIST)``: with ``python -m pytest`` the repo is on sys.path, and a stale
    ``trie_decode.egg-info`` left there by a build would be found first.
    """
    purelib = sysconfig.get_paths()["purelib"]
    found = list(md.distributions(name=DIST, path=[purelib]))
    assert len(found) == 1, f"expected one {DIST} in {purelib}, found {len(found)}"
    return found[0]


def test_current_env_has_an_editable_install_of_this_repo():
    direct_url = _installed_dist().read_text("direct_url.json")
    assert direct_url, f"{DIST} was not installed by pip from a local folder (no direct_url.json)"
    info = json.loads(direct_url)
    assert info.get("dir_info", {}).get("editable") is True, f"{DIST} is not an editable install: {info}"
    assert info["url"].startswith("file://")
    assert Path(info["url"][len("file://"):]).resolve() == REPO.resolve(), (
        f"{DIST} is installed editable from {info['url']}, not from this repo {REPO}"
    )


def test_editable_install_maps_integrations_folder():
    trie_decode = importlib.import_module("trie_decode")
    integrations = importlib.import_module("trie_decode.integrations")
    smollm2 = importlib.import_module("trie_decode.integrations.smollm2")

    assert _is_under(trie_decode.__file__, REPO / "trie_decode")
    assert Path(integrations.__file__).resolve() == (REPO / "integrations" / "__init__.py").resolve()
    assert Path(smollm2.__file__).resolve() == (REPO / "integrations" / "smollm2.py").resolve()
    assert callable(smollm2.smollm2_path)


def test_import_trie_decode_does_not_import_frameworks():
    """integrations/__init__.py promises that ``import trie_decode`` never pulls in transformers or vLLM."""
    code = (
        "import sys, trie_decode, trie_decode.integrations\n"
        "bad = sorted(m for m in ('transformers', 'vllm') if m in sys.modules)\n"
        "assert not bad, f'import trie_decode imported {bad}'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=300)


# --- (b) a normal, non-editable install ----------------------------------------------------------------


@pytest.fixture(scope="module")
def built_wheel(tmp_path_factory) -> Path:
    """A wheel built from a copy of the work tree (building in place would write build/ into the repo)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(REPO, src, ignore=_NOT_SOURCES)
    out = tmp / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--wheel-dir", str(out), str(src)],
        check=True, cwd=tmp, timeout=600,
    )
    wheels = list(out.glob("trie_decode-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_wheel_contents_map_integrations(built_wheel):
    names = set(zipfile.ZipFile(built_wheel).namelist())
    assert "trie_decode/__init__.py" in names
    assert "trie_decode/integrations/__init__.py" in names
    assert "trie_decode/integrations/smollm2.py" in names
    assert "trie_decode/py.typed" in names
    # Shipped only under its package name, never as a top-level `integrations` package.
    assert not any(n.startswith("integrations/") for n in names), sorted(n for n in names if n.startswith("integ"))
    # No test, venv or repo files leaking into the wheel.
    assert not any(n.startswith(("tests/", ".venv/", "scripts/", "examples/")) for n in names)
    # The product only: no benchmarks, model fixtures or demo, under any name.
    assert not any(n.startswith(tuple(f"{p}/" for p in CHECKOUT_ONLY)) for n in names)
    assert not any(n.startswith("trie_decode/bench/") for n in names)
    for moved in ("gemma3.py", "tokenizer_zoo.py", "demo.py"):
        assert not any(n.endswith(f"/{moved}") for n in names), moved
    assert "trie_decode/bitmask.py" in names and "trie_decode/masking.py" not in names
    # Every shipped module has its source in the package's two folders (nothing generated or copied in).
    for n in (n for n in names if n.endswith(".py")):
        rel = Path(n).relative_to("trie_decode")
        in_integrations = rel.parts[0] == "integrations"
        src = REPO / "integrations" / rel.relative_to("integrations") if in_integrations else REPO / "trie_decode" / rel
        assert src.is_file(), n
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(built_wheel).read(entry_points).decode()
    assert "trie-decode = trie_decode.cli:main" in text


@pytest.fixture(scope="module")
def wheel_install(built_wheel, tmp_path_factory) -> Path:
    """The wheel installed (no dependencies) into a folder of its own: what a user of the wheel has."""
    tmp = tmp_path_factory.mktemp("wheel-install")
    target = tmp / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--target", str(target), str(built_wheel)],
        check=True, cwd=tmp, timeout=600,
    )
    return target


def test_normal_install_imports_integrations_from_install_dir(wheel_install):
    target = wheel_install
    assert (target / "trie_decode" / "integrations" / "smollm2.py").is_file()
    assert not (target / "integrations").exists()

    code = (
        "import json, trie_decode, trie_decode.integrations, trie_decode.integrations.smollm2 as m\n"
        "print(json.dumps([trie_decode.__file__, trie_decode.integrations.__file__, m.__file__,"
        " callable(m.smollm2_path)]))\n"
    )
    # cwd and PYTHONPATH are the install dir, so the repo is not on sys.path; the venv's editable finder still
    # is (it sits in site-packages), which is exactly why the files must be checked to come from `target`.
    env = {**os.environ, "PYTHONPATH": str(target)}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=target, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    pkg_file, integrations_file, smollm2_file, has_fn = json.loads(proc.stdout.strip().splitlines()[-1])
    for f in (pkg_file, integrations_file, smollm2_file):
        assert _is_under(f, target), f"{f} imported from outside the install dir {target}"
    assert Path(smollm2_file).resolve() == (target / "trie_decode" / "integrations" / "smollm2.py").resolve()
    assert has_fn


def test_normal_install_bench_says_it_runs_from_a_checkout(wheel_install):
    """Without the checkout's ``benchmarks/``, ``trie-decode bench`` says where the benchmarks are (exit 2)."""
    code = "import sys, trie_decode.cli as cli\nprint(cli.__file__)\nsys.exit(cli.main(['bench', '--quick']))\n"
    env = {**os.environ, "PYTHONPATH": str(wheel_install)}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=wheel_install, env=env, capture_output=True, text=True, timeout=300
    )
    assert _is_under(proc.stdout.strip().splitlines()[0], wheel_install), proc.stdout
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "run from a source checkout" in proc.stderr and "not part of the installed package" in proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


# --- (c) the console script ------------------------------------------------------------------------------


def test_console_script_entry_point_declared():
    eps = [ep for ep in _installed_dist().entry_points if ep.group == "console_scripts" and ep.name == "trie-decode"]
    assert [ep.value for ep in eps] == ["trie_decode.cli:main"]


def test_console_script_help_runs():
    # sys.executable is the venv's python (not resolved: resolving would leave the venv); scripts sit beside it.
    script = Path(sys.executable).parent / "trie-decode"
    assert script.is_file(), f"console script missing: {script}"
    proc = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, f"trie-decode --help exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "usage" in proc.stdout.lower(), proc.stdout


def _module_graph() -> dict[str, set[str]]:
    """Every import (module level or inside a function) between the package's own modules, from the source."""
    import ast

    root = Path(__file__).resolve().parent.parent
    files = {}
    roots = [(root / "trie_decode", "trie_decode"), (root / "integrations", "trie_decode.integrations")]
    roots += [(root / name, name) for name in CHECKOUT_ONLY]
    for base, prefix in roots:
        for path in base.rglob("*.py"):
            rel = path.relative_to(base).with_suffix("").parts
            name = ".".join((prefix, *rel))
            files[name.removesuffix(".__init__")] = (path, path.name == "__init__.py")
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, (path, is_pkg) in files.items():
        package = name if is_pkg else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{base}.{node.module}" if node.module else base
                else:
                    base = node.module or ""
                subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in files]
                targets = subs or [base]
            for t in targets:
                while t and t not in files and "." in t:
                    t = t.rpartition(".")[0]
                # Importing an ancestor package is how Python reaches any submodule: not a dependency edge.
                if t in files and t != name and not name.startswith(t + "."):
                    graph[name].add(t)
    return graph


def test_no_import_cycles():
    """Imports go one way (docs/concepts.md, "Where things live"): no cycle, not even through call-time imports."""
    graph = _module_graph()
    assert "trie_decode.constraint" in graph and "trie_decode.integrations.vllm" in graph
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                cycles.append(sorted(scc))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_package_never_imports_the_checkout_only_folders():
    """The wheel lacks ``benchmarks`` and ``model_fixtures``, so the shipped modules must not import them; the one
    exception is ``trie-decode bench``, which imports ``benchmarks`` at call time, after finding the checkout."""
    import ast

    graph = _module_graph()
    assert "benchmarks.suites" in graph and "model_fixtures.gemma3" in graph
    shipped = [name for name in graph if name.split(".")[0] == "trie_decode"]
    edges = {(src, dst) for src in shipped for dst in graph[src] if dst.split(".")[0] in CHECKOUT_ONLY}
    assert edges == {("trie_decode.cli", "benchmarks")}, sorted(edges)
    top_level = [n for n in ast.parse((REPO / "trie_decode" / "cli.py").read_text()).body
                 if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert not [ast.unparse(n) for n in top_level if "benchmarks" in ast.unparse(n)]


def test_public_api():
    """``from trie_decode import ...`` gives what the docs and doctests use, and ``__all__`` lists only real names."""
    import doctest

    import trie_decode

    assert len(trie_decode.__all__) == len(set(trie_decode.__all__))
    assert not [name for name in trie_decode.__all__ if not hasattr(trie_decode, name)]
    for name, module in (("TokenTrie", "trie"), ("TrieConstraint", "constraint"), ("SpanRules", "spans"),
                         ("catalog_from_codes", "catalogs"), ("LiveCatalog", "live")):
        assert name in trie_decode.__all__, name
        assert getattr(trie_decode, name) is getattr(importlib.import_module(f"trie_decode.{module}"), name)
    result = doctest.testmod(trie_decode, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0, result
