"""The wheel holds every module of the product (setup.cfg finds packages, so a sub-package
cannot be left out; an editable install would hide the gap)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("memory", "comm", "sched", "runtime", "bench")
BUILD_FILES = ("setup.cfg", "pyproject.toml", "README.md")


def product_files(root: Path) -> set[str]:
    return {
        p.relative_to(root).as_posix()
        for pkg in PRODUCT
        for p in (root / pkg).rglob("*.py")
        if "__pycache__" not in p.parts
    }


def test_every_module_is_in_the_wheel(tmp_path):
    src = tmp_path / "src"
    for pkg in PRODUCT:
        shutil.copytree(ROOT / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    for name in BUILD_FILES:
        shutil.copy(ROOT / name, src / name)
    out = tmp_path / "wheel"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
        + ["-w", str(out), str(src)],
        check=True,
        timeout=120,
    )
    (wheel,) = out.glob("xpod-*.whl")
    with zipfile.ZipFile(wheel) as z:
        shipped = {n for n in z.namelist() if n.endswith(".py")}
    expected = product_files(ROOT)
    assert expected, "no product modules found"
    assert not expected - shipped, f"left out of the wheel: {sorted(expected - shipped)}"
    assert not shipped - expected, f"in the wheel but not in the tree: {sorted(shipped - expected)}"
    with zipfile.ZipFile(wheel) as z:
        entry = z.read(next(n for n in z.namelist() if n.endswith("entry_points.txt"))).decode()
    assert "xpod = " in entry


def test_every_product_folder_is_a_package():
    # setup.cfg's find: skips a folder without __init__.py (a namespace package) silently
    for pkg in PRODUCT:
        for d in [ROOT / pkg, *(p for p in (ROOT / pkg).rglob("*") if p.is_dir())]:
            if "__pycache__" in d.parts or not any(d.glob("*.py")):
                continue
            assert (d / "__init__.py").exists(), f"{d.relative_to(ROOT)} has no __init__.py"
