"""Overlapped launches of the Triton kernels (programmatic dependent launches), on the CPU: the switch,
and the code Triton makes for sm_90 with it (compiled, not run; launches: tests/gpu)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

from mgx.kernels.triton import _common  # noqa: E402


def test_overlap_options_follow_the_switch_and_never_reach_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _common.overlap_options() == {"OVERLAP": False}
    monkeypatch.setattr(_common, "_INTERPRETING", True)
    with _common.overlapped_launches(True):
        assert _common.overlap_options() == {"OVERLAP": False}  # the interpreter has no griddepcontrol
    monkeypatch.setattr(_common, "_INTERPRETING", False)
    with _common.overlapped_launches(True):
        assert _common.overlap_options() == {"OVERLAP": True, "launch_pdl": True}
        with _common.overlapped_launches(False):
            assert _common.overlap_options() == {"OVERLAP": False}
        assert _common.overlap_options()["OVERLAP"]
    assert _common.overlap_options() == {"OVERLAP": False}


def test_kernels_compiled_overlapped_for_sm90_release_and_wait() -> None:
    """The decode merge and argmax merge kernels compiled for sm_90 (in a process without the
    interpreter): with OVERLAP their PTX holds griddepcontrol.wait and, after it, .launch_dependents
    (a kernel lets the next start only once its predecessor is done) and the kernel is marked for
    launch_pdl; without it, neither."""
    code = textwrap.dedent('''
        import os
        os.environ.pop("TRITON_INTERPRET", None)
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
        from mgx.kernels.triton import attention, lm_head
        cases = [
            (lm_head._argmax_merge_kernel, {"part_v_ptr": "*fp32", "part_i_ptr": "*i32", "ids_ptr": "*i32",
             "vals_ptr": "*fp32", "num_tiles": "i32"}, {"BLOCK_T": 64}),
            (attention._decode_merge_kernel, {"part_o_ptr": "*fp32", "part_m_ptr": "*fp32", "part_l_ptr": "*fp32",
             "out_ptr": "*bf16", "stride_o": "i32", "num_splits": "i32"}, {"HQ": 8, "D": 64, "BLOCK_P": 8, "BLOCK_D": 64}),
        ]
        for fn, types, consts in cases:
            for on in (True, False):
                c = {**consts, "OVERLAP": on}
                sig = {**types, **{name: "constexpr" for name in c}}
                k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=c), target=GPUTarget("cuda", 90, 32),
                                   options={"launch_pdl": on})
                ptx = k.asm["ptx"]
                wait, release = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
                print(fn.__name__, on, wait >= 0, release >= 0, bool(k.metadata.launch_pdl), 0 <= wait < release)
    ''')
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.split("\n")
    for name in ("_argmax_merge_kernel", "_decode_merge_kernel"):
        assert f"{name} True True True True True" in lines
        assert f"{name} False False False False False" in lines
