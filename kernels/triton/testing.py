"""Random inputs for the GPU kernels' tests and benchmarks: quantized weights and paged K/V caches.

The quantizers here only make valid inputs in each scheme's format (formats/README.md); the
compiler's passes own the real ones.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .linear import GpuWeight

__all__ = ["PagedBatch", "as_read_by", "make_weight", "paged_batch", "tile16"]


def make_weight(
    scheme: str,
    n: int,
    k: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    group_size: int = 128,
    symmetric: bool = False,
    layout: str = "row_major",
    generator: torch.Generator | None = None,
) -> GpuWeight:
    """A random W [n, k] (about unit variance / sqrt(k)) stored in ``scheme`` (and ``layout``: row_major,
    sparse24_nibble_meta for 2:4 weights, cuda_tile16 for int4 and W8A16)."""
    where = generator.device if generator is not None else torch.device(device)
    w = torch.randn(n, k, generator=generator, device=where) / k**0.5
    if scheme == "none":
        return GpuWeight("none", n, k, w.to(dtype).to(device))
    tiled = tile16 if layout == "cuda_tile16" else lambda gw: gw
    if scheme == "w8a16":
        s = w.abs().amax(1).clamp_min(1e-8) / 127
        q = torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8)
        return tiled(GpuWeight("w8a16", n, k, q.to(device), scales=s.float().to(device)))
    if scheme == "int4":
        packed, s, z = _int4(w, group_size, symmetric)
        return tiled(GpuWeight("int4", n, k, packed.to(device), scales=s.to(device), zeros=_dev(z, device),
                               group_size=group_size, symmetric=symmetric))  # fmt: skip
    if scheme in ("sparse24", "sparse24_int4"):
        groups = w.reshape(n, k // 4, 4)
        keep = groups.abs().topk(2, dim=-1).indices.sort(dim=-1).values  # [n, k/4, 2], ascending
        vals = groups.gather(-1, keep).reshape(n, k // 2)
        meta = (keep[..., 0] | (keep[..., 1] << 2)).to(torch.uint8)  # [n, k/4]
        if layout == "sparse24_nibble_meta":
            meta = meta[:, 0::2] | (meta[:, 1::2] << 4)
        meta = meta.contiguous().to(device)
        if scheme == "sparse24":
            return GpuWeight("sparse24", n, k, vals.to(dtype).contiguous().to(device), meta=meta, layout=layout)
        packed, s, z = _int4(vals, group_size, symmetric)
        return GpuWeight("sparse24_int4", n, k, packed.to(device), scales=s.to(device), zeros=_dev(z, device),
                         meta=meta, group_size=group_size, symmetric=symmetric, layout=layout)  # fmt: skip
    raise ValueError(f"unknown scheme {scheme!r}")


def tile16(w: GpuWeight) -> GpuWeight:
    """An int4 or W8A16 weight in the ``cuda_tile16`` layout (``mgx.formats.layouts``), on its device: the
    same values, the codes' bytes tiled as that layout packs them."""
    from dataclasses import replace

    from mgx.formats.layouts import tile16_axes

    out = replace(w, layout="cuda_tile16")  # refuses a scheme or shape the layout cannot hold
    shape, order = tile16_axes(w.scheme, *w.weight.shape)
    return replace(out, weight=w.weight.reshape(shape).permute(order).contiguous().reshape(w.weight.shape))


def as_read_by(w: GpuWeight, kernels, silu_mul: bool = False) -> GpuWeight:  # noqa: ANN001
    """``w`` as the native imma kinds of ``kernels`` (a ``CudaKernels``, or None) read it for its scheme:
    ``tile16(w)`` for a MGX_IMMA_TILE16 build where the layout holds the shape (``tile16_holds``), else
    ``w`` itself (a default build reads row-major codes); for a MGX_IMMA_HALF_SCALES build int4 scales
    rounded to fp16 values (as quantize_int4 writes them) and their ``scale_pairs`` (ordered for the
    SiLU product with ``silu_mul``), so a bench or profile of a build measures the kinds it has instead
    of finding that none of them takes the weight."""
    from mgx.formats.layouts import tile16_holds
    from mgx.kernels.cuda.gemv import MMA_COLUMNS, reads_half_scales, reads_tile16, scale_pairs

    if kernels is None or w.layout != "row_major" or not tile16_holds(w.n, w.k) or not reads_tile16(kernels, w.scheme):
        return w
    w = tile16(w)
    if w.scheme == "int4" and reads_half_scales(kernels) and w.group_size % MMA_COLUMNS == 0:
        w = scale_pairs(replace(w, scales=w.scales.half().float()), silu_mul)
    return w


def _int4(w: torch.Tensor, g: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Group-quantize w [n, c] (c % g == 0) -> (bytes [n, c/2], scales [n, c/g] f32, zeros u8 or None)."""
    n, c = w.shape
    wg = w.reshape(n, c // g, g)
    if symmetric:
        s = wg.abs().amax(-1).clamp_min(1e-8) / 7
        z = torch.full_like(s, 8.0)
    else:
        lo, hi = wg.amin(-1).clamp_max(0), wg.amax(-1).clamp_min(0)
        s = ((hi - lo) / 15).clamp_min(1e-8)
        z = torch.round(-lo / s).clamp(0, 15)
    q = torch.round(wg / s[..., None] + z[..., None]).clamp(0, 15).to(torch.uint8).reshape(n, c)
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
    return packed, s.float().contiguous(), None if symmetric else z.to(torch.uint8).contiguous()


def _dev(t: torch.Tensor | None, device: str | torch.device) -> torch.Tensor | None:
    return None if t is None else t.to(device)


@dataclass
class PagedBatch:
    """A batch of sequences whose earlier tokens sit in a paged cache, and this step's query rows."""

    k_cache: torch.Tensor  # [num_blocks, block_size, Hk, D]
    v_cache: torch.Tensor
    block_table: torch.Tensor  # [S, max_blocks] int32
    context_lens: torch.Tensor  # [S] int32, after this step's tokens are written
    query_start_loc: torch.Tensor  # [S + 1] int32
    positions: torch.Tensor  # [T] int32
    q: torch.Tensor  # [T, Hq*D]
    k: torch.Tensor  # [T, Hk*D]
    v: torch.Tensor  # [T, Hk*D]


def paged_batch(
    context_lens: list[int],
    query_lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    generator: torch.Generator | None = None,
    spare_blocks: int = 3,
) -> PagedBatch:
    """Random cache contents for the cached tokens, blocks handed out in shuffled order.

    Drawn on ``generator``'s device when one is given (reproducible), else on ``device`` (fast).
    """
    where = generator.device if generator is not None else torch.device(device)
    per_seq = [-(-c // block_size) for c in context_lens]
    max_blocks = max(per_seq + [1])
    num_blocks = sum(per_seq) + spare_blocks
    order = torch.randperm(num_blocks, generator=generator, device=where).to(torch.int32)
    table = torch.zeros(len(context_lens), max_blocks, dtype=torch.int32, device=where)
    used = 0
    for i, nb in enumerate(per_seq):
        table[i, :nb] = order[used : used + nb]
        used += nb
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=generator, device=where).to(dtype)
    v_cache = torch.randn(shape, generator=generator, device=where).to(dtype)
    qsl = [0]
    pos: list[int] = []
    for c, q in zip(context_lens, query_lens):
        qsl.append(qsl[-1] + q)
        pos.extend(range(c - q, c))
    t = qsl[-1]

    def rand(*s: int) -> torch.Tensor:
        return torch.randn(s, generator=generator, device=where).to(dtype).to(device)

    return PagedBatch(
        k_cache.to(device), v_cache.to(device), table.to(device),
        torch.tensor(context_lens, dtype=torch.int32, device=device),
        torch.tensor(qsl, dtype=torch.int32, device=device), torch.tensor(pos, dtype=torch.int32, device=device),
        rand(t, num_heads * head_dim), rand(t, num_kv_heads * head_dim), rand(t, num_kv_heads * head_dim),
    )  # fmt: skip
