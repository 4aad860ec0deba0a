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


@pytest.mark.parametrize(("rows", "vocab", "dtype"), [(1, 333, torch.bfloat16), (3, 9000, torch.bfloat16), (2, 4096, torch.float32)])
def test_argmax_of_written_logits_is_the_fused_heads(rows: int, vocab: int, dtype: torch.dtype) -> None:
    """``argmax_logits`` (the tail of a native-GEMV LM head) gives the fused head's (ids, logits) for
    the logits its reference rounds: torch's argmax (first id on ties) and the logit there in fp32.
    9000 tokens are three programs a row, the last one partial."""
    g = torch.Generator().manual_seed(vocab)
    w = make_weight("int4", vocab, 64, dtype=torch.float32, device=DEVICE, generator=g, group_size=32)
    x = torch.randn(rows, 64, generator=g).to(DEVICE, dtype)
    logits = (x.float() @ lm_head.dequantize_ref(w).T).to(dtype)
    ids, vals = lm_head.argmax_logits(logits)
    want_ids, want_vals = lm_head.lm_head_argmax_ref(x, w)
    assert ids.dtype == torch.int32 and vals.dtype == torch.float32
    assert ids.tolist() == want_ids.tolist() == logits.float().argmax(dim=1).tolist()
    assert torch.equal(vals, want_vals)


def test_argmax_of_written_logits_breaks_ties_to_the_smallest_id_across_programs() -> None:
    logits = torch.full((2, 3 * lm_head.ARGMAX_BLOCK_V), -1.0, dtype=torch.bfloat16, device=DEVICE)
    best = [5000, 4097, 12000]  # the same largest value in the second and third programs' blocks
    logits[0, best] = 3.0
    logits[1, -1] = 0.5  # the very last token
    ids, vals = lm_head.argmax_logits(logits)
    assert ids.tolist() == [4097, 3 * lm_head.ARGMAX_BLOCK_V - 1]
    assert vals.tolist() == [3.0, 0.5]
    with pytest.raises(ValueError, match="contiguous rows"):
        lm_head.argmax_logits(logits.T)
    with pytest.raises(ValueError, match="empty vocabulary"):
        lm_head.argmax_logits(logits[:, :0])
