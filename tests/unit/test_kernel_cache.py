"""comm.kernels.cache: the numba cache of the kernels package is emptied when any of its
source files changed (a kernel inlines helpers of other files), and only then."""

from __future__ import annotations

from comm.kernels.cache import STAMP, drop_stale_cache


def _package(tmp_path):
    pkg = tmp_path / "kernels"
    (pkg / "__pycache__").mkdir(parents=True)
    (pkg / "a.py").write_text("def helper(): return 1\n")
    (pkg / "b.py").write_text("def kernel(): return 2\n")
    return pkg


def _cache_files(pkg, *names):
    for n in names:
        (pkg / "__pycache__" / n).write_bytes(b"compiled")


def test_a_change_in_any_file_empties_the_cache(tmp_path):
    pkg = _package(tmp_path)
    _cache_files(pkg, "b.kernel-1.py311.nbi", "b.kernel-1.py311.1.nbc")
    assert drop_stale_cache(pkg)  # no stamp yet: the cache may be from any sources
    assert not list((pkg / "__pycache__").glob("*.nb?"))
    _cache_files(pkg, "b.kernel-1.py311.nbi", "b.kernel-1.py311.1.nbc", "other.pyc")
    assert not drop_stale_cache(pkg)  # same sources: kept
    assert len(list((pkg / "__pycache__").glob("*.nb?"))) == 2
    (pkg / "a.py").write_text("def helper(): return 3\n")  # a helper b's kernel inlines
    assert drop_stale_cache(pkg)
    assert not list((pkg / "__pycache__").glob("*.nb?"))
    assert (pkg / "__pycache__" / "other.pyc").exists()  # Python's own cache is not ours
    assert (pkg / "__pycache__" / STAMP).exists()


def test_an_unwritable_cache_is_left_to_numba(tmp_path):
    pkg = _package(tmp_path)
    (pkg / "__pycache__").rmdir()
    (pkg / "__pycache__").write_text("not a directory")
    assert drop_stale_cache(pkg) is False
