"""`xpod bench pool --hosts 2,2`: a KV pool hit held by the die's own host's server against one
held by another host's server (KVPOOL.md §4.9; 000 §4.4's UB plane against the VPC plane,
Fig. 23), with a die-local hit beside them, in one run.

```
xpod bench pool --hosts 2,2 [--model medium] [--max-seq-len 2048] [--prompt-len 1024] \\
    [--reuse 0.25,0.5,0.9] [--prompts 5] [--json F]
```

One engine over emulated hosts (MPI between them, one pool server per host). Per reuse rate r
and repetition (fresh seeded prompts; k = floor(r x L / block_size) shared blocks P):
1. warm: W = P + tail pinned to die A (host 0's first die), 4 output tokens, then a wait until
   the pool stored W's blocks (on host 0's server);
2. measured, one at a time on the idle engine, each after a one-token `prime` of its die:
   - same host: P + tail_s on die S (host 0's second die): a pool hit copied by S's master from
     its host's mapped DRAM tier (`load_ms_same_host`);
   - other host: P + tail_x on die X (host 1's first die): the same hit fetched over TCP from
     host 0's server's peer socket (`load_ms_cross_host`);
   - local: P + tail_l on die X again, whose cache now holds P: a die-local hit (the control
     of TTFT). The order of the first two alternates by repetition.
A load's time is its master's, from the hint's arrival to the request queued with its blocks
landed and crc-checked (the shell's `pool_load_ms_sum`, per request). Figures: p50 / p99 per
path, the cross-host / same-host ratio of the same run, GB/s, TTFTs, and the machine's noise.
"""

from __future__ import annotations

import os
import random
import time

import numpy as np

from bench.common import pct, print_table, progress, run_info, write_json
from bench.pool_requests import ask, prime, ttft
from memory.errors import ConfigError
from runtime.engine import Engine, EngineConfig
from runtime.engine.pool_shell import PoolConfig

WARM_TOKENS = 4
STORE_WAIT_S = 30.0
DEFAULT_REUSE = (0.25, 0.5, 0.9)


def dies_of(hosts: list[int]) -> tuple[int, int, int]:
    """(A, S, X): host 0's first two dies and the first die of another host."""
    h0 = [d for d, h in enumerate(hosts) if h == hosts[0]]
    other = [d for d, h in enumerate(hosts) if h != hosts[0]]
    if len(h0) < 2 or not other:
        raise ConfigError("argument --hosts: the cross-host pool bench needs two dies on the"
                          " first host and one on another (e.g. 2,2 or 2,1)")  # fmt: skip
    return h0[0], h0[1], other[0]


def engine_config(o, hosts: list[int]) -> EngineConfig:
    """No stall detector, rollback deadline or restart (a fault ends the run)."""
    return EngineConfig(
        dies=len(hosts), hosts=tuple(hosts), fabric=o.fabric or "mpi", model=o.model,
        model_overrides={"max_seq_len": o.max_seq_len}, max_num_seqs=2,
        max_num_batched_tokens=o.budget, block_size=o.block_size, prefix_cache=True,
        kv_pool=PoolConfig(dram_mib=o.dram_mib, load_timeout_s=30.0), timeout_s=120.0,
        recover=False, rollback=False,
    )  # fmt: skip


def prompts(o, point: int, rep: int, k: int) -> dict[str, list[int]]:
    rng = random.Random(f"{o.seed}/hosts/{point}/{rep}")
    n, L = k * o.block_size, o.prompt_len
    shared = [rng.randrange(256) for _ in range(n)]
    first = rng.sample(range(256), 4)
    out = {}
    for name, f in zip(("warm", "same", "cross", "local"), first, strict=True):
        tail = [rng.randrange(256) for _ in range(L - n)]
        tail[0] = f  # every tail differs from its first token: nothing shared past P
        out[name] = shared + tail
    return out


def shell(eng: Engine) -> tuple[float, int, int]:
    with eng.lock:
        s = eng.pool.stats()
    return s["pool_load_ms_sum"], s["pool_load_bytes"], s["pool_stored_blocks"]


def wait_stored(eng: Engine, target: int) -> None:
    t0 = time.monotonic()
    while shell(eng)[2] < target:
        if time.monotonic() - t0 > STORE_WAIT_S:
            progress(f"  warning: the pool stored {shell(eng)[2]} of {target} blocks")
            return
        time.sleep(0.002)


def one_rep(o, eng: Engine, dies: tuple[int, int, int], point: int, rep: int, k: int) -> dict:
    a, s, x = dies
    ps = prompts(o, point, rep, k)
    before = shell(eng)[2]
    ask(eng, [ps["warm"]], a, WARM_TOKENS, o.timeout)
    wait_stored(eng, before + o.prompt_len // o.block_size)
    out = {}
    order = [("same", s), ("cross", x)][:: 1 if rep % 2 == 0 else -1] + [("local", x)]
    for i, (name, die) in enumerate(order):
        prime(o, eng, die, point, rep, i)
        c0 = shell(eng)
        t = ask(eng, [ps[name]], die, 1, o.timeout)[0]
        c1 = shell(eng)
        out[name] = ttft(t) * 1e3
        out[f"{name}_cached"] = t.n_cached
        out[f"{name}_load_ms"] = c1[0] - c0[0]
        out[f"{name}_load_bytes"] = c1[1] - c0[1]
    return out


def summarize(r: float, k: int, reps: list[dict], block_size: int) -> dict:
    row = {"reuse": r, "reuse_blocks": k, "hit_expected": k * block_size}
    for name in ("same", "cross", "local"):
        ms = [x[name] for x in reps]
        row[f"ttft_ms_{name}"], row[f"ttft_ms_{name}_p99"] = pct(ms, 50), pct(ms, 99)
        row[f"cached_tokens_{name}"] = int(np.median([x[f"{name}_cached"] for x in reps]))
    for name, key in (("same", "same_host"), ("cross", "cross_host")):
        loads = [x[f"{name}_load_ms"] for x in reps]
        nbytes = int(np.median([x[f"{name}_load_bytes"] for x in reps]))
        p50 = pct(loads, 50)
        row.update({f"load_ms_{key}": p50, f"load_ms_{key}_p99": pct(loads, 99),
                    f"load_bytes_{key}": nbytes,
                    f"load_gbps_{key}": nbytes / (p50 * 1e6) if p50 else None})  # fmt: skip
    same, cross = row["load_ms_same_host"], row["load_ms_cross_host"]
    row["cross_over_same_load"] = cross / same if same else None
    row["cross_over_same_load_paired"] = (
        float(np.median([x["cross_load_ms"] / x["same_load_ms"] for x in reps]))
        if all(x["same_load_ms"] for x in reps) else None)  # fmt: skip
    row["cross_minus_same_ttft_ms"] = float(np.median([x["cross"] - x["same"] for x in reps]))
    row["cross_minus_local_ttft_ms"] = float(np.median([x["cross"] - x["local"] for x in reps]))
    row["samples"] = reps
    return row


COLUMNS = [
    ("reuse", "r", "g"), ("cached_tokens_cross", "hit tok", "d"),
    ("load_ms_same_host", "same-host load ms", ".2f"), ("load_ms_same_host_p99", "p99", ".2f"),
    ("load_ms_cross_host", "cross-host load ms", ".2f"), ("load_ms_cross_host_p99", "p99", ".2f"),
    ("cross_over_same_load", "cross/same", ".2f"), ("load_gbps_same_host", "same GB/s", ".2f"),
    ("load_gbps_cross_host", "cross GB/s", ".2f"), ("ttft_ms_same", "TTFT same ms", ".0f"),
    ("ttft_ms_cross", "TTFT cross ms", ".0f"), ("ttft_ms_local", "TTFT local ms", ".0f"),
]  # fmt: skip


def run(o, hosts: list[int], spec: str) -> int:
    dies = dies_of(hosts)
    bs, L = o.block_size, o.prompt_len
    reuse = [r for r in o.reuse if r > 0] or list(DEFAULT_REUSE)
    progress(f"xpod bench pool --hosts {spec}: model {o.model}, prompt {L} tokens, r ="
             f" {', '.join(f'{r:g}' for r in reuse)}, {o.prompts} prompts per r; warm on die"
             f" {dies[0]}, same host die {dies[1]}, other host die {dies[2]}")  # fmt: skip
    load0, t0 = os.getloadavg(), time.monotonic()
    rows, bad = [], []
    with Engine.launch(engine_config(o, hosts)) as eng:
        for i, r in enumerate(reuse):
            k = int(r * L // bs)
            reps = []
            for rep in range(o.prompts):
                x = one_rep(o, eng, dies, i, rep, k)
                reps.append(x)
                progress(f"  r={r:g} {rep + 1}/{o.prompts}: load same host"
                         f" {x['same_load_ms']:.2f} ms, other host {x['cross_load_ms']:.2f} ms;"
                         f" TTFT same {x['same']:.0f}, cross {x['cross']:.0f}, local"
                         f" {x['local']:.0f} ms")  # fmt: skip
                if (x["same_cached"], x["cross_cached"]) != (k * bs, k * bs):
                    bad.append((r, rep, x["same_cached"], x["cross_cached"]))
            rows.append(summarize(r, k, reps, bs))
        with eng.lock:
            stats = eng.pool.stats()
        fetch = {g: {key: v for key, v in eng.stats.get(g, {}).items()
                     if key in ("pool_fetches", "pool_fetch_bytes", "pool_fetch_failed",
                                "pool_remote_loads")} for g in range(len(hosts))}  # fmt: skip
    ttfts = [x[n] for row in rows for x in row["samples"] for n in ("same", "cross", "local")]
    res = {
        "bench": "pool-hosts", "model": o.model, "hosts": spec, "fabric": o.fabric or "mpi",
        "prompt_len": L, "block_size": bs, "prompts": o.prompts, "seed": o.seed,
        "die_warm": dies[0], "die_same_host": dies[1], "die_cross_host": dies[2],
        "reuse_sweep": rows, "master_fetch_counters": fetch,
        "pool_stats": {key: v for key, v in stats.items() if isinstance(v, int | float)},
        "noise": {"loadavg_start": list(load0), "loadavg_end": list(os.getloadavg()),
                  "ttft_p99_over_p50_all": pct(ttfts, 99) / pct(ttfts, 50),
                  "host_cores": os.cpu_count()},
        "hit_mismatches": bad, "wall_s": time.monotonic() - t0, **run_info(),
    }  # fmt: skip
    print(
        f"\nKV pool hits by where the blocks are: model {o.model}, hosts {spec}, prompt {L}"
        f" tokens, p50 / p99 over {o.prompts} prompts per r (one run; compare within it)"
    )
    print_table(rows, COLUMNS)
    n = res["noise"]
    print(f"machine noise: TTFT p99 / p50 over every request {n['ttft_p99_over_p50_all']:.2f}x;"
          f" load average {n['loadavg_start'][0]:.2f} -> {n['loadavg_end'][0]:.2f} on"
          f" {n['host_cores']} cores")  # fmt: skip
    if o.json:
        write_json(o.json, res)
    if bad:
        progress(f"  hits short of the shared prefix (r, rep, same, cross): {bad}")
    return 1 if bad else 0


__all__ = ["dies_of", "run"]
