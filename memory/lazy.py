"""Package re-exports loaded on first use (PEP 562 module `__getattr__`).

A package `__init__` that re-exports its public names eagerly makes importing any of its
modules import all of them: `from memory.errors import ConfigError` would load numpy and
posix_ipc, and `xpod clean` would load the whole pod. With `lazy_exports` the `__init__` names
each public name's home module, and a name is imported when someone first asks for it.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping


def lazy_exports(
    package: str, homes: Mapping[str, str]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """`(__getattr__, __dir__)` for `package`, whose names `homes` maps to their modules."""
    module = sys.modules[package]

    def __getattr__(name: str) -> object:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(home), name)
        setattr(module, name, value)  # once: later lookups find it without coming here
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(module)) | set(homes))

    return __getattr__, __dir__
