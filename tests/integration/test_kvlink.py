"""KV links of a PD pod (comm.kvlink) between real die processes: a prefill die writes value-coded
KV blocks straight into the blocks a decode die chose (its scatter list, sent over XCCL p2p), then
the record and the completion count; the decode side checks every element and the crc32.

Every element of the source is coded with its (layer, block, position, column), so a segment
written to the wrong place, short, or from the wrong block shows which one. Transfers: 1 token
(part of one block), exactly one block, one block and a token, permuted non-adjacent blocks, the
whole pool; more transfers to one decode die than it has record slots (the ack flow control);
two decode dies at once; a failed record (no data); the probe's echo.
"""

from __future__ import annotations

import numpy as np
import pytest

import comm
from comm.kvlink import (
    OK,
    SOURCE_FAILED,
    KVGeometry,
    KVLinkRx,
    KVLinkTx,
    checksum,
    scatter_spans,
    segments,
)
from memory import layout as L
from runtime import Pod, PodConfig

LAYERS, BLOCKS, BS, W = 3, 8, 4, 5
SENTINEL = -7.0


def code(layer: int, block: int, pos: int, col: int) -> float:
    return float(layer * 100000 + block * 1000 + pos * 10 + col)


def coded_pool() -> np.ndarray:
    lyr, blk, pos, col = np.meshgrid(np.arange(LAYERS), np.arange(BLOCKS), np.arange(BS),
                                     np.arange(W), indexing="ij")  # fmt: skip
    return (lyr * 100000 + blk * 1000 + pos * 10 + col).astype(np.float32)


# (decode die, tokens, source blocks, destination blocks)
CASES = [
    (1, 1, [3], [5]),
    (1, BS, [0], [0]),
    (1, BS + 1, [1, 2], [6, 7]),
    (2, 3 * BS - 2, [7, 0, 4], [2, 5, 1]),
    (2, BLOCKS * BS, list(range(BLOCKS)), list(range(BLOCKS))),
    (1, 2 * BS, [5, 6], [3, 4]),
    (1, BS - 1, [6], [2]),
    (1, 2, [7], [1]),  # the 6th transfer to die 1: PD_SLOTS = 4 record slots, acks needed
]


def geometry(die, pool) -> KVGeometry:
    return KVGeometry(die.region.offset_of(pool), LAYERS, BLOCKS, BS, W)


def link_main(die) -> dict:
    me = die.die_id
    pool = die.alloc((LAYERS, BLOCKS, BS, W), np.float32)
    try:
        geo = geometry(die, pool)
        if me == 0:
            pool[...] = coded_pool()
            tx = KVLinkTx(die, timeout_s=20.0)
            sent = []
            for i, (dst, n, src_blocks, _) in enumerate(CASES):
                offs = np.zeros(LAYERS * -(-n // BS), np.int64)
                comm.recv(die, offs, dst, event_id=i)  # the decode side's scatter list
                spans = segments(geo, src_blocks, offs.tolist(), n)
                drafts = [3 + i, 4 + i][: i % 3]  # MTP drafts with the first token: 0..2
                sent.append((len(spans), *tx.push(dst, spans, req=100 + i, first=7 + i,
                                                  drafts=drafts)))  # fmt: skip
            comm.recv(die, np.zeros(1, np.int64), 1, event_id=99)  # a failed transfer next
            tx.push(1, np.zeros((0, 3), np.int64), req=500, first=0, status=SOURCE_FAILED)
            comm.recv(die, np.zeros(1, np.int64), 1, event_id=98)  # the probe is written
            tx.echo([1, 2])
            comm.send(die, np.ones(1, np.int64), 1, event_id=97)
            return {"sent": sent}
        pool[...] = SENTINEL
        remote = {0: die.words[0]}
        rx = KVLinkRx(me, die.layout, die.words[me], remote)
        got = []
        for i, (dst, n, _, dst_blocks) in enumerate(CASES):
            if dst != me:
                continue
            comm.send(die, np.asarray(geo.offsets(dst_blocks), np.int64), 0, event_id=i)
            recs = []
            while not recs:  # the record of this transfer: poll this die's own region
                die.wait_ge(die.words[me], rx_done_word(die), rx.taken[0] + 1, 0, "pd.done")
                recs = rx.poll(0)
            rec = recs[0]
            spans = scatter_spans(geo.offsets(dst_blocks), n, BS, W * 4, LAYERS)
            ok = checksum(die.region.array, spans, 1) == rec.crc
            rx.ack(0, rec.k)
            got.append({"case": i, "rec": rec, "crc_ok": ok, "pool": pool.copy()})
        if me == 1:
            comm.send(die, np.zeros(1, np.int64), 0, event_id=99)
            die.wait_ge(die.words[me], rx_done_word(die), rx.taken[0] + 1, 0, "pd.done")
            failed = rx.poll(0)[0]
            rx.ack(0, failed.k)
            seq = rx.probe(0)
            comm.send(die, np.zeros(1, np.int64), 0, event_id=98)
            comm.recv(die, np.zeros(1, np.int64), 0, event_id=97)
            return {"got": got, "failed": failed, "echo": (seq, rx.echoed(0))}
        return {"got": got}
    finally:
        die.free(pool)


def rx_done_word(die) -> int:
    from comm.kvlink import peer_word

    return peer_word(die.layout, 0, L.PD_DONE)


@pytest.mark.timeout(120)
def test_value_coded_blocks_land_where_the_scatter_list_says():
    cfg = PodConfig(num_dies=3, app_bytes=1 << 20, serve_slot_bytes=4096, timeout_s=20.0)
    with Pod.launch(cfg) as pod:
        res = pod.run(link_main, timeout_s=60)
        again = pod.run(link_main, timeout_s=60)  # the pod is usable after: the counters go on
    src = coded_pool()
    for r in (res, again):
        for die in (1, 2):
            cases = [c for c in r[die]["got"]]
            assert [c["case"] for c in cases] == [i for i, c in enumerate(CASES) if c[0] == die]
            written = np.zeros((LAYERS, BLOCKS), bool)
            for c in cases:
                _, n, sb, db = CASES[c["case"]]
                rec, pool = c["rec"], c["pool"]
                assert rec.status == OK and rec.req == 100 + c["case"] and c["crc_ok"]
                assert rec.first == 7 + c["case"]
                assert list(rec.drafts) == [3 + c["case"], 4 + c["case"]][: c["case"] % 3]
                assert rec.nbytes == LAYERS * n * W * 4
                for i, (s, d) in enumerate(zip(sb, db, strict=False)):
                    rows = min(BS, n - i * BS)
                    written[:, d] = True
                    np.testing.assert_array_equal(pool[:, d, :rows], src[:, s, :rows])
                    if rows < BS and not (pool[:, d, rows:] == SENTINEL).all():
                        # only a later case may have filled the rest of the block
                        assert any(d in CASES[j][3] for j in range(c["case"])), (c, d)
            last = cases[-1]["pool"]
            assert (last[~written] == SENTINEL).all(), "a block outside every list was written"
        failed = r[1]["failed"]
        assert failed.status == SOURCE_FAILED and failed.req == 500 and failed.nbytes == 0
        assert failed.drafts == ()  # a slot's old drafts never read as this record's
        seq, echo = r[1]["echo"]
        assert seq >= 1 and echo == seq
        spans = [s for s, *_ in r[0]["sent"]]
        assert spans[4] == 1  # the whole pool, blocks in order: one copy
        assert spans[3] == 3 * LAYERS  # permuted blocks: one copy per (layer, block)


def test_segments_coalesce_and_refuse_bad_lists():
    geo = KVGeometry(4096, 2, 8, 4, 5)
    dst = KVGeometry(1 << 16, 2, 8, 4, 5)
    s = segments(geo, [2, 3, 4], dst.offsets([5, 6, 7]), 10)
    assert s.tolist() == [[4096 + 2 * 80, (1 << 16) + 5 * 80, 200],
                          [4096 + 10 * 80, (1 << 16) + 13 * 80, 200]]  # fmt: skip
    s = segments(geo, [2, 3], dst.offsets([6, 5]), 8)  # not adjacent on the destination
    assert len(s) == 4 and s[:, 2].tolist() == [80] * 4
    assert checksum(np.arange(1 << 17, dtype=np.uint8) % 251, s, 0) != 0
    with pytest.raises(comm.ProtocolError, match="scatter list"):
        segments(geo, [2, 3], dst.offsets([5]), 8)
    with pytest.raises(comm.ProtocolError, match="source has"):
        segments(geo, [2], dst.offsets([5, 6]), 8)
    with pytest.raises(comm.ProtocolError, match="outside the pool"):
        geo.offsets([8])
