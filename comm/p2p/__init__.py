"""XCCL point-to-point send / recv over the dies' shared regions (docs/protocols.md §4, 001 §3.1).

Per (sender s, receiver r, lane l) there is one inbound descriptor `desc[s][l]` in r's meta area
(written by s), one ack `ack[r][l]` in s's meta area (written by r), one zero-copy rendezvous
`rdv[r][l]` in s's meta area (written by r) and one ring in r's managed area (written by s).

Steps (the trace records each by number, see `comm.trace.STEP_NAMES`):

```
 sender s                                         receiver r
 1 MTE2: stripe chunk app -> UB half (ping-pong)
 2 MTE3: UB -> ring slot tail % slots in r        5 poll desc[s][l].tail_ptr > head_ptr
   (wait for credit: tail - head < slots)
 3 publish desc: event_id, msg_info, chunk_id,    6 ring slot -> UB -> app; publish
   then tail_ptr LAST                               ack.head_ptr (the credit)
 4 poll own ack[r][l].done >= seq                 7 after the last chunk: ack.event_id,
 8 done on every lane: check ack.status             ack.status, then ack.done = seq LAST
```

Variants:
- `mte`: as drawn, staged through the lane's UB (two private copies around the ring).
- `dma`: the die's DMA engine thread runs the lane loop: app <-> ring directly, as many contiguous
  free slots per copy as credits allow, while the caller blocks without CPU (`comm.dma`).
- `zero-copy`: a rendezvous in the MPI manner (ready-to-send, clear-to-send). The sender
  announces the message on lane 0 (event_id, msg_info, then chunk_id = seq << 24 LAST, tail_ptr
  untouched); the receiver, once it sees the announcement and has checked it against its own
  call, publishes (step 0) on each lane `rdv`: event_id, region offset and size of that lane's
  stripe of its destination buffer, then `seq` = the message's seq LAST; each sender lane waits
  for `rdv.seq == seq` exactly, writes straight into the receiver's app area and publishes its
  descriptor; steps 3, 4, 7, 8 as above (one virtual chunk per lane, no ring slot). A rendezvous
  is tagged with the message it belongs to, so a lane can never write into another message's
  buffer; a rejected announcement is answered with `rdv.event_id = RDV_REJECT`, tagged the same.
- async: `isend` / `irecv` return a `Request`; `test()` advances without blocking, `wait()` blocks.

`msg_info` (descriptor word 3) = nbytes | lanes << 40 | dtype.num << 48 | variant << 56, so the
receiver checks size, lane count, dtype and variant of every message. `chunk_id` = seq << 24 |
chunk index, where seq counts the messages of the pair (sender, receiver), the same on every lane
of a message, and is what the receiver echoes into `ack.done` (a monotonic word; caller event ids
may repeat). A receive starts when lane 0's `chunk_id` carries a seq above its own `ack.done`;
every lane it completes must carry that seq, event id and msg_info (checked per chunk), so a lane
of another message can never be taken for this one.

A mismatch found by the receiver (event id, size, lanes, dtype, variant) is answered by draining
the sender's message (ring variants) or refusing its rendezvous (zero-copy) and acking every
lane with a non-zero `status`: both sides raise ProtocolError and the pair's counters stay
consistent, so the pod stays usable. The sender raises only after EVERY lane is acked (the
receiver may still be draining lane 3 when it acked lane 0).

One module per path:

    sendrecv.py    `send` / `recv`, and their small-message fast path (§4.3)
    request.py     `Request`, `isend` / `irecv` (every other transfer starts here), `resync`
    lanes.py       the lane state machines of the ring variants (mte, dma) and of receives
    zero_copy.py   the zero-copy sender lane, rendezvous and probe
    mismatch.py    the receiver's verdict on a message it did not ask for, and the refusal
    message.py     variants, statuses, msg_info, stripes, argument checks
"""

from comm.p2p.message import (
    ABORTED,
    BAD_DTYPE,
    BAD_EVENT,
    BAD_LANES,
    BAD_SIZE,
    BAD_VARIANT,
    BIG_COPY,
    DMA,
    EVENT_LIMIT,
    MTE,
    NBYTES_MASK,
    OK,
    RDV_REJECT,
    SEQ_SHIFT,
    STATUS_TEXT,
    VARIANT_NAMES,
    VARIANTS,
    ZC,
    byte_view,
    pack_info,
    stripes,
    unpack_info,
)
from comm.p2p.request import Request, irecv, isend, resync
from comm.p2p.sendrecv import recv, send

__all__ = [
    "ABORTED",
    "BAD_DTYPE",
    "BAD_EVENT",
    "BAD_LANES",
    "BAD_SIZE",
    "BAD_VARIANT",
    "BIG_COPY",
    "DMA",
    "EVENT_LIMIT",
    "MTE",
    "NBYTES_MASK",
    "OK",
    "RDV_REJECT",
    "SEQ_SHIFT",
    "STATUS_TEXT",
    "VARIANT_NAMES",
    "VARIANTS",
    "ZC",
    "Request",
    "byte_view",
    "irecv",
    "isend",
    "pack_info",
    "recv",
    "resync",
    "send",
    "stripes",
    "unpack_info",
]
