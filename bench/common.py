"""Shared pieces of every `xpod bench`: sample statistics, rows, tables, JSON lines, progress.

A row is a plain dict so that the JSON line, the table and the plot read the same keys. Units are
in the key names (`p50_us`, `gbps`, `cpu_s_per_die`). Every row carries the git sha and the date so
that a JSON file outlives the run that wrote it.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence

import numpy as np

from runtime.cli.argtypes import (  # re-exported: bench code imports them from here
    fmt_size,
    parse_size,
)

_GIT_SHA: str | None = None


def git_sha() -> str:
    """Short sha of the checkout the benchmark runs from ("unknown" outside git)."""
    global _GIT_SHA
    if _GIT_SHA is None:
        here = os.path.dirname(os.path.abspath(__file__))
        try:
            out = subprocess.run(
                ["git", "-C", here, "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                timeout=5,
                check=False,
            )
            _GIT_SHA = out.stdout.strip() or "unknown"
        except (OSError, subprocess.SubprocessError):
            _GIT_SHA = "unknown"
    return _GIT_SHA


def run_info() -> dict:
    """Fields stamped on every row: when, where, which code."""
    return {
        "date": datetime.date.today().isoformat(),
        "host_cores": os.cpu_count(),
        "python": platform.python_version(),
        "git_sha": git_sha(),
    }


def latency_stats(samples_ns: Sequence[float] | np.ndarray) -> dict:
    """p50 / p99 / min / mean of per-iteration times, in microseconds."""
    a = np.asarray(samples_ns, dtype=np.float64) / 1e3
    if a.size == 0:
        return {"p50_us": float("nan"), "p99_us": float("nan"), "min_us": float("nan")}
    return {
        "p50_us": float(np.percentile(a, 50)),
        "p99_us": float(np.percentile(a, 99)),
        "min_us": float(a.min()),
        "mean_us": float(a.mean()),
        "iters": int(a.size),
    }


def p2p_row(
    transport: str,
    variant: str,
    cores: int,
    size_bytes: int,
    one_way_ns: Sequence[float] | np.ndarray,
    cpu_s_per_die: float,
    **extra: object,
) -> dict:
    """One `bench: "p2p"` row from one-way latency samples (half of each ping-pong round trip).

    `gbps` is ping-pong bandwidth: size / p50 one-way time (GB = 1e9 bytes).
    """
    row = {"bench": "p2p", "transport": transport, "variant": variant, "cores": cores}
    row["size_bytes"] = int(size_bytes)
    row.update(latency_stats(one_way_ns))
    p50 = row["p50_us"]
    row["gbps"] = size_bytes / (p50 * 1e3) if p50 and p50 == p50 else 0.0
    row["cpu_s_per_die"] = float(cpu_s_per_die)
    row.update(extra)
    row.update(run_info())
    return row


def parse_sizes(text: str) -> list[int]:
    """'8,4K,1M' -> bytes (empty items skipped); ValueError on a bad size."""
    return [parse_size(s) for s in text.split(",") if s.strip()]


def print_table(rows: Iterable[dict], columns: Sequence[tuple[str, str, str]], file=None) -> None:
    """Print rows as a fixed-width table. columns: (key, header, format spec)."""
    file = file or sys.stdout
    rows = list(rows)
    cells = [[_cell(r.get(k), spec) for k, _, spec in columns] for r in rows]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, (_, h, _) in enumerate(columns)]
    print("  ".join(h.rjust(w) for (_, h, _), w in zip(columns, widths, strict=True)), file=file)
    for c in cells:
        print("  ".join(v.rjust(w) for v, w in zip(c, widths, strict=True)), file=file)
    file.flush()


def _cell(value: object, spec: str) -> str:
    if value is None or value == "":
        return "-"
    if spec == "size" and isinstance(value, int):
        return fmt_size(value)
    if spec and isinstance(value, int | float):
        return format(value, spec)
    return str(value)


def write_jsonl(path: str, rows: Iterable[dict], append: bool = False) -> None:
    """One JSON object per line; `append` keeps rows of earlier runs."""
    with open(path, "a" if append else "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, sort_keys=False) + "\n")


def pct(xs: Sequence[float], q: float) -> float | None:
    """The q-th percentile of xs (None: no samples)."""
    return float(np.percentile(xs, q)) if len(xs) else None


def write_json(path: str, obj: dict) -> None:
    """One JSON object to `path` (indented), and a progress line saying so."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
    progress(f"  wrote {path}")


def write_outputs(rows: list[dict], json_path: str | None, plot_path: str | None) -> None:
    """The --json and --plot outputs every bench offers."""
    if json_path:
        write_jsonl(json_path, rows)
        progress(f"wrote {len(rows)} rows to {json_path}")
    if plot_path:
        from bench.plot import plot_rows

        plot_rows(rows, plot_path)
        progress(f"wrote {plot_path}")


def progress(msg: str) -> None:
    """A progress line on stderr, so stdout stays a clean table."""
    print(msg, file=sys.stderr, flush=True)


class Bar:
    """Requests done / total and output tok/s on stderr (a redrawn line on a terminal, a line
    per quarter otherwise)."""

    def __init__(self, label: str, total: int, enabled: bool):
        self.label, self.total, self.enabled = label, total, enabled
        self.tty = enabled and sys.stderr.isatty()
        self.done = self.tokens = 0
        self.t0 = time.perf_counter()
        self.shown = 0

    def add_tokens(self, n: int) -> None:
        self.tokens += n

    def finished(self) -> None:
        self.done += 1
        if self.enabled and not self.tty and self.done * 4 // self.total > self.shown:
            self.shown = self.done * 4 // self.total
            progress(self.line())

    def line(self) -> str:
        el = time.perf_counter() - self.t0
        w = 30
        k = w * self.done // max(self.total, 1)
        return (
            f"  {self.label} [{'#' * k}{'.' * (w - k)}] {self.done}/{self.total} req"
            f"  {self.tokens / el if el > 0 else 0:.0f} tok/s  {el:.1f} s"
        )

    def draw(self) -> None:
        if self.tty:
            sys.stderr.write("\r" + self.line())
            sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\r" + self.line() + "\n")
            sys.stderr.flush()
