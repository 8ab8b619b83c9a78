"""`xpod bench engine`: the serving engine's figures in one run, against `xpod decode`.

```
xpod bench engine --dies 4 --batch 8 [--prompt-len 64] [--steps 64] [--json FILE] [--quick]
xpod bench engine --attention-dies 2 --expert-dies 6 --domains 1,2,3 --microbatches 1,2
```

With --attention-dies, the run is the split pod's instead (`bench.split`): per (domains,
micro-batches) shape, decode and the engine, the expert dies' idle share, the per-role time
shares, and the step model's prediction against the measured step.

Parts, all in one run on the same machine (the machine is shared and noisy: compare only
within a run):
1. baseline: `xpod decode` (the raw fixed-batch loop on the same executor) at the dies, batch
   and lengths;
2. throughput: the engine through its Python client at saturation (`ignore_eos`, fixed lengths,
   `waves x batch` requests submitted at once; the balancer holds the surplus, so the
   concurrency is the batch), with asynchronous execution on, then off; output tokens/s, the
   scheduling bubble (a die's wait for its next command) and the step time, p50 / p99, and the
   CPU seconds of the client (the caller's process), the masters and the dies;
3. idle: the engine left idle for `--idle-s` seconds: CPU of every xpod process together, in %
   of one core;
4. DP balance: `dies` groups, a stream of 12 requests per group (one every 50 ms), prompt and
   output lengths varying +-80 %, least-KV vs round-robin: max/mean KV usage (blocks in use)
   over groups, averaged over time while the requests arrive, and over the whole run;
5. prefix cache: prompts sharing 75 % of their tokens, cache on vs off: hit rate, TTFT p50;
6. schedule replay: a short run with chunked prefill, prefix hits and a tiny KV pool (forced
   preemption) replayed through the single-process reference: tokens and logits bit-equal?

`--json FILE` writes one JSON object with every figure (keys in the table at the end).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass

import numpy as np
import psutil

from bench.common import progress, run_info
from bench.split import check_options, print_split, run_split
from memory.errors import ConfigError
from runtime.cli.argtypes import int_list, nonneg_int, output_file, positive_float, positive_int
from runtime.decode import DecodeOptions, make_prompts, run_decode
from runtime.engine import Engine, EngineConfig
from runtime.engine.replay import replay
from runtime.model import PRESETS
from sched import SamplingParams


@dataclass(frozen=True)
class Options:
    dies: int
    batch: int
    prompt_len: int
    steps: int
    waves: int
    model: str
    idle_s: float
    json: str | None
    repeat: int = 1
    gc_every: int = 0
    pin: str = "auto"
    seed: int = 0
    attention_dies: int = 0  # > 0: the split pod's shapes (bench.split)
    expert_dies: int = 0
    domains: tuple = (1,)
    microbatches: tuple = (1,)
    overrides: dict | None = None
    spec_tokens: tuple = ()  # MTP: the engine with k drafts against without (bench.spec)
    mtp_draft: str = "fit"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dies", type=positive_int, default=4, help="dies = DP groups (default 4)")
    p.add_argument("--batch", type=positive_int, default=8, help="concurrent requests (default 8)")
    p.add_argument("--prompt-len", type=positive_int, default=64, help="prompt tokens")
    p.add_argument("--steps", type=positive_int, default=64, help="output tokens per request")
    p.add_argument("--waves", type=positive_int, default=3, help="requests = waves x batch")
    p.add_argument("--model", default="small", choices=tuple(PRESETS))
    p.add_argument("--idle-s", type=positive_float, default=10.0, help="idle window, seconds")
    p.add_argument("--repeat", type=positive_int, default=3,
                   help="decode / engine throughput pairs, alternating (default 3)")  # fmt: skip
    p.add_argument(
        "--gc-every",
        type=nonneg_int,
        default=0,
        help="0 = automatic GC; N = freeze after warm-up, collect every N steps",
    )
    p.add_argument(
        "--pin",
        default="auto",
        choices=("auto", "on", "off"),
        help="pin dies and masters to cores (default auto)",
    )
    g = p.add_argument_group("MoE-attention disaggregation (bench.split; default colocated)")
    g.add_argument("--attention-dies", type=nonneg_int, default=0, metavar="A",
                   help="run the split pod's shapes instead: A attention dies")  # fmt: skip
    g.add_argument("--expert-dies", type=nonneg_int, default=0, metavar="E",
                   help="expert dies (default: --dies minus A)")  # fmt: skip
    g.add_argument("--domains", type=int_list(1, 16), default=[1, 2], metavar="D,...",
                   help="DP domains to run (default 1,2)")  # fmt: skip
    g.add_argument("--microbatches", type=int_list(1, 2), default=[1], metavar="M,...",
                   help="micro-batches to run (default 1)")  # fmt: skip
    g.add_argument("--experts", type=positive_int, default=None, metavar="N",
                   help="routed experts (default: the preset's; a multiple of E)")  # fmt: skip
    g = p.add_argument_group("multi-token prediction (bench.spec; default: the engine's figures)")
    g.add_argument(
        "--num-speculative-tokens",
        type=int_list(1),
        default=None,
        metavar="K,...",
        help="the engine with K MTP drafts against without, per K (e.g. 1,2)",
    )
    g.add_argument("--mtp-draft", default="fit", metavar="MODE",
                   help="real | fit | oracle | synthetic:P1[,P2] (default fit)")  # fmt: skip
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="every row computed alone (MTP: the tokens of the run without)",
    )
    p.add_argument("--quick", action="store_true", help="short run (CI smoke test)")
    p.add_argument("--json", type=output_file, default=None, help="write the figures to FILE")


def parse_options(args: argparse.Namespace) -> Options:
    steps, waves, idle, repeat = args.steps, args.waves, args.idle_s, args.repeat
    if args.quick:
        steps, waves, idle, repeat = min(steps, 16), 1, min(idle, 1.0), 1
    a, e = args.attention_dies, args.expert_dies
    if a:
        e = e or args.dies - a
        if e < 1:
            raise ConfigError(f"argument --expert-dies: {a} attention dies leave no expert die")
    elif e:
        raise ConfigError("argument --expert-dies: needs --attention-dies")
    overrides = {"num_experts": args.experts} if args.experts else {}
    if args.batch_invariant:
        overrides["batch_invariant"] = True
    spec = tuple(args.num_speculative_tokens or ())
    if spec and a:
        raise ConfigError("argument --num-speculative-tokens: the colocated engine's MTP figures"
                          " (not with --attention-dies)")  # fmt: skip
    opts = Options(a + e if a else args.dies, args.batch, args.prompt_len, steps, waves,
                   args.model, idle, args.json, repeat, args.gc_every, args.pin, 0, a, e,
                   tuple(args.domains), tuple(args.microbatches), overrides, spec,
                   args.mtp_draft)  # fmt: skip
    if spec:
        from runtime.model.mtp import SpecConfig, parse_draft

        name, rates = parse_draft(args.mtp_draft)
        for k in spec:
            try:
                engine_config(opts, async_depth=1, speculative=SpecConfig(k, name, rates))
            except ConfigError as err:
                raise ConfigError(f"argument --num-speculative-tokens/--mtp-draft: {err}") from None
        return opts
    if a:
        try:
            check_options(opts)
        except ConfigError as err:
            raise ConfigError(f"argument --attention-dies/--expert-dies/--experts: {err}") from None
        return opts
    engine_config(opts)  # every check before anything starts (ConfigError names the field)
    return opts


def engine_config(opts: Options, **changes) -> EngineConfig:
    per_group = -(-opts.batch // opts.dies)
    base = dict(dies=opts.dies, model=opts.model, max_num_seqs=per_group,
                model_overrides=dict(opts.overrides or {}),
                max_num_batched_tokens=max(64, 2 * opts.prompt_len), timeout_s=120.0,
                gc_every=opts.gc_every, pin=opts.pin)  # fmt: skip
    return EngineConfig(**{**base, **changes})


# -- measuring ------------------------------------------------------------------------------------


class CpuMeter:
    """CPU seconds of the client (this process), the masters and the dies of an engine."""

    def __init__(self, eng: Engine):
        self.groups = {
            "client": [psutil.Process()],
            "masters": [psutil.Process(p.pid) for p in eng.masters],
            "dies": [psutil.Process(p.pid) for p in eng.pod.procs],
        }
        self.t0, self.c0 = time.monotonic(), self._now()

    def _now(self) -> dict[str, float]:
        return {k: sum(sum(p.cpu_times()[:2]) for p in ps) for k, ps in self.groups.items()}

    def read(self) -> dict[str, float]:
        c1 = self._now()
        wall = time.monotonic() - self.t0
        out = {f"cpu_s_{k}": c1[k] - self.c0[k] for k in c1}
        out["wall_s"] = wall
        return out


def pct(values, q: float) -> float:
    return float(np.percentile(values, q)) if len(values) else 0.0


def final_lists(eng: Engine, key: str) -> list[float]:
    return [v for s in eng.stats.values() for v in s.get(key, [])]


def saturation(opts: Options, async_depth: int, idle_s: float = 0.0) -> dict:
    """Throughput at saturation; with idle_s, the idle CPU afterwards."""
    prompts = make_prompts(opts.waves * opts.batch, opts.prompt_len, opts.seed)
    params = SamplingParams(max_tokens=opts.steps, ignore_eos=True)
    out: dict = {}
    with Engine.launch(engine_config(opts, async_depth=async_depth)) as eng:
        eng.generate(prompts[: opts.batch], SamplingParams(max_tokens=4, ignore_eos=True))
        meter = CpuMeter(eng)
        t0 = time.monotonic()
        outs = eng.generate(prompts, params)
        wall = time.monotonic() - t0
        cpu = meter.read()
        tokens = sum(len(o.token_ids) for o in outs)
        out.update(cpu)
        out.update(tokens_per_s=tokens / wall, tokens=tokens, wall_s=wall)
        out["ttft_p50_ms"] = pct([o.ttft_s * 1e3 for o in outs], 50)
        out["tpot_p50_ms"] = pct([o.tpot_s * 1e3 for o in outs], 50)
        out["tpot_p99_ms"] = pct([o.tpot_s * 1e3 for o in outs], 99)
        if idle_s:
            time.sleep(0.5)
            idle = CpuMeter(eng)
            time.sleep(idle_s)
            c = idle.read()
            busy = c["cpu_s_client"] + c["cpu_s_masters"] + c["cpu_s_dies"]
            out["idle_cpu_pct"] = 100.0 * busy / c["wall_s"]
            out["idle_cpu_s"] = {k[6:]: v for k, v in c.items() if k.startswith("cpu_s_")}
    bubble, step = final_lists(eng, "bubble_ms"), final_lists(eng, "step_ms")
    out.update(bubble_p50_ms=pct(bubble, 50), bubble_p99_ms=pct(bubble, 99),
               step_p50_ms=pct(step, 50), step_p99_ms=pct(step, 99),
               dummy_steps=sum(s["dummy_steps"] for s in eng.stats.values()))  # fmt: skip
    return out


ARRIVAL_GAP_S = 0.05  # the DP-balance run's request stream: one request every 50 ms
GRID_S = 0.02  # KV usage is read on this time grid (each group's latest report)


def kv_balance(opts: Options, policy: str) -> tuple[float, float]:
    """Max/mean KV usage (blocks in use) over groups, averaged over time: while the requests
    arrive (a stream of 12 per group, one every ARRIVAL_GAP_S, prompt and output lengths
    varying +-80 %), and over the whole run (the drain at the end included). A group's batch
    limit is twice its share, so it never decides where a request goes."""
    rng = random.Random(opts.seed)
    n = max(12 * opts.dies, 2 * opts.batch)
    lens = [max(4, int(opts.prompt_len * rng.uniform(0.2, 1.8))) for _ in range(n)]
    outs = [max(2, int(opts.steps * rng.uniform(0.2, 1.8))) for _ in range(n)]
    prompts = [make_prompts(1, n_tok, opts.seed + i)[0] for i, n_tok in enumerate(lens)]
    params = [SamplingParams(max_tokens=o, ignore_eos=True) for o in outs]
    seqs = 2 * -(-n // opts.dies)
    cfg = engine_config(opts, lb_policy=policy, prefix_cache=False, max_num_seqs=seqs)
    with Engine.launch(cfg) as eng:
        ids, t0 = [], time.time()
        for p, sp in zip(prompts, params, strict=True):
            ids.append(eng.submit(p, sp))
            time.sleep(ARRIVAL_GAP_S)
        t1 = time.time()
        for rid in ids:
            eng.result(rid)
        t2 = time.time()
        samples = sorted(eng.stats_log, key=lambda s: s["t"])
    return imbalance(samples, opts.dies, t0, t1), imbalance(samples, opts.dies, t0, t2)


def imbalance(samples: list[dict], dies: int, t_lo: float, t_hi: float) -> float:
    """Mean over a GRID_S time grid of max/mean blocks in use (each group's latest stats)."""
    latest: dict[int, int] = {}
    ratios, i, t = [], 0, t_lo
    while t <= t_hi:
        while i < len(samples) and samples[i]["t"] <= t:
            latest[samples[i]["group"]] = samples[i]["kv"]["used"]
            i += 1
        if len(latest) == dies and sum(latest.values()):
            ratios.append(max(latest.values()) * dies / sum(latest.values()))
        t += GRID_S
    return float(np.mean(ratios)) if ratios else 0.0


def prefix(opts: Options, enabled: bool) -> dict:
    """Prompts sharing 75 % of their tokens: hit rate and TTFT with the cache on or off."""
    n, length = 4 * opts.dies, max(32, 2 * opts.prompt_len)
    shared = make_prompts(1, int(length * 0.75), opts.seed)[0]
    tails = make_prompts(n, length - len(shared), opts.seed + 1)
    prompts = [shared + t[1:] + [t[0]] for t in tails]
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with Engine.launch(engine_config(opts, prefix_cache=enabled, lb_policy="round_robin")) as eng:
        eng.generate([shared + [1]] * opts.dies, params)  # warm every group's cache
        outs = eng.generate(prompts, params)
        time.sleep(0.3)
        st = eng.stats
    hits = sum(s["prefix_hit_tokens"] for s in st.values())
    queried = sum(s["prefix_query_tokens"] for s in st.values())
    return {"hit_rate": hits / queried if queried else 0.0,
            "ttft_p50_ms": pct([o.ttft_s * 1e3 for o in outs], 50)}  # fmt: skip


def replay_check(opts: Options) -> dict:
    dies = min(opts.dies, 2)
    cfg = EngineConfig(dies=dies, model="tiny", max_num_seqs=4, max_num_batched_tokens=32,
                       num_blocks=16, log_steps=True, keep_logits=True)  # fmt: skip
    base = "the pod shares one memory fabric; " * 2
    prompts = [base + "x" * i for i in range(10)]
    params = [SamplingParams(max_tokens=40, temperature=0.7 * (i % 2), seed=i) for i in range(10)]
    with Engine.launch(cfg) as eng:
        eng.generate(prompts, params)
    rep = replay(eng.model, dies, None, cfg.blocks, cfg.block_size, eng.step_log,
                 cfg.combine_dtype)  # fmt: skip
    return {"replay_bit_equal": rep.bit_equal, "replay_steps": rep.steps,
            "replay_sampled": rep.sampled}  # fmt: skip


# -- the command ----------------------------------------------------------------------------------


def run(opts: Options) -> int:
    if opts.spec_tokens:
        from bench.spec import print_spec, run_spec

        res = {**run_spec(opts, engine_config, list(opts.spec_tokens), opts.mtp_draft),
               **run_info()}  # fmt: skip
        print_spec(res)
        if opts.json:
            with open(opts.json, "w") as f:
                json.dump(res, f, indent=1)
            progress(f"  wrote {opts.json}")
        return 0 if all(r["replay_bit_equal"] for r in res["rows"]) else 1
    if opts.attention_dies:
        res = {**run_split(opts), **run_info()}
        print_split(res)
        if opts.json:
            with open(opts.json, "w") as f:
                json.dump(res, f, indent=1)
            progress(f"  wrote {opts.json}")
        return 0
    progress(f"xpod bench engine: {opts.dies} dies, batch {opts.batch}, prompt {opts.prompt_len},"
             f" {opts.steps} tokens, {opts.waves} waves, model {opts.model}")  # fmt: skip
    decs, ons = [], []
    for i in range(opts.repeat):  # alternating pairs: the machine's drift hits both alike
        progress(f"  [1/6] baseline: xpod decode ({i + 1}/{opts.repeat}) ...")
        decs.append(run_decode(DecodeOptions(dies=opts.dies, batch=opts.batch,
                                             prompt_len=opts.prompt_len, steps=opts.steps,
                                             model=opts.model)))  # fmt: skip
        last = i == opts.repeat - 1
        progress(f"  [2/6] engine, asynchronous execution on ({i + 1}/{opts.repeat})"
                 + (", then idle ..." if last else " ..."))  # fmt: skip
        ons.append(saturation(opts, 2, opts.idle_s if last else 0.0))
    ratios = [o["tokens_per_s"] / d["tokens_per_s"] for o, d in zip(ons, decs, strict=True)]
    k = int(np.argsort(ratios)[len(ratios) // 2])  # the median pair
    dec, on = decs[k], {**ons[k], **{x: ons[-1][x] for x in ("idle_cpu_pct", "idle_cpu_s")}}
    progress("  [3/6] engine, asynchronous execution off ...")
    off = saturation(opts, 1)
    progress("  [4/6] DP balance: least-KV, round-robin ...")
    (least, least_all), (rr, rr_all) = kv_balance(opts, "least_kv"), kv_balance(opts, "round_robin")
    progress("  [5/6] prefix cache on / off ...")
    p_on, p_off = prefix(opts, True), prefix(opts, False)
    progress("  [6/6] schedule replay ...")
    rep = replay_check(opts)
    decode_e2e = (
        opts.batch
        * opts.steps
        / (dec["prefill_ms"] / 1e3 + opts.batch * opts.steps / dec["tokens_per_s"])
    )
    res = {
        "bench": "engine", "dies": opts.dies, "batch": opts.batch, "prompt_len": opts.prompt_len,
        "steps": opts.steps, "model": opts.model, "requests": opts.waves * opts.batch,
        "gc_every": opts.gc_every, "pin": opts.pin,
        "engine_tokens_per_s": on["tokens_per_s"], "decode_tokens_per_s": dec["tokens_per_s"],
        "ratio": on["tokens_per_s"] / dec["tokens_per_s"],
        "ratios": ratios, "repeat": opts.repeat,
        "decode_e2e_tokens_per_s": decode_e2e, "ratio_e2e": on["tokens_per_s"] / decode_e2e,
        "engine_tokens_per_s_async_off": off["tokens_per_s"],
        "bubble_p50_ms": on["bubble_p50_ms"], "bubble_p99_ms": on["bubble_p99_ms"],
        "step_p50_ms": on["step_p50_ms"], "step_p99_ms": on["step_p99_ms"],
        "bubble_share_p50": on["bubble_p50_ms"] / on["step_p50_ms"] if on["step_p50_ms"] else 0,
        "bubble_async_off_p50_ms": off["bubble_p50_ms"],
        "bubble_async_off_p99_ms": off["bubble_p99_ms"],
        "tpot_p50_ms": on["tpot_p50_ms"], "tpot_p99_ms": on["tpot_p99_ms"],
        "decode_tpot_p50_ms": dec["tpot_p50_ms"], "ttft_p50_ms": on["ttft_p50_ms"],
        "dummy_steps": on["dummy_steps"],
        "cpu_s_client": on["cpu_s_client"], "cpu_s_masters": on["cpu_s_masters"],
        "cpu_s_dies": on["cpu_s_dies"], "wall_s": on["wall_s"],
        "idle_cpu_pct": on.get("idle_cpu_pct", 0.0), "idle_s": opts.idle_s,
        "idle_cpu_s": on.get("idle_cpu_s", {}),
        "kv_balance_least_kv": least, "kv_balance_round_robin": rr,
        "kv_balance_least_kv_whole_run": least_all, "kv_balance_round_robin_whole_run": rr_all,
        "prefix_hit_rate": p_on["hit_rate"], "prefix_hit_rate_off": p_off["hit_rate"],
        "ttft_p50_ms_prefix_on": p_on["ttft_p50_ms"],
        "ttft_p50_ms_prefix_off": p_off["ttft_p50_ms"],
        **rep, **run_info(),
    }  # fmt: skip
    print_report(res)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(res, f, indent=1)
        progress(f"  wrote {opts.json}")
    return 0 if res["replay_bit_equal"] else 1


def print_report(r: dict) -> None:
    print(f"\nserving engine vs xpod decode: {r['dies']} dies, batch {r['batch']}, prompt"
          f" {r['prompt_len']}, {r['steps']} output tokens, {r['requests']} requests, model"
          f" {r['model']}, gc_every {r['gc_every']}, pin {r['pin']}"
          " (one run; compare ratios)")  # fmt: skip
    rows = [
        ("output tokens/s, engine (async on)", f"{r['engine_tokens_per_s']:.1f}"),
        ("output tokens/s, engine (async off)", f"{r['engine_tokens_per_s_async_off']:.1f}"),
        ("output tokens/s, xpod decode (decode steps)", f"{r['decode_tokens_per_s']:.1f}"),
        ("  engine / decode, median pair", f"{r['ratio']:.2f}x  (incl. prefill:"
                                            f" {r['ratio_e2e']:.2f}x); pairs: "
                                            + ", ".join(f"{x:.2f}" for x in r["ratios"])),
        ("step p50 / p99 ms", f"{r['step_p50_ms']:.2f} / {r['step_p99_ms']:.2f}"),
        ("bubble p50 / p99 ms, async on", f"{r['bubble_p50_ms']:.3f} / {r['bubble_p99_ms']:.3f}"
                                          f"  ({r['bubble_share_p50']:.2%} of a step)"),
        ("bubble p50 / p99 ms, async off",
         f"{r['bubble_async_off_p50_ms']:.3f} / {r['bubble_async_off_p99_ms']:.3f}"),
        ("TPOT p50 / p99 ms (engine; decode p50)",
         f"{r['tpot_p50_ms']:.2f} / {r['tpot_p99_ms']:.2f}; {r['decode_tpot_p50_ms']:.2f}"),
        ("CPU s: client / masters / dies",
         f"{r['cpu_s_client']:.2f} / {r['cpu_s_masters']:.2f} / {r['cpu_s_dies']:.2f}"
         f" over {r['wall_s']:.1f} s"),
        (f"idle CPU, all processes, {r['idle_s']:g} s", f"{r['idle_cpu_pct']:.2f} % of one core"),
        ("KV balance max/mean: least-KV / round-robin",
         f"{r['kv_balance_least_kv']:.2f} / {r['kv_balance_round_robin']:.2f} while requests"
         f" arrive; {r['kv_balance_least_kv_whole_run']:.2f} /"
         f" {r['kv_balance_round_robin_whole_run']:.2f} with the drain"),
        ("prefix hit rate (cache on / off)",
         f"{r['prefix_hit_rate']:.2f} / {r['prefix_hit_rate_off']:.2f}"),
        ("TTFT p50 ms, prefix cache on / off",
         f"{r['ttft_p50_ms_prefix_on']:.1f} / {r['ttft_p50_ms_prefix_off']:.1f}"),
        ("schedule replay bit-equal",
         f"{r['replay_bit_equal']} ({r['replay_sampled']} tokens, {r['replay_steps']} steps)"),
    ]  # fmt: skip
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")


def main(args: argparse.Namespace) -> int:
    return run(parse_options(args))
