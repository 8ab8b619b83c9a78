"""INT8 early quantization of dispatch payloads (000 §4.2.1 ②, docs/protocols.md §5), and the
16-bit combine payload (bfloat16, 000 §4.2.1: 14 KB per token at hidden 7168).

Per token (row): `scale = max|x| / 127` in float32 (1.0 for an all-zero row),
`q = clip(rint(x / scale), -127, 127)` as int8; the float32 scale travels with the token and the
expert die dequantizes with `q * scale`. On the wire a token costs `hidden` bytes + its scale
(the paper pads the 4-byte scale to 512 B; the protocols' layouts say what they pad to).

Two corrections keep the error bound true at the ends of the float32 range, and change nothing
for ordinary activations (max|x| between about 1.5e-36 and 3.4e38):
- a *subnormal* scale (max|x| < 127 * 2**-126) is stepped one float32 up: the division rounds it
  by up to half the smallest subnormal, which is large relative to such a scale and could make
  max|x| / scale exceed 127.5, i.e. clip;
- a scale whose `127 * scale` overflows to inf (max|x| within an ulp of float32 max) is stepped
  one float32 down, so that dequantization stays finite.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = [
    "BF16",
    "COMBINE_DTYPES",
    "INT8_ERROR_BOUND",
    "INT8_QMAX",
    "combine_dtype",
    "dequantize_int8",
    "quantize_int8",
    "round_combine",
    "row_scales",
]

INT8_QMAX = 127  # symmetric range: -128 is never produced

# |dequantize_int8(*quantize_int8(x)) - x| <= INT8_ERROR_BOUND * scale, per element of each row.
# In exact arithmetic rint() is off by at most 1/2, so the bound is scale / 2. Computing in float32
# adds two roundings (x / scale and q * scale), each at most 127 * 2**-24 in units of the scale:
# 254 * 2**-24 < 2**-16. Hence 1/2 + 2**-16; `x` here is the input converted to float32.
INT8_ERROR_BOUND = 0.5 + 2.0**-16

_F32 = np.finfo(np.float32)
_ACCEPTED = (np.float16, np.float32, np.float64)


def _as_f32_rows(x) -> np.ndarray:
    """`x` as float32 `[n, hidden]`; TypeError for other dtypes, ValueError for shape/non-finite."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"x: expected a numpy array, got {type(x).__name__}")
    if x.dtype.type not in _ACCEPTED:
        raise TypeError(f"x: expected float16, float32 or float64, got dtype {x.dtype}")
    if x.ndim != 2:
        raise ValueError(f"x: expected shape [n, hidden], got shape {x.shape}")
    with np.errstate(over="ignore"):  # float64 beyond float32 range becomes inf, rejected below
        x32 = x.astype(np.float32, copy=False)
    finite = np.isfinite(x32)
    if not finite.all():  # argwhere only on failure: it costs ~20x the check
        row, col = (int(v) for v in np.argwhere(~finite)[0])
        raise ValueError(
            f"x[{row}, {col}] = {x[row, col]}: values must be finite and within float32 range"
        )
    return x32


def row_scales(amax: np.ndarray) -> np.ndarray:
    """float32 scale per row from float32 `amax = max|x|` (see the module docstring); shared
    with the compiled `comm.kernels.int8.quantize_int8`."""
    with np.errstate(over="ignore", under="ignore"):
        scale = amax / np.float32(INT8_QMAX)
        low = (amax > 0) & (scale < _F32.tiny)
        scale[low] = np.nextafter(scale[low], np.float32(np.inf))
        high = np.isinf(scale * np.float32(INT8_QMAX))
        scale[high] = np.nextafter(scale[high], np.float32(0))
    scale[amax == 0] = np.float32(1.0)
    return scale


def quantize_int8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-token INT8 quantization, computed in float32.

    Arguments:
        x: float16 / float32 / float64 `[n, hidden]`, finite and within float32 range; converted
            to float32 first. `n` and `hidden` may be 0.

    Returns:
        q: int8 `[n, hidden]`, `clip(rint(x / scale[:, None]), -127, 127)` (rint: half to even).
        scale: float32 `[n]`, `max|x[row]| / 127` (1.0 for an all-zero row); see the module
            docstring for the two range-end corrections.

    Guarantee: `|dequantize_int8(q, scale) - x| <= INT8_ERROR_BOUND * scale[:, None]`, i.e.
    half a quantization step plus float32 rounding (`INT8_ERROR_BOUND = 1/2 + 2**-16`).
    """
    x32 = _as_f32_rows(x)
    amax = np.max(np.abs(x32), axis=1, initial=np.float32(0)).astype(np.float32)
    scale = row_scales(amax)
    q = np.clip(np.rint(x32 / scale[:, None]), -INT8_QMAX, INT8_QMAX).astype(np.int8)
    return q, scale


def dequantize_int8(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Inverse of `quantize_int8`: `q.astype(float32) * scale[:, None]`.

    Arguments:
        q: int8 `[n, hidden]`.
        scale: float32 `[n]`, one scale per row.

    Returns:
        x: float32 `[n, hidden]`.
    """
    if not isinstance(q, np.ndarray) or q.dtype != np.int8:
        raise TypeError(f"q: expected an int8 numpy array, got {getattr(q, 'dtype', type(q))}")
    if not isinstance(scale, np.ndarray) or scale.dtype != np.float32:
        raise TypeError(
            f"scale: expected a float32 numpy array, got {getattr(scale, 'dtype', type(scale))}"
        )
    if q.ndim != 2 or scale.shape != (q.shape[0],):
        raise ValueError(
            f"q, scale: expected shapes [n, hidden] and [n], got {q.shape} and {scale.shape}"
        )
    return q.astype(np.float32) * scale[:, None]


# -- the combine payload -------------------------------------------------------------------------

# bfloat16 from ml_dtypes (the JAX project's numpy dtype): float32 -> bfloat16 rounds to nearest,
# ties to even, keeps inf and NaN (a NaN stays a NaN), subnormals included; bfloat16 -> float32
# is exact. Its C cast runs at ~7 GB/s of float32 input here, faster than the same rounding
# written as numpy integer passes (tests/unit/test_bf16.py checks it against IEEE RNE bit by bit).
BF16 = np.dtype(ml_dtypes.bfloat16)
COMBINE_DTYPES = ("bfloat16", "float32")


def combine_dtype(name_or_bytes: str | int) -> np.dtype:
    """The numpy dtype of combine rows: "bfloat16" / 2 -> BF16, "float32" / 4 -> float32."""
    if name_or_bytes in ("bfloat16", 2):
        return BF16
    if name_or_bytes in ("float32", 4):
        return np.dtype(np.float32)
    raise ValueError(f"combine dtype: {name_or_bytes!r} is not one of {COMBINE_DTYPES}")


def round_combine(rows: np.ndarray, dtype: str | int | np.dtype = "bfloat16") -> np.ndarray:
    """float32 rows as the combine delivers them: rounded to bfloat16 and back (exact), or
    unchanged for float32. The reference's side of the contract: a row's value after the trip."""
    dt = dtype if isinstance(dtype, np.dtype) else combine_dtype(dtype)
    if dt == np.float32:
        return rows
    return rows.astype(dt).astype(np.float32)
