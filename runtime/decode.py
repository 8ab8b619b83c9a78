"""Distributed decode of the toy model: each die a DP rank for attention and an EP rank for experts.

```
xpod decode --dies 4 --batch 8 --prompt-len 64 --steps 128 --check
xpod decode --dies 8 --model small --quant int8 --trace decode.json --json decode.jsonl
```

What runs where (000 §4.2.2, 001 §4.2):

- The launcher builds the prompts, spreads the global batch over the dies (request `r` of the
  batch goes to die `r % dies`; request ids are then given die by die, as `ReferencePod` does),
  and checks the model against the pod (`ModelConfig.validate`) before any process starts.
- Every die builds the non-expert weights and its own experts from the seed (nothing is shipped),
  keeps its requests' latent KV rows in blocks in its app area (`BlockKV`), and runs the layers
  of `runtime.model.DieModel`. Every MoE layer is a pod-wide `comm.dispatch` / `comm.combine`
  (protocol and quantization selectable). A die with no requests still joins every step with an
  empty batch, so no collective ever waits for a die that has nothing to say.
- Prefill is the first step, through the same path, with every prompt as one segment; then one
  token per request per step. Every request decodes exactly `steps` tokens (no early EOS stop), so
  every die runs the same number of steps.

Bit-exactness: the dies call the same `DieModel` phases on the same per-die batches as
`runtime.reference_model.ReferencePod`, and the protocols deliver exactly `comm.reference`'s
dispatch rows and combine sums, so without quantization tokens and logits are equal bit for bit.
With INT8 dispatch the pod equals an INT8 `ReferencePod` bit for bit too; against the float32
reference its logits differ by the quantization error (reported, with greedy-token agreement).

Observability: every phase of every layer is a record in the die's trace (`op` "model", on its
own track), from which the per-layer breakdown in the manner of 001 Fig. 20 is computed:
attention, gate, dispatch (incl. dequantization), experts (routed + shared + dense FFN), combine,
other (embedding, final norm and LM head, sampling, KV bookkeeping). `--trace` also records the
protocol steps of `comm`, for a Perfetto timeline with one process per die.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field

import numpy as np

import comm
from comm.quant import dequantize_int8
from comm.routing import Placement
from comm.trace import STEP_NAMES, TRACK_NAMES
from memory.errors import ConfigError
from memory.heap import keep_freed_memory
from runtime.argtypes import (
    flag_error,
    int_range,
    nonneg_float,
    nonneg_int,
    output_file,
    positive_float,
    positive_int,
)
from runtime.blas import limit_blas_threads
from runtime.config import PodConfig
from runtime.model import (
    PRESETS,
    DieModel,
    ModelConfig,
    batch_rows,
    build_weights,
    encode,
    last_rows,
    sample,
)
from runtime.pod import Pod

PHASES = ("attention", "gate", "dispatch", "experts", "combine", "other")
MAX_BATCH = 1 << 20  # --batch: requests of one run
MODEL_LANE = 99  # trace track of the model phases (comm's steps use lanes 0..)
TRACE_OP = "model"
STEP_NAMES.update({(TRACE_OP, i): p for i, p in enumerate(PHASES)})
TRACK_NAMES[MODEL_LANE] = "model"

CORPUS = (
    "The pod is a set of dies that share one memory fabric. Each die owns a region of high"
    " bandwidth memory and reads its peers' regions directly, so tokens travel to experts without"
    " a network stack in the way. Attention runs data parallel: every die keeps its own requests"
    " and their compressed latent cache. Experts run expert parallel: each die hosts a slice of"
    " the routed experts and serves every token that picks one of them. A decode step therefore"
    " alternates local work and pod-wide exchanges, and its latency is set by the slowest die."
)


# -- the KV cache in the app area --------------------------------------------------------------


class BlockKV:
    """Latent KV rows of a die's requests in fixed-size blocks of its app area (paged, as vLLM).

    The pool is one array `[n_layers, n_blocks, block_size, kv_dim]` float32 allocated from the
    die's app-area allocator; a request owns a block table (block ids in position order) shared
    by all layers. `get` gathers a request's blocks into a contiguous array (the values, hence the
    results, are exactly those `DictKV` keeps in one array).
    """

    def __init__(self, pool: np.ndarray, block_size: int):
        self.pool = pool
        self.block_size = block_size
        self.free_blocks = list(range(pool.shape[1] - 1, -1, -1))
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[tuple[int, int], int] = {}

    @staticmethod
    def blocks_for(tokens: int, block_size: int) -> int:
        return math.ceil(tokens / block_size)

    def append(self, req: int, layer: int, rows: np.ndarray) -> None:
        n0 = self.lens.get((req, layer), 0)
        n1 = n0 + rows.shape[0]
        table = self.tables.setdefault(req, [])
        bs = self.block_size
        while len(table) * bs < n1:
            if not self.free_blocks:
                raise MemoryError(
                    f"KV pool exhausted: request {req} needs {self.blocks_for(n1, bs)} blocks of"
                    f" {bs} tokens; the pool has {self.pool.shape[1]}"
                )
            table.append(self.free_blocks.pop())
        at = n0
        while at < n1:
            blk, off = divmod(at, bs)
            take = min(bs - off, n1 - at)
            self.pool[layer, table[blk], off : off + take] = rows[at - n0 : at - n0 + take]
            at += take
        self.lens[(req, layer)] = n1

    def get(self, req: int, layer: int) -> np.ndarray:
        n = self.lens.get((req, layer), 0)
        table = self.tables.get(req, [])[: self.blocks_for(n, self.block_size)]
        return self.pool[layer, table].reshape(-1, self.pool.shape[3])[:n]

    def free(self, req: int) -> None:
        self.free_blocks.extend(reversed(self.tables.pop(req, [])))
        for key in [k for k in self.lens if k[0] == req]:
            del self.lens[key]


# -- what the dies run ----------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeSpec:
    """Everything a die needs (picklable; sent once per run)."""

    model: ModelConfig
    prompts: list[list[list[int]]]  # [die][i] token ids
    request_ids: list[list[int]]  # [die][i]
    steps: int
    protocol: str = "fused"
    quant: str | None = None
    temperature: float = 0.0
    seed: int = 0
    block_size: int = 16
    keep_logits: bool = True


class _Clock:
    """Per-phase wall-time accounting, every span also a trace record (op "model")."""

    def __init__(self, die, n_layers: int):
        self.trace = die.trace
        self.step = 0
        self.layer_ns = np.zeros((n_layers, len(PHASES)), np.int64)  # decode steps only
        self.other_ns = 0
        self.counting = False

    def span(self, phase: int, layer: int, t0: int) -> int:
        t1 = time.perf_counter_ns()
        self.trace.rec(t0, t1 - t0, TRACE_OP, phase, layer, MODEL_LANE, self.step, 0)
        if self.counting:
            if layer >= 0:
                self.layer_ns[layer, phase] += t1 - t0
            else:
                self.other_ns += t1 - t0
        return t1


def _forward(die, model: DieModel, segments, spec: DecodeSpec, clock: _Clock, local_ids):
    """One step of this die: DieModel's phases with pod-wide MoE collectives (see the module)."""
    cfg = model.cfg
    t = time.perf_counter_ns()
    tokens, _, _ = batch_rows(segments)
    h = model.embed(tokens)
    t = clock.span(5, -1, t)
    for layer in range(cfg.n_layers):
        h = model.attention(layer, h, segments)
        t = clock.span(0, layer, t)
        if not model.is_moe(layer):
            h = model.dense_ffn(layer, h)
            t = clock.span(3, layer, t)
            continue
        xn, idx, w = model.gate(layer, h)
        t = clock.span(1, layer, t)
        ev = clock.step * cfg.n_layers + layer
        d = comm.dispatch(die, xn, idx, w, protocol=spec.protocol, quant=spec.quant, event_id=ev)
        rows = dequantize_int8(d.x, d.scales) if spec.quant == "int8" else d.x
        t = clock.span(2, layer, t)
        y = model.experts(layer, rows, d.expert_counts, local_ids)
        t = clock.span(3, layer, t)
        routed = comm.combine(die, y, d.handle, event_id=ev)
        t = clock.span(4, layer, t)
        h = model.finish_moe(layer, h, xn, routed)
        t = clock.span(3, layer, t)
    logits = model.logits(h[last_rows(segments)])
    clock.span(5, -1, t)
    return logits


def decode_main(die, spec: DecodeSpec) -> dict:
    """Run on every die: build the model, prefill, decode `spec.steps` steps; return timings,
    tokens and (optionally) logits of this die's requests."""
    cfg = spec.model
    me = die.die_id
    placement = Placement.default(cfg.num_experts, tuple(range(die.num_dies)))
    local_ids = placement.experts_on(me).tolist()
    weights = build_weights(cfg, local_ids)
    prompts, ids = spec.prompts[me], spec.request_ids[me]
    need = sum(BlockKV.blocks_for(len(p) + spec.steps, spec.block_size) for p in prompts)
    pool = die.alloc((cfg.n_layers, max(need, 1), spec.block_size, cfg.kv_cache_dim), np.float32)
    kv = BlockKV(pool, spec.block_size)
    model = DieModel(cfg, weights, kv)
    clock = _Clock(die, cfg.n_layers)
    ctx = die.ctx
    tokens = [[] for _ in ids]
    history = []

    def take(logits, s):
        rngs = [np.random.default_rng([spec.seed, r, s]) for r in ids] if spec.temperature else None
        new = sample(logits, spec.temperature, rngs)
        for i, tok in enumerate(new.tolist()):
            tokens[i].append(tok)
        if spec.keep_logits:
            history.append(logits)

    try:
        comm.barrier(die)
        cpu0, t0 = time.process_time(), time.perf_counter_ns()
        prefill = [(r, p, 0) for r, p in zip(ids, prompts, strict=True)]
        logits = _forward(die, model, prefill, spec, clock, local_ids)
        t = time.perf_counter_ns()
        take(logits, 0)
        clock.span(5, -1, t)
        prefill_ns = time.perf_counter_ns() - t0
        comm.barrier(die)
        step_ns = []
        clock.counting = True
        cpu1, wait0, t0 = time.process_time(), ctx.waited_ns, time.perf_counter_ns()
        for s in range(1, spec.steps + 1):
            clock.step = s
            ts = time.perf_counter_ns()
            segs = [(r, [tokens[i][-1]], len(prompts[i]) + s - 1) for i, r in enumerate(ids)]
            logits = _forward(die, model, segs, spec, clock, local_ids)
            t = time.perf_counter_ns()
            take(logits, s)
            clock.span(5, -1, t)
            step_ns.append(time.perf_counter_ns() - ts)
        decode_ns = time.perf_counter_ns() - t0
        cpu_decode = time.process_time() - cpu1
        wait_ns = ctx.waited_ns - wait0
    finally:
        die.free(pool)
    return {
        "die": me,
        "request_ids": ids,
        "tokens": tokens,
        "logits": history,
        "prefill_ns": prefill_ns,
        "decode_ns": decode_ns,
        "step_ns": step_ns,
        "layer_ns": clock.layer_ns,
        "other_ns": clock.other_ns,
        "wait_ns": wait_ns,
        "cpu_prefill_s": cpu1 - cpu0,
        "cpu_decode_s": cpu_decode,
    }


# -- the launcher side ----------------------------------------------------------------------------


@dataclass
class DecodeOptions:
    dies: int = 4
    batch: int = 8
    prompt_len: int = 64
    steps: int = 32
    model: str = "small"
    quant: str | None = None
    protocol: str = "fused"
    temperature: float = 0.0
    seed: int = 0
    check: bool = False
    trace: str | None = None
    json: str | None = None
    block_size: int = 16
    timeout_s: float = 120.0
    overrides: dict = field(default_factory=dict)
    prompts: list[list[int]] | None = None  # explicit prompts (then batch = len(prompts))
    pin: str = "auto"
    wait: str = "auto"


def make_prompts(batch: int, prompt_len: int, seed: int) -> list[list[int]]:
    """`batch` prompts of `prompt_len` tokens (BOS + UTF-8 bytes of the corpus from a seeded
    offset); request r's text depends only on (seed, r)."""
    if prompt_len < 1:
        raise ConfigError(f"prompt_len: {prompt_len} must be >= 1")
    text = (CORPUS + " ") * (prompt_len // len(CORPUS) + 2)
    out = []
    for r in range(batch):
        start = int(np.random.default_rng([seed, r]).integers(0, len(CORPUS)))
        out.append(encode(text[start : start + prompt_len - 1]))
    return out


def spread(prompts: list[list[int]], dies: int) -> tuple[list[list[list[int]]], list[list[int]]]:
    """Request r -> die r % dies; ids given die by die (the ReferencePod convention).
    Returns (prompts per die, request ids per die)."""
    per_die = [[p for r, p in enumerate(prompts) if r % dies == d] for d in range(dies)]
    ids, nxt = [], 0
    for d in range(dies):
        ids.append(list(range(nxt, nxt + len(per_die[d]))))
        nxt += len(per_die[d])
    return per_die, ids


def pod_config(model: ModelConfig, spec_prompts, opts: DecodeOptions) -> PodConfig:
    """A PodConfig sized for this run: all-to-all areas for the longest prefill of a die, an app
    area for its KV pool."""
    rows = max(1, max(sum(len(p) for p in ps) for ps in spec_prompts))
    blocks = max(
        sum(BlockKV.blocks_for(len(p) + opts.steps, opts.block_size) for p in ps)
        for ps in spec_prompts
    )
    kv_bytes = model.n_layers * max(blocks, 1) * opts.block_size * model.kv_cache_dim * 4
    return PodConfig(
        num_dies=opts.dies,
        a2a_max_batch=rows,
        a2a_hidden=model.hidden,
        a2a_topk=model.topk,
        num_experts=model.num_experts,
        a2a_dispatch_dtype="int8" if opts.quant == "int8" else "float32",
        app_bytes=kv_bytes + (1 << 20),
        trace=bool(opts.trace),
        trace_capacity=1 << 20 if opts.trace else 1 << 16,
        timeout_s=opts.timeout_s,
        pin=opts.pin,
        wait=opts.wait,
    )


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_decode(opts: DecodeOptions) -> dict:
    """Launch a pod, decode, optionally check against the reference; return the summary dict."""
    model = ModelConfig.preset(opts.model, **opts.overrides)
    model.validate(opts.dies)  # before any process starts
    if opts.protocol not in comm.alltoall.PROTOCOLS:
        raise ConfigError(f"protocol: {opts.protocol!r} is not one of {comm.alltoall.PROTOCOLS}")
    if opts.quant not in (None, "int8"):
        raise ConfigError(f"quant: {opts.quant!r} must be none or int8")
    if opts.batch < 0 or opts.steps < 0:
        raise ConfigError("batch and steps must be >= 0")
    if opts.prompts is not None:
        prompts = [list(p) for p in opts.prompts]
        opts.batch = len(prompts)
    else:
        prompts = make_prompts(opts.batch, opts.prompt_len, opts.seed)
    longest = max((len(p) for p in prompts), default=0)
    if longest + opts.steps > model.max_seq_len:
        raise ConfigError(
            f"prompt_len + steps = {longest + opts.steps} exceeds the model's"
            f" max_seq_len {model.max_seq_len}"
        )
    bad = [(r, t) for r, p in enumerate(prompts) for t in p if not 0 <= t < model.vocab_size]
    if bad or any(not p for p in prompts):
        raise ConfigError(f"prompts: every prompt needs >= 1 token in [0, vocab); bad: {bad[:3]}")
    per_die, ids = spread(prompts, opts.dies)
    spec = DecodeSpec(
        model, per_die, ids, opts.steps, opts.protocol, opts.quant, opts.temperature, opts.seed,
        opts.block_size, keep_logits=opts.check,
    )  # fmt: skip
    cfg = pod_config(model, per_die, opts)
    _progress(
        f"xpod decode: model {opts.model} ({model.n_layers} layers, hidden {model.hidden},"
        f" {model.num_experts} experts top-{model.topk}), {opts.dies} dies on {cfg.cores} cores,"
        f" batch {opts.batch} ({', '.join(str(len(p)) for p in per_die)} per die), prompt"
        f" {opts.prompt_len}, {opts.steps} steps, {opts.protocol}"
        f" {opts.quant or 'float32'} dispatch"
    )
    t0 = time.monotonic()
    with Pod.launch(cfg) as pod:
        _progress(f"  pod {pod.pod_id} up in {time.monotonic() - t0:.1f} s; decoding ...")
        res = pod.run(decode_main, spec)
        if opts.trace:
            n = pod.write_trace(opts.trace)
            _progress(f"  wrote {n} trace events to {opts.trace}")
    summary = summarize(res, opts, model)
    if opts.check:
        summary.update(check(res, per_die, opts, model))
    return summary


def summarize(res: list[dict], opts: DecodeOptions, model: ModelConfig) -> dict:
    steps = opts.steps
    decode_s = max(r["decode_ns"] for r in res) / 1e9
    step_ms = (
        np.max(np.array([r["step_ns"] for r in res], np.float64), axis=0) / 1e6
        if steps
        else np.zeros(0)
    )
    layer_ns = sum(r["layer_ns"] for r in res) / len(res)  # mean over dies
    per_step_us = layer_ns / max(steps, 1) / 1e3  # [layer, phase]
    other_us = sum(r["other_ns"] for r in res) / len(res) / max(steps, 1) / 1e3
    totals = per_step_us.sum(axis=0)
    totals[PHASES.index("other")] += other_us
    wait_share = [r["wait_ns"] / max(r["decode_ns"], 1) for r in res]
    return {
        "bench": "decode",
        "model": opts.model,
        "dies": opts.dies,
        "batch": opts.batch,
        "prompt_len": opts.prompt_len,
        "steps": steps,
        "quant": opts.quant or "none",
        "protocol": opts.protocol,
        "tokens_per_s": opts.batch * steps / decode_s if decode_s else 0.0,
        "tpot_p50_ms": float(np.percentile(step_ms, 50)) if steps else 0.0,
        "tpot_p99_ms": float(np.percentile(step_ms, 99)) if steps else 0.0,
        "prefill_ms": max(r["prefill_ns"] for r in res) / 1e6,
        "breakdown_us_per_step": {p: float(totals[i]) for i, p in enumerate(PHASES)},
        "breakdown_us_per_layer": [
            {
                "layer": i,
                "moe": model.is_moe(i),
                **{p: float(per_step_us[i, j]) for j, p in enumerate(PHASES)},
            }
            for i in range(model.n_layers)
        ],
        "wait_share": float(np.mean(wait_share)),
        "wait_share_per_die": [float(w) for w in wait_share],
        "cpu_s_per_die": float(np.mean([r["cpu_decode_s"] for r in res])),
    }


def check(res: list[dict], per_die, opts: DecodeOptions, model: ModelConfig) -> dict:
    """Run the single-process reference on the same prompts; compare tokens and logits."""
    from runtime.reference_model import ReferencePod

    limit_blas_threads(1)  # the reference is one process on one core (the pod's dies: the same)
    keep_freed_memory()  # as every die does
    _progress("  --check: single-process reference (float32 dispatch) ...")
    ref = ReferencePod(model, opts.dies, quant=None).generate(
        per_die, opts.steps, opts.temperature, opts.seed
    )
    out = {"ref_tokens_per_s": ref.decode_tokens_per_s, "ref_prefill_ms": ref.prefill_s * 1e3}
    out.update(compare(res, ref, exact=opts.quant is None))
    if opts.quant == "int8":
        _progress("  --check: single-process reference with INT8 dispatch ...")
        ref8 = ReferencePod(model, opts.dies, quant="int8").generate(
            per_die, opts.steps, opts.temperature, opts.seed
        )
        exact = compare(res, ref8, exact=True)
        out["int8_ref_mismatched_tokens"] = exact["mismatched_tokens"]
        out["int8_ref_logits_bit_equal"] = exact["logits_bit_equal"]
    return out


def compare(res: list[dict], ref, exact: bool) -> dict:
    """Tokens, first mismatch and logit differences of the pod against a GenerateResult.

    The logit difference is taken over the steps before a request's first token mismatch (after
    it the inputs differ and so do the logits, legitimately)."""
    total = mismatched = 0
    first = None
    max_diff, scale, bit_equal, prefill_diff = 0.0, 0.0, True, 0.0
    for d, r in enumerate(res):
        for i, req in enumerate(r["request_ids"]):
            got, want = r["tokens"][i], ref.tokens[d][i]
            total += len(want)
            bad = [s for s, (a, b) in enumerate(zip(got, want, strict=True)) if a != b]
            mismatched += len(bad)
            stop = bad[0] + 1 if bad else len(want)
            if bad and (first is None or bad[0] < first["step"]):
                first = {
                    "die": d,
                    "request": req,
                    "step": bad[0],
                    "got": got[bad[0]],
                    "want": want[bad[0]],
                }
            for s in range(stop):
                a, b = r["logits"][s][i], ref.logits[d][s][i]
                bit_equal &= bool(np.array_equal(a, b))
                diff = float(np.max(np.abs(a - b)))
                max_diff = max(max_diff, diff)
                if s == 0:
                    prefill_diff = max(prefill_diff, diff)
                scale = max(scale, float(np.max(np.abs(b))))
    return {
        "mismatched_tokens": mismatched,
        "total_tokens": total,
        "token_agreement": 1.0 - mismatched / total if total else 1.0,
        "first_mismatch": first,
        "logits_bit_equal": bit_equal,
        "logits_max_abs_diff": max_diff,
        "logits_max_abs_diff_prefill": prefill_diff,
        "logits_max_abs": scale,
    }


# -- output ----------------------------------------------------------------------------------------


def print_summary(s: dict) -> None:
    print(
        f"\ndecode: {s['dies']} dies, model {s['model']}, batch {s['batch']}, prompt"
        f" {s['prompt_len']}, {s['steps']} steps, {s['protocol']} {s['quant']} dispatch"
    )
    print(
        f"  tokens/s {s['tokens_per_s']:.1f}   TPOT p50 {s['tpot_p50_ms']:.2f} ms  p99"
        f" {s['tpot_p99_ms']:.2f} ms   prefill {s['prefill_ms']:.1f} ms   waiting"
        f" {s['wait_share']:.0%} of decode time   cpu {s['cpu_s_per_die']:.2f} s/die"
    )
    b = s["breakdown_us_per_step"]
    tot = sum(b.values()) or 1.0
    print("\n  one decode step, us per die (mean over dies), as 001 Fig. 20:")
    print("  " + "".join(f"{p:>11}" for p in ("layer", *PHASES, "total")))
    for row in s["breakdown_us_per_layer"]:
        vals = [row[p] for p in PHASES]
        kind = "moe" if row["moe"] else "dense"
        print(
            f"  {row['layer']:>5} {kind:>5}"
            + "".join(f"{v:>11.0f}" for v in vals)
            + f"{sum(vals):>11.0f}"
        )
    print("  " + f"{'all':>11}" + "".join(f"{b[p]:>11.0f}" for p in PHASES) + f"{tot:>11.0f}")
    print("  " + f"{'share':>11}" + "".join(f"{b[p] / tot:>11.0%}" for p in PHASES))
    if "ref_tokens_per_s" in s:
        ratio = s["tokens_per_s"] / s["ref_tokens_per_s"] if s["ref_tokens_per_s"] else 0.0
        print(
            f"\n  reference (one process, same prompts, same run): {s['ref_tokens_per_s']:.1f}"
            f" tokens/s -> pod / reference = {ratio:.2f}x"
        )
        fm = s["first_mismatch"]
        print(
            f"  tokens: {s['total_tokens'] - s['mismatched_tokens']}/{s['total_tokens']} equal"
            f" ({s['token_agreement']:.1%});  logits bit-equal: {s['logits_bit_equal']};  max"
            f" |diff| {s['logits_max_abs_diff']:.3g} over the steps before a request's first"
            f" mismatch, {s['logits_max_abs_diff_prefill']:.3g} at the prefill step (max |logit|"
            f" {s['logits_max_abs']:.3g})"
        )
        if fm:
            print(
                f"  first mismatch: die {fm['die']} request {fm['request']} step {fm['step']}:"
                f" got {fm['got']}, reference {fm['want']}"
            )
        if "int8_ref_mismatched_tokens" in s:
            print(
                f"  vs the INT8 reference: {s['int8_ref_mismatched_tokens']} mismatched tokens,"
                f" logits bit-equal: {s['int8_ref_logits_bit_equal']}"
            )


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dies", type=positive_int, default=4, help="dies in the pod (default 4)")
    p.add_argument(
        "--batch",
        type=int_range(1, MAX_BATCH),
        default=8,
        help="global batch: requests over all dies",
    )
    p.add_argument("--prompt-len", type=positive_int, default=64, help="prompt tokens per request")
    p.add_argument(
        "--steps", type=positive_int, default=32, help="decode steps (tokens per request)"
    )
    p.add_argument("--model", default="small", choices=tuple(PRESETS), help="model preset")
    p.add_argument("--quant", default="none", choices=("none", "int8"))
    p.add_argument("--protocol", default="fused", choices=comm.alltoall.PROTOCOLS)
    p.add_argument("--temperature", type=nonneg_float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=nonneg_int, default=0, help="prompts, weights and sampling seed")
    p.add_argument("--check", action="store_true", help="compare with the reference, same run")
    p.add_argument("--trace", type=output_file, default=None, help="write a Perfetto trace to FILE")
    p.add_argument(
        "--json", type=output_file, default=None, help="append the summary as one JSON line to FILE"
    )
    p.add_argument("--block-size", type=positive_int, default=16, help="KV cache block (tokens)")
    p.add_argument("--timeout", type=positive_float, default=120.0, help="wait deadline, seconds")
    p.add_argument("--pin", default="auto", choices=("auto", "on", "off"), help="PodConfig.pin")
    p.add_argument(
        "--wait", default="auto", choices=("auto", "spin", "yield"), help="PodConfig.wait"
    )


# ModelConfig / PodConfig fields -> the flags that set them (for errors found after parsing)
_MODEL_FLAGS = {
    "preset": "--model",
    "seed": "--seed",
    "num_dies": "--dies",
    "expert_dies": "--dies",
    "num_experts": "--dies",
}
_POD_FLAGS = {
    "num_dies": "--dies",
    "a2a_max_batch": "--batch/--prompt-len/--dies",
    "app_bytes": "--batch/--prompt-len/--steps/--block-size/--dies",
    "trace_capacity": "--trace",
    "timeout_s": "--timeout",
}


def options(args: argparse.Namespace) -> DecodeOptions:
    """DecodeOptions of the parsed flags, checked as `run_decode` will before launching: the
    model against the pod, prompt + steps against max_seq_len, the PodConfig it sizes.

    Raises:
        ConfigError naming the flag(s).
    """
    opts = DecodeOptions(
        dies=args.dies,
        batch=args.batch,
        prompt_len=args.prompt_len,
        steps=args.steps,
        model=args.model,
        quant=None if args.quant == "none" else args.quant,
        protocol=args.protocol,
        temperature=args.temperature,
        seed=args.seed,
        check=args.check,
        trace=args.trace,
        json=args.json,
        block_size=args.block_size,
        timeout_s=args.timeout,
        overrides={"seed": args.seed},
        pin=args.pin,
        wait=args.wait,
    )
    _check_options(opts)
    return opts


def _check_options(opts: DecodeOptions) -> None:
    try:
        model = ModelConfig.preset(opts.model, **opts.overrides)
        model.validate(opts.dies)
    except ConfigError as e:
        raise flag_error(e, _MODEL_FLAGS) from None
    if opts.prompt_len + opts.steps > model.max_seq_len:
        raise ConfigError(
            f"argument --prompt-len/--steps: prompt_len + steps = {opts.prompt_len + opts.steps}"
            f" exceeds the max_seq_len {model.max_seq_len} of model {opts.model}"
        )
    # the PodConfig run_decode will size (make_prompts: every prompt has prompt_len tokens)
    prompt = range(opts.prompt_len)
    per_die = [[prompt] * len(range(d, opts.batch, opts.dies)) for d in range(opts.dies)]
    try:
        pod_config(model, per_die, opts)
    except ConfigError as e:
        raise flag_error(e, _POD_FLAGS) from None


def main(args: argparse.Namespace) -> int:
    opts = options(args)
    s = run_decode(opts)
    print_summary(s)
    if opts.json:
        with open(opts.json, "a") as f:
            f.write(json.dumps(s, default=_jsonable) + "\n")
        _progress(f"  appended the summary to {opts.json}")
    if opts.check and opts.quant is None and (s["mismatched_tokens"] or not s["logits_bit_equal"]):
        return 1
    return 0


def _jsonable(o):
    if isinstance(o, np.integer | np.floating):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(type(o).__name__)
