"""comm.p2p helpers that need no pod: msg_info packing, lane stripes, byte views."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from comm import p2p


@settings(max_examples=300, deadline=None)
@given(
    nbytes=st.integers(0, (1 << 40) - 1),
    lanes=st.integers(0, 255),
    dtype_num=st.integers(0, 255),
    variant=st.integers(0, 127),
)
def test_pack_unpack_round_trip(nbytes, lanes, dtype_num, variant):
    info = p2p.pack_info(nbytes, lanes, dtype_num, variant)
    assert 0 <= info < 1 << 63  # fits the signed int64 descriptor word
    assert p2p.unpack_info(info) == (nbytes, lanes, dtype_num, variant)


def test_pack_info_bit_positions():
    assert p2p.pack_info(5, 0, 0, 0) == 5
    assert p2p.pack_info(0, 1, 0, 0) == 1 << 40
    assert p2p.pack_info(0, 0, 1, 0) == 1 << 48
    assert p2p.pack_info(0, 0, 0, 1) == 1 << 56
    assert p2p.NBYTES_MASK == (1 << 40) - 1


@pytest.mark.parametrize("name", ["mte", "dma", "zero-copy"])
def test_variants_distinct_and_fit_7_bits(name):
    v = p2p.VARIANTS[name]
    assert 0 < v < 128
    assert p2p.VARIANT_NAMES[v] == name
    assert len(set(p2p.VARIANTS.values())) == len(p2p.VARIANTS)


@pytest.mark.parametrize("dtype", [np.uint8, np.int32, np.int64, np.float16, np.float32,
                                   np.float64, np.complex128, np.bool_])  # fmt: skip
def test_dtype_num_fits_its_byte(dtype):
    num = np.dtype(dtype).num
    assert 0 <= num < 256
    info = p2p.pack_info(123, 4, num, p2p.ZC)
    assert p2p.unpack_info(info)[2] == num


@settings(max_examples=300, deadline=None)
@given(nbytes=st.integers(0, 1 << 22), lanes=st.integers(1, 64))
def test_stripes_cover_exactly_once(nbytes, lanes):
    s = p2p.stripes(nbytes, lanes)
    assert len(s) == lanes
    pos = 0
    for lo, hi in s:
        assert lo == pos, "stripes must be contiguous and in lane order"
        assert lo <= hi
        assert lo % 64 == 0 or lo == nbytes, "a stripe starts on a 64-byte boundary"
        pos = hi
    assert pos == nbytes
    sizes = [hi - lo for lo, hi in s]
    # equal stripes, then one shorter, then empty ones
    nonempty = [n for n in sizes if n]
    if nonempty:
        assert all(n == nonempty[0] for n in nonempty[:-1])
        assert nonempty[-1] <= nonempty[0]
        assert sizes[: len(nonempty)] == nonempty


@pytest.mark.parametrize(
    "nbytes, lanes, expect",
    [
        (0, 1, [(0, 0)]),
        (0, 2, [(0, 0), (0, 0)]),
        (10, 4, [(0, 10), (10, 10), (10, 10), (10, 10)]),
        (256, 4, [(0, 64), (64, 128), (128, 192), (192, 256)]),
        (257, 2, [(0, 192), (192, 257)]),
        (1000, 3, [(0, 384), (384, 768), (768, 1000)]),
    ],
)
def test_stripes_examples(nbytes, lanes, expect):
    assert p2p.stripes(nbytes, lanes) == expect


# -- byte_view: what a send / recv buffer may be ---------------------------------------------------


@pytest.mark.parametrize(
    "arr",
    [
        np.arange(10, dtype=np.int64),
        np.zeros((3, 4, 5), np.float32),
        np.zeros(0, np.uint8),
        np.zeros((2, 0, 3), np.float64),
        np.array(5, dtype=np.int16),
        np.zeros(7, np.complex64),
        np.zeros(3, np.dtype([("a", "<i4"), ("b", "<f8")])),
        np.zeros(4, "datetime64[s]"),
    ],
    ids=["1d", "3d", "empty", "empty3d", "0d", "complex", "record", "datetime"],
)
def test_byte_view_accepts_c_contiguous_arrays(arr):
    mv = p2p.byte_view(arr, "send buffer", writable=True)
    assert len(mv) == arr.nbytes
    assert mv.format == "B"
    if arr.nbytes:
        mv[0] = 0xFF
        assert arr.reshape(-1).view(np.uint8)[0] == 0xFF  # a view, not a copy


def test_byte_view_refuses_object_arrays():
    with pytest.raises(TypeError, match="object"):
        p2p.byte_view(np.array([1, "a"], dtype=object), "send buffer", writable=False)


@pytest.mark.parametrize(
    "arr",
    [np.arange(20)[::2], np.zeros((4, 6), order="F"), np.zeros((4, 6))[:, 1:3]],
    ids=["strided", "fortran", "column-slice"],
)
def test_byte_view_refuses_non_contiguous(arr):
    with pytest.raises(ValueError, match="contiguous"):
        p2p.byte_view(arr, "send buffer", writable=False)


def test_byte_view_refuses_read_only_recv_buffer():
    arr = np.zeros(8)
    arr.flags.writeable = False
    p2p.byte_view(arr, "send buffer", writable=False)  # fine to send from
    with pytest.raises(ValueError, match="read-only"):
        p2p.byte_view(arr, "recv buffer", writable=True)


@pytest.mark.parametrize("obj", [b"abc", bytearray(4), [1, 2, 3], memoryview(b"xy")])
def test_byte_view_refuses_non_arrays(obj):
    with pytest.raises(TypeError, match="numpy array"):
        p2p.byte_view(obj, "send buffer", writable=False)
