"""The LM head fused with argmax: greedy ids and their logits, without [R, V] logits."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from mgx.kernels.triton import lm_head  # noqa: E402
from mgx.kernels.triton.linear import GpuWeight, LinearConfig  # noqa: E402
from mgx.kernels.triton.testing import make_weight  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(("scheme", "rows"), [("none", 1), ("none", 5), ("w8a16", 2), ("int4", 3), ("none", 20)])
def test_lm_head_argmax(scheme: str, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    w = make_weight(scheme, 333, 64, dtype=torch.float32, device=DEVICE, generator=g, group_size=32)
    x = torch.randn(rows, 64, generator=g).to(DEVICE)
    ids, vals = lm_head.lm_head_argmax(x, w)
    want_ids, want_vals = lm_head.lm_head_argmax_ref(x, w)
    assert ids.tolist() == want_ids.tolist()
    torch.testing.assert_close(vals, want_vals, atol=1e-5, rtol=1e-5)


def test_ties_go_to_the_smallest_id_across_tiles() -> None:
    v, h = 100, 16
    weight = torch.zeros(v, h, device=DEVICE)
    weight[[7, 40, 93], 0] = 1.0  # three equal best logits in three different tiles
    weight[3, 1] = 1.0
    x = torch.zeros(2, h, device=DEVICE)
    x[0, 0] = 2.0
    x[1, 1] = 1.0
    ids, vals = lm_head.lm_head_argmax(x, GpuWeight("none", v, h, weight), config=LinearConfig(1, 16, 16, 4, 2))
    assert ids.tolist() == [7, 3]
    assert vals.tolist() == [2.0, 1.0]


def test_merging_tile_bests_takes_the_largest_and_the_smallest_id_on_ties() -> None:
    """``merge_tile_argmax`` (the second kernel of the Triton head and of the native one): per row, the
    largest of the tiles' best logits and, among equal ones, the smallest id; 1,500 tiles span two of
    its 1,024-wide passes."""
    g = torch.Generator().manual_seed(5)
    part_v = torch.randn(3, 1500, generator=g)
    part_i = (torch.arange(1500, dtype=torch.int32) * 16 + torch.randint(0, 16, (3, 1500), generator=g)).to(torch.int32)
    part_v[1, [40, 1200]] = 9.0  # a tie across passes: tile 40's id wins
    part_v[2, 1400] = float("-inf")
    ids, vals = lm_head.merge_tile_argmax(part_v.to(DEVICE), part_i.to(DEVICE))
    top = part_v.argmax(dim=1)
    assert ids.tolist() == part_i[torch.arange(3), top].tolist()
    assert int(top[1]) == 40
    assert vals.tolist() == part_v[torch.arange(3), top].tolist()


@pytest.mark.parametrize("tiles", [19, 1500, 8016])
def test_every_merge_candidate_takes_the_largest_and_the_smallest_id_on_ties(tiles: int) -> None:
    """Each of ``merge_candidates`` (tiles a pass and warps the autotune pass times) gives the
    reference's ids and logits on rows with ties across tiles and passes, a -inf and a NaN-free
    row of equal values; 8,016 is the 8B vocabulary's groups on the native imma kinds."""
    g = torch.Generator().manual_seed(tiles)
    part_v = torch.randint(-20, 20, (3, tiles), generator=g).float()
    part_v[2] = 1.5  # every tile ties: the smallest id
    part_v[1, 0] = float("-inf")
    part_i = (torch.arange(tiles, dtype=torch.int32) * 16 + torch.randint(0, 16, (3, tiles), generator=g)).to(torch.int32)
    top = torch.stack([torch.nonzero(r == r.max())[0, 0] for r in part_v])  # the first of equals: the smallest id
    configs = lm_head.merge_candidates(tiles)
    assert configs[0] == lm_head.ArgmaxMergeConfig() and len(set(configs)) == len(configs)
    assert all(c.block_t <= max(1024, lm_head.next_pow2(tiles)) for c in configs)
    for config in configs:
        ids, vals = lm_head.merge_tile_argmax(part_v.to(DEVICE), part_i.to(DEVICE), config=config)
        assert ids.tolist() == part_i[torch.arange(3), top].tolist(), config
        assert vals.tolist() == part_v[torch.arange(3), top].tolist(), config


def test_nan_logits_never_win_and_the_token_is_always_in_the_vocabulary() -> None:
    """A NaN logit counts as -inf: passed over where any number is left (row 0: a NaN row in the
    weight), and a row whose logits are all NaN (row 1: NaN in x) or all -inf (a bias of -inf) gets the
    smallest id, 0, with the logit -inf, never an id outside the vocabulary (which the next step's
    embedding lookup would read out of bounds on the device)."""
    v, h = 100, 16
    g = torch.Generator().manual_seed(9)
    weight = torch.randn(v, h, generator=g)
    weight[37] = float("nan")
    x = torch.randn(2, h, generator=g)
    x[1, 3] = float("nan")
    w = GpuWeight("none", v, h, weight.to(DEVICE))
    ids, vals = lm_head.lm_head_argmax(x.to(DEVICE), w, config=LinearConfig(1, 16, 16, 4, 2))
    logits = x[0] @ weight.T
    want = int(torch.where(logits.isnan(), float("-inf"), logits).argmax())
    assert want != 37 and ids.tolist() == [want, 0]
    assert vals[0].item() == pytest.approx(logits[want].item(), rel=1e-5) and vals[1].item() == float("-inf")
    bias = torch.full((v,), float("-inf"), device=DEVICE)
    ids, vals = lm_head.lm_head_argmax(x[:1].to(DEVICE), w, bias, config=LinearConfig(1, 16, 16, 4, 2))
    assert ids.tolist() == [0] and vals.tolist() == [float("-inf")]
