"""The C++ RMSNorm (plain, q/k-norm groups, fused residual add), RoPE and SiLU-mul kernels against the
numpy reference on every ISA path this host runs, with widths that are not multiples of a register
and 1 or 33 rows.

Tolerances: RMSNorm rtol 2e-6 (float32 sums in another order); RoPE atol 2e-6 (cos and sin are
rounded from double, the reference's from float32); SiLU-mul rtol 1e-6 against float64 (the kernel's
sigmoid is 1 / (1 + exp(-g)); the reference's 0.5 * (1 + tanh(g / 2)) cancels in float32 for g < -8,
so against it the check is absolute: 1e-6 * |up|).
"""

from __future__ import annotations

import numpy as np
import pytest
from _cpu_testing import ISAS

from mgx.kernels import cpu
from mgx.kernels import reference as ref


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("rows", "width", "group"), [(1, 40, 40), (33, 576, 576), (33, 60, 12), (3, 7, 7)])
def test_rms_norm(isa: str, rows: int, width: int, group: int) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, width)).astype(np.float32)
    residual = rng.normal(size=(rows, width)).astype(np.float32)
    weight = rng.normal(1.0, 0.1, group).astype(np.float32)
    with cpu.use_isa(isa):
        plain = cpu.rms_norm(x, weight, eps=1e-5, group=group)
        unweighted = cpu.rms_norm(x, None, eps=1e-5, group=group)
        fused, total = cpu.rms_norm(x, weight, eps=1e-5, group=group, residual=residual)
    np.testing.assert_allclose(plain, ref.rms_norm(x, weight, eps=1e-5, group=group), rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(unweighted, ref.rms_norm(x, None, eps=1e-5, group=group), rtol=2e-6, atol=1e-7)
    np.testing.assert_array_equal(total, x + residual)
    np.testing.assert_allclose(fused, ref.rms_norm(x + residual, weight, eps=1e-5, group=group), rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("rows", "heads", "kv_heads", "head_dim", "rotary_dim"), [(1, 9, 3, 64, 64), (33, 4, 2, 12, 12), (5, 3, 1, 10, 4)])
def test_rope(isa: str, rows: int, heads: int, kv_heads: int, head_dim: int, rotary_dim: int) -> None:
    rng = np.random.default_rng(1)
    q = rng.normal(size=(rows, heads * head_dim)).astype(np.float32)
    k_wide = rng.normal(size=(rows, 3 * kv_heads * head_dim)).astype(np.float32)
    k = k_wide[:, kv_heads * head_dim : 2 * kv_heads * head_dim]  # a strided view, as `split` gives
    positions = rng.integers(0, 5000, rows)
    inv_freq = (1.0 / 10000.0 ** (np.arange(0, rotary_dim, 2, dtype=np.float32) / rotary_dim)).astype(np.float32)
    want_q, want_k = ref.rope(q, k, positions, inv_freq, head_dim=head_dim, rotary_dim=rotary_dim, attention_scaling=1.5)
    with cpu.use_isa(isa):
        cos, sin = cpu.rope_table(positions, inv_freq, 1.5)
        got_q = cpu.rope(q, cos, sin, head_dim=head_dim, rotary_dim=rotary_dim)
        got_k = cpu.rope(k, cos, sin, head_dim=head_dim, rotary_dim=rotary_dim)
    np.testing.assert_allclose(got_q, want_q, atol=2e-6 * 1.5 * 5, rtol=0)
    np.testing.assert_allclose(got_k, want_k, atol=2e-6 * 1.5 * 5, rtol=0)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(("rows", "width"), [(1, 1536), (33, 36), (2, 7)])
def test_silu_mul(isa: str, rows: int, width: int) -> None:
    rng = np.random.default_rng(2)
    gate = (rng.normal(size=(rows, width)) * 6).astype(np.float32)
    gate[0, 0], gate[-1, -1] = -100.0, 100.0  # saturated ends
    up = rng.normal(size=(rows, width)).astype(np.float32)
    fused = np.concatenate([gate, up], axis=1)
    with cpu.use_isa(isa):
        two = cpu.silu_mul(gate, up)
        one = cpu.silu_mul(fused)
    g64 = gate.astype(np.float64)
    exact = g64 / (1.0 + np.exp(-g64)) * up
    np.testing.assert_allclose(two, exact, rtol=1e-6, atol=1e-37)
    np.testing.assert_allclose(two, ref.silu_mul(gate, up), rtol=0, atol=1e-6 * np.abs(up).max())
    np.testing.assert_array_equal(one, two)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"MGX_NUM_THREADS": "abc"}, "MGX_NUM_THREADS='abc' is not a thread count"),
        ({"MGX_NUM_THREADS": "0"}, "MGX_NUM_THREADS='0' is not a thread count"),
        ({"MGX_NUM_THREADS": "2.5"}, "MGX_NUM_THREADS='2.5' is not a thread count"),
        ({"MGX_CPU_ISA": "avx9000"}, "MGX_CPU_ISA='avx9000' is not a kernel path of this host: it runs "),
    ],
)
def test_bad_settings_in_the_environment_are_named(monkeypatch: pytest.MonkeyPatch, env: dict[str, str],
                                                   message: str) -> None:
    before = (cpu.num_threads(), cpu.isa())
    monkeypatch.delenv("MGX_NUM_THREADS", raising=False)
    monkeypatch.delenv("MGX_CPU_ISA", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    try:
        with pytest.raises(cpu.CPUSettingError, match="^" + message.replace(".", r"\.")):
            cpu._apply_env()
    finally:
        cpu.set_num_threads(before[0])
        cpu.set_isa(before[1])


def test_settings_in_the_environment_are_applied(monkeypatch: pytest.MonkeyPatch) -> None:
    before = (cpu.num_threads(), cpu.isa())
    monkeypatch.setenv("MGX_NUM_THREADS", " 3 ")
    monkeypatch.setenv("MGX_CPU_ISA", "scalar")
    try:
        cpu._apply_env()
        assert (cpu.num_threads(), cpu.isa()) == (3, "scalar")
    finally:
        cpu.set_num_threads(before[0])
        cpu.set_isa(before[1])
