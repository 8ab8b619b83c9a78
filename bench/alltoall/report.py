"""What a run prints after its table: repeats merged into medians, and the summary figures of the
issue (fused buffers, against the peers, against the copy limit, the shapes of Fig. 6 and
Table 7, A2E metadata writes, dedup), all computed from the run's rows."""

from __future__ import annotations

import numpy as np

from bench.alltoall.inputs import split_protocol

COLUMNS = [
    ("transport", "transport", ""),
    ("protocol", "protocol", ""),
    ("quant", "quant", ""),
    ("pod", "dies", ""),
    ("batch", "batch", "d"),
    ("disp_mb", "disp_MB/die", ".3f"),
    ("iters", "iters", "d"),
    ("dispatch_p50_us", "disp_p50", ".0f"),
    ("dispatch_p99_us", "disp_p99", ".0f"),
    ("combine_p50_us", "comb_p50", ".0f"),
    ("combine_p99_us", "comb_p99", ".0f"),
    ("total_p50_us", "total_p50", ".0f"),
    ("algbw_gbps", "algbw", ".3f"),
    ("busbw_gbps", "busbw", ".3f"),
    ("aggregate_gbps", "agg_GB/s", ".3f"),
    ("copy_ratio", "of_copy", ".1%"),
    ("cpu_s_per_die", "cpu_s/die", ".3f"),
]
PAPER_EP320 = dict(num_dies=320, a2a_max_batch=96, a2a_hidden=7168, a2a_topk=8, experts=1)
_KEY = ("transport", "protocol", "quant", "dies", "attention_dies", "batch", "routing")
_MEDIAN_KEYS = (
    "dispatch_p50_us",
    "dispatch_p99_us",
    "combine_p50_us",
    "combine_p99_us",
    "total_p50_us",
    "total_p99_us",
    "algbw_gbps",
    "busbw_gbps",
    "aggregate_gbps",
    "memcpy_gbps",
    "copy_limit_gbps",
    "copy_ratio",
    "cpu_s_per_die",
)


def merge_repeats(runs: list[list[dict]]) -> list[dict]:
    """One row per key: medians over repeats, min of the minima, and `total_p50_spread` =
    (max - min) / median of the total p50s."""
    out = []
    for row in runs[0]:
        key = tuple(row[k] for k in _KEY)
        same = [r for run in runs for r in run if tuple(r[k] for k in _KEY) == key]
        merged = dict(row)
        for k in _MEDIAN_KEYS:
            merged[k] = float(np.median([r[k] for r in same]))
        for k in ("dispatch_min_us", "combine_min_us", "total_min_us"):
            merged[k] = float(min(r[k] for r in same))
        p50s = np.array([r["total_p50_us"] for r in same])
        merged["repeats"] = len(same)
        merged["total_p50_spread"] = float((p50s.max() - p50s.min()) / np.median(p50s))
        out.append(merged)
    return out


def table_rows(rows: list[dict]) -> list[dict]:
    """The rows with the table's own columns: `pod` (EP degree or A2E split), `disp_mb`."""
    out = []
    for r in rows:
        pod = f"{r['attention_dies']}+{r['expert_dies']}" if r["attention_dies"] else r["dies"]
        out.append({**r, "pod": str(pod), "disp_mb": r["dispatch_bytes_per_die"] / 1e6})
    return out


def _find(rows, **want) -> list[dict]:
    return [r for r in rows if all(r.get(k) == v for k, v in want.items())]


def print_summary(rows: list[dict]) -> None:
    """The figures of the issue, computed from this run's rows."""
    xp = _find(rows, transport="xpod")
    _print_buffers(xp)
    _print_vs_peers(rows)
    _print_copy_limit(xp)
    _print_quant_shape(xp)
    _print_ep_degree(xp)
    _print_a2e(xp)
    _print_dedup(xp)


def _print_buffers(xp: list[dict]) -> None:
    from memory import layout as L

    seen = {}
    for r in xp:
        seen.setdefault(_pod_name(r), r)
    print("\nfused receive buffers per die (die.layout.fused_buffer_bytes(); two halves each):")
    for name, r in seen.items():
        print(
            f"  {name}: dispatch {mib(r['fused_dispatch_buffer_bytes'])},"
            f" combine {mib(r['fused_combine_buffer_bytes'])}"
        )
    p = PAPER_EP320
    for dtype, nbytes in (("int8", 1), ("float32", 4)):
        lo = L.compute(
            num_dies=p["num_dies"],
            lanes=4,
            ring_slots=8,
            slot_bytes=96 << 10,
            app_bytes=0,
            a2a_max_batch=p["a2a_max_batch"],
            a2a_hidden=p["a2a_hidden"],
            a2a_topk=p["a2a_topk"],
            a2a_experts_per_die=p["experts"],
            a2a_num_experts=p["num_dies"] * p["experts"],
            a2a_dispatch_bytes=nbytes,
            a2a_combine_bytes=2,
        ).fused_buffer_bytes()
        print(
            f"  this layout at the paper's EP320, batch 96, hidden 7168, 1 expert per die,"
            f" a2a_dispatch_dtype={dtype}: dispatch {lo['dispatch'] / 1e6:.0f} MB,"
            f" combine {lo['combine'] / 1e6:.0f} MB (paper: 225 MB + 420 MB; our combine"
            " buffer is indexed by (slot, k) of this die's tokens, bfloat16)"
        )


def _print_dedup(xp: list[dict]) -> None:
    """11.3: bytes and time with dedup against without, same pod, same run."""
    lines = []
    for r in xp:
        base, dedup = split_protocol(r["protocol"])
        if not dedup:
            continue
        plain = _find(xp, protocol=base, quant=r["quant"], dies=r["dies"], batch=r["batch"],
                      attention_dies=r["attention_dies"], routing=r["routing"])  # fmt: skip
        if not plain:
            continue
        p = plain[0]
        nb = r["dispatch_bytes_per_die"] + r["combine_bytes_per_die"]
        pb = p["dispatch_bytes_per_die"] + p["combine_bytes_per_die"]
        lines.append(
            f"  {_pod_name(r)} ({r['routing']}, hottest expert {r['hottest_over_mean']:.1f}x"
            f" mean) {base:>5} {r['quant']:>4}: bytes/die {pb / 1e6:.2f} -> {nb / 1e6:.2f} MB"
            f" ({1 - nb / pb:.0%} fewer), total p50 {p['total_p50_us']:.0f} ->"
            f" {r['total_p50_us']:.0f} us ({r['total_p50_us'] / p['total_p50_us']:.2f}x),"
            f" p99 {p['total_p99_us']:.0f} -> {r['total_p99_us']:.0f} us"
        )
    if lines:
        print("\ndedup (one message per token and die) against one per token and expert:")
        print("\n".join(lines))


def mib(n: int) -> str:
    """A byte count in MiB, or KiB below one MiB, one decimal."""
    return f"{n / 2**20:.1f} MiB" if n >= 1 << 20 else f"{n / 2**10:.1f} KiB"


def _pod_name(r: dict) -> str:
    skew = " skew" if r.get("routing") == "skew" else ""
    if r["attention_dies"]:
        return f"A2E {r['attention_dies']}+{r['expert_dies']} b{r['batch']}{skew}"
    return f"EP{r['dies']} b{r['batch']}{skew}"


def _print_vs_peers(rows: list[dict]) -> None:
    peer_rows = [r for r in rows if r["transport"] != "xpod"]
    if not peer_rows:
        return
    print(
        "\nvs peers, same run (total = dispatch + combine p50, and its ratio to the copy floor;"
        " ratios xpod / mpi4py ep (the same job on MPI), xpod / mpi4py alltoallv (the bytes"
        " only): < 1 xpod faster; zmq / xpod: > 1 xpod faster; CPU ms per step per die):"
    )
    for x in _find(rows, transport="xpod", attention_dies=0):
        key = dict(dies=x["dies"], batch=x["batch"], quant=x["quant"], attention_dies=0,
                   routing=x["routing"])  # fmt: skip
        parts = [
            f"{_pod_name(x)} {x['protocol']:>5} {x['quant']:>4}:"
            f" xpod {x['total_p50_us']:7.0f} us ({x['time_over_floor']:.0f}x floor,"
            f" cpu {x['cpu_ms_per_step']:.2f})"
        ]
        for t, proto in (("mpi4py", "ep"), ("mpi4py", "alltoallv"), ("zmq", "push-pull")):
            p = _find(peer_rows, transport=t, protocol=proto, **key)
            if not p:
                continue
            p = p[0]
            mpi = t == "mpi4py"
            ratio = x["total_p50_us"] / p["total_p50_us"] if mpi else p["total_p50_us"] / x[
                "total_p50_us"]  # fmt: skip
            cpu = f", cpu {p['cpu_ms_per_step']:.2f}" if proto == "ep" else ""
            parts.append(f"{t} {proto} {p['total_p50_us']:6.0f} us ({p['time_over_floor']:.0f}x"
                         f" floor{cpu}) -> {ratio:5.2f}x")  # fmt: skip
        print("  " + ", ".join(parts))


def _print_copy_limit(xp: list[dict]) -> None:
    if not xp:
        return
    big = max(r["batch"] for r in xp)
    print(
        f"\naggregate bytes moved per second vs the copy limit (cores x one core's memcpy of a"
        f" die's bytes), batch {big}:"
    )
    for r in _find(xp, batch=big):
        print(
            f"  {_pod_name(r)} {r['protocol']:>5} {r['quant']:>4}: aggregate"
            f" {r['aggregate_gbps']:.2f} GB/s, copy limit {r['cores']} x"
            f" {r['memcpy_gbps']:.1f} = {r['copy_limit_gbps']:.1f} GB/s ->"
            f" {r['copy_ratio']:.1%}"
        )


def _print_quant_shape(xp: list[dict]) -> None:
    """Fig. 6: int8 / none dispatch and combine p50 per batch (< 1: quantized faster)."""
    groups = sorted({(r["protocol"], _pod_name(r).rsplit(" b", 1)[0]) for r in xp})
    lines = []
    for protocol, pod in groups:
        mine = [r for r in xp if r["protocol"] == protocol and _pod_name(r).startswith(pod + " ")]
        parts = []
        for b in sorted({r["batch"] for r in mine}):
            q = {r["quant"]: r for r in mine if r["batch"] == b}
            if "int8" in q and "none" in q:
                ratio = q["int8"]["dispatch_p50_us"] / q["none"]["dispatch_p50_us"]
                parts.append(f"b{b} {ratio:.2f}")
        if parts:
            lines.append(f"  {pod} {protocol:>5}: " + "  ".join(parts))
    if lines:
        print(
            "\nFig. 6 shape: int8 / none dispatch p50 per batch (< 1: quantized dispatch faster):"
        )
        print("\n".join(lines))


def _print_ep_degree(xp: list[dict]) -> None:
    """Table 7: total p50 over EP degree for each (protocol, quant, batch)."""
    ep = [r for r in xp if not r["attention_dies"]]
    if len({r["dies"] for r in ep}) < 2:
        return
    print("\nTable 7 shape: dispatch / combine p50 (us) over EP degree:")
    for key in sorted({(r["protocol"], r["quant"], r["batch"]) for r in ep}):
        same = sorted(
            _find(ep, protocol=key[0], quant=key[1], batch=key[2]), key=lambda r: r["dies"]
        )
        cells = [
            f"EP{r['dies']} {r['dispatch_p50_us']:.0f}/{r['combine_p50_us']:.0f}" for r in same
        ]
        print(f"  {key[0]:>5} {key[1]:>4} b{key[2]:<3}: " + "  ".join(cells))


def _print_a2e(xp: list[dict]) -> None:
    rows = _find(xp, protocol="a2e")
    if rows:
        print("\nA2E/E2A metadata writes per step (fields written in other dies' meta areas):")
    for pod in sorted({(r["attention_dies"], r["expert_dies"]) for r in rows}):
        mine = _find(rows, attention_dies=pod[0], expert_dies=pod[1])
        att = sorted({r["metadata_writes_per_attention_die"] for r in mine})
        tramp = sorted({r["metadata_writes_per_trampoline"] for r in mine})
        print(
            f"  A2E {pod[0]}+{pod[1]}: per attention die {'/'.join(map(str, att))} (direct AIV"
            f" writes would need {pod[1]}), per trampoline {'/'.join(map(str, tramp))};"
            f" {len(mine)} rows, every one checked against sum_k w[k]"
        )
