"""Reference kernels: one function per IR op (see ``mgx.formats.ir.OP_SPECS``), float32 numpy.

Activations are ``[T, F]`` float32 arrays, the tokens of one step packed along T. The kernels are
pure: they never keep state, and attention works on one sequence at a time (the backend loops).
"""

from __future__ import annotations

import numpy as np

__all__ = ["embedding", "rms_norm", "linear", "split", "rope", "attention", "silu_mul", "add"]


def embedding(tokens: np.ndarray, weight: np.ndarray) -> np.ndarray:
    """Rows of ``weight`` [V, H] for ``tokens`` [T] -> [T, H]."""
    tokens = np.asarray(tokens)
    vocab = weight.shape[0]
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab):
        bad = tokens[(tokens < 0) | (tokens >= vocab)][0]
        raise IndexError(f"token id {int(bad)} is outside the vocabulary [0, {vocab})")
    return np.ascontiguousarray(weight[tokens], dtype=np.float32)


def rms_norm(x: np.ndarray, weight: np.ndarray | None, *, eps: float, group: int) -> np.ndarray:
    """Scale each contiguous group of ``group`` features of x [T, F] to unit RMS, times weight [group]."""
    t, f = x.shape
    g = x.reshape(t, f // group, group)  # [T, F/group, group]
    out = g * (1.0 / np.sqrt(np.mean(g * g, axis=-1, keepdims=True) + np.float32(eps)))
    if weight is not None:
        out = out * weight
    return out.reshape(t, f).astype(np.float32, copy=False)


def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """x [T, K] @ weight[N, K]^T (+ bias [N]) -> [T, N]."""
    out = x @ weight.T
    if bias is not None:
        out += bias
    return out


def split(x: np.ndarray, sizes: list[int]) -> list[np.ndarray]:
    """x [T, sum(sizes)] -> one [T, size] array per size (views)."""
    bounds = np.cumsum(sizes)[:-1]
    return np.split(x, bounds, axis=1)


def rope(
    q: np.ndarray,
    k: np.ndarray,
    positions: np.ndarray,
    inv_freq: np.ndarray,
    *,
    head_dim: int,
    rotary_dim: int,
    attention_scaling: float = 1.0,
) -> tuple[np.ndarray, np.ndarray]:
    """Rotate q [T, Hq*D] and k [T, Hk*D] at ``positions`` [T], rotate-half (neox/HF Llama) style.

    Only the first ``rotary_dim`` dims of each head turn; the rest pass through.
    """
    # The angle is a float32 product, as HF computes it, so long positions round the same way.
    angle = positions.astype(np.float32)[:, None] * inv_freq.astype(np.float32)[None, :]  # [T, R/2]
    angle = np.concatenate([angle, angle], axis=-1)[:, None, :]  # [T, 1, R]
    cos = np.cos(angle) * np.float32(attention_scaling)
    sin = np.sin(angle) * np.float32(attention_scaling)
    return _rotate(q, cos, sin, head_dim, rotary_dim), _rotate(k, cos, sin, head_dim, rotary_dim)


def _rotate(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, head_dim: int, rotary_dim: int) -> np.ndarray:
    t = x.shape[0]
    h = x.reshape(t, -1, head_dim)  # [T, H, D]
    rot = h[..., :rotary_dim]
    half = rotary_dim // 2
    rotated = np.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)  # rotate_half
    out = h.astype(np.float32, copy=True)
    out[..., :rotary_dim] = rot * cos + rotated * sin
    return out.reshape(t, -1)


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    q_positions: np.ndarray,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    scale: float,
    sliding_window: int = 0,
) -> np.ndarray:
    """Causal GQA attention of one sequence.

    q [T, Hq*D] are queries at ``q_positions`` [T]; k, v [S, Hk*D] are all the keys and values the
    sequence has (cached ones and the new ones), key j being at position j. A query at position p
    sees keys j <= p, and with ``sliding_window`` w > 0 only those with p - j < w. -> [T, Hq*D]
    """
    t, s = q.shape[0], k.shape[0]
    group = num_heads // num_kv_heads
    qh = q.reshape(t, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3)  # [Hk, G, T, D]
    kh = k.reshape(s, num_kv_heads, head_dim).transpose(1, 0, 2)  # [Hk, S, D]
    vh = v.reshape(s, num_kv_heads, head_dim).transpose(1, 0, 2)  # [Hk, S, D]
    scores = (qh @ kh[:, None].swapaxes(-1, -2)) * np.float32(scale)  # [Hk, G, T, S]
    p = np.asarray(q_positions)[:, None]  # [T, 1]
    j = np.arange(s)[None, :]  # [1, S]
    visible = j <= p
    if sliding_window > 0:
        visible &= p - j < sliding_window
    scores = np.where(visible, scores, -np.inf)
    scores -= scores.max(axis=-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(axis=-1, keepdims=True)
    out = probs @ vh[:, None]  # [Hk, G, T, D]
    return np.ascontiguousarray(out.transpose(2, 0, 1, 3)).reshape(t, num_heads * head_dim)


def silu_mul(gate: np.ndarray, up: np.ndarray | None = None) -> np.ndarray:
    """silu(gate) * up; with ``up`` None, gate [T, 2F] holds gate then up -> [T, F]."""
    if up is None:
        gate, up = np.split(gate, 2, axis=1)
    sigmoid = 0.5 * (1.0 + np.tanh(0.5 * gate))  # = 1 / (1 + exp(-gate)), without overflow
    return gate * sigmoid * up


def add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a + b, same shape."""
    return a + b
