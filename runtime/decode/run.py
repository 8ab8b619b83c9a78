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
  keeps its requests' latent KV rows in blocks of its app area (`runtime.model.kv.PagedKV`, block
  tables from `sched.KVManager`, as the serving engine does), and runs the executor's forward
  step (`runtime.model.forward.forward`, the same code the serving loop runs). Every MoE layer is a
  pod-wide `comm.dispatch` / `comm.combine` (protocol and quantization selectable). A die with
  no requests still joins every step with an empty batch, so no collective ever waits for a die
  that has nothing to say.
- Prefill is the first step, through the same path, with every prompt as one segment; then one
  token per request per step. Every request decodes exactly `steps` tokens (no early EOS stop), so
  every die runs the same number of steps.

Bit-exactness: the dies call the same `DieModel` phases on the same per-die batches as
`runtime.model.reference.ReferencePod`, and the protocols deliver exactly `comm.reference`'s
dispatch rows and combine sums, so without quantization tokens and logits are equal bit for bit.
With INT8 dispatch the pod equals an INT8 `ReferencePod` bit for bit too; against the float32
reference its logits differ by the quantization error (reported, with greedy-token agreement).

This is the raw fixed-batch loop: no scheduler, no master, no rings. It is the baseline the
serving engine is measured against (`xpod bench engine`). The options live in
`runtime.decode.options`, the report in `runtime.decode.report`, the flags in the CLI.

Observability: every phase of every layer is a record in the die's trace (`op` "model", on its
own track), from which the per-layer breakdown in the manner of 001 Fig. 20 is computed:
attention, gate, dispatch (incl. dequantization), experts (routed + shared + dense FFN), combine,
other (embedding, final norm and LM head, sampling, KV bookkeeping). `--trace` also records the
protocol steps of `comm`, for a Perfetto timeline with one process per die.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import numpy as np

import comm
from comm.alltoall import Split
from memory.errors import ConfigError, PodError
from runtime.decode.options import EPLB_MODES, DecodeOptions, progress
from runtime.decode.project import card_model, check_projection, project_decode
from runtime.decode.report import (
    check,
    eplb_compare,
    eplb_stats,
    repeats,
    single_process,
    summarize,
)
from runtime.decode.split import split_check, split_decode_main, split_summary
from runtime.model import EPLBConfig, ModelConfig, encode, pod_config_for, sample
from runtime.model.forward import Clock, build_model, forward, prepared_for_fork
from runtime.model.pipeline import forward_microbatched
from runtime.model.tokenizer import CORPUS
from runtime.pod import Pod
from runtime.pod.config import PodConfig
from sched import KVManager

__all__ = ["DecodeSpec", "check_microbatches", "decode_main", "make_prompts", "pod_config",
           "run_decode", "spread"]  # fmt: skip


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
    eplb: EPLBConfig | None = None
    split: Split | None = None  # a split pod (runtime.decode.split), or colocated
    microbatches: int = 1  # colocated: 2 = runtime.model.pipeline's two-stream step


def blocks_needed(prompts: list[list[int]], steps: int, block_size: int) -> int:
    return sum(-(-(len(p) + steps) // block_size) for p in prompts)


def decode_main(die, spec: DecodeSpec) -> dict:
    """Run on every die: build the model, prefill, decode `spec.steps` steps; return timings,
    tokens and (optionally) logits of this die's requests."""
    if spec.split is not None:
        return split_decode_main(die, spec)
    cfg = spec.model
    me = die.die_id
    prompts, ids = spec.prompts[me], spec.request_ids[me]
    n_blocks = blocks_needed(prompts, spec.steps, spec.block_size)
    model, pool, bal = build_model(die, cfg, n_blocks, spec.block_size, spec.eplb, True)
    kv = KVManager(max(n_blocks, 1), spec.block_size, enable_prefix_cache=False)
    tables = [kv.alloc_blocks(r, len(p) + spec.steps) for r, p in zip(ids, prompts, strict=True)]
    clock = Clock(die, cfg.kv_layers)
    ctx = die.ctx
    tokens = [[] for _ in ids]
    history = []

    def step(segments) -> None:
        model.kv.begin_step(
            [(r, start, len(t), tables[i]) for i, (r, t, start) in enumerate(segments)]
        )
        bal.begin_step(clock.step)
        fwd = forward if spec.microbatches == 1 else forward_microbatched
        logits = fwd(die, model, segments, spec.protocol, spec.quant, clock, bal)
        bal.end_step(clock.step)
        t = time.perf_counter_ns()
        s = clock.step
        rngs = [np.random.default_rng([spec.seed, r, s]) for r in ids] if spec.temperature else None
        for i, tok in enumerate(sample(logits, spec.temperature, rngs).tolist()):
            tokens[i].append(tok)
        if spec.keep_logits:
            history.append(logits)
        clock.span(5, -1, t)

    try:
        comm.barrier(die)
        cpu0, t0 = time.process_time(), time.perf_counter_ns()
        step([(r, p, 0) for r, p in zip(ids, prompts, strict=True)])
        prefill_ns = time.perf_counter_ns() - t0
        comm.barrier(die)
        step_ns = []
        clock.counting = True
        cpu1, wait0, t0 = time.process_time(), ctx.waited_ns, time.perf_counter_ns()
        cap = getattr(die, "cap", None)  # a capture pod: each step a call (decode.project)
        for s in range(1, spec.steps + 1):
            clock.step = s
            ts = time.perf_counter_ns()
            if cap is not None:
                cap.begin("step", s, cap.main)
            step([(r, [tokens[i][-1]], len(prompts[i]) + s - 1) for i, r in enumerate(ids)])
            if cap is not None:
                cap.end("step", s)
            step_ns.append(time.perf_counter_ns() - ts)
        decode_ns = time.perf_counter_ns() - t0
        cpu_decode = time.process_time() - cpu1
        wait_ns = ctx.waited_ns - wait0
    finally:
        bal.close()
        die.free(pool)
    return {
        "eplb": bal.report(),
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


def pod_config(
    model: ModelConfig, spec_prompts, opts: DecodeOptions, eplb: EPLBConfig | None = None
) -> PodConfig:
    """A PodConfig sized for this run: all-to-all areas for the longest prefill of a die, an app
    area for its KV pool (and, with EPLB, its expert bank); on a split pod, the experts' areas
    for the expert dies only."""
    return pod_config_for(
        model,
        opts.dies,
        max_rows=max(sum(len(p) for p in ps) for ps in spec_prompts),
        num_blocks=max(blocks_needed(ps, opts.steps, opts.block_size) for ps in spec_prompts),
        block_size=opts.block_size,
        quant=opts.quant,
        combine_dtype=opts.combine_dtype,
        eplb=eplb,
        trace=bool(opts.trace),
        timeout_s=opts.timeout_s,
        pin=opts.pin,
        wait=opts.wait,
        expert_dies=opts.expert_dies or None,
        hosts=tuple(opts.hosts),
        fabric=opts.fabric,
        host_names=tuple(opts.host_names),
        net_if=opts.net_if,
        **({"cores": opts.cores} if opts.cores else {}),
    )


def make_split(opts: DecodeOptions, model: ModelConfig) -> Split:
    """The Split of --attention-dies / --expert-dies / --domains / --microbatches, checked (the
    model's experts over the expert dies) before any process starts."""
    n = opts.attention_dies + opts.expert_dies
    if opts.dies != n:
        raise ConfigError(f"dies: {opts.dies}, but attention + expert dies = {n}")
    if opts.eplb != "off":
        raise ConfigError("eplb: decode on a split pod runs without EPLB (serving has it)")
    if opts.protocol != "fused":
        raise ConfigError("protocol: a split pod moves rows with A2E / E2A (protocol fused)")
    model.validate(n, opts.expert_dies)
    return Split.make(n, opts.attention_dies, opts.domains, opts.microbatches)


def check_microbatches(opts: DecodeOptions) -> None:
    """--microbatches on a colocated pod: 2 (runtime.model.pipeline), without EPLB or MTP."""
    if opts.microbatches != 2:
        raise ConfigError(f"microbatches: 1 or 2, got {opts.microbatches}")
    if opts.eplb != "off" or opts.spec is not None:
        raise ConfigError("microbatches: a colocated pod runs 2 without EPLB and without MTP")


def run_decode(opts: DecodeOptions) -> dict:
    """Launch a pod, decode, optionally check against the reference; return the summary dict."""
    model = card_model(opts, ModelConfig.preset(opts.model, **opts.overrides))
    sp = make_split(opts, model) if opts.split else None
    model.validate(opts.dies, opts.expert_dies or None)  # before any process starts
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
    if opts.eplb not in EPLB_MODES:
        raise ConfigError(f"eplb: {opts.eplb!r} must be one of {EPLB_MODES}")
    eplb = None if opts.eplb == "off" else opts.eplb_config
    if eplb is not None:
        eplb.check(model, opts.dies)
    check_projection(opts, model)  # --project: the profile, the card (before any pod starts)
    if sp is None and opts.microbatches != 1:
        check_microbatches(opts)
    if sp is not None and opts.spec is None:
        return _run_split(opts, model, prompts, sp)
    per_die, ids = spread(prompts, opts.dies if sp is None else len(sp.att_dies))
    if opts.spec is not None:
        from runtime.decode.spec_run import run_spec_decode

        return run_spec_decode(opts, model, per_die, ids, sp)
    if opts.eplb == "compare":
        off = _run(opts, model, per_die, ids, None, keep_logits=True, trace=False)[0][0]
        on = _run(opts, model, per_die, ids, eplb, keep_logits=True, trace=bool(opts.trace))[0][0]
        return eplb_compare(off, on, per_die, opts, model)
    if opts.repeat < 1 or (opts.repeat > 1 and opts.eplb == "compare"):
        raise ConfigError("repeat: >= 1, and 1 with --eplb compare (it runs its own pair of pods)")
    between = None
    if opts.check and opts.repeat > 1:

        def between(_):  # after each pod run: the baseline, same prompts, same machine state
            out = single_process(per_die, opts, model)
            _quiesce()
            return out

    runs = _run(opts, model, per_die, ids, eplb, keep_logits=opts.check, trace=bool(opts.trace),
                between=between)  # fmt: skip
    res = _median_run(runs, opts) if len(runs) > 1 else runs[0][0]
    summary = summarize(res, opts, model)
    summary["microbatches"] = opts.microbatches
    if eplb is not None:
        summary["eplb"] = eplb_stats(res, model, summary["step_ms"])
    if opts.check:
        summary.update(check(res, per_die, opts, model, baseline=opts.repeat == 1))
    if opts.repeat > 1:
        summary.update(repeats(runs, opts, model))
    if opts.project is not None:  # a capture pod of --project-steps steps, replayed
        o = dataclasses.replace(opts, steps=opts.project_steps, trace=None)
        spec = DecodeSpec(model, per_die, ids, o.steps, o.protocol, o.quant, o.temperature,
                          o.seed, o.block_size, keep_logits=False,
                          microbatches=o.microbatches)  # fmt: skip
        cfg = pod_config(model, per_die, o)
        summary.update(project_decode(opts, model, decode_main, spec, cfg))
    return summary


def _run_split(opts: DecodeOptions, model: ModelConfig, prompts, sp: Split) -> dict:
    """A split pod's decode run (`runtime.decode.split`): the batch over the attention dies;
    with --project, a capture pod of the same split decode (its attention dies' steps tiled,
    docs/projection.md §6)."""
    if opts.repeat != 1:
        raise ConfigError("repeat: 1 on a split pod")
    per_att, ids = spread(prompts, len(sp.att_dies))
    spec = DecodeSpec(model, per_att, ids, opts.steps, "fused", opts.quant, opts.temperature,
                      opts.seed, opts.block_size, keep_logits=opts.check, split=sp)  # fmt: skip
    sizing = per_att + [[] for _ in sp.exp_dies]
    cfg = pod_config(model, sizing, opts)
    progress(
        f"xpod decode: model {opts.model} ({model.n_layers} layers, hidden {model.hidden},"
        f" {model.num_experts} experts top-{model.topk}) on a split pod: attention dies"
        f" {list(sp.att_dies)} in {sp.num_domains} domain(s) {[list(d) for d in sp.domains]},"
        f" {sp.microbatches} micro-batch(es), expert dies {list(sp.exp_dies)}; batch"
        f" {opts.batch} ({', '.join(str(len(p)) for p in per_att)} per attention die), prompt"
        f" {opts.prompt_len}, {opts.steps} steps, {opts.quant or 'float32'} A2E,"
        f" {opts.combine_dtype} E2A, {cfg.cores} cores"
    )
    t0 = time.monotonic()
    with prepared_for_fork(model):
        pod_cm = Pod.launch(cfg if opts.trace else cfg.replace(trace=False))
    with pod_cm as pod:
        progress(f"  pod {pod.pod_id} up in {time.monotonic() - t0:.1f} s; decoding ...")
        res = pod.run(decode_main, spec)
        if opts.trace:
            n = pod.write_trace(opts.trace)
            progress(f"  wrote {n} trace events to {opts.trace}")
    summary = split_summary(res, opts, model, sp)
    if opts.check:
        summary.update(split_check(res, per_att, opts, model, sp))
    if opts.project is not None:  # a capture pod of --project-steps steps, replayed
        o = dataclasses.replace(opts, steps=opts.project_steps, trace=None)
        spec = dataclasses.replace(spec, steps=o.steps, keep_logits=False)
        cfg = pod_config(model, sizing, o)
        summary.update(project_decode(opts, model, decode_main, spec, cfg))
    return summary


def _quiesce(limit_s: float = 1.0) -> None:
    """Wait until this process stops using CPU while its main thread sleeps: after the
    one-process baseline's products on every core, OpenBLAS's worker threads spin ~0.1 s
    before they sleep (measured: 0.1 s of CPU during a 0.5 s sleep), and a pod run started
    then lost a core to them (median pair 0.96-1.06x against 1.10-1.23x after a pause)."""
    deadline = time.monotonic() + limit_s
    last = time.process_time()
    while time.monotonic() < deadline:
        time.sleep(0.02)
        now = time.process_time()
        if now - last < 0.002:
            return
        last = now


def _median_run(runs: list, opts: DecodeOptions) -> list[dict]:
    """The pod run whose decode time is the median of the repeats (its tokens must equal every
    other run's: a run that decodes differently is an error, not noise)."""
    first = [r["tokens"] for r in runs[0][0]]
    for i, (res, _) in enumerate(runs[1:], 2):
        if [r["tokens"] for r in res] != first:
            raise PodError(f"decode run {i} of {opts.repeat} produced other tokens than run 1")
    order = sorted(range(len(runs)), key=lambda i: max(r["decode_ns"] for r in runs[i][0]))
    return runs[order[len(runs) // 2]][0]


def _run(opts: DecodeOptions, model: ModelConfig, per_die, ids, eplb, keep_logits: bool,
         trace: bool, between=None) -> list[tuple[list[dict], object]]:  # fmt: skip
    """One pod: launch, decode `opts.repeat` times (calling `between(i)` after run i, in the
    launcher while the dies wait); [(every die's result, between's result or None)] per run."""
    spec = DecodeSpec(
        model, per_die, ids, opts.steps, opts.protocol, opts.quant, opts.temperature, opts.seed,
        opts.block_size, keep_logits=keep_logits, eplb=eplb, microbatches=opts.microbatches,
    )  # fmt: skip
    cfg = pod_config(model, per_die, opts, eplb)
    balance = "off" if eplb is None else (
        f"on ({eplb.redundant_per_die} redundant slot(s) per die, {eplb.policy}, every"
        f" {eplb.every} steps)"
    )  # fmt: skip
    progress(
        f"xpod decode: model {opts.model} ({model.n_layers} layers, hidden {model.hidden},"
        f" {model.num_experts} experts top-{model.topk}, score bias {model.score_bias}),"
        f" {opts.dies} dies on {cfg.cores} cores, batch {opts.batch}"
        f" ({', '.join(str(len(p)) for p in per_die)} per die), prompt {opts.prompt_len},"
        f" {opts.steps} steps, {opts.protocol} {opts.quant or 'float32'} dispatch,"
        f" {opts.combine_dtype} combine, EPLB {balance}"
        + (f", hosts {list(opts.hosts)} ({cfg.fabric} fabric)" if opts.hosts else "")
    )
    t0 = time.monotonic()
    with prepared_for_fork(model):  # the dies fork with the kernels and one copy of the weights
        pod_cm = Pod.launch(cfg if trace else cfg.replace(trace=False))
    with pod_cm as pod:
        progress(f"  pod {pod.pod_id} up in {time.monotonic() - t0:.1f} s; decoding ...")
        runs = []
        for i in range(opts.repeat):
            if i:
                progress(f"  run {i + 1} of {opts.repeat} ...")
            res = pod.run(decode_main, spec)
            runs.append((res, between(i) if between is not None else None))
        if trace:
            n = pod.write_trace(opts.trace)
            progress(f"  wrote {n} trace events to {opts.trace}")
    return runs
