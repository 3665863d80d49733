"""``trie-decode bench``: the benchmark suites (build, step, generate, fastforward, vllm, retrieval, beam).

Why this exists: the claim of this package is a number (the per-step cost of masking to one of N names, against
the best-known ways to do it) and the number must be reproducible by anyone: same name lists, same tokenizer, each
peer used the way its users use it, failures reported instead of dropped, and the ``fill_(-inf)`` floor measured in
the same process so that results from different machines compare as ratios.

Usage::

    trie-decode bench --suite step --quick        # CI smoke run, ~3 minutes on 2 CPU cores
    python -m benchmarks --suite all --plots      # the full report (hours on a small CPU)

This folder is part of the source checkout, not of the installed package (the wheel ships the product only):
``trie-decode bench`` finds it beside the ``trie_decode`` folder of an editable install, and ``python -m
benchmarks`` runs from the checkout's root. The model and tokenizer fixtures the suites load are in
``model_fixtures/``, beside it.

Layout: :mod:`.peers` (the interface and one class per peer, plus the registries our implementation plugs into),
:mod:`.data` (name lists), :mod:`.timing`, :mod:`.worker` (the measuring process), :mod:`.suites` (supervision and
the suites), :mod:`.report` (tables, JSON, plots). Heavy imports (torch, transformers, the peers' libraries) happen
only when a suite runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

__all__ = ["main", "build_parser", "child_env", "CHECKOUT"]

CHECKOUT = Path(__file__).resolve().parent.parent


def child_env(**overrides: str) -> dict[str, str]:
    """``os.environ`` plus ``overrides``, with the checkout's root on ``PYTHONPATH`` (first, unless already there).

    Every measurement runs in a ``python -m benchmarks.<module>`` subprocess (and vLLM spawns engine processes of
    its own); ``benchmarks`` and ``model_fixtures`` are not installed, so the children find them through
    ``PYTHONPATH`` whatever their working folder.
    """
    env = dict(os.environ, **overrides)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(CHECKOUT) not in paths:
        env["PYTHONPATH"] = os.pathsep.join([str(CHECKOUT), *paths])
    return env


def _size_list(text: str) -> list[int]:
    from .data import parse_size

    try:
        values = [parse_size(t) for t in text.split(",") if t.strip()]
    except ValueError as exc:  # argparse would say only "invalid _size_list value"
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated sizes, got {text!r}")
    return values


def _number(kind: type, low: float, what: str) -> Callable[[str], Any]:
    """An argparse type: ``kind(text)``, finite and above ``low``; else a usage error saying it expected ``what``."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not low < value < float("inf"):  # NaN too
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value

    return parse


_positive_int = _number(int, 0, "a positive integer")
_non_negative_int = _number(int, -1, "an integer >= 0")
_positive_float = _number(float, 0, "a positive number")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def build_parser(prog: str = "trie-decode bench") -> argparse.ArgumentParser:
    """The command-line parser of the benchmark (shared by ``trie-decode bench`` and ``python -m``)."""
    from .data import NAME_KINDS
    from .suites import SUITES

    p = argparse.ArgumentParser(prog=prog, description="Benchmark trie_decode against its peers.")
    p.add_argument("--suite", choices=[*SUITES, "all"], default="step", help="which suite to run (default: step)")
    p.add_argument("--quick", action="store_true", help="CI smoke sizes (1k, 10k) and batches (1, 8), short budgets")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="output folder (default: ./bench-results)")
    p.add_argument("--plots", action="store_true", help="also write PNG plots (matplotlib)")
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default: auto = cuda when available)")
    p.add_argument("--sizes", type=_size_list, help="entries per list, e.g. 1k,10k,100k,1M (overrides defaults)")
    p.add_argument("--batches", type=_int_list, help="batch sizes, e.g. 1,8,64 (overrides defaults)")
    p.add_argument("--peers", type=lambda s: [t.strip() for t in s.split(",") if t.strip()],
                   help="comma-separated peer names (default: all registered; see --list-peers)")
    p.add_argument("--list-peers", action="store_true", help="list the registered peers and exit")
    p.add_argument("--names", choices=NAME_KINDS, default="auto",
                   help="name lists: auto = real names up to 13k, titles to 100k, semantic ids above")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=_non_negative_int, default=1,
                   help="torch threads in the measuring processes on CPU (default 1; 0 = torch's default)")
    p.add_argument("--setup-limit", type=_positive_float,
                   help="seconds allowed for one peer's setup at one size (default 120, quick 30)")
    p.add_argument("--budget", type=_positive_float,
                   help="seconds of measuring per (peer, size, batch) (default 30, quick 3)")
    p.add_argument("--mem-limit", type=_positive_float, help="GiB of RSS after which a peer's process is killed")
    p.add_argument("--steps", type=_positive_int, help="decode steps per repeat (default 64, quick 32)")
    p.add_argument("--repeats", type=_positive_int, help="repeats per measurement (default 5, quick 3)")
    p.add_argument("--tokenizer", help="tokenizer folder, or a family: gemma3 (262k ids), llama3.2, deepseek, qwen3.6, "
                   "mistral-v1, mistral-v3, mistral-tekken, smollm2 (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                   help="one process per peer in the step suite (default: on, off with --quick)")
    return p


def main(argv: Sequence[str] | None = None, prog: str = "trie-decode bench") -> int:
    """Run the benchmark from command-line arguments; returns the process exit code.

    Failing peers are results, not errors: the exit code is 0 when the suites ran, 2 on bad arguments.
    """
    args = build_parser(prog).parse_args(argv)
    from .peers import BUILD_PEERS, STEP_PEERS
    from .suites import SUITES, BenchConfig, run, workers_stop_with_us

    if args.list_peers:
        for label, reg in (("step", STEP_PEERS), ("build", BUILD_PEERS)):
            print(f"{label}:")
            for name, target in reg.items():
                print(f"  {name:<20} {target}")
        return 0
    cfg = BenchConfig(
        suites=list(SUITES) if args.suite == "all" else [args.suite],
        quick=args.quick, out_dir=args.out, plots=args.plots, device=args.device, sizes=args.sizes,
        batches=args.batches, peers=args.peers, names=args.names, seed=args.seed, threads=args.threads,
        setup_limit_s=args.setup_limit, measure_budget_s=args.budget, mem_limit_gib=args.mem_limit,
        steps=args.steps, repeats=args.repeats, tokenizer=args.tokenizer, isolate=args.isolate,
    )
    try:
        with workers_stop_with_us():  # Ctrl-C or SIGTERM stops the worker processes too
            run(cfg)
    except ValueError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    return 0
