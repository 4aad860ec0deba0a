"""Encode ``ArtifactContents`` into the FlatBuffer of ``mgx.fbs`` and decode it back.

Tensor bytes are not here: the encoder takes the tensors' slots (offset, length, checksum) from the
writer, and the decoder hands them back for the loader to map.
"""

from __future__ import annotations

import json
import numbers
import struct
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, TypeVar

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
from ._layout import CHECKSUM_ALGORITHM, TensorSlot
from .fbs import (
    Arch,
    Attr,
    AttrKind,
    AutotuneTable,
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
T = TypeVar("T")

# Fields stored as scalars (or strings) under the same snake_case name in the schema.
_ARCH_SCALARS = (
    "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
    "max_position", "rms_norm_eps", "rope_theta", "tie_word_embeddings", "bos_token_id", "pad_token_id",
)
_GENERATION_SCALARS = ("temperature", "top_p", "top_k", "max_new_tokens", "repetition_penalty")
_FINGERPRINT_FIELDS = ("source_hash", "tokenizer_hash", "dtype", "quantization", "target", "format_version")


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
    autotune = [_encode_autotune(b, arch, entries) for arch, entries in contents.autotune.items()]
    fields = {
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
        "autotune": _vector(b, autotune),
        "metadata": _vector(b, [_key_value(b, k, v) for k, v in contents.metadata.items()]),
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
        _table(b, FbStateSpec, {"layer": s.layer, "kind": b.CreateString(s.kind), "num_kv_heads": s.num_kv_heads,
                                "head_dim": s.head_dim, "shape": _numbers(b, s.shape, "<i8")})
        for s in g.states
    ]
    return _table(b, Program, {"ops": _vector(b, ops), "inputs": _strings(b, g.inputs),
                               "outputs": _strings(b, g.outputs), "states": _vector(b, states)})


def _encode_op(b: flatbuffers.Builder, index: int, op: ir.Op) -> int:
    where = f"op {index} ({op.kind} from {op.source or '?'})"
    weights = [
        _table(b, WeightRef, {"role": b.CreateString(role), "tensor": b.CreateString(name)})
        for role, name in op.weights.items()
    ]
    return _table(b, Op, {
        "kind": b.CreateString(op.kind),
        "inputs": _strings(b, op.inputs),
        "outputs": _strings(b, op.outputs),
        "weights": _vector(b, weights),
        "attrs": _encode_attrs(b, op.attrs, where),
        "source": b.CreateString(op.source),
    })


def _encode_tensor(b: flatbuffers.Builder, t: ir.Tensor, slot: TensorSlot) -> int:
    return _table(b, FbTensor, {
        "name": b.CreateString(t.name),
        "dtype": _DTYPE_TO_FB[t.dtype],
        "shape": _numbers(b, t.shape, "<i8"),
        "offset": slot.offset,
        "length": slot.length,
        "scheme": b.CreateString(t.scheme),
        "scheme_params": _encode_attrs(b, t.scheme_params, f"tensor {t.name!r} scheme_params"),
        "layout": b.CreateString(t.layout),
        "checksum": b.CreateByteVector(slot.checksum),
    })


def _encode_attrs(b: flatbuffers.Builder, attrs: dict[str, Any], where: str) -> int:
    return _vector(b, [_encode_attr(b, name, value, where) for name, value in attrs.items()])


def _encode_attr(b: flatbuffers.Builder, name: str, value: Any, where: str) -> int:
    kind, value = _attr_kind(value, f"{where}: attribute {name!r}")
    fields: dict[str, Any] = {"name": b.CreateString(name), "kind": kind}
    if kind == AttrKind.AttrKind.Int:
        fields["i"] = value
    elif kind == AttrKind.AttrKind.Float:
        fields["f"] = value
    elif kind == AttrKind.AttrKind.Bool:
        fields["b"] = value
    elif kind == AttrKind.AttrKind.String:
        fields["s"] = b.CreateString(value)
    elif kind == AttrKind.AttrKind.Ints:
        fields["ints"] = _numbers(b, value, "<i8")
    elif kind == AttrKind.AttrKind.Floats:
        fields["floats"] = _numbers(b, value, "<f8")
    else:
        fields["strings"] = _strings(b, value)
    return _table(b, Attr, fields)


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
    return _table(b, Tokenizer, {
        "json_zstd": b.CreateByteVector(tokenizer_zstd),
        "json_size": len(contents.tokenizer_json.encode("utf-8")),
        "chat_template": None if template is None else b.CreateString(template),
    })


def _encode_generation(b: flatbuffers.Builder, gen: GenerationDefaults) -> int:
    fields: dict[str, Any] = {"stop_token_ids": _numbers(b, gen.stop_token_ids, "<i8")}
    fields.update({name: getattr(gen, name) for name in _GENERATION_SCALARS})
    return _table(b, Generation, fields)


def _encode_pass(b: flatbuffers.Builder, p: PassRecord) -> int:
    return _table(b, FbPassRecord, {"name": b.CreateString(p.name),
                                    "options_json": _json(b, p.options, f"pass {p.name!r} options"),
                                    "summary": b.CreateString(p.summary)})


def _encode_golden(b: flatbuffers.Builder, golden: GoldenSet) -> int:
    cases = [
        _table(b, FbGoldenCase, {
            "prompt": b.CreateString(c.prompt),
            "chat": c.chat,
            "prompt_ids": _numbers(b, c.prompt_ids, "<i4"),
            "expected_ids": _numbers(b, c.expected_ids, "<i4"),
            "expected_top1_logits": _numbers(b, c.expected_top1_logits, "<f8"),
        })
        for c in golden.cases
    ]
    return _table(b, FbGoldenSet, {"cases": _vector(b, cases), "logit_atol": golden.logit_atol})


def _encode_autotune(b: flatbuffers.Builder, gpu_arch: str, entries: list[AutotuneEntry]) -> int:
    encoded = [
        _table(b, FbAutotuneEntry, {"kernel": b.CreateString(e.kernel), "shape_key": b.CreateString(e.shape_key),
                                    "config_json": _json(b, e.config, f"autotune {e.kernel!r} config")})
        for e in entries
    ]
    return _table(b, AutotuneTable, {"gpu_arch": b.CreateString(gpu_arch), "entries": _vector(b, encoded)})


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
    """Decode a FlatBuffer; any failure (of flatbuffers, struct, UTF-8, zstd or a dataclass's
    validation) becomes ArtifactError("corrupt FlatBuffer: ...")."""
    try:
        return _Decoder(buf).model()
    except ArtifactError as e:
        raise ArtifactError(f"corrupt FlatBuffer: {e}") from None
    # Any exception at all: a corrupt buffer breaks the generated accessors in unforeseeable ways.
    except Exception as e:  # noqa: BLE001
        message = " ".join(str(e).split())
        raise ArtifactError(f"corrupt FlatBuffer: {type(e).__name__}: {message}") from None


class _Decoder:
    """Reads one FlatBuffer; charges every vector and string to a byte budget the buffer's size,
    so that a crafted buffer whose vectors alias each other cannot make decoding run for ages."""

    def __init__(self, buf: bytes) -> None:
        self.buf = buf
        self.budget = len(buf)

    def _spend(self, n: int) -> None:
        self.budget -= n
        if self.budget < 0:
            raise ArtifactError(f"its vectors and strings add up to more than its {len(self.buf)} bytes")

    def each(self, count: int, get: Callable[[int], T]) -> list[T]:
        """Items 0..count-1 of a vector of tables or strings."""
        self._spend(4 * count)
        return [get(i) for i in range(count)]

    def text(self, raw: bytes | None, what: str) -> str:
        """A required string."""
        if raw is None:
            raise ArtifactError(f"{what} is missing")
        self._spend(len(raw))
        return raw.decode("utf-8")

    def optional_text(self, raw: bytes | None) -> str | None:
        return None if raw is None else self.text(raw, "")

    def texts(self, count: int, get: Callable[[int], bytes]) -> list[str]:
        return [self.text(raw, "a list item") for raw in self.each(count, get)]

    def numbers(self, array: np.ndarray | int) -> list:
        """A vector of scalars (the generated ``...AsNumpy()`` returns 0 when the vector is absent)."""
        if isinstance(array, int):
            return []
        self._spend(array.nbytes)
        return array.tolist()

    def json(self, raw: bytes | None) -> Any:
        return {} if raw is None else json.loads(self.text(raw, ""))

    # -- tables --------------------------------------------------------------------------------

    def model(self) -> Decoded:
        if not Model.Model.ModelBufferHasIdentifier(self.buf, 0):
            raise ArtifactError(f"file identifier is not {FILE_IDENTIFIER!r}")
        m = Model.Model.GetRootAs(self.buf, 0)
        if m.Arch() is None or m.Program() is None or m.Fingerprint() is None:
            raise ArtifactError("arch, program or fingerprint is missing")
        tensors, slots = {}, []
        for t in self.each(m.TensorsLength(), m.Tensors):
            tensor, slot = self.tensor(t)
            if tensor.name in tensors:
                raise ArtifactError(f"tensor {tensor.name!r} appears twice in the tensor table")
            tensors[tensor.name] = tensor
            slots.append(slot)
        program = m.Program()
        graph = ir.Graph(
            arch=self.arch(m.Arch()),
            ops=self.each(program.OpsLength(), lambda i: self.op(program.Ops(i))),
            tensors=tensors,
            states=self.each(program.StatesLength(), lambda i: self.state(program.States(i))),
            inputs=self.texts(program.InputsLength(), program.Inputs),
            outputs=self.texts(program.OutputsLength(), program.Outputs),
        )
        tokenizer_json, chat_template = self.tokenizer(m.Tokenizer())
        fp = m.Fingerprint()
        contents = ArtifactContents(
            graph=graph,
            tokenizer_json=tokenizer_json,
            fingerprint=Fingerprint(
                **{f: self.text(getattr(fp, _camel(f))(), f"fingerprint.{f}") for f in _FINGERPRINT_FIELDS}
            ),
            chat_template=chat_template,
            generation=self.generation(m.Generation()),
            passes=self.each(m.PassesLength(), lambda i: self.pass_record(m.Passes(i))),
            golden=None if m.Golden() is None else self.golden(m.Golden()),
            metadata=dict(self.each(m.MetadataLength(), lambda i: self.key_value(m.Metadata(i)))),
            autotune=dict(self.each(m.AutotuneLength(), lambda i: self.autotune(m.Autotune(i)))),
            producer=self.optional_text(m.Producer()) or "",
        )
        algorithm = self.optional_text(m.ChecksumAlgorithm()) or ""
        return Decoded(contents, slots, (m.FormatMajor(), m.FormatMinor()), algorithm)

    def arch(self, a: Any) -> ir.ArchConfig:
        return ir.ArchConfig(
            model_type=self.text(a.ModelType(), "arch.model_type"),
            eos_token_ids=self.numbers(a.EosTokenIdsAsNumpy()),
            extra=self.json(a.ExtraJson()),
            **{name: getattr(a, _camel(name))() for name in _ARCH_SCALARS},
        )

    def op(self, o: Any) -> ir.Op:
        weights = self.each(o.WeightsLength(), o.Weights)
        return ir.Op(
            kind=self.text(o.Kind(), "op kind"),
            inputs=self.texts(o.InputsLength(), o.Inputs),
            outputs=self.texts(o.OutputsLength(), o.Outputs),
            weights={self.text(w.Role(), "weight role"): self.text(w.Tensor(), "weight tensor") for w in weights},
            attrs=self.attrs(o.AttrsLength(), o.Attrs),
            source=self.optional_text(o.Source()) or "",
        )

    def state(self, s: Any) -> ir.StateSpec:
        return ir.StateSpec(layer=s.Layer(), kind=self.text(s.Kind(), "state kind"), num_kv_heads=s.NumKvHeads(),
                            head_dim=s.HeadDim(), shape=tuple(self.numbers(s.ShapeAsNumpy())))

    def tensor(self, t: Any) -> tuple[ir.Tensor, TensorSlot]:
        name = self.text(t.Name(), "tensor name")
        dtype = _DTYPE_FROM_FB.get(t.Dtype())
        if dtype is None:
            raise ArtifactError(f"tensor {name!r} has dtype code {t.Dtype()}, which this reader does not know")
        tensor = ir.Tensor(
            name=name,
            dtype=dtype,
            shape=tuple(self.numbers(t.ShapeAsNumpy())),
            scheme=self.text(t.Scheme(), f"tensor {name!r} scheme"),
            scheme_params=self.attrs(t.SchemeParamsLength(), t.SchemeParams),
            layout=self.text(t.Layout(), f"tensor {name!r} layout"),
        )
        checksum = t.ChecksumAsNumpy()
        checksum = b"" if isinstance(checksum, int) else checksum.tobytes()
        return tensor, TensorSlot(name, t.Offset(), t.Length(), checksum)

    def attrs(self, count: int, get: Callable[[int], Any]) -> dict[str, Any]:
        return dict(self.attr(a) for a in self.each(count, get))

    def attr(self, a: Any) -> tuple[str, Any]:
        name, kind, K = self.text(a.Name(), "attribute name"), a.Kind(), AttrKind.AttrKind
        if kind == K.Int:
            return name, a.I()
        if kind == K.Float:
            return name, a.F()
        if kind == K.Bool:
            return name, a.B()
        if kind == K.String:
            return name, self.text(a.S(), f"attribute {name!r} value")
        if kind == K.Ints:
            return name, self.numbers(a.IntsAsNumpy())
        if kind == K.Floats:
            return name, self.numbers(a.FloatsAsNumpy())
        if kind == K.Strings:
            return name, self.texts(a.StringsLength(), a.Strings)
        raise ArtifactError(f"attribute {name!r} has kind code {kind}, which this reader does not know")

    def tokenizer(self, t: Any) -> tuple[str, str | None]:
        if t is None:
            return "", None
        size, packed = t.JsonSize(), t.JsonZstdAsNumpy()
        if size > _MAX_TOKENIZER_BYTES:
            raise ArtifactError(f"tokenizer.json size {size} is implausible")
        data = b"" if isinstance(packed, int) else packed.tobytes()
        self._spend(len(data))
        if data and zstandard.frame_content_size(data) != size:
            raise ArtifactError(f"tokenizer.json frame does not declare its size {size}")
        raw = zstandard.ZstdDecompressor().decompress(data, max_output_size=size) if data else b""
        if len(raw) != size:
            raise ArtifactError(f"tokenizer.json is {len(raw)} bytes once decompressed, expected {size}")
        return raw.decode("utf-8"), self.optional_text(t.ChatTemplate())

    def generation(self, g: Any) -> GenerationDefaults:
        if g is None:
            return GenerationDefaults()
        scalars = {name: getattr(g, _camel(name))() for name in _GENERATION_SCALARS}
        return GenerationDefaults(stop_token_ids=self.numbers(g.StopTokenIdsAsNumpy()), **scalars)

    def pass_record(self, p: Any) -> PassRecord:
        return PassRecord(name=self.text(p.Name(), "pass name"), options=self.json(p.OptionsJson()),
                          summary=self.optional_text(p.Summary()) or "")

    def golden(self, g: Any) -> GoldenSet:
        def case(c: Any) -> GoldenCase:
            return GoldenCase(
                prompt=self.optional_text(c.Prompt()) or "",
                chat=c.Chat(),
                prompt_ids=self.numbers(c.PromptIdsAsNumpy()),
                expected_ids=self.numbers(c.ExpectedIdsAsNumpy()),
                expected_top1_logits=self.numbers(c.ExpectedTop1LogitsAsNumpy()),
            )

        return GoldenSet(cases=self.each(g.CasesLength(), lambda i: case(g.Cases(i))), logit_atol=g.LogitAtol())

    def key_value(self, kv: Any) -> tuple[str, str]:
        return self.text(kv.Key(), "metadata key"), self.text(kv.Value(), "metadata value")

    def autotune(self, t: Any) -> tuple[str, list[AutotuneEntry]]:
        def entry(e: Any) -> AutotuneEntry:
            return AutotuneEntry(kernel=self.text(e.Kernel(), "autotune kernel"),
                                 shape_key=self.text(e.ShapeKey(), "autotune shape key"),
                                 config=self.json(e.ConfigJson()))

        return self.text(t.GpuArch(), "autotune gpu_arch"), self.each(t.EntriesLength(), lambda i: entry(t.Entries(i)))
