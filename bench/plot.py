"""PNG plots of `xpod bench` rows (the dicts of bench/common.py, or their JSON lines).

p2p: latency and bandwidth against message size. alltoall: dispatch / combine latency and busbw
against batch size (the papers' Fig. 6) and, with several EP degrees, against EP degree (Table 7).

matplotlib is an optional extra (`pip install -e '.[plot]'`), imported only when a plot is asked
for, and used through its Agg canvas: no pyplot, no display, no global backend switch.
"""

from __future__ import annotations

import math
from collections import defaultdict

from runtime.cli.argtypes import fmt_size

MATPLOTLIB_MISSING = "--plot needs matplotlib: pip install -e '.[plot]'"
_XPOD_COLORS = ["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown",
                "tab:pink", "tab:olive", "tab:cyan", "gold", "navy", "lime"]  # fmt: skip
_PEER_STYLE = {
    "shm-floor": {"color": "black", "linestyle": "--"},
    "mpi4py": {"color": "dimgray", "linestyle": "--"},
    "zmq-ipc": {"color": "darkgray", "linestyle": ":"},
    "pipe": {"color": "silver", "linestyle": ":"},
}
_A2A_PEER_STYLE = {
    "mpi4py": {"color": "dimgray", "linestyle": "--"},
    "zmq": {"color": "darkgray", "linestyle": ":"},
}
A2A_KEYS = ("transport", "protocol", "quant", "dies", "attention_dies", "batch",
            "dispatch_p50_us", "combine_p50_us", "total_p50_us", "busbw_gbps")  # fmt: skip
MAX_SIZE_TICKS = 10  # a size axis from 8 B to 64 MiB has 24 doublings: label every few


def plot_rows(rows: list[dict], path: str) -> None:
    """Plot rows of one benchmark to a PNG at `path`, picked by rows[0]["bench"]."""
    if not rows:
        raise ValueError("no rows to plot")
    bench = rows[0].get("bench")
    if bench == "p2p":
        plot_p2p(rows, path)
    elif bench == "alltoall":
        missing = [k for k in A2A_KEYS if k not in rows[0]]
        if missing:
            raise ValueError(
                f"alltoall rows lack {', '.join(missing)}: not `xpod bench alltoall` rows"
            )
        plot_alltoall(rows, path)
    else:
        raise NotImplementedError(
            f"no plot for bench {bench!r} rows with keys {sorted(rows[0])}"
            f" (plots: 'p2p', 'alltoall' with {', '.join(A2A_KEYS)})"
        )


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


def plot_alltoall(rows: list[dict], path: str) -> None:
    """Fig. 6 / Table 7 of the papers from `xpod bench alltoall` rows.

    Top: dispatch p50, combine p50 and busbw against batch size (log-log), one line per
    (transport, protocol, quant, pod). Bottom left, when the rows hold more than one EP degree:
    dispatch + combine p50 against EP degree, one line per (transport, protocol, quant, batch).
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import FixedLocator, NullLocator
    except ImportError as e:
        raise RuntimeError(MATPLOTLIB_MISSING) from e
    rows = [r for r in rows if r.get("bench") == "alltoall"]
    if not rows:
        raise ValueError("no alltoall rows to plot")
    ep_degrees = sorted({r["dies"] for r in rows if not r["attention_dies"]})
    fig = Figure(figsize=(15, 8.5 if len(ep_degrees) > 1 else 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2 if len(ep_degrees) > 1 else 1, 3, squeeze=False)
    panels = (
        ("dispatch_p50_us", "dispatch p50 (µs)"),
        ("combine_p50_us", "combine p50 (µs)"),
        ("busbw_gbps", "busbw (GB/s)"),
    )
    lines = _a2a_lines(rows, lambda r: r["batch"])
    colors = iter(_XPOD_COLORS * 8)
    styles = {
        label: _A2A_PEER_STYLE.get(points[0]["transport"])
        or {"color": next(colors), "linestyle": "-"}
        for label, points in lines.items()
    }
    batches = sorted({r["batch"] for r in rows})
    for ax, (key, ylabel) in zip(axes[0], panels, strict=True):
        for label, points in lines.items():
            pts = [(r["batch"], r[key]) for r in points if r[key] > 0]
            marker = "o" if points[0]["quant"] == "int8" else "s"
            ax.plot(
                [b for b, _ in pts],
                [v for _, v in pts],
                marker=marker,
                ms=3,
                label=label,
                **styles[label],
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(FixedLocator(batches))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticklabels([str(b) for b in batches])
        ax.set_xlabel("batch (tokens per die)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    if len(ep_degrees) > 1:
        _plot_ep_degree(axes[1], rows, ep_degrees)
        axes[1][1].legend(handles, labels, loc="upper left", fontsize="x-small", title="top row")
    else:
        fig.legend(handles, labels, loc="outside right upper", fontsize="x-small")
    dates = sorted({str(r.get("date", "?")) for r in rows})
    r0 = rows[0]
    fig.suptitle(
        f"xpod bench alltoall: hidden {r0['hidden']}, top-{r0['topk']},"
        f" {r0['num_experts']} experts ({', '.join(dates)})"
    )
    fig.savefig(path, dpi=110)


def _plot_ep_degree(axes, rows: list[dict], ep_degrees: list[int]) -> None:
    from matplotlib.ticker import FixedLocator, NullLocator

    ax = axes[0]
    ep_rows = [r for r in rows if not r["attention_dies"]]
    lines = _a2a_lines(ep_rows, lambda r: r["dies"], by_batch=True)
    colors = iter(_XPOD_COLORS * 8)
    for label, points in lines.items():
        style = _A2A_PEER_STYLE.get(points[0]["transport"]) or {"color": next(colors)}
        ax.plot(
            [r["dies"] for r in points],
            [r["total_p50_us"] for r in points],
            marker="o",
            ms=3,
            label=label,
            **style,
        )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(FixedLocator(ep_degrees))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([f"EP{d}" for d in ep_degrees])
    ax.set_xlabel("EP degree (dies)")
    ax.set_ylabel("dispatch + combine p50 (µs)")
    ax.grid(True, which="both", alpha=0.3)
    for other in axes[1:]:
        other.set_axis_off()
    handles, labels = ax.get_legend_handles_labels()
    axes[2].legend(handles, labels, loc="upper left", fontsize="x-small", title="bottom left")


def _a2a_lines(rows: list[dict], x, by_batch: bool = False) -> dict[str, list[dict]]:
    """label -> rows sorted by x(row); a label names transport, protocol, quant and the pod
    (or, by_batch, the batch instead of the pod)."""
    lines: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        lines[_a2a_label(r, by_batch)].append(r)
    return {label: sorted(points, key=x) for label, points in lines.items()}


def _a2a_label(r: dict, by_batch: bool) -> str:
    proto = "" if r["transport"] != "xpod" else f" {r['protocol']}"
    if by_batch:
        where = f"b{r['batch']}"
    elif r["attention_dies"]:
        where = f"{r['attention_dies']}+{r['dies'] - r['attention_dies']}"
    else:
        where = f"EP{r['dies']}"
    return f"{r['transport']}{proto} {r['quant']} {where}"
