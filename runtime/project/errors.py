"""The one error of `runtime.project`: a capture or a profile that cannot be projected.

Every message names what (the file, the key, the die / stream / seq of the event) and why, on
one line; the CLI prints it as `xpod project: error: ...` with exit status 2 and writes nothing.
"""

from __future__ import annotations


class ProjectError(Exception):
    """A capture, profile or projection refused (message: file / key / die / event, and why)."""


__all__ = ["ProjectError"]
