"""The pure parts of prefill-decode disaggregation: the topology and connection mapping, the
shell's picks, the config's checks, the scheduler's lease and prefilled requests, the fault
plan's kv phase."""

from __future__ import annotations

import pytest

from memory.errors import ConfigError
from runtime.engine import EngineConfig
from runtime.engine.faults import FaultSpecError, parse_faults
from runtime.engine.pd import PDTopology, kv_source_rank
from runtime.engine.pd_shell import PDRouter, pd_blocks, pd_master_spec
from sched import KVManager, Request, SamplingParams, Scheduler, SchedulerConfig
from sched.request import FinishReason, RequestStatus


def test_topology_parts_roles_and_links():
    t = PDTopology.make(2, 3)
    assert t.prefill == (0, 1) and t.decode == (2, 3, 4) and t.num_dies == 5
    assert t.part(1) == (0, 1) and t.part(3) == (2, 3, 4)
    assert t.role(0) == "prefill" and t.role(4) == "decode" and t.link(1, 3) == "1->3"
    for bad in ((0, 2), (2, 0), (True, 2), (20, 20)):
        with pytest.raises(ConfigError):
            PDTopology.make(*bad)


def test_connection_mapping_is_000s_formula():
    # prefill TP 4, decode TP 2 (ratio 2), decode DP 8: group size 4
    got = [[kv_source_rank(4, 2, 8, dp, tp) for tp in range(2)] for dp in range(8)]
    assert got == [[0, 1]] * 4 + [[2, 3]] * 4
    assert kv_source_rank(1, 1, 4, 3, 0) == 0  # TP 1: every decode rank, prefill rank 0
    with pytest.raises(ConfigError):
        kv_source_rank(3, 2, 4, 0, 0)


def test_config_checks_and_what_it_gives_each_group():
    cfg = EngineConfig(prefill_dies=1, decode_dies=2, model="tiny", decode_blocks=16)
    assert cfg.dies == 3 and cfg.pd.decode == (1, 2) and cfg.rollback is False
    assert pd_blocks(cfg, 0) == cfg.blocks and pd_blocks(cfg, 2) == 16
    spec = pd_master_spec(cfg, 1)
    assert spec["role"] == "decode" and spec["prefill"] == [0] and spec["timeout_s"] == 2.0
    assert pd_master_spec(EngineConfig(dies=2, model="tiny"), 0) is None
    pc = cfg.pod_config()
    assert pc.num_dies == 3 and pc.a2a_max_local_experts == 16  # 16 experts over 1 die
    for bad, match in (
        (dict(prefill_dies=1, decode_dies=0), "decode_dies"),
        (dict(prefill_dies=3, decode_dies=2), "num_experts"),  # tiny: 16 experts over 3 dies
        (dict(prefill_dies=1, decode_dies=2, expert_dies=2), "expert dies"),
        (dict(prefill_dies=1, decode_dies=2, kv_policy="retry"), "kv_policy"),
        (dict(prefill_dies=1, decode_dies=2, kv_lease_s=0), "kv_lease_s"),
        (dict(prefill_dies=1, decode_dies=2, decode_blocks=3), "decode_blocks"),
    ):
        with pytest.raises(ConfigError, match=match):
            EngineConfig(model="tiny", **bad)


def test_router_picks_prefill_by_queue_times_length_and_decode_by_kv():
    cfg = EngineConfig(prefill_dies=2, decode_dies=2, model="tiny", max_num_seqs=2, queue_ahead=0)
    r = PDRouter(cfg)
    long_, short = list(range(200)), [1, 2, 3]
    p, d = r.pick(long_, 10)
    r.on_dispatch(0, p, d, long_, 10)
    p2, d2 = r.pick(short, 10)
    assert p2 != p and d2 != d  # the empty prefill die; the decode die with less KV reserved
    r.on_dispatch(1, p2, d2, short, 10)
    assert r.pick(short, 10)[0] == p2  # (1 + 1) x (3 + 3) < (1 + 1) x (200 + 3)
    r.on_prefilled(0)
    assert r.queue_tokens() == {p: 0, p2: 3}
    # a prefill die seen dead by a decode master is skipped until it is ok again
    r.on_stats({"group": 2, "pd_links": {"0->2": {"state": "dead"}, "1->2": {"state": "ok"}}})
    assert r.pick(short, 1)[0] == 1
    r.on_stats({"group": 2, "pd_links": {"0->2": {"state": "ok"}}})
    assert not r.dead.get(0)
    # every decode die at its limit: no pick
    r.on_dispatch(2, 0, 2, short, 10)
    r.on_dispatch(3, 0, 3, short, 10)
    assert r.pick(short, 10) is None
    r.on_finish(3)
    assert r.pick(short, 10) is not None


def test_scheduler_lease_keeps_the_blocks_of_a_finished_request():
    kv = KVManager(8, 4)
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_seq_len=32), kv)
    a = Request(1, list(range(10)), SamplingParams(max_tokens=1))
    b = Request(2, list(range(50, 56)), SamplingParams(max_tokens=1))
    s.lease[1] = ("lease", 1)
    s.add(a)
    s.add(b)
    plan = s.schedule()
    s.on_result(plan.plan_id, {1: 7, 2: 8})
    assert a.finish_reason is FinishReason.LENGTH and kv.block_table(("lease", 1)) != []
    assert kv.usage()["used"] == 3  # a's 3 blocks under the lease, b's freed
    kv.free(("lease", 1))
    assert kv.usage()["used"] == 0
    kv.check()
    # an aborted leased request frees at once
    c = Request(3, list(range(9)), SamplingParams(max_tokens=1))
    s.lease[3] = ("lease", 3)
    s.add(c)
    s.schedule()
    s.abort(3)
    assert ("lease", 3) not in kv._tables


def test_add_prefilled_joins_the_batch_at_its_prompt_end():
    kv = KVManager(8, 4)
    s = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_seq_len=32), kv)
    kv.alloc_blocks(5, 10)
    req = Request(5, list(range(10)) + [42], SamplingParams(max_tokens=3), index_base=1)
    s.add_prefilled(req, 10)
    assert req.status is RequestStatus.RUNNING
    plan = s.schedule()
    (row,) = plan.rows
    assert (row.start, row.tokens, row.sample, row.token_index) == (10, [42], True, 1)
    with pytest.raises(ValueError, match="no block table"):
        s.add_prefilled(Request(6, [1, 2, 3], SamplingParams(max_tokens=1)), 2)
    kv.alloc_blocks(7, 3)
    with pytest.raises(ValueError, match="num_computed"):
        s.add_prefilled(Request(7, [1, 2, 3], SamplingParams(max_tokens=1)), 3)
    assert 7 not in s._live


def test_add_prefilled_with_mtp_drafts_starts_with_a_verify_row():
    kv = KVManager(16, 4)
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, max_seq_len=32,
                          async_depth=1, spec_tokens=2)  # fmt: skip
    s = Scheduler(cfg, kv)
    for rid, max_tokens in ((5, 6), (6, 1), (7, 6)):
        kv.alloc_blocks(rid, 10)
        s.add_prefilled(Request(rid, list(range(10)) + [42], SamplingParams(max_tokens),
                                index_base=1), 10, [7, 8])  # fmt: skip
    s._preempt(s._live[7])  # preempted before its first row: it recomputes, no drafts fed
    plan = s.schedule()
    rows = {r.request_id: r for r in plan.rows}
    r5, r6, r7 = rows[5], rows[6], rows[7]
    assert (r5.start, r5.tokens, r5.feed, r5.num_tokens, r5.drafts) == (10, None, [42, 7, 8], 3, 2)
    assert (r5.token_index, r5.sample, r5.want) == (1, True, 2)
    assert (r6.feed, r6.drafts) == ([42], 0)  # 1 token left: no room for a draft
    assert (r7.start, r7.drafts, r7.tokens[:2]) == (0, 0, [0, 1])
    assert kv.block_table(5) == r5.block_table and len(r5.block_table) * 4 >= 10 + 3 + 1
    out = s.on_result(plan.plan_id, {5: [7, 99], 6: [3], 7: [1]})
    assert out.new_tokens[5] == [7, 99] and s._live[5].num_computed == 12
    (row,) = [r for r in s.schedule().rows if r.request_id == 5]
    assert (row.start, row.tokens, row.feed, row.drafts) == (12, None, None, 2)  # the die feeds


def test_fault_plan_kv_phase():
    (f,) = parse_faults("delay:die=0,step=2,phase=kv,for=0.5s", 3)
    assert f.phase == "kv" and f.in_die and f.step == 2
    (f,) = parse_faults("kill:die=0,step=1,phase=kv", 3)
    assert f.phase == "kv" and f.in_die
    with pytest.raises(FaultSpecError, match="kv"):
        parse_faults("delay:die=0,step=2,phase=prefill,for=0.5s", 3)
