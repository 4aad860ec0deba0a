"""Calibrated rounding (GPTQ, Frantar et al. 2022) and pruning (SparseGPT, Frantar & Alistarh 2023).

Both walk the columns of W [N, K] in order, replace each column by its quantized (or pruned) value,
and spread the resulting error over the columns not yet visited, weighted by the inverse of the
layer's input Hessian H = E[x x^T] so that the layer's output on the calibration activations moves
as little as possible. Rows never interact, so matrices that read the same input can be stacked
and solved at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ._base import PassError

__all__ = ["ColumnQuantizer", "obs_solve"]

# Columns whose error is pushed to the rest of W in one matmul (rounded up to a multiple of the
# group width), and, inside a block, columns updated one by one before a smaller matmul.
_BLOCK = 128
_SUB = 16

@dataclass(frozen=True, slots=True)
class ColumnQuantizer:
    """How columns are rounded: fitted once per group of ``group_cols`` columns, applied column by column."""

    group_cols: int  # columns sharing one set of parameters (K for none)
    # fit(w [N, g] current values, zeroed where pruned) -> parameters for those columns
    fit: Callable[[np.ndarray], tuple[np.ndarray, ...]]
    # round(w [N] one column, params, index of the column within its group) -> the stored value [N]
    round: Callable[[np.ndarray, tuple[np.ndarray, ...], int], np.ndarray]


def _inverse_cholesky(h: np.ndarray, damp: float) -> np.ndarray:
    """The upper triangular U with U^T U = (H + damp * mean(diag H) * I)^-1, as GPTQ uses it.

    With J the exchange matrix and J H J = M M^T (Cholesky), U = J M^-1 J: one factorization and
    one triangular inverse.
    """
    h = np.array(h[::-1, ::-1], dtype=np.float64, copy=True)  # J H J
    k = h.shape[0]
    h[np.diag_indices(k)] += damp * float(np.mean(np.diag(h)))
    try:
        m = np.linalg.cholesky(h)
    except np.linalg.LinAlgError:
        raise PassError("the calibration Hessian is not positive definite; raise `damp`") from None
    return np.linalg.inv(m)[::-1, ::-1]


def obs_solve(
    w: np.ndarray,
    hessian: np.ndarray,
    *,
    quantizer: ColumnQuantizer | None = None,
    keep: np.ndarray | None = None,
    prune_2_4: bool = False,
    damp: float = 0.01,
    act_order: bool = False,
) -> tuple[np.ndarray, np.ndarray | None, list[tuple[np.ndarray, ...]]]:
    """Round and/or prune ``w`` [N, K] column by column with error feedback through ``hessian`` [K, K].

    ``keep`` is a fixed keep mask [N, K] (pruned entries become 0); with ``prune_2_4`` the mask is
    chosen on the way, two of every four columns per row by the SparseGPT saliency w^2 / [H^-1]_kk^2.
    With ``act_order`` columns are visited by decreasing H_kk (the inputs with most energy first) and
    each group's parameters are fitted up front on the original weights ("static groups"), since a
    group's columns are no longer visited together.
    Returns the new values [N, K] float32 (exactly what the quantizer's ``round`` produced, 0 where
    pruned), the keep mask (None if nothing was pruned) and the parameters fitted per group, in order.
    """
    n, k = w.shape
    if hessian.shape != (k, k):
        raise PassError(f"Hessian {hessian.shape} does not match a weight with K={k}")
    group = quantizer.group_cols if quantizer else _BLOCK
    if group % _SUB:
        raise PassError(f"column groups must be a multiple of {_SUB}, got {group}")
    if act_order and (quantizer is None or keep is not None or prune_2_4):
        raise PassError("act_order applies to plain (dense) quantization only")
    block = group * -(-_BLOCK // group)
    order = np.argsort(-np.diag(hessian), kind="stable") if act_order else np.arange(k)
    static = [quantizer.fit(np.asarray(w[:, g0:g0 + group], np.float32)) for g0 in range(0, k, group)] \
        if act_order else None
    w, hessian = w[:, order], hessian[np.ix_(order, order)]
    h = np.array(hessian, dtype=np.float64, copy=True)
    dead = np.diag(h) <= 0
    h[dead, dead] = 1.0  # inputs that are always zero: any value is as good; keep it
    u = _inverse_cholesky(h, damp).astype(np.float32)
    # Work on W^T so that a column of W is a contiguous row: [K, N].
    wt = np.array(w.T, dtype=np.float32, order="C")
    out = np.zeros_like(wt)
    mask = None
    if keep is not None or prune_2_4:
        mask = np.ones((k, n), bool) if keep is None else np.array(keep.T, order="C")
    params: list[tuple[np.ndarray, ...]] = []
    current: tuple[np.ndarray, ...] = ()
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        err = np.zeros((b1 - b0, n), np.float32)  # error of each column of the block, scaled by 1/U[c, c]
        for s0 in range(b0, b1, _SUB):
            s1 = min(s0 + _SUB, b1)
            for c in range(s0, s1):
                if prune_2_4 and c % 4 == 0:
                    d = np.diag(u)[c:c + 4, None]
                    drop = np.argsort(wt[c:c + 4] ** 2 / d**2, axis=0, kind="stable")[:2]  # [2, N]
                    mask[c:c + 4] = True
                    np.put_along_axis(mask[c:c + 4], drop, False, axis=0)
                if static is not None:
                    current = static[order[c] // group]
                elif quantizer is not None and c % group == 0:
                    span = wt[c:min(c + group, k)]  # up to date: earlier sub-blocks were applied
                    current = quantizer.fit((span if mask is None else np.where(mask[c:c + group], span, 0)).T)
                    params.append(current)
                col = wt[c]
                q = quantizer.round(col, current, order[c] % group) if quantizer is not None else col.copy()
                if mask is not None:
                    q = np.where(mask[c], q, np.float32(0))
                out[c] = q
                e = (col - q) / u[c, c]
                wt[c + 1:s1] -= u[c, c + 1:s1, None] * e[None, :]
                err[c - b0] = e
            wt[s1:b1] -= u[s0:s1, s1:b1].T @ err[s0 - b0:s1 - b0]
        wt[b1:] -= u[b0:b1, b1:].T @ err
    if static is not None:
        params = static
        out[order] = out.copy()  # rows back in the original column order
    return np.ascontiguousarray(out.T), None if mask is None else np.ascontiguousarray(mask.T), params
