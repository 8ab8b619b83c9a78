"""The speculative-decoding figures of an engine's run, from its masters' counters (vLLM's
spec_decode metrics: the same sums `/metrics` exports per group)."""

from __future__ import annotations

from runtime.model.mtp import SpecConfig


def spec_summary(stats: dict, spec: SpecConfig | None) -> dict | None:
    """Sums over the groups' latest stats (`Engine.stats`): drafts, draft tokens, accepted
    tokens (and per position), verify rows, MTP die time; the rates vLLM derives from them;
    None without MTP."""
    if spec is None:
        return None
    groups = [s for s in stats.values() if s]
    tot = {k: sum(s.get(k, 0) for s in groups) for k in
           ("spec_drafts", "spec_draft_tokens", "spec_accepted_tokens", "spec_verify_rows",
            "spec_model_agree", "mtp_ns")}  # fmt: skip
    per_pos = [sum((s.get("spec_accepted_per_pos") or [0] * spec.k)[j] for s in groups)
               for j in range(spec.k)]  # fmt: skip
    d, dt, acc = tot["spec_drafts"], tot["spec_draft_tokens"], tot["spec_accepted_tokens"]
    return {
        "spec_tokens": spec.k,
        "draft_mode": spec.label,
        "num_drafts": d,
        "num_draft_tokens": dt,
        "num_accepted_tokens": acc,
        "num_accepted_tokens_per_pos": per_pos,
        "acceptance_rate": acc / dt if dt else None,
        "acceptance_per_pos": [p / d if d else None for p in per_pos],
        "mean_acceptance_length": 1 + acc / d if d else None,
        "verify_rows": tot["spec_verify_rows"],
        "mtp_s": tot["mtp_ns"] / 1e9,
        "draft_model_agreement": tot["spec_model_agree"] / dt if dt and spec.transcript else None,
    }


def add_spec_counts(c: dict, body: dict) -> None:
    """A master's counters (`c`) plus a speculative result's drafts and accepted tokens and its
    MTP die time (vLLM's spec_decode counters, per group)."""
    c["mtp_ns"] += body.get("mtp_ns", 0)
    for _rid, drafts, accepted, agree in body["spec"]:
        c["spec_verify_rows"] += 1
        if drafts:
            c["spec_drafts"] += 1
            c["spec_draft_tokens"] += drafts
            c["spec_accepted_tokens"] += accepted
            c["spec_model_agree"] += agree
            for j in range(accepted):
                c["spec_accepted_per_pos"][j] += 1


def check_transcript(tr, spec: SpecConfig | None, vocab: int) -> list[int] | None:
    """A request's transcript for oracle / synthetic drafts, checked (ValueError: a bad one,
    or one the speculative config does not read)."""
    if tr is None:
        return None
    if spec is None or not spec.transcript:
        raise ValueError("transcript: only with MTP's oracle or synthetic drafts")
    if not isinstance(tr, list | tuple) or not all(isinstance(t, int) and 0 <= t < vocab
                                                   for t in tr):  # fmt: skip
        raise ValueError("transcript: a list of token ids")
    return [int(t) for t in tr]


def spec_line(s: dict) -> str:
    """One line: the drafts, their acceptance and the mean acceptance length."""
    rate = "-" if s["acceptance_rate"] is None else f"{s['acceptance_rate']:.3f}"
    per = ", ".join("-" if p is None else f"{p:.3f}" for p in s["acceptance_per_pos"])
    mal = "-" if s["mean_acceptance_length"] is None else f"{s['mean_acceptance_length']:.3f}"
    return (f"MTP k={s['spec_tokens']} draft {s['draft_mode']}: {s['num_drafts']} verify rows"
            f" with drafts, {s['num_draft_tokens']} draft tokens, {s['num_accepted_tokens']}"
            f" accepted (rate {rate}; per position {per}); mean acceptance length {mal};"
            f" MTP die time {s['mtp_s']:.3f} s")  # fmt: skip


__all__ = ["add_spec_counts", "check_transcript", "spec_line", "spec_summary"]
