"""`xpod decode`: the flags, parsed and checked (the model against the pod, prompt + steps
against the context, the PodConfig the run will size) before any process starts; then the run
(`runtime.decode`), its report and its exit status."""

from __future__ import annotations

import argparse
import json

from memory.errors import ConfigError
from runtime.cli.argtypes import (
    flag_error,
    int_range,
    nonneg_float,
    nonneg_int,
    output_file,
    positive_float,
    positive_int,
)
from runtime.cli.hosts import add_host_args, host_fields
from runtime.cli.model_flags import (
    add_alltoall_flags,
    add_eplb_flags,
    add_model_flags,
    add_pin_flag,
    add_spec_flags,
    add_split_flags,
    eplb_config,
    model_overrides,
    quant_of,
    spec_of,
    split_dies,
)
from runtime.cli.project_flags import (
    add_project_args,
    card_flags,
    card_model,
    check_project,
    project_options,
)
from runtime.decode.options import EPLB_MODES, MAX_BATCH, DecodeOptions, progress
from runtime.decode.report import jsonable, print_eplb, print_summary
from runtime.decode.run import check_microbatches, make_split, pod_config, run_decode
from runtime.decode.split import print_split
from runtime.model import ModelConfig


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dies", type=positive_int, default=4, help="dies in the pod (default 4)")
    p.add_argument(
        "--batch",
        type=int_range(1, MAX_BATCH),
        default=None,
        help="global batch: requests over all dies (default 8; with --eplb compare 8 per die:"
        " with one request per die a step routes ~4 rows per die, and its busiest die is noise)",
    )
    p.add_argument("--prompt-len", type=positive_int, default=64, help="prompt tokens per request")
    p.add_argument(
        "--steps", type=positive_int, default=32, help="decode steps (tokens per request)"
    )
    add_model_flags(p)
    p.add_argument(
        "--groups",
        default=None,
        metavar="N_GROUP:TOPK_GROUP",
        help="group-limited routing, e.g. 8:4 (DeepSeek-V3's); default: the preset's",
    )
    add_eplb_flags(p, EPLB_MODES, every=8, window="decode")
    p.add_argument("--dies-per-node", type=nonneg_int, default=0,
                   help="EPLB: nodes of N dies; the deepseek policy keeps each expert group on"
                   " one node (0: one node)")  # fmt: skip
    add_alltoall_flags(p)
    p.add_argument("--temperature", type=nonneg_float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=nonneg_int, default=0, help="prompts, weights and sampling seed")
    p.add_argument("--check", action="store_true", help="compare with the reference, same run")
    p.add_argument(
        "--repeat",
        type=positive_int,
        default=1,
        help="decode R times in one pod; with --check each pod run is followed by the whole"
        " batch in one process, alternating, and the medians and per-pair ratios are reported",
    )
    p.add_argument("--trace", type=output_file, default=None, help="write a Perfetto trace to FILE")
    p.add_argument(
        "--json", type=output_file, default=None, help="append the summary as one JSON line to FILE"
    )
    p.add_argument("--block-size", type=positive_int, default=16, help="KV cache block (tokens)")
    p.add_argument("--timeout", type=positive_float, default=120.0, help="wait deadline, seconds")
    add_host_args(p)
    add_pin_flag(p)
    p.add_argument(
        "--wait", default="auto", choices=("auto", "spin", "yield"), help="PodConfig.wait"
    )
    add_split_flags(p)
    add_spec_flags(p)
    add_project_args(p)


# ModelConfig / PodConfig fields -> the flags that set them (for errors found after parsing)
_MODEL_FLAGS = {
    "preset": "--model",
    "score_bias": "--score-bias",
    "n_group": "--groups",
    "topk_group": "--groups",
    "seed": "--seed",
    "num_dies": "--dies",
    "expert_dies": "--dies/--expert-dies",
    "num_experts": "--experts/--dies/--expert-dies",
}
_POD_FLAGS = {
    "num_dies": "--dies",
    "a2a_max_batch": "--batch/--prompt-len/--dies",
    "app_bytes": "--batch/--prompt-len/--steps/--block-size/--dies",
    "trace_capacity": "--trace",
    "timeout_s": "--timeout",
}


def parse_options(args: argparse.Namespace) -> DecodeOptions:
    """DecodeOptions of the parsed flags, checked as `run_decode` will before launching: the
    model against the pod, prompt + steps against max_seq_len, the PodConfig it sizes.

    Raises:
        ConfigError naming the flag(s).
    """
    args.dies, host_cfg = host_fields(args, args.dies, 4)
    dies, att, exp = split_dies(args)
    opts = DecodeOptions(
        dies=dies,
        attention_dies=att,
        expert_dies=exp,
        domains=args.domains,
        microbatches=args.microbatches,
        batch=args.batch
        if args.batch is not None
        else (8 * args.dies if args.eplb == "compare" else 8),
        prompt_len=args.prompt_len,
        steps=args.steps,
        model=args.model,
        quant=quant_of(args),
        combine_dtype=args.combine_dtype,
        protocol=args.protocol,
        temperature=args.temperature,
        seed=args.seed,
        check=args.check,
        repeat=args.repeat,
        trace=args.trace,
        json=args.json,
        block_size=args.block_size,
        timeout_s=args.timeout,
        overrides=_model_overrides(args),
        pin=args.pin,
        wait=args.wait,
        eplb=args.eplb,
        eplb_config=eplb_config(args, dies_per_node=args.dies_per_node),
        spec=spec_of(args),
        **project_options(args),
        **host_cfg,
    )
    _check_options(opts)
    return opts


def _model_overrides(args: argparse.Namespace) -> dict:
    """ModelConfig overrides of the flags: the seed, --score-bias, --groups."""
    out: dict = {"seed": args.seed, **model_overrides(args)}
    if args.groups is not None:
        try:
            n_group, topk_group = (int(v) for v in args.groups.split(":"))
        except ValueError:
            raise ConfigError(
                f"argument --groups: expected N_GROUP:TOPK_GROUP (e.g. 8:4), got {args.groups!r}"
            ) from None
        out.update(n_group=n_group, topk_group=topk_group)
    return out


def _check_options(opts: DecodeOptions) -> None:
    try:  # with --model-card: the card's structure (the model the run will have)
        model = card_model(opts, ModelConfig.preset(opts.model, **opts.overrides))
        model.validate(opts.dies, opts.expert_dies or None)
    except ConfigError as e:
        raise flag_error(e, card_flags(opts, _MODEL_FLAGS)) from None
    check_project(opts, model)  # --project, --model-card, --context, ...
    if opts.split:
        try:
            make_split(opts, model)
        except ConfigError as e:
            raise ConfigError(f"argument --attention-dies/--expert-dies/--domains: {e}") from None
    elif opts.domains != 1:
        raise ConfigError("argument --domains: need --attention-dies")
    elif opts.microbatches != 1:
        try:
            check_microbatches(opts)
        except ConfigError as e:
            raise ConfigError(f"argument --microbatches: {e}") from None
    if opts.repeat > 1 and opts.eplb == "compare":
        raise ConfigError("argument --repeat: --eplb compare runs its own pair of pods; drop one")
    if opts.spec is not None:
        from runtime.decode.spec_run import check_spec, spec_model

        try:
            check_spec(opts, spec_model(model, opts.spec), [range(opts.prompt_len)])
        except ConfigError as e:
            raise ConfigError(f"argument --num-speculative-tokens/--steps: {e}") from None
        return
    if opts.prompt_len + opts.steps > model.max_seq_len:
        raise ConfigError(
            f"argument --prompt-len/--steps: prompt_len + steps = {opts.prompt_len + opts.steps}"
            f" exceeds the max_seq_len {model.max_seq_len} of model {opts.model}"
        )
    # the PodConfig run_decode will size (make_prompts: every prompt has prompt_len tokens)
    prompt = range(opts.prompt_len)
    per_die = [[prompt] * len(range(d, opts.batch, opts.dies)) for d in range(opts.dies)]
    eplb = None if opts.eplb == "off" else opts.eplb_config
    if eplb is not None:
        try:
            eplb.check(model, opts.dies)
        except ConfigError as e:
            raise ConfigError(f"argument --eplb/--redundant/--dies-per-node/--model: {e}") from None
        if opts.eplb == "compare" and opts.steps < eplb.every + model.n_layers + 2:
            raise ConfigError(
                f"argument --steps: --eplb compare measures after the first switch, at step"
                f" {eplb.every + 1 + model.n_layers - model.n_dense_layers}; give more steps"
                f" than that (e.g. --steps {2 * eplb.every + 2 * model.n_layers + 4})"
            )
    try:
        pod_config(model, per_die, opts, eplb)
    except ConfigError as e:
        raise flag_error(e, _POD_FLAGS) from None


def run(opts: DecodeOptions) -> int:
    s = run_decode(opts)
    if s.get("bench") == "decode-mtp":
        from runtime.decode.spec_run import print_spec

        print_spec(s)
    elif s.get("layout") == "split":
        print_split(s)
    elif s.get("bench") == "decode-eplb":
        print_eplb(s)
    else:
        print_summary(s)
        if "eplb" in s:
            print_eplb(s)
    if opts.project is not None:
        from runtime.decode.project import print_projection

        print_projection(s)
    if opts.json:
        with open(opts.json, "a") as f:
            f.write(json.dumps(s, default=jsonable) + "\n")
        progress(f"  appended the summary to {opts.json}")
    if s.get("projection_refused"):
        return 2
    if (
        opts.check
        and (opts.quant is None or opts.split)
        and (s["mismatched_tokens"] or not s["logits_bit_equal"])
    ):
        return 1
    if s.get("bench") == "decode-mtp":
        return 1 if opts.check and not s["replay_bit_equal"] else 0
    if s.get("bench") == "decode-eplb" and (s["mismatched_tokens"] or not s["logits_bit_equal"]):
        return 1
    return 0
