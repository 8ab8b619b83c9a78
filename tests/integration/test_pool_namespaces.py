"""KV-pool namespaces end to end (a request's cache salt, vLLM's `cache_salt`): the salt roots
every prefix-cache hash of its request (`sched.pool_types.ns_root`), so requests of different
salts never share cached KV, die-local or pooled; a namespace's quota (`PoolConfig.quotas`)
bounds what it stores; and the OpenAI usage reports `prompt_tokens_details.cached_tokens`.

The engines are 2 dies of the small model in batch-invariant mode (a hit gives the tokens of a
computed prompt), requests pinned to a die (`group`); stores are asynchronous, so a test waits
for them in the pool's index. The first tests need no process (the pieces the salt goes
through); the HTTP test launches `xpod serve` (`ServerProc` checks nothing is left behind).
"""

from __future__ import annotations

import json
import random

import pytest

from memory import pool_layout as P
from runtime.api.protocol import APIError, ModelInfo, chat_prompt, parse_chat, parse_completion
from runtime.engine import Engine
from runtime.engine.output import OutputHandler
from runtime.engine.pool_config import PoolConfig
from runtime.engine.replay import replay_engine
from runtime.engine.tracker import TrackedRequest
from runtime.model import ModelConfig, encode
from sched import KVManager, LoadBalancer, Request, SamplingParams, Scheduler, SchedulerConfig
from sched.pool import chain, ns_root
from tests.integration.test_api_server import ServerProc, metric, settle, sse_events
from tests.waiting import wait_for

BS = 16
BASE = dict(dies=2, model="small", timeout_s=30.0, recover=False, rollback=False,
            model_overrides={"batch_invariant": True})  # fmt: skip
SLOW_OK = dict(load_timeout_s=300.0, lease_s=300.0)  # no fallback on a slow machine
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
MODEL = ModelConfig.preset("small")


def prompt_of(seed: int, n: int = 4 * BS + 5) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 256) for _ in range(n)]


def run(eng: Engine, prompt: list[int], group: int, ns: str | None) -> TrackedRequest:
    """One request pinned to `group` in namespace ns, finished (to its length)."""
    t = eng.tracker.track(prompt, GREEDY, group=group, ns=ns)
    eng.tracker.enqueue([t])
    assert t.done.wait(60), f"request {t.id} did not finish"
    assert t.reason == "length", (t.id, t.reason, t.error)
    return t


def pstat(eng: Engine, key: str):
    with eng.lock:
        return eng.pool.stats()[key]


def entries(eng: Engine, prompt: list[int], ns: str | None) -> list:
    """The index's entries of the prompt's full blocks in namespace ns (None: not there)."""
    with eng.lock:
        return [eng.pool.index.entry(h) for h, _, _ in chain(prompt, BS, ns)]


def wait_in_pool(eng: Engine, prompt: list[int], ns: str | None, n: int | None = None) -> None:
    """Until the first n (all) full blocks of the prompt in ns are complete and no store is
    in flight."""

    def there() -> bool:
        es = entries(eng, prompt, ns)[:n]
        with eng.lock:
            idle = not eng.pool.stores
        return idle and all(e is not None and e.state == "complete" for e in es)

    wait_for(there, what=f"the prompt's blocks in the pool (ns {ns!r})")


# -- the pieces the salt goes through (no process) -------------------------------------------------


def test_the_scheduler_salts_the_die_local_cache():
    """Two requests of one prompt: the same ns hits the first's blocks, another ns (or none)
    does not; the blocks it registers are the pool's keys of that ns."""
    kv = KVManager(64, BS)
    s = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=512,
                                  max_seq_len=256), kv)  # fmt: skip
    prompt = prompt_of(3)

    def serve(rid: int, ns: str | None) -> Request:
        req = Request(rid, list(prompt), SamplingParams(max_tokens=1, ignore_eos=True), ns=ns)
        s.add(req)
        while not req.is_finished:
            plan = s.schedule()
            s.on_result(plan.plan_id, {r.request_id: 7 for r in plan.rows if r.sample})
        return req

    assert serve(0, "a").num_cached == 0
    assert kv.match_by_prefix(prompt, ns_root("a"))[1] == 4 * BS
    assert kv.match_by_prefix(prompt)[1] == 0  # the default namespace's chain is not there
    assert serve(1, None).num_cached == 0 and serve(2, "b").num_cached == 0
    assert serve(3, "a").num_cached == 4 * BS
    for ns in ("a", "b", None):  # each ns's blocks under its own keys, the pool's
        blocks, hit = kv.match_by_prefix(prompt, ns_root(ns))
        assert hit == 4 * BS and len(set(blocks)) == 4
    kv.check()
    with pytest.raises(ValueError, match="ns"):
        s.add(Request(9, [1, 2], SamplingParams(), ns=""))


def test_the_prefix_balancer_keys_by_namespace():
    lb = LoadBalancer(2, 4, 64, BS, policy="prefix")
    prompt = prompt_of(4)
    a = lb.prefix_hashes(prompt, "a")
    assert a == [h for h, _, _ in chain(prompt, BS, "a")]
    assert lb.prefix_hashes(prompt) == [h for h, _, _ in chain(prompt, BS)] != a
    lb.on_dispatch(1, 0, len(prompt), 4, a)
    assert lb.matched(1, a) == 4 and lb.matched(1, lb.prefix_hashes(prompt, "b")) == 0


def test_cached_tokens_in_the_usage():
    """A renderer reports the admitted request's prompt tokens not computed (the master's
    `cached` entry), also when a stop string ends it before its finish record."""
    h = OutputHandler()
    spec = {"kind": "completion", "stream": True, "include_usage": True, "stop": ["z"]}
    h.open(1, spec, 40)
    h.open(2, {"kind": "chat", "stream": False}, 30)
    out, stops = h.process({"deltas": [[1, 0, encode("abz", bos=False)]], "done": [],
                            "cached": [[1, 32]]})  # fmt: skip
    assert stops == [1]
    usage = [json.loads(f[6:]) for f in out["data"][0][2].split(b"\n\n") if f[6:7] == b"{"]
    assert usage[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    out, _ = h.process({"deltas": [[2, 0, encode("ok", bos=False)]],
                        "done": [[2, "length", 30, 16, "", 0.0, 0.0]]})  # fmt: skip
    body = json.loads(out["data"][-1][2])  # from the finish record (no `cached` entry)
    assert body["usage"]["prompt_tokens"] == 30
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 16}


# -- engines ---------------------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_a_namespace_hits_only_itself():
    """A prompt in ns "a" computed on die 0 is a pool hit for "a" on die 1, but not for "b"
    nor the default namespace, not even on die 0 (its die-local cache is salted too); the
    tokens are the same in every case, and the schedule replay (given the salts) is
    bit-equal, the loaded blocks landed."""
    p = prompt_of(11)
    n = (len(p) - 1) // BS
    log = dict(log_steps=True, keep_logits=True)
    with Engine.launch(**BASE, **log, kv_pool=PoolConfig(dram_mib=16, **SLOW_OK)) as eng:
        for bad in ("", 7, "x" * 257):
            with pytest.raises(ValueError, match="cache salt"):
                eng.tracker.track(p, GREEDY, ns=bad)
        first = run(eng, p, 0, "a")
        assert first.n_cached == 0
        wait_in_pool(eng, p, "a")
        assert all(e is None for e in entries(eng, p, None)), "stored under the default keys"
        hit = run(eng, p, 1, "a")
        assert hit.n_cached == n * BS
        wait_for(lambda: eng.stats.get(1, {}).get("pool_hit_tokens", 0) >= n * BS,
                 what="die 1's pool hit")  # fmt: skip
        other = run(eng, p, 0, "b")  # die 0 holds the prompt's blocks of "a"
        plain = run(eng, p, 0, None)
        assert other.n_cached == 0 and plain.n_cached == 0
        assert len({tuple(t.out) for t in (first, hit, other, plain)}) == 1
        for ns in ("b", None):  # stored in their own namespaces, no collision
            wait_in_pool(eng, p, ns)
        with eng.lock:
            eng.pool.index.check()
            st = eng.pool.stats()
        assert st["index_collisions"] == 0 and st["index_entries"] == 3 * (len(p) // BS), st
        assert st["pool_quota_refused_blocks"] == 0
        assert {e.ns for e in entries(eng, p, "b")} == {"b"}
    assert eng.tracker.namespaces == {first.id: "a", hit.id: "a", other.id: "b"}
    rep = replay_engine(eng.config, eng.step_log, eng.tracker.prompts, eng.tracker.namespaces)
    assert rep.bit_equal, (rep.token_mismatches[:3], rep.logit_mismatches[:3])
    assert rep.pool_landed == n and rep.pool_missing == 0, (rep.pool_landed, rep.pool_missing)


def test_cache_salt_is_parsed():
    model = ModelInfo("xpod-small", MODEL.max_seq_len, MODEL.vocab_size)
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert parse_completion({"prompt": "hi", "cache_salt": "s"}, model).cache_salt == "s"
    assert parse_chat({**chat, "cache_salt": "t"}, model).cache_salt == "t"
    assert parse_completion({"prompt": "hi", "cache_salt": None}, model).cache_salt is None
    for bad in (1, "", "x" * 257, {"a": 1}):
        with pytest.raises(APIError) as e:
            parse_chat({**chat, "cache_salt": bad}, model)
        assert e.value.status == 400 and e.value.param == "cache_salt"


@pytest.mark.timeout(180)
def test_a_quota_bounds_a_namespace():
    """Namespace "q" with a quota of 2 blocks stores 2 of its prompt's 4 (the other 2 skipped
    and counted: the third over the quota, the fourth its child; no request fails); the default
    namespace stores all of its prompt; the next request of "q" on the other die hits the 2
    stored blocks."""
    slot = P.slot_bytes(MODEL.kv_layers, BS, MODEL.kv_cache_dim)
    quota = PoolConfig(dram_mib=16, quotas={"q": 2.5 * slot / (1 << 20)}, **SLOW_OK)
    p, p2 = prompt_of(21), prompt_of(22)
    with Engine.launch(**BASE, kv_pool=quota) as eng:
        assert eng.pool.index.quotas == {"q": 2}
        a = run(eng, p, 0, "q")
        wait_in_pool(eng, p, "q", 2)
        es = entries(eng, p, "q")
        assert [e is not None for e in es] == [True, True, False, False], es
        assert pstat(eng, "pool_quota_refused_blocks") == 2
        run(eng, p2, 0, None)
        wait_in_pool(eng, p2, None)  # the default namespace: no quota
        b = run(eng, p, 1, "q")
        assert b.n_cached == 2 * BS and b.out == a.out
        with eng.lock:
            eng.pool.index.check()  # includes: no namespace over its quota
            st = eng.pool.stats()
        assert st["pool_quota_refused_blocks"] >= 2 and st["index_quota_dropped"] >= 1, st
        assert st["pool_store_failed"] == 0 and st["index_dram_used"] == {0: 2 + len(p2) // BS}


# -- the HTTP API ----------------------------------------------------------------------------------

TEXT = "the salted prompt: every die keeps its own memory, and the pool keeps them all. " * 2


@pytest.mark.timeout(180)
def test_cache_salt_and_cached_tokens_over_http():
    """`cache_salt` reaches the engine (another salt is no hit), a bad one is a 400 and the
    server goes on, and `usage.prompt_tokens_details.cached_tokens` says what was not
    computed: 0 for a fresh prompt, the pool hit for a repeated one (streamed too)."""
    n_prompt = len(encode(TEXT))
    full = (n_prompt - 1) // BS  # the blocks a prefix match may use
    messages = [{"role": "user", "content": TEXT}]
    n_chat = len(encode(chat_prompt(messages))) // BS  # (the warm-up's 1-token prompts: none)
    s = ServerProc("--kv-pool", "--pool-dram-mib", "16", "--lb", "round_robin",
                   "--batch-invariant", "--block-size", str(BS))  # fmt: skip
    try:
        settle(s)

        def complete(salt, stream: bool = False, path: str = "/v1/completions") -> dict:
            body = {"model": "xpod-tiny", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
            if path.endswith("chat/completions"):
                body["messages"] = messages
            else:
                body["prompt"] = TEXT
            if salt is not None:
                body["cache_salt"] = salt
            if stream:
                body.update(stream=True, stream_options={"include_usage": True})
            status, _, data = s.post(path, body)
            assert status == 200, data
            return sse_events(data)[-1]["usage"] if stream else json.loads(data)["usage"]

        def cached(usage: dict) -> int:
            return usage["prompt_tokens_details"]["cached_tokens"]

        def stored() -> float:
            return metric(s.metrics(), "xpod_pool_stored_blocks_total")

        assert cached(complete("s1")) == 0
        wait_for(lambda: stored() >= n_prompt // BS, what="the salted prompt stored")
        again = complete("s1", stream=True)  # the other die: loaded from the pool
        assert cached(again) == full * BS and again["prompt_tokens"] == n_prompt
        assert cached(complete("s2")) == 0  # another salt: no hit on either die
        assert cached(complete(None)) == 0  # nor the default namespace
        for bad, why in ((123, "must be a string"), ("", "1 to 256"), ("x" * 257, "1 to 256"),
                         (["s1"], "must be a string")):  # fmt: skip
            status, _, data = s.post("/v1/completions", {"prompt": TEXT, "cache_salt": bad})
            err = json.loads(data)["error"]
            assert status == 400 and err["param"] == "cache_salt" and why in err["message"], err
        chat = "/v1/chat/completions"
        n = 3 * (n_prompt // BS)  # "s1", "s2" and the default namespace stored it
        assert cached(complete("c", path=chat)) == 0
        wait_for(lambda: stored() >= n + n_chat, what="the chat prompt stored")
        assert cached(complete("c", path=chat)) > 0
        m = settle(s)
        assert metric(m, "xpod_pool_quota_refused_blocks_total") == 0
    finally:
        s.stop()
