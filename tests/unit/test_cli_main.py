"""`runtime.cli.main`: the command table names real modules with the command interface, its bench
help lines are the modules' own, and a command imports only what it runs (checked in a fresh
interpreter: what `sys.modules` holds after `xpod <argv>`)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from runtime.cli.main import BENCHES, COMMANDS, build_parser, selected

ROOT = Path(__file__).resolve().parents[2]
INTERFACE = ("add_args", "parse_options", "run")


@pytest.mark.parametrize("name", [n for n, (m, _) in COMMANDS.items() if m])
def test_every_command_module_has_the_interface(name):
    module, _ = COMMANDS[name]
    # `project` launches capture pods for --validate / --calibrate: its front is in bench/
    assert module.startswith("runtime.cli.") or (name, module) == ("project", "bench.project.cli")
    mod = importlib.import_module(module)
    missing = [f for f in INTERFACE if not callable(getattr(mod, f, None))]
    assert not missing, f"{module} lacks {missing}"


@pytest.mark.parametrize("name", sorted(BENCHES))
def test_every_bench_module_has_the_interface_and_its_help_line(name):
    module, help_ = BENCHES[name]
    assert module == f"bench.{name}"
    mod = importlib.import_module(module)
    missing = [f for f in INTERFACE if not callable(getattr(mod, f, None))]
    assert not missing, f"{module} lacks {missing}"
    assert help_ == (mod.__doc__ or "").strip().splitlines()[0], "the table's help line drifted"


def test_every_bench_module_is_in_the_table():
    found = {p.stem for p in (ROOT / "bench").glob("*.py") if _is_bench(p.stem)}
    found |= {
        p.parent.name for p in (ROOT / "bench").glob("*/__init__.py") if _is_bench(p.parent.name)
    }
    assert found == set(BENCHES), (
        f"bench modules with a command, not in BENCHES: {found - set(BENCHES)}"
    )


def _is_bench(name: str) -> bool:
    mod = importlib.import_module(f"bench.{name}")
    return all(callable(getattr(mod, f, None)) for f in INTERFACE)


@pytest.mark.parametrize(
    "argv, want",
    [
        ([], (None, None)),
        (["--help"], (None, None)),
        (["decode", "--model", "tiny"], ("decode", None)),
        (["bench", "p2p", "--quick"], ("bench", "p2p")),
        (["bench", "--help"], ("bench", None)),
        (["bench", "--json", "x", "p2p"], ("bench", None)),
    ],
)
def test_selected(argv, want):
    assert selected(argv) == want


def test_the_lazy_parser_parses_like_the_full_one():
    for argv in (["run", "--dies", "2", "--size", "4K"], ["bench", "ring", "--quick"],
                 ["layout", "--dies", "8"], ["clean", "--dry-run"]):  # fmt: skip
        lazy = vars(build_parser(argv).parse_args(argv))
        full = vars(build_parser().parse_args(argv))
        assert lazy == full, argv


IMPORTED = textwrap.dedent(
    """
    import contextlib, io, json, sys
    from runtime.cli.main import main
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        main(sys.argv[1:])
    print(json.dumps(sorted(sys.modules)))
    """
)


def imported_by(*argv: str) -> set[str]:
    r = subprocess.run([sys.executable, "-c", IMPORTED, *argv], cwd=ROOT, capture_output=True,
                       text=True, timeout=60, check=True)  # fmt: skip
    return set(json.loads(r.stdout.strip().splitlines()[-1]))


def _ours(mods: set[str], prefix: str) -> set[str]:
    return {m for m in mods if m == prefix or m.startswith(prefix + ".")}


def test_help_imports_no_command():
    mods = imported_by("--help")
    assert not _ours(mods, "numpy") and not _ours(mods, "bench")
    for part in ("runtime.pod", "runtime.model", "runtime.engine", "runtime.api", "comm"):
        assert not _ours(mods, part), part
    assert not {m for m in mods if m.startswith("runtime.cli.") and m not in
                ("runtime.cli.main", "runtime.cli.argtypes")}  # fmt: skip


def test_clean_imports_the_control_segment_only():
    mods = imported_by("clean", "--dry-run")
    assert "runtime.pod.control" in mods
    for part in ("bench", "comm", "runtime.model", "runtime.engine", "runtime.api", "sched.eplb"):
        assert not _ours(mods, part), part
    assert "runtime.pod.launcher" not in mods


def test_a_bench_imports_only_its_own_bench_module():
    mods = imported_by("bench", "ring", "--help")
    assert "bench.ring" in mods
    others = {f"bench.{n}" for n in BENCHES} - {"bench.ring"}
    assert not others & mods, others & mods
    assert not _ours(mods, "runtime.engine") and not _ours(mods, "runtime.api")
