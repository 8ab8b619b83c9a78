"""PNG plots of `xpod bench` rows (the dicts of bench/common.py, or their JSON lines).

matplotlib is an optional extra (`pip install -e '.[plot]'`), imported only when a plot is asked
for, and used through its Agg canvas: no pyplot, no display, no global backend switch.
"""

from __future__ import annotations

import math
from collections import defaultdict

from bench.common import fmt_size

MATPLOTLIB_MISSING = "--plot needs matplotlib: pip install -e '.[plot]'"
_XPOD_COLORS = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown",
                "tab:pink", "tab:olive", "tab:cyan", "gold", "navy", "lime"]  # fmt: skip
_PEER_STYLE = {
    "shm-floor": {"color": "black", "linestyle": "--"},
    "mpi4py": {"color": "dimgray", "linestyle": "--"},
    "zmq-ipc": {"color": "darkgray", "linestyle": ":"},
    "pipe": {"color": "silver", "linestyle": ":"},
}
MAX_SIZE_TICKS = 10  # a size axis from 8 B to 64 MiB has 24 doublings: label every few


def plot_rows(rows: list[dict], path: str) -> None:
    """Plot rows of one benchmark to a PNG at `path`, picked by rows[0]["bench"]."""
    if not rows:
        raise ValueError("no rows to plot")
    bench = rows[0].get("bench")
    if bench == "p2p":
        plot_p2p(rows, path)
    else:
        raise NotImplementedError(f"no plot for bench {bench!r} yet (only 'p2p')")


def plot_p2p(rows: list[dict], path: str) -> None:
    """Two log-log panels, p50 one-way latency (µs) and bandwidth (GB/s) against message size.

    One line per label: the transport for peers, "xpod <variant> c<cores>" for our protocol.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import FixedLocator, NullLocator
    except ImportError as e:
        raise RuntimeError(MATPLOTLIB_MISSING) from e
    lines = _p2p_lines(rows)
    if not lines:
        raise ValueError("no p2p rows to plot")
    fig = Figure(figsize=(12, 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    lat_ax, bw_ax = fig.subplots(1, 2)
    xpod_colors = iter(_XPOD_COLORS * 4)
    for label, points in lines.items():
        # xpod rows: solid lines, a colour per variant and cores; peers: dashed, greys/black
        style = _PEER_STYLE.get(label) or {"color": next(xpod_colors), "linestyle": "-"}
        sizes = [r["size_bytes"] for r in points]
        lat_ax.plot(sizes, [r["p50_us"] for r in points], marker="o", ms=3, label=label, **style)
        bw = [(r["size_bytes"], r["gbps"]) for r in points if r["gbps"] > 0]
        bw_ax.plot([s for s, _ in bw], [g for _, g in bw], marker="o", ms=3, label=label, **style)
    ticks = _size_ticks([r["size_bytes"] for points in lines.values() for r in points])
    for ax, ylabel in ((lat_ax, "p50 one-way latency (µs)"), (bw_ax, "bandwidth (GB/s)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticklabels([_size_label(t) for t in ticks])
        ax.set_xlabel("message size")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    bw_ax.legend(fontsize="small")
    dates = sorted({str(r.get("date", "?")) for r in rows})
    fig.suptitle(f"xpod bench p2p: ping-pong, one-way = round trip / 2 ({', '.join(dates)})")
    fig.savefig(path, dpi=110)


def _p2p_lines(rows: list[dict]) -> dict[str, list[dict]]:
    """label -> its p2p rows sorted by size, labels in order of first appearance."""
    lines: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        if r.get("bench") == "p2p":
            lines[_label(r)].append(r)
    return {label: sorted(points, key=lambda r: r["size_bytes"]) for label, points in lines.items()}


def _label(row: dict) -> str:
    if row["transport"] == "xpod":
        return f"xpod {row['variant']} c{row['cores']}"
    return row["transport"]


def _size_ticks(sizes: list[int]) -> list[int]:
    """Powers of two from the smallest to the largest size, both ends labelled, ~MAX_SIZE_TICKS."""
    lo = math.floor(math.log2(min(sizes)))
    hi = math.ceil(math.log2(max(sizes)))
    step = max(1, math.ceil((hi - lo) / (MAX_SIZE_TICKS - 1)))
    exps = list(range(lo, hi + 1, step))
    if exps[-1] != hi:
        if 2 * (hi - exps[-1]) < step:  # too close to the end label to read: drop it
            exps.pop()
        exps.append(hi)
    return [1 << e for e in exps]


def _size_label(n: int) -> str:
    text = fmt_size(n)
    return text + "B" if text.isdigit() else text
