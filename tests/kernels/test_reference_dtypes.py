"""bf16/f16 helpers and weight dequantization against torch."""

from __future__ import annotations

import numpy as np
import pytest

from mgx.formats.ir import DType, Tensor
from mgx.kernels import reference as ref

torch = pytest.importorskip("torch")

SPECIALS = np.array(
    [0.0, -0.0, 1.0, -2.5, 1e-40, 3.0e38, 3.4e38, -3.4e38, np.inf, -np.inf, np.nan, 1.00390625, 1.01171875],
    dtype=np.float32,
)


def test_f32_to_bf16_rounds_like_torch() -> None:
    x = np.concatenate([SPECIALS, np.random.default_rng(0).standard_normal(4096).astype(np.float32) * 100])
    got = ref.f32_to_bf16(x)
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    finite = ~np.isnan(x)
    np.testing.assert_array_equal(got[finite], want[finite])
    assert np.isnan(ref.bf16_to_f32(got[~finite])).all()


def test_bf16_to_f32_is_exact() -> None:
    bits = np.arange(0, 1 << 16, 7, dtype=np.uint16)
    want = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(ref.bf16_to_f32(bits), want)
    np.testing.assert_array_equal(ref.f32_to_bf16(ref.bf16_to_f32(bits[:1000])), bits[:1000])


def test_bf16_to_f32_wants_bit_patterns() -> None:
    with pytest.raises(TypeError, match="uint16"):
        ref.bf16_to_f32(np.zeros(3, np.float32))


def test_to_f32() -> None:
    x = np.array([[1.5, -2.25]], np.float32)
    assert ref.to_f32(x, DType.F32) is x  # no copy
    np.testing.assert_array_equal(ref.to_f32(x.astype(np.float16), DType.F16), x)
    np.testing.assert_array_equal(ref.to_f32(ref.f32_to_bf16(x), DType.BF16), x)
    with pytest.raises(TypeError, match="floating"):
        ref.to_f32(np.zeros(2, np.int8), DType.I8)


def test_dequantize_plain_and_unknown_schemes() -> None:
    w = np.array([[1.0, 2.0]], np.float32)
    np.testing.assert_array_equal(ref.dequantize(Tensor("w", DType.BF16, (1, 2), ref.f32_to_bf16(w))), w)
    with pytest.raises(ref.UnsupportedWeightError, match=r"scheme 'int4_g128'.*known:.*none"):
        ref.dequantize(Tensor("w", DType.U8, (1, 2), np.zeros((1, 2), np.uint8), scheme="int4_g128"))
    with pytest.raises(ref.UnsupportedWeightError, match="layout 'tiled'"):
        ref.dequantize(Tensor("w", DType.F32, (1, 2), w, layout="tiled"))
