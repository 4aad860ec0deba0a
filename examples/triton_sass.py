"""Instructions per weight element in the one-row GEMV's loop, from the SASS Triton compiles for a GPU.

Needs no GPU: Triton compiles ``_linear_kernel`` for the target architecture on the CPU (its own
ptxas and cuobjdump), specialized as a launch specializes it (16-byte aligned pointers, sizes and
strides that are multiples of 16). For each backward branch the script counts the instructions of
the loop body it closes and divides by the weight elements one thread handles per iteration
(BLOCK_N x BLOCK_K / threads), with and without the RMSNorm in the loads (``linear(norm=)``).

A static count, not a speed: it shows which variant issues fewer instructions per byte of weight,
which matters where a GEMV is bound by instructions (W8A16, INT4) rather than by bytes.

    python examples/triton_sass.py --scheme w8a16 --block-n 16 --block-k 512 --warps 4
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("triton_sass: unset TRITON_INTERPRET: with it the kernels take their interpreter code, not the GPU's")

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from mgx.kernels.triton import linear  # noqa: E402

WEIGHT_PTR = {"none": "*bf16", "w8a16": "*i8", "int4": "*u8"}
POINTERS = {"x_ptr": "*bf16", "s_ptr": "*fp32", "z_ptr": "*u8", "meta_ptr": "*u8", "b_ptr": "*bf16", "out_ptr": "*bf16",
            "ws_ptr": "*fp32", "cnt_ptr": "*i32", "res_ptr": "*bf16", "sq_ptr": "*fp32", "nw_ptr": "*bf16"}  # fmt: skip
UNALIGNED_INTS = {"M", "n_sq"}  # the row count and the number of partial sums are not multiples of 16
_ADDRESS = re.compile(r"/\*([0-9a-f]{4,})\*/")
_BRANCH = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")
_OPCODE = re.compile(r"\*/\s+(?:@!?U?P[T\d]+\s+)?([A-Z][A-Z0-9_]*)")


def compile_sass(scheme: str, block_n: int, block_k: int, warps: int, split: int, norm: bool, arch: int) -> str:
    """SASS of ``_linear_kernel`` as the one-row GEMV of ``scheme`` with that configuration."""
    names = linear._linear_kernel.arg_names
    const = dict(SCHEME=linear.SCHEME_IDS[scheme], GROUP=128 if scheme == "int4" else 1, SYMMETRIC=False,
                 META_PACKED=False, HAS_BIAS=False, SILU_MUL=False, USE_DOT=False, DOT_PREC="ieee", BLOCK_M=1,
                 BLOCK_N=block_n, BLOCK_K=block_k, EVEN=True, SPLIT_K=split, SWAP=False, FAST_CVT=True,
                 OVERLAP=False, RES_SQ=False, NORM_IN=norm, NORM_W=norm, BLOCK_SQ=256)  # fmt: skip
    sig = {}
    for name in names:
        if name in const:
            sig[name] = "constexpr"
        elif name == "w_ptr":
            sig[name] = WEIGHT_PTR[scheme]
        else:
            sig[name] = POINTERS.get(name, "fp32" if name == "eps" else "i32")
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
             if sig[name].startswith("*") or (sig[name] == "i32" and name not in UNALIGNED_INTS)}  # fmt: skip
    src = ASTSource(fn=linear._linear_kernel, signature=sig, constexprs={k: v for k, v in const.items() if k in names},
                    attrs=attrs)  # fmt: skip
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "num_stages": 1})
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        return subprocess.run([cuobjdump, "-sass", path], capture_output=True, text=True, check=True).stdout


def loops(sass: str) -> list[Counter]:
    """Opcode counts of each loop body: the instructions from a backward branch's target to the branch."""
    lines = [(int(m.group(1), 16), line) for line in sass.splitlines() if (m := _ADDRESS.search(line))]
    found = []
    for addr, line in lines:
        branch = _BRANCH.search(line)
        if branch and int(branch.group(1), 16) < addr:
            start = int(branch.group(1), 16)
            found.append(Counter(m.group(1).split(".")[0] for a, text in lines
                                 if start <= a <= addr and (m := _OPCODE.search(text))))  # fmt: skip
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scheme", choices=sorted(WEIGHT_PTR), default="w8a16")
    parser.add_argument("--block-n", type=int, default=16)
    parser.add_argument("--block-k", type=int, default=512)
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--split-k", type=int, default=1)
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for sm_90")
    args = parser.parse_args()
    per_thread = args.block_n * args.block_k / (32 * args.warps)
    for norm in (False, True):
        sass = compile_sass(args.scheme, args.block_n, args.block_k, args.warps, args.split_k, norm, args.arch)
        for ops in loops(sass):
            total = sum(ops.values())
            top = ", ".join(f"{op} {n}" for op, n in ops.most_common(10))
            print(f"{args.scheme} {args.block_n} x {args.block_k}, {args.warps} warps, norm in loads {norm}: "
                  f"{total} instructions a loop, {total / per_thread:.2f} per weight element ({top})")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
