"""The one family of xpod errors, raised at the boundary with what, where and why.

They live in `memory/` because it is the bottom of the import graph: `comm/` and `runtime/`
re-export them, so user code writes `from runtime import PeerTimeout` or
`from comm import ProtocolError`.
"""

from __future__ import annotations


class PodError(Exception):
    """Base of every xpod error. A die's error re-raised by the launcher carries `die_id`."""

    die_id: int | None = None


class ConfigError(PodError, ValueError):
    """A configuration value out of range; the message names the field and the allowed range."""


class ShmError(PodError):
    """A shared-memory call failed; the message names the call and the segment."""


class ProtocolError(PodError):
    """Bad magic or layout, event-id / size / dtype mismatch between a send and its recv."""


class PeerRefused(ProtocolError):
    """Another die refused its input to a collective this die took part in (the other die's own
    error says why). Every die's operation counter still moved by one: the pod stays in step."""


class PeerTimeout(PodError, TimeoutError):
    """A wait passed its deadline; names die, peer, field, expected and seen values, seconds."""


class LinkError(PodError):
    """A collective's link failed (001 §6.1's error code: an injected `err` fault in xpod).
    Transient: the serving engine rolls the step back and runs it again."""


class PodAborted(PodError):
    """The launcher aborted the operation this die was waiting in (another die failed)."""
