"""The PTX Triton compiles for an sm_90 GPU (on the CPU, no GPU needed) keeps transformers' bf16
roundings: RoPE's two rounded products and their sum stay three roundings.

Compiled, ``round_as`` rounds with the GPU's conversion; with the conversions visible LLVM may narrow
rounded products and their sum to bf16 and contract them into one bf16 FMA, which rounds once. That
happened to RoPE (found on the H200 by test_hf_rounding.py; ``round_apart`` keeps them apart). The
interpreter, which every other kernel test runs, takes the bit rounding instead and cannot see it,
so this compiles the kernels for the GPU in a child process without TRITON_INTERPRET."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from mgx.kernels.triton import attention, rope

def ptx(fn, types, const):
    sig = {n: "constexpr" if n in const else types.get(n, "i32") for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs=dict(const))
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 1}).asm["ptx"]

bf, f32, i32 = "*bf16", "*fp32", "*i32"
found = {}
found["rope"] = ptx(rope._rope_kv_kernel,
    {"q_ptr": bf, "k_ptr": bf, "v_ptr": bf, "pos_ptr": i32, "inv_ptr": f32, "kc_ptr": bf, "vc_ptr": bf, "bt_ptr": i32,
     "qsl_ptr": i32, "attention_scaling": "fp32"},
    dict(HQ=4, HK=2, D=128, ROT=128, PAGE=16, ROPE=True, WRITE_KV=True, BLOCK_HQ=4, BLOCK_HK=2, BLOCK_D=128, BLOCK_S=2))
found["decode_rope_prologue"] = ptx(attention._decode_kernel,
    {"q_ptr": bf, "kc_ptr": bf, "vc_ptr": bf, "bt_ptr": i32, "ctx_ptr": i32, "out_ptr": bf, "part_o_ptr": f32,
     "part_m_ptr": f32, "part_l_ptr": f32, "cnt_ptr": i32, "k_ptr": bf, "v_ptr": bf, "inv_ptr": f32,
     "attention_scaling": "fp32", "scale_log2": "fp32"},
    dict(HK=2, G=4, D=64, PAGE=16, BLOCK_G=16, BLOCK_D=64, BLOCK_N=32, BLOCK_P=1, BLOCK_R=1, SPLIT=True, MERGE=False,
         ROT=64, DOT_PREC="tf32", OVERLAP=False))
print(json.dumps({name: {"bf16_fma": len(re.findall(r"\bfma\.rn[a-z.]*\.bf16", text)),
                         "cvt_bf16": len(re.findall(r"\bcvt\.rn\.bf16", text))} for name, text in found.items()}))
"""


@pytest.fixture(scope="module")
def ptx_counts() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kernel", ["rope", "decode_rope_prologue"])
def test_compiled_rope_rounds_each_product_apart(ptx_counts: dict, kernel: str) -> None:
    counts = ptx_counts[kernel]
    assert counts["cvt_bf16"] > 0  # the compiled rounding is what runs (not the interpreter's bit rounding)
    assert counts["bf16_fma"] == 0  # no rounded product contracted with the add after it
