"""The published decode figures (issue 32) a projection is checked against, all held out (the
profiles were frozen before any was evaluated: bench/project/points.py FROZEN).

Each point names its seed line and the decode configuration its figure describes, as
`bench.project.synth_decode` synthesizes it at the paper's scale (the workload dict), and what
is read from the projection (`measure`): a per-layer latency, a TPOT, a ratio of two
configurations, a throughput gain in percent, or a share of the iteration. Reading the papers:

- 000's decode instance (§4.1, l.353; §5.1, l.687): 320 dies, EP320 / DP320, one expert per
  die; "batch 96" is per NPU in Tables 4-5 (96 requests per NPU at 1,943 tokens/s and 49.4 ms:
  96 / 0.0494 = 1,943) and "each die handles a local batch of at most 96 tokens" (§4.2.1,
  l.413): 48 requests per die, 96 rows with one MTP token. The per-layer figures of §5.4.2
  (874 / 1,260 us, l.815) are "after overlapping two microbatches" (Fig. 22's caption, l.806)
  at a 4,096-token input; §5.4.1's throughput gains (l.798) at batch 64 / 96 / 128 per NPU.
- 001 §7.1 (l.424-426): DP288 / EP288, batch 60 per die, ~3K context, MTP at 90 %: a 93 ms
  iteration, attention 21.8 %, dispatch + combine ~36 % (with the real, skewed routing).
- 001 §7 (l.428): 480 attention dies in 3 domains of 160 and 288 expert dies, batch 96 per
  attention die: A2E 0.17, MoE 0.12, E2A 0.19 ms per layer, a 93 ms forward.
- 000 Table 4 (l.727): DeepSeek's profile on H800, batch 128, KV 4,096: TPOT 50.2 ms.
"""

from __future__ import annotations

from bench.project.points import PubPoint

TOL = 0.20  # a decode figure within 20 %
TOL_RATIO = 0.10  # a ratio of two decode figures within 10 %
POINTS_TOL = 5.0  # a gain in percent within 5 points
SHARE_TOL = 8.0  # a share of the iteration within 8 points

CM384_DECODE = {"layout": "ep", "dies": 320, "card": "deepseek-v3", "routing": "uniform",
                "microbatches": 2, "context": 4096}  # fmt: skip


def _p(id_: str, profile: str, figure: str, op: str, published: float, unit: str, kind: str,
       tol: float, source: str, **workload) -> PubPoint:  # fmt: skip
    ep = workload.get("dies")
    return PubPoint(id_, profile, figure, op, ep, workload.get("requests"), published, unit,
                    kind, "held_out", tol, source, workload)  # fmt: skip


def _table5() -> list[PubPoint]:
    out = []
    # (batch per NPU, prompt, output, TPOT ms); 4,096 + 256: the KV grows from 4,096 to 4,352
    for b, prompt, output, tpot in ((8, 4096, 256, 14.9), (24, 4096, 256, 24.6),
                                    (96, 4096, 256, 49.4), (112, 2048, 256, 47.4),
                                    (128, 1024, 1024, 46.8)):  # fmt: skip
        out.append(_p(
            f"000.table5.tpot.b{b}", "cm384", "000 Table 5", f"TPOT, {prompt} + {output}",
            tpot, "ms", "value", TOL, "000 Table 5 (l.733-740)", measure="tpot",
            **{**CM384_DECODE, "requests": max(1, b // 2), "mtp": 1, "acceptance": 0.7,
               "context": prompt + output // 2}))  # fmt: skip
    return out


DECODE_POINTS: tuple[PubPoint, ...] = (
    _p("000.s5.4.2.layer", "cm384", "000 §5.4.2", "per layer, no MTP", 874.0, "us", "value",
       TOL, "000 §5.4.2 (l.815): 874 us per layer at batch 96", measure="layer",
       **{**CM384_DECODE, "requests": 48, "mtp": 0}),
    _p("000.s5.4.2.layer_mtp", "cm384", "000 §5.4.2", "per layer, 1 MTP token", 1260.0, "us",
       "value", TOL, "000 §5.4.2 (l.815): 1,260 us with MTP", measure="layer",
       **{**CM384_DECODE, "requests": 48, "mtp": 1, "acceptance": 0.7}),
    _p("000.s5.4.2.ratio", "cm384", "000 §5.4.2", "per layer, MTP / no MTP", 1.44, "x",
       "value", TOL_RATIO, "000 §5.4.2 (l.815): +44 %", measure="layer_ratio",
       **{**CM384_DECODE, "requests": 48, "mtp": 1, "acceptance": 0.7}),
    *[_p(f"000.s5.4.1.gain.b{b}", "cm384", "000 §5.4.1", "micro-batch throughput gain", g, "%",
         "points", POINTS_TOL, f"000 §5.4.1 (l.798): +{g} % at batch {b}",
         measure="microbatch_gain", **{**CM384_DECODE, "requests": b // 2, "mtp": 1,
                                       "acceptance": 0.7})
      for b, g in ((64, 5.8), (96, 9.4), (128, 6.9))],
    _p("000.s5.4.1.layer_cut.b96", "cm384", "000 §5.4.1", "micro-batch per-layer change", -10.0,
       "%", "points", POINTS_TOL, "000 §5.4.1 (l.800): ~10 % less per layer at batch 96",
       measure="microbatch_layer_change", **{**CM384_DECODE, "requests": 48, "mtp": 1,
                                             "acceptance": 0.7}),
    _p("000.s4.2.3.stream", "cm384", "000 §4.2.3", "per micro-batch, each stream", 600.0, "us",
       "value", TOL, "000 §4.2.3 (l.464-465): each stream ~600 us per micro-batch",
       measure="stream", **{**CM384_DECODE, "requests": 48, "mtp": 1, "acceptance": 0.7}),
    *_table5(),
    _p("001.s7.1.iteration", "cm384", "001 §7.1", "DP288 / EP288 iteration", 93.0, "ms",
       "value", TOL, "001 §7.1 (l.424-426): one iteration ~93 ms", measure="iteration",
       layout="ep", dies=288, card="deepseek-v3", routing="skew", microbatches=2, context=3072,
       requests=60, mtp=1, acceptance=0.9),
    _p("001.s7.1.attention_share", "cm384", "001 §7.1", "attention share", 21.8, "%", "points",
       SHARE_TOL, "001 §7.1 (l.426): attention kernel 21.8 %", measure="attention_share",
       layout="ep", dies=288, card="deepseek-v3", routing="skew", microbatches=2, context=3072,
       requests=60, mtp=1, acceptance=0.9),
    _p("001.s7.1.comm_share", "cm384", "001 §7.1", "dispatch + combine share", 36.0, "%",
       "points", SHARE_TOL, "001 §7.1 (l.426): dispatch + combine ~36 %",
       measure="comm_share", layout="ep", dies=288, card="deepseek-v3", routing="skew",
       microbatches=2, context=3072, requests=60, mtp=1, acceptance=0.9),
    *[_p(f"001.s7.split.{op}", "cm384", "001 §7", f"{op} per layer, 480 + 288", ms, "ms",
         "value", TOL, f"001 §7.1 (l.428): {op} {ms} ms", measure=op, layout="split",
         attention_dies=480, domains=3, expert_dies=288, card="deepseek-v3", routing="uniform",
         context=3072, requests=96, mtp=1, acceptance=0.9)
      for op, ms in (("a2e", 0.17), ("moe", 0.12), ("e2a", 0.19))],
    _p("001.s7.split.iteration", "cm384", "001 §7", "480 + 288 iteration", 93.0, "ms", "value",
       TOL, "001 §7.1 (l.428): forward ~93 ms", measure="iteration", layout="split",
       attention_dies=480, domains=3, expert_dies=288, card="deepseek-v3", routing="uniform",
       context=3072, requests=96, mtp=1, acceptance=0.9),
    _p("000.table4.h800.tpot", "h800", "000 Table 4", "TPOT, DeepSeek's H800 profile", 50.2,
       "ms", "value", TOL, "000 Table 4 (l.727): batch 128, KV 4,096, ~50.2 ms",
       measure="tpot", layout="ep", dies=128, card="deepseek-v3", routing="uniform",
       microbatches=2, context=4096, requests=128, mtp=1, acceptance=0.7, shared="local"),
)  # fmt: skip


__all__ = ["DECODE_POINTS"]
