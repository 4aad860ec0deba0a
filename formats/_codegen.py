"""Regenerate the committed FlatBuffers code in ``formats/fbs/`` from ``formats/mgx.fbs``.

Run ``python -m mgx.formats._codegen`` after editing the schema, with the ``flatc`` pinned in
pyproject's ``dev`` extra on PATH. ``tests/unit/test_schema_codegen.py`` regenerates into a temporary
folder and fails when the committed files differ.

The schema's namespace is ``mgx.formats.fbs``: flatc writes ``mgx/formats/fbs/*.py`` with absolute
imports of that package, so the files are copied as they are, with no rewriting.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

FORMATS_DIR = Path(__file__).resolve().parent
SCHEMA = FORMATS_DIR / "mgx.fbs"
GENERATED_DIR = FORMATS_DIR / "fbs"
FLATC_VERSION = "25.12.19"  # the flatc the committed code was generated with
# Lazy in-method imports (no --python-typing) keep the generated modules free of import cycles.
FLATC_ARGS = ("--python", "--python-no-type-prefix-suffix")
_NAMESPACE_PATH = ("mgx", "formats", "fbs")  # where flatc puts the schema's namespace


def flatc_version(flatc: str = "flatc") -> str:
    """The version ``flatc --version`` reports, e.g. "25.12.19"."""
    out = subprocess.run([flatc, "--version"], check=True, capture_output=True, text=True).stdout
    return out.split()[-1]


def generate(out_dir: Path, flatc: str = "flatc") -> list[Path]:
    """Run flatc on the schema and write the generated modules into ``out_dir``; returns their paths.

    ``out_dir`` is emptied of ``*.py`` files first, so modules of removed schema types disappear.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [flatc, *FLATC_ARGS, "-o", tmp, str(SCHEMA)], check=True, capture_output=True, text=True
        )
        produced = Path(tmp).joinpath(*_NAMESPACE_PATH)
        for old in out_dir.glob("*.py"):
            old.unlink()
        written = []
        for src in sorted(produced.glob("*.py")):
            written.append(Path(shutil.copyfile(src, out_dir / src.name)))
    return written


def main() -> int:
    """Regenerate ``formats/fbs/`` in place."""
    version = flatc_version()
    if version != FLATC_VERSION:
        print(
            f"warning: flatc is {version}, the committed code was generated with {FLATC_VERSION}",
            file=sys.stderr,
        )
    for path in generate(GENERATED_DIR):
        print(path.relative_to(FORMATS_DIR.parent))
    return 0


if __name__ == "__main__":
    sys.exit(main())
