"""Instructions per weight element in the one-row GEMV's loop, from the SASS Triton compiles for a GPU.

Needs no GPU: Triton compiles ``_linear_kernel`` for the target architecture on the CPU (its own
ptxas and cuobjdump), specialized as a launch specializes it (16-byte aligned pointers, sizes and
strides that are multiples of 16). For each backward branch the script counts the instructions of
the loop body it closes and divides by the weight elements one thread handles per iteration
(BLOCK_N x BLOCK_K / threads), with and without the RMSNorm in the loads (``linear(norm=)``).

A static count, not a speed: it shows which variant issues fewer instructions per byte of weight,
which matters where a GEMV is bound by instructions (W8A16, INT4) rather than by bytes.

    python examples/triton_sass.py --scheme w8a16 --block-n 16 --block-k 512 --warps 4

With ``--native ARCH`` (e.g. sm_90a; needs nvcc) it builds the native kernels (``kernels/cuda``) as
``mgxc`` does and prints, for each GEMV entry point, its registers and stack bytes a thread and the
instructions of each loop of 20 or more, its nested loops left out, largest first, with its MMAs
and global loads. nvcc may compile one loop twice (e.g. for a null and a given zeros pointer); an
outer loop over output groups holds the epilogue. A tensor-core kernel's main loop takes kMmaUnroll
128-column steps a warp, the pipelined one's 2 x kMmaPipeUnroll.
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
                 LAYOUT=0, HAS_BIAS=False, SILU_MUL=False, USE_DOT=False, DOT_PREC="ieee", BLOCK_M=1,
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
    (sass,) = cuobjdump(kernel.asm["cubin"], "-sass")
    return sass


def cuobjdump(cubin: bytes, *flags: str) -> list[str]:
    """What Triton's bundled cuobjdump prints for ``cubin``, once per flag ("-sass", "-res-usage")."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        return [subprocess.run([tool, flag, path], capture_output=True, text=True, check=True).stdout for flag in flags]


def loops(sass: str, own: bool = False) -> list[Counter]:
    """Opcode counts of each loop body: the instructions from a backward branch's target to the branch
    (``own``: less those of the loops inside it, i.e. what one of its iterations issues when the inner
    loops run once a group or not at all)."""
    lines = [(int(m.group(1), 16), line) for line in sass.splitlines() if (m := _ADDRESS.search(line))]
    spans = [(int(b.group(1), 16), addr) for addr, line in lines
             if (b := _BRANCH.search(line)) and int(b.group(1), 16) < addr]  # fmt: skip

    def inside(a: int, start: int, end: int) -> bool:
        nested = own and any((s, e) != (start, end) and start <= s and e <= end and s <= a <= e for s, e in spans)
        return start <= a <= end and not nested

    return [Counter(m.group(1).split(".")[0] for a, text in lines if inside(a, start, end) and (m := _OPCODE.search(text)))
            for start, end in spans]  # fmt: skip


_FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)", re.MULTILINE)
_USAGE = re.compile(r"Function (\S+):\s*\n?\s*REG:(\d+) STACK:(\d+)")


def native_report(arch: str, match: str, flags: tuple[str, ...] = ()) -> list[str]:
    """One line per native entry point whose name holds ``match``: registers, stack, loop sizes (of a
    build with nvcc ``flags``)."""
    from mgx.kernels.cuda.build import build_cuda_kernels

    usage, sass = cuobjdump(build_cuda_kernels(arch, extra_flags=flags), "-res-usage", "-sass")
    regs = {name: (int(r), int(st)) for name, r, st in _USAGE.findall(usage)}
    parts = _FUNCTION.split(sass)  # [before, name, body, name, body, ...]
    lines = []
    for name, body in sorted(zip(parts[1::2], parts[2::2])):
        if match in name:
            r, st = regs.get(name, (-1, -1))
            found = sorted(((sum(ops.values()), ops["HMMA"], ops["IMMA"], ops["LDG"]) for ops in loops(body, own=True)),
                           reverse=True)  # fmt: skip
            sizes = ", ".join(f"{n} ({'HMMA' if h else 'IMMA'} {h or i}, LDG {ld})" if h or i else str(n)
                              for n, h, i, ld in found if n >= 20)  # fmt: skip
            lines.append(f"{name}: {r} registers, {st} bytes of stack; loops {sizes or 'none'}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scheme", choices=sorted(WEIGHT_PTR), default="w8a16")
    parser.add_argument("--block-n", type=int, default=16)
    parser.add_argument("--block-k", type=int, default=512)
    parser.add_argument("--warps", type=int, default=4)
    parser.add_argument("--split-k", type=int, default=1)
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for sm_90")
    parser.add_argument("--native", metavar="ARCH", help="the native kernels for ARCH (e.g. sm_90a) instead")
    parser.add_argument("--match", default="gemv", help="with --native: entry points whose name holds this")
    parser.add_argument("--nvcc-flag", action="append", default=[], help="with --native: build with this flag too "
                        "(repeatable; with =: --nvcc-flag=-D...)")
    args = parser.parse_args()
    if args.native:
        from mgx.kernels.cuda.build import CudaBuildError

        try:
            lines = native_report(args.native, args.match, tuple(args.nvcc_flag))
        except CudaBuildError as e:
            sys.exit(f"triton_sass: {e}")
        print("\n".join(lines) if lines else f"no entry point holds {args.match!r}")
        return 0 if lines else 1
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
