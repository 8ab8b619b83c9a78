"""The pod flags (`xpod run`, `xpod layout`, and the benchmarks that launch a bare pod) and the
PodConfig they make: the flags win over a TOML file (`--config`), which wins over the defaults;
a bad value names the flag that set it."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from memory.errors import ConfigError
from runtime.cli.argtypes import flag_error, input_file, output_file, positive_float, positive_int
from runtime.pod.config import PodConfig

POD_FLAGS = {
    "num_dies": "--dies",
    "lanes": "--lanes",
    "slot_bytes": "--slot-bytes",
    "ring_slots": "--ring-slots",
    "timeout_s": "--timeout",
    "trace": "--trace",
}


def add_pod_flags(p: argparse.ArgumentParser) -> None:
    """The pod flags of `xpod run` and `xpod layout` (unset: the TOML file's or the default)."""
    p.add_argument(
        "--dies", type=positive_int, default=None, help="dies in the pod (PodConfig.num_dies)"
    )
    p.add_argument("--config", type=input_file, default=None, help="PodConfig TOML file")
    p.add_argument("--lanes", type=positive_int, default=None, help="AIV lanes per die")
    p.add_argument("--slot-bytes", type=positive_int, default=None, help="ring slot bytes")
    p.add_argument("--ring-slots", type=positive_int, default=None, help="slots per ring")
    p.add_argument("--timeout", type=positive_float, default=None, help="wait deadline, seconds")
    p.add_argument(
        "--trace", type=output_file, default=None, help="write a Chrome/Perfetto trace to FILE"
    )


def pod_config(args: argparse.Namespace, flags: dict[str, str] | None = None, **extra) -> PodConfig:
    """The PodConfig of the pod flags and `extra`; a ConfigError names the flag (`flags` maps
    the fields of `extra` to the flags they come from)."""
    return load_config(
        args.config,
        {**POD_FLAGS, **(flags or {})},
        num_dies=args.dies,
        lanes=args.lanes,
        slot_bytes=args.slot_bytes,
        ring_slots=args.ring_slots,
        timeout_s=args.timeout,
        trace=True if args.trace else None,
        **extra,
    )


def load_config(toml: str | None, flags: Mapping[str, str], **values: object) -> PodConfig:
    """`PodConfig.load(toml, **values)`; a ConfigError names the flag that set the bad field.

    `flags` maps PodConfig fields to flags (see `flag_error`); a field maps only if its value
    here is not None (an unset flag leaves the field to the TOML file or the default).
    """
    try:
        return PodConfig.load(toml, **values)
    except ConfigError as e:
        given = {k: v for k, v in flags.items() if values.get(k) is not None}
        raise flag_error(e, given, toml) from None
