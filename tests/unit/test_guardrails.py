"""ruff and the import-linter contracts (the runtime never imports the compiler side) run with the tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _tool(name: str) -> str:
    found = shutil.which(name) or str(Path(sys.executable).parent / name)
    if not Path(found).exists():
        pytest.skip(f"{name} is not installed (pip install -e '.[dev]')")
    return found


def test_import_contracts_hold() -> None:
    res = subprocess.run([_tool("lint-imports")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert "broken" not in res.stdout.lower() or " 0 broken" in res.stdout


def test_ruff_is_clean() -> None:
    res = subprocess.run([_tool("ruff"), "check", "."], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-4000:]


def test_the_repository_folders_are_no_top_level_packages_in_the_tests() -> None:
    """The root is the `mgx` package's folder: on sys.path its kernels/ shadowed the Hugging Face
    `kernels` package that transformers 5 imports (tests/conftest.py takes the root off)."""
    import importlib.util

    for name in ("kernels", "runtime", "compiler", "passes", "formats"):
        spec = importlib.util.find_spec(name)
        origin = Path(spec.origin).resolve() if spec is not None and spec.origin else None
        assert origin is None or ROOT not in origin.parents, f"{name} resolves to {origin}"


@pytest.mark.parametrize("installed", [True, False])
def test_loading_a_source_with_the_root_on_the_path_names_the_shadowed_kernels_package(
    installed: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`python -c` / `-m` run from the root: where the Hugging Face `kernels` package is installed
    (transformers 5 imports it), the compiler says what shadows it before transformers fails deep
    inside; where it is not, nothing is in the way and loading goes on (here: to the missing folder)."""
    import importlib.metadata

    from mgx.compiler.sources import SourceError, load_source
    from mgx.compiler.spec import SourceSpec

    real = importlib.metadata.version

    def version(name: str) -> str:  # the kernels distribution as the case has it, the others as they are
        if name != "kernels":
            return real(name)
        if installed:
            return "0.19.1"
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.delitem(sys.modules, "kernels", raising=False)
    monkeypatch.syspath_prepend(str(ROOT))
    missing = SourceSpec("hf_dir", tmp_path / "nowhere", "nowhere")
    want = "'kernels' package that transformers imports resolves to this project's own folder"
    with pytest.raises(SourceError, match=want if installed else "nowhere: cannot read the model config"):
        load_source(missing)


def test_thread_share_probe() -> None:
    """Run by the test below in a process that looks like one of two pytest-xdist workers: conftest.py
    gave it half of the cores for torch's pool (at least one thread)."""
    if os.environ.get("MGX_TEST_THREAD_PROBE") != "1":
        pytest.skip("a probe for test_xdist_workers_share_the_cores")
    torch = pytest.importorskip("torch")
    share = max(1, (os.cpu_count() or 1) // 2)
    assert os.environ["OMP_NUM_THREADS"] == str(share)
    assert torch.get_num_threads() == share


def test_xdist_workers_share_the_cores() -> None:
    """Under pytest-xdist each worker's torch pool would take a thread a core (N workers, N threads a
    core, busy-waiting against each other: tests/conftest.py has the figures)."""
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "PYTEST_ADDOPTS")}
    env.update(PYTEST_XDIST_WORKER_COUNT="2", MGX_TEST_THREAD_PROBE="1")
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                          f"{Path(__file__).relative_to(ROOT)}::test_thread_share_probe"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0 and "1 passed" in res.stdout, res.stdout[-3000:] + res.stderr[-2000:]
