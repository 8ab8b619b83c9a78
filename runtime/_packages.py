"""Make `sched` mean xpod's package, not the standard library's `sched` module.

The product's top-level package names are fixed, and one of them, `sched`, is also a module of
the standard library. The stdlib directory comes before an installed project on `sys.path`
(and setuptools' editable finder is consulted last), so outside the repository root a plain
`import sched` would find the standard one. `runtime/__init__.py` calls `use_our_sched()` before
any module of ours imports `sched`; it registers our package from beside `runtime/` as `sched`
(loaded on first use). (A process that imported the stdlib `sched` before xpod keeps its own
reference.)
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

OURS = Path(__file__).resolve().parent.parent / "sched" / "__init__.py"


def use_our_sched() -> None:
    mod = sys.modules.get("sched")
    if mod is not None and Path(getattr(mod, "__file__", "") or "").resolve() == OURS:
        return
    spec = importlib.util.spec_from_file_location(
        "sched", OURS, submodule_search_locations=[str(OURS.parent)]
    )
    # Registered now, executed on first use (importlib's LazyLoader): `sched` pulls in numpy,
    # and a command that never schedules (`xpod clean`, `--help`) should not pay for it.
    loader = importlib.util.LazyLoader(spec.loader)
    spec.loader = loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["sched"] = module
    loader.exec_module(module)
