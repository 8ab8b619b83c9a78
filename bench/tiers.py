"""`xpod bench tiers`: the KV pool's eviction to the SSD tier and its admission against a scan.

On the real engine: issue 33's eviction figures (KVPOOL.md §4.7, §5.4, E4).

```
xpod bench tiers [--dies 2] [--model small] [--docs 16] [--doc-blocks 4] \\
    [--requests 96] [--scan-blocks 16] [--hot-requests 24] [--json F]
```

Two workloads, each on fresh engines of the same settings, requests one at a time, pinned to
dies in turn (request i on die i mod dies), greedy, 2 output tokens. The dies' own prefix
caches are kept small (`--die-blocks` per die) so a prefix seen on another die, or long ago,
is the pool's to serve.

1. **Eviction.** `--docs` documents of `--doc-blocks` blocks (the working set: docs x blocks);
   each request is a seeded random document + a unique tail of one block and 5 tokens. Run
   twice on the same request sequence: *bounded* (the DRAM tier holds `--dram-fraction` of the
   working set, 1/4 by default, an SSD tier holds all of it) and *unbounded* (DRAM for twice the
   working set, no SSD tier); a third run, the bounded DRAM without the SSD tier, shows what
   the SSD tier is worth. Hit rate = prompt tokens not computed (the die-local cache's and
   the pool's, `TrackedRequest.n_cached`) over the tokens a cache of infinite size could have
   served (the document's blocks, from its second request on). After every request the index
   is scraped: DRAM and SSD use never over capacity, no orphan, `PoolIndex.check()` passes.
   Bar: bounded >= 0.9 x unbounded.
2. **Scan.** A hot system prompt of `--hot-blocks` blocks + a unique tail, every third request;
   between two of them two unique long prompts of `--scan-blocks` blocks each (the scan: each
   larger than half the DRAM tier, which holds `--scan-dram-blocks`). No SSD tier. Run per
   admission policy (`always`, `second_hit`) with the scan and without it (the same hot
   requests, nothing between): the hot requests' hit tokens with the scan over those without
   it is what the hot prompt keeps through the scan. Bar: `second_hit` keeps >= 95 %.

JSON (`--json`): `{"eviction": {working_set_blocks, dram_slots_bounded, ssd_blocks_bounded,
hit_rate_bounded, hit_rate_unbounded, ratio, ok, max_dram_used, max_ssd_used, scrapes, orphans,
promotions, demotions, ...}, "scan": {"always" | "second_hit": {hot_hits_scan, hot_hits_noscan,
kept, ...}, "ok"}, "run": ...}`.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass

from bench.common import progress, run_info
from memory import pool_layout as P
from memory.errors import ConfigError
from runtime.cli.argtypes import int_range, output_file, positive_float, positive_int
from runtime.engine import Engine, EngineConfig, EngineError, SamplingParams
from runtime.engine.pool_config import PoolConfig
from runtime.model import PRESETS, ModelConfig

EVICTION_BAR = 0.9  # bounded hit rate / unbounded
SCAN_BAR = 0.95  # hot hits kept through the scan, second_hit admission
OUT_TOKENS = 2
TAIL = 5  # tokens past the last full block of every prompt


def add_args(p: argparse.ArgumentParser) -> None:
    add = p.add_argument
    add("--dies", type=int_range(2), default=2, help="dies = DP groups, >= 2 (default 2)")
    add("--model", default="small", choices=tuple(PRESETS), help="model preset (default small)")
    add("--block-size", type=positive_int, default=16, help="KV block tokens (default 16)")
    add("--die-blocks", type=positive_int, default=24,
        help="each die's KV blocks: its own prefix cache's room (default 24)")  # fmt: skip
    add("--docs", type=positive_int, default=16, help="eviction: documents (default 16)")
    add("--doc-blocks", type=positive_int, default=4, help="eviction: blocks per document (4)")
    add("--requests", type=positive_int, default=96, help="eviction: requests (default 96)")
    add(
        "--dram-fraction",
        type=positive_float,
        default=0.25,
        help="eviction: the bounded DRAM tier, a fraction of the working set (default 0.25)",
    )
    add("--hot-blocks", type=positive_int, default=8, help="scan: the hot prompt's blocks (8)")
    add("--scan-blocks", type=positive_int, default=16,
        help="scan: blocks of each unique long prompt (default 16)")  # fmt: skip
    add("--scan-dram-blocks", type=positive_int, default=24,
        help="scan: the DRAM tier's slots (default 24)")  # fmt: skip
    add("--hot-requests", type=positive_int, default=24, help="scan: hot requests (default 24)")
    add("--timeout", type=positive_float, default=300.0, help="seconds per request (300)")
    add("--seed", type=int, default=0, help="documents, tails and order (default 0)")
    add("--json", type=output_file, default=None, help="write the figures to FILE (one object)")


@dataclass(frozen=True)
class Options:
    dies: int
    model: str
    block_size: int
    die_blocks: int
    docs: int
    doc_blocks: int
    requests: int
    dram_fraction: float
    hot_blocks: int
    scan_blocks: int
    scan_dram_blocks: int
    hot_requests: int
    timeout: float
    seed: int
    json: str | None


def parse_options(args: argparse.Namespace) -> Options:
    o = Options(**{f: getattr(args, f) for f in Options.__dataclass_fields__})
    longest = max(o.doc_blocks, o.hot_blocks, o.scan_blocks) + 1  # + the tail's block
    need = longest * o.block_size + TAIL + OUT_TOKENS
    ctx = ModelConfig.preset(o.model).max_seq_len
    if need > ctx:
        raise ConfigError(f"argument --doc-blocks/--hot-blocks/--scan-blocks: a prompt of"
                          f" {longest} blocks of {o.block_size} is longer than the model's"
                          f" context of {ctx}")  # fmt: skip
    if o.die_blocks < longest + 1:
        raise ConfigError(f"argument --die-blocks: {o.die_blocks} blocks cannot hold a context"
                          f" of {longest + 1} blocks")  # fmt: skip
    if o.dram_fraction >= 1:
        raise ConfigError(f"argument --dram-fraction: {o.dram_fraction:g} must be < 1")
    if o.scan_dram_blocks < o.hot_blocks + 1:
        raise ConfigError(f"argument --scan-dram-blocks: {o.scan_dram_blocks} slots cannot hold"
                          f" the hot prompt's {o.hot_blocks} blocks and a tail")  # fmt: skip
    return o


def slot_mib(o: Options, slots: int) -> float:
    """The DRAM (or SSD) MiB that hold exactly `slots` blocks (`P.slots_for` inverts it)."""
    m = ModelConfig.preset(o.model)
    return (slots * P.slot_bytes(m.kv_layers, o.block_size, m.kv_cache_dim)
            + P.HEADER_BYTES) / P.MiB  # fmt: skip


def config(o: Options, pool: PoolConfig) -> EngineConfig:
    """Small die caches, a pool, no stall detector (a slow machine is not a fault here)."""
    ctx = (max(o.doc_blocks, o.hot_blocks, o.scan_blocks) + 2) * o.block_size
    return EngineConfig(dies=o.dies, model=o.model, block_size=o.block_size,
                        model_overrides={"max_seq_len": ctx},
                        num_blocks=o.die_blocks, max_num_seqs=2, kv_pool=pool, timeout_s=120.0,
                        recover=False, rollback=False)  # fmt: skip


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 256) for _ in range(n)]


def ask(eng: Engine, prompt: list[int], die: int, timeout: float):
    params = SamplingParams(max_tokens=OUT_TOKENS, temperature=0.0, ignore_eos=True)
    t = eng.tracker.track(prompt, params, group=die)
    eng.tracker.enqueue([t])
    if not t.done.wait(timeout) or t.reason != "length":
        raise EngineError(f"request {t.id} on die {die}: {t.error or t.reason or 'no answer'}")
    return t


def settle(eng: Engine, timeout: float = 30.0) -> None:
    """Every store ordered so far answered (a request's blocks reach the pool after it ends)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with eng.lock:
            if not eng.pool.stores and not eng.pool.index.stats()["writing"]:
                return
        time.sleep(0.002)
    progress("  warning: stores still in flight after 30 s")


def scrape(eng: Engine, cap: dict, seen: dict) -> None:
    """The index against its capacity, after a request (`PoolIndex.check()`: every invariant)."""
    with eng.lock:
        eng.pool.index.check()
        st = eng.pool.index.stats()
    dram, ssd = sum(st["dram_used"].values()), sum(st["ssd_used"].values())
    if dram > cap["dram"] or (cap["ssd"] is not None and ssd > cap["ssd"]):
        raise EngineError(f"the pool over capacity: DRAM {dram} of {cap['dram']}, SSD {ssd} of"
                          f" {cap['ssd']}")  # fmt: skip
    seen["max_dram_used"] = max(seen.get("max_dram_used", 0), dram)
    seen["max_ssd_used"] = max(seen.get("max_ssd_used", 0), ssd)
    seen["orphans"] = max(seen.get("orphans", 0), st["orphans"])
    seen["scrapes"] = seen.get("scrapes", 0) + 1
    for k in ("promotions", "demotions", "evictions"):
        if k in st:
            seen[k] = st[k]


# -- 1. eviction --------------------------------------------------------------------------------


def eviction_trace(o: Options) -> list[tuple[int, list[int]]]:
    """(document, prompt) per request: a seeded document + a unique tail."""
    rng = random.Random(f"{o.seed}/eviction")
    bs = o.block_size
    docs = [tokens(rng, o.doc_blocks * bs) for _ in range(o.docs)]
    out = []
    for _ in range(o.requests):
        d = rng.randrange(o.docs)
        out.append((d, docs[d] + tokens(rng, bs + TAIL)))
    return out


def eviction_run(o: Options, trace: list, pool: PoolConfig, cap: dict, label: str) -> dict:
    seen: dict = {}
    cached = 0
    with Engine.launch(config(o, pool)) as eng:
        for i, (_, prompt) in enumerate(trace):
            t = ask(eng, prompt, i % o.dies, o.timeout)
            cached += t.n_cached
            settle(eng)
            scrape(eng, cap, seen)
            if (i + 1) % 16 == 0:
                progress(f"  {label}: {i + 1}/{len(trace)} requests, {cached} tokens cached")
    return {"cached_tokens": cached, **seen}


def eviction(o: Options) -> dict:
    trace = eviction_trace(o)
    bs, ws = o.block_size, o.docs * o.doc_blocks
    ideal, first = 0, set()
    for d, _ in trace:
        if d in first:
            ideal += o.doc_blocks * bs
        first.add(d)
    small = max(1, int(ws * o.dram_fraction))
    bounded = PoolConfig(dram_mib=slot_mib(o, small), ssd_mib=slot_mib(o, 2 * ws) - slot_mib(o, 0),
                         load_timeout_s=300.0, lease_s=300.0)  # fmt: skip
    unbounded = PoolConfig(dram_mib=slot_mib(o, 2 * ws), load_timeout_s=300.0, lease_s=300.0)
    progress(
        f"eviction: {o.docs} documents x {o.doc_blocks} blocks = {ws} blocks, {o.requests}"
        f" requests; bounded DRAM {small} slots + SSD, unbounded DRAM {2 * ws} slots"
    )
    dram_only = PoolConfig(dram_mib=slot_mib(o, small), load_timeout_s=300.0, lease_s=300.0)
    b = eviction_run(o, trace, bounded, {"dram": small, "ssd": 2 * ws}, "bounded")
    d = eviction_run(o, trace, dram_only, {"dram": small, "ssd": None}, "bounded, no SSD")
    u = eviction_run(o, trace, unbounded, {"dram": 2 * ws, "ssd": None}, "unbounded")
    hb, hu = b["cached_tokens"] / ideal, u["cached_tokens"] / ideal
    ratio = hb / hu if hu else None
    return {"working_set_blocks": ws, "requests": o.requests, "ideal_tokens": ideal,
            "dram_slots_bounded": small, "ssd_blocks_bounded": 2 * ws,
            "dram_slots_unbounded": 2 * ws, "hit_rate_bounded": hb, "hit_rate_unbounded": hu,
            "ratio": ratio, "bar": EVICTION_BAR,
            "ok": None if ratio is None else ratio >= EVICTION_BAR,
            "hit_rate_dram_only": d["cached_tokens"] / ideal,
            "bounded": b, "unbounded": u, "dram_only": d}  # fmt: skip


# -- 2. scan ------------------------------------------------------------------------------------


def scan_trace(o: Options, scan: bool) -> list[tuple[bool, list[int]]]:
    """(hot?, prompt): the hot prompt + a unique tail, then (with the scan) two unique long
    prompts, `--hot-requests` times. The same hot requests with and without the scan."""
    rng = random.Random(f"{o.seed}/scan")
    bs = o.block_size
    hot = tokens(rng, o.hot_blocks * bs)
    out = []
    for i in range(o.hot_requests):
        out.append((True, hot + tokens(random.Random(f"{o.seed}/hot/{i}"), bs + TAIL)))
        if scan:
            for j in range(2):
                srng = random.Random(f"{o.seed}/scan/{i}/{j}")
                out.append((False, tokens(srng, o.scan_blocks * bs + TAIL)))
    return out


def scan_run(o: Options, admit: str, scan: bool) -> dict:
    pool = PoolConfig(dram_mib=slot_mib(o, o.scan_dram_blocks), admit=admit, load_timeout_s=300.0,
                      lease_s=300.0)  # fmt: skip
    seen: dict = {}
    hot_hits = scan_hits = 0
    with Engine.launch(config(o, pool)) as eng:
        for i, (is_hot, prompt) in enumerate(scan_trace(o, scan)):
            t = ask(eng, prompt, i % o.dies, o.timeout)
            if is_hot:
                hot_hits += t.n_cached
            else:
                scan_hits += t.n_cached
            settle(eng)
            scrape(eng, {"dram": o.scan_dram_blocks, "ssd": None}, seen)
    return {"hot_hits": hot_hits, "scan_hits": scan_hits, **seen}


def scans(o: Options) -> dict:
    out: dict = {}
    progress(
        f"scan: a hot prompt of {o.hot_blocks} blocks, {o.hot_requests} times, two unique"
        f" prompts of {o.scan_blocks} blocks between; DRAM {o.scan_dram_blocks} slots"
    )
    for admit in ("always", "second_hit"):
        with_scan = scan_run(o, admit, True)
        without = scan_run(o, admit, False)
        kept = with_scan["hot_hits"] / without["hot_hits"] if without["hot_hits"] else None
        out[admit] = {"hot_hits_scan": with_scan["hot_hits"],
                      "hot_hits_noscan": without["hot_hits"], "kept": kept,
                      "scan": with_scan, "noscan": without}  # fmt: skip
        progress(
            f"  {admit}: the hot prompt's hit tokens {with_scan['hot_hits']} with the scan,"
            f" {without['hot_hits']} without: kept {kept if kept is None else f'{kept:.3f}'}"
        )
    k = out["second_hit"]["kept"]
    out["bar"] = SCAN_BAR
    out["ok"] = None if k is None else k >= SCAN_BAR
    return out


# -- the command --------------------------------------------------------------------------------


def run(o: Options) -> int:
    t0 = time.monotonic()
    res = {"bench": "tiers", "dies": o.dies, "model": o.model, "block_size": o.block_size,
           "die_blocks": o.die_blocks, "seed": o.seed, "eviction": eviction(o),
           "scan": scans(o)}  # fmt: skip
    res["seconds"] = time.monotonic() - t0
    res["run"] = run_info()
    print_report(res)
    if o.json:
        with open(o.json, "w") as f:
            f.write(json.dumps(res) + "\n")
        progress(f"  wrote {o.json}")
    return 0


def print_report(res: dict) -> None:
    e, s = res["eviction"], res["scan"]
    verdict = {True: "met", False: "NOT met", None: "-"}
    print(
        f"KV pool tiers: model {res['model']}, {res['dies']} dies, {res['die_blocks']} blocks"
        f" per die (one run; compare within it)"
    )
    print(
        f"  eviction: DRAM {e['dram_slots_bounded']} slots (of a {e['working_set_blocks']}-"
        f"block working set) + SSD: hit rate {e['hit_rate_bounded']:.3f}; unbounded"
        f" {e['hit_rate_unbounded']:.3f}; ratio {e['ratio']:.3f}, bar {e['bar']:g}:"
        f" {verdict[e['ok']]}; the same DRAM without the SSD tier"
        f" {e['hit_rate_dram_only']:.3f}"
    )
    b = e["bounded"]
    print(f"    max DRAM used {b.get('max_dram_used')} of {e['dram_slots_bounded']}, max SSD used"
          f" {b.get('max_ssd_used')} of {e['ssd_blocks_bounded']}, orphans {b.get('orphans')},"
          f" {b.get('scrapes')} scrapes, promotions {b.get('promotions')}")  # fmt: skip
    for admit in ("always", "second_hit"):
        a = s[admit]
        kept = "-" if a["kept"] is None else f"{a['kept']:.3f}"
        print(f"  scan, {admit}: the hot prompt keeps {kept} of its hits ({a['hot_hits_scan']}"
              f" / {a['hot_hits_noscan']} tokens)")  # fmt: skip
    print(f"  second_hit bar {s['bar']:g}: {verdict[s['ok']]}")


def main(args: argparse.Namespace) -> int:
    return run(parse_options(args))
