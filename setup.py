"""The C++ CPU kernels extension, ``mgx.kernels.cpu._mgx_cpu``; everything else is in pyproject.toml.

One build runs on any x86-64 host: each ISA path is its own translation unit that switches its
target with a pragma (kernels/cpu/csrc/isa_prelude.h), and the module picks a path from CPUID at
import. Other architectures compile the portable path only. OpenMP is used when the compiler has it
(``MGX_NO_OPENMP=1`` builds without). ``MGX_PORTABLE_ONLY=1`` builds only the portable path, as
an aarch64 host would (tests/e2e/test_portable_build.py). No dependency beyond a C++17 compiler and the Python headers.
"""

from __future__ import annotations

import os
import tempfile
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

CSRC = "kernels/cpu/csrc"
SOURCES = [f"{CSRC}/{name}.cpp" for name in ("isa_avx512", "isa_scalar", "isa_avx2", "module")]
HEADERS = [f"{CSRC}/{name}.h" for name in ("common", "impl", "isa_prelude", "scalar_types")]


class BuildExt(build_ext):
    """GCC or Clang flags, OpenMP when a probe links with it, translation units compiled in parallel."""

    def build_extensions(self) -> None:
        # No -ffast-math: the kernels rely on IEEE infinities (masked attention scores).
        flags, omp = ["-O3", "-std=c++17", "-g0", "-fvisibility=hidden"], (["-fopenmp"], ["-fopenmp"])
        if os.environ.get("MGX_NO_OPENMP") == "1" or not self._links(omp):
            omp = ([], [])
        for ext in self.extensions:
            ext.extra_compile_args = flags + omp[0]
            ext.extra_link_args = omp[1]
            if os.environ.get("MGX_PORTABLE_ONLY") == "1":  # what a non-x86 host builds, on any host
                ext.define_macros.append(("MGX_PORTABLE_ONLY", "1"))
        super().build_extensions()

    def build_extension(self, ext: Extension) -> None:
        # The ISA translation units take tens of seconds each and are independent: compile them side
        # by side (setuptools compiles one after another), then link as usual.
        serial = self.compiler.compile

        def parallel(sources: list[str], *args: object, **kwargs: object) -> list[str]:
            with ThreadPoolExecutor(max_workers=max(1, min(len(sources), os.cpu_count() or 1))) as pool:
                return [obj for objs in pool.map(lambda src: serial([src], *args, **kwargs), sources) for obj in objs]

        self.compiler.compile = parallel
        try:
            super().build_extension(ext)
        finally:
            self.compiler.compile = serial

    def _links(self, omp: tuple[list[str], list[str]]) -> bool:
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "probe.cpp")
            with open(src, "w") as f:
                f.write("#include <omp.h>\nint main() { return omp_get_max_threads() > 0 ? 0 : 1; }\n")
            try:
                objects = self.compiler.compile([src], output_dir=tmp, extra_postargs=omp[0])
                self.compiler.link_executable(objects, "probe", output_dir=tmp, extra_postargs=omp[1])
            except Exception:  # any compile or link failure means: build without OpenMP
                return False
        return True


setup(
    ext_modules=[Extension("mgx.kernels.cpu._mgx_cpu", sources=SOURCES, depends=HEADERS, language="c++")],
    cmdclass={"build_ext": BuildExt},
)
