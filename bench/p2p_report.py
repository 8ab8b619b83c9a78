"""What `xpod bench p2p` prints and merges after its runs: the same-run ratios of xpod's rows
against the peers (one host, several hosts) and the median of repeated runs."""

from __future__ import annotations

import numpy as np

from bench import common


def print_host_ratios(rows: list[dict]) -> None:
    """A multi-host pod's ratios, same run: its cross-host pair against the raw RMA cycle,
    mpi4py Send/Recv and zmq over TCP; its same-host pair against a one-host pod's."""

    def key(r):
        return (r["variant"], r["cores"], r["size_bytes"])

    peers = {
        (r["transport"], r["size_bytes"]): r for r in rows if not r["transport"].startswith("xpod")
    }
    single = {key(r): r for r in rows if r["transport"] == "xpod-1host"}
    print("\nratios, same run (p50 / p50; < 1 means xpod is faster):")
    for r in rows:
        if r["transport"] != "xpod":
            continue
        size = r["size_bytes"]
        parts = [f"{common.fmt_size(size):>5} {r['variant']} c{r['cores']} dies {r['pair']}"]
        if r["cross_host"]:
            for t in ("rma-raw", "mpi4py-tcp", "zmq-tcp"):
                peer = peers.get((t, size))
                if peer and peer["p50_us"] > 0:
                    parts.append(f"{t} {r['p50_us'] / peer['p50_us']:.2f}x")
            zmq = peers.get(("zmq-tcp", size))
            if zmq and zmq["gbps"] > 0 and size >= 1 << 20:
                parts.append(f"GB/s vs zmq-tcp {r['gbps'] / zmq['gbps']:.2f}x")
        elif key(r) in single:
            parts.append(f"one-host pod {r['p50_us'] / single[key(r)]['p50_us']:.2f}x")
        print("  " + ", ".join(parts))


def merge_repeats(runs: list[list[dict]]) -> list[dict]:
    """One row per (transport, variant, cores, size): the median over repeats of p50 / p99 /
    gbps / cpu, the minimum of min_us, and `p50_spread` = (max - min) / median of the p50s."""
    out = []
    for row in runs[0]:
        key = (row["transport"], row["variant"], row["cores"], row["size_bytes"], row.get("pair"))
        same = [r for run in runs for r in run if (r["transport"], r["variant"], r["cores"],
                r["size_bytes"], r.get("pair")) == key]  # fmt: skip
        merged = dict(row)
        p50s = np.array([r["p50_us"] for r in same])
        for k in ("p50_us", "p99_us", "gbps", "cpu_s_per_die", "mean_us"):
            if k in row:
                merged[k] = float(np.median([r[k] for r in same]))
        merged["min_us"] = float(min(r["min_us"] for r in same))
        merged["repeats"] = len(same)
        merged["p50_spread"] = float((p50s.max() - p50s.min()) / np.median(p50s))
        out.append(merged)
    return out


def print_ratios(rows: list[dict]) -> None:
    """xpod p50 / peer p50 for the best xpod row of each size (same run)."""
    peers = {(r["transport"], r["size_bytes"]): r for r in rows if r["transport"] != "xpod"}
    if not peers:
        return
    print("\nratios, same run (best xpod variant's p50 / peer p50; < 1 means xpod is faster):")
    for size in sorted({r["size_bytes"] for r in rows if r["transport"] == "xpod"}):
        best = min(
            (r for r in rows if r["transport"] == "xpod" and r["size_bytes"] == size),
            key=lambda r: r["p50_us"],
        )
        parts = [f"{common.fmt_size(size):>5}  best xpod {best['variant']} c{best['cores']}"]
        for t in ("shm-floor", "mpi4py", "zmq-ipc", "pipe"):
            peer = peers.get((t, size))
            if peer:
                parts.append(f"{t} {best['p50_us'] / peer['p50_us']:.2f}x")
        print("  " + ", ".join(parts))
