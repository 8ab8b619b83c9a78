"""The rows of one pod: xpod's (every die's times, maxima over dies per iteration) and the peers'
(the same byte counts over mpi4py and pyzmq), each turned into a `bench: "alltoall"` row with
its bytes, bandwidths and copy floor (see the package docstring)."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from bench import common, peers
from bench.alltoall.dies import a2e_run, ep_run
from bench.alltoall.inputs import Point, msg_bytes
from bench.alltoall.options import Options
from runtime import Pod

PEER_PROTOCOL = {"mpi4py": "alltoallv", "zmq": "push-pull"}
WARMUP = 3  # calibration iterations (the first ones of a pod also touch its pages)
RUN_TIMEOUT_S = 900.0


def memcpy_gbps(sizes: list[int], budget_s: float = 0.05) -> float:
    """One core's np.copyto bandwidth copying each of `sizes` bytes once, as one buffer each:
    sum(sizes) / sum of the p50 copy times (GB/s = bytes/ns)."""
    total_ns, now = 0.0, time.perf_counter_ns
    for n in (s for s in sizes if s > 0):
        src, dst = np.ones(n, np.uint8), np.zeros(n, np.uint8)
        np.copyto(dst, src)
        samples = []
        for _ in range(max(5, min(200, int(budget_s * 10e9 / n)))):
            t0 = now()
            np.copyto(dst, src)
            samples.append(now() - t0)
        total_ns += float(np.median(samples))
    return sum(sizes) / total_ns if total_ns else 0.0


def a2a_row(
    transport: str,
    protocol: str,
    quant: str,
    pt: Point,
    res: dict,
    counts,
    cores: int,
    memcpy: float,
    **extra: object,
) -> dict:
    """One `bench: "alltoall"` row from per-iteration maxima over dies (see the module doc)."""
    disp, comb = np.asarray(res["dispatch_ns"]), np.asarray(res["combine_ns"])
    dm, cm = msg_bytes(pt, quant)
    msgs = float(np.mean(counts[: pt.senders].sum(axis=1)))
    row = {
        "bench": "alltoall",
        "transport": transport,
        "protocol": protocol,
        "quant": quant,
        "combine_dtype": pt.combine_dtype,
        "dies": pt.dies,
        "attention_dies": pt.attention_dies,
        "expert_dies": pt.dies - pt.attention_dies,
        "batch": pt.batch,
        "hidden": pt.hidden,
        "topk": pt.topk,
        "num_experts": pt.num_experts,
        "seed": pt.seed,
        "routing": pt.routing,
    }
    stats = {"dispatch": disp, "combine": comb, "total": disp + comb}
    for name, samples in stats.items():
        s = common.latency_stats(samples)
        row.update({f"{name}_{k}": s[k] for k in ("p50_us", "p99_us", "min_us")})
    row["iters"] = int(disp.size)
    row["dispatch_bytes_per_die"] = int(round(msgs * dm))
    row["combine_bytes_per_die"] = int(round(msgs * cm))
    per_die = row["dispatch_bytes_per_die"] + row["combine_bytes_per_die"]
    total_ns = row["total_p50_us"] * 1e3
    row["algbw_gbps"] = per_die / total_ns if total_ns > 0 else 0.0
    factor = 1.0 if pt.attention_dies else (pt.dies - 1) / pt.dies
    row["busbw_gbps"] = row["algbw_gbps"] * factor
    row["aggregate_gbps"] = row["algbw_gbps"] * pt.senders
    row["memcpy_gbps"] = memcpy
    row["copy_limit_gbps"] = memcpy * cores
    row["copy_ratio"] = row["aggregate_gbps"] / row["copy_limit_gbps"] if memcpy else 0.0
    # the floor: every sending die's bytes copied once, at the copy limit of the cores in use
    floor_ns = pt.senders * per_die / row["copy_limit_gbps"] if memcpy else 0.0
    row["floor_us"] = floor_ns / 1e3
    row["time_over_floor"] = total_ns / floor_ns if floor_ns else 0.0
    row["cpu_ms_per_step"] = 1e3 * float(res.get("cpu_s_per_die", 0.0)) / max(int(disp.size), 1)
    row["cpu_s_per_die"] = float(res.get("cpu_s_per_die", 0.0))
    row["cores"] = cores
    row.update(extra)
    row.update(common.run_info())
    return row


def xpod_row(pod: Pod, pt: Point, protocol: str, quant: str, want, opts: Options) -> dict:
    """Calibrate (warm-up only), then time; returns merged per-iteration maxima over dies."""
    fn = a2e_run if protocol == "a2e" else ep_run
    iters = opts.iters
    if not iters:
        res = pod.run(fn, pt, protocol, quant, WARMUP, 0, want, timeout_s=RUN_TIMEOUT_S)
        per_iter = np.max([r["iter_ns"] for r in res], axis=0)[1:]  # the first touches pages
        t_iter_s = float(np.median(per_iter)) / 1e9
        iters = peers.iters_for_budget(t_iter_s, opts.budget_s, *opts.iters_range)
    res = pod.run(fn, pt, protocol, quant, 1, iters, want, timeout_s=RUN_TIMEOUT_S)
    out = {
        "dispatch_ns": np.max([r["dispatch_ns"] for r in res], axis=0),
        "combine_ns": np.max([r["combine_ns"] for r in res], axis=0),
        "cpu_s_per_die": float(np.mean([r["cpu_s"] for r in res])),
    }
    if protocol == "a2e":
        att = [r["metadata_writes"] for r in res[: pt.attention_dies]]
        tramp = [r["metadata_writes"] for r in res[pt.attention_dies : 2 * pt.attention_dies]]
        out["metadata_writes_per_attention_die"] = max(att)
        out["metadata_writes_per_trampoline"] = max(tramp)
    return out


def _peer_cases(pt: Point, counts, quants: list[str], opts: Options) -> list[dict]:
    cases = []
    for quant in quants:
        dm, cm = msg_bytes(pt, quant)
        cases.append(
            {
                "counts": counts.tolist(),
                "dispatch_msg_bytes": dm,
                "combine_msg_bytes": cm,
                "warmup": WARMUP,
                "iters": opts.iters,
                "budget_s": opts.budget_s,
                "min_iters": opts.iters_range[0],
                "max_iters": opts.iters_range[1],
            }
        )
    return cases


def measure_peers(pt: Point, counts, opts: Options, memcpy: dict, cores: int) -> list[dict]:
    """The same byte counts over mpi4py Alltoallv (when installed) and the pyzmq all-to-all."""
    rows = []
    for transport in peers.A2A_PEER_TRANSPORTS:
        if transport == "mpi4py":
            ok, why = peers.mpi_available()
            if not ok:
                common.progress(f"  skipping mpi4py peer: {why}")
                continue
        common.progress(f"  {pt.label}: peer {transport} ...")
        cases = _peer_cases(pt, counts, opts.quants, opts)
        kinds = [(PEER_PROTOCOL[transport], q) for q in opts.quants]
        if transport == "mpi4py" and not pt.attention_dies:  # the same job as xpod's (11.4)
            cases += [{**c, "ep": {"point": dataclasses.asdict(pt), "quant": q}}
                      for c, q in zip(cases, opts.quants, strict=True)]  # fmt: skip
            kinds += [("ep", q) for q in opts.quants]
        try:
            results = peers.run_a2a_peer(transport, cases, timeout_s=RUN_TIMEOUT_S)
        except RuntimeError as e:
            common.progress(f"  peer {transport} failed: {e}")
            continue
        for (protocol, quant), res in zip(kinds, results, strict=True):
            rows.append(a2a_row(transport, protocol, quant, pt, res, counts, cores, memcpy[quant]))
    return rows
