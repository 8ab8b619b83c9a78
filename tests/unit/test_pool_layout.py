"""memory.pool_layout: the DRAM tier's sizing and segment, the SSD tier's block files."""

from __future__ import annotations

import os
import stat
import struct
from pathlib import Path

import numpy as np
import pytest

from comm.kvlink import KVGeometry, scatter_spans, segments
from memory import pool_layout as P
from memory.errors import ConfigError, ProtocolError, ShmError

FP = P.make_fingerprint("test", 1)
OTHER_FP = P.make_fingerprint("other", 2)
L, BS, ROW = 3, 4, 8
SLOT = L * BS * ROW * 4  # 384 B
BIG = 1 << 40


def payload(seed: int) -> np.ndarray:
    return np.arange(L * BS * ROW, dtype=np.float32) + seed * 1000


# -- sizing ------------------------------------------------------------------------------------


def test_slots_for_counts_whole_slots_after_the_header():
    n = P.slots_for(1, 4, 16, 96, shm_free=BIG, mem_available=BIG)
    assert n == (P.MiB - P.HEADER_BYTES) // (4 * 16 * 96 * 4) == 42
    assert P.pool_bytes(n, 4, 16, 96) <= P.MiB
    assert P.slots_for(64, 4, 16, 96, shm_free=BIG, mem_available=BIG) == 2730


def test_slots_for_refuses_no_slot_and_what_the_machine_cannot_hold():
    with pytest.raises(ConfigError, match="holds no block"):
        P.slots_for(0.01, 4, 16, 96, shm_free=BIG, mem_available=BIG)
    with pytest.raises(ConfigError, match="/dev/shm has 0.5 MiB"):
        P.slots_for(8, 4, 16, 96, shm_free=P.MiB // 2, mem_available=BIG)
    with pytest.raises(ConfigError, match="MemAvailable is 2.0 MiB"):
        P.slots_for(8, 4, 16, 96, shm_free=BIG, mem_available=2 * P.MiB)
    for bad in (0, -1, "8", True):
        with pytest.raises(ConfigError, match="pool-dram-mib"):
            P.slots_for(bad, 4, 16, 96, shm_free=BIG, mem_available=BIG)
    with pytest.raises(ConfigError, match="block_size"):
        P.slots_for(8, 4, 0, 96)
    # the machine's own figures: a size far beyond any machine's memory is refused
    with pytest.raises(ConfigError, match="give a smaller size"):
        P.slots_for(1 << 30, 4, 16, 96)


# -- the DRAM segment --------------------------------------------------------------------------


def test_create_attach_unlink_pool_segment(leak_check):
    pod = f"ut{os.getpid()}"
    seg = P.create_pool(pod, 3, FP, L, 5, BS, ROW)
    try:
        assert seg.name == f"/xpod.{pod}.pool3"
        assert stat.S_IMODE(os.stat(f"/dev/shm{seg.name[0:]}").st_mode) == 0o600
        with pytest.raises(ShmError):  # exists: never silently shared
            P.create_pool(pod, 3, FP, L, 5, BS, ROW)
        geo = KVGeometry(*seg.kv_args())
        assert geo == KVGeometry(P.HEADER_BYTES, L, 5, BS, ROW)
        seg.slots()[:] = np.arange(L * 5 * BS * ROW, dtype=np.float32).reshape(L, 5, BS, ROW)
        other = P.attach_pool(pod, 3, FP)
        try:
            assert (other.n_layers, other.n_slots, other.block_size, other.row_floats) == (
                L, 5, BS, ROW)  # fmt: skip
            assert other.creator_pid == os.getpid() and other.fingerprint == FP
            np.testing.assert_array_equal(other.slots(), seg.slots())
            # segments() and block_crc work on it unchanged
            spans = segments(geo, [1, 2], KVGeometry(0, L, 2, BS, ROW).offsets([0, 1]), 2 * BS)
            assert len(spans) == L  # two consecutive slots merged per layer
            want = P.pool_crc(np.ascontiguousarray(seg.slots()[:, 4]).tobytes())
            assert P.block_crc(other.array, geo, 4) == want
            sp = scatter_spans(geo.offsets([4]), BS, BS, ROW * 4, L)  # the spans a master checks
            got = 0
            for _, off, n in sp.tolist():
                got = P.pool_crc(other.array[off : off + n], got)
            assert got == want
        finally:
            other.close()
        with pytest.raises(ProtocolError, match="fingerprint"):
            P.attach_pool(pod, 3, OTHER_FP)
    finally:
        seg.close()
        assert P.unlink_pool(pod, 3)
    assert not P.unlink_pool(pod, 3)
    with pytest.raises(ShmError):
        P.attach_pool(pod, 3)


def test_block_crc_rows_and_range():
    geo = KVGeometry(16, 2, 3, 4, 2)
    arr = np.arange(16 + 2 * 3 * 4 * 2 * 4, dtype=np.uint32).astype(np.uint8)
    rows2 = P.pool_crc(arr[16 + 32 : 16 + 48])
    rows2 = P.pool_crc(arr[16 + 3 * 32 + 32 : 16 + 3 * 32 + 48], rows2)
    assert P.block_crc(arr, geo, 1, rows=2) == rows2
    with pytest.raises(ProtocolError):
        P.block_crc(arr, geo, 3)
    with pytest.raises(ProtocolError):
        P.block_crc(arr, geo, 0, rows=5)


# -- block files -------------------------------------------------------------------------------


def test_write_read_block_roundtrip(tmp_path):
    e = P.write_block(str(tmp_path), FP, 0xABC, None, None, [1, 2, 3, 4], [payload(1)])
    assert e.path == str(tmp_path / FP.hex() / "_" / "0000000000000abc.blk")
    assert stat.S_IMODE(os.stat(e.path).st_mode) == 0o600
    assert e.crc == P.pool_crc(payload(1).tobytes())
    got, data = P.read_block(e.path, FP, SLOT)
    assert got == e and got.parent is None and got.ns is None and got.tokens == (1, 2, 3, 4)
    np.testing.assert_array_equal(data.view(np.float32), payload(1))
    # a parent of 0 and an empty namespace are kept apart from none
    e2 = P.write_block(
        str(tmp_path),
        FP,
        7,
        "",
        0,
        [5],
        [payload(2)[: SLOT // 8], payload(2)[SLOT // 8 :]],
        fsync=True,
    )
    got2, _ = P.read_block(e2.path)
    assert (got2.ns, got2.parent, got2.crc) == ("", 0, P.pool_crc(payload(2).tobytes()))
    assert not [n for n in os.listdir(os.path.dirname(e2.path)) if P.TMP_MARK in n]


def test_read_block_refuses_crc_fingerprint_and_size(tmp_path):
    e = P.write_block(str(tmp_path), FP, 1, "a", 9, [1, 2], [payload(3)])
    with pytest.raises(P.BlockFileError, match="fingerprint"):
        P.read_block(e.path, OTHER_FP)
    with pytest.raises(P.BlockFileError, match="payload of 384 B, a block is 96"):
        P.read_block(e.path, FP, 96)
    raw = bytearray(Path(e.path).read_bytes())
    raw[-5] ^= 0x40  # a payload bit flipped
    Path(e.path).write_bytes(raw)
    with pytest.raises(P.BlockFileError, match="payload crc mismatch"):
        P.read_block(e.path)
    raw[-5] ^= 0x40
    raw[60] ^= 1  # a header bit (in the key / tokens)
    Path(e.path).write_bytes(raw)
    with pytest.raises(P.BlockFileError, match="header crc"):
        P.read_block(e.path)
    raw[60] ^= 1
    Path(e.path).write_bytes(raw[:-10])  # truncated
    with pytest.raises(P.BlockFileError, match="payload bytes"):
        P.read_block(e.path)
    with pytest.raises(P.BlockFileError):
        P.read_block(str(tmp_path / "missing.blk"))


def test_scan_skips_corrupt_foreign_and_stray_files_and_deletes_temps(tmp_path):
    root = str(tmp_path)
    keys = [(None, None), ("tenant-a", 0x10), ("a/../b", 7)]
    good = [P.write_block(root, FP, 0x10 + i, ns, p, [i, i + 1], [payload(i)])
            for i, (ns, p) in enumerate(keys)]  # fmt: skip
    assert os.path.basename(os.path.dirname(good[2].path)).startswith("~")  # no path from a name
    bad = P.write_block(root, FP, 0x99, None, None, [1], [payload(9)])
    raw = bytearray(Path(bad.path).read_bytes())
    raw[-1] ^= 0xFF
    Path(bad.path).write_bytes(raw)  # corrupt payload
    half = bad.path.replace("99.blk", "98.blk")
    Path(half).write_bytes(raw[:100])  # a half-written file under a final name
    tmp = good[0].path + ".tmp.4242"
    Path(tmp).write_bytes(raw[:50])  # a half-written temp file: deleted
    foreign = P.write_block(root, OTHER_FP, 0x55, None, None, [1], [payload(5)])
    moved = os.path.join(os.path.dirname(good[0].path), "0000000000000055.blk")
    os.rename(foreign.path, moved)  # another fingerprint's file in ours: skipped
    renamed = os.path.join(os.path.dirname(good[0].path), "0000000000000077.blk")
    os.link(good[0].path, renamed)  # a file named after another hash
    Path(os.path.dirname(good[0].path), "notes.txt").write_text("x")
    other = P.write_block(root, OTHER_FP, 0x56, None, None, [1], [payload(6)])  # not scanned
    res = P.scan(root, FP, SLOT)
    assert sorted(e.h for e in res.entries) == [0x10, 0x11, 0x12]
    assert {e.h: e for e in res.entries} == {e.h: e for e in good}
    assert res.skipped == 5 and len(res.problems) == 5
    assert res.removed_tmp == 1 and not os.path.exists(tmp)
    assert os.path.exists(bad.path) and os.path.exists(other.path)  # skipped, not deleted
    assert P.scan(str(tmp_path / "none"), FP).entries == []
    # a wrong-sized block of our fingerprint is skipped too
    assert P.scan(root, FP, SLOT * 2).skipped == 8


def test_write_block_refuses_out_of_range_keys(tmp_path):
    with pytest.raises(ProtocolError):
        P.write_block(str(tmp_path), FP, 1 << 64, None, None, [1], [payload(0)])
    with pytest.raises(ConfigError):
        P.write_block(str(tmp_path), b"short", 1, None, None, [1], [payload(0)])
    assert not os.listdir(tmp_path)


def test_check_pool_dir(tmp_path):
    d = tmp_path / "pool"
    assert P.check_pool_dir(str(d)) == str(d) and d.is_dir()
    (d / FP.hex()).mkdir()
    (d / (P.PROBE_PREFIX + "1")).write_text("")  # a dead writer's probe: ours, removed
    assert P.check_pool_dir(str(d)) == str(d) and sorted(os.listdir(d)) == [FP.hex()]
    (d / "README").write_text("mine")
    with pytest.raises(ConfigError, match=rf"{d} holds files that are not xpod pool files: README"):
        P.check_pool_dir(str(d))
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(ConfigError, match=f"{f}: not a directory"):
        P.check_pool_dir(str(f))
    with pytest.raises(ConfigError, match="not a writable directory"):
        P.check_pool_dir(str(f / "sub"))
    if os.geteuid() != 0:  # root writes anywhere
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        with pytest.raises(ConfigError, match="not a writable directory"):
            P.check_pool_dir(str(ro))


def test_header_layout_is_as_documented(tmp_path):
    e = P.write_block(str(tmp_path), FP, 0x1234, "ns", 0x42, [7, 8], [payload(0)])
    raw = Path(e.path).read_bytes()
    magic, fp, flags, ns_len = struct.unpack_from("<8s16sBH", raw, 0)
    assert (magic, fp, flags, ns_len) == (b"XPODBLK2", FP, 3, 2)
    assert raw[27:29] == b"ns"
    h, parent, n, crc, nbytes = struct.unpack_from("<QQIIQ", raw, 29)
    assert (h, parent, n, crc, nbytes) == (0x1234, 0x42, 2, e.crc, SLOT)
    assert struct.unpack_from("<2q", raw, 61) == (7, 8)
    assert struct.unpack_from("<I", raw, 77)[0] == P.pool_crc(raw[:77])
    assert raw[81:] == payload(0).tobytes()
