"""The native GEMV's launcher on the CPU: which products it takes and its block size (the kernel itself
runs in tests/gpu/test_gpu_kernels.py against the reference)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from mgx.kernels.cuda import gemv as cg  # noqa: E402
from mgx.kernels.triton.testing import make_weight  # noqa: E402


class FakeKernels:
    """Loaded kernels on 'device 0' holding the entries given."""

    device = 0

    def __init__(self, *entries: str) -> None:
        self.entries = set(entries)

    def has(self, entry: str) -> bool:
        return entry in self.entries


def test_threads_keep_about_four_words_per_row_in_flight() -> None:
    assert [cg.gemv_threads(k) for k in (8, 1024, 2048, 4096, 8192, 14336, 65536)] == [32, 32, 64, 128, 256, 256, 256]


def test_declines_what_the_kernel_cannot_take() -> None:
    w = make_weight("int4", 64, 256, group_size=32)
    x = torch.randn(1, 256).to(torch.bfloat16)
    every = FakeKernels(*cg.ENTRIES.values())
    assert not cg.gemv_applies(None, x, w)
    assert not cg.gemv_applies(FakeKernels(cg.ENTRIES["gemv", "w8a16"]), x, w)  # an artifact without the int4 entry
    assert not cg.gemv_applies(every, x, w)  # a CPU tensor
    assert not cg.gemv_applies(every, x, make_weight("sparse24", 64, 256))  # no native kernel for 2:4
    assert not cg.gemv_applies(every, x, make_weight("w8a16", 64, 256), kind="mma")  # int4 only
    assert not cg.gemv_applies(every, x, make_weight("w8a16", 64, 256), kind="mma_persistent")
    assert not cg.gemv_applies(every, x, make_weight("w8a16", 64, 256), kind="mma_pipelined")
    assert not cg.gemv_applies(every, x, w, kind="tensor")  # no such kind (e.g. from a newer artifact)
    assert set(cg.ENTRIES) == {("gemv", "int4"), ("gemv", "w8a16"), ("gemv", "none"), ("mma", "int4"),
                               ("mma_pipe", "int4")}  # fmt: skip
    assert set(cg.LABELS) == set(cg.ENTRIES)


def test_rmsnorm_prologue_operands_and_entry_names() -> None:
    """What the ``_norm`` entries can read next to the row (the kernel itself: tests/gpu), and that
    each GEMV entry has its ``_norm`` twin of the same ABI version."""
    x, delta = (torch.randn(1, 256).to(torch.bfloat16) for _ in range(2))
    total, g = torch.empty_like(x), torch.ones(256, dtype=torch.bfloat16)
    assert cg.NormPrologue(delta, g, 1e-6, total).applies(x)
    assert cg.NormPrologue(None, None, 1e-6).applies(x)  # a first layer's norm: nothing added, no sum
    assert not cg.NormPrologue(delta, g, 1e-6).applies(x)  # a sum with nowhere to go
    assert not cg.NormPrologue(None, g, 1e-6, total).applies(x)  # and the other way round
    assert not cg.NormPrologue(delta, g, 1e-6, x).applies(x)  # the sum over the row it reads
    assert not cg.NormPrologue(delta, g, 1e-6, delta).applies(x)
    assert not cg.NormPrologue(delta, g.float(), 1e-6, total).applies(x)  # bf16 only
    assert not cg.NormPrologue(delta[:, :128], g, 1e-6, total).applies(x)  # a delta of another width
    assert not cg.NormPrologue(torch.randn(1, 257).to(torch.bfloat16)[:, 1:], g, 1e-6, total).applies(x)  # unaligned
    wide = torch.randn(1, cg.MAX_NORM_K + 8).to(torch.bfloat16)
    assert not cg.NormPrologue(None, None, 1e-6).applies(wide)  # past the prologue's shared memory
    assert set(cg.NORM_ENTRIES) == set(cg.ENTRIES)
    for key, name in cg.ENTRIES.items():
        base, version = name.rsplit("_v", 1)
        assert cg.NORM_ENTRIES[key] == f"{base}_norm_v{version}"


def test_persistent_tensor_core_kind_has_no_entry_of_its_own() -> None:
    """``mma_persistent`` launches the ``mma`` entry (and its ``_norm`` twin) on fewer blocks: a kind
    for the autotune pass to time, not new code in the artifact (the launch itself: tests/gpu);
    ``mma_pipelined`` has an entry (and twin) of its own."""
    assert cg.KINDS == ("gemv", "mma", "mma_persistent", "mma_pipelined")
    assert {kind for kind, _ in cg.ENTRIES} == {"gemv", "mma", "mma_pipe"} and set(cg.NORM_ENTRIES) == set(cg.ENTRIES)
