"""The KV pool over hosts (`--hosts`, issue 33 "one per host", KVPOOL.md §4.9): one pool server
per host, a die's blocks stored on its host's server, a hit on another host's server fetched
over TCP by the die's master (runtime.engine.pool_peer), a load mixing home and fetched blocks,
and a stopped remote server costing its fetch, never the request.

Two emulated hosts of two dies each (`hosts=(0, 0, 1, 1)`, MPI between them): die 0 and 1 on
host 0 (server 0), dies 2 and 3 on host 1 (server 1). Requests are pinned to a die; waits are
on counters that only grow, finished requests and a stopped process (tests.waiting).
"""

from __future__ import annotations

import os
import signal

import pytest

from runtime.engine import Engine
from runtime.engine.pool_config import PoolConfig
from sched.pool import chain
from tests.integration.test_kv_pool import (
    BS,
    INVARIANT,
    SLOW_OK,
    logits_by_index,
    mstat,
    ok,
    prompt_of,
    pstat,
    run,
    wait_in_pool,
)
from tests.waiting import stopped, wait_for

pytestmark = pytest.mark.timeout(240)

HOSTS = dict(dies=4, hosts=(0, 0, 1, 1), fabric="mpi")
# No supervisor and no iteration rollback (nothing may depend on the machine's speed)
BASE = dict(model="small", timeout_s=60.0, recover=False, rollback=False)


def servers_of(eng: Engine, prompt: list[int]) -> list[int]:
    """The pool server of each block of prompt the index holds (-1: not there)."""
    with eng.lock:
        es = [eng.pool.index.entry(h) for h, _, _ in chain(prompt, BS)]
    return [e.server if e is not None else -1 for e in es]


def test_hits_on_the_other_hosts_server_are_fetched_bit_equal():
    """P1 runs on die 0 (stored on server 0); P2 = P1's 4 blocks + 4 more, on die 2 (host 1):
    the 4 are fetched from server 0, its 4 new ones stored on server 1; P2 on die 1 (host 0,
    cold): a load of 4 home blocks (copied from server 0's mapped tier) and 4 fetched from
    server 1. Batch-invariant: every token and logit equals an engine with no cache at all."""
    p1 = prompt_of(31)
    p2 = prompt_of(32, 8 * BS + 5, p1[: 4 * BS])
    log = dict(log_steps=True, keep_logits=True, model_overrides=INVARIANT)
    with Engine.launch(**BASE, **log, dies=4, prefix_cache=False) as ref:
        r1, r2a = run(ref, [p1], 0)[0], run(ref, [p2], 2)[0]
        (r2b,) = run(ref, [p2], 1)
    want = {k: logits_by_index(ref, r.id) for k, r in (("a", r1), ("b", r2a), ("c", r2b))}

    with Engine.launch(**BASE, **log, **HOSTS, kv_pool=PoolConfig(dram_mib=16, **SLOW_OK)) as eng:
        assert eng.pool.stats()["servers"] == 2
        (a,) = run(eng, [p1], 0)
        wait_in_pool(eng, p1)
        assert servers_of(eng, p1)[:4] == [0] * 4  # die 0's host's server
        (b,) = run(eng, [p2], 2)
        wait_in_pool(eng, p2)
        assert servers_of(eng, p2)[:8] == [0] * 4 + [1] * 4  # die 2's new blocks: server 1
        wait_for(lambda: mstat(eng, 2, "pool_remote_hit_tokens") >= 4 * BS, what="die 2's hit")
        assert mstat(eng, 2, "pool_remote_hit_tokens") == 4 * BS  # fetched from server 0
        (c,) = run(eng, [p2], 1)
        wait_for(lambda: mstat(eng, 1, "pool_hit_tokens") >= 8 * BS, what="die 1's hit")
        assert mstat(eng, 1, "pool_remote_hit_tokens") == 8 * BS  # a load over hosts: mixed
        assert mstat(eng, 1, "pool_fetches") == 1  # one fetch, from server 1
        assert mstat(eng, 1, "pool_fetch_bytes") > 0
        for g in range(4):
            assert mstat(eng, g, "pool_crc_mismatches") == 0
        assert (b.n_cached, c.n_cached) == (4 * BS, 8 * BS)
        assert pstat(eng, "pool_load_failed") == 0
    assert ok([a, b, c]) == [list(r1.out), list(r2a.out), list(r2b.out)]
    for k, t in (("a", a), ("b", b), ("c", c)):
        got = logits_by_index(eng, t.id)
        assert sorted(got) == sorted(want[k])
        for i in want[k]:
            assert (got[i] == want[k][i]).all(), f"request {k} token {i}: logits differ"


def test_a_stopped_remote_server_costs_its_fetch_not_the_request():
    """P on die 0 (server 0); server 0 stopped (SIGSTOP): P's twin on die 2 sends its fetch,
    which cannot be answered; after the load timeout the request recomputes its prefix and
    finishes with the tokens of no pool at all. Resumed, server 0 serves the next fetch (the
    late reply of the first is dropped)."""
    p = prompt_of(41)
    twin = p[: 4 * BS] + prompt_of(42, 5)
    cfg = PoolConfig(dram_mib=16, load_timeout_s=1.0, lease_s=300.0)
    with Engine.launch(**BASE, **HOSTS, kv_pool=cfg) as eng:
        (a,) = run(eng, [p], 0)
        wait_in_pool(eng, p)
        pid = eng.pool.handle_of(0).pid
        with stopped(pid):
            (b,) = run(eng, [twin], 2)  # ends after its fetch timed out (recomputed)
            wait_for(lambda: mstat(eng, 2, "pool_fetches") >= 1, what="die 2's fetch")
        wait_for(lambda: mstat(eng, 2, "pool_load_fallbacks") >= 1, what="the fallback")
        assert mstat(eng, 2, "pool_remote_hit_tokens") == 0 and b.n_cached == 0
        (c,) = run(eng, [p[: 4 * BS] + prompt_of(43, 5)], 3)
        wait_for(lambda: mstat(eng, 3, "pool_remote_hit_tokens") >= 4 * BS, what="die 3's hit")
        assert c.n_cached == 4 * BS
    with Engine.launch(**BASE, dies=4, prefix_cache=False) as ref:
        want = ok(run(ref, [p], 0) + run(ref, [twin], 2))
    assert ok([a, b]) == want


def test_a_killed_server_restarts_and_the_other_host_fetches_from_its_successor():
    """Host 0's server SIGKILLed: its DRAM entries leave the index (no SSD tier), it restarts
    with a new epoch and peer socket; a prompt stored from die 1 afterwards is fetched by die 3
    (host 1) from the successor, and no fetch failed."""
    p = prompt_of(51)
    with Engine.launch(**BASE, **HOSTS, kv_pool=PoolConfig(dram_mib=16, **SLOW_OK)) as eng:
        (a,) = run(eng, [p], 0)
        wait_in_pool(eng, p)
        with eng.lock:
            pid, epoch = eng.pool.handle_of(0).pid, eng.pool.servers[0].epoch
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: pstat(eng, "pool_server_restarts") >= 1, what="server 0's restart")

        def successor_up() -> bool:
            with eng.lock:
                sv = eng.pool.servers[0]
                return sv.epoch > epoch and sv.peer is not None

        wait_for(successor_up, what="server 0's successor's inventory")
        assert servers_of(eng, p)[:4] == [-1] * 4  # its DRAM entries went with it
        q = prompt_of(52)
        (b,) = run(eng, [q], 1)
        wait_in_pool(eng, q)
        assert servers_of(eng, q)[:4] == [0] * 4
        (c,) = run(eng, [q[: 4 * BS] + prompt_of(53, 5)], 3)
        wait_for(lambda: mstat(eng, 3, "pool_remote_hit_tokens") >= 4 * BS, what="die 3's hit")
        assert c.n_cached == 4 * BS and mstat(eng, 3, "pool_fetch_failed") == 0
        ok([a, b, c])


def test_a_server_that_cannot_restart_costs_its_host_only(monkeypatch):
    """Host 1's server killed and its restart failing: that server is off (its host's dies
    store nothing), the pool stays on, and die 2 (host 1) still fetches host 0's blocks."""
    from runtime.engine import pool_shell

    p = prompt_of(81)
    with Engine.launch(**BASE, **HOSTS, kv_pool=PoolConfig(dram_mib=16, **SLOW_OK)) as eng:
        (a,) = run(eng, [p], 0)
        wait_in_pool(eng, p)

        def no_restart(cfg):
            raise OSError("no room for another server")

        monkeypatch.setattr(pool_shell, "start_pool_server", no_restart)
        with eng.lock:
            pid = eng.pool.handle_of(1).pid
        os.kill(pid, signal.SIGKILL)

        def off() -> bool:
            with eng.lock:
                return eng.pool.servers[1].down

        wait_for(off, what="server 1 off after its failed restart")
        with eng.lock:
            assert not eng.pool.down and eng.pool.handle_of(0) is not None
        (b,) = run(eng, [p[: 4 * BS] + prompt_of(82, 5)], 2)
        wait_for(lambda: mstat(eng, 2, "pool_remote_hit_tokens") >= 4 * BS, what="die 2's hit")
        assert b.n_cached == 4 * BS
        ok([a, b])
