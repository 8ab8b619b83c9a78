"""argparse types of the `xpod` command line: every flag is checked where it is parsed.

A type raises `argparse.ArgumentTypeError`, so argparse itself reports the flag, e.g.
`xpod decode: error: argument --block-size: 0 is not an integer >= 1`, and exits with status 2
(`Parser` keeps that to one line). Checks that need several flags, or a `PodConfig` / model, run
before any process starts and raise `ConfigError` naming the flag(s) (`flag_error`;
`runtime.cli.flags.load_config`); `runtime.cli.main` prints those the same way, with status 2.

`bench/` sits above `runtime/` and imports these too; `bench.common.parse_size` is `parse_size`.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import NoReturn, TypeVar

from memory.errors import ConfigError

SIZE_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
T = TypeVar("T")


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, `prog: error: message`, with status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, error_line(self.prog, message))


def error_line(prog: str, message: object) -> str:
    """`prog: error: message` on one line (newlines of the message folded)."""
    return f"{prog}: error: {' '.join(str(message).split())}\n"


def _shown(text: str) -> str:
    return text if text.strip() and text == text.strip() else repr(text)


# -- numbers ---------------------------------------------------------------------------------------


def int_range(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """An argparse type: an integer in [lo, hi] (no upper bound when hi is None)."""
    want = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{_shown(text)} is not {want}") from None
        if value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(f"{_shown(text)} is not {want}")
        return value

    parse.__name__ = "int"
    return parse


def float_range(lo: float, *, above: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number >= lo (> lo if `above`)."""
    want = f"a number {'>' if above else '>='} {lo:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{_shown(text)} is not {want}") from None
        if not math.isfinite(value) or value < lo or (above and value == lo):
            raise argparse.ArgumentTypeError(f"{_shown(text)} is not {want}")
        return value

    parse.__name__ = "float"
    return parse


positive_int = int_range(1)
nonneg_int = int_range(0)
positive_float = float_range(0.0, above=True)
nonneg_float = float_range(0.0)


# -- sizes -----------------------------------------------------------------------------------------


def parse_size(text: str) -> int:
    """'8', '4096', '4k', '4K', '8M', '64MiB' -> bytes; ValueError unless a positive size."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    mult = 1
    if t and t[-1] in SIZE_UNITS:
        mult = SIZE_UNITS[t[-1]]
        t = t[:-1]
    try:
        value = int(t) * mult
    except ValueError:
        raise ValueError(
            f"bad size {text!r}: use bytes or a K/M/G suffix, e.g. 8,4096,8M"
        ) from None
    if value <= 0:
        raise ValueError(f"bad size {text!r}: must be positive")
    return value


def fmt_size(n: int) -> str:
    """Bytes as parse_size reads them back: 1048576 -> '1M', 4096 -> '4K', 100 -> '100'."""
    for unit, div in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def size(text: str) -> int:
    """An argparse type: a size in bytes >= 1, e.g. 4096, 4K, 8M, 1G."""
    try:
        return parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{_shown(text)} is not a size >= 1 byte, such as 8, 4096, 4K, 8M or 1G"
        ) from None


# -- comma lists -----------------------------------------------------------------------------------


def _items(text: str, what: str) -> list[str]:
    items = [v.strip() for v in text.split(",") if v.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"{text!r} is empty: give a comma list of {what}")
    return items


def _each(text: str, what: str, one: Callable[[str], T]) -> list[T]:
    """`one` of every item of the comma list `text`; an error names the list it is in."""
    items = _items(text, what)
    try:
        return [one(v) for v in items]
    except argparse.ArgumentTypeError as e:
        if len(items) == 1:
            raise
        raise argparse.ArgumentTypeError(f"{e} (in {text})") from None


def int_list(lo: int = 1, hi: int | None = None) -> Callable[[str], list[int]]:
    """An argparse type: a non-empty comma list of integers in [lo, hi], e.g. '4,8'."""
    one = int_range(lo, hi)
    want = f"integers >= {lo}" if hi is None else f"integers in [{lo}, {hi}]"

    def parse(text: str) -> list[int]:
        return _each(text, want, one)

    parse.__name__ = "int list"
    return parse


def size_list(text: str) -> list[int]:
    """An argparse type: a non-empty comma list of sizes, e.g. '8,4K,1M'."""
    return _each(text, "sizes", size)


def choice_list(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    """An argparse type: a non-empty comma list of names out of `allowed`, e.g. 'mte,dma'."""
    names = ", ".join(allowed)

    def one(name: str) -> str:
        if name not in allowed:
            raise argparse.ArgumentTypeError(f"{name!r} is not one of {names}")
        return name

    def parse(text: str) -> list[str]:
        return _each(text, names, one)

    parse.__name__ = "choice list"
    return parse


# -- files -----------------------------------------------------------------------------------------


def input_file(text: str) -> str:
    """An argparse type: a readable file."""
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"{_shown(text)}: no such file")
    if not os.access(text, os.R_OK):
        raise argparse.ArgumentTypeError(f"{_shown(text)}: not readable")
    return text


def output_file(text: str) -> str:
    """An argparse type: a file this process may create or overwrite (checked now, not after
    a run): not a directory, in an existing writable directory."""
    if not text.strip():
        raise argparse.ArgumentTypeError(f"{_shown(text)} is not a file name")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{_shown(text)} is a directory, not a file")
    parent = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"{_shown(text)}: directory {parent} does not exist")
    writable = os.access(text, os.W_OK) if os.path.exists(text) else os.access(parent, os.W_OK)
    if not writable:
        raise argparse.ArgumentTypeError(f"{_shown(text)}: not writable")
    return text


# -- errors found after parsing (several flags, PodConfig, model) ----------------------------------


def flag_error(err: ConfigError, flags: Mapping[str, str], toml: str | None = None) -> ConfigError:
    """`err` with the flag(s) that set the field(s) it names in front, on one line.

    The fields are the text before the message's first ':' split on '/' (`PodConfig` and
    `ModelConfig` messages start so); `flags` maps a field to its flag(s), e.g.
    {"num_dies": "--dies", "app_bytes": "--size/--dies"}. A field no flag set came from the TOML
    file `toml`, if one was given (then the flag named is --config).
    """
    msg = " ".join(str(err).split())
    fields = msg.split(":", 1)[0].split("/")
    named = [f for field in fields if field in flags for f in flags[field].split("/")]
    if named:
        return ConfigError(f"argument {'/'.join(dict.fromkeys(named))}: {msg}")
    if toml:
        return ConfigError(f"argument --config: {msg}")
    return ConfigError(msg)


__all__ = [
    "Parser",
    "choice_list",
    "error_line",
    "flag_error",
    "float_range",
    "fmt_size",
    "input_file",
    "int_list",
    "int_range",
    "nonneg_float",
    "nonneg_int",
    "output_file",
    "parse_size",
    "positive_float",
    "positive_int",
    "size",
    "size_list",
]
