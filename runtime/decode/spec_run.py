"""The launcher side of `xpod decode --num-speculative-tokens K` (`runtime.decode.spec`): the
pod sized for both runs, the baseline then the MTP run (alternating with `--repeat`), the
figures of issue 31's JSON keys, and `--check` against the single-process reference running
the same speculative schedule (`runtime.model.mtp.reference_decode`); on a split pod
(`--attention-dies`) the batch is the attention dies' and the reference `SplitReference`."""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from comm.alltoall import Split
from memory.errors import ConfigError
from runtime.decode.options import DecodeOptions, progress
from runtime.decode.spec import NO_MTP, SpecDecodeSpec, merged_stats, spec_decode_main
from runtime.model import ModelConfig, pod_config_for
from runtime.model.forward import prepared_for_fork
from runtime.model.mtp import SpecConfig, positions_needed, reference_decode
from runtime.pod import Pod


def spec_model(model: ModelConfig, spec: SpecConfig) -> ModelConfig:
    """The model with its MTP module (and the fitted head for the `fit` draft)."""
    return dataclasses.replace(model, mtp_layers=1, mtp_fit=spec.draft == "fit")


def spec_positions(prompts, steps: int, spec: SpecConfig) -> int:
    """KV positions a request may reach in either run (MTP: up to 1 + k a step; the
    baseline: `steps x (1 + k)` steps of one)."""
    longest = max((len(p) for p in prompts), default=0)
    return max(positions_needed(longest, steps, spec.k), longest + steps * (1 + spec.k) + 1)


def check_spec(opts: DecodeOptions, model: ModelConfig, prompts) -> None:
    """Refuse what the speculative decode cannot run (before any process starts)."""
    spec = opts.spec
    if opts.eplb != "off" or opts.hosts:
        raise ConfigError(
            "num-speculative-tokens: xpod decode speculates on a single-host pod (colocated or"
            " split) without EPLB"
        )
    need = spec_positions(prompts, opts.steps, spec)
    if need > model.max_seq_len:
        raise ConfigError(
            f"prompt_len + steps: with {spec.k} draft(s) a request may reach position {need}"
            f" (the baseline runs steps x {1 + spec.k} steps for the transcript), more than the"
            f" max_seq_len {model.max_seq_len} of model {opts.model}: fewer --steps"
        )


def run_spec_decode(opts: DecodeOptions, model: ModelConfig, per_die, ids,
                    split: Split | None = None) -> dict:  # fmt: skip
    """Launch one pod; baseline and MTP runs; the summary (module docstring). `split`: a split
    pod, `per_die` / `ids` then per attention die."""
    spec = opts.spec
    model = spec_model(model, spec)
    prompts = [p for ps in per_die for p in ps]
    check_spec(opts, model, prompts)
    positions = spec_positions(prompts, opts.steps, spec)
    bs = opts.block_size
    per = max(len(x) for x in ids)
    cfg = pod_config_for(
        model, opts.dies,
        max_rows=max(max(sum(len(p) for p in ps) for ps in per_die), per * (1 + spec.k)),
        num_blocks=per * -(-positions // bs), block_size=bs, quant=opts.quant,
        combine_dtype=opts.combine_dtype, trace=bool(opts.trace), timeout_s=opts.timeout_s,
        pin=opts.pin, wait=opts.wait, expert_dies=opts.expert_dies or None,
        **({"cores": opts.cores} if opts.cores else {}),
    )  # fmt: skip
    base = SpecDecodeSpec(
        model,
        per_die,
        ids,
        opts.steps * (1 + spec.k),
        NO_MTP,
        opts.protocol,
        opts.quant,
        opts.temperature,
        opts.seed,
        bs,
        positions=positions,
        split=split,
    )
    progress(
        f"xpod decode: model {opts.model} + 1 MTP module ({model.n_layers} layers), {opts.dies}"
        f" dies, batch {opts.batch}, prompt {opts.prompt_len}; MTP k={spec.k} draft"
        f" {spec.label}: {opts.steps} steps, against {base.steps} steps without MTP"
        f" (baseline and transcript), same pod"
    )
    t0 = time.monotonic()
    with prepared_for_fork(model):
        pod_cm = Pod.launch(cfg if opts.trace else cfg.replace(trace=False))
    runs = []
    with pod_cm as pod:
        progress(f"  pod {pod.pod_id} up in {time.monotonic() - t0:.1f} s")
        for i in range(opts.repeat):
            progress(f"  run {i + 1} of {opts.repeat}: without MTP ...")
            b = _attention(pod.run(spec_decode_main,
                                   dataclasses.replace(base, keep_kv=opts.check)))  # fmt: skip
            tr = {r: toks for res in b for r, toks in zip(res["request_ids"], res["tokens"],
                                                          strict=True)}  # fmt: skip
            run = dataclasses.replace(base, steps=opts.steps, spec=spec, keep_logits=opts.check,
                                      keep_kv=opts.check,
                                      transcripts=tr if spec.transcript else {})  # fmt: skip
            progress(f"  run {i + 1} of {opts.repeat}: with MTP ...")
            runs.append((b, _attention(pod.run(spec_decode_main, run)), tr))
        if opts.trace:
            n = pod.write_trace(opts.trace)
            progress(f"  wrote {n} trace events to {opts.trace}")
    order = sorted(range(len(runs)), key=lambda i: _decode_s(runs[i][1]))
    b, m, tr = runs[order[len(runs) // 2]]
    out = summary(b, m, tr, opts, spec)
    if opts.repeat > 1:
        out["speedup_runs"] = [round(_tps(mm) / _tps(bb), 4) for bb, mm, _ in runs]
    if split is not None:
        out.update(layout="split", attention_dies=len(split.att_dies),
                   expert_dies=len(split.exp_dies), domains=split.num_domains,
                   microbatches=split.microbatches)  # fmt: skip
    if opts.check:
        out.update(check_reference(m, per_die, ids, opts, model, spec, tr, split))
        out["kv_rows_equal_no_mtp"] = kv_equal_no_mtp(b, m, model)
    if opts.project is not None:  # a capture pod of --project-steps steps, replayed
        from runtime.decode.project import project_decode

        cap = dataclasses.replace(base, steps=opts.project_steps, spec=spec,
                                  transcripts=tr if spec.transcript else {})  # fmt: skip
        out.update(project_decode(opts, model, spec_decode_main, cap, cfg))
    return out


def kv_equal_no_mtp(b: list[dict], m: list[dict], model: ModelConfig) -> bool:
    """Whether every request's main-layer KV rows after the MTP run (rejected drafts
    overwritten) equal the run without MTP's at the same positions (bit for bit: expected
    under batch invariance)."""
    base = {r: rows for res in b for r, rows in res["kv_rows"].items()}
    n = model.n_layers
    return all(np.array_equal(rows[:n], base[r][:n, : rows.shape[1]])
               for res in m for r, rows in res["kv_rows"].items())  # fmt: skip


def _attention(res: list[dict]) -> list[dict]:
    """The results of the dies that decode (a split pod's attention dies; every die else)."""
    return [r for r in res if r.get("role") != "expert"]


def _decode_s(res: list[dict]) -> float:
    return max(r["decode_ns"] for r in res) / 1e9


def _tps(res: list[dict]) -> float:
    emitted = sum(len(t) - 1 for r in res for t in r["tokens"])  # after the prefill's token
    return emitted / _decode_s(res) if _decode_s(res) else 0.0


def _step_ms(res: list[dict], key: str = "step_ns") -> float:
    per_step = np.max(np.array([r[key] for r in res], np.float64), axis=0) / 1e6
    return float(np.median(per_step)) if per_step.size else 0.0


def summary(b: list[dict], m: list[dict], tr: dict, opts: DecodeOptions,
            spec: SpecConfig) -> dict:  # fmt: skip
    """The figures of one baseline + MTP pair (issue 31's keys)."""
    st = merged_stats(m, spec)
    step_ms, base_ms = _step_ms(m), _step_ms(b)
    mtp_ms = _step_ms(m, "mtp_ns")
    ratio = step_ms / base_ms if base_ms else None
    tps, tps0 = _tps(m), _tps(b)
    rows = sum(len(r["request_ids"]) for r in m) * opts.steps
    emitted = sum(len(t) - 1 for r in m for t in r["tokens"])
    identical = all(tr[rid][: len(t)] == t for r in m
                    for rid, t in zip(r["request_ids"], r["tokens"], strict=True))  # fmt: skip
    mal = st["mean_acceptance_length"]
    return {
        "bench": "decode-mtp", "model": opts.model, "dies": opts.dies, "batch": opts.batch,
        "prompt_len": opts.prompt_len, "steps": opts.steps, "quant": opts.quant or "none",
        "temperature": opts.temperature, "batch_invariant": bool(opts.overrides.get(
            "batch_invariant")),
        **st,
        "tokens_per_step": emitted / rows if rows else None,
        "step_ms": step_ms, "step_ms_no_mtp": base_ms, "step_ratio": ratio,
        "mtp_ms_per_step": mtp_ms,
        "verify_ratio": (step_ms - mtp_ms) / base_ms if base_ms else None,
        "tokens_per_s": tps, "tokens_per_s_no_mtp": tps0,
        "speedup": tps / tps0 if tps0 else None,
        "predicted_speedup": mal / ratio if mal and ratio else None,
        "tokens_identical": identical,
        "draft_model_agreement": sum(r["model_agree"] for r in m) / st["num_draft_tokens"]
        if spec.transcript and st["num_draft_tokens"] else None,
        "prefill_ms": max(r["prefill_ns"] for r in m) / 1e6,
    }  # fmt: skip


def check_reference(m: list[dict], per_die, ids, opts: DecodeOptions, model: ModelConfig,
                    spec: SpecConfig, tr: dict, split: Split | None = None) -> dict:  # fmt: skip
    """The single-process reference of the same speculative schedule (a split pod's:
    `SplitReference`): tokens and every verify row's logits must be equal bit for bit (float32
    dispatch), the accounting the same."""
    from runtime.model.reference import ReferencePod
    from runtime.model.split_reference import SplitReference
    from runtime.pod.proc import limit_blas_threads

    limit_blas_threads(1)  # as on the dies: a multithreaded matmul sums in another order
    progress("  --check: single-process reference of the speculative schedule ...")
    if split is not None:
        ref = SplitReference(model, split, quant=opts.quant, combine_dtype=opts.combine_dtype)
    else:
        ref = ReferencePod(model, opts.dies, quant=opts.quant, combine_dtype=opts.combine_dtype)
    streams = reference_decode(
        ref,
        per_die,
        ids,
        opts.steps,
        spec,
        opts.temperature,
        opts.seed,
        tr if spec.transcript else None,
        keep_logits=True,
    )
    mism, logits_equal = 0, True
    for d, res in enumerate(m):
        for s, toks, lgs in zip(streams[d], res["tokens"], res["logits"], strict=True):
            mism += sum(a != b for a, b in zip(s.tokens, toks, strict=False))
            mism += abs(len(s.tokens) - len(toks))
            logits_equal &= len(s.logits) == len(lgs) and all(
                np.array_equal(a, b) for a, b in zip(s.logits, lgs, strict=True)
            )
    from runtime.model.mtp import stats

    kv_equal = True  # every layer's rows, the MTP module's too, against the reference's store
    for d, res in enumerate(m):
        die = ref.dies[d] if hasattr(ref, "dies") else None
        for s in streams[d]:
            rows = res["kv_rows"].get(s.rid)
            if die is None or rows is None or not hasattr(die.kv, "get"):
                continue
            for layer in range(model.kv_layers):
                want = die.kv.get(s.rid, layer)[: rows.shape[1]]
                kv_equal &= np.array_equal(rows[layer], want)
    ref_stats = stats([s for die in streams for s in die], spec)
    same = all(ref_stats[k] == merged_stats(m, spec)[k]
               for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"))  # fmt: skip
    return {"mismatched_tokens": int(mism), "logits_bit_equal": bool(logits_equal),
            "accounting_equal": bool(same), "kv_rows_equal_reference": bool(kv_equal),
            "replay_bit_equal": bool(mism == 0 and logits_equal and same and kv_equal)}  # fmt: skip


def print_spec(s: dict) -> None:
    """The MTP run's figures against the baseline's."""
    print(
        f"\ndecode with MTP: {s['dies']} dies, model {s['model']}, batch {s['batch']}, prompt"
        f" {s['prompt_len']}, {s['steps']} steps, k={s['spec_tokens']} draft {s['draft_mode']}"
    )
    acc = s["acceptance_rate"]
    per = ", ".join("-" if p is None else f"{p:.3f}" for p in s["acceptance_per_pos"])
    print(f"  drafts {s['num_drafts']} rows / {s['num_draft_tokens']} tokens, accepted"
          f" {s['num_accepted_tokens']} ({'-' if acc is None else f'{acc:.3f}'}; per position"
          f" {per}); mean acceptance length {s['mean_acceptance_length'] or 0:.3f}; tokens per"
          f" step {s['tokens_per_step'] or 0:.3f}")  # fmt: skip
    print(f"  step {s['step_ms']:.2f} ms (MTP {s['mtp_ms_per_step']:.2f} ms) vs"
          f" {s['step_ms_no_mtp']:.2f} ms without: step ratio {s['step_ratio'] or 0:.2f}"
          f" (verify {s['verify_ratio'] or 0:.2f})")  # fmt: skip
    print(
        f"  tokens/s {s['tokens_per_s']:.1f} vs {s['tokens_per_s_no_mtp']:.1f} without:"
        f" speedup {s['speedup'] or 0:.2f}x (predicted {s['predicted_speedup'] or 0:.2f}x)"
    )
    print(f"  tokens identical to the run without MTP: {s['tokens_identical']}"
          + ("" if s["batch_invariant"] else " (default mode: a verify row may differ in the"
             " last bits from a one-row step; --batch-invariant makes it exact)"))  # fmt: skip
    if "replay_bit_equal" in s:
        print(f"  --check: reference of the same schedule: {s['mismatched_tokens']} tokens"
              f" differ, verify logits bit-equal {s['logits_bit_equal']}, accounting equal"
              f" {s['accounting_equal']}, KV rows of every layer equal"
              f" {s['kv_rows_equal_reference']}")  # fmt: skip
        print(f"  --check: main-layer KV rows after rejected drafts equal the run without MTP:"
              f" {s['kv_rows_equal_no_mtp']}")  # fmt: skip


__all__ = ["check_spec", "print_spec", "run_spec_decode", "spec_model", "spec_positions"]
