"""The native GEMV's launcher on the CPU: which products it takes and its block size (the kernel itself
runs in tests/gpu/test_gpu_kernels.py against the reference)."""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from mgx.kernels.cuda import build  # noqa: E402
from mgx.kernels.cuda import gemv as cg  # noqa: E402
from mgx.kernels.triton.testing import as_read_by, make_weight  # noqa: E402


class FakeKernels:
    """Loaded kernels on 'device 0' holding the entries given."""

    device = 0

    def __init__(self, *entries: str) -> None:
        self.entries = set(entries)

    def has(self, entry: str) -> bool:
        return entry in self.entries


def test_threads_keep_about_four_words_per_row_in_flight() -> None:
    assert [cg.gemv_threads(k) for k in (8, 1024, 2048, 4096, 8192, 14336, 65536)] == [32, 32, 64, 128, 256, 256, 256]


def test_blocks_have_the_threads_of_their_kind() -> None:
    """The tensor-core kinds launch blocks of their entry's warps (gemv.cu's kMmaWarps, kImmaWarps, and 4
    and 16 for ``imma_w4`` and ``imma_w16``); the CUDA-core kind as many as K asks for."""
    assert [cg.block_threads(kind, 4096) for kind in cg.KINDS] == [128, 256, 256, 256, 256, 256, 128, 512, 128]
    assert cg.block_threads("gemv", 14336) == 256


def test_declines_what_the_kernel_cannot_take() -> None:
    w = make_weight("int4", 64, 256, group_size=32)
    x = torch.randn(1, 256).to(torch.bfloat16)
    every = FakeKernels(*cg.ENTRIES.values())
    assert not cg.gemv_applies(None, x, w)
    assert not cg.gemv_applies(FakeKernels(cg.ENTRIES["gemv", "w8a16"]), x, w)  # an artifact without the int4 entry
    assert not cg.gemv_applies(every, x, w)  # a CPU tensor
    assert not cg.gemv_applies(every, x, make_weight("sparse24", 64, 256))  # no native kernel for 2:4
    assert not cg.gemv_applies(every, x, w, kind="tensor")  # no such kind (e.g. from a newer artifact)
    assert set(cg.ENTRIES) == {("gemv", "int4"), ("gemv", "w8a16"), ("gemv", "none"), ("mma", "int4"),
                               ("mma_pipe", "int4"), ("mma", "w8a16"), ("mma_pipe", "w8a16"), ("imma", "w8a16"),
                               ("imma", "int4"), ("imma_multi", "w8a16"), ("imma_multi", "int4"), ("imma4", "w8a16"),
                               ("imma4", "int4"), ("imma16", "w8a16"), ("imma16", "int4"), ("imma4_multi", "w8a16"),
                               ("imma4_multi", "int4")}  # fmt: skip
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


def test_greedy_lm_head_entries_are_the_imma_kinds_without_a_prologue() -> None:
    """``gemv_argmax``'s entries: one per imma entry and scheme, same ABI version; no other kind and
    no RMSNorm prologue takes the greedy head (the kernel itself: tests/gpu)."""
    assert set(cg.ARGMAX_ENTRIES) == {key for key in cg.ENTRIES if key[0].startswith("imma")}
    for key, name in cg.ARGMAX_ENTRIES.items():
        assert name == cg.ENTRIES[key].replace("_bf16_v", "_argmax_v") and name.endswith(f"_v{cg.KERNEL_ABI}")
    for kind in cg.KINDS:
        for scheme in ("int4", "w8a16", "none"):
            got = cg.entry_for(kind, scheme, argmax=True)
            assert (got is not None) == (kind.startswith("imma") and scheme != "none")
    x = torch.randn(1, 256).to(torch.bfloat16)
    w = make_weight("int4", 64, 256, group_size=128)
    every = FakeKernels(*cg.ENTRIES.values(), *cg.NORM_ENTRIES.values(), *cg.ARGMAX_ENTRIES.values())
    assert not cg.gemv_applies(every, x, w, kind="imma", argmax=True, norm=cg.NormPrologue(None, None, 1e-6))
    assert not cg.gemv_applies(every, x, w, kind="mma", argmax=True)


def test_staged_twins_are_their_kinds_entries_and_need_the_stage_entry() -> None:
    """``gemv_staged``'s entries: one per staged kind (imma, imma_w4, imma_w16) and scheme, named after
    the kind's own entry, same ABI version; ``staged_applies`` needs both that entry and the scheme's
    stage entry, a staged kind, and what ``gemv_applies`` needs (a CUDA row: so never on the CPU). A
    record holds 520 bytes a 128-column step (the kernels: tests/gpu)."""
    assert set(cg.STAGED_ENTRIES) == {(k, s) for k in ("imma", "imma_w4", "imma_w16") for s in ("int4", "w8a16")}
    for (kind, scheme), name in cg.STAGED_ENTRIES.items():
        assert name == cg.entry_for(kind, scheme).replace("_bf16_v", "_staged_bf16_v")
    assert all(name.endswith(f"_v{cg.KERNEL_ABI}") for name in cg.STAGE_ENTRIES.values())
    assert cg.staged_bytes(4096) == 32 * 520 and cg.staged_bytes(14336) == 112 * 520
    x = torch.randn(1, 256).to(torch.bfloat16)
    w = make_weight("int4", 64, 256, group_size=128)
    every = FakeKernels(*cg.ENTRIES.values(), *cg.STAGED_ENTRIES.values(), *cg.STAGE_ENTRIES.values())
    assert not cg.staged_applies(every, x, w, "imma")  # a CPU row
    assert not cg.staged_applies(None, x, w, "imma") and not cg.staged_applies(every, x, w, "imma_persistent")
    assert not cg.staged_applies(every, x, make_weight("none", 64, 256), "imma")
    norm = cg.NormPrologue(None, None, 1e-6)
    assert not cg.norm_stage_applies(FakeKernels(*cg.NORM_STAGE_ENTRIES.values()), x, norm, "int4")  # a CPU row
    assert not cg.norm_stage_applies(None, x, norm, "int4") and not cg.norm_stage_applies(every, x, norm, "none")
    for blocks in (0, -2):  # refused before anything is allocated or launched
        with pytest.raises(ValueError, match=f"at least one block, not {blocks}"):
            cg.norm_stage(x, norm, "int4", kernels=every, blocks=blocks)


@pytest.mark.parametrize(("n", "k", "silu", "group", "symmetric"),
                         [(40, 512, False, 128, False), (2 * 20, 256, True, 256, True), (33, 384, False, 128, True)])
def test_scale_pairs_hold_each_lanes_scales_as_the_half_scales_build_reads_them(n: int, k: int, silu: bool, group: int,
                                                                                symmetric: bool) -> None:  # fmt: skip
    """``scale_pairs`` (for gemv.cu's MGX_IMMA_HALF_SCALES build): at [b, j, g] the scale and zero of rows
    lo(b, g) and hi(b, g) for column group j (zero 8 when symmetric) as float16, with the rows of
    gemv_imma: 16 a group, or 8 gate rows and the 8 up rows beside them with ``silu_mul``; past N the
    last row. Scales that fp16 would change are refused; the weight is otherwise unchanged."""
    w0 = make_weight("int4", n, k, group_size=group, symmetric=symmetric)
    assert not cg.half_scales_hold(w0)  # random fp32 scales
    with pytest.raises(ValueError, match="fp16 values"):
        cg.scale_pairs(w0, silu)
    w = replace(w0, scales=w0.scales.half().float())
    got = cg.scale_pairs(w, silu)
    assert got.weight is w.weight and got.scales is w.scales and got.pairs_silu == silu
    sz = got.pairs
    n_out, per = (n // 2, 8) if silu else (n, 16)
    groups = -(-n_out // per)
    assert sz.shape == (groups, k // group, 8, 4) and sz.dtype == torch.float16
    for b in range(groups):
        for g in range(8):
            lo = min(b * per + g, n_out - 1)
            hi = n_out + lo if silu else min(b * 16 + g + 8, n - 1)
            for j in range(k // group):
                for half, row in ((0, lo), (1, hi)):
                    zero = 8.0 if symmetric else float(w.zeros[row, j])
                    assert sz[b, j, g, 2 * half].item() == w.scales[row, j].item()
                    assert sz[b, j, g, 2 * half + 1].item() == zero
    with pytest.raises(ValueError, match="pairs shape"):
        replace(got, pairs=sz[:-1])
    assert not cg.half_scales_hold(make_weight("int4", 32, 256, group_size=64))  # groups under 128 columns


@pytest.mark.parametrize(("scheme", "n", "k"), [("int4", 48, 384), ("w8a16", 32, 256), ("w8a16", 2 * 1000, 128)])
@pytest.mark.parametrize("silu", [False, True])
def test_tile16_layout_puts_each_imma_lanes_word_where_the_tile16_build_loads_it(scheme: str, n: int, k: int,
                                                                               silu: bool) -> None:  # fmt: skip
    """The cuda_tile16 layout (``testing.tile16``, as ``layouts.pack`` writes it) against gemv.cu's
    MGX_IMMA_TILE16 addressing, emulated: lane (g, t) of group b loads, for its rows lo and hi (8
    rows from r0 = 16 b and 16 b + 8, or with the SiLU product 8 b and F + 8 b), step s and word v,
    the 16 bytes at (r0 / 16) S kStep + (r0 % 16) 64 + 16 lane + s kStep + v 1024 (kStep = 1024 kW):
    bytes 64 v + 16 t .. of step s of row r0 + g, and 32 lanes' word is 512 contiguous bytes."""
    from mgx.kernels.triton.testing import tile16

    source = (Path(cg.__file__).parent / "gemv.cu").read_text()
    assert "(r0 >> 4) * (static_cast<uint32_t>(steps) * kStepBytes) + (r0 & 15u) * 64u + 16u * lane" in source
    assert "kStepBytes = kTile16 ? 1024u * kW" in source and "kWordBytes = kTile16 ? 1024u" in source
    kw = {"group_size": 128} if scheme == "int4" else {}
    w = make_weight(scheme, n, k, **kw)
    flat = tile16(w).weight.view(torch.uint8).reshape(-1)
    rows = w.weight.view(torch.uint8)
    words, steps = (2 if scheme == "w8a16" else 1), k // 128
    step_bytes, n_out = 1024 * words, (n // 2 if silu else n)
    for b in range(n_out // 8 if silu else n // 16):
        for high in (False, True):
            r0 = ((n_out if high else 0) + 8 * b) if silu else 16 * b + (8 if high else 0)
            base = (r0 // 16) * steps * step_bytes + (r0 % 16) * 64
            for s in range(steps):
                for v in range(words):
                    at = base + s * step_bytes + v * 1024
                    for lane in range(32):
                        g, t = lane // 4, lane % 4
                        got = flat[at + 16 * lane:at + 16 * lane + 16]
                        want = rows[r0 + g, 64 * words * s + 64 * v + 16 * t:][:16]
                        assert torch.equal(got, want), (b, high, s, v, lane)


def test_persistent_tensor_core_kind_has_no_entry_of_its_own() -> None:
    """``mma_persistent`` launches the ``mma`` entry (and its ``_norm`` twin) on fewer blocks: a kind
    for the autotune pass to time, not new code in the artifact (the launch itself: tests/gpu);
    ``mma_pipelined`` and ``imma`` have entries (and twins) of their own; ``imma`` int4 needs groups
    of a multiple of 128, as ``mma``."""
    assert cg.KINDS == ("gemv", "mma", "mma_persistent", "mma_pipelined", "imma", "imma_persistent", "imma_w4", "imma_w16",
                        "imma_persistent_w4")  # fmt: skip
    assert {kind for kind, _ in cg.ENTRIES} == {"gemv", "mma", "mma_pipe", "imma", "imma_multi", "imma4", "imma16",
                                                "imma4_multi"}  # fmt: skip
    assert set(cg.NORM_ENTRIES) == set(cg.ENTRIES)
    every = FakeKernels(*cg.ENTRIES.values())
    for kind in ("mma", "imma", "imma_persistent", "imma_w4", "imma_w16", "imma_persistent_w4"):  # groups of 64: the CUDA-core kind only (and a CPU x: none)
        assert not cg.gemv_applies(every, torch.randn(1, 256).to(torch.bfloat16), make_weight("int4", 64, 256, group_size=64), kind=kind)


def test_persistent_integer_kind_gives_blocks_equal_shares_where_enough_blocks_remain() -> None:
    """``imma_persistent``'s grid (block b takes groups b, b + grid, ...): never more blocks than
    groups or than ``most``, so every block gets a group; the largest share is the least possible
    (ceil(groups / most)); and where at least 3/4 of ``most`` blocks remain, the fewest blocks with
    that share, so that the extra groups are spread over all blocks rather than left to some (1,792
    groups on 396 blocks: 359 blocks, 356 of them with 5 groups; not 210 blocks of 5 and 186 of 4)."""
    for most in (3, 324, 396, 528):
        for groups in (1, 2, most - 1, most, most + 1, 2 * most - 1, 600, 1792, 8016):
            blocks = cg.equal_shares(groups, most)
            share = -(-groups // blocks)  # block b takes b, b + blocks, ...: the largest share
            assert 1 <= blocks <= min(groups, most) and share == -(-groups // most)
            if 4 * -(-groups // share) >= 3 * most:  # the fewest blocks with that share
                assert blocks == -(-groups // share) and (blocks - 1) * share < groups
            else:
                assert blocks == min(groups, most)
    assert cg.equal_shares(1792, 396) == 359 and cg.equal_shares(397, 396) == 396


def test_norm_launches_keep_the_warps_an_sm_whatever_a_blocks_warps() -> None:
    """A _norm launch runs NORM_WARPS_PER_SM (32) warps an SM: 8 blocks of imma_w4's 4 warps, 4 of
    imma's 8, 2 of imma_w16's 16 (it ran 4 blocks whatever their warps: imma_w4 at half its plain
    occupancy), never more blocks than an SM holds at once, and at least one."""
    assert cg.NORM_WARPS_PER_SM == 32
    assert [cg.norm_blocks_per_sm(kind, 4096, 16) for kind in ("imma_w4", "imma", "imma_w16", "mma")] == [8, 4, 2, 4]
    assert cg.norm_blocks_per_sm("imma_persistent_w4", 4096, 16) == 8
    assert cg.norm_blocks_per_sm("imma_w4", 4096, 6) == 6  # e.g. shared memory for K = 8192
    assert cg.norm_blocks_per_sm("imma_w16", 4096, 0) == 1


def _constant(source: str, pattern: str) -> int:
    found = re.findall(pattern, source)
    assert len(found) == 1, (pattern, found)
    return int(found[0], 16)


def _lop3(lut: int, a: np.ndarray, b: int, c: int) -> np.ndarray:
    """PTX lop3.b32 with truth table ``lut`` (a = 0xF0, b = 0xCC, c = 0xAA), bit by bit."""
    out = np.zeros_like(a)
    for bit in range(32):
        i = ((a >> bit) & 1) << 2 | ((b >> bit) & 1) << 1 | ((c >> bit) & 1)
        out |= ((lut >> i) & 1) << bit
    return out


def _byte_perm(x: np.ndarray, y: np.ndarray, selector: int) -> np.ndarray:
    """CUDA __byte_perm(x, y, s): byte i of the result is byte (s >> 4i) & 7 of y:x."""
    pool = (y.astype(np.uint64) << 32) | x.astype(np.uint64)
    out = np.zeros_like(x)
    for i in range(4):
        pick = (selector >> (4 * i)) & 7
        out |= ((pool >> np.uint64(8 * pick)) & np.uint64(0xFF)).astype(np.uint32) << np.uint32(8 * i)
    return out


def _bf16(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)


def test_w8a16_tensor_core_decoding_gives_2304_plus_each_code() -> None:
    """The W8A16 tensor-core GEMV's decoding, with the constants and LOP3 truth tables read from
    gemv.cu and its byte permutes and LOP3s emulated bit by bit here (the kernel itself runs on a GPU
    in tests/gpu): for every pair of words of codes (columns c0..c3, c4..c7), pair p's low-nibble
    A operand times x plus its high-nibble operand times 16 x is (2304 + q) x for both columns of the
    pair, for all 256 codes, so the row's total D - 2304 sum x is sum q x."""
    source = (Path(cg.__file__).parent / "gemv.cu").read_text()
    and_or_lut = _constant(source, r'lop3\.b32 %0, %1, %2, %3, (0x[0-9A-Fa-f]+);" : "=r"\(r\) : "r"\(a\), "r"\(b\)')
    sel_xor_lut = _constant(source, r'lop3\.b32 %0, %1, %2, %3, (0x[0-9A-Fa-f]+);" : "=r"\(r\) : "r"\(a\), "r"\(m\)')
    low = _constant(source, r"kLow = (0x[0-9A-Fa-f]+)u")
    pair = _constant(source, r"kPair = (0x[0-9A-Fa-f]+)u")
    flip = _constant(source, r"kFlip = (0x[0-9A-Fa-f]+)u")
    sel = re.findall(r"__byte_perm\(wl\[2 \* j\], wl\[2 \* j \+ 1\], (0x[0-9A-Fa-f]+)\)", source)
    assert len(sel) == 2
    codes = np.arange(-128, 128, dtype=np.int64)
    rng = np.random.default_rng(0)
    for _ in range(64):  # words of 4 codes each: columns 0..3 and 4..7
        q = rng.permutation(np.tile(codes, 2))[:8 * 64].reshape(-1, 8)
        b = (q & 0xFF).astype(np.uint32)
        w0 = b[:, 0] | b[:, 1] << 8 | b[:, 2] << 16 | b[:, 3] << 24
        w1 = b[:, 4] | b[:, 5] << 8 | b[:, 6] << 16 | b[:, 7] << 24
        z = [_byte_perm(w0, w1, int(s, 16)) for s in sel]
        for p in range(4):  # pair p: columns p and p + 4, as the kernel's loop over q
            v = z[p >> 1] >> np.uint32(8 * (p & 1))
            lo = _lop3(and_or_lut, v, low, pair)
            hi = _lop3(sel_xor_lut, v >> np.uint32(4), low, flip)
            for half, column in ((0, p), (16, p + 4)):
                a_lo = _bf16((lo >> np.uint32(half)) & np.uint32(0xFFFF))
                a_hi = _bf16((hi >> np.uint32(half)) & np.uint32(0xFFFF))
                np.testing.assert_array_equal(a_lo + 16 * a_hi, 2304 + q[:, column])
    assert "2304.0f" in source


def _imma_column(c: int) -> int:
    return 128 * c + 8 * (c & 1) + 64 * (c >> 1)


def _imma_scale(x_bits: np.ndarray) -> tuple[int, int, np.float32]:
    """imma_factor's e (the bf16 exponent field of the step's largest |x|), ec = max(e, 22) and up = 2^(148 - ec)."""
    e = int((x_bits & 0x7FFF).max()) >> 7
    ec = max(e, 22)
    return e, ec, np.float32(2.0 ** (148 - ec))


def _imma_buffer() -> np.ndarray:
    """A warp's B buffer with its column of ones (column 2)."""
    buf = np.zeros(640, np.uint8)
    buf[_imma_column(2):_imma_column(2) + 128] = 1
    return buf


def _imma_put(buf: np.ndarray, at: int, u: np.ndarray, selectors: dict[str, int]) -> None:
    """imma_put: bytes 0, 1 and 2 of the four integer x ``u`` as the words at ``at`` of B's columns 0, 1 and 3."""
    p01 = _byte_perm(u[0:1], u[1:2], selectors["pair"])
    p23 = _byte_perm(u[2:3], u[3:4], selectors["pair"])
    top = _byte_perm(_byte_perm(u[0:1], u[1:2], selectors["top"]), _byte_perm(u[2:3], u[3:4], selectors["top"]), 0x5410)
    for c, word in ((0, _byte_perm(p01, p23, 0x5410)), (1, _byte_perm(p01, p23, 0x7632)), (3, top)):
        buf[_imma_column(c) + at:_imma_column(c) + at + 4] = np.frombuffer(word.astype("<u4").tobytes(), np.uint8)


def _imma_set_sums(fragment, buf: np.ndarray) -> np.ndarray:
    """Two m16n8k32 MMAs (h = 0, 1) of one set of 8 rows, placed by the PTX layout (A: row g regs 0
    and 2, row g + 8 regs 1 and 3, k-slots 4t.. and 16 + 4t..; B: column g, the same k-slots; D:
    columns 2t, 2t + 1) from lane (g, t)'s 16-byte A fragment ``fragment(g, t, h)`` and its 8-byte B
    read of the warp's buffer, then the quad's weighing of D: the 8 rows' sums of q X."""
    d = np.zeros((16, 8), np.int64)
    for h in range(2):
        a = np.zeros((16, 32), np.int64)
        b = np.zeros((32, 8), np.int64)
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            frag = fragment(g, t, h)
            a[g, 4 * t:4 * t + 4], a[g + 8, 4 * t:4 * t + 4] = frag[0:4], frag[4:8]
            a[g, 16 + 4 * t:20 + 4 * t], a[g + 8, 16 + 4 * t:20 + 4 * t] = frag[8:12], frag[12:16]
            at = _imma_column(g & 3) + 16 * t + 8 * (g >> 2) + 64 * h
            b[4 * t:4 * t + 4, g], b[16 + 4 * t:20 + 4 * t, g] = buf[at:at + 4], buf[at + 4:at + 8]
        d += a @ b
    assert np.abs(d).max() < 2**24  # every part converts to fp32 exactly
    sums = np.zeros(8)
    for g in range(8):
        for t in range(4):
            lo, hi = (d[g + 8, 2 * t], d[g + 8, 2 * t + 1]) if t >= 2 else (d[g, 2 * t], d[g, 2 * t + 1])
            sums[g] += (hi - 64 * lo) * 65536.0 if t & 1 else hi * 256.0 + lo
    return sums


def _imma_warp_step(codes: np.ndarray, x_bits: np.ndarray, selectors: dict[str, int]) -> np.ndarray:
    """One 128-column step of the ``imma`` GEMV for one warp, emulated lane by lane as gemv.cu does it:
    lane l's four x through the FFMA (fp32, as the GPU rounds it) and byte permutes into the warp's
    buffer, then each lane's A fragment (16 bytes of its W row as loaded) and B fragment (an 8-byte
    read of the buffer) placed into m16n8k32 by the PTX layout (A: row g regs 0 and 2, row g + 8 regs 1
    and 3, k-slots 4t.. and 16 + 4t..; B: column g, the same k-slots; D: columns 2t, 2t + 1), and the
    quad's weighing of D. ``codes``: int8 [16, 128] (rows lo 0-7, hi 8-15); returns fp32 [16] sums."""
    x = _bf16(x_bits)
    e, ec, up = _imma_scale(x_bits)
    buf = _imma_buffer()
    for lane in range(32):
        u = (x[4 * lane:4 * lane + 4].astype(np.float32) * up + np.float32(12582912.0)).astype(np.float32).view(np.uint32)
        _imma_put(buf, 16 * (lane >> 2) + 4 * (((lane & 1) << 1) | ((lane >> 1) & 1)), u, selectors)
    total = np.zeros(16)
    for rows in (slice(0, 8), slice(8, 16)):
        w = codes[rows].astype(np.int64)
        total[rows] = _imma_set_sums(lambda g, t, h, w=w: w[g, 64 * h + 16 * t:64 * h + 16 * t + 16], buf)
    factor = np.nan if e == 255 else 2.0 ** (ec - 148)
    return total * factor


def test_w8a16_integer_tensor_core_step_is_the_exact_product_within_fixed_point_rounding() -> None:
    """The ``imma`` kind's arithmetic (the kernel itself runs on a GPU in tests/gpu), with the byte
    permutes read from gemv.cu: one warp's step gives sum q x for its 16 rows within 2^-23 of the
    step's largest |x| times sum |q| (x made integer: rn(x 2^(148 - e)), exact within 2^14 of the
    largest), on plain rows, rows with one large outlier, all-zero x, tiny x, and NaN (every output
    NaN)."""
    source = (Path(cg.__file__).parent / "gemv.cu").read_text()
    pair = re.findall(r"__byte_perm\(u0, u1, (0x[0-9A-Fa-f]+)\), p23 = __byte_perm\(u2, u3, (0x[0-9A-Fa-f]+)\)", source)
    top = re.findall(r"__byte_perm\(__byte_perm\(u0, u1, (0x[0-9A-Fa-f]+)\)", source)
    assert len(pair) == 1 and pair[0][0] == pair[0][1] and len(top) == 1
    for text in ("12582912.0f", "275 - ec", "ec - 21", "max(e, 22)", "(t & 1) ? 64 : 0", "(t & 1) ? 65536.0f : 256.0f"):
        assert text in source, text
    selectors = {"pair": int(pair[0][0], 16), "top": int(top[0], 16)}
    rng = np.random.default_rng(3)
    for case in ("plain", "outlier", "zero", "tiny", "nan"):
        codes = rng.integers(-128, 128, (16, 128)).astype(np.int8)
        x = rng.standard_normal(128).astype(np.float32)
        if case == "outlier":
            x[rng.integers(128)] = 3000.0
        elif case == "zero":
            x[:] = 0.0
        elif case == "tiny":
            x *= 1e-30
        elif case == "nan":
            x[5] = np.nan
        bits = (x.view(np.uint32) >> 16).astype(np.uint32)  # bf16 by truncation: any bf16 will do
        got = _imma_warp_step(codes, bits, selectors)
        if case == "nan":
            assert np.isnan(got).all()
            continue
        xv = _bf16(bits)
        want = codes.astype(np.float64) @ xv
        bound = 2.0**-23 * max(np.abs(xv).max(), 2.0**-104) * np.abs(codes.astype(np.float64)).sum(axis=1)
        assert np.all(np.abs(got - want) <= bound), (case, np.abs(got - want).max(), bound.min())
        if case == "zero":
            assert np.all(got == 0)


def _imma4_warp_step(codes: np.ndarray, zeros: np.ndarray, x_bits: np.ndarray, picks: tuple[int, int]) -> np.ndarray:
    """One 128-column step of the int4 ``imma`` GEMV for one warp, emulated lane by lane as gemv.cu does
    it: lane l's eight x (columns 8 (l / 2) ..), of which it takes those of parity l % 2 through the
    byte permute ``picks[l % 2]`` and the FFMA into the warp's buffer, the step's sum of X from the
    same words, then each lane's 16 bytes of packed codes masked into low and high nibbles as the A
    fragments of two m16n8k32 MMAs (u8), B read as the W8A16 kind reads it, the quad's weighing of D
    and lane t = 0's z sum X. ``codes``: [16, 128] in 0..15 (rows lo 0-7, hi 8-15), ``zeros`` [16];
    returns the 16 sums of (q - z) x."""
    e, ec, up = _imma_scale(x_bits)
    words = x_bits[0::2].astype(np.uint32) | x_bits[1::2].astype(np.uint32) << np.uint32(16)  # 64 words of two bf16
    packed = (codes[:, 0::2] | codes[:, 1::2] << 4).astype(np.uint8)  # [16, 64]: column 2b + j in nibble j of byte b
    buf = _imma_buffer()
    sum_low = 0
    for lane in range(32):
        o, h = lane >> 1, lane & 1
        fp = _byte_perm(words[4 * o:4 * o + 4], np.zeros(4, np.uint32), picks[h]).view(np.float32)
        u = (fp * up + np.float32(12582912.0)).astype(np.float32).view(np.uint32)
        sum_low += int((u & 0x7FFFFF).sum())
        _imma_put(buf, 64 * h + 16 * (o >> 2) + 8 * (o & 1) + 4 * ((o >> 1) & 1), u, {"pair": 0x5140, "top": 0x0062})
    sum_x = float(np.float32(sum_low - (1 << 29)))
    assert abs(sum_low - (1 << 29)) < 2**29
    total = np.zeros(16)
    for rows in (slice(0, 8), slice(8, 16)):
        w = packed[rows].astype(np.int64)
        total[rows] = _imma_set_sums(lambda g, t, h, w=w: (w[g, 16 * t:16 * t + 16] >> (4 * h)) & 0xF, buf)
        total[rows] -= zeros[rows] * sum_x  # lane t = 0's share
    factor = np.nan if e == 255 else 2.0 ** (ec - 148)
    return total * factor


def test_int4_integer_tensor_core_step_is_the_exact_product_within_fixed_point_rounding() -> None:
    """The int4 ``imma`` kind's arithmetic (the kernel runs on a GPU in tests/gpu), with the byte
    permutes that pick a lane's x read from gemv.cu: one warp's step gives sum (q - z) x for its 16
    rows (zeros 0..15 and the symmetric 8) within 2^-22 of the step's largest |x| times sum |q - z|
    (x made integer) plus 2^-22 z sum |x| (sum X rounded to fp32), on plain rows, an outlier, zero,
    tiny and NaN x; a wrong nibble, column or byte would be off by whole codes times x."""
    source = (Path(cg.__file__).parent / "gemv.cu").read_text()
    picks = re.findall(r"\(lane & 1\) \? (0x[0-9A-Fa-f]+)u : (0x[0-9A-Fa-f]+)u;", source)
    assert len(picks) == 1
    for text in ("kLowNibbles = 0x0F0F0F0Fu", "(v.x >> 4) & kLowNibbles", "64 * (lane & 1) + 16 * (o >> 2) + 8 * (o & 1) + 4 * ((o >> 1) & 1)",
                 "warp_sum(lane_sum) - (1 << 29)", "s32.u8.u8.s32", "zx = t == 0 ? sum_x : 0.0f"):  # fmt: skip
        assert text in source, text
    pick = (int(picks[0][1], 16), int(picks[0][0], 16))  # (even lanes, odd lanes)
    rng = np.random.default_rng(5)
    for case in ("plain", "outlier", "zero", "tiny", "nan", "symmetric"):
        codes = rng.integers(0, 16, (16, 128)).astype(np.int64)
        zeros = np.full(16, 8) if case == "symmetric" else rng.integers(0, 16, 16)
        x = rng.standard_normal(128).astype(np.float32)
        if case == "outlier":
            x[rng.integers(128)] = -3000.0
        elif case == "zero":
            x[:] = 0.0
        elif case == "tiny":
            x *= 1e-30
        elif case == "nan":
            x[77] = np.nan
        bits = (x.view(np.uint32) >> 16).astype(np.uint32)
        got = _imma4_warp_step(codes, zeros, bits, pick)
        if case == "nan":
            assert np.isnan(got).all()
            continue
        xv = _bf16(bits)
        centered = (codes - zeros[:, None]).astype(np.float64)
        want = centered @ xv
        big = max(np.abs(xv).max(), 2.0**-104)
        bound = 2.0**-22 * big * np.abs(centered).sum(axis=1) + 2.0**-22 * zeros * np.abs(xv).sum() + 1e-300
        assert np.all(np.abs(got - want) <= bound), (case, np.abs(got - want).max(), bound.min())
        if case == "zero":
            assert np.all(got == 0)


def test_benches_hand_a_tile16_build_tiled_weights() -> None:
    """``as_read_by`` (bench_gpu_kernels, bench_gpu_layer, ncu_gemv): a MGX_IMMA_TILE16 build gets the
    weight's codes in cuda_tile16, the same values; a default build, no kernels, a dense weight or a shape
    the layout cannot hold get the weight as it is."""
    from mgx.kernels.triton.linear import dequantize_ref

    tiled_build, default_build = FakeKernels(cg.TILE16_MARKER), FakeKernels()
    for scheme in ("int4", "w8a16"):
        w = make_weight(scheme, 32, 256)
        t = as_read_by(w, tiled_build)
        assert t.layout == "cuda_tile16" and not torch.equal(t.weight, w.weight)
        assert torch.equal(dequantize_ref(t), dequantize_ref(w))
        assert as_read_by(w, default_build) is w and as_read_by(w, None) is w and as_read_by(t, tiled_build) is t
    for w in (make_weight("int4", 24, 256), make_weight("int4", 32, 192, group_size=64), make_weight("none", 32, 256)):
        assert as_read_by(w, tiled_build) is w


def test_fused_mlp_rows_read_back_in_fixed_point_and_the_launchers_refuse_what_they_cannot_take() -> None:
    """The fused MLP's rows (gemv.cu's mlp_int4_fused, MGX_CUDA_FUSED_MLP): int64 multiples of 2^-32 and a
    flag, each row 16-byte aligned; ``fixed_to`` rounds each value to fp32 then to the dtype (as
    ``norm_stage_fx`` reads it) and makes a flagged row NaN; the launchers refuse CPU rows, missing
    entries and rows of another shape, and the product's entry is the <16 warps, 2 steps, 4 row groups,
    double-buffered, fixed point> variant that bench_gpu_mlp.py timed (``w16_u2_d4_b1_x``)."""
    rows = cg.fixed_rows(6, "cpu", 2)
    assert rows.shape == (2, 8) and rows.dtype == torch.int64 and not rows.any() and rows.stride(0) * 8 % 16 == 0
    rows[0, :6] = torch.tensor([3 << 31, -(1 << 32), 1, (1 << 32) + 1, -(3 << 30), 0])
    rows[1, 6] = 1  # a NaN or Inf was met
    as_f32 = cg.fixed_to(rows, torch.float32)
    assert as_f32[0].tolist() == [1.5, -1.0, 2.0**-32, 1.0, -0.75, 0.0] and bool(as_f32[1].isnan().all())
    assert cg.fixed_to(rows, torch.bfloat16)[0].tolist() == [1.5, -1.0, 2.0**-32, 1.0, -0.75, 0.0]  # 1 + 2^-32 -> 1
    x = torch.randn(1, 256).to(torch.bfloat16)
    gate_up, down = make_weight("int4", 512, 256, group_size=128), make_weight("int4", 256, 256, group_size=128)
    both = FakeKernels(cg.FUSED_MLP_ENTRY, cg.NORM_STAGE_FX_ENTRY, cg.TILE16_MARKER, cg.HALF_SCALES_MARKER)
    assert not cg.fused_mlp_applies(None, x, gate_up, down)
    assert not cg.fused_mlp_applies(FakeKernels(cg.FUSED_MLP_ENTRY), x, gate_up, down)  # no norm_stage_fx
    assert not cg.fused_mlp_applies(both, x, gate_up, down)  # a CPU row (and row-major weights without pairs)
    with pytest.raises(ValueError, match="int64 row of 258"):
        cg.fused_mlp(x, gate_up, down, kernels=both, out=torch.zeros(256, dtype=torch.int64))
    with pytest.raises(ValueError, match="int64 row of 258"):
        cg.norm_stage_fx(x, torch.zeros(258, dtype=torch.int32), None, 1e-5, x.clone(), kernels=both)
    source = (Path(cg.__file__).parent / "gemv.cu").read_text()
    assert "MGX_MLP_ENTRY_NAMED(mgx_mlp_int4_fused, 16, 2, 4, true, true)" in source
    assert cg.FUSED_MLP_THREADS == 16 * 32
    example = (Path(__file__).resolve().parents[2] / "examples" / "mlp_fused.cu").read_text()
    assert "MGX_MLP_ENTRY(16, 2, 4, 1, true, _x)" in example  # the variant timed as the product's


def _entry_ptx(ptx: str, entry: str) -> str:
    """The PTX of one ``.entry`` of a module's text, up to the next one."""
    start = ptx.index(f".entry {entry}(")
    end = ptx.find(".entry ", start + 1)
    return ptx[start:] if end < 0 else ptx[start:end]


@pytest.mark.parametrize("early", [None, "0"])
def test_norm_stage_fx_releases_qkv_before_its_wait_and_no_other_norm_does(early: str | None) -> None:
    """In the product's build (cuda_tile16, fp16 scale pairs) for sm_90a, the add + norm after the fused
    MLP lets the next kernel (QKV) launch before its own griddepcontrol.wait; the norm before gate/up
    releases only after it, as every other kernel does (mgx_abi.cuh). MGX_NORM_FX_EARLY=0 turns the
    early release off."""
    nvcc = build.find_nvcc()
    if nvcc is None:
        pytest.skip("needs nvcc")
    flags = ["-DMGX_IMMA_TILE16=1", "-DMGX_IMMA_HALF_SCALES=1", *([f"-DMGX_NORM_FX_EARLY={early}"] if early else [])]
    with tempfile.TemporaryDirectory(prefix="mgx-ptx-") as tmp:
        out = Path(tmp) / "gemv.ptx"
        cmd = [nvcc, "-ptx", *build._flags("sm_90a", tuple(flags)), "-o", str(out), str(build.HERE / "gemv.cu")]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)  # the kernels' own nvcc flags
        assert proc.returncode == 0, proc.stderr[-2000:]
        ptx = out.read_text()
    for entry, released_first in ((cg.NORM_STAGE_FX_ENTRY, early is None), (cg.NORM_STAGE_ENTRIES["int4"], False)):
        body = _entry_ptx(ptx, entry)
        wait, release = body.find("griddepcontrol.wait"), body.find("griddepcontrol.launch_dependents")
        assert wait >= 0 and release >= 0, entry
        assert (release < wait) == released_first, (entry, release, wait)
