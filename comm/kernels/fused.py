"""The fused protocol's steps over every die's region, one call each (docs/protocols.md §7).

Every polled word a reader waits on is written by a LATER call than the data it guards: a call
boundary keeps the compiler from moving stores across it, and x86's total store order keeps
them in program order for the other cores (docs/protocols.md §3).
"""

from __future__ import annotations

import numba
import numpy as np

from comm.kernels.bf16 import put_bits
from comm.kernels.packets import assemble_count, assemble_place, packet
from comm.kernels.region import LIKE_I32, LIKE_I64, LIKE_U8, region


@numba.njit(cache=True, nogil=True, boundscheck=False)
def fused_pack(addrs, nbytes, dies, offs, base, payload8, scale_bits, slots, ks, locs,
               stride):  # pragma: no cover - compiled  # fmt: skip
    """FusedDispatch step 1 for every destination: the packets of layout rows
    offs[p]:offs[p + 1] into die dies[p]'s block for this source (byte `base` of its region),
    row by row as `pack_rows` writes them (payload, then scale | slot | k | local as int32)."""
    for p in range(dies.shape[0]):
        d8 = region(addrs, dies[p], nbytes, LIKE_U8)
        d32 = region(addrs, dies[p], nbytes, LIKE_I32)
        for i in range(offs[p], offs[p + 1]):
            row = base + (i - offs[p]) * stride
            packet(payload8, scale_bits, slots[i], ks[i], locs[i], d8, d32, row, stride)


@numba.njit(cache=True, nogil=True, boundscheck=False)
def fused_counts(addrs, nbytes, pos_of, offs, per_expert, exp_flat, exp_start, counts_word,
                 flag_word, event, code):  # pragma: no cover - compiled  # fmt: skip
    """FusedDispatch step 2 for every die d, all but the polled word: the rows per local
    expert into d's counts block for this source (word `counts_word`), then the flag's event
    id, row count and quant code (words from `flag_word`). `fused_seq` stores the operation
    number afterwards, in a later call."""
    for d in range(pos_of.shape[0]):
        w = region(addrs, d, nbytes, LIKE_I64)
        p = pos_of[d]
        a = exp_start[d]
        for j in range(a, exp_start[d + 1]):
            w[counts_word + j - a] = per_expert[exp_flat[j]]
        w[flag_word + 0] = event  # FLAG_EVENT
        w[flag_word + 1] = offs[p + 1] - offs[p] if p >= 0 else 0  # FLAG_COUNT
        w[flag_word + 3] = code  # FLAG_QUANT


@numba.njit(cache=True, nogil=True, boundscheck=False)
def fused_seq(addrs, nbytes, word, op):  # pragma: no cover - compiled
    """The polled word of every die, LAST: word `word` of every region = op."""
    for d in range(addrs.shape[0]):
        region(addrs, d, nbytes, LIKE_I64)[word] = op


@numba.njit(cache=True, nogil=True, boundscheck=False)
def fused_assemble(m8, m32, m64, srcs, cnts, block0, block_bytes, cw0, cw_stride, stride, pb,
                   counts, x8, scale_bits, out_src, out_slot, out_k, out_local):  # fmt: skip
    """FusedDispatch step 3 over this die's own receive area (pragma: no cover - compiled):
    source srcs[j]'s cnts[j] packets at byte block0 + src * block_bytes, counted by local
    expert into `counts` (zeros in), checked against the per-expert counts each source wrote
    (words cw0 + src * cw_stride), then placed grouped by local expert, stable in (source,
    slot, k) order: `assemble_count` / `assemble_place` per source, in one call. Returns 0;
    -1 - src for a packet naming a local expert outside [0, len(counts)); -(1 << 40) when the
    packets disagree with the counts words."""
    n_local = counts.shape[0]
    for j in range(srcs.shape[0]):
        a = block0 + srcs[j] * block_bytes
        if assemble_count(m32[a // 4 : (a + cnts[j] * stride) // 4], cnts[j], stride, counts):
            return -1 - srcs[j]
    for e in range(n_local):
        t = 0
        for j in range(srcs.shape[0]):
            t += m64[cw0 + srcs[j] * cw_stride + e]
        if t != counts[e]:
            return -(1 << 40)
    cursor = np.empty(n_local, np.int64)
    acc = 0
    for e in range(n_local):
        cursor[e] = acc
        acc += counts[e]
    for j in range(srcs.shape[0]):
        a = block0 + srcs[j] * block_bytes
        b = a + cnts[j] * stride
        assemble_place(m8[a:b], m32[a // 4 : b // 4], cnts[j], stride, pb, srcs[j], cursor, x8,
                       scale_bits, out_src, out_slot, out_k, out_local)  # fmt: skip
    return 0


@numba.njit(cache=True, nogil=True, boundscheck=False)
def fused_scatter(rows, order, lin, starts, addrs, nbytes, like, base, stride, cevent_word, me,
                  event):  # pragma: no cover - compiled  # fmt: skip
    """FusedCombine step 1 for every destination d: this die's event id word (cevent_word +
    me), then row order[j] into d's combine buffer row lin[j] (`base` / `stride` in elements of
    `like`'s dtype), for j in starts[d]:starts[d + 1]: float32 bits (uint32) into a bfloat16
    buffer rounded to nearest even on the way (as `round_bf16`), bfloat16 or float32 bits
    into their own buffer as they are. `fused_cflags` stores the completion words afterwards."""
    h = rows.shape[1]
    for d in range(starts.shape[0] - 1):
        if starts[d] == starts[d + 1]:
            continue
        region(addrs, d, nbytes, LIKE_I64)[cevent_word + me] = event
        dst = region(addrs, d, nbytes, like)
        for j in range(starts[d], starts[d + 1]):
            s = rows[order[j]]
            at = base + lin[j] * stride
            o = dst[at : at + h]
            for c in range(h):
                o[c] = put_bits(s[c], like)


@numba.njit(cache=True, nogil=True, boundscheck=False)
def fused_cflags(addrs, nbytes, lin, starts, cflag_word, op):  # pragma: no cover - compiled
    """FusedCombine step 2, LAST: the completion word of every row sent, op."""
    for d in range(starts.shape[0] - 1):
        w = region(addrs, d, nbytes, LIKE_I64)
        for j in range(starts[d], starts[d + 1]):
            w[cflag_word + lin[j]] = op
