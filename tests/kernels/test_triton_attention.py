"""Paged attention: the cache write, prefill (causal, sliding window, GQA, mixed lengths) and decode
(split over the context or not), against a torch reference that gathers the cache, and against the
numpy oracles ``reference.paged_attention`` / ``reference.write_kv`` (and ``reference.attention``
on each sequence's K/V read back from the cache, for decode)."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from mgx.kernels import reference as ref  # noqa: E402
from mgx.kernels.triton import attention  # noqa: E402
from mgx.kernels.triton.testing import paged_batch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def oracle(b, *, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, window: int) -> np.ndarray:
    """reference.attention per sequence, on K/V read back from the cache in position order."""
    page = b.k_cache.shape[1]
    out = []
    qsl = b.query_start_loc.tolist()
    for i in range(len(qsl) - 1):
        n = int(b.context_lens[i])
        j = torch.arange(n, device=b.k_cache.device)
        slots = b.block_table[i, j // page].long() * page + j % page
        k = b.k_cache.reshape(-1, num_kv_heads * head_dim)[slots].float().cpu().numpy()
        v = b.v_cache.reshape(-1, num_kv_heads * head_dim)[slots].float().cpu().numpy()
        q = b.q[qsl[i] : qsl[i + 1]].float().cpu().numpy()
        pos = b.positions[qsl[i] : qsl[i + 1]].cpu().numpy()
        out.append(ref.attention(q, k, v, pos, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                 scale=scale, sliding_window=window))  # fmt: skip
    return np.concatenate(out)


CASES = {
    # name: (context_lens, query_lens, Hq, Hk, D, block_size, window)
    "prefill-gqa": ([9, 5, 20], [9, 2, 7], 4, 2, 16, 4, 0),
    "prefill-window": ([12, 20], [5, 20], 4, 1, 16, 8, 6),
    "prefill-mha-odd-dim": ([7, 3], [3, 3], 2, 2, 24, 4, 0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_paged_attention_prefill(case: str) -> None:
    ctx, ql, hq, hk, d, page, window = CASES[case]
    g = torch.Generator().manual_seed(len(case))
    b = paged_batch(ctx, ql, num_heads=hq, num_kv_heads=hk, head_dim=d, block_size=page, device=DEVICE, generator=g)
    scale = d**-0.5
    kc0, vc0 = b.k_cache.float().cpu().numpy(), b.v_cache.float().cpu().numpy()  # before the write
    out = torch.full_like(b.q, float("nan"))
    got = attention.paged_attention(b.q, b.k, b.v, b.k_cache, b.v_cache, b.block_table, b.context_lens,
                                    b.query_start_loc, b.positions, scale=scale, sliding_window=window, out=out)  # fmt: skip
    # paged_attention wrote this step's k, v into the cache first; the references read it from there.
    want = attention.paged_attention_ref(b.q, b.k_cache, b.v_cache, b.block_table, b.context_lens,
                                         b.query_start_loc, b.positions, scale=scale, sliding_window=window)  # fmt: skip
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    np_ = lambda t: t.cpu().numpy()  # noqa: E731
    paged_oracle = ref.paged_attention(np_(b.q), np_(b.k), np_(b.v), kc0, vc0, np_(b.positions), np_(b.block_table),
                                       np_(b.context_lens), np_(b.query_start_loc), num_heads=hq, num_kv_heads=hk,
                                       head_dim=d, scale=scale, sliding_window=window)  # fmt: skip
    np.testing.assert_allclose(got.cpu().numpy(), paged_oracle, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(b.k_cache.cpu().numpy(), kc0)  # both wrote the same slots
    np.testing.assert_array_equal(b.v_cache.cpu().numpy(), vc0)


@pytest.mark.parametrize("num_splits", [1, 3, 8, None])
@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("merge", ["kernel", "last split"])
def test_paged_attention_decode(num_splits: int | None, window: int, merge: str) -> None:
    """Split partials merged by the second kernel, or by the split that arrives last (counters),
    which leaves the counters zeroed for the next launch. Pieces of one tile (3 and 8 splits of
    16-token tiles here; 8 leaves most pieces empty) take the kernel's straight path, longer pieces
    (1 split) and windows its loop."""
    g = torch.Generator().manual_seed(5 + window)
    hq, hk, d = 8, 2, 16
    b = paged_batch([1, 13, 40], [1, 1, 1], num_heads=hq, num_kv_heads=hk, head_dim=d, block_size=8,
                    device=DEVICE, generator=g)  # fmt: skip
    counters = attention.new_decode_counters(DEVICE, 3, hk) if merge == "last split" else None
    want = attention.paged_attention_ref(b.q, b.k_cache, b.v_cache, b.block_table, b.context_lens,
                                         b.query_start_loc, b.positions, scale=0.3, sliding_window=window)  # fmt: skip
    for _ in range(2 if counters is not None else 1):  # the second launch finds the counters zeroed again
        out = torch.full_like(b.q, float("nan"))
        got = attention.paged_attention_decode(b.q, b.k_cache, b.v_cache, b.block_table, b.context_lens, scale=0.3,
                                               sliding_window=window, num_splits=num_splits, out=out, block_n=16,
                                               counters=counters)  # fmt: skip
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        if counters is not None:
            assert not counters.any()
    np.testing.assert_allclose(got.cpu().numpy(), oracle(b, num_heads=hq, num_kv_heads=hk, head_dim=d, scale=0.3,
                                                         window=window), atol=1e-5, rtol=1e-5)  # fmt: skip


@pytest.mark.parametrize("num_splits", [20, 40])
@pytest.mark.parametrize("merge", ["kernel", "last split"])
def test_decode_merges_more_splits_than_it_loads_at_once(num_splits: int, merge: str) -> None:
    """A 300-token context in 16-token pieces: 19 of them hold keys, more than the merge loads at
    once (``MERGE_SPLITS``), so it runs in rounds; with 40 splits the last 21 are empty."""
    assert attention.MERGE_SPLITS < 19
    g = torch.Generator().manual_seed(num_splits)
    hq, hk, d = 4, 2, 16
    b = paged_batch([300, 5], [1, 1], num_heads=hq, num_kv_heads=hk, head_dim=d, block_size=8, device=DEVICE,
                    generator=g)  # fmt: skip
    counters = attention.new_decode_counters(DEVICE, 2, hk) if merge == "last split" else None
    want = attention.paged_attention_ref(b.q, b.k_cache, b.v_cache, b.block_table, b.context_lens,
                                         b.query_start_loc, b.positions, scale=0.3)  # fmt: skip
    got = attention.paged_attention_decode(b.q, b.k_cache, b.v_cache, b.block_table, b.context_lens, scale=0.3,
                                           num_splits=num_splits, block_n=16, counters=counters)  # fmt: skip
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if counters is not None:
        assert not counters.any()
    else:  # every merge kernel configuration the autotune pass may store
        for config in attention.MERGE_CONFIGS[1:]:
            got = attention.paged_attention_decode(b.q, b.k_cache, b.v_cache, b.block_table, b.context_lens, scale=0.3,
                                                   num_splits=num_splits, block_n=16, merge=config)  # fmt: skip
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=str(config))


def test_decode_launches_its_merge_kernel_with_the_configuration_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    """``paged_attention_decode``'s ``merge`` reaches the merge kernel (a local flag of the same name
    once hid it, so a tuned configuration was dropped for the default)."""
    b = paged_batch([70], [1], num_heads=4, num_kv_heads=2, head_dim=16, block_size=16, device=DEVICE)
    seen = []
    real = attention.merge_splits
    monkeypatch.setattr(attention, "merge_splits", lambda *a, config=None: seen.append(config) or real(*a, config=config))
    for config in attention.MERGE_CONFIGS:
        attention.paged_attention_decode(b.q, b.k_cache, b.v_cache, b.block_table, b.context_lens, scale=0.3,
                                         num_splits=3, block_n=16, merge=config)  # fmt: skip
    assert seen == attention.MERGE_CONFIGS


def test_merge_splits_checks_its_partials_and_weighs_each_split_by_its_softmax() -> None:
    """``merge_splits`` alone: each row's splits combined as sum(2^(m - top) * o) / sum(2^(m - top) * l),
    an empty split (m = -inf) weighing nothing; partials of another shape are refused."""
    g = torch.Generator().manual_seed(3)
    n, hq, p, d = 2, 3, 20, 16
    part_o, part_m = torch.randn(n, hq, p, d, generator=g), torch.randn(n, hq, p, generator=g) * 3
    part_l = torch.rand(n, hq, p, generator=g) + 0.5
    part_m[0, 1, 5:] = float("-inf")
    w = torch.exp2(part_m - part_m.amax(dim=2, keepdim=True))
    want = ((w[..., None] * part_o).sum(2) / (w * part_l).sum(2)[..., None]).reshape(n, hq * d)
    for config in attention.MERGE_CONFIGS:
        out = torch.empty(n, hq * d, device=DEVICE)
        got = attention.merge_splits(part_o.to(DEVICE), part_m.to(DEVICE), part_l.to(DEVICE), out, config=config)
        torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5, msg=str(config))
    with pytest.raises(ValueError, match="decode merge: partials"):
        attention.merge_splits(part_o.to(DEVICE), part_m[:, :, :4].to(DEVICE), part_l.to(DEVICE), out)


def test_decode_merges_any_split_count_with_two_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each tile the merge loads splits in is a variant of the decode kernel that Triton compiles the
    first time it meets it (mid-load, as contexts grow): split counts from 2 to 20 launch two tiles in
    all (``merge_tile``), and each count's output is the reference's."""
    launched: set[int] = set()
    kernel = attention._decode_kernel

    class Recording:
        def __getitem__(self, grid):  # noqa: ANN001, ANN204
            def launch(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
                launched.add(kwargs["BLOCK_P"])
                return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(attention, "_decode_kernel", Recording())
    g = torch.Generator().manual_seed(3)
    hq, hk, d = 4, 2, 16
    b = paged_batch([300, 40], [1, 1], num_heads=hq, num_kv_heads=hk, head_dim=d, block_size=8, device=DEVICE,
                    generator=g)  # fmt: skip
    want = attention.paged_attention_ref(b.q, b.k_cache, b.v_cache, b.block_table, b.context_lens,
                                         b.query_start_loc, b.positions, scale=0.3)  # fmt: skip
    counters = attention.new_decode_counters(DEVICE, 2, hk)
    for num_splits in (2, 5, 9, 20):
        got = attention.paged_attention_decode(b.q, b.k_cache, b.v_cache, b.block_table, b.context_lens, scale=0.3,
                                               num_splits=num_splits, block_n=16, counters=counters)  # fmt: skip
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert launched == {attention.SMALL_MERGE_SPLITS, attention.MERGE_SPLITS}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rotary_dim", "window", "num_splits"), [(None, 0, 3), (8, 0, 1), (None, 6, 2), (8, 0, 8)])
def test_decode_with_rope_equals_rope_and_write_kv_then_decode(dtype, rotary_dim, window: int, num_splits: int) -> None:
    """``rope=`` in decode: the kernel turns q and k at position ctx - 1 (transformers' roundings)
    and writes this step's k and v into the cache itself; the same cache, to the bit, and the same
    output as ``rope_and_write_kv`` followed by plain decode, with the caller's q, k, v untouched.
    One-tile pieces (3 and 8 splits; the slot's page from the tile's, read before the context length)
    and longer pieces (1 split: the slot in the third tile; a window: in the first tile, which is read
    before the kernel's wait and takes this step's k, v in registers) both."""
    from mgx.kernels.triton.rope import rope_and_write_kv

    g = torch.Generator().manual_seed(11)
    hq, hk, d = 8, 2, 16
    b = paged_batch([1, 13, 40], [1, 1, 1], num_heads=hq, num_kv_heads=hk, head_dim=d, block_size=8,
                    dtype=dtype, device=DEVICE, generator=g)  # fmt: skip
    rot = rotary_dim or d
    inv = (1.0 / 10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot)).to(DEVICE)
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    q, k, v = b.q.clone(), b.k.clone(), b.v.clone()
    rope = attention.DecodeRope(k, v, inv, rotary_dim, attention_scaling=0.9)
    got = attention.paged_attention_decode(q, kc, vc, b.block_table, b.context_lens, scale=0.3, sliding_window=window,
                                           num_splits=num_splits, block_n=16, rope=rope, counters=attention.new_decode_counters(DEVICE, 3, hk))  # fmt: skip
    assert torch.equal(q, b.q) and torch.equal(k, b.k) and torch.equal(v, b.v)
    q2, k2 = b.q.clone(), b.k.clone()
    rope_and_write_kv(q2, k2, b.v, b.positions, inv, b.k_cache, b.v_cache, b.block_table, b.query_start_loc,
                      head_dim=d, rotary_dim=rotary_dim, attention_scaling=0.9)  # fmt: skip
    want = attention.paged_attention_decode(q2, b.k_cache, b.v_cache, b.block_table, b.context_lens, scale=0.3,
                                            sliding_window=window, num_splits=num_splits, block_n=16)  # fmt: skip
    assert torch.equal(kc, b.k_cache) and torch.equal(vc, b.v_cache)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_decode_bf16_and_prefill_agree_on_one_token_queries() -> None:
    g = torch.Generator().manual_seed(9)
    b = paged_batch([17, 33], [1, 1], num_heads=4, num_kv_heads=4, head_dim=32, block_size=16,
                    dtype=torch.bfloat16, device=DEVICE, generator=g)  # fmt: skip
    dec = attention.paged_attention_decode(b.q, b.k_cache, b.v_cache, b.block_table, b.context_lens, scale=0.2,
                                           num_splits=2, block_n=16)  # fmt: skip
    pre = attention.paged_attention_prefill(b.q, b.k_cache, b.v_cache, b.block_table, b.context_lens,
                                            b.query_start_loc, b.positions, scale=0.2, block_m=16, block_n=16)  # fmt: skip
    want = attention.paged_attention_ref(b.q, b.k_cache, b.v_cache, b.block_table, b.context_lens,
                                         b.query_start_loc, b.positions, scale=0.2).float()  # fmt: skip
    for got in (dec, pre):
        err = (got.float() - want).norm() / want.norm()
        assert err < 1e-2, err


def test_write_kv_puts_each_token_in_its_slot() -> None:
    g = torch.Generator().manual_seed(2)
    b = paged_batch([5, 2], [3, 2], num_heads=2, num_kv_heads=2, head_dim=16, block_size=2, device=DEVICE, generator=g)
    kc, vc = b.k_cache.clone(), b.v_cache.clone()
    attention.write_kv(b.k, b.v, b.positions, kc, vc, b.block_table, b.query_start_loc)
    for t, (seq, pos) in enumerate([(0, 2), (0, 3), (0, 4), (1, 0), (1, 1)]):
        blk = int(b.block_table[seq, pos // 2])
        torch.testing.assert_close(kc[blk, pos % 2].reshape(-1), b.k[t])
        torch.testing.assert_close(vc[blk, pos % 2].reshape(-1), b.v[t])
    assert int((kc != b.k_cache).any(-1).any(-1).sum()) == 5  # nothing else moved
    kc0, vc0 = b.k_cache.cpu().numpy().copy(), b.v_cache.cpu().numpy().copy()
    ref.write_kv(b.k.cpu().numpy(), b.v.cpu().numpy(), kc0, vc0, b.positions.cpu().numpy(),
                 b.block_table.cpu().numpy(), b.query_start_loc.cpu().numpy())  # fmt: skip
    np.testing.assert_array_equal(kc.cpu().numpy(), kc0)
    np.testing.assert_array_equal(vc.cpu().numpy(), vc0)


def test_decode_splits_fill_the_gpu() -> None:
    assert attention.decode_splits(1, 8, 32768, 132) == 33
    assert attention.decode_splits(1, 8, 8192, 132) == 33
    assert attention.decode_splits(64, 8, 32768, 132) == 1
    assert attention.decode_splits(1, 8, 100, 132) == 1
    assert attention.decode_splits(1, 8, 1024, 132) == 8  # pieces of two 64-token tiles
    assert attention.decode_splits(1, 8, 1024, 132, min_tiles=1) == 16
    assert attention.decode_splits(1, 8, 1024, 132, block_n=32) == 16


@pytest.mark.parametrize("block_n", [8, 48])
def test_decode_refuses_a_tile_tl_dot_cannot_take(block_n: int) -> None:
    """A tile under 16 rows compiles in the interpreter but not for a GPU (tl.dot's smallest K):
    refused up front on every device, with the reason."""
    b = paged_batch([5], [1], num_heads=2, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32,
                    device=DEVICE, generator=torch.Generator().manual_seed(1))  # fmt: skip
    with pytest.raises(ValueError, match=f"block_n must be a power of two of at least 16.*got {block_n}"):
        attention.paged_attention_decode(b.q, b.k_cache, b.v_cache, b.block_table, b.context_lens, scale=0.3,
                                         num_splits=1, block_n=block_n)  # fmt: skip
