"""Faults of the pod-wide KV pool (KVPOOL.md §4.8, §5.2 E5): a plan's `kill:pool=0` and
`stop:pool=0,for=T` under multi-turn conversations over 2 dies. The pool's soft state can always
be lost: every request completes with the tokens of a run without the pool (batch-invariant
mode, greedy), a killed server is seen exiting and restarted (its loads in flight fall back to
recompute, counted), a stopped one costs its loads their timeout, never a pod restart, and once
it is back the conversations hit the pool again, nothing left held or quarantined.

Each turn of a conversation is its previous turn's prompt and answer plus a new user message,
sent to the other die than its previous turn (pinned): its die-local cache holds the prompt of
two turns back, the pool the previous turn's, so every turn after the first loads from the pool.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from memory.errors import ConfigError
from runtime.engine import Engine, EngineConfig
from runtime.engine.faults import FaultSpecError, parse_faults, proc_state
from runtime.engine.pool_config import PoolConfig
from sched import SamplingParams
from tests.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
BS = 8
TINY = dict(dies=2, model="tiny", timeout_s=20.0, max_num_batched_tokens=64, block_size=BS,
            model_overrides={"batch_invariant": True})  # fmt: skip
CONVS = 6
TURNS = 7  # turns 0-2 before the fault, 3 across it, 4-6 after
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)  # greedy
# The plan's fault is due this long after the launch: the three turns before it (36 short
# requests of the tiny model) end well before; a machine where they do not fails the check
# that says so, not a bound on its speed elsewhere.
FAULT_AT_S = 6.0


def _user(c: int, r: int, n: int) -> list[int]:
    return [1 + (c * 37 + r * 11 + k) % 250 for k in range(n)]


class Conversations:
    """CONVS conversations; turn r of conversation c goes to die (c + r) % 2."""

    def __init__(self) -> None:
        self.prompts = [_user(c, 0, 3 * BS) for c in range(CONVS)]
        self.outs: list[list[list[int]]] = []  # per turn, per conversation: its tokens

    def submit(self, eng: Engine, r: int) -> list[int]:
        return [eng.submit(self.prompts[c], PARAMS, group=(c + r) % 2) for c in range(CONVS)]

    def collect(self, eng: Engine, ids: list[int]) -> list:
        """The turn's outputs, once its prompt blocks are stored (the shell had each request's
        `put` before its finish: the same socket): the next turn finds them complete."""
        outs = [eng.result(i, timeout_s=60) for i in ids]
        assert [o.finish_reason for o in outs] == ["length"] * CONVS, outs
        r = len(self.outs)
        self.outs.append([o.token_ids for o in outs])
        for c, o in enumerate(outs):
            self.prompts[c] = self.prompts[c] + o.token_ids + _user(c, r + 1, BS)
        if eng.pool is not None:
            wait_for(lambda: not eng.pool.stores, what="the turn's stores")
        return outs

    def turn(self, eng: Engine, r: int) -> list:
        return self.collect(eng, self.submit(eng, r))


def _masters(eng: Engine, key: str) -> int:
    return sum(int((eng.stats.get(g) or {}).get(key, 0)) for g in range(eng.config.dies))


def _hits(outs: list) -> list[int]:
    """Prompt tokens each request found cached (die-local or loaded from the pool)."""
    return [o.num_cached_tokens for o in outs]


def _previous(outs: list) -> list[int]:
    """The length of each request's previous turn (all of it: full blocks), what it finds
    cached when it hits the pool (its die-local cache has the turn before that)."""
    return [len(o.prompt) - PARAMS.max_tokens - BS for o in outs]


@pytest.fixture(scope="module")
def reference() -> list[list[list[int]]]:
    """The same turns without the pool: every prompt computed."""
    conv = Conversations()
    with Engine.launch(**TINY) as eng:
        for r in range(TURNS):
            conv.turn(eng, r)
    return conv.outs


def _pool_engine(tmp_path, plan: str, load_timeout_s: float) -> Engine:
    # the server copies the loads (a master copying a DRAM hit itself never waits for it)
    pool = PoolConfig(dram_mib=4, load_timeout_s=load_timeout_s, load_by="server")
    return Engine.launch(**TINY, kv_pool=pool, inject=plan,
                         fault_log=str(tmp_path / "faults.jsonl"))  # fmt: skip


def _before_the_fault(eng: Engine, conv: Conversations) -> None:
    """Turns 0-2: stored, then loaded (each turn after the first hits its previous turn)."""
    for r in range(3):
        outs = conv.turn(eng, r)
        if r:
            assert _hits(outs) == _previous(outs), outs
    assert eng.pool.counters["pool_landed_blocks"] > 0
    assert eng.supervisor.fired == [], (
        f"the plan's fault (at={FAULT_AT_S:g}s) fired before the first three turns ended"
    )


def _but_benign(counts: dict) -> dict:
    """`counts` without benign rollbacks: a step whose collective waited past the op deadline
    on a host that stalled a process that long (test_reliability.py's `only`)."""
    return {k: v for k, v in counts.items() if k not in ("deadline", "rollback")}


def _log(tmp_path) -> list[dict]:
    return [json.loads(x) for x in (tmp_path / "faults.jsonl").read_text().splitlines()]


@pytest.mark.timeout(90)
def test_a_killed_pool_server_costs_hits_never_requests(reference, tmp_path):
    conv = Conversations()
    eng = _pool_engine(tmp_path, f"kill:pool=0,at={FAULT_AT_S:g}s", load_timeout_s=60.0)
    try:
        _before_the_fault(eng, conv)
        old = eng.pool.handle.pid
        # Turn 3's loads wait on a server held stopped until the plan kills it (a 60 s load
        # timeout: they end by the kill only), the dies idle meanwhile: no pod hang either.
        os.kill(old, signal.SIGSTOP)
        ids = conv.submit(eng, 3)
        wait_for(lambda: _masters(eng, "pool_waiting") == CONVS, what="6 loads waiting")
        wait_for(lambda: eng.pool.counters["pool_server_restarts"] == 1, what="the restart")
        conv.collect(eng, ids)
        wait_for(lambda: _masters(eng, "pool_load_fallbacks") == CONVS,
                 what="the 6 loads in flight at the kill fallen back")  # fmt: skip
        assert eng.pool.handle.pid != old and proc_state(old) in ("", "Z", "X")
        # the new server is up once its inventory is in the index: turn 3's stores offered
        # before that were dropped (turn 4 finds those in its die-local cache only)
        wait_for(lambda: eng.pool.index.stats()["down"] == [], what="the new server's inventory")
        landed = eng.pool.counters["pool_landed_blocks"]
        for r in range(4, TURNS):  # stored by the new server, then loaded
            outs = conv.turn(eng, r)
            if r == 4:
                local = [n - PARAMS.max_tokens - BS for n in _previous(outs)]
                assert all(h in (a, b) for h, a, b in zip(_hits(outs), local, _previous(outs),
                                                          strict=True)), outs  # fmt: skip
            else:
                assert _hits(outs) == _previous(outs), outs
        assert eng.pool.counters["pool_landed_blocks"] > landed
        rel = eng.reliability()
        pool = eng.pool.stats()
    finally:
        eng.close()
    assert conv.outs == reference  # every token as computed without the pool
    assert pool["pool_server_deaths"] == 1 and pool["pool_server_restarts"] == 1, pool
    assert pool["pool_load_failed"] == CONVS, pool  # the shell's count of the same fallbacks
    c = rel["counts"]
    assert c["injected"] == c["verified"] == {"kill-pool": 1}, c
    assert _but_benign(c["detected"]) == {"pool_exit": 1}, c
    assert _but_benign(c["recovered"]) == {"pool_restart": 1}, c
    assert rel["gen"] == 0, rel  # the pod never restarted
    led = rel["ledger"]
    assert led["token_gaps"] == 0 and led["failed"] == 0, led
    assert led["accepted"] == led["ended"] == CONVS * TURNS, led
    events = _log(tmp_path)
    fault = f"kill:pool=0,at={FAULT_AT_S:g}s"
    (inj,) = [e for e in events if e["event"] == "injected"]
    assert inj["fault"] == fault and inj["target"] == "pool" and inj["pid"] == old, inj
    (det,) = [e for e in events if e["event"] == "detected" and e["kind"] == "pool_exit"]
    assert det["fault"] == fault and det["detect_s"] >= 0, det
    (rec,) = [e for e in events if e["event"] == "recovered" and e["tier"] != "rollback"]
    assert rec["tier"] == "pool_restart" and rec["fault"] == fault, rec


@pytest.mark.timeout(90)
def test_a_stopped_pool_server_times_its_loads_out_then_serves_again(reference, tmp_path):
    conv = Conversations()
    # a kill long after the end: reported as not fired, with why
    plan = f"stop:pool=0,at={FAULT_AT_S:g}s,for=3s; kill:pool=0,at=900s"
    eng = _pool_engine(tmp_path, plan, load_timeout_s=0.3)
    try:
        _before_the_fault(eng, conv)
        wait_for(lambda: eng.supervisor.fired, what="the stop")
        (stop,) = eng.supervisor.fired
        assert stop.verified, stop.detail
        conv.turn(eng, 3)  # within the 3 s stop: each load times out after 0.3 s
        fallbacks = _masters(eng, "pool_load_fallbacks")
        assert fallbacks == CONVS, (fallbacks, stop.resumed_at)
        wait_for(lambda: stop.resumed_at, what="the plan's SIGCONT")
        # the late completions free the quarantined blocks, the stores end: nothing held
        wait_for(lambda: _masters(eng, "pool_quarantined") == 0
                 and _masters(eng, "pool_holds") == 0 and _masters(eng, "pool_waiting") == 0
                 and not eng.pool.stores,
                 what="quarantines and holds released")  # fmt: skip
        landed = eng.pool.counters["pool_landed_blocks"]
        for r in range(4, TURNS):
            outs = conv.turn(eng, r)
            assert _hits(outs) == _previous(outs), outs
        assert eng.pool.counters["pool_landed_blocks"] > landed
        rel = eng.reliability()
        pool = eng.pool.stats()
    finally:
        eng.close()
    assert conv.outs == reference
    assert pool["pool_server_deaths"] == 0 and pool["index_writing"] == 0, pool
    c = rel["counts"]
    assert c["injected"] == c["verified"] == {"stop-pool": 1}, c
    # no hang of the pod (no stall, heartbeat or restart) while its loads waited
    assert _but_benign(c["detected"]) == {} and _but_benign(c["recovered"]) == {}, c
    assert rel["gen"] == 0 and rel["ledger"]["token_gaps"] == 0, rel
    ((f, why),) = eng.not_fired
    assert f.text == "kill:pool=0,at=900s" and "after the end" in why, why
    (nf,) = [e for e in _log(tmp_path) if e["event"] == "not_fired"]
    assert nf["target"] == "pool" and "after the end" in nf["reason"], nf


@pytest.mark.timeout(150)
def test_bench_chaos_kills_and_stops_the_pool_under_conversations(tmp_path):
    out = tmp_path / "chaos.json"
    cmd = [sys.executable, "-m", "runtime.cli", "bench", "chaos", "--dies", "2", "--model",
           "tiny", "--kv-pool", "--pool-dram-mib", "1", "--pool-ssd-mib", "16",
           "--dataset", "multi-turn", "--mt-turns", "3", "--max-tokens", "16",
           "--request-rate", "8", "--duration", "6", "--batch-invariant",
           # from the engine's launch: the kill's restart takes ms, the stop ends at 5.5 s,
           # before the 6 s of conversations (which start once the server is up) are over
           "--inject", "kill:pool=0,at=2s; stop:pool=0,at=4s,for=1.5s",
           "--op-timeout", "2", "--stall-timeout", "3",  # margin for a busy host
           "--json", str(out)]  # fmt: skip
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=140)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads(out.read_text().splitlines()[-1])
    assert s["requests_sent"] == s["requests_completed"] == s["requests_accepted"] > 0, s
    assert s["requests_lost"] == s["token_gaps_server"] == s["streams_differing"] == 0, s
    assert s["faults_injected"] == s["faults_verified"] == 2 and s["leaks"] == [], s
    assert s["pool_kills"] == s["pool_stops"] == s["pool_restarts"] == 1, s
    assert s["pool_restarts_server"] == 1 and s["fallbacks"] >= 0, s  # from /metrics
    (row,) = s["pool_recoveries"]
    assert row["fault"] == "kill:pool=0,at=2s" and row["restart_s"] >= 0, row
    assert "hit_rate_recovery_s" in row and "pool_kills" in r.stdout, r.stdout


@pytest.mark.parametrize(
    "plan, pool, match",
    [
        ("kill:pool=0,at=1s", False, "no KV pool"),
        ("stop:pool=0,at=1s,for=1s", False, "no KV pool"),
        ("kill:pool=5,at=1s", True, r"pool=5: must be an index in \[0, 1\)"),
        ("kill:pool=0,step=3", True, "at=T only"),
        ("kill:pool=0,at=1s,gen=1", True, "at=T only"),
        ("kvfault:pool=0,at=1s", True, "killed or stopped"),
        ("err:pool=0,at=1s", True, "killed or stopped"),
    ],
)
def test_bad_pool_plans_are_refused_clearly(plan, pool, match):
    with pytest.raises(FaultSpecError, match=match):
        parse_faults(plan, 2, pool_servers=int(pool))
    kv_pool = PoolConfig(dram_mib=4) if pool else None
    with pytest.raises(ConfigError, match="inject: .*" + match):
        EngineConfig(**TINY, kv_pool=kv_pool, inject=plan)
