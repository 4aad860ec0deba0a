"""What the GPU gives kernels that only read memory: a floor under the decode step's GEMV chain, and
what a kernel boundary costs against a grid barrier inside one persistent kernel.

- ``floor``: kernels that read (and fold) exactly as many bytes as each projection of the
  Llama-3.1-8B INT4 layer reads of its weights (int4 codes, an fp16 scale and zero a row and group of 128),
  chained by programmatic dependent launches in one CUDA graph as ``bench_gpu_layer.py`` chains the
  GEMVs: the layer's four projections 32 times, each projection alone 32 times, and one kernel
  reading all of it (the rate without boundaries). Each reader loads its first bytes before its wait,
  as the GEMVs do. Compare a projection's rate here with ``bench_gpu_layer.py --parts qkv,o,...``.
- ``boundaries``: P phases each reading S bytes, as P kernels chained by programmatic dependent
  launch against one persistent kernel with a grid barrier between its phases, whose blocks ask for
  their share of the next phase's first bytes before the barrier ("early") or after it ("late"):
  what a persistent decode kernel would pay for each boundary it removes. The barriers
  (``--barriers``): ``one``, a release add on one counter, then each block polling it with acquire
  loads (the thirty-ninth session's); ``spread``, the adds spread over 32 counters that a warp of
  each block polls at once; ``flags``, a flag a block stored with release semantics, all of them
  polled by a warp of each block at once (no atomics); ``relaxed``, ``one`` without any ordering of
  memory (no barrier for data: the round trips' own latency); ``split``, ``one`` with the release add
  before the next phase's first bytes are asked for and the polls after.

    python examples/bench_gpu_floor.py [--parts floor,boundaries] [--blocks-per-sm 1,2,4] [--barriers one,spread,...]

Needs an NVIDIA GPU (sm_90 or newer: programmatic dependent launches) and nvcc. Times are medians,
milliseconds.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys

PARTS = ("floor", "boundaries")
# The persistent kernel's grid barriers (floor_phases' mode, in this order; SOURCE's grid_barrier says how).
BARRIERS = ("one", "spread", "flags", "relaxed", "split")
MAX_BLOCKS = 1024  # the persistent kernel's blocks at most ("flags": 32 lanes x kMaxFlags)
LINE_WORDS = 32  # 4-byte words a 128-byte line (kLine)
LAYERS = 32
# (N, K) of the 8B layer's one-row products (as bench_gpu_layer.py: gate/up holds the gate, then the up rows).
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
GROUP = 128  # int4 columns a scale and a zero

SOURCE = r"""
#include <cstdint>
__device__ __forceinline__ void pdl_wait() {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.b32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
constexpr int U = 8;  // 16-byte words a thread asks for at a time
struct Batch { uint4 v[U]; };
__device__ __forceinline__ void load_batch(Batch& b, const uint4* src, long long i, long long hi) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const long long j = i + static_cast<long long>(u) * blockDim.x;
    b.v[u] = j < hi ? ld_stream(src + j) : make_uint4(0, 0, 0, 0);
  }
}
__device__ __forceinline__ uint32_t fold(const Batch& b) {
  uint32_t a = 0;
#pragma unroll
  for (int u = 0; u < U; ++u) a ^= b.v[u].x ^ b.v[u].y ^ b.v[u].z ^ b.v[u].w;
  return a;
}
// The block's words [lo, hi): `first` (the batch at lo + thread) already asked for, then a batch ahead.
__device__ __forceinline__ uint32_t stream_from(Batch& first, const uint4* src, long long lo, long long hi) {
  const long long step = static_cast<long long>(blockDim.x) * U;
  uint32_t acc = 0;
  Batch next;
  for (long long i = lo + threadIdx.x; i < hi; i += step) {
    load_batch(next, src, i + step, hi);
    acc ^= fold(first);
    first = next;
  }
  return acc;
}
__device__ __forceinline__ void share(long long words, int phase, long long& lo, long long& hi) {
  const long long per = (words + gridDim.x - 1) / gridDim.x, base = static_cast<long long>(phase) * words;
  lo = base + blockIdx.x * per;
  hi = min(lo + per, base + words);
}
extern "C" __global__ void __launch_bounds__(256) floor_read(const uint4* src, long long words, int phase, uint32_t* sink) {
  long long lo, hi;
  share(words, phase, lo, hi);
  Batch first;
  load_batch(first, src, lo + threadIdx.x, hi);  // before the wait, as the GEMVs' first step
  pdl_wait();
  const uint32_t acc = stream_from(first, src, lo, hi);
  if (acc == 0x9E3779B9u) sink[blockIdx.x] = acc;  // keeps the loads
}
constexpr int kLine = 32;  // u32 words a 128-byte line: each counter or flag of the barriers on its own
constexpr int kMaxFlags = 32;  // flags a polling lane reads at once ("flags": up to 1,024 blocks)
__device__ __forceinline__ unsigned ld_relaxed(const unsigned* p) {
  unsigned v;
  asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// A grid barrier, the block's arrival at phase `phase` (1, 2, ...) and its wait for every block's:
// mode 0 ("one"): a release add on one counter, thread 0 polling it with acquire loads;
// mode 1 ("spread"): block b adds to counter b % 32 (a line each), lane i of warp 0 polls counter i
//   with relaxed loads, then one acquire fence;
// mode 2 ("flags"): block b stores the phase into its own line with release semantics, the lanes of
//   warp 0 poll all the blocks' lines (up to 32 loads in flight a lane), then one acquire fence;
// mode 3 ("relaxed"): as "one" with a relaxed add and relaxed polls, no ordering of memory at all:
//   not a barrier a kernel could use for data, only the latency of the round trips themselves;
// mode 4 ("split"): as "one", but the block arrives (its release add) before it asks for the next
//   phase's first bytes and waits after, so the release does not wait for those loads (floor_phases).
// "one"'s two halves, thread 0 of the block: its release add, and its acquire polls until every block
// of the grid has added for this phase ("split" sends the next phase's first loads between them).
__device__ __forceinline__ void arrive_one(unsigned* sync) {
  asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(sync) : "memory");
}
__device__ __forceinline__ void wait_one(const unsigned* sync, unsigned phase) {
  unsigned seen;
  do {
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(sync) : "memory");
  } while (seen < phase * gridDim.x);
}
__device__ __forceinline__ void grid_barrier(unsigned* sync, unsigned phase, int mode) {
  __syncthreads();
  const unsigned lane = threadIdx.x;
  if (mode == 0) {
    if (lane == 0) {
      arrive_one(sync);
      wait_one(sync, phase);
    }
  } else if (mode == 1) {
    if (lane == 0)
      asm volatile("red.release.gpu.global.add.u32 [%0], 1;" ::"l"(sync + (blockIdx.x % 32) * kLine) : "memory");
    if (lane < 32) {
      const unsigned mine = (gridDim.x + 31 - lane) / 32;  // the blocks b with b % 32 == lane
      while (!__all_sync(0xFFFFFFFFu, ld_relaxed(sync + lane * kLine) >= phase * mine)) {
      }
      asm volatile("fence.acq_rel.gpu;" ::: "memory");
    }
  } else if (mode == 3) {
    if (lane == 0) {
      asm volatile("red.relaxed.gpu.global.add.u32 [%0], 1;" ::"l"(sync) : "memory");
      while (ld_relaxed(sync) < phase * gridDim.x) {
      }
    }
  } else {
    if (lane == 0)
      asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(sync + blockIdx.x * kLine), "r"(phase) : "memory");
    if (lane < 32) {
      bool done;
      do {
        unsigned seen[kMaxFlags];
#pragma unroll
        for (int i = 0; i < kMaxFlags; ++i) {
          const unsigned b = lane + 32u * i;
          seen[i] = b < gridDim.x ? ld_relaxed(sync + b * kLine) : phase;
        }
        done = true;
#pragma unroll
        for (int i = 0; i < kMaxFlags; ++i) done = done && seen[i] >= phase;
      } while (!__all_sync(0xFFFFFFFFu, done));
      asm volatile("fence.acq_rel.gpu;" ::: "memory");
    }
  }
  __syncthreads();
}
extern "C" __global__ void __launch_bounds__(256) floor_phases(const uint4* src, long long words, int phases,
                                                               unsigned* sync, uint32_t* sink, int early, int mode) {
  long long lo, hi;
  share(words, 0, lo, hi);
  Batch first;
  load_batch(first, src, lo + threadIdx.x, hi);
  uint32_t total = 0;
  for (int p = 0; p < phases; ++p) {
    share(words, p, lo, hi);
    total ^= stream_from(first, src, lo, hi);
    const bool more = p + 1 < phases;
    if (more) share(words, p + 1, lo, hi);
    if (mode == 4) {  // "split": arrive, ask, wait
      __syncthreads();
      if (threadIdx.x == 0) arrive_one(sync);
      if (more && early) load_batch(first, src, lo + threadIdx.x, hi);
      if (threadIdx.x == 0) wait_one(sync, static_cast<unsigned>(p + 1));
      __syncthreads();
    } else {
      if (more && early) load_batch(first, src, lo + threadIdx.x, hi);
      grid_barrier(sync, static_cast<unsigned>(p + 1), mode);
    }
    if (more && !early) load_batch(first, src, lo + threadIdx.x, hi);
  }
  if (total == 0x9E3779B9u) sink[blockIdx.x] = total;
}
"""


def projection_bytes() -> dict[str, int]:
    """Bytes each 8B INT4 projection reads of its weight: N K / 2 of codes and N K / 128 fp16 pairs of
    scale and zero, 4 bytes each (``GpuWeight.gemv_nbytes`` of ``make_weight``'s asymmetric int4 with
    ``scale_pairs``, as ``bench_gpu_layer.py`` times it on the model's MGX_IMMA_HALF_SCALES build; fp32
    scales and u8 zeros, 5 bytes a group, until the forty-second session)."""
    return {p: n * k // 2 + (n * k // GROUP) * 4 for p, (n, k) in SHAPES.items()}


def floor_plans() -> dict[str, list[int]]:
    """Each chain's reads in launch order: the layer's four projections 32 times, each one alone 32
    times, and everything in one read."""
    size = projection_bytes()
    plans = {"layer (4 projections)": [size[p] for _ in range(LAYERS) for p in SHAPES]}
    plans.update({p: [size[p]] * LAYERS for p in SHAPES})
    plans["one kernel, all of it"] = [LAYERS * sum(size.values())]
    return plans


def build(arch: str) -> bytes:
    from mgx.kernels.cuda.build import compile_unit, find_nvcc

    if find_nvcc() is None:
        raise SystemExit("bench_gpu_floor needs nvcc")
    return compile_unit(SOURCE, arch)


class Bench:
    def __init__(self, reps: int) -> None:
        import torch

        from mgx.kernels.cuda.build import arch_for
        from mgx.kernels.cuda.driver import CudaModule

        major, minor = torch.cuda.get_device_capability()
        if major < 9:
            raise SystemExit(f"bench_gpu_floor needs sm_90 or newer (programmatic dependent launches), not sm_{major}{minor}")
        self.torch, self.reps = torch, reps
        self.module = CudaModule(build(arch_for(major, minor)))
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count
        plans = floor_plans()
        need = max(sum((n + 255) // 256 * 256 for n in plan) for plan in plans.values())
        self.src = torch.randint(0, 255, (need,), dtype=torch.uint8, device="cuda")
        self.sink = torch.zeros(4096, dtype=torch.int32, device="cuda")
        self.sync = torch.zeros(MAX_BLOCKS * LINE_WORDS, dtype=torch.int32, device="cuda")  # the barriers' lines

    def _launch(self, name: str, blocks: int, args: list, overlap: bool) -> None:
        stream = self.torch.cuda.current_stream().cuda_stream
        self.module.launch(name, (blocks,), (256,), args, stream, overlap=overlap)

    def _ms(self, fn, graph: bool) -> float:  # noqa: ANN001
        torch = self.torch
        fn()
        torch.cuda.synchronize()
        run = fn
        if graph:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            run = g.replay
        times = []
        for _ in range(self.reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)

    def chain(self, plan: list[int], blocks: int) -> float:
        """One reader a size of ``plan``, each on fresh bytes, chained by PDL in a graph."""

        def run() -> None:
            at = 0
            for nbytes in plan:
                args = [ctypes.c_void_p(self.src.data_ptr() + at), ctypes.c_longlong(nbytes // 16), ctypes.c_int(0),
                        ctypes.c_void_p(self.sink.data_ptr())]  # fmt: skip
                self._launch("floor_read", blocks, args, overlap=True)
                at += (nbytes + 255) // 256 * 256

        return self._ms(run, graph=True)

    def persistent(self, words: int, phases: int, blocks: int, early: bool, barrier: str = "one") -> float:
        """The phases in one kernel of ``blocks`` (at most ``MAX_BLOCKS``), a ``barrier`` between them."""
        if blocks > MAX_BLOCKS:
            raise ValueError(f"{blocks} blocks: the barriers' lines hold {MAX_BLOCKS}")

        def run() -> None:
            self.sync.zero_()
            args = [ctypes.c_void_p(self.src.data_ptr()), ctypes.c_longlong(words), ctypes.c_int(phases),
                    ctypes.c_void_p(self.sync.data_ptr()), ctypes.c_void_p(self.sink.data_ptr()), ctypes.c_int(int(early)),
                    ctypes.c_int(BARRIERS.index(barrier))]  # fmt: skip
            self._launch("floor_phases", blocks, args, overlap=False)

        return self._ms(run, graph=True)  # as the chains: a graph's launch on each side of the times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default=",".join(PARTS), help=f"which, of {', '.join(PARTS)}")
    ap.add_argument("--blocks-per-sm", default="1,2,4", help="reader blocks (256 threads) an SM, comma-separated")
    ap.add_argument("--phases", type=int, default=128, help="phases of the boundaries part")
    ap.add_argument("--phase-mb", default="28,12,3,0.25", help="MB a phase reads in the boundaries part, comma-separated (the 39th session timed 29: the buffer shrank with the fp16 scale pairs)")
    ap.add_argument("--barriers", default=",".join(BARRIERS), help=f"the persistent kernel's grid barriers, of {', '.join(BARRIERS)}")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args(argv)
    parts = args.parts.split(",")
    if unknown := [p for p in parts if p not in PARTS]:
        ap.error(f"--parts: {', '.join(unknown)} not one of {', '.join(PARTS)}")
    barriers = args.barriers.split(",")
    if unknown := [b for b in barriers if b not in BARRIERS]:
        ap.error(f"--barriers: {', '.join(unknown)} not one of {', '.join(BARRIERS)}")
    try:
        per_sm = [int(x) for x in args.blocks_per_sm.split(",")]
        phase_mb = [float(x) for x in args.phase_mb.split(",")]
    except ValueError:
        ap.error("--blocks-per-sm and --phase-mb take comma-separated numbers")
    if min(per_sm) < 1 or min(phase_mb) <= 0 or args.phases < 1 or args.reps < 1:
        ap.error("--blocks-per-sm, --phase-mb, --phases and --reps must be positive")
    if args.phases * max(phase_mb) * 1e6 > LAYERS * sum(projection_bytes().values()):
        ap.error("--phases x --phase-mb is more than the floor's buffer (the 8B layers' INT4 weights)")
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("bench_gpu_floor needs an NVIDIA GPU")
    bench = Bench(args.reps)
    most = bench.module.max_blocks_per_sm("floor_phases", 256)  # a grid barrier needs every block resident
    print(f"{torch.cuda.get_device_name()}, {bench.sms} SMs; persistent blocks an SM at most {most}")
    if "floor" in parts:
        for k in per_sm:
            for name, plan in floor_plans().items():
                ms = bench.chain(plan, k * bench.sms)
                print(f"  floor, {k} blocks an SM: {name}: {ms:.3f} ms ({1e3 * ms / LAYERS:.2f} us a layer, "
                      f"{sum(plan) / ms / 1e6:.0f} GB/s)", flush=True)  # fmt: skip
    if "boundaries" in parts:
        for mb in phase_mb:
            words = int(mb * 1e6) // 16
            for k in per_sm:
                blocks = k * bench.sms
                one = bench.chain([words * 16 * args.phases], blocks)
                pdl = bench.chain([words * 16] * args.phases, blocks)
                line = (f"  boundaries, {mb:g} MB x {args.phases} phases, {k} blocks an SM: one kernel {one:.3f} ms; "
                        f"PDL chain {pdl:.3f} ms ({1e3 * (pdl - one) / args.phases:.2f} us a boundary)")  # fmt: skip
                for barrier in barriers if k <= most and blocks <= MAX_BLOCKS else ():
                    for early in (False, True):
                        ms = bench.persistent(words, args.phases, blocks, early, barrier)
                        line += (f"; persistent ({barrier}), next bytes {'before' if early else 'after'} the barrier "
                                 f"{ms:.3f} ms ({1e3 * (ms - one) / args.phases:.2f} us a barrier)")  # fmt: skip
                print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
