"""What a split serving pod reports about its roles (MoE-attention disaggregation): per-role
time shares, the expert dies' idle share, A2E / E2A time per step, read from the dies' own
cumulative serve words (`memory.layout` SV_*: the attention dies' attn_ns, a2e_ns, e2a_ns,
step_ns; the expert dies' idle_ns, a2e_ns, expert_ns, e2a_ns, a2e_calls); and every DP group's
die counters the shell reads fresh (`die_counters`)."""

from __future__ import annotations

from memory import layout as L
from memory.errors import PodError

ATT_WORDS = {"attention_ns": L.SV_ATTN_NS, "a2e_ns": L.SV_A2E_NS, "e2a_ns": L.SV_E2A_NS,
             "forward_ns": L.SV_STEP_NS, "dummy_steps": L.SV_DUMMY_STEPS}  # fmt: skip
EXP_WORDS = {"idle_ns": L.SV_IDLE_NS, "a2e_ns": L.SV_A2E_NS, "expert_ns": L.SV_EXPERT_NS,
             "e2a_ns": L.SV_E2A_NS, "a2e_calls": L.SV_A2E_CALLS}  # fmt: skip


def role_counters(pod, split) -> dict | None:
    """{"attention": {die: {...}}, "expert": {die: {...}}} read now, or None (not a split pod,
    or the pod is closed)."""
    if split is None or pod is None or pod.closed:
        return None
    lo = pod.layout
    try:
        att = {a: {k: int(pod.region(a).words[lo.serve_word(w)]) for k, w in ATT_WORDS.items()}
               for a in split.att_dies}  # fmt: skip
        exp = {x: {k: int(pod.region(x).words[lo.serve_word(w)]) for k, w in EXP_WORDS.items()}
               for x in split.exp_dies}  # fmt: skip
    except (PodError, IndexError, ValueError, TypeError):
        return None
    return {"attention": att, "expert": exp}


def split_summary(counters: dict | None, moe_layers: int, split) -> dict | None:
    """Per-role time shares, the expert idle share and A2E / E2A ms per step from
    `role_counters`; the steps the pod ran (rows or dummies) are an expert die's A2E calls
    over the calls of a step (MoE layers x domains x micro-batches)."""
    if not counters:
        return None
    att, exp = counters["attention"], counters["expert"]
    fwd = sum(c["forward_ns"] for c in att.values()) or 1
    a_att = sum(c["attention_ns"] for c in att.values())
    a_a2e = sum(c["a2e_ns"] for c in att.values())
    a_e2a = sum(c["e2a_ns"] for c in att.values())
    e_tot = sum(c["idle_ns"] + c["a2e_ns"] + c["expert_ns"] + c["e2a_ns"] for c in exp.values())
    e_tot = e_tot or 1
    calls = max((c["a2e_calls"] for c in exp.values()), default=0)
    steps = max(calls // max(moe_layers * split.cycle, 1), 1)
    n_att = max(len(att), 1)
    return {
        "attention_dies": list(split.att_dies),
        "expert_dies": list(split.exp_dies),
        "domains": split.num_domains,
        "microbatches": split.microbatches,
        "attention_share": {
            "attention": a_att / fwd,
            "a2e": a_a2e / fwd,
            "e2a": a_e2a / fwd,
            "other": max(0.0, 1 - (a_att + a_a2e + a_e2a) / fwd),
        },
        "expert_share": {
            k: sum(c[f"{k}_ns"] for c in exp.values()) / e_tot
            for k in ("idle", "a2e", "expert", "e2a")
        },
        "expert_idle_share": sum(c["idle_ns"] for c in exp.values()) / e_tot,
        "a2e_ms_per_step": a_a2e / n_att / steps / 1e6,
        "e2a_ms_per_step": a_e2a / n_att / steps / 1e6,
        "steps": steps,
        "expert_a2e_calls": {x: c["a2e_calls"] for x, c in exp.items()},
    }


def eplb_counters(pod, split, groups: int) -> dict[int, dict[str, int]]:
    """Per die that hosts experts (a split pod's expert dies, else the `groups` dies), its EPLB
    words read now: the leader's last window's balancedness (ppm), rows received, bytes moved,
    move ns, maps switched to ({} without EPLB, or once the pod is closed)."""
    if pod is None or pod.closed or not pod.layout.eplb_layers:
        return {}
    lo = pod.layout
    idx = {k: lo.eplb_word(w) for k, w in (
        ("eplb_balance_ppm", L.EP_BALANCE_PPM), ("eplb_rows", L.EP_ROWS),
        ("eplb_moved_bytes", L.EP_MOVED_BYTES), ("eplb_move_ns", L.EP_MOVE_NS),
        ("eplb_switched", L.EP_SWITCHED))}  # fmt: skip
    dies = split.exp_dies if split is not None else range(groups)
    try:
        return {d: {k: int(pod.region(d).words[i]) for k, i in idx.items()} for d in dies}
    except (PodError, IndexError, ValueError, TypeError):
        return {}


def die_counters(pod, dies: int) -> dict[int, dict[int, int]]:
    """Per DP group's die, read now from its serving words (the shell launched the pod and maps
    every region): dummy steps, cumulative attention / MoE wait / forward ns, its step number,
    and its EPLB words when the pod balances ({} once the pod is closed)."""
    if pod is None or pod.closed:
        return {}
    lo = pod.layout
    idx = {k: lo.serve_word(w) for k, w in (("dummy_steps", L.SV_DUMMY_STEPS),
           ("attn_ns", L.SV_ATTN_NS), ("moe_ns", L.SV_MOE_NS), ("step_ns", L.SV_STEP_NS),
           ("die_step", L.SV_VOTE_STEP))}  # fmt: skip
    if lo.eplb_layers:
        idx.update({k: lo.eplb_word(w) for k, w in (
            ("eplb_balance_ppm", L.EP_BALANCE_PPM), ("eplb_rows", L.EP_ROWS),
            ("eplb_moved_bytes", L.EP_MOVED_BYTES), ("eplb_move_ns", L.EP_MOVE_NS),
            ("eplb_switched", L.EP_SWITCHED))})  # fmt: skip
    out = {}
    for g in range(dies):
        try:
            words = pod.region(g).words
            out[g] = {k: int(words[i]) for k, i in idx.items()}
        except (PodError, IndexError, ValueError, TypeError):
            return {}
    return out


__all__ = ["die_counters", "eplb_counters", "role_counters", "split_summary"]
