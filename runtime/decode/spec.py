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

On a split pod (`--attention-dies`, `runtime.decode.split`) the attention dies hold the batch and
run the main forward and the MTP sub-forwards through `runtime.model.split` (attention_step,
attention_mtp); the expert dies loop (`expert_loop`) over `n_layers + k` MoE slots a step until
each run's end marker.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

import comm
from comm.alltoall import Split
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
from runtime.model.split import (
    attention_mtp,
    attention_step,
    build_split_model,
    end_experts,
    expert_loop,
    split_clock,
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
    keep_kv: bool = False  # return every request's KV rows (every layer) at its last position
    positions: int = 0  # KV positions each request may reach (the larger of both runs)
    transcripts: dict = field(default_factory=dict)  # request -> tokens (oracle / synthetic)
    split: Split | None = None  # a split pod: prompts and ids per attention die


class _Forwards:
    """A die's main forward and MTP sub-forward over its pod's layout: colocated
    (`runtime.model.forward`) or a split pod's attention die (`runtime.model.split`)."""

    def __init__(self, die, ds: SpecDecodeSpec, n_blocks: int):
        cfg, sp = ds.model, ds.split
        self.die, self.ds, self.bal = die, ds, None
        if sp is None:
            self.model, self.pool, self.bal = build_model(die, cfg, n_blocks, ds.block_size)
            self.clock = Clock(die, cfg.kv_layers)
        else:
            self.model, self.pool = build_split_model(die, cfg, sp, n_blocks, ds.block_size)
            self.clock = split_clock(die, cfg.kv_layers)
        self.clock.slots = cfg.n_layers + ds.spec.k

    def main(self, seg, lrows, hidden: bool):
        """Logits at `lrows` (and with `hidden`, the normed rows) of this die's segments."""
        ds, sp = self.ds, self.ds.split
        if sp is not None:
            return attention_step(self.die, self.model, seg, sp, ds.quant, self.clock,
                                  logit_rows=lrows, hidden=hidden)  # fmt: skip
        self.bal.begin_step(self.clock.step)
        out = forward(self.die, self.model, seg, ds.protocol, ds.quant, self.clock, self.bal,
                      logit_rows=lrows, hidden=hidden)  # fmt: skip
        self.bal.end_step(self.clock.step)
        return out

    def mtp(self, j: int, seg, hidden: np.ndarray):
        ds, sp = self.ds, self.ds.split
        if sp is not None:
            return attention_mtp(self.die, self.model, seg, hidden, j, sp, ds.quant, self.clock)
        return forward_mtp(self.die, self.model, seg, hidden, j, ds.protocol, ds.quant,
                           self.clock, self.bal)  # fmt: skip

    def end(self) -> None:
        """After the last step: a split pod's end marker to its expert dies (this run's)."""
        if self.ds.split is not None:
            end_experts(self.die, self.ds.split, self.ds.quant)

    def close(self) -> None:
        if self.bal is not None:
            self.bal.close()
        self.die.free(self.pool)


def _expert_main(die, ds: SpecDecodeSpec) -> dict:
    """A split pod's expert die: its experts (the MTP module's too) served over `n_layers + k`
    MoE slots a step until the attention dies' end marker."""
    cfg, sp = ds.model, ds.split
    model, _ = build_split_model(die, cfg, sp, 0, ds.block_size)
    clock = split_clock(die, cfg.kv_layers)
    comm.barrier(die)
    st = expert_loop(die, model, sp, ds.quant, clock, slots=cfg.n_layers + ds.spec.k)
    return {"role": "expert", "die": die.die_id, "stats": st.to_dict()}


def spec_decode_main(die, ds: SpecDecodeSpec) -> dict:
    """Run on every die: prefill, `ds.steps` speculative steps; this die's streams and times (a
    split pod's expert die: its loop's counters)."""
    sp = ds.split
    if sp is not None and die.die_id not in sp.att_dies:
        return _expert_main(die, ds)
    cfg, spec, me = ds.model, ds.spec, die.die_id
    rank = me if sp is None else sp.att_dies.index(me)
    prompts, ids = ds.prompts[rank], ds.request_ids[rank]
    bs = ds.block_size
    n_blocks = sum(-(-ds.positions // bs) for _ in ids)
    fw = _Forwards(die, ds, n_blocks)
    kv = KVManager(max(n_blocks, 1), bs, enable_prefix_cache=False)
    tables = {r: kv.alloc_blocks(r, ds.positions) for r in ids}
    clock = fw.clock
    streams = [[SpecStream(r, list(p), (ds.seed, r), ds.transcripts.get(r))
                for r, p in zip(ids, prompts, strict=True)]]  # fmt: skip
    dec = SpecDecoder(spec, streams, ds.temperature, cfg.max_seq_len, ds.keep_logits)
    mtp_ns = [0]

    def place(seg) -> None:
        fw.model.kv.begin_step([(r, start, len(t), tables[r]) for r, t, start in seg])

    def run_main(segs, lrows):
        place(segs[0])
        if spec.k:
            logits, normed = fw.main(segs[0], lrows[0], True)
        else:
            logits = fw.main(segs[0], lrows[0], False)
            normed = np.zeros((sum(len(t) for _, t, _ in segs[0]), 0), np.float32)
        return [logits], [normed]

    def run_mtp(j, segs, hidden):
        t0 = time.perf_counter_ns()
        place(segs[0])
        out = fw.mtp(j, segs[0], hidden[0])
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
        if sp is None:  # a split pod's expert dies are in their loop: no pod-wide barrier
            comm.barrier(die)
        clock.counting = True
        cpu1, wait0, t0 = time.process_time(), ctx.waited_ns, time.perf_counter_ns()
        cap = getattr(die, "cap", None)  # a capture pod: each step a call (decode.project)
        for s in range(1, ds.steps + 1):
            ts, m0 = time.perf_counter_ns(), mtp_ns[0]
            if cap is not None:
                cap.begin("step", s, cap.main)
            step(s)
            if cap is not None:
                cap.end("step", s)
            step_ns.append(time.perf_counter_ns() - ts)
            step_mtp_ns.append(mtp_ns[0] - m0)
        decode_ns = time.perf_counter_ns() - t0
        cpu_decode = time.process_time() - cpu1
        wait_ns = ctx.waited_ns - wait0
        fw.end()
        kv_rows = _kv_rows(fw.pool, tables, streams[0], bs) if ds.keep_kv else {}
    finally:
        fw.close()
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
        "kv_rows": kv_rows,
    }  # fmt: skip


def _kv_rows(pool: np.ndarray, tables: dict, streams, bs: int) -> dict:
    """Request -> float32 `[kv_layers, pos, kv_dim]`: its rows of every layer at positions
    [0, pos), pos its next row's start (the rows its accepted tokens wrote)."""
    out = {}
    for s in streams:
        t = np.asarray(tables[s.rid][: -(-s.pos // bs)], np.int64)
        out[s.rid] = pool[:, t].reshape(pool.shape[0], -1, pool.shape[3])[:, : s.pos].copy()
    return out


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
