"""memory.alloc.AppAllocator over a plain numpy buffer (one process, no shared memory)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memory import AppAllocator, PodError
from memory.alloc import AllocError

AREA_OFF = 4096


def make(nbytes: int = 1 << 16) -> tuple[AppAllocator, np.ndarray]:
    # A page-aligned backing store so alignment within the area is alignment in memory too.
    raw = np.zeros(nbytes + 8192, np.uint8)
    start = -raw.ctypes.data % 4096
    area = raw[start : start + nbytes]
    return AppAllocator(area, AREA_OFF, "test area"), area


def test_alloc_returns_zeroed_c_contiguous_view_of_the_area():
    al, area = make()
    area[:] = 0xAB
    a = al.alloc((3, 5), np.float32)
    assert a.shape == (3, 5) and a.dtype == np.float32
    assert a.flags.c_contiguous and a.flags.writeable
    assert not a.any()
    a[...] = 7
    off = al.area_offset(a)
    assert area[off : off + a.nbytes].view(np.float32).tolist() == [7.0] * 15
    assert al.region_offset(a) == AREA_OFF + off


def test_int_shape_and_default_dtype():
    al, _ = make()
    a = al.alloc(10)
    assert a.shape == (10,) and a.dtype == np.uint8


@pytest.mark.parametrize("align", [1, 8, 64, 256, 4096])
def test_alignment(align):
    al, _ = make()
    al.alloc(3)  # misalign the next free byte
    a = al.alloc(100, np.uint8, align=align)
    assert al.area_offset(a) % align == 0
    assert a.ctypes.data % align == 0


def test_default_alignment_is_a_cache_line():
    al, _ = make()
    for _ in range(5):
        assert al.alloc(1).ctypes.data % 64 == 0


def test_allocations_do_not_overlap_and_are_accounted():
    al, _ = make()
    arrs = [al.alloc(n) for n in (1, 63, 64, 65, 1000)]
    spans = sorted((al.area_offset(a), al.area_offset(a) + a.nbytes) for a in arrs)
    for (_, e1), (s2, _) in zip(spans, spans[1:], strict=False):
        assert e1 <= s2
    assert al.used_bytes == 1 + 63 + 64 + 65 + 1000
    for a in arrs:
        al.free(a)
    assert al.used_bytes == 0
    assert al.largest_free_bytes == al.capacity_bytes


def test_free_coalesces_in_any_order():
    al, _ = make(1 << 12)
    a, b, c = (al.alloc(1024, align=1) for _ in range(3))
    rest = al.alloc(1024, align=1)
    assert al.largest_free_bytes == 0
    al.free(a)
    al.free(c)
    assert al.largest_free_bytes == 1024
    al.free(b)  # joins a and c
    assert al.largest_free_bytes == 3072
    al.free(rest)
    assert al.largest_free_bytes == 4096


def test_full_area_raises_alloc_error_with_numbers():
    al, _ = make(4096)
    al.alloc(4000)
    with pytest.raises(AllocError) as ei:
        al.alloc(200)
    msg = str(ei.value)
    assert "200 B" in msg and "test area" in msg and "4096" in msg
    assert isinstance(ei.value, MemoryError) and isinstance(ei.value, PodError)


def test_freed_space_is_reused():
    al, _ = make(4096)
    a = al.alloc(4096)
    al.free(a)
    b = al.alloc(4096)
    assert al.area_offset(b) == 0


def test_zero_sized_allocations_have_the_right_shape():
    al, _ = make()
    a = al.alloc(0)
    b = al.alloc((0, 7), np.float64)
    assert a.size == 0 and b.shape == (0, 7) and b.dtype == np.float64


def test_free_of_zero_sized_allocation_frees_only_itself():
    # numpy gives every empty view the same base pointer, so an empty allocation must not be
    # found by address: freeing it must not free the allocation at offset 0 (regression test)
    al, _ = make()
    x = al.alloc(100)
    used = al.used_bytes
    z = al.alloc(0)
    al.free(z)
    assert al.used_bytes == used
    y = al.alloc(100)
    assert al.area_offset(y) != al.area_offset(x), "y overlaps the live array x"
    al.free(x)
    al.free(y)
    assert al.used_bytes == 0


def test_empty_area():
    al, _ = make(0)
    assert al.capacity_bytes == 0
    with pytest.raises(AllocError):
        al.alloc(1)


@pytest.mark.parametrize(
    "args, exc",
    [
        (((4,), object), TypeError),
        (((4,), np.dtype([("a", "i8"), ("b", "O")])), TypeError),
        (((-1,), np.uint8), ValueError),
        (((2, -3), np.uint8), ValueError),
        (("x", np.uint8), ValueError),
        ((2.5, np.uint8), ValueError),
        (((2, None), np.uint8), ValueError),
        (((True,), np.uint8), ValueError),
        ((4, "not-a-dtype"), TypeError),
    ],
)
def test_bad_requests(args, exc):
    al, _ = make()
    with pytest.raises(exc, match="alloc: (shape|negative|dtype)"):
        al.alloc(*args)
    assert al.alloc(8).size == 8  # and the allocator still works


@pytest.mark.parametrize("align", [0, 3, 48, -64])
def test_bad_alignment(align):
    al, _ = make()
    with pytest.raises(ValueError, match="align"):
        al.alloc(8, np.uint8, align=align)


def test_free_rejects_foreign_arrays_and_double_free():
    al, _ = make()
    a = al.alloc(256)
    with pytest.raises(ValueError):
        al.free(np.zeros(256, np.uint8))  # not in the area
    with pytest.raises(ValueError):
        al.free(a[8:])  # not the start of an allocation
    al.free(a)
    with pytest.raises(ValueError):
        al.free(a)  # double free
    assert al.used_bytes == 0


def test_area_offset_of_outside_array():
    al, _ = make()
    with pytest.raises(ValueError, match="not inside"):
        al.area_offset(np.zeros(4))


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.one_of(
            st.tuples(st.just("alloc"), st.integers(0, 3000), st.sampled_from([1, 8, 64, 512])),
            st.tuples(st.just("free"), st.integers(0, 1000), st.just(0)),
        ),
        max_size=60,
    )
)
def test_random_alloc_free_sequences(ops):
    """No two live allocations overlap, contents survive, and freeing all restores the area."""
    al, _ = make(1 << 14)
    live: list[tuple[np.ndarray, int]] = []
    tag = 0
    for op, n, align in ops:
        if op == "alloc":
            try:
                a = al.alloc(n, np.uint8, align=align)
            except AllocError:
                assert n > 0 and al.largest_free_bytes < n + align
                continue
            assert al.area_offset(a) % align == 0
            assert not a.any()
            tag = tag % 255 + 1
            a[:] = tag
            live.append((a, tag))
        elif live:
            a, t = live.pop(n % len(live))
            assert (a == t).all(), "an allocation was overwritten by another one"
            al.free(a)
    spans = sorted((al.area_offset(a), al.area_offset(a) + a.nbytes) for a, _ in live if a.nbytes)
    for (_, e1), (s2, _) in zip(spans, spans[1:], strict=False):
        assert e1 <= s2
    for a, t in live:
        assert (a == t).all()
        al.free(a)
    assert al.used_bytes == 0
    assert al.largest_free_bytes == al.capacity_bytes
