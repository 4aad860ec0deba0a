"""kernels/cuda/build.py keeps built images (in the process and on disk) under a key of everything
that decides their bytes. A stand-in nvcc (a script that logs its calls and writes a fake cubin)
counts the builds, so this runs without the CUDA toolkit."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from mgx.kernels.cuda import build


@pytest.fixture
def fake_nvcc(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path]:
    """A shell nvcc: ``--version`` prints the contents of version.txt; a build appends a line to
    calls.log and writes an ELF header and its flags (up to -o) to the -o path. Returns (its path, tmp)."""
    (tmp_path / "version.txt").write_text("Cuda compilation tools, release 13.0\n")
    script = tmp_path / "nvcc"
    script.write_text(f"""#!/bin/sh
if [ "$1" = "--version" ]; then cat "{tmp_path}/version.txt"; exit 0; fi
echo "$@" >> "{tmp_path}/calls.log"
out=""; prev=""
for a in "$@"; do if [ "$prev" = "-o" ]; then out="$a"; fi; prev="$a"; done
printf '\\177ELF' > "$out"; echo "$@" | sed 's/ -o .*//' >> "$out"
""")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("MGX_CUDA_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "_MEMO", {})
    monkeypatch.setattr(build, "_VERSIONS", {})
    return str(script), tmp_path


def _builds(tmp: Path) -> int:
    log = tmp / "calls.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


def test_an_image_is_built_once_and_kept_on_disk(fake_nvcc: tuple[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    nvcc, tmp = fake_nvcc
    first = build.build_cuda_kernels("sm_90a", nvcc=nvcc)
    assert first.startswith(b"\x7fELF") and b"-gencode=arch=compute_90a,code=sm_90a" in first
    assert build.build_cuda_kernels("sm_90a", nvcc=nvcc) == first and _builds(tmp) == 1
    monkeypatch.setattr(build, "_MEMO", {})  # a new process: from the disk
    assert build.build_cuda_kernels("sm_90a", nvcc=nvcc) == first and _builds(tmp) == 1
    assert len(list((tmp / "cache").glob("*.cubin"))) == 1 and not list((tmp / "cache").glob(".*"))


def test_what_decides_the_bytes_is_in_the_key(fake_nvcc: tuple[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    nvcc, tmp = fake_nvcc
    build.build_cuda_kernels("sm_90a", nvcc=nvcc)
    build.build_cuda_kernels("sm_80", nvcc=nvcc)  # another architecture
    build.build_cuda_kernels("sm_90a", nvcc=nvcc, extra_flags=("-DMGX_KERNEL_ABI=9",))  # other flags
    assert _builds(tmp) == 3
    (tmp / "version.txt").write_text("Cuda compilation tools, release 13.1\n")  # another nvcc
    monkeypatch.setattr(build, "_MEMO", {})
    monkeypatch.setattr(build, "_VERSIONS", {})
    build.build_cuda_kernels("sm_90a", nvcc=nvcc)
    assert _builds(tmp) == 4
    # A changed source: the key reads every .cu and .cuh beside build.py.
    sources = [p for p in build.HERE.iterdir() if p.suffix in (".cu", ".cuh")]
    real = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda p: real(p) + (b"//" if p == sources[0] else b""))
    monkeypatch.setattr(build, "_MEMO", {})
    build.build_cuda_kernels("sm_90a", nvcc=nvcc)
    assert _builds(tmp) == 5


def test_a_torn_entry_is_rebuilt_and_an_unwritable_cache_is_skipped(fake_nvcc: tuple[str, Path],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    nvcc, tmp = fake_nvcc
    image = build.build_cuda_kernels("sm_90a", nvcc=nvcc)
    (kept,) = (tmp / "cache").glob("*.cubin")
    kept.write_bytes(image[:3])  # cut short
    monkeypatch.setattr(build, "_MEMO", {})
    assert build.build_cuda_kernels("sm_90a", nvcc=nvcc) == image and _builds(tmp) == 2
    assert kept.read_bytes() == image  # written again, whole
    blocked = tmp / "a-file"
    blocked.write_text("not a directory")
    monkeypatch.setenv("MGX_CUDA_KERNEL_CACHE", str(blocked / "cache"))
    monkeypatch.setattr(build, "_MEMO", {})
    assert build.build_cuda_kernels("sm_90a", nvcc=nvcc) == image and _builds(tmp) == 3


@pytest.mark.parametrize("off", ["off", "0", ""])
def test_the_disk_cache_can_be_turned_off(fake_nvcc: tuple[str, Path], monkeypatch: pytest.MonkeyPatch, off: str) -> None:
    nvcc, tmp = fake_nvcc
    monkeypatch.setenv("MGX_CUDA_KERNEL_CACHE", off)
    assert build.cache_dir() is None
    build.build_cuda_kernels("sm_90a", nvcc=nvcc)
    monkeypatch.setattr(build, "_MEMO", {})
    build.build_cuda_kernels("sm_90a", nvcc=nvcc)
    assert _builds(tmp) == 2 and not (tmp / "cache").exists()


def test_default_place_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("MGX_CUDA_KERNEL_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert build.cache_dir() == tmp_path / "mgx" / "cuda-kernels"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert build.cache_dir() == Path(os.path.expanduser("~")) / ".cache" / "mgx" / "cuda-kernels"


def test_a_failing_nvcc_is_reported_and_nothing_is_kept(fake_nvcc: tuple[str, Path]) -> None:
    nvcc, tmp = fake_nvcc
    bad = tmp / "bad-nvcc"
    bad.write_text("#!/bin/sh\nif [ \"$1\" = \"--version\" ]; then echo v; exit 0; fi\necho 'error: no' >&2\nexit 2\n")
    bad.chmod(0o755)
    with pytest.raises(build.CudaBuildError, match="error: no"):
        build.build_cuda_kernels("sm_90a", nvcc=str(bad))
    assert not list((tmp / "cache").glob("*.cubin"))


def test_a_unit_compiled_alone_takes_the_kernels_flags_and_is_not_kept(fake_nvcc: tuple[str, Path],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """``compile_unit`` (a benchmark's own kernels): the kernels' flags for the architecture, a build
    each call, nothing in the cache; without nvcc a CudaBuildError that says so."""
    nvcc, tmp = fake_nvcc
    first = build.compile_unit("__global__ void k() {}", "sm_90a", nvcc=nvcc)
    assert build.compile_unit("__global__ void k() {}", "sm_90a", nvcc=nvcc) == first and _builds(tmp) == 2
    assert first.startswith(b"\x7fELF") and build.gencode("sm_90a").encode() in first and b"-lineinfo" in first
    assert not (tmp / "cache").exists() or not any((tmp / "cache").iterdir())
    monkeypatch.setattr(build, "find_nvcc", lambda: None)
    with pytest.raises(build.CudaBuildError, match="nvcc not found"):
        build.compile_unit("", "sm_90a")
