"""The flag groups of every command that runs the toy model (`xpod decode`, `generate`, `serve`,
`bench engine`, `bench serve`), defined once: the model, the MoE all-to-all, expert load
balancing, pinning. The commands differ only in the defaults they pass."""

from __future__ import annotations

import argparse

import comm
from comm.quant import COMBINE_DTYPES
from memory.errors import ConfigError
from runtime.cli.argtypes import nonneg_int, positive_int
from runtime.model import PRESETS, SCORE_BIASES, EPLBConfig
from sched.eplb import POLICIES


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """--model, --experts, --score-bias, --batch-invariant."""
    p.add_argument("--model", default="small", choices=tuple(PRESETS),
                   help="model preset (default small)")  # fmt: skip
    p.add_argument("--experts", type=positive_int, default=None, metavar="N",
                   help="routed experts (default: the preset's); they must split evenly over the"
                   " dies that host them (e.g. 30 for 5 or 6 expert dies)")  # fmt: skip
    p.add_argument("--max-seq-len", type=positive_int, default=None, metavar="N",
                   help="context length (default: the preset's: small 512); e.g. 2048 for the"
                   " 1K-token prompts of the PD interference phase")  # fmt: skip
    p.add_argument("--score-bias", default=None, choices=SCORE_BIASES,
                   help="router correction bias (default: the preset's); skew makes a few experts"
                   " hot")  # fmt: skip
    p.add_argument("--batch-invariant", action="store_true",
                   help="every row computed independently of its batch mates (fixed reduction"
                   " order for any row count): output does not change under load, a recomputed"
                   " stream equals the fault-free one bit for bit; slower")  # fmt: skip


def model_overrides(args: argparse.Namespace) -> dict:
    """ModelConfig overrides of --experts, --max-seq-len, --score-bias and --batch-invariant."""
    out: dict = {}
    if getattr(args, "experts", None) is not None:
        out["num_experts"] = args.experts
    if getattr(args, "max_seq_len", None) is not None:
        out["max_seq_len"] = args.max_seq_len
    if args.score_bias is not None:
        out["score_bias"] = args.score_bias
    if args.batch_invariant:
        out["batch_invariant"] = True
    return out


def add_spec_flags(p: argparse.ArgumentParser) -> None:
    """--speculative-config, --num-speculative-tokens, --mtp-draft (vLLM's names): MTP."""
    g = p.add_argument_group("multi-token prediction (001 §4.6; default: off)")
    g.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='e.g. \'{"method":"mtp","num_speculative_tokens":2,"draft":"fit"}\'',
    )
    g.add_argument("--num-speculative-tokens", type=nonneg_int, default=None, metavar="K",
                   help="K drafts per step from the model's MTP module (0-2; 0 = off)")  # fmt: skip
    g.add_argument("--mtp-draft", default=None, metavar="MODE",
                   help="real | fit (default: the MTP head fitted on the model's own text) |"
                   " oracle | synthetic:P1[,P2] (transcript drafts; benchmarks)")  # fmt: skip


def spec_of(args: argparse.Namespace):
    """The SpecConfig of the --speculative-config / --num-speculative-tokens / --mtp-draft
    flags, or None (off); ConfigError names the flag."""
    from runtime.model.mtp import spec_config

    try:
        return spec_config(getattr(args, "speculative_config", None),
                           getattr(args, "num_speculative_tokens", None),
                           getattr(args, "mtp_draft", None))  # fmt: skip
    except ConfigError as e:
        raise ConfigError(f"argument --speculative-config/--num-speculative-tokens/--mtp-draft:"
                          f" {e}") from None  # fmt: skip


def add_split_flags(p: argparse.ArgumentParser, what: str = "decode") -> None:
    """--attention-dies, --expert-dies, --domains, --microbatches: MoE-attention disaggregation."""
    g = p.add_argument_group("MoE-attention disaggregation (001 §5.2; default: colocated)")
    g.add_argument("--attention-dies", type=nonneg_int, default=0, metavar="A",
                   help=f"{what} on a split pod: A attention dies (the DP groups: MLA, KV, dense"
                   " layers, gate, shared expert) and the expert dies (routed experts in a"
                   " persistent loop); 0 = colocated (default)")  # fmt: skip
    g.add_argument("--expert-dies", type=nonneg_int, default=0, metavar="E",
                   help="expert dies (default: the rest of --dies); >= A (one trampoline per"
                   " attention die)")  # fmt: skip
    g.add_argument("--domains", type=positive_int, default=1, metavar="D",
                   help="DP domains: the attention dies in D groups that take turns on the"
                   " expert dies (1 <= D <= A)")  # fmt: skip
    g.add_argument("--microbatches", type=int, default=1, choices=(1, 2),
                   help="micro-batches per domain and layer (1 or 2)")  # fmt: skip


def split_dies(args: argparse.Namespace) -> tuple[int, int, int]:
    """(dies, attention dies, expert dies) of --dies / --attention-dies / --expert-dies."""
    a, e = args.attention_dies, args.expert_dies
    if not a:
        if e:
            raise ConfigError("argument --expert-dies: needs --attention-dies")
        return args.dies, 0, 0
    if not e:
        e = args.dies - a
    if e < 1:
        raise ConfigError(
            f"argument --expert-dies: {a} attention dies leave no expert die of --dies"
            f" {args.dies}; give --expert-dies"
        )
    return a + e, a, e


def add_alltoall_flags(p: argparse.ArgumentParser) -> None:
    """--protocol, --quant, --combine-dtype: the MoE dispatch / combine."""
    p.add_argument("--protocol", default="fused", choices=comm.alltoall.PROTOCOLS,
                   help="MoE all-to-all protocol (default fused)")  # fmt: skip
    p.add_argument("--quant", default="none", choices=("none", "int8"),
                   help="MoE dispatch quantization (default none)")  # fmt: skip
    p.add_argument("--combine-dtype", default="bfloat16", choices=COMBINE_DTYPES,
                   help="MoE combine rows in 16 bits (the paper's, default) or"
                   " float32")  # fmt: skip


def quant_of(args: argparse.Namespace) -> str | None:
    """The `quant` field of a config: None for `--quant none`."""
    return None if args.quant == "none" else args.quant


def add_eplb_flags(p: argparse.ArgumentParser, modes: tuple[str, ...], every: int,
                   window: str) -> None:  # fmt: skip
    """--eplb (one of `modes`), --redundant, --eplb-every (default `every` `window` steps),
    --eplb-policy."""
    p.add_argument("--eplb", default="off", choices=modes,
                   help="expert load balancing: " + ", ".join(modes))  # fmt: skip
    p.add_argument("--redundant", type=nonneg_int, default=1,
                   help="EPLB: redundant expert slots per die (default 1)")  # fmt: skip
    p.add_argument("--eplb-every", type=positive_int, default=every,
                   help=f"EPLB: {window} steps per load window; a plan after each (default"
                   f" {every})")  # fmt: skip
    p.add_argument("--eplb-policy", default="greedy", choices=POLICIES,
                   help="EPLB placement policy (default greedy, 001 §4.5)")  # fmt: skip


def eplb_config(args: argparse.Namespace, **extra) -> EPLBConfig:
    """The EPLBConfig of the EPLB flags (whether it is on is the caller's to say)."""
    return EPLBConfig(redundant_per_die=args.redundant, every=args.eplb_every,
                      policy=args.eplb_policy, **extra)  # fmt: skip


def add_pin_flag(p: argparse.ArgumentParser, what: str = "dies") -> None:
    p.add_argument("--pin", default="auto", choices=("auto", "on", "off"),
                   help=f"pin {what} to cores: auto (when they fit), on, off")  # fmt: skip
