"""comm.quant: INT8 early quantization, by hand and against its documented error bound."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from comm import quant
from comm.quant import INT8_ERROR_BOUND, dequantize_int8, quantize_int8

F32 = np.finfo(np.float32)


def check_bound(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantize `x`, check the documented guarantees, return (q, scale)."""
    q, scale = quantize_int8(x)
    assert q.dtype == np.int8 and q.shape == x.shape
    assert scale.dtype == np.float32 and scale.shape == (x.shape[0],)
    assert np.isfinite(scale).all() and (scale > 0).all()
    assert (q >= -127).all() and (q <= 127).all()
    back = dequantize_int8(q, scale)
    assert back.dtype == np.float32 and np.isfinite(back).all()
    # the error in float64 so that the check itself does not round
    err = np.abs(back.astype(np.float64) - x.astype(np.float32).astype(np.float64))
    limit = INT8_ERROR_BOUND * scale.astype(np.float64)[:, None]
    worst = np.argwhere(err > limit)
    assert worst.size == 0, f"bound broken at {worst[0]}: err {err[tuple(worst[0])]}"
    zero = ~x.any(axis=1)
    assert (scale[zero] == 1).all() and (q[zero] == 0).all()
    return q, scale


def test_by_hand():
    x = np.array(
        [
            [127.0, -63.5, 0.0, 1.0, 62.5],  # scale 1; rint is half-to-even: -63.5 -> -64
            [0.0, 0.0, 0.0, 0.0, 0.0],  # all zero: scale 1
            [2.0, -1.0, 0.5, 0.0, -2.0],  # scale 2/127
        ],
        dtype=np.float32,
    )
    q, scale = quantize_int8(x)
    np.testing.assert_array_equal(scale, np.array([1, 1, np.float32(2) / 127], np.float32))
    np.testing.assert_array_equal(
        q, np.array([[127, -64, 0, 1, 62], [0, 0, 0, 0, 0], [127, -64, 32, 0, -127]], np.int8)
    )
    np.testing.assert_array_equal(dequantize_int8(q, scale)[0], [127, -64, 0, 1, 62])


def test_bound_constant_is_half_a_step_plus_float32_rounding():
    assert INT8_ERROR_BOUND == 0.5 + 2.0**-16
    assert "INT8_ERROR_BOUND" in quantize_int8.__doc__
    # why not exactly 1/2: x / scale = -25.49999... rounds to -25.5 in float32, rint makes it -26
    x = np.array([[3.685620069503784, -0.74002605676651]], np.float32)
    q, scale = quantize_int8(x)
    err = abs(float(dequantize_int8(q, scale)[0, 1]) - float(x[0, 1])) / float(scale[0])
    assert 0.5 < err <= INT8_ERROR_BOUND


@pytest.mark.parametrize("shape", [(0, 8), (3, 0), (0, 0)])
def test_empty(shape):
    q, scale = quantize_int8(np.zeros(shape, np.float32))
    assert q.shape == shape and q.dtype == np.int8
    assert scale.shape == (shape[0],) and (scale == 1).all()
    assert dequantize_int8(q, scale).shape == shape


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_input_dtypes_are_computed_in_float32(dtype):
    x = np.random.default_rng(7).standard_normal((4, 16)).astype(dtype)
    q, scale = quantize_int8(x)
    q32, scale32 = quantize_int8(x.astype(np.float32))
    np.testing.assert_array_equal(q, q32)
    np.testing.assert_array_equal(scale, scale32)


def test_scale_is_max_over_127_in_float32():
    x = np.random.default_rng(3).standard_normal((64, 32)).astype(np.float32) * 1e3
    _, scale = quantize_int8(x)
    np.testing.assert_array_equal(scale, np.abs(x).max(axis=1) / np.float32(127))


@pytest.mark.parametrize(
    "x, exc, msg",
    [
        (np.zeros((2, 3), np.int32), TypeError, "x: expected float16, float32 or float64"),
        (np.zeros((2, 3), np.complex64), TypeError, "got dtype complex64"),
        ([[1.0, 2.0]], TypeError, "x: expected a numpy array, got list"),
        (np.zeros(3, np.float32), ValueError, r"x: expected shape \[n, hidden\]"),
        (np.array([[1, np.nan]], np.float32), ValueError, r"x\[0, 1\] = nan: values must be"),
        (np.array([[1], [-np.inf]], np.float32), ValueError, r"x\[1, 0\] = -inf"),
        (np.array([[1e39]], np.float64), ValueError, "within float32 range"),
    ],
)
def test_quantize_rejects_bad_input(x, exc, msg):
    with pytest.raises(exc, match=msg):
        quantize_int8(x)


@pytest.mark.parametrize(
    "q, scale, exc, msg",
    [
        (np.zeros((2, 3), np.int16), np.ones(2, np.float32), TypeError, "q: expected an int8"),
        (np.zeros((2, 3), np.int8), np.ones(2), TypeError, "scale: expected a float32"),
        (np.zeros((2, 3), np.int8), np.ones(3, np.float32), ValueError, r"got \(2, 3\) and"),
    ],
)
def test_dequantize_rejects_bad_input(q, scale, exc, msg):
    with pytest.raises(exc, match=msg):
        dequantize_int8(q, scale)


# -- the error bound -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "row",
    [
        [F32.max, -F32.max, F32.max / 3],  # 127 * scale would overflow without the correction
        [F32.smallest_subnormal, 0.0, -F32.smallest_subnormal],  # scale / 127 rounds to 0
        [F32.smallest_subnormal * 190, F32.smallest_subnormal * 63],  # would clip
        [F32.tiny * 100, -F32.tiny],
        [F32.tiny * 127, F32.tiny * 126.5],
        [1e-30, 1e30],
    ],
)
def test_bound_at_the_ends_of_the_float32_range(row):
    check_bound(np.array([row], dtype=np.float32))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("exponent", [-44, -40, -37, -20, 0, 20, 37])
def test_bound_random_magnitudes(seed, exponent):
    print(f"seed={seed} exponent={exponent}")
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((200, 257)) * 10.0**exponent
    x *= rng.integers(0, 2, size=(200, 1))  # about half of the rows all zero
    x = np.clip(x, -F32.max, F32.max).astype(np.float32)
    q, scale = check_bound(x)
    normal = np.abs(x).max(axis=1) >= 2 * 127 * F32.tiny
    # where the scale needs no correction, the largest element lands on +-127 exactly
    assert (np.abs(q[normal]).max(axis=1, initial=0) == 127).all()


@settings(max_examples=300, deadline=None)
@given(
    hnp.arrays(
        np.float32,
        hnp.array_shapes(min_dims=2, max_dims=2, min_side=0, max_side=12),
        elements=st.floats(width=32, allow_nan=False, allow_infinity=False),
    )
)
def test_bound_hypothesis(x):
    check_bound(x)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 6),
    st.floats(width=32, min_value=F32.smallest_subnormal, max_value=F32.max),
    st.data(),
)
def test_bound_hypothesis_one_magnitude(n, magnitude, data):
    """Rows with values in [-magnitude, magnitude], so every magnitude is explored, huge or tiny."""
    elems = st.floats(-magnitude, magnitude, width=32)
    x = data.draw(hnp.arrays(np.float32, (n, 9), elements=elems))
    check_bound(x)


def test_module_documents_the_corrections():
    assert "subnormal" in quant.__doc__ and "overflows" in quant.__doc__
