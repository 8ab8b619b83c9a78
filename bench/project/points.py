"""The published figures a projection is checked against (docs/projection.md §4).

Each point names its seed figure and line, what xpod captures to project it, whether it is a
calibration point (the profile's calibrated constants were fitted on it) or held out (never
fitted on: evaluated only with the frozen profile), and how close the projection must come.
Table 7 (000 l.836-853: batch 128 per rank, hidden 7168, top-8, 256 experts, INT8 dispatch,
BF16 combine) is projected with xpod's fused dispatch / combine (`fused`, `int8`), the
protocol of 000 §4.2.1; DeepEP's low-latency kernels (the H800 columns) move the same
(token, expert) messages. A point's `kind` says how it is judged: `value` within `tolerance`
(relative, either side), `below` / `at_least` a bound (001 §3.1 states inequalities only).

`FROZEN` holds the sha256 of each shipped profile the held-out points were evaluated with:
fitting again (`xpod project --calibrate`) changes a profile's sha256, so the held-out results
no longer apply and tests/unit/test_project_points.py fails until FROZEN (and the results in
docs/results/) are updated on purpose (the freeze rule of shared/PROJECTION.md §5.6).
"""

from __future__ import annotations

from dataclasses import dataclass, field

TOL_CALIBRATION, TOL_HELD_OUT, TOL_SCALE = 0.05, 0.15, 0.20

# Table 7's workload: batch 128 per rank, hidden 7168, top-8 of 256 experts (000 l.836-838)
T7 = {"batch": 128, "hidden": 7168, "topk": 8, "experts": 256, "protocol": "fused",
      "quant": "int8"}  # fmt: skip
# 000 §5.5.1 Table 7 (l.840-851), µs: {ep: (dispatch, combine)}
TABLE7 = {
    "cm384": {8: (116, 118), 16: (131, 132), 32: (133, 146), 64: (141, 150), 128: (152, 150),
              256: (152, 149)},
    "h800": {8: (163, 318), 16: (173, 329), 32: (182, 350), 64: (186, 353), 128: (192, 369),
             256: (194, 360)},
}  # fmt: skip
T7_LINES = {8: 840, 16: 842, 32: 844, 64: 846, 128: 848, 256: 850}
CALIBRATION_EP = {"cm384": (8, 16), "h800": (8,)}

# 001 §3.1 (l.149): a pair of dies on two servers, the send's eight steps end to end
P2P_SIZES_BELOW_1MB = (8, 4096, 65536, 262144, 524288, 1_048_575)  # < 1 MiB: the strict reading
P2P_BIG = 9_000_000
# the send / recv ring the p2p points run on: 64 slots of 16 KiB per lane (a pipelined ring;
# the default 8 x 96 KiB ring fills its first 96 KiB slot before anything moves, which alone
# puts 1 MB on 2 lanes at ~21.5 us at the fitted b_core: docs/projection.md §4)
P2P_RING = {"ring_slots": 64, "slot_bytes": 16384, "variant": "mte"}

# 001 §3.3 (l.185): one of the three DP domains: 160 attention dies (TP1) + 288 expert dies,
# batch 96 per die; A2E 172 us, E2A 193 us. 001 places 256 routed experts and 32 redundant
# copies one per expert die; xpod's block placement holds 288 experts, one per die, routed
# uniformly (bench.project.synth_a2e docstring)
A2E_LAYOUT = {"attention_dies": 160, "expert_dies": 288, "batch": 96, "hidden": 7168,
              "topk": 8, "experts": 288, "quant": "int8"}  # fmt: skip


@dataclass(frozen=True, slots=True)
class PubPoint:
    """One published figure and how xpod projects it."""

    id: str  # e.g. "table7.cm384.dispatch.ep8"
    profile: str  # the profile it is projected on
    figure: str  # "000 Table 7"
    op: str  # "dispatch", "combine", "write 512 B", "send < 1 MB, 2 lanes", ...
    ep: int | None  # dies of the collective (None: a pair)
    batch: int | None  # tokens per rank
    published: float
    unit: str  # "us" or "x" (a ratio)
    kind: str  # "value" | "below" | "at_least" | "points" (a percentage, within points)
    role: str  # "calibration" | "held_out"
    tolerance: float  # relative, for kind == "value"
    source: str  # seed and line
    workload: dict = field(default_factory=dict)  # what to capture (bench.project.validate)


def _table7(profile: str) -> list[PubPoint]:
    out = []
    for ep, (disp, comb) in TABLE7[profile].items():
        cal = ep in CALIBRATION_EP[profile]
        role = "calibration" if cal else "held_out"
        tol = TOL_CALIBRATION if cal else TOL_HELD_OUT
        for op, us in (("dispatch", disp), ("combine", comb)):
            out.append(PubPoint(
                f"table7.{profile}.{op}.ep{ep}", profile, "000 Table 7", op, ep, 128, float(us),
                "us", "value", role, tol, f"000 Table 7 (l.{T7_LINES[ep]})",
                {"kind": "alltoall", "dies": ep, **T7}))  # fmt: skip
    return out


POINTS: tuple[PubPoint, ...] = (
    *_table7("cm384"),
    PubPoint("table1.write_512b", "cm384", "000 Table 1", "write 512 B, inter-node", None, None,
             2.1, "us", "value", "calibration", TOL_CALIBRATION,
             "000 Table 1 (l.168): NPU-NPU write, 512 B, inter-node 2.1 us",
             {"kind": "write", "bytes": 512}),
    PubPoint("001.s3.1.p2p_1mb_2lanes", "cm384", "001 §3.1", "send < 1 MB, 2 lanes (slowest)",
             None, None, 20.0, "us", "below", "calibration", TOL_CALIBRATION,
             "001 §3.1 (l.149): 'less than 20 us for payloads below 1 MB even with 2 AIV cores'",
             {"kind": "p2p_sizes", "sizes": list(P2P_SIZES_BELOW_1MB), "lanes": 2, **P2P_RING}),
    PubPoint("001.s3.1.p2p_9mb_48v2", "cm384", "001 §3.1", "send 9 MB: 2 lanes / 48 lanes",
             None, None, 2.5, "x", "at_least", "calibration", TOL_CALIBRATION,
             "001 §3.1 (l.149): '9 MB with 48 AIV cores is more than 2.5x faster than with 2'",
             {"kind": "p2p_ratio", "bytes": P2P_BIG, "lanes": [2, 48], **P2P_RING}),
    PubPoint("001.s3.3.a2e", "cm384", "001 §3.3", "a2e", 448, 96, 172.0, "us", "value",
             "held_out", TOL_SCALE, "001 §3.3 (l.185): 'A2E achieves a latency of 172 us'",
             {"kind": "a2e", **A2E_LAYOUT}),
    PubPoint("001.s3.3.e2a", "cm384", "001 §3.3", "e2a", 448, 96, 193.0, "us", "value",
             "held_out", TOL_SCALE, "001 §3.3 (l.185): 'E2A completes in 193 us'",
             {"kind": "a2e", **A2E_LAYOUT}),
    *_table7("h800"),
)  # fmt: skip

PROFILES = ("cm384", "h800")

# sha256 of each shipped profile when its held-out points were evaluated (module docstring)
FROZEN: dict[str, str] = {
    "cm384": "d800d5acbac243ae5b4cf93b68085daeaec9295510ee5957ede45c3de7bf9f1d",
    "h800": "7a9a34c21598ddc11d3d0d8a8279a64643589b9c46e9b3bfb877dac0062ea2b6",
}


def points_of(profile: str) -> list[PubPoint]:
    """The points projected on `profile` (ValueError for a profile with none)."""
    pts = [p for p in POINTS if p.profile == profile]
    if not pts:
        raise ValueError(f"no published points for profile {profile!r}: one of {PROFILES}")
    return pts


def judge(p: PubPoint, projected: float) -> tuple[float, bool]:
    """(signed relative error, ok) of `projected` against point `p` (a `points` kind: the signed
    difference in percentage points, ok within `tolerance` points)."""
    if p.kind == "points":
        diff = projected - p.published
        return diff, abs(diff) <= p.tolerance + 1e-12
    error = projected / p.published - 1.0
    if p.kind == "below":
        return error, projected < p.published
    if p.kind == "at_least":
        return error, projected >= p.published
    return error, abs(error) <= p.tolerance + 1e-12  # 105 / 100 - 1 is 0.05000000000000004


__all__ = ["FROZEN", "POINTS", "PROFILES", "PubPoint", "judge", "points_of"]
