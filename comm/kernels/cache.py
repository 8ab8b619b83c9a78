"""The kernels' disk cache kept in step with every file of the package.

numba keys a kernel's cache (`cache=True`, in `__pycache__`) by the kernel's own file only,
while a kernel carries the helpers it inlines from the package's other files (`bf16`, `region`,
`packets.packet`) in its compiled code: an edit of such a helper would leave the kernels of the
other files running the old one. `drop_stale_cache` stamps the cache with a digest of every
source file of the package and empties it when the digest changes; the next call compiles.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path

STAMP = "numba-sources.sha256"


def sources_digest(package_dir: Path) -> str:
    """sha256 of the package's .py files (names and bytes, in name order)."""
    h = hashlib.sha256()
    for p in sorted(package_dir.glob("*.py")):
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def drop_stale_cache(package_dir: Path) -> bool:
    """Remove the package's numba cache files if they were made from other sources; True if it
    removed them. A cache it cannot write (a read-only install) is left to numba."""
    cache = package_dir / "__pycache__"
    digest = sources_digest(package_dir)
    stamp = cache / STAMP
    with contextlib.suppress(OSError):
        if stamp.read_text() == digest:
            return False
    try:
        cache.mkdir(exist_ok=True)
        for f in [*cache.glob("*.nbi"), *cache.glob("*.nbc")]:
            with contextlib.suppress(FileNotFoundError):  # another process removed it first
                f.unlink()
        tmp = cache / f"{STAMP}.{os.getpid()}"
        tmp.write_text(digest)
        os.replace(tmp, stamp)  # atomic: a reader sees the old stamp or the new one
    except OSError:
        return False
    return True
