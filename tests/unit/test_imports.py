"""Import direction (docs/architecture.md §1): walk every module's AST, fail on an arrow up.

Between packages: memory -> (nothing of ours); comm -> memory; sched -> nothing of ours;
runtime -> memory, comm, sched; bench and tests may import anything, and nothing else imports
them. Inside `runtime/`, sub-packages by role with their own down-only direction (RUNTIME_LAYERS).
Across the whole product: no import cycle between modules and no private name (`_x`) taken from
another module. Imports inside functions count: hiding an arrow in a function does not make it
point down.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = {"memory", "comm", "sched", "runtime", "bench", "tests"}
PRODUCT = ("memory", "comm", "sched", "runtime", "bench")
ALLOWED = {
    "memory": {"memory"},
    "comm": {"memory", "comm"},
    "sched": {"sched"},
    "runtime": {"memory", "comm", "sched", "runtime"},
    "bench": OURS,
    "tests": OURS,
}

# Inside runtime/: what each part may import besides itself (module-name prefixes). The root
# (`runtime/__init__`, `runtime._packages`) sits with the pod: it re-exports `runtime.Pod`.
RUNTIME_LAYERS: dict[str, set[str]] = {
    "runtime": {"memory", "comm", "runtime._packages", "runtime.pod"},
    "runtime.pod": {"memory", "comm"},
    "runtime.model": {"memory", "comm", "sched", "runtime.pod"},
    "runtime.decode": {
        "memory",
        "comm",
        "sched",
        "runtime.pod",
        "runtime.model",
        "runtime.project",
    },
    "runtime.engine": {"memory", "comm", "sched", "runtime.pod", "runtime.model"},
    "runtime.api": {"memory", "comm", "sched", "runtime.pod", "runtime.model", "runtime.engine"},
    "runtime.cli": {"memory", "comm", "sched", "runtime"},
    "runtime.project": set(),
}


# -- the walk ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Arrow:
    src: str  # importing module, dotted
    dst: str  # imported module (the longest dotted prefix that is a module of ours)
    name: str | None  # the name taken from it (`from dst import name`), if any
    line: int


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def product_modules(root: Path = ROOT, packages: tuple[str, ...] = PRODUCT) -> dict[str, Path]:
    found = {}
    for pkg in packages:
        for p in (root / pkg).rglob("*.py"):
            if ".venv" not in p.parts:
                found[module_name(p, root)] = p
    return found


def _resolve(dotted: str, modules: dict[str, Path]) -> str | None:
    while dotted:
        if dotted in modules:
            return dotted
        dotted = dotted.rpartition(".")[0]
    return None


@cache
def parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def arrows(path: Path, modules: dict[str, Path], root: Path = ROOT) -> list[Arrow]:
    """Every import of one of our modules in `path`, nested and relative ones included."""
    src = module_name(path, root)
    here = src.split(".") if path.name == "__init__.py" else src.split(".")[:-1]
    tree = parse(path)
    out: list[Arrow] = []
    for node in ast.walk(tree):
        wanted: list[tuple[str, str | None]] = []
        if isinstance(node, ast.Import):
            wanted = [(a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = here[: len(here) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                wanted.append((full, None) if full in modules else (base, a.name))
        for dotted, name in wanted:
            if dotted.split(".")[0] not in OURS:
                continue
            dst = _resolve(dotted, modules) or dotted
            if dst != src:
                out.append(Arrow(src, dst, name, node.lineno))
    return out


def private_attributes(path: Path, modules: dict[str, Path], root: Path = ROOT) -> list[Arrow]:
    """`mod._x` where `mod` is bound to one of our modules by an import in `path`."""
    tree = parse(path)
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in modules:
                    bound[a.asname or a.name.split(".")[0]] = (
                        a.name if a.asname else a.name.split(".")[0]
                    )
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full in modules:
                    bound[a.asname or a.name] = full
    src = module_name(path, root)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not _is_private(node.attr):
            continue
        chain, base = [], node.value
        while isinstance(base, ast.Attribute):
            chain.append(base.attr)
            base = base.value
        if isinstance(base, ast.Name) and base.id in bound:
            dst = ".".join([bound[base.id], *reversed(chain)])
            if _resolve(dst, modules) != src:
                out.append(Arrow(src, dst, node.attr, node.lineno))
    return out


def _is_private(name: str | None) -> bool:
    return bool(name) and name.startswith("_") and not name.startswith("__")


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = set()
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.add(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(comp)
    return found


def layer_of(module: str) -> str:
    """The RUNTIME_LAYERS key a runtime module belongs to."""
    parts = module.split(".")
    if len(parts) >= 2 and ".".join(parts[:2]) in RUNTIME_LAYERS:
        return ".".join(parts[:2])
    return "runtime"


def runtime_violations(modules: dict[str, Path], root: Path = ROOT) -> list[str]:
    bad = []
    for mod, path in sorted(modules.items()):
        if mod.split(".")[0] != "runtime":
            continue
        layer = layer_of(mod)
        allowed = RUNTIME_LAYERS[layer] | {layer}
        for a in arrows(path, modules, root):
            if a.dst.split(".")[0] not in ("memory", "comm", "sched", "runtime"):
                continue  # between packages: test_import_direction
            if a.dst == "runtime._packages":
                continue
            if not any(a.dst == p or a.dst.startswith(p + ".") for p in allowed):
                bad.append(f"{path.relative_to(root)}:{a.line} ({layer}) imports {a.dst}")
    return bad


# -- the tests ---------------------------------------------------------------------------------


MODULES = product_modules()


@pytest.mark.parametrize("pkg", sorted(ALLOWED))
def test_import_direction(pkg):
    files = sorted(p for p in (ROOT / pkg).rglob("*.py") if ".venv" not in p.parts)
    if pkg in ("memory", "comm", "runtime"):
        assert files, f"package {pkg} has no modules"
    everything = product_modules(packages=tuple(sorted(OURS)))
    bad = []
    for path in files:
        for a in arrows(path, everything):
            top = a.dst.split(".")[0]
            if top not in ALLOWED[pkg]:
                bad.append(f"{path.relative_to(ROOT)}:{a.line} imports {top}")
    assert not bad, f"{pkg} may import only {sorted(ALLOWED[pkg])}:\n" + "\n".join(bad)


def test_runtime_sub_packages_import_down_only():
    bad = runtime_violations(MODULES)
    assert not bad, "an arrow points up inside runtime/ (RUNTIME_LAYERS):\n" + "\n".join(bad)


def test_no_import_cycle():
    graph: dict[str, set[str]] = {}
    for mod, path in MODULES.items():
        graph[mod] = {a.dst for a in arrows(path, MODULES) if a.dst in MODULES}
    found = cycles(graph)
    assert not found, "import cycles:\n" + "\n".join(str(sorted(c)) for c in found)


def test_no_private_name_crosses_a_module():
    taken = set()
    for path in MODULES.values():
        for a in arrows(path, MODULES) + private_attributes(path, MODULES):
            if _is_private(a.name):
                taken.add((a.src, f"{a.dst}.{a.name}"))
    assert not taken, "private names taken from another module:\n" + "\n".join(
        map(str, sorted(taken))
    )


def test_every_runtime_module_lives_in_a_sub_package():
    loose = [m for m in MODULES if layer_of(m) == "runtime" and m.split(".")[0] == "runtime"]
    assert sorted(loose) == ["runtime", "runtime._packages"], loose


# -- the checker checks itself ------------------------------------------------------------------


def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return product_modules(tmp_path, packages=("runtime", "comm"))


def test_checker_sees_nested_relative_and_from_imports(tmp_path):
    mods = _tree(
        tmp_path,
        {
            "comm/__init__.py": "",
            "comm/trace.py": "x = 1\n",
            "runtime/__init__.py": "",
            "runtime/pod/__init__.py": "",
            "runtime/pod/sibling.py": "",
            "runtime/pod/m.py": "import os\nfrom comm.trace import x\n\ndef f():\n"
            "    import runtime.model.ops\n    from . import sibling\n",
            "runtime/model/__init__.py": "",
            "runtime/model/ops.py": "",
        },
    )
    got = {a.dst for a in arrows(tmp_path / "runtime/pod/m.py", mods, tmp_path)}
    assert got == {"comm.trace", "runtime.model.ops", "runtime.pod.sibling"}


def test_checker_fails_on_an_arrow_up_inside_runtime(tmp_path):
    # the pod may not import the model: a deliberate bad import is caught, nested or not
    mods = _tree(
        tmp_path,
        {
            "runtime/__init__.py": "",
            "runtime/pod/__init__.py": "",
            "runtime/pod/launcher.py": "def f():\n    from runtime.model import kernels\n",
            "runtime/model/__init__.py": "",
            "runtime/model/kernels.py": "from runtime.pod import launcher\n",
        },
    )
    bad = runtime_violations(mods, tmp_path)
    assert bad == ["runtime/pod/launcher.py:2 (runtime.pod) imports runtime.model.kernels"]


def test_checker_finds_cycles_and_private_names(tmp_path):
    mods = _tree(
        tmp_path,
        {
            "comm/__init__.py": "",
            "comm/a.py": "from comm.b import _hidden\n",
            "comm/b.py": "def f():\n    import comm.a\n    return comm.a._secret\n",
        },
    )
    graph = {m: {a.dst for a in arrows(p, mods, tmp_path)} for m, p in mods.items()}
    assert cycles(graph) == [{"comm.a", "comm.b"}]
    names = {a.name for p in mods.values() for a in arrows(p, mods, tmp_path)}
    names |= {a.name for p in mods.values() for a in private_attributes(p, mods, tmp_path)}
    assert {"_hidden", "_secret"} <= names


def test_every_package_is_covered():
    top = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    assert top <= set(ALLOWED), f"packages without an import rule: {sorted(top - set(ALLOWED))}"
