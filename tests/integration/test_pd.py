"""Prefill-decode disaggregation through the real engine (runtime.engine.pd): prefill dies and
decode dies in one pod, each part its own lockstep EP group, the KV moved once over the KV links.

- correctness: tokens and logits equal the schedule replay of both parts (the KV a decode die
  received must be what its prefill die computed), with prefix hits on the prefill side,
  preemption on the decode side (a small decode pool), chunked prefill, greedy and seeded
  sampling; every transfer's crc32 equal to its source's;
- a request aborted in every connector state (Transferring: a KV fault holds the copy back;
  Bootstrapping: the decode pool is full; WaitingForInput: the prefill master is stopped;
  running on the decode die) ends once with "abort", and nothing stays allocated on either side;
- faults: a stopped prefill die -> the decode side probes, finds the link dead and fails its
  request within the deadline (kv_policy fail), while a saturated decode side is only "slow";
  an expired lease frees the prefill blocks and the request is sent again (recompute); a decode
  die killed mid-transfer -> a restart, the request recomputes and finishes.
"""

from __future__ import annotations

import os
import signal

import pytest

from runtime.engine import Engine
from runtime.engine.replay import replay_engine
from sched import SamplingParams
from tests.waiting import stopped, wait_for

TINY = dict(model="tiny", timeout_s=20.0, max_num_batched_tokens=32)
# The tests below stop dies and masters on purpose, for as long as their checks need on a slow
# machine: no hang detection (that is tested in test_reliability.py)
HELD = dict(stall_timeout_s=120.0, heartbeat_timeout_s=120.0)


def pd_states(eng: Engine) -> dict:
    out: dict = {}
    for g in eng.config.pd.decode:
        for k, v in (eng.stats.get(g) or {}).get("pd_states", {}).items():
            out[k] = out.get(k, 0) + v
    return out


def settled(eng: Engine, timeout_s: float = 30.0) -> dict:
    """Every group idle, no KV block used on either side, no lease held, no PD request open."""

    def idle():
        st = eng.stats
        if len(st) != eng.config.dies:
            return None
        for s in st.values():
            if s["running"] or s["waiting"] or s["kv"]["used"] or s["inflight"]:
                return None
            if s.get("pd_leased") or any((s.get("pd_states") or {}).values()):
                return None
        return st

    return wait_for(idle, timeout_s, f"the groups to settle: {eng.stats}")


def link_state(eng: Engine, link: str) -> str:
    for g in eng.config.pd.decode:
        links = (eng.stats.get(g) or {}).get("pd_links") or {}
        if link in links:
            return links[link]["state"]
    return ""


@pytest.mark.timeout(180)
def test_pd_tokens_and_logits_equal_the_replay_of_both_parts():
    base = "the quick brown fox jumps over the lazy dog " * 2  # 2+ full blocks: prefix hits
    prompts = [base + "x" * (i % 5) for i in range(8)] + ["y" * 70, "short"]
    params = [SamplingParams(max_tokens=50 + 9 * (i % 4), temperature=0.7 * (i % 2), seed=i,
                             ignore_eos=i % 3 == 0) for i in range(len(prompts))]  # fmt: skip
    with Engine.launch(prefill_dies=1, decode_dies=2, max_num_seqs=4, decode_blocks=16,
                       log_steps=True, keep_logits=True, **TINY) as eng:  # fmt: skip
        outs = eng.generate(prompts, params, timeout_s=120)
        st = settled(eng)
        cfg = eng.config
    assert {o.finish_reason for o in outs} <= {"stop", "length"}, outs
    assert all(o.token_ids for o in outs)
    pre, dec = st[0], [st[1], st[2]]
    assert pre["prefix_hit_tokens"] > 0, "shared prefixes must hit on the prefill die"
    assert sum(s["num_preemptions"] for s in dec) > 0, "a decode pool of 16 blocks must preempt"
    n_pd = len(prompts)
    assert pre["pd_prefilled"] == n_pd and pre["pd_leases_freed"] == n_pd
    assert sum(s["pd_success"] for s in dec) == n_pd
    assert sum(s["pd_checksum_mismatches"] for s in dec) == 0
    links = {k: v for s in dec for k, v in s["pd_links"].items()}
    assert sum(v["transfers"] for v in links.values()) == n_pd
    assert all(v["bytes"] > 0 for v in links.values())
    rep = replay_engine(cfg, eng.step_log)
    assert rep.token_mismatches == [] and rep.logit_mismatches == [], rep
    assert rep.bit_equal and rep.logits_compared == rep.sampled
    # every output token was sampled on some die: the first on the prefill die, the rest on
    # the decode dies (a preempted request samples again only what it had not delivered)
    assert rep.sampled >= sum(len(o.token_ids) for o in outs)


@pytest.mark.timeout(180)
def test_an_abort_in_every_connector_state_ends_once_and_frees_both_sides():
    long_ = SamplingParams(max_tokens=150, ignore_eos=True)
    with Engine.launch(prefill_dies=1, decode_dies=1, max_num_seqs=4, decode_blocks=16,
                       recover=False, kv_timeout_s=30.0, **HELD,
                       inject="delay:die=0,step=1,phase=kv,for=3s", **TINY) as eng:  # fmt: skip
        # Transferring: the first transfer is held back mid-copy by the KV fault (3 s: a state
        # the stats, sent every 0.1 s, cannot miss)
        r = eng.submit("a" * 40, SamplingParams(max_tokens=5))
        wait_for(lambda: pd_states(eng).get("Transferring"), what="Transferring")
        eng.abort(r)
        assert eng.result(r, 10).finish_reason == "abort"
        settled(eng)
        # Bootstrapping: a long request holds the decode pool: its decode die is stopped before
        # it arrives, so it runs (its first decode step in flight) and holds the pool until the
        # die goes on; the next request has no room
        with stopped(eng.pod.procs[1].pid):
            hold = eng.submit("b" * 200, SamplingParams(max_tokens=50, ignore_eos=True))
            wait_for(lambda: (eng.stats.get(1) or {}).get("running"), what="the long one to run")
            r = eng.submit("c" * 100, SamplingParams(max_tokens=5))
            wait_for(lambda: pd_states(eng).get("Bootstrapping"), what="Bootstrapping")
            eng.abort(r)
            assert eng.result(r, 10).finish_reason == "abort"
        assert eng.result(hold, 60).finish_reason == "length"
        settled(eng)
        # WaitingForInput: the prefill master is stopped, the decode die allocated and waits
        with stopped(eng.masters[0].pid):
            r = eng.submit("d" * 60, SamplingParams(max_tokens=5))
            wait_for(lambda: pd_states(eng).get("WaitingForInput"), what="WaitingForInput")
            eng.abort(r)
            assert eng.result(r, 10).finish_reason == "abort"
        settled(eng)
        # running on the decode die: the die is stopped before the request lands, so the
        # request is in its batch (a decode step of it in flight) when the abort comes
        with stopped(eng.pod.procs[1].pid):
            r = eng.submit("e" * 30, long_)
            wait_for(lambda: (eng.stats.get(1) or {}).get("running"), what="it to run")
            eng.abort(r)
            out = eng.result(r, 10)
        assert out.finish_reason == "abort" and len(out.token_ids) < 150
        st = settled(eng)
        # the pod still serves
        ok = eng.generate(["after the aborts"], SamplingParams(max_tokens=8), timeout_s=30)
        assert ok[0].finish_reason in ("stop", "length") and ok[0].token_ids
        led = eng.tracker.ledger
    assert st[0]["pd_leased"] == 0 and st[1]["kv"]["used"] == 0
    assert led["accepted"] == led["ended"] and led["token_gaps"] == 0


@pytest.mark.timeout(180)
def test_a_stopped_prefill_die_is_a_dead_link_and_a_full_decode_side_is_slow():
    opts = dict(recover=False, kv_timeout_s=0.3, kv_policy="fail", **HELD)
    with Engine.launch(prefill_dies=1, decode_dies=1, max_num_seqs=4, decode_blocks=16, **opts,
                       **TINY) as eng:  # fmt: skip
        # saturated decode side: a request waits for room past the deadline -> probe -> "slow"
        # (the decode die is stopped before the long request lands: it holds the pool as long
        # as the die is stopped)
        with stopped(eng.pod.procs[1].pid):
            hold = eng.submit("b" * 200, SamplingParams(max_tokens=50, ignore_eos=True))
            wait_for(lambda: (eng.stats.get(1) or {}).get("running"), what="the long one to run")
            r = eng.submit("c" * 100, SamplingParams(max_tokens=5))
            wait_for(lambda: link_state(eng, "0->1") == "slow", what='"slow"')
            assert pd_states(eng).get("Bootstrapping") == 1
        assert eng.result(hold, 60).finish_reason == "length"
        assert eng.result(r, 30).finish_reason in ("stop", "length")  # waited, not failed
        settled(eng)
        # a stopped prefill die: its request fails by the link's deadline and probe (not by
        # result()'s own timeout, which would raise), the link is "dead"
        with stopped(eng.pod.procs[0].pid):
            r = eng.submit("d" * 60, SamplingParams(max_tokens=5))
            out = eng.result(r, 20)
            assert out.finish_reason == "error" and "link 0->1 dead" in out.error, out
            wait_for(lambda: link_state(eng, "0->1") == "dead", what='"dead" in the stats')
        # the prefill die runs again: its late write lands in quarantined blocks, then they free
        wait_for(lambda: link_state(eng, "0->1") == "ok", what='"ok" again')
        ok = eng.generate(["after the stop"], SamplingParams(max_tokens=8), timeout_s=30)
        assert ok[0].finish_reason in ("stop", "length")
        st = settled(eng)
    assert st[1]["pd_failed"] == 1 and st[1]["pd_probes"] >= 2
    assert st[1]["pd_quarantined_blocks"] > 0 and st[1]["kv"]["used"] == 0


@pytest.mark.timeout(180)
def test_an_expired_lease_frees_the_prefill_blocks_and_the_request_is_sent_again():
    with Engine.launch(prefill_dies=1, decode_dies=1, max_num_seqs=4, recover=False,
                       kv_lease_s=0.3, kv_timeout_s=30.0, **HELD, **TINY) as eng:  # fmt: skip
        with stopped(eng.masters[1].pid):  # the decode master: nobody reads the KV
            r = eng.submit("lease " * 10, SamplingParams(max_tokens=6, ignore_eos=True))
            wait_for(lambda: (eng.stats.get(0) or {}).get("pd_leases_expired"),
                     what="the lease to expire")  # fmt: skip
            assert (eng.stats.get(0) or {}).get("pd_leased") == 0
        out = eng.result(r, 30)
        assert out.finish_reason == "length" and len(out.token_ids) == 6, out
        st = settled(eng)
        recomputed = eng.tracker.pd.counters["pd_recomputed"]
    assert recomputed == 1 and st[0]["pd_failed_orders"] >= 1 and st[1]["pd_failed"] == 1


@pytest.mark.timeout(180)
def test_a_decode_die_killed_mid_transfer_restarts_and_the_request_finishes():
    with Engine.launch(prefill_dies=1, decode_dies=2, max_num_seqs=4,
                       inject="delay:die=0,step=1,phase=kv,for=3s", **TINY) as eng:  # fmt: skip
        r = eng.submit("kill me " * 5, SamplingParams(max_tokens=8, ignore_eos=True))
        t = wait_for(lambda: eng.track_info(r), what="the request")
        wait_for(lambda: pd_states(eng).get("Transferring"), what="Transferring")
        os.kill(eng.pod.procs[t.group].pid, signal.SIGKILL)
        out = eng.result(r, 60)
        rel = eng.reliability()
    assert out.finish_reason == "length" and len(out.token_ids) == 8, out
    assert rel["gen"] >= 1
