"""The projection flags of `xpod decode` (`--project`, `--model-card`, `--context`,
`--project-trace`, `--project-dir`, `--project-steps`; runtime.decode.project), parsed and
checked before any pod starts."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from runtime.cli.argtypes import int_range, output_file, positive_int
from runtime.decode.options import DecodeOptions
from runtime.decode.project import PROJECT_STEPS, TOY, card_model, check_projection
from runtime.model import ModelConfig
from runtime.model.card import CARDS, structure


def add_project_args(p: argparse.ArgumentParser) -> None:
    """The projection flags (module docstring)."""
    g = p.add_argument_group("projected hardware time (docs/projection.md §6; default: off)")
    g.add_argument("--project", default=None, metavar="PROFILE",
                   help="also project the decode step on a hardware profile (cm384, h800, host,"
                   " or a .toml path): a capture pod of the same configuration, replayed; adds"
                   " projected_step_ms, projected_layer_us, projected_tpot_ms,"
                   " projected_breakdown, ... to the summary, every figure printed as"
                   " 'projected (PROFILE, CARD, routing R, context N)'")  # fmt: skip
    g.add_argument("--model-card", default=None, metavar="CARD",
                   help=f"with --project: size every op and message by a real model's card"
                   f" ({', '.join(CARDS)}; default {TOY}: the run's own widths); the run's"
                   " model takes the card's structure (layers, dense layers, experts, top-k,"
                   " groups)")  # fmt: skip
    g.add_argument("--context", type=positive_int, default=None, metavar="N",
                   help="with --project: every row attends to N positions in the projection"
                   " (default: each row's own, prompt + step)")  # fmt: skip
    g.add_argument("--project-trace", type=output_file, default=None, metavar="FILE",
                   help="with --project: write a Perfetto trace in projected time (--trace"
                   " stays the host trace)")  # fmt: skip
    g.add_argument("--project-dir", default=None, metavar="DIR",
                   help="with --project: keep the captures in DIR/raw and DIR/projected"
                   " (re-project with `xpod project DIR/projected --profile P`); default: a"
                   " temporary directory")  # fmt: skip
    g.add_argument("--project-steps", type=int_range(2, 64), default=PROJECT_STEPS, metavar="N",
                   help=f"with --project: decode steps of the capture pod, the first a warm-up"
                   f" (default {PROJECT_STEPS})")  # fmt: skip


def project_options(args: argparse.Namespace) -> dict:
    """DecodeOptions fields of the projection flags."""
    return {"project": args.project, "model_card": args.model_card, "context": args.context,
            "project_trace": args.project_trace, "project_dir": args.project_dir,
            "project_steps": args.project_steps}  # fmt: skip


def card_flags(opts: DecodeOptions, flags: Mapping[str, str]) -> dict[str, str]:
    """`flags` (ModelConfig field -> flags) with the fields a model card sets named after
    --model-card too, when one is set: an error about them names the card's flag."""
    out = dict(flags)
    if opts.model_card in CARDS:
        for key in structure(CARDS[opts.model_card]):
            out[key] = "/".join(dict.fromkeys(["--model-card", *out.get(key, "").split("/")]))
            out[key] = out[key].rstrip("/")
    return out


def check_project(opts: DecodeOptions, model: ModelConfig) -> None:
    """The projection flags checked against `model` (the run's, `card_model` applied:
    `runtime.decode.project.check_projection`); ConfigError names the flag."""
    check_projection(opts, model)


__all__ = ["add_project_args", "card_flags", "card_model", "check_project", "project_options"]
