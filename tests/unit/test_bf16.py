"""The bfloat16 combine payload: ml_dtypes' float32 -> bfloat16 cast is IEEE round-to-nearest,
ties to even, bit for bit (checked against an integer implementation written here), at the
edges too (ties, subnormals, the largest finite values, inf, NaN, signed zeros)."""

from __future__ import annotations

import numpy as np
import pytest

from comm.quant import BF16, combine_dtype, round_combine


def rne_bits(x: np.ndarray) -> np.ndarray:
    """uint16 bfloat16 bits of float32 `x`: IEEE round to nearest, ties to even (NaN: quiet)."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    rounded[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)  # keep the sign, quiet the NaN
    return rounded


def bits(f32_bits: list[int]) -> np.ndarray:
    return np.array(f32_bits, np.uint32).view(np.float32)


EDGES = [
    0x00000000, 0x80000000,  # +-0
    0x3F800000, 0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF,  # 1.0, ties to even, near ties
    0xBF808000, 0xBF818000,  # negative ties
    0x00000001, 0x00008000, 0x00018000, 0x007FFFFF, 0x00800000, 0x807FFFFF,  # subnormals
    0x7F7FFFFF, 0x7F7F7FFF, 0x7F7F8000, 0xFF7FFFFF,  # largest finite: some round to inf
    0x7F800000, 0xFF800000,  # inf
    0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FBFFFFF,  # NaNs (quiet, signed, signalling)
]  # fmt: skip


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast")
def test_edges_are_round_to_nearest_even():
    x = bits(EDGES)
    got = x.astype(BF16).view(np.uint16)
    want = rne_bits(x)
    finite = ~np.isnan(x)
    assert np.array_equal(got[finite], want[finite]), [
        (hex(e), hex(g), hex(w)) for e, g, w in zip(EDGES, got, want, strict=True) if g != w
    ]
    back = x.astype(BF16).astype(np.float32)
    assert np.isnan(back[~finite]).all()  # a NaN stays a NaN
    assert np.signbit(back[1]) and back[1] == 0  # -0 stays -0
    assert back[2] == 1.0 and back[3] == 1.0  # 1 + 2**-8: the tie goes to the even 1.0
    assert back[4] == np.float32(1 + 2**-6)  # 1 + 3 * 2**-8: the tie goes up, to even
    assert np.isinf(back[15]) and np.isfinite(back[16])  # max float32 rounds to inf


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast")
@pytest.mark.parametrize("seed", range(4))
def test_random_bit_patterns_match_the_integer_rounding(seed):
    u = np.random.default_rng(seed).integers(0, 1 << 32, 1 << 18, dtype=np.uint64)
    x = u.astype(np.uint32).view(np.float32)
    finite = ~np.isnan(x)
    got = x.astype(BF16).view(np.uint16)
    assert np.array_equal(got[finite], rne_bits(x)[finite])
    assert np.isnan(x[~finite].astype(BF16).astype(np.float32)).all()


def test_round_combine_is_the_trip_and_exact_for_float32():
    rng = np.random.default_rng(7)
    rows = rng.standard_normal((5, 33)).astype(np.float32)
    assert round_combine(rows, "float32") is rows
    r = round_combine(rows)
    assert r.dtype == np.float32
    assert np.array_equal(r.view(np.uint32) & 0xFFFF, np.zeros(r.shape, np.uint32))
    assert np.array_equal(r.view(np.uint32) >> 16, rne_bits(rows).astype(np.uint32))
    assert np.array_equal(round_combine(r), r)  # bfloat16 values survive the trip unchanged
    assert np.abs(r - rows).max() <= np.abs(rows).max() * 2.0**-8


def test_combine_dtype_names():
    assert combine_dtype("bfloat16") == BF16 == combine_dtype(2)
    assert combine_dtype("float32") == np.float32 == combine_dtype(4)
    with pytest.raises(ValueError, match="bfloat16"):
        combine_dtype("float16")


# -- the compiled kernel the pods use (comm.kernels) -----------------------------------------------


@pytest.mark.filterwarnings("ignore:invalid value encountered in cast")
@pytest.mark.parametrize("seed", range(3))
def test_kernel_equals_the_rounding_on_edges_and_random_bits(seed):
    from comm.kernels import to_bfloat16

    u = np.random.default_rng(seed).integers(0, 1 << 32, (64, 4096), dtype=np.uint64)
    x = u.astype(np.uint32).view(np.float32)
    x[0, : len(EDGES)] = bits(EDGES)
    got = to_bfloat16(x).view(np.uint16)
    finite = ~np.isnan(x)
    assert np.array_equal(got[finite], rne_bits(x)[finite])
    assert np.array_equal(got[finite], x.astype(BF16).view(np.uint16)[finite])
    back = got[~finite].view(BF16).astype(np.float32)
    assert np.isnan(back).all()
    assert np.array_equal(np.signbit(back), np.signbit(x[~finite]))  # a NaN keeps its sign


def test_kernel_gathers_rows_into_a_strided_buffer():
    from comm.kernels import to_bfloat16

    rng = np.random.default_rng(3)
    rows = rng.standard_normal((7, 33)).astype(np.float32)
    order = np.array([6, 0, 0, 3], np.int64)
    buf = np.full((4, 48), 7, BF16)  # rows of 48, the first 33 written
    to_bfloat16(rows, buf[:, :33], order)
    assert np.array_equal(buf[:, :33].view(np.uint16), rne_bits(rows[order]))
    assert (buf[:, 33:].astype(np.float32) == 7).all()  # the padding is not touched
    assert to_bfloat16(rows[:0]).shape == (0, 33)


@pytest.mark.parametrize(
    "args, error",
    [
        ((np.zeros((2, 3), np.float64),), TypeError),
        ((np.zeros(3, np.float32),), TypeError),
        ((np.zeros((2, 3), np.float32), np.zeros((2, 3), np.float32)), TypeError),
        ((np.zeros((2, 3), np.float32), np.zeros((3, 3), BF16)), TypeError),
        ((np.zeros((2, 3), np.float32), np.zeros((2, 6), BF16)[:, ::2]), ValueError),
        ((np.zeros((2, 3), np.float32), None, np.array([0, 2])), ValueError),
        ((np.zeros((2, 3), np.float32), None, np.array([-1])), ValueError),
    ],
)
def test_kernel_refuses_bad_arguments(args, error):
    from comm.kernels import to_bfloat16

    with pytest.raises(error):
        to_bfloat16(*args)
