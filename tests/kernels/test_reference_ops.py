"""The numpy reference kernels against torch implementations written here, on awkward shapes."""

from __future__ import annotations

import numpy as np
import pytest

from mgx.kernels import reference as ref

torch = pytest.importorskip("torch")
F = torch.nn.functional


def rand(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def t(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x)).double()


def close(got: np.ndarray, want: torch.Tensor, atol: float = 1e-5) -> None:
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want.numpy(), atol=atol, rtol=1e-5)


@pytest.mark.parametrize("tokens", [[0], [4, 4, 0, 12, 7]])
def test_embedding(tokens: list[int]) -> None:
    w = rand(np.random.default_rng(0), 13, 7)
    close(ref.embedding(np.array(tokens), w), F.embedding(torch.tensor(tokens), t(w)))


def test_embedding_rejects_out_of_vocab() -> None:
    with pytest.raises(IndexError, match="outside the vocabulary"):
        ref.embedding(np.array([1, 13]), np.zeros((13, 4), np.float32))


@pytest.mark.parametrize(
    ("tokens", "width", "group", "weighted"), [(1, 9, 9, True), (5, 24, 8, True), (3, 12, 4, False)]
)
def test_rms_norm(tokens: int, width: int, group: int, weighted: bool) -> None:
    rng = np.random.default_rng(1)
    x, w = rand(rng, tokens, width, scale=3.0), rand(rng, group)
    want = F.rms_norm(t(x).view(tokens, -1, group), (group,), t(w) if weighted else None, eps=1e-6)
    close(ref.rms_norm(x, w if weighted else None, eps=1e-6, group=group), want.view(tokens, width))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tokens", [1, 6])
def test_linear(tokens: int, bias: bool) -> None:
    rng = np.random.default_rng(2)
    x, w, b = rand(rng, tokens, 11), rand(rng, 5, 11), rand(rng, 5)
    want = F.linear(t(x), t(w), t(b) if bias else None)
    close(ref.linear(x, w, b if bias else None), want)


def test_split() -> None:
    x = rand(np.random.default_rng(3), 4, 10)
    parts = ref.split(x, [6, 2, 2])
    for got, want in zip(parts, torch.split(t(x), [6, 2, 2], dim=1), strict=True):
        close(np.ascontiguousarray(got), want)


def torch_rope(x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, d: int, rot: int, scaling: float):
    """HF Llama: q * cos + rotate_half(q) * sin on the first ``rot`` dims of each head."""
    h = x.view(x.shape[0], -1, d)  # [T, H, D]
    freqs = pos.double()[:, None] * inv_freq.double()[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]
    cos, sin = emb.cos() * scaling, emb.sin() * scaling
    xr, xp = h[..., :rot], h[..., rot:]
    x1, x2 = xr[..., : rot // 2], xr[..., rot // 2 :]
    rotated = torch.cat([-x2, x1], dim=-1)
    return torch.cat([xr * cos + rotated * sin, xp], dim=-1).reshape(x.shape)


@pytest.mark.parametrize(
    ("hq", "hk", "d", "rot", "positions", "scaling"),
    [
        (4, 2, 8, 8, [0, 1, 2], 1.0),
        (6, 2, 10, 6, [5], 1.0),  # partial rotary, one decode token
        (3, 3, 4, 4, [17, 18, 19, 20, 21, 22, 23], 1.3),  # an offset chunk, scaled cos/sin
    ],
)
def test_rope(hq: int, hk: int, d: int, rot: int, positions: list[int], scaling: float) -> None:
    rng = np.random.default_rng(4)
    n = len(positions)
    q, k = rand(rng, n, hq * d), rand(rng, n, hk * d)
    pos = np.array(positions)
    inv_freq = (1.0 / 10000.0 ** (np.arange(0, rot, 2) / rot)).astype(np.float32)
    gq, gk = ref.rope(q, k, pos, inv_freq, head_dim=d, rotary_dim=rot, attention_scaling=scaling)
    close(gq, torch_rope(t(q), torch.tensor(pos), t(inv_freq), d, rot, scaling))
    close(gk, torch_rope(t(k), torch.tensor(pos), t(inv_freq), d, rot, scaling))


def torch_attention(q, k, v, q_pos, hq: int, hk: int, d: int, scale: float, window: int) -> torch.Tensor:
    """SDPA with an explicit mask; K/V heads repeated for GQA like HF's repeat_kv."""
    qh = q.view(q.shape[0], hq, d).transpose(0, 1)  # [Hq, T, D]
    kh = k.view(k.shape[0], hk, d).transpose(0, 1).repeat_interleave(hq // hk, dim=0)  # [Hq, S, D]
    vh = v.view(v.shape[0], hk, d).transpose(0, 1).repeat_interleave(hq // hk, dim=0)
    p, j = q_pos[:, None], torch.arange(k.shape[0])[None, :]
    mask = j <= p
    if window:
        mask &= j > p - window
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)  # [Hq, T, D]
    return out.transpose(0, 1).reshape(q.shape[0], hq * d)


@pytest.mark.parametrize(
    ("hq", "hk", "d", "cached", "new", "window"),
    [
        (4, 4, 8, 0, 5, 0),  # prefill, MHA
        (6, 2, 8, 9, 1, 0),  # decode over a cache, GQA groups of 3
        (6, 3, 5, 4, 7, 0),  # a chunk after a cache, odd head_dim
        (4, 1, 8, 0, 11, 3),  # sliding window in prefill (MQA)
        (4, 2, 8, 10, 2, 4),  # sliding window over a cache
    ],
)
def test_attention(hq: int, hk: int, d: int, cached: int, new: int, window: int) -> None:
    rng = np.random.default_rng(5)
    s = cached + new
    q, k, v = rand(rng, new, hq * d), rand(rng, s, hk * d), rand(rng, s, hk * d)
    pos = np.arange(cached, s)
    scale = 1.0 / np.sqrt(d)
    got = ref.attention(
        q, k, v, pos, num_heads=hq, num_kv_heads=hk, head_dim=d, scale=scale, sliding_window=window
    )
    close(got, torch_attention(t(q), t(k), t(v), torch.tensor(pos), hq, hk, d, scale, window))


@pytest.mark.parametrize("fused", [False, True])
def test_silu_mul(fused: bool) -> None:
    rng = np.random.default_rng(6)
    gate, up = rand(rng, 3, 7, scale=20.0), rand(rng, 3, 7)  # large gates: no overflow warnings
    want = F.silu(t(gate)) * t(up)
    with np.errstate(all="raise"):
        got = ref.silu_mul(np.concatenate([gate, up], axis=1)) if fused else ref.silu_mul(gate, up)
    close(got, want, atol=1e-4)


def test_add() -> None:
    rng = np.random.default_rng(7)
    a, b = rand(rng, 2, 5), rand(rng, 2, 5)
    close(ref.add(a, b), t(a) + t(b))
