"""A serving step with MTP on a die (`runtime.model.mtp.spec_step` in the serving loop of
`runtime.engine.executor`): decode rows are fed their last token and the drafts the die made
at the row before, every sampled position is verified with the non-speculative draw, the MTP
module's sub-forwards run on every die (a dummy step too: their MoE is pod-wide), and the
result carries each row's emitted tokens (`sampled`: `[id, [tokens]]`), its drafts and accepted
count (`spec`: `[id, drafts, accepted, agreement]`) and the next drafts (`drafted`, for the
schedule replay). On a split pod (`loop.split`) an attention die runs the main forward and the
MTP sub-forwards through `runtime.model.split` (attention here, experts on the expert dies)."""

from __future__ import annotations

import time

import numpy as np

from comm.trace import STEP_NAMES, TRACK_NAMES
from memory.errors import ProtocolError
from runtime.engine import wire
from runtime.model.forward import PHASES, forward, forward_mtp
from runtime.model.mtp import SpecRow, spec_step
from runtime.model.split import attention_mtp, attention_step

# the timeline of a speculative step (001 Fig. 20 shows MTP as its own bar): a track on each die
SPEC_OP, SPEC_LANE = "spec", 97
STEP_NAMES.update({(SPEC_OP, 0): "verify", (SPEC_OP, 1): "mtp 1", (SPEC_OP, 2): "mtp 2"})
TRACK_NAMES[SPEC_LANE] = "speculative"


def spec_step_die(loop, s: int, cmd: dict | None, rows: list[dict], dropped: list) -> None:
    """A step with MTP (runtime.model.mtp.spec_step): decode rows fed their last token and
    drafts, every sampled position verified, the MTP sub-forwards' drafts kept for the next
    row. The result's `sampled` holds each row's emitted tokens, `spec` its drafts and
    accepted count, `drafted` the next drafts (the replay checks them)."""
    fed, srows = [], []
    for r in rows:
        rid = r["id"]
        if r.get("transcript") is not None:
            loop.transcripts[rid] = r["transcript"]
        if r["tokens"] is None:
            if "feed" in r:  # a PD decode's first row: its first token, its prefill's drafts
                loop.last[rid], loop.drafts[rid] = r["feed"][0], r["feed"][1:]
            if rid not in loop.last:
                raise ProtocolError(f"die {loop.me}: decode row of request {rid}, which has"
                                    " no sampled token on this die")  # fmt: skip
            toks = [loop.last[rid]] + loop.drafts.get(rid, [])[: r.get("k", 0)]
            fed.append([rid, toks])
        else:
            toks = r["tokens"]
        nxt = r.get("next", -1)
        srows.append(SpecRow(rid, list(toks), r["start"], len(toks) - 1 if r["tokens"] is None
                             else 0, r["sample"], r["index"], r["temperature"], r["seed"],
                             nxt if nxt >= 0 else None, r.get("want", 0),
                             loop.transcripts.get(rid)))  # fmt: skip
    tables = {r["id"]: r["table"] for r in rows}
    loop.clock.step = s
    loop.clock.cur = cur = [0] * len(PHASES)
    t0 = time.perf_counter_ns()
    busy = loop.stats["steps"]
    loop.bal.begin_step(busy)
    mtp_ns = [0]
    if loop.kv_thread is not None and loop.kv_thread.error is not None:
        raise loop.kv_thread.error

    def place(seg) -> None:
        loop.model.kv.begin_step([(rid, st, len(t), tables[rid]) for rid, t, st in seg])

    def run_main(segs, lrows):
        t = time.perf_counter_ns()
        place(segs[0])
        if loop.split is not None:
            bal = None if loop.spec.eplb is None else loop.bal
            out = attention_step(loop.die, loop.model, segs[0], loop.split, loop.spec.quant,
                                 loop.clock, bal=bal, logit_rows=lrows[0],
                                 hidden=True)  # fmt: skip
        else:
            out = forward(loop.ep, loop.model, segs[0], loop.spec.protocol, loop.spec.quant,
                          loop.clock, loop.bal, logit_rows=lrows[0], hidden=True)  # fmt: skip
        loop.die.trace.rec(t, time.perf_counter_ns() - t, SPEC_OP, 0, -1, SPEC_LANE, s,
                           len(lrows[0]))  # fmt: skip
        return [out[0]], [out[1]]

    def run_mtp(j, segs, hidden):
        t = time.perf_counter_ns()
        place(segs[0])
        if loop.split is not None:
            out = attention_mtp(loop.die, loop.model, segs[0], hidden[0], j, loop.split,
                                loop.spec.quant, loop.clock)  # fmt: skip
        else:
            out = forward_mtp(loop.ep, loop.model, segs[0], hidden[0], j, loop.spec.protocol,
                              loop.spec.quant, loop.clock, loop.bal)  # fmt: skip
        mtp_ns[0] += time.perf_counter_ns() - t
        loop.die.trace.rec(t, time.perf_counter_ns() - t, SPEC_OP, 1 + j, -1, SPEC_LANE, s,
                           len(segs[0]))  # fmt: skip
        return [out[0]], [out[1]]

    if loop.op_policy is not None:
        loop.die.policy = loop.ep.policy = loop.op_policy
    try:
        (outs,) = spec_step(loop.mtp, [srows], run_main, run_mtp, loop.spec.model.vocab_size)
    finally:
        loop.die.policy = loop.ep.policy = loop.policy
    loop.bal.end_step(busy)
    sampled, spec, drafted, logits = [], [], [], []
    decode = {rid for rid, _ in fed}  # verify rows: decode rows (a prefill's sample is not one)
    for r, o in zip(srows, outs, strict=True):
        if not r.sample:
            continue
        loop.last[r.rid] = o.emitted[-1]
        loop.drafts[r.rid] = o.drafts
        sampled.append([r.rid, o.emitted])
        if r.rid in decode:
            spec.append([r.rid, r.drafts, o.accepted,
                     sum(int(a == b) for a, b in zip(o.model_drafts, o.drafts,
                                                     strict=False))])  # fmt: skip
        drafted.append([r.rid, o.drafts])
        logits.append(o.logits)
    t1 = time.perf_counter_ns()
    loop.account(s, rows, t0, t1, cur, sum(len(x.tokens) for x in srows))
    w = loop.words[loop.me]
    w[loop.mtp_word] += mtp_ns[0]
    if cmd is not None:
        body = {"plan": cmd["plan"], "seq": cmd["seq"], "step": s, "t0": t0, "t1": t1,
                "sampled": sampled, "fed": fed, "spec": spec, "drafted": drafted,
                "mtp_ns": mtp_ns[0], "dummy_steps": loop.stats["dummy_steps"],
                "bubble_ns": loop.bubble, "attn_ns": cur[0]}  # fmt: skip
        if loop.spec.keep_logits and logits:
            body["logits"] = wire.pack_array(np.concatenate(logits))
        if dropped:
            body["dropped"] = dropped
        if loop.bad_new:
            body["kv_fault"], loop.bad_new = loop.bad_new, []
        loop.publish(body)


__all__ = ["spec_step_die"]
