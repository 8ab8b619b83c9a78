"""What a p2p message is, on the wire and at the API: variants, ack statuses, `msg_info`, the
lanes' stripes, and the checks every send and receive makes before it touches shared memory."""

from __future__ import annotations

import numpy as np

from comm.endpoint import Endpoint
from comm.trace import now_ns
from memory import layout as L
from memory.errors import ProtocolError

MTE, DMA, ZC = 1, 2, 3
VARIANTS = {"mte": MTE, "dma": DMA, "zero-copy": ZC}
VARIANT_NAMES = {v: k for k, v in VARIANTS.items()}
OK, BAD_EVENT, BAD_SIZE, BAD_LANES, BAD_DTYPE, BAD_VARIANT = 0, 1, 2, 3, 4, 5
ABORTED = 99  # ack.status of a message discarded by resync
STATUS_TEXT = {
    ABORTED: "discarded by resync after a failed pod.run",
    BAD_EVENT: "event id mismatch",
    BAD_SIZE: "size mismatch",
    BAD_LANES: "lane-count (cores) mismatch",
    BAD_DTYPE: "dtype mismatch",
    BAD_VARIANT: "variant mismatch (zero-copy on one side only)",
}
RDV_REJECT = -(1 << 62)  # rdv.event_id: the receiver refused the announced zero-copy message
SEQ_SHIFT = 24
NBYTES_MASK = (1 << 40) - 1
BIG_COPY = 1 << 20  # from here numpy copies beat memoryview (20 vs 11 GB/s at 8 MiB here)
_INT = (int, np.integer)
EVENT_LIMIT = 1 << 62


def pack_info(nbytes: int, lanes: int, dtype_num: int, variant: int) -> int:
    return nbytes | lanes << 40 | dtype_num << 48 | variant << 56


def unpack_info(info: int) -> tuple[int, int, int, int]:
    """msg_info -> (nbytes, lanes, dtype.num, variant)."""
    return info & NBYTES_MASK, (info >> 40) & 0xFF, (info >> 48) & 0xFF, (info >> 56) & 0x7F


def stripes(nbytes: int, lanes: int) -> list[tuple[int, int]]:
    """Byte range [lo, hi) of each lane: equal 64-byte-aligned stripes, the last one shorter."""
    per = -(-nbytes // lanes)
    per = -(-per // 64) * 64
    return [(min(nbytes, i * per), min(nbytes, (i + 1) * per)) for i in range(lanes)]


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    if len(src) >= BIG_COPY:
        np.copyto(np.frombuffer(dst, np.uint8), np.frombuffer(src, np.uint8))
    else:
        dst[:] = src


def byte_view(buf: np.ndarray, what: str, writable: bool) -> memoryview:
    """Flat uint8 memoryview of a C-contiguous numpy array; clear errors otherwise.

    The common case is one `memoryview(buf).cast("B")` (~0.25 us); the checks that explain a
    refusal run only when that fails.
    """
    if type(buf) is np.ndarray:
        try:
            m = memoryview(buf)
            if m.format != "O" and (not writable or not m.readonly):
                return m.cast("B")
        except (TypeError, ValueError):
            pass  # not C-contiguous, or a dtype without a buffer format: explained below
    if not isinstance(buf, np.ndarray):
        raise TypeError(f"{what} must be a numpy array, got {type(buf).__name__}")
    if buf.dtype.hasobject:
        raise TypeError(f"{what} has dtype {buf.dtype}, which holds Python objects")
    if not buf.flags.c_contiguous:
        raise ValueError(
            f"{what} is not C-contiguous (strides {buf.strides}); pass np.ascontiguousarray(...)"
        )
    if writable and not buf.flags.writeable:
        raise ValueError(f"{what} is read-only")
    return memoryview(buf.reshape(-1).view(np.uint8))


def trace_done(ep: Endpoint, op: str, dst: int, lane: int, event_id: int, nbytes: int) -> None:
    """Steps 4 (poll ack, since the lane's last publish) and 8 (done) of a sender lane."""
    tr = ep.trace
    if tr.enabled:
        t = now_ns()
        last = next((r[0] for r in reversed(tr.records) if r[2] == op and r[5] == lane), t)
        tr.rec(last, t - last, op, 4, dst, lane, event_id, nbytes)
        tr.rec(t, 0, op, 8, dst, lane, event_id, nbytes)


def check_ack(ep: Endpoint, aw: memoryview, ack: int, dst: int, event_id: int) -> None:
    """Step 8: the receiver acked; raise if it rejected the message."""
    status = aw[ack + L.ACK_STATUS]
    if status:
        raise ProtocolError(
            f"die {ep.die_id} send to die {dst} (event_id {event_id}): the receiver rejected it:"
            f" {STATUS_TEXT.get(status, status)} (receiver expected event_id"
            f" {aw[ack + L.ACK_EVENT]}); message discarded"
        )


def check_args(ep: Endpoint, buf: np.ndarray, peer: int, event_id: int, cores: int, variant: str,
               send: bool) -> tuple[memoryview, int]:  # fmt: skip
    """The checks every send and recv makes before it publishes anything; returns the buffer's
    flat bytes and the variant's code."""
    ep.check_peer(peer, "destination" if send else "source")
    ep.check_cores(cores)
    if variant not in VARIANTS:
        raise ValueError(f"variant {variant!r}: choose one of {', '.join(VARIANTS)}")
    if not isinstance(event_id, _INT) or not 0 <= event_id < (1 << 62):
        raise ValueError(f"event_id {event_id!r} must be an int in [0, 2**62)")
    mv = byte_view(buf, "send buffer" if send else "recv buffer", writable=not send)
    if len(mv) > NBYTES_MASK:
        raise ValueError(f"message of {len(mv)} bytes exceeds the 1 TiB limit of msg_info")
    return mv, VARIANTS[variant]
