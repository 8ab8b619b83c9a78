"""`xpod bench pool --pd 1,1`: a PD pod's decode die loading the pooled prefix itself (the KV
link then carries the rest of the prompt) against the link carrying the whole prompt
(`--pool-decode-load on|off`; KVPOOL.md §4.9 v2), in one run.

```
xpod bench pool --pd 1,1 [--model medium] [--max-seq-len 2048] [--prompt-len 1024] \\
    [--reuse 0.5,0.9] [--prompts 5] [--json F]
```

Two PD engines side by side with the same settings but `decode_load` (on / off), idle while the
other works. Per reuse rate r and repetition (fresh seeded prompts, k = floor(r x L /
block_size) shared blocks P), on each engine in turn (the order alternates by repetition): a
warm request W = P + tail (4 tokens; its blocks stored in the pool, waited for), then the
measured M = P + another tail, 2 output tokens, unpinned (the PD router's pair). Per request:
the bytes the KV link moved (the decode masters' `pd_links`, exact), the link's transfer time,
the decode die's pool copy (bytes, ms) and TTFT (to the first token the client gets, after
the transfer). Figures: p50 / p99 per engine, on / off ratios of the same run.
"""

from __future__ import annotations

import os
import random
import time

import numpy as np

from bench.common import pct, print_table, progress, run_info, write_json
from runtime.engine import Engine, EngineConfig, EngineError, SamplingParams
from runtime.engine.pool_shell import PoolConfig

WARM_TOKENS = 4
STORE_WAIT_S = 30.0


def engine_config(o, pd: tuple[int, int], decode_load: bool) -> EngineConfig:
    """No stall detector, rollback deadline or restart (a fault ends the run)."""
    return EngineConfig(
        dies=sum(pd), prefill_dies=pd[0], decode_dies=pd[1], model=o.model,
        model_overrides={"max_seq_len": o.max_seq_len}, max_num_seqs=2,
        max_num_batched_tokens=o.budget, block_size=o.block_size, prefix_cache=True,
        kv_pool=PoolConfig(dram_mib=o.dram_mib, load_timeout_s=30.0, decode_load=decode_load),
        timeout_s=120.0, recover=False, rollback=False,
    )  # fmt: skip


def ask(eng: Engine, prompt: list[int], max_tokens: int, timeout: float):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t = eng.tracker.track(prompt, params)  # unpinned: the PD router's pair
    eng.tracker.enqueue([t])
    if not t.done.wait(timeout):
        raise EngineError(f"request {t.id}: no answer within {timeout:g} s")
    if t.reason == "error" or not t.t_first:
        raise EngineError(f"request {t.id} failed: {t.error or t.reason}")
    return t


def decode_counters(eng: Engine, groups: list[int], after: float) -> dict[str, float]:
    """The decode masters' link and pool-copy totals, from stats sent after `after`."""
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        if all(eng.stats.get(g, {}).get("t", 0.0) >= after for g in groups):
            break
        time.sleep(0.01)
    out = {"link_bytes": 0, "link_ns": 0, "decode_bytes": 0, "decode_ns": 0, "skipped": 0}
    for g in groups:
        s = eng.stats.get(g, {})
        for link in (s.get("pd_links") or {}).values():
            out["link_bytes"] += link["bytes"]
            out["link_ns"] += link["ns"]
        out["decode_bytes"] += s.get("pool_decode_bytes", 0)
        out["decode_ns"] += s.get("pool_decode_ns", 0)
        out["skipped"] += s.get("pd_skipped_blocks", 0)
    return out


def stored(eng: Engine) -> int:
    with eng.lock:
        return eng.pool.stats()["pool_stored_blocks"]


def one(o, eng: Engine, decode: list[int], ps: dict) -> dict:
    before = stored(eng)
    ask(eng, ps["warm"], WARM_TOKENS, o.timeout)
    t0 = time.monotonic()
    while stored(eng) < before + o.prompt_len // o.block_size:
        if time.monotonic() - t0 > STORE_WAIT_S:
            progress("  warning: the warm request's blocks were not all stored")
            break
        time.sleep(0.002)
    c0 = decode_counters(eng, decode, time.time())
    t = ask(eng, ps["measured"], 2, o.timeout)
    c1 = decode_counters(eng, decode, time.time())
    d = {k: c1[k] - c0[k] for k in c0}
    return {"ttft_ms": (t.t_first - t.t0) * 1e3, "link_bytes": d["link_bytes"],
            "link_ms": d["link_ns"] / 1e6, "decode_load_bytes": d["decode_bytes"],
            "decode_load_ms": d["decode_ns"] / 1e6, "skipped_blocks": d["skipped"]}  # fmt: skip


def run(o, pd: tuple[int, int]) -> int:
    bs, L = o.block_size, o.prompt_len
    reuse = [r for r in o.reuse if r > 0] or [0.5, 0.9]
    decode = list(range(pd[0], sum(pd)))
    progress(f"xpod bench pool --pd {pd[0]},{pd[1]}: model {o.model}, prompt {L} tokens, r ="
             f" {', '.join(f'{r:g}' for r in reuse)}, {o.prompts} prompts per r, decode load"
             " on vs off")  # fmt: skip
    load0, t_start = os.getloadavg(), time.monotonic()
    rows, bad = [], []
    with Engine.launch(engine_config(o, pd, True)) as on, \
            Engine.launch(engine_config(o, pd, False)) as off:  # fmt: skip
        for i, r in enumerate(reuse):
            k = int(r * L // bs)
            reps = []
            for rep in range(o.prompts):
                rng = random.Random(f"{o.seed}/pd/{i}/{rep}")
                shared = [rng.randrange(256) for _ in range(k * bs)]
                x = {}
                for name, eng in [("on", on), ("off", off)][:: 1 if rep % 2 == 0 else -1]:
                    tails = [[rng.randrange(256) for _ in range(L - k * bs)] for _ in range(2)]
                    tails[0][0], tails[1][0] = 1, 2  # nothing shared past P
                    x[name] = one(
                        o, eng, decode, {"warm": shared + tails[0], "measured": shared + tails[1]}
                    )
                reps.append(x)
                if x["on"]["skipped_blocks"] != k:
                    bad.append((r, rep, x["on"]["skipped_blocks"]))
                a, b = x["on"], x["off"]
                progress(f"  r={r:g} {rep + 1}/{o.prompts}: link on {a['link_bytes'] / 1e6:.2f}"
                         f" MB / off {b['link_bytes'] / 1e6:.2f} MB; TTFT on"
                         f" {a['ttft_ms']:.0f} / off {b['ttft_ms']:.0f} ms")  # fmt: skip
            row = {"reuse": r, "reuse_blocks": k}
            for name in ("on", "off"):
                for key in ("ttft_ms", "link_bytes", "link_ms", "decode_load_ms"):
                    xs = [x[name][key] for x in reps]
                    row[f"{key}_{name}"], row[f"{key}_{name}_p99"] = pct(xs, 50), pct(xs, 99)
            row["link_bytes_ratio"] = row["link_bytes_on"] / row["link_bytes_off"]
            row["ttft_ratio_paired"] = float(np.median([x["on"]["ttft_ms"] / x["off"]["ttft_ms"]
                                                        for x in reps]))  # fmt: skip
            row["samples"] = reps
            rows.append(row)
    res = {"bench": "pool-pd", "model": o.model, "pd": list(pd), "prompt_len": L,
           "block_size": bs, "prompts": o.prompts, "seed": o.seed, "reuse_sweep": rows,
           "skip_mismatches": bad, "noise": {"loadavg_start": list(load0),
                                             "loadavg_end": list(os.getloadavg()),
                                             "host_cores": os.cpu_count()},
           "wall_s": time.monotonic() - t_start, **run_info()}  # fmt: skip
    print(f"\nPD: the decode die loading the pooled prefix (on) against the KV link carrying"
          f" the whole prompt (off): model {o.model}, prompt {L} tokens, p50 over {o.prompts}"
          " prompts per r (one run; compare within it)")  # fmt: skip
    print_table(rows, COLUMNS)
    if o.json:
        write_json(o.json, res)
    if bad:
        progress(f"  decode loads short of the shared prefix (r, rep, blocks): {bad}")
    return 1 if bad else 0


COLUMNS = [
    ("reuse", "r", "g"), ("link_bytes_off", "link B off", ".0f"),
    ("link_bytes_on", "link B on", ".0f"), ("link_bytes_ratio", "on/off", ".3f"),
    ("link_ms_off", "link ms off", ".2f"), ("link_ms_on", "link ms on", ".2f"),
    ("decode_load_ms_on", "decode load ms", ".2f"), ("ttft_ms_off", "TTFT off", ".0f"),
    ("ttft_ms_off_p99", "p99", ".0f"), ("ttft_ms_on", "TTFT on", ".0f"),
    ("ttft_ms_on_p99", "p99", ".0f"), ("ttft_ratio_paired", "on/off paired", ".3f"),
]  # fmt: skip


__all__ = ["run"]
