"""Encode ``ArtifactContents`` into the FlatBuffer of ``mgx.fbs`` and decode it back.

Tensor bytes are not here: the encoder takes the tensors' slots (offset, length, checksum) from the
writer, and the decoder hands them back for the loader to map.
"""

from __future__ import annotations

import json
import numbers
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import flatbuffers
import numpy as np
import zstandard

from . import ir
from ._contents import (
    FORMAT_MAJOR,
    FORMAT_MINOR,
    ArtifactContents,
    ArtifactError,
    AutotuneEntry,
    Fingerprint,
    GenerationDefaults,
    GoldenCase,
    GoldenSet,
    PassRecord,
)
from ._fbread import Reader, Table
from ._layout import CHECKSUM_ALGORITHM, TensorSlot
from .fbs import (
    Arch,
    Attr,
    AttrKind,
    AutotuneTable,
    CudaKernelImage,
    DType,
    Generation,
    KeyValue,
    Model,
    Op,
    Program,
    Tokenizer,
    WeightRef,
)
from .fbs import AutotuneEntry as FbAutotuneEntry
from .fbs import Fingerprint as FbFingerprint
from .fbs import GoldenCase as FbGoldenCase
from .fbs import GoldenSet as FbGoldenSet
from .fbs import PassRecord as FbPassRecord
from .fbs import StateSpec as FbStateSpec
from .fbs import Tensor as FbTensor

FILE_IDENTIFIER = b"MGXF"  # Model's file_identifier in mgx.fbs
TOKENIZER_ZSTD_LEVEL = 10  # tokenizer.json is JSON: level 10 is within a few % of 19 and many times faster
_MAX_TOKENIZER_BYTES = 1 << 30  # a larger json_size is corruption

_DTYPE_TO_FB = {d: getattr(DType.DType, d.name) for d in ir.DType}
_DTYPE_FROM_FB = {code: d for d, code in _DTYPE_TO_FB.items()}
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1

# Fields stored as scalars (or strings) under the same snake_case name in the schema and the dataclass.
_ARCH_SCALARS = (
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "intermediate_size",
    "max_position",
    "rms_norm_eps",
    "rope_theta",
    "tie_word_embeddings",
    "bos_token_id",
    "pad_token_id",
)
_GENERATION_SCALARS = ("temperature", "top_p", "top_k", "max_new_tokens", "repetition_penalty")
_FINGERPRINT_FIELDS = ("source_hash", "tokenizer_hash", "dtype", "quantization", "target", "format_version")
_GPU_ARCH = re.compile(r"sm_\d+[af]?")  # nvcc's names of real GPU architectures: "sm_90a", "sm_80"


def _camel(snake: str) -> str:
    """flatc's Python name for a schema field: "rms_norm_eps" -> "RmsNormEps"."""
    return "".join(part.capitalize() for part in snake.split("_"))


# ---------------------------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------------------------


def compress_tokenizer(tokenizer_json: str) -> bytes:
    """tokenizer.json as the single zstd frame ``Tokenizer.json_zstd`` holds."""
    return zstandard.ZstdCompressor(level=TOKENIZER_ZSTD_LEVEL).compress(tokenizer_json.encode("utf-8"))


def encode_model(contents: ArtifactContents, slots: list[TensorSlot], tokenizer_zstd: bytes) -> bytes:
    """The FlatBuffer for ``contents`` whose tensors lie at ``slots`` (one per tensor, in data order).

    Its size depends on the slots' offsets and lengths but not on the checksums' values, which are
    fixed-size: the writer relies on this to lay the file out before it has hashed the tensors.
    """
    try:
        return _encode_model(contents, slots, tokenizer_zstd)
    except ArtifactError:
        raise
    except (TypeError, ValueError, OverflowError, struct.error) as e:
        raise ArtifactError(f"cannot encode the artifact: {type(e).__name__}: {e}") from None


def _encode_model(contents: ArtifactContents, slots: list[TensorSlot], tokenizer_zstd: bytes) -> bytes:
    b = flatbuffers.Builder(1 << 16)
    g = contents.graph
    fingerprint = {f: b.CreateString(getattr(contents.fingerprint, f)) for f in _FINGERPRINT_FIELDS}
    fields = {  # children are built as the values are evaluated, before the Model table starts
        "format_major": FORMAT_MAJOR,
        "format_minor": FORMAT_MINOR,
        "producer": b.CreateString(contents.producer),
        "checksum_algorithm": b.CreateString(CHECKSUM_ALGORITHM),
        "arch": _encode_arch(b, g.arch),
        "program": _encode_program(b, g),
        "tensors": _vector(b, [_encode_tensor(b, g.tensors[s.name], s) for s in slots]),
        "tokenizer": _encode_tokenizer(b, contents, tokenizer_zstd),
        "generation": _encode_generation(b, contents.generation),
        "passes": _vector(b, [_encode_pass(b, p) for p in contents.passes]),
        "golden": None if contents.golden is None else _encode_golden(b, contents.golden),
        "fingerprint": _table(b, FbFingerprint, fingerprint),
        "autotune": _vector(
            b, [_encode_autotune(b, arch, entries) for arch, entries in contents.autotune.items()]
        ),
        "metadata": _vector(b, [_key_value(b, k, v) for k, v in contents.metadata.items()]),
        "cuda_kernels": _encode_cuda_kernels(b, contents.cuda_kernels),
    }
    b.Finish(_table(b, Model, fields), file_identifier=FILE_IDENTIFIER)
    return bytes(b.Output())


def _table(b: flatbuffers.Builder, module: ModuleType, fields: dict[str, Any]) -> int:
    """Build one table of the generated ``module`` from its fields by schema name; None fields are left out.

    Children (strings, vectors, tables) must already be built: FlatBuffers cannot nest them.
    """
    module.Start(b)
    for name, value in fields.items():
        if value is not None:
            getattr(module, "Add" + _camel(name))(b, value)
    return module.End(b)


def _vector(b: flatbuffers.Builder, offsets: list[int]) -> int:
    """A vector of already-built tables or strings."""
    b.StartVector(4, len(offsets), 4)
    for off in reversed(offsets):
        b.PrependUOffsetTRelative(off)
    return b.EndVector()


def _strings(b: flatbuffers.Builder, items: list[str]) -> int:
    return _vector(b, [b.CreateString(s) for s in items])


def _numbers(b: flatbuffers.Builder, items: Any, dtype: str) -> int:
    """A vector of scalars; ``dtype`` is the little-endian numpy type of the schema's element type."""
    return b.CreateNumpyVector(np.asarray(items, dtype=dtype).reshape(-1))


def _json(b: flatbuffers.Builder, value: Any, what: str) -> int:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError) as e:
        raise ArtifactError(f"cannot encode {what} as JSON: {e}") from None
    return b.CreateString(text)


def _key_value(b: flatbuffers.Builder, key: str, value: str) -> int:
    if not isinstance(key, str) or not isinstance(value, str):
        raise ArtifactError(f"metadata {key!r}: keys and values must be str, got {type(value).__name__}")
    return _table(b, KeyValue, {"key": b.CreateString(key), "value": b.CreateString(value)})


def _encode_arch(b: flatbuffers.Builder, arch: ir.ArchConfig) -> int:
    fields: dict[str, Any] = {
        "model_type": b.CreateString(arch.model_type),
        "eos_token_ids": _numbers(b, arch.eos_token_ids, "<i8"),
        "extra_json": _json(b, arch.extra, "arch.extra"),
    }
    fields.update({name: getattr(arch, name) for name in _ARCH_SCALARS})
    return _table(b, Arch, fields)


def _encode_program(b: flatbuffers.Builder, g: ir.Graph) -> int:
    ops = [_encode_op(b, i, op) for i, op in enumerate(g.ops)]
    states = [
        _table(
            b,
            FbStateSpec,
            {
                "layer": s.layer,
                "kind": b.CreateString(s.kind),
                "num_kv_heads": s.num_kv_heads,
                "head_dim": s.head_dim,
                "shape": _numbers(b, s.shape, "<i8"),
            },
        )
        for s in g.states
    ]
    return _table(
        b,
        Program,
        {
            "ops": _vector(b, ops),
            "inputs": _strings(b, g.inputs),
            "outputs": _strings(b, g.outputs),
            "states": _vector(b, states),
        },
    )


def _encode_op(b: flatbuffers.Builder, index: int, op: ir.Op) -> int:
    where = f"op {index} ({op.kind} from {op.source or '?'})"
    weights = [
        _table(b, WeightRef, {"role": b.CreateString(role), "tensor": b.CreateString(name)})
        for role, name in op.weights.items()
    ]
    return _table(
        b,
        Op,
        {
            "kind": b.CreateString(op.kind),
            "inputs": _strings(b, op.inputs),
            "outputs": _strings(b, op.outputs),
            "weights": _vector(b, weights),
            "attrs": _encode_attrs(b, op.attrs, where),
            "source": b.CreateString(op.source),
        },
    )


def _encode_tensor(b: flatbuffers.Builder, t: ir.Tensor, slot: TensorSlot) -> int:
    return _table(
        b,
        FbTensor,
        {
            "name": b.CreateString(t.name),
            "dtype": _DTYPE_TO_FB[t.dtype],
            "shape": _numbers(b, t.shape, "<i8"),
            "offset": slot.offset,
            "length": slot.length,
            "scheme": b.CreateString(t.scheme),
            "scheme_params": _encode_attrs(b, t.scheme_params, f"tensor {t.name!r} scheme_params"),
            "layout": b.CreateString(t.layout),
            "checksum": b.CreateByteVector(slot.checksum),
        },
    )


def _encode_attrs(b: flatbuffers.Builder, attrs: dict[str, Any], where: str) -> int:
    return _vector(b, [_encode_attr(b, name, value, where) for name, value in attrs.items()])


def _encode_attr(b: flatbuffers.Builder, name: str, value: Any, where: str) -> int:
    kind, value = _attr_kind(value, f"{where}: attribute {name!r}")
    field, build = _ATTR_WRITERS[kind]
    return _table(b, Attr, {"name": b.CreateString(name), "kind": kind, field: build(b, value)})


# Which Attr field holds each AttrKind's value, and how to build it (the inverse of _ATTR_READERS).
_ATTR_WRITERS: dict[int, tuple[str, Callable[[flatbuffers.Builder, Any], Any]]] = {
    AttrKind.AttrKind.Int: ("i", lambda b, v: v),
    AttrKind.AttrKind.Float: ("f", lambda b, v: v),
    AttrKind.AttrKind.Bool: ("b", lambda b, v: v),
    AttrKind.AttrKind.String: ("s", lambda b, v: b.CreateString(v)),
    AttrKind.AttrKind.Ints: ("ints", lambda b, v: _numbers(b, v, "<i8")),
    AttrKind.AttrKind.Floats: ("floats", lambda b, v: _numbers(b, v, "<f8")),
    AttrKind.AttrKind.Strings: ("strings", _strings),
}


def _attr_kind(value: Any, what: str) -> tuple[int, Any]:
    """The AttrKind for a Python value, and the value normalised (numpy scalars to Python, tuples to lists)."""
    K = AttrKind.AttrKind
    if isinstance(value, np.ndarray) and value.ndim == 1:
        value = value.tolist()
    if isinstance(value, (bool, np.bool_)):
        return K.Bool, bool(value)
    if isinstance(value, numbers.Integral):
        return K.Int, _int64(int(value), what)
    if isinstance(value, numbers.Real):
        return K.Float, float(value)
    if isinstance(value, str):
        return K.String, value
    if isinstance(value, (list, tuple)):
        items = list(value)
        if all(isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_)) for v in items):
            return K.Ints, [_int64(int(v), what) for v in items]  # an empty list is stored as Ints
        if all(isinstance(v, numbers.Real) and not isinstance(v, (bool, np.bool_)) for v in items):
            return K.Floats, [float(v) for v in items]
        if all(isinstance(v, str) for v in items):
            return K.Strings, items
    raise ArtifactError(
        f"{what}: cannot store {type(value).__name__} {value!r:.60}; "
        "supported: int, float, str, bool and lists of int, float or str"
    )


def _int64(v: int, what: str) -> int:
    if not _INT64_MIN <= v <= _INT64_MAX:
        raise ArtifactError(f"{what}: {v} does not fit in 64 bits")
    return v


def _encode_tokenizer(b: flatbuffers.Builder, contents: ArtifactContents, tokenizer_zstd: bytes) -> int:
    template = contents.chat_template
    return _table(
        b,
        Tokenizer,
        {
            "json_zstd": b.CreateByteVector(tokenizer_zstd),
            "json_size": len(contents.tokenizer_json.encode("utf-8")),
            "chat_template": None if template is None else b.CreateString(template),
        },
    )


def _encode_generation(b: flatbuffers.Builder, gen: GenerationDefaults) -> int:
    fields: dict[str, Any] = {"stop_token_ids": _numbers(b, gen.stop_token_ids, "<i8")}
    fields.update({name: getattr(gen, name) for name in _GENERATION_SCALARS})
    return _table(b, Generation, fields)


def _encode_pass(b: flatbuffers.Builder, p: PassRecord) -> int:
    return _table(
        b,
        FbPassRecord,
        {
            "name": b.CreateString(p.name),
            "options_json": _json(b, p.options, f"pass {p.name!r} options"),
            "summary": b.CreateString(p.summary),
        },
    )


def _encode_golden(b: flatbuffers.Builder, golden: GoldenSet) -> int:
    cases = [
        _table(
            b,
            FbGoldenCase,
            {
                "prompt": b.CreateString(c.prompt),
                "chat": c.chat,
                "prompt_ids": _numbers(b, c.prompt_ids, "<i4"),
                "expected_ids": _numbers(b, c.expected_ids, "<i4"),
                "expected_top1_logits": _numbers(b, c.expected_top1_logits, "<f8"),
            },
        )
        for c in golden.cases
    ]
    return _table(b, FbGoldenSet, {"cases": _vector(b, cases), "logit_atol": golden.logit_atol})


def _encode_autotune(b: flatbuffers.Builder, gpu_arch: str, entries: list[AutotuneEntry]) -> int:
    encoded = [
        _table(
            b,
            FbAutotuneEntry,
            {
                "kernel": b.CreateString(e.kernel),
                "shape_key": b.CreateString(e.shape_key),
                "config_json": _json(b, e.config, f"autotune {e.kernel!r} config"),
            },
        )
        for e in entries
    ]
    return _table(b, AutotuneTable, {"gpu_arch": b.CreateString(gpu_arch), "entries": _vector(b, encoded)})


def _check_cuda_image(gpu_arch: Any, code: Any) -> None:
    """What writer and reader both demand of a CudaKernelImage: an nvcc architecture name, some code."""
    if not isinstance(gpu_arch, str) or _GPU_ARCH.fullmatch(gpu_arch) is None:
        raise ArtifactError(
            f"cuda_kernels: architecture {gpu_arch!r} is not of the form sm_<number>[a|f], e.g. sm_90a"
        )
    if not isinstance(code, bytes):
        raise ArtifactError(f"cuda_kernels: the image for {gpu_arch} is a {type(code).__name__}, not bytes")
    if not code:
        raise ArtifactError(f"cuda_kernels: the image for {gpu_arch} is empty")


def _encode_cuda_kernels(b: flatbuffers.Builder, images: dict[str, bytes]) -> int | None:
    """The images as a vector, or None (the field left out, as a 1.0 writer did) when there are none."""
    if not images:
        return None
    encoded = []
    for gpu_arch, code in images.items():
        _check_cuda_image(gpu_arch, code)
        fields = {"gpu_arch": b.CreateString(gpu_arch), "code": b.CreateByteVector(code)}
        encoded.append(_table(b, CudaKernelImage, fields))
    return _vector(b, encoded)


# ---------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Decoded:
    """A decoded FlatBuffer: contents with tensors not yet mapped, and where their bytes are."""

    contents: ArtifactContents  # graph tensors have data=None
    slots: list[TensorSlot]  # in tensor table order
    version: tuple[int, int]  # (format_major, format_minor) the FlatBuffer records
    checksum_algorithm: str  # Model.checksum_algorithm


def decode_model(buf: bytes) -> Decoded:
    """Decode a FlatBuffer; any failure (bounds, struct, UTF-8, JSON, zstd or a dataclass's validation)
    becomes ArtifactError("corrupt FlatBuffer: ...")."""
    try:
        return _decode_model(Reader(buf).root(Model, FILE_IDENTIFIER))
    except ArtifactError as e:
        raise ArtifactError(f"corrupt FlatBuffer: {e}") from None
    except Exception as e:  # noqa: BLE001 - a corrupt buffer breaks decoding in unforeseeable ways
        message = " ".join(str(e).split())
        raise ArtifactError(f"corrupt FlatBuffer: {type(e).__name__}: {message}") from None


def _decode_model(m: Table) -> Decoded:
    tensors, slots = {}, []
    for t in m.tables("tensors", FbTensor):
        tensor, slot = _decode_tensor(t)
        if tensor.name in tensors:
            raise ArtifactError(f"tensor {tensor.name!r} appears twice in the tensor table")
        tensors[tensor.name] = tensor
        slots.append(slot)
    program = _required_table(m, "program", Program)
    graph = ir.Graph(
        arch=_decode_arch(_required_table(m, "arch", Arch)),
        ops=[_decode_op(op) for op in program.tables("ops", Op)],
        tensors=tensors,
        states=[_decode_state(s) for s in program.tables("states", FbStateSpec)],
        inputs=program.strings("inputs"),
        outputs=program.strings("outputs"),
    )
    fingerprint = _required_table(m, "fingerprint", FbFingerprint)
    tokenizer_json, chat_template = _decode_tokenizer(m.table("tokenizer", Tokenizer))
    golden = m.table("golden", FbGoldenSet)
    contents = ArtifactContents(
        graph=graph,
        tokenizer_json=tokenizer_json,
        fingerprint=Fingerprint(**{f: _required(fingerprint, f) for f in _FINGERPRINT_FIELDS}),
        chat_template=chat_template,
        generation=_decode_generation(m.table("generation", Generation)),
        passes=[_decode_pass(p) for p in m.tables("passes", FbPassRecord)],
        golden=None if golden is None else _decode_golden(golden),
        metadata={_required(kv, "key"): _required(kv, "value") for kv in m.tables("metadata", KeyValue)},
        autotune=dict(_decode_autotune(t) for t in m.tables("autotune", AutotuneTable)),
        cuda_kernels=_decode_cuda_kernels(m.tables("cuda_kernels", CudaKernelImage)),
        producer=m.string("producer") or "",
    )
    version = (m.scalar("format_major"), m.scalar("format_minor"))
    return Decoded(contents, slots, version, m.string("checksum_algorithm") or "")


def _required(t: Table, name: str) -> str:
    value = t.string(name)
    if value is None:
        raise ArtifactError(f"{t.name}.{name} is missing")
    return value


def _required_table(t: Table, name: str, module: ModuleType) -> Table:
    value = t.table(name, module)
    if value is None:
        raise ArtifactError(f"{t.name}.{name} is missing")
    return value


def _decode_json(t: Table, name: str) -> Any:
    text = t.string(name)
    return {} if text is None else json.loads(text)


def _decode_arch(a: Table) -> ir.ArchConfig:
    return ir.ArchConfig(
        model_type=_required(a, "model_type"),
        eos_token_ids=a.numbers("eos_token_ids", "<i8"),
        extra=_decode_json(a, "extra_json"),
        **{name: a.scalar(name) for name in _ARCH_SCALARS},
    )


def _decode_op(o: Table) -> ir.Op:
    return ir.Op(
        kind=_required(o, "kind"),
        inputs=o.strings("inputs"),
        outputs=o.strings("outputs"),
        weights={_required(w, "role"): _required(w, "tensor") for w in o.tables("weights", WeightRef)},
        attrs=_decode_attrs(o, "attrs"),
        source=o.string("source") or "",
    )


def _decode_state(s: Table) -> ir.StateSpec:
    return ir.StateSpec(
        layer=s.scalar("layer"),
        kind=_required(s, "kind"),
        num_kv_heads=s.scalar("num_kv_heads"),
        head_dim=s.scalar("head_dim"),
        shape=tuple(s.numbers("shape", "<i8")),
    )


def _decode_tensor(t: Table) -> tuple[ir.Tensor, TensorSlot]:
    name = _required(t, "name")
    dtype = _DTYPE_FROM_FB.get(t.scalar("dtype"))
    if dtype is None:
        raise ArtifactError(
            f"tensor {name!r} has dtype code {t.scalar('dtype')}, which this reader does not know"
        )
    tensor = ir.Tensor(
        name=name,
        dtype=dtype,
        shape=tuple(t.numbers("shape", "<i8")),
        scheme=_required(t, "scheme"),
        scheme_params=_decode_attrs(t, "scheme_params"),
        layout=_required(t, "layout"),
    )
    return tensor, TensorSlot(name, t.scalar("offset"), t.scalar("length"), t.bytes("checksum"))


def _decode_attrs(t: Table, name: str) -> dict[str, Any]:
    return dict(_decode_attr(a) for a in t.tables(name, Attr))


def _decode_attr(a: Table) -> tuple[str, Any]:
    name, kind = _required(a, "name"), a.scalar("kind")
    read = _ATTR_READERS.get(kind)
    if read is None:
        raise ArtifactError(f"attribute {name!r} has kind code {kind}, which this reader does not know")
    return name, read(a)


# How to read each AttrKind's value (the inverse of _ATTR_WRITERS).
_ATTR_READERS: dict[int, Callable[[Table], Any]] = {
    AttrKind.AttrKind.Int: lambda a: a.scalar("i"),
    AttrKind.AttrKind.Float: lambda a: a.scalar("f"),
    AttrKind.AttrKind.Bool: lambda a: a.scalar("b"),
    AttrKind.AttrKind.String: lambda a: _required(a, "s"),
    AttrKind.AttrKind.Ints: lambda a: a.numbers("ints", "<i8"),
    AttrKind.AttrKind.Floats: lambda a: a.numbers("floats", "<f8"),
    AttrKind.AttrKind.Strings: lambda a: a.strings("strings"),
}


def _decode_tokenizer(t: Table | None) -> tuple[str, str | None]:
    if t is None:
        return "", None
    size, packed = t.scalar("json_size"), t.bytes("json_zstd")
    if size > _MAX_TOKENIZER_BYTES:
        raise ArtifactError(f"tokenizer.json size {size} is implausible")
    if packed and zstandard.frame_content_size(packed) != size:
        raise ArtifactError(f"tokenizer.json's zstd frame does not declare its size {size}")
    raw = zstandard.ZstdDecompressor().decompress(packed) if packed else b""
    if len(raw) != size:
        raise ArtifactError(f"tokenizer.json is {len(raw)} bytes once decompressed, expected {size}")
    return raw.decode("utf-8"), t.string("chat_template")


def _decode_generation(g: Table | None) -> GenerationDefaults:
    if g is None:
        return GenerationDefaults()
    scalars = {name: g.scalar(name) for name in _GENERATION_SCALARS}
    return GenerationDefaults(stop_token_ids=g.numbers("stop_token_ids", "<i8"), **scalars)


def _decode_pass(p: Table) -> PassRecord:
    return PassRecord(
        name=_required(p, "name"), options=_decode_json(p, "options_json"), summary=p.string("summary") or ""
    )


def _decode_golden(g: Table) -> GoldenSet:
    cases = [
        GoldenCase(
            prompt=c.string("prompt") or "",
            chat=c.scalar("chat"),
            prompt_ids=c.numbers("prompt_ids", "<i4"),
            expected_ids=c.numbers("expected_ids", "<i4"),
            expected_top1_logits=c.numbers("expected_top1_logits", "<f8"),
        )
        for c in g.tables("cases", FbGoldenCase)
    ]
    return GoldenSet(cases=cases, logit_atol=g.scalar("logit_atol"))


def _decode_autotune(t: Table) -> tuple[str, list[AutotuneEntry]]:
    entries = [
        AutotuneEntry(
            kernel=_required(e, "kernel"),
            shape_key=_required(e, "shape_key"),
            config=_decode_json(e, "config_json"),
        )
        for e in t.tables("entries", FbAutotuneEntry)
    ]
    return _required(t, "gpu_arch"), entries


def _decode_cuda_kernels(images: list[Table]) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for t in images:
        arch, code = _required(t, "gpu_arch"), bytes(t.bytes("code"))
        _check_cuda_image(arch, code)
        if arch in out:
            raise ArtifactError(f"cuda_kernels: two images for {arch}")
        out[arch] = code
    return out
