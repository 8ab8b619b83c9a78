"""`xpod bench passes`: each pass one die makes over the bytes of an EP dispatch + combine, timed
alone in one process, against `np.copyto` of the same bytes (issue 11.2's table).

The shape is `xpod bench alltoall`'s (the same tokens and routing of die 0, uniform routing over
the pod's dies): per step a die quantizes its `batch` tokens, packs one row per (token, expert)
message into every destination's block, groups the rows it receives by expert, rounds its expert
outputs to bfloat16 on the way back (into its own area for pull, into the token's die for
fused), and reduces its own tokens' rows in ascending k; the fused passes write into fake
regions addressed as the protocol addresses every die's region. A pass's GB/s counts
the bytes it reads and writes; `x copy` = its time over `np.copyto` of its output bytes (1.0: as
fast as a copy). Every pass runs on the code the protocols run (comm.kernels) or on the same
numpy statement.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from collections.abc import Callable

import numpy as np

from bench import common
from bench.alltoall import Point, default_experts, routing, tokens
from comm.alltoall import weighted_sum
from comm.quant import BF16, quantize_int8
from comm.routing import Placement, get_dispatch_layout
from memory.layout import PULL_ROW_META
from runtime.cli.argtypes import nonneg_int, output_file, positive_int


@dataclasses.dataclass(frozen=True)
class Options:
    point: Point
    reps: int
    json: str | None


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dies", type=positive_int, default=8, help="EP degree (default 8)")
    p.add_argument("--batch", type=positive_int, default=16, help="tokens per die (default 16)")
    p.add_argument("--hidden", type=positive_int, default=7168, help="hidden size (default 7168)")
    p.add_argument("--topk", type=positive_int, default=8, help="experts per token (default 8)")
    p.add_argument("--experts", type=positive_int, default=None, help="default 256")
    p.add_argument("--seed", type=nonneg_int, default=0, help="routing and token seed")
    p.add_argument("--reps", type=positive_int, default=50, help="timed repetitions per pass")
    p.add_argument("--json", type=output_file, default=None, help="write one JSON line per pass")


def parse_options(args: argparse.Namespace) -> Options:
    experts = args.experts or default_experts(args.dies)
    if experts % args.dies or args.topk > experts:
        from memory.errors import ConfigError

        raise ConfigError(
            f"argument --experts/--topk: {experts} experts over {args.dies} dies, top-{args.topk}"
        )
    pt = Point(args.dies, args.batch, args.hidden, args.topk, experts, args.seed)
    return Options(pt, args.reps, args.json)


def _time(fn: Callable[[], object], reps: int) -> float:
    """Median seconds of `fn` over `reps` runs (after one warm-up)."""
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def measure(pt: Point, reps: int) -> list[dict]:
    """One row per pass: name, bytes read + written, seconds, GB/s, time over np.copyto."""
    from comm import kernels as k  # numba: loaded only when it runs

    x = tokens(pt, 0)
    idx, w = routing(pt, 0)
    placement = Placement.default(pt.num_experts, tuple(range(pt.dies)))
    lay = get_dispatch_layout(idx, placement)
    n_msgs, h, dies = lay.num_msgs, pt.hidden, pt.dies
    stride = -(-(h + PULL_ROW_META) // 64) * 64 * 4  # a float32 pod's dispatch row
    q, scale = quantize_int8(x)
    block = pt.batch * min(pt.topk, pt.num_experts // dies) * stride  # a source's receive block
    comb_stride = -(-2 * h // 64) * 32  # bfloat16 elements of a combine row
    comb_bytes = pt.batch * pt.topk * comb_stride * 2
    # every die's region as the fused kernels take them: the blocks for die 0 as a source, the
    # combine buffer, then die 0's own receive area (a block per source) and its counts words
    regions = [np.zeros(block + comb_bytes + dies * block + 8 * dies * pt.num_experts, np.uint8)
               for _ in range(dies)]  # fmt: skip
    addrs, nbytes = np.array([r.ctypes.data for r in regions], np.int64), len(regions[0])
    mine = (regions[0], regions[0].view(np.int32), regions[0].view(np.int64))  # die 0 itself
    dies_arr = np.arange(dies, dtype=np.int64)
    payload8, scale_bits = q.view(np.uint8), scale.view(np.int32)
    recv0 = block + comb_bytes
    counts0 = (recv0 + dies * block) // 8
    n_local = pt.num_experts // dies
    # a die receives about as many rows as it sends (uniform routing): its own messages, by
    # destination, stand in for what each source sends it
    offs = lay.dest_offsets
    for p in range(dies):
        a, b = int(offs[p]), int(offs[p + 1])
        rows = regions[0][recv0 + p * block : recv0 + p * block + (b - a) * stride]
        k.pack_rows(q, scale, lay.msg_slot[a:b], lay.msg_k[a:b],
                    lay.msg_local_expert[a:b] % n_local, rows.reshape(b - a, stride))  # fmt: skip
        counts = np.bincount(lay.msg_local_expert[a:b] % n_local, minlength=n_local)
        regions[0].view(np.int64)[counts0 + p * n_local : counts0 + (p + 1) * n_local] = counts
    cnts = np.diff(offs).astype(np.int64)
    out8 = np.empty((n_msgs, h), np.uint8)
    outs = [np.empty(n_msgs, np.int32)] + [np.empty(n_msgs, np.int64) for _ in range(4)]

    def pack():  # FusedDispatch step 1: every destination's packets in one call
        k.fused_pack(addrs, nbytes, dies_arr, offs, 0, payload8, scale_bits, lay.msg_slot,
                     lay.msg_k, lay.msg_local_expert, stride)  # fmt: skip

    def assemble():  # step 3: every source's packets of this die's area, grouped by expert
        counts = np.zeros(n_local, np.int64)
        got = k.fused_assemble(*mine, dies_arr, cnts, recv0, block, counts0,
                               n_local, stride, h, counts, out8, *outs)  # fmt: skip
        assert got == 0, got

    eout = np.random.default_rng(1).standard_normal((n_msgs, h)).astype(np.float32)
    ebf = k.to_bfloat16(eout)
    order = np.lexsort((lay.msg_k, lay.msg_slot, lay.msg_local_expert))
    plan = np.empty((2, n_msgs), np.int64)
    starts = np.empty(dies + 1, np.int64)
    dest = np.arange(n_msgs, dtype=np.int64) % dies  # rows back to their tokens' dies
    assert not k.group_by_dest(dest, lay.msg_slot, lay.msg_k, pt.topk, dies,
                               pt.batch * pt.topk, plan[0], plan[1], starts)  # fmt: skip

    def scatter():  # FusedCombine step 1: every row, rounded, into its token's die
        k.fused_scatter(eout.view(np.uint32), plan[0], plan[1], starts, addrs, nbytes,
                        np.zeros(0, np.uint16), block // 2, comb_stride, counts0, 0, 1)  # fmt: skip

    comb = np.zeros((pt.batch * pt.topk, comb_stride), BF16)  # this die's combine buffer
    lin = lay.msg_slot * pt.topk + lay.msg_k
    comb[lin, :h] = ebf
    contrib = comb[:, :h].reshape(pt.batch, pt.topk, h)
    own = np.zeros((n_msgs, comb_stride), BF16)  # the pull combine's own send area

    passes = [
        ("quantize int8 (kernel)", lambda: k.quantize_int8(x), x.nbytes, q.nbytes + 4 * len(q)),
        ("fused: pack rows into every destination (kernel)", pack, n_msgs * (h + 16),
         n_msgs * (h + 16)),
        ("fused: group received rows by expert (kernel)", assemble, n_msgs * (h + 16),
         n_msgs * (h + 36)),
        ("pull: round + gather rows into own area (kernel)",
         lambda: k.to_bfloat16(eout, own[:, :h], order), eout.nbytes, ebf.nbytes),
        ("fused: round + write rows into token's die (kernel)", scatter, eout.nbytes,
         ebf.nbytes),
        ("weighted reduce, ascending k (kernel)", lambda: weighted_sum(contrib, idx, w),
         contrib.nbytes, pt.batch * h * 4),
    ]  # fmt: skip
    rows = []
    for name, fn, read, written in passes:
        s = _time(fn, reps)
        src = np.ones(written, np.uint8)
        dst = np.empty_like(src)
        c = _time(lambda src=src, dst=dst: np.copyto(dst, src), reps)
        rows.append({
            "bench": "passes", "pass": name, "bytes_read": int(read), "bytes_written": int(written),
            "us": s * 1e6, "gbps": (read + written) / s / 1e9, "copy_us": c * 1e6,
            "copy_gbps": 2 * written / c / 1e9, "x_copy": s / c if c else 0.0,
            **dataclasses.asdict(pt), **common.run_info(),
        })  # fmt: skip
    return rows


def run(opts: Options) -> int:
    pt = opts.point
    common.progress(
        f"xpod bench passes: EP{pt.dies} b{pt.batch}, hidden {pt.hidden}, top-{pt.topk},"
        f" {pt.num_experts} experts: one die's passes, {opts.reps} reps each, one process"
    )
    rows = measure(pt, opts.reps)
    print(f"\n{'pass':52} {'MB r+w':>8} {'us':>8} {'GB/s':>7} {'copy us':>8} {'x copy':>7}")
    for r in rows:
        mb = (r["bytes_read"] + r["bytes_written"]) / 1e6
        print(f"{r['pass']:52} {mb:8.2f} {r['us']:8.0f} {r['gbps']:7.2f} {r['copy_us']:8.0f}"
              f" {r['x_copy']:7.2f}")  # fmt: skip
    total = sum(r["us"] for r in rows)
    print(f"{'all passes':52} {'':8} {total:8.0f}   (one die's CPU per step, without waiting)")
    if opts.json:
        with open(opts.json, "a", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        print(f"wrote {len(rows)} rows to {opts.json}")
    return 0
