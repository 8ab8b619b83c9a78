"""`xpod bench alltoall`: expert-parallel dispatch + combine latency over batch size and EP degree.

One row per (transport, protocol, quant, dies, batch), in the nccl-tests manner; with `--peers`
the same byte pattern is moved, in the same run, by mpi4py Alltoallv and by a pyzmq all-to-all.

Definitions (every transport measures them the same way):
- routing: each die draws, for each of its `batch` tokens, `topk` distinct experts uniformly at
  random (generator seeded with (seed, die_id)); the same routing in every iteration, and the
  peers move the per-destination message counts it gives (`counts[src][dst]`). `--routing
  skew`: the experts are drawn without replacement with Zipf popularity 1 / rank (ranks a
  permutation seeded by `seed`, the same on every die), so a few experts (and dies) are hot.
- dedup (`--protocol pull-dedup,fused-dedup`): the same collective with `dispatch(...,
  dedup=True)`: one message per (token, destination die) instead of per (token, expert);
  bytes count those messages (each dispatch message also carries its expert list, 12 bytes
  per entry, not counted: below 1 % of a row at hidden 7168).
- one iteration: barrier, dispatch, barrier, combine; dispatch and combine are timed on every die
  with perf_counter_ns, and the collective's time is the maximum over dies. p50 / p99 / min are
  over the timed iterations after warm-up; total = dispatch + combine of the same iteration.
  Expert outputs are a preallocated float32 array (no expert compute is timed).
- bytes per die (mean over the sending dies; a message is one routed (token, expert) pair, the
  die's own experts included, as nccl-tests counts a rank's own block): dispatch = messages x
  (hidden + 4-byte scale) with int8, x 4 x hidden with none; combine = messages x 4 x hidden.
- algbw = (dispatch + combine bytes per die) / total p50; busbw = algbw x (N-1)/N (nccl-tests'
  alltoall factor; 1 for A2E, where no message stays on its die); aggregate = sending dies x
  bytes per die / total p50.
- memcpy_gbps: one core's np.copyto bandwidth copying one die's dispatch bytes and its combine
  bytes once (each as one buffer), measured in the launcher during the same run; copy limit =
  cores x memcpy_gbps; copy_ratio = aggregate / copy limit.
- cpu_s_per_die: time.process_time() of the timed loop (barriers included), mean over dies.
- A2E (`--a2e` or `--protocol a2e`): pods of A attention + X expert dies, comm.a2e / comm.e2a;
  bytes per attention die; `metadata_writes` = fields an attention die writes per step.

Per (dies, batch) one pod sized for that batch runs every protocol x quant row, then the peers.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from dataclasses import dataclass

import numpy as np

import comm
from bench import common, peers
from comm.quant import COMBINE_DTYPES, combine_dtype
from comm.routing import Placement, get_dedup_layout, get_dispatch_layout
from memory.errors import ConfigError
from runtime import Pod, PodConfig
from runtime.cli.argtypes import (
    choice_list,
    input_file,
    int_list,
    nonneg_int,
    output_file,
    positive_float,
    positive_int,
)
from runtime.cli.flags import load_config

DEFAULT_BATCHES = "1,8,16,32,64,128"
QUICK_BATCHES = "1,16,128"
PROTOCOLS = ("pull", "fused", "pull-dedup", "fused-dedup", "a2e")
ROUTINGS = ("uniform", "skew")
QUANTS = ("int8", "none")
PEER_PROTOCOL = {"mpi4py": "alltoallv", "zmq": "push-pull"}
SCALE_BYTES = 4  # an int8 token's float32 scale travels with it
WARMUP = 3  # calibration iterations (the first ones of a pod also touch its pages)
BUDGET_S, QUICK_BUDGET_S = 1.5, 0.3  # timed seconds per row
ITERS_RANGE, QUICK_ITERS_RANGE = (10, 400), (5, 60)
RUN_TIMEOUT_S = 900.0
PAPER_EP320 = dict(num_dies=320, a2a_max_batch=96, a2a_hidden=7168, a2a_topk=8, experts=1)

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


@dataclass(frozen=True, slots=True)
class Point:
    """One pod of the run: its size, the all-to-all shape and the routing seed.

    attention_dies is 0 for an expert-parallel pod (every die sends and hosts experts); for an
    A2E pod dies 0..attention_dies-1 send and dies attention_dies..dies-1 host the experts.
    """

    dies: int
    batch: int
    hidden: int
    topk: int
    num_experts: int
    seed: int
    attention_dies: int = 0
    combine_dtype: str = "bfloat16"
    routing: str = "uniform"

    @property
    def senders(self) -> int:
        return self.attention_dies or self.dies

    @property
    def expert_dies(self) -> tuple[int, ...]:
        return tuple(range(self.attention_dies, self.dies))

    @property
    def label(self) -> str:
        skew = " skew" if self.routing == "skew" else ""
        if self.attention_dies:
            return (f"A2E {self.attention_dies}+{self.dies - self.attention_dies}"
                    f" b{self.batch}{skew}")  # fmt: skip
        return f"EP{self.dies} b{self.batch}{skew}"


# -- inputs, the same in the dies, the launcher and the peers --------------------------------------


def routing(pt: Point, die_id: int) -> tuple[np.ndarray, np.ndarray]:
    """(topk_idx int64 [batch, topk] of distinct experts, topk_weights float32 [batch, topk])."""
    rng = np.random.default_rng([pt.seed, die_id])
    scores = rng.random((pt.batch, pt.num_experts))
    if pt.routing == "skew":  # weighted sampling without replacement (Efraimidis-Spirakis)
        rank = np.random.default_rng([pt.seed, 1 << 20]).permutation(pt.num_experts)
        popularity = 1.0 / (rank + 1.0)
        scores = -np.log(np.maximum(scores, 1e-300)) / popularity  # smallest first = sampled
    idx = np.argsort(scores, axis=1)[:, : pt.topk].astype(np.int64)
    return idx, rng.random((pt.batch, pt.topk), dtype=np.float32)


def split_protocol(protocol: str) -> tuple[str, bool]:
    """("fused", True) of "fused-dedup": the comm protocol and the dedup option of a row."""
    base, _, dedup = protocol.partition("-")
    return base, dedup == "dedup"


def tokens(pt: Point, die_id: int) -> np.ndarray:
    rng = np.random.default_rng([pt.seed, die_id, 1])
    return rng.standard_normal((pt.batch, pt.hidden), dtype=np.float32)


def counts_matrix(pt: Point, dedup: bool = False) -> np.ndarray:
    """int64 [dies, dies]: messages each sending die dispatches to each die (rows of the
    attention dies only, for A2E: the expert dies they end up on); with `dedup`, one message
    per (token, destination die)."""
    placement = Placement.default(pt.num_experts, pt.expert_dies)
    counts = np.zeros((pt.dies, pt.dies), np.int64)
    for src in range(pt.senders):
        idx, w = routing(pt, src)
        if dedup:
            per_die = np.diff(get_dedup_layout(idx, w, placement).dest_offsets)
        else:
            per_die = get_dispatch_layout(idx, placement).num_tokens_per_die
        counts[src, list(placement.dies)] = per_die
    return counts


def hottest_over_mean(pt: Point) -> float:
    """Routed (token, expert) pairs of the hottest expert over the mean, all dies' tokens."""
    load = np.zeros(pt.num_experts, np.int64)
    for src in range(pt.senders):
        idx = routing(pt, src)[0]
        load += np.bincount(idx[idx >= 0], minlength=pt.num_experts)
    return float(load.max() / load.mean()) if load.sum() else 0.0


def msg_bytes(pt: Point, quant: str) -> tuple[int, int]:
    """(dispatch, combine) bytes of one message (combine rows: bfloat16 or float32)."""
    dispatch = pt.hidden + SCALE_BYTES if quant == "int8" else 4 * pt.hidden
    return dispatch, combine_dtype(pt.combine_dtype).itemsize * pt.hidden


def default_experts(expert_dies: int) -> int:
    return 256 if 256 % expert_dies == 0 else 8 * expert_dies


# -- in the dies -----------------------------------------------------------------------------------


def _inputs(die, pt: Point) -> tuple:
    key = ("a2a_inputs", pt)
    if key not in die.user:
        die.user[key] = (tokens(pt, die.die_id), *routing(pt, die.die_id))
    return die.user[key]


def _expert_out(die, rows: int, hidden: int) -> np.ndarray:
    """float32 [>= rows, hidden] of ones, kept between calls (its pages touched once)."""
    buf = die.user.get("a2a_expert_out")
    if buf is None or buf.shape[0] < rows or buf.shape[1] != hidden:
        buf = die.user["a2a_expert_out"] = np.ones((max(rows, 1), hidden), np.float32)
    return buf


def _weight_sums(w: np.ndarray) -> np.ndarray:
    """What combine returns in every column when every expert row is 1.0: the ascending-k
    float32 sum of the weights, the operation order of comm.reference.combine_ref."""
    acc = np.zeros(w.shape[0], np.float32)
    for k in range(w.shape[1]):
        acc = acc + w[:, k]
    return acc


def _dedup_weight_sums(pt: Point, idx: np.ndarray, w: np.ndarray) -> np.ndarray:
    """What a dedup combine returns in every column when every expert row is 1.0: per die the
    ascending-k sum of its weights, rounded to the combine dtype, then summed over the dies in
    order of their first k (comm.reference.combine_ref(..., dedup=True) on rows of ones)."""
    from comm.reference import dedup_sum

    placement = Placement.default(pt.num_experts, pt.expert_dies)
    routed = idx >= 0
    die_of = np.where(routed, placement.die_of[np.maximum(idx, 0)], -1)
    ones = np.ones((*idx.shape, 1), np.float32)
    return dedup_sum(ones, routed, die_of, w, combine_dtype(pt.combine_dtype))[:, 0]


def _check(die, what: str, got_rows: int, want_rows: int, out, w, want_sums=None) -> None:
    if got_rows != want_rows:
        raise RuntimeError(f"die {die.die_id}: {what} delivered {got_rows} rows, want {want_rows}")
    if out is None:
        return
    sums = _weight_sums(w) if want_sums is None else want_sums
    if not np.array_equal(out, np.broadcast_to(sums[:, None], out.shape)):
        raise RuntimeError(f"die {die.die_id}: {what} combine output differs from sum_k w[k]")


def ep_run(die, pt: Point, protocol: str, quant: str, warmup: int, iters: int, want) -> dict:
    """warmup + iters x (barrier, dispatch, barrier, combine); this die's times in ns.

    `want[die_id]` = rows this die must receive; the last iteration's rows and combine output
    are checked (expert rows of ones, so out[slot] = sum_k w[slot, k] exactly).
    """
    x, idx, w = _inputs(die, pt)
    eout = _expert_out(die, int(want[die.die_id]), pt.hidden)
    q = None if quant == "none" else quant
    base, dedup = split_protocol(protocol)
    now, disp, comb, iter_ns = time.perf_counter_ns, [], [], []
    cpu0 = time.process_time()
    for i in range(warmup + iters):
        if i == warmup:
            cpu0 = time.process_time()
        comm.barrier(die)
        t0 = now()
        d = comm.dispatch(die, x, idx, w, protocol=base, quant=q, event_id=i, dedup=dedup)
        t1 = now()
        comm.barrier(die)
        t2 = now()
        out = comm.combine(die, eout[: len(d.x)], d.handle, event_id=i)
        t3 = now()
        iter_ns.append(t3 - t0)
        if i >= warmup:
            disp.append(t1 - t0)
            comb.append(t3 - t2)
    cpu_s = time.process_time() - cpu0
    sums = _dedup_weight_sums(pt, idx, w) if dedup else None
    _check(die, f"{protocol} {quant}", len(d.x), int(want[die.die_id]), out, w, sums)
    return {"dispatch_ns": disp, "combine_ns": comb, "iter_ns": iter_ns, "cpu_s": cpu_s}


def a2e_run(die, pt: Point, protocol: str, quant: str, warmup: int, iters: int, want) -> dict:
    """As `ep_run`, with comm.a2e / comm.e2a: attention dies send and get the combine output,
    expert dies receive rows and return expert outputs. Also returns the die's metadata writes."""
    n_att = pt.attention_dies
    is_att = die.die_id < n_att
    x, idx, w = _inputs(die, pt) if is_att else (None, None, None)
    eout = None if is_att else _expert_out(die, int(want[die.die_id]), pt.hidden)
    q = None if quant == "none" else quant
    now, disp, comb, iter_ns = time.perf_counter_ns, [], [], []
    cpu0 = time.process_time()
    for i in range(warmup + iters):
        if i == warmup:
            cpu0 = time.process_time()
        comm.barrier(die)
        t0 = now()
        res, h = comm.a2e(die, x, idx, w, n_att, quant=q, event_id=i)
        t1 = now()
        comm.barrier(die)
        t2 = now()
        out = comm.e2a(die, None if is_att else eout[: len(res.x)], h, event_id=i)
        t3 = now()
        iter_ns.append(t3 - t0)
        if i >= warmup:
            disp.append(t1 - t0)
            comb.append(t3 - t2)
    cpu_s = time.process_time() - cpu0
    got = pt.batch * pt.topk if is_att else len(res.x)
    _check(die, f"a2e {quant}", got, int(want[die.die_id]), out if is_att else None, w)
    return {
        "dispatch_ns": disp,
        "combine_ns": comb,
        "iter_ns": iter_ns,
        "cpu_s": cpu_s,
        "metadata_writes": h.metadata_writes,
        "role": h.role,
    }


# -- in the launcher -------------------------------------------------------------------------------


@dataclass(slots=True)
class Options:
    dies: list[int]
    batches: list[int]
    hidden: int
    topk: int
    experts: int | None
    protocols: list[str]
    quants: list[str]
    combine_dtype: str
    a2e_pods: list[tuple[int, int]]
    routings: list[str]
    peers: bool
    budget_s: float
    iters_range: tuple[int, int]
    iters: int
    repeat: int
    seed: int
    trace: str | None
    config: str | None
    timeout: float | None
    json: str | None = None
    plot: str | None = None


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


def _run_xpod_row(pod: Pod, pt: Point, protocol: str, quant: str, want, opts: Options) -> dict:
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


def _want_rows(pt: Point, counts) -> np.ndarray:
    """Rows each die must receive (expert dies) or send (A2E attention dies)."""
    want = counts.sum(axis=0)
    if pt.attention_dies:
        want[: pt.attention_dies] = counts[: pt.attention_dies].sum(axis=1)
    return want


def _pod_config(pt: Point, opts: Options) -> PodConfig:
    """The pod of `pt`; a ConfigError names the flag(s) that set the bad field."""
    n_exp = pt.dies - pt.attention_dies
    dies_flag = "--attention-dies/--expert-dies" if pt.attention_dies else "--dies"
    shape = "--batch/--hidden/--topk/" + dies_flag
    flags = {
        "num_dies": dies_flag,
        "a2a_max_batch": "--batch",
        "a2a_hidden": "--hidden",
        "a2a_topk": "--topk",
        "num_experts": "--experts/" + dies_flag,
        "a2a_max_local_experts": "--experts/" + dies_flag,
        "app_bytes": shape,  # the region's size is that of its all-to-all areas
        "trace": "--trace",
        "timeout_s": "--timeout",
    }
    return load_config(
        opts.config,
        flags,
        num_dies=pt.dies,
        a2a_max_batch=pt.batch,
        a2a_hidden=pt.hidden,
        a2a_topk=pt.topk,
        num_experts=pt.num_experts,
        a2a_max_local_experts=pt.num_experts // n_exp if pt.attention_dies else None,
        app_bytes=1 << 20,  # the all-to-all areas are separate; the app area stays unused
        # INT8-only runs get the paper's INT8 row size (a quarter of the float32 rows)
        a2a_dispatch_dtype="int8" if opts.quants == ["int8"] else "float32",
        a2a_combine_dtype=pt.combine_dtype,
        trace=True if opts.trace else None,
        timeout_s=opts.timeout,
    )


def run_point(pt: Point, protocols: list[str], opts: Options, trace_path: str | None) -> list:
    """One pod for `pt`: every protocol x quant row, then the peers; `opts.repeat` times.
    Returns one list of rows per repeat."""
    counts = counts_matrix(pt)
    want = _want_rows(pt, counts)
    cfg = _pod_config(pt, opts)
    cores = cfg.cores
    bufs = cfg.layout().fused_buffer_bytes()
    common.progress(
        f"{pt.label}: {pt.num_experts} experts, {cfg.layout().region_bytes / 2**20:.0f} MiB per"
        f" region, fused receive buffers per die: dispatch {_mib(bufs['dispatch'])}"
        f" (x2 halves), combine {_mib(bufs['combine'])}; wait={cfg.wait_policy().name}"
    )
    extra = {
        "fused_dispatch_buffer_bytes": bufs["dispatch"],
        "fused_combine_buffer_bytes": bufs["combine"],
        "wait": cfg.wait_policy().name,
        "pinned": cfg.pinned(),
    }
    dedup_counts = counts_matrix(pt, dedup=True)
    extra["hottest_over_mean"] = hottest_over_mean(pt)
    runs = []
    with Pod.launch(cfg) as pod:
        for rep in range(opts.repeat):
            rows = []
            memcpy = {}
            for quant in opts.quants:
                dm, cm = msg_bytes(pt, quant)
                msgs = float(np.mean(counts[: pt.senders].sum(axis=1)))
                memcpy[quant] = memcpy_gbps([int(msgs * dm), int(msgs * cm)])
            for protocol in protocols:
                for quant in opts.quants:
                    t0 = time.monotonic()
                    res = _run_xpod_row(pod, pt, protocol, quant, want, opts)
                    a2e_extra = {k: v for k, v in res.items() if k.startswith("metadata")}
                    dedup = split_protocol(protocol)[1]
                    rows.append(
                        a2a_row(
                            "xpod",
                            protocol,
                            quant,
                            pt,
                            res,
                            dedup_counts if dedup else counts,
                            cores,
                            memcpy[quant],
                            **extra,
                            **a2e_extra,
                        )
                    )
                    r = rows[-1]
                    common.progress(
                        f"  {pt.label} xpod {protocol} {quant}: dispatch p50"
                        f" {r['dispatch_p50_us']:.0f} us, combine p50 {r['combine_p50_us']:.0f}"
                        f" us ({r['iters']} iters, {time.monotonic() - t0:.1f} s)"
                        + (f" [repeat {rep + 1}]" if opts.repeat > 1 else "")
                    )
            if opts.peers and not pt.attention_dies and pt.dies >= 2:
                rows += measure_peers(pt, counts, opts, memcpy, cores)
            runs.append(rows)
        if trace_path:
            n = pod.write_trace(trace_path)
            common.progress(f"wrote {n} trace events to {trace_path}")
    return runs


# -- repeats, summary ------------------------------------------------------------------------------

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


def _table_rows(rows: list[dict]) -> list[dict]:
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
            f"  {name}: dispatch {_mib(r['fused_dispatch_buffer_bytes'])},"
            f" combine {_mib(r['fused_combine_buffer_bytes'])}"
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


def _mib(n: int) -> str:
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


# -- command line ----------------------------------------------------------------------------------


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dies", type=int_list(1), default="8", help="EP degrees, comma list, e.g. 4,8")
    p.add_argument(
        "--batch",
        type=int_list(1),
        default=None,
        help=f"tokens per die, comma list, default {DEFAULT_BATCHES}",
    )
    p.add_argument("--hidden", type=positive_int, default=7168, help="hidden size (default 7168)")
    p.add_argument(
        "--topk", type=positive_int, default=8, help="experts per token, <= experts (default 8)"
    )
    p.add_argument(
        "--experts",
        type=positive_int,
        default=None,
        help="experts (default 256 if it divides over the expert dies, else 8 per die)",
    )
    p.add_argument(
        "--protocol",
        type=choice_list(PROTOCOLS),
        default="pull,fused",
        help=f"comma list of {','.join(PROTOCOLS)}",
    )
    p.add_argument(
        "--quant",
        type=choice_list(QUANTS),
        default="int8,none",
        help=f"comma list of {','.join(QUANTS)}",
    )
    p.add_argument(
        "--routing",
        type=choice_list(ROUTINGS),
        default="uniform",
        help="comma list of uniform (default) and skew (Zipf expert popularity)",
    )
    p.add_argument(
        "--combine-dtype",
        default="bfloat16",
        choices=COMBINE_DTYPES,
        help="combine rows in 16 bits (the paper's, default) or float32",
    )
    p.add_argument("--a2e", action="store_true", help="add A2E/E2A rows (protocol a2e)")
    p.add_argument(
        "--attention-dies", type=int_list(1), default="2", help="A2E attention dies, comma list"
    )
    p.add_argument(
        "--expert-dies",
        type=int_list(1),
        default="4",
        help="A2E expert dies (>= attention dies), paired with the above",
    )
    p.add_argument("--peers", action="store_true", help="also mpi4py Alltoallv and pyzmq")
    p.add_argument("--quick", action="store_true", help=f"batches {QUICK_BATCHES}, few iters")
    p.add_argument(
        "--iters", type=nonneg_int, default=0, help="timed iterations (default 0: by time)"
    )
    p.add_argument("--iters-scale", type=positive_float, default=1.0, help="scale the time per row")
    p.add_argument(
        "--repeat",
        type=positive_int,
        default=1,
        help="measure everything R times, alternating xpod and peers; report medians",
    )
    p.add_argument("--seed", type=nonneg_int, default=0, help="routing and token seed")
    p.add_argument(
        "--json", type=output_file, default=None, help="write one JSON line per row to FILE"
    )
    p.add_argument(
        "--plot", type=output_file, default=None, help="draw latency and bandwidth vs batch to FILE"
    )
    p.add_argument(
        "--trace", type=output_file, default=None, help="write a Chrome/Perfetto trace per pod"
    )
    p.add_argument("--config", type=input_file, default=None, help="PodConfig TOML file")
    p.add_argument("--timeout", type=positive_float, default=None, help="wait deadline (PodConfig)")


def _a2e_pods(att: list[int], exp: list[int]) -> list[tuple[int, int]]:
    """(attention dies, expert dies) pairs of --attention-dies and --expert-dies (a single
    value pairs with every value of the other list)."""
    if len(att) != len(exp) and 1 not in (len(att), len(exp)):
        raise ConfigError(
            f"argument --attention-dies/--expert-dies: lists of {len(att)} and {len(exp)} values"
            " do not pair up (give as many values in each, or one in either)"
        )
    n = max(len(att), len(exp))
    pods = list(
        zip(att * n if len(att) == 1 else att, exp * n if len(exp) == 1 else exp, strict=True)
    )
    bad = [(a, x) for a, x in pods if a > x]
    if bad:
        raise ConfigError(
            f"argument --attention-dies/--expert-dies: A2E needs attention dies <= expert dies,"
            f" got {bad[0][0]} > {bad[0][1]}"
        )
    return pods


def parse_options(args: argparse.Namespace) -> Options:
    """Options of the parsed flags, every pod of the run checked (experts, topk, PodConfig)
    before any starts; a ConfigError names the flag(s)."""
    protocols = list(args.protocol)
    if args.a2e and "a2e" not in protocols:
        protocols.append("a2e")
    quick = args.quick
    opts = Options(
        dies=args.dies,
        batches=args.batch or int_list(1)(QUICK_BATCHES if quick else DEFAULT_BATCHES),
        hidden=args.hidden,
        topk=args.topk,
        experts=args.experts,
        protocols=protocols,
        quants=args.quant,
        combine_dtype=args.combine_dtype,
        a2e_pods=_a2e_pods(args.attention_dies, args.expert_dies),
        routings=list(args.routing),
        peers=args.peers,
        budget_s=(QUICK_BUDGET_S if quick else BUDGET_S) * args.iters_scale,
        iters_range=QUICK_ITERS_RANGE if quick else ITERS_RANGE,
        iters=args.iters,
        repeat=args.repeat,
        seed=args.seed,
        trace=args.trace,
        config=args.config,
        timeout=args.timeout,
        json=args.json,
        plot=args.plot,
    )
    for pt, _ in plan(opts):
        _check_point(pt, opts)
    return opts


def _check_point(pt: Point, opts: Options) -> None:
    n_exp = pt.dies - pt.attention_dies
    if pt.num_experts % n_exp:
        raise ConfigError(
            f"argument --experts: {pt.num_experts} experts do not divide over the {n_exp}"
            f" expert dies of {pt.label}"
        )
    if pt.topk > pt.num_experts:
        raise ConfigError(
            f"argument --topk: {pt.topk} is more than the {pt.num_experts} experts of {pt.label}"
            " (--experts)"
        )
    _pod_config(pt, opts)


def plan(opts: Options) -> list[tuple[Point, list[str]]]:
    """Every pod of the run with the protocols it measures, in run order."""
    out = []
    ep_protocols = [p for p in opts.protocols if p != "a2e"]
    for routing_ in opts.routings:
        for dies in opts.dies if ep_protocols else []:
            e = opts.experts or default_experts(dies)
            for b in opts.batches:
                pt = Point(dies, b, opts.hidden, opts.topk, e, opts.seed, 0, opts.combine_dtype,
                           routing_)  # fmt: skip
                out.append((pt, ep_protocols))
        for a, x in opts.a2e_pods if "a2e" in opts.protocols else []:
            e = opts.experts or default_experts(x)
            for b in opts.batches:
                pt = Point(a + x, b, opts.hidden, opts.topk, e, opts.seed, a, opts.combine_dtype,
                           routing_)  # fmt: skip
                out.append((pt, ["a2e"]))
    return out


def _trace_path(base: str | None, pt: Point, many: bool) -> str | None:
    if not base or not many:
        return base
    root, ext = os.path.splitext(base)
    tag = (
        f"a2e{pt.attention_dies}+{pt.dies - pt.attention_dies}"
        if pt.attention_dies
        else (f"ep{pt.dies}")
    )
    skew = ".skew" if pt.routing == "skew" else ""
    return f"{root}.{tag}.b{pt.batch}{skew}{ext or '.json'}"


def main(args: argparse.Namespace) -> int:
    return run(parse_options(args))


def run(opts: Options) -> int:
    points = plan(opts)
    common.progress(
        f"xpod bench alltoall: {len(points)} pod(s), batches {opts.batches}, hidden {opts.hidden},"
        f" top-{opts.topk}, protocols {','.join(opts.protocols)}, quant {','.join(opts.quants)}"
        f"{', peers mpi4py + zmq' if opts.peers else ''}, {os.cpu_count()} cores"
    )
    runs: list[list[dict]] = [[] for _ in range(opts.repeat)]
    t_start = time.monotonic()
    for i, (pt, protocols) in enumerate(points):
        per_rep = run_point(pt, protocols, opts, _trace_path(opts.trace, pt, len(points) > 1))
        for rep, rows in enumerate(per_rep):
            runs[rep] += rows
        common.progress(
            f"[{i + 1}/{len(points)}] {pt.label} done, {time.monotonic() - t_start:.0f} s"
        )
    rows = runs[0] if opts.repeat == 1 else merge_repeats(runs)
    columns = COLUMNS + ([("total_p50_spread", "spread", ".0%")] if opts.repeat > 1 else [])
    common.print_table(_table_rows(rows), columns)
    print_summary(rows)
    common.write_outputs(rows, opts.json, opts.plot)
    return 0


if __name__ == "__main__":
    import sys

    from runtime import cli

    sys.exit(cli.main(["bench", "alltoall", *sys.argv[1:]]))


__all__ = ["Point", "a2a_row", "add_args", "counts_matrix", "main", "routing", "tokens"]
