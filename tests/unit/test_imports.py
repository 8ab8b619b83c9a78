"""Import direction (docs/architecture.md §1): walk every module's AST, fail on an arrow up.

memory -> (nothing of ours); comm -> memory; sched -> nothing of ours; runtime -> memory, comm,
sched; bench and tests may import anything, and nothing else imports them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = {"memory", "comm", "sched", "runtime", "bench", "tests"}
ALLOWED = {
    "memory": {"memory"},
    "comm": {"memory", "comm"},
    "sched": {"sched"},
    "runtime": {"memory", "comm", "sched", "runtime"},
    "bench": OURS,
    "tests": OURS,
}


def imported_packages(path: Path) -> set[tuple[str, int]]:
    """(top-level package of ours, line) for every import in the file, nested ones included."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: stays inside its own package
                continue
            names = [node.module or ""]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top in OURS:
                found.add((top, node.lineno))
    return found


def package_files(pkg: str) -> list[Path]:
    return sorted(p for p in (ROOT / pkg).rglob("*.py") if ".venv" not in p.parts)


@pytest.mark.parametrize("pkg", sorted(ALLOWED))
def test_import_direction(pkg):
    files = package_files(pkg)
    if pkg in ("memory", "comm", "runtime"):
        assert files, f"package {pkg} has no modules"
    bad = []
    for path in files:
        for top, line in sorted(imported_packages(path)):
            if top not in ALLOWED[pkg]:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {top}")
    assert not bad, f"{pkg} may import only {sorted(ALLOWED[pkg])}:\n" + "\n".join(bad)


def test_checker_sees_nested_and_from_imports(tmp_path):
    src = tmp_path / "m.py"
    src.write_text(
        "import os\nfrom comm.trace import x\n\ndef f():\n    import runtime.pod\n"
        "    from . import sibling\n"
    )
    assert {t for t, _ in imported_packages(src)} == {"comm", "runtime"}


def test_every_package_is_covered():
    top = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    assert top <= set(ALLOWED), f"packages without an import rule: {sorted(top - set(ALLOWED))}"
