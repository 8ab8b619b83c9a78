"""`xpod decode --num-speculative-tokens K`: the fixed-batch decode with MTP drafts
(`runtime.model.mtp`), against the same batch without them, in one pod.

Each die runs `runtime.model.mtp.spec_step` over its requests: step 0 prefills every prompt and
runs the MTP module over it; each of the `steps` later steps verifies one row `[last] + drafts`
per request and drafts k tokens for the next. A request's draws are keyed by `(seed, request,
output index)` (what the plain decode keys by step, the same draws), so a greedy or seeded run
emits the tokens the run without MTP emits, as long as their rows compute the same bits
(`batch_invariant`; in the default mode a 2-row verify may differ from a 1-row step in the
last bits, which is reported, not hidden).

In the same pod, first the batch without MTP for `steps x (1 + k)` steps (the baseline: its
step time, its tokens/s, and the transcript the oracle / synthetic drafts read and the MTP run's
tokens are compared with), then with MTP for `steps` steps; `--repeat R` alternates them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

import comm
from runtime.model import ModelConfig
from runtime.model.forward import Clock, build_model, forward, forward_mtp
from runtime.model.mtp import (
    SpecConfig,
    SpecDecoder,
    SpecStream,
    positions_needed,
    spec_step,
    stats,
)
from sched import KVManager

NO_MTP = SpecConfig(0, "real")


@dataclass(frozen=True)
class SpecDecodeSpec:
    """What every die needs for one speculative (or baseline) run (picklable)."""

    model: ModelConfig
    prompts: list[list[list[int]]]  # [die][i]
    request_ids: list[list[int]]
    steps: int
    spec: SpecConfig
    protocol: str = "fused"
    quant: str | None = None
    temperature: float = 0.0
    seed: int = 0
    block_size: int = 16
    keep_logits: bool = False
    positions: int = 0  # KV positions each request may reach (the larger of both runs)
    transcripts: dict = field(default_factory=dict)  # request -> tokens (oracle / synthetic)


def spec_decode_main(die, ds: SpecDecodeSpec) -> dict:
    """Run on every die: prefill, `ds.steps` speculative steps; this die's streams and times."""
    cfg, spec, me = ds.model, ds.spec, die.die_id
    prompts, ids = ds.prompts[me], ds.request_ids[me]
    bs = ds.block_size
    n_blocks = sum(-(-ds.positions // bs) for _ in ids)
    model, pool, bal = build_model(die, cfg, n_blocks, bs)
    kv = KVManager(max(n_blocks, 1), bs, enable_prefix_cache=False)
    tables = {r: kv.alloc_blocks(r, ds.positions) for r in ids}
    clock = Clock(die, cfg.kv_layers)
    clock.slots = cfg.n_layers + spec.k
    streams = [[SpecStream(r, list(p), (ds.seed, r), ds.transcripts.get(r))
                for r, p in zip(ids, prompts, strict=True)]]  # fmt: skip
    dec = SpecDecoder(spec, streams, ds.temperature, cfg.max_seq_len, ds.keep_logits)
    mtp_ns = [0]

    def place(seg) -> None:
        model.kv.begin_step([(r, start, len(t), tables[r]) for r, t, start in seg])

    def run_main(segs, lrows):
        place(segs[0])
        bal.begin_step(clock.step)
        if spec.k:
            logits, normed = forward(die, model, segs[0], ds.protocol, ds.quant, clock, bal,
                                     logit_rows=lrows[0], hidden=True)  # fmt: skip
        else:
            logits = forward(die, model, segs[0], ds.protocol, ds.quant, clock, bal,
                             logit_rows=lrows[0])  # fmt: skip
            normed = np.zeros((sum(len(t) for _, t, _ in segs[0]), 0), np.float32)
        bal.end_step(clock.step)
        return [logits], [normed]

    def run_mtp(j, segs, hidden):
        t0 = time.perf_counter_ns()
        place(segs[0])
        out = forward_mtp(die, model, segs[0], hidden[0], j, ds.protocol, ds.quant, clock, bal)
        mtp_ns[0] += time.perf_counter_ns() - t0
        return [out[0]], [out[1]]

    def step(s: int) -> None:
        clock.step = s
        rows = dec.rows(s)
        dec.take(s, rows, spec_step(spec, rows, run_main, run_mtp, cfg.vocab_size))

    ctx = die.ctx
    step_ns, step_mtp_ns = [], []
    try:
        comm.barrier(die)
        cpu0, t0 = time.process_time(), time.perf_counter_ns()
        step(0)
        prefill_ns = time.perf_counter_ns() - t0
        comm.barrier(die)
        clock.counting = True
        cpu1, wait0, t0 = time.process_time(), ctx.waited_ns, time.perf_counter_ns()
        for s in range(1, ds.steps + 1):
            ts, m0 = time.perf_counter_ns(), mtp_ns[0]
            step(s)
            step_ns.append(time.perf_counter_ns() - ts)
            step_mtp_ns.append(mtp_ns[0] - m0)
        decode_ns = time.perf_counter_ns() - t0
        cpu_decode = time.process_time() - cpu1
        wait_ns = ctx.waited_ns - wait0
    finally:
        bal.close()
        die.free(pool)
    mine = streams[0]
    return {
        "die": me, "request_ids": ids,
        "tokens": [s.tokens for s in mine],
        "logits": [s.logits for s in mine] if ds.keep_logits else [],
        "stats": stats(mine, spec),
        "model_agree": sum(s.model_agree for s in mine),
        "prefill_ns": prefill_ns, "decode_ns": decode_ns, "step_ns": step_ns,
        "mtp_ns": step_mtp_ns, "layer_ns": clock.layer_ns, "other_ns": clock.other_ns,
        "wait_ns": wait_ns, "cpu_prefill_s": cpu1 - cpu0, "cpu_decode_s": cpu_decode,
    }  # fmt: skip


def merged_stats(res: list[dict], spec: SpecConfig) -> dict:
    """`stats` over every die's requests (the dies' sums)."""
    keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    tot = {k: sum(r["stats"][k] for r in res) for k in keys}
    per_pos = [sum((r["stats"]["acceptance_per_pos"][j] or 0) * r["stats"]["num_drafts"]
                   for r in res) for j in range(spec.k)]  # fmt: skip
    d = tot["num_drafts"]
    return {
        "spec_tokens": spec.k, "draft_mode": spec.label, **tot,
        "acceptance_rate": tot["num_accepted_tokens"] / tot["num_draft_tokens"]
        if tot["num_draft_tokens"] else None,
        "acceptance_per_pos": [round(p / d, 6) if d else None for p in per_pos],
        "mean_acceptance_length": 1 + tot["num_accepted_tokens"] / d if d else None,
    }  # fmt: skip


__all__ = ["NO_MTP", "SpecDecodeSpec", "merged_stats", "positions_needed", "spec_decode_main"]
