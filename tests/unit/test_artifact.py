"""The .mgx artifact: round trip, zero-copy loading, integrity checks and robustness to bad files."""

from __future__ import annotations

import dataclasses
import random
import struct
from collections.abc import Callable
from pathlib import Path

import flatbuffers
import numpy as np
import pytest

from mgx.formats import _fbcodec, _layout, ir
from mgx.formats.artifact import (
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
    describe_artifact,
    load_artifact,
    verify_artifact,
    write_artifact,
)
from mgx.formats.fbs import CudaKernelImage, Generation, Model

ALIGN = _layout.DATA_ALIGN

# One attribute of every kind the format stores.
EVERY_ATTR = {
    "an_int": -7,
    "a_big_int": 1 << 62,
    "a_float": 0.1,
    "a_string": "héllo",
    "a_bool": True,
    "a_false": False,  # the default value: absent from the buffer, must still come back as a bool
    "ints": [1, -2, 3],
    "floats": [0.5, -1e-30, 3.25],
    "strings": ["q", "k", "v"],
    "empty": [],
}


def _random_data(rng: np.random.Generator, dtype: ir.DType, shape: tuple[int, ...]) -> np.ndarray:
    np_dtype = ir.numpy_dtype(dtype)
    if np_dtype.kind == "f":
        return rng.standard_normal(shape).astype(np_dtype)
    info = np.iinfo(np_dtype)
    return rng.integers(info.min, info.max, size=shape, dtype=np_dtype, endpoint=True)


def make_contents(seed: int = 0) -> ArtifactContents:
    """A small model that exercises every field: every dtype, every attr kind, states, golden set."""
    rng = np.random.default_rng(seed)
    shapes = {
        ir.DType.F32: (5, 7),
        ir.DType.F16: (3, 4, 5),
        ir.DType.BF16: (8,),
        ir.DType.I8: (1000,),
        ir.DType.U8: (4097,),  # one byte past a page: the next tensor must still start aligned
        ir.DType.I32: (),  # a scalar
        ir.DType.I64: (0, 3),  # empty
    }
    tensors = {}
    for dtype, shape in shapes.items():
        name = f"w.{dtype.value}"
        tensors[name] = ir.Tensor(name, dtype, shape, _random_data(rng, dtype, shape))
    tensors["w.i8"].scheme, tensors["w.i8"].layout = "int8_rowwise", "tiled_16x32"
    tensors["w.i8"].scheme_params = {"group_size": 128, "symmetric": True, "scale_dtype": "f16", "cols": 1000}
    arch = ir.ArchConfig(
        model_type="llama",
        vocab_size=7,
        hidden_size=5,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        intermediate_size=16,
        max_position=2048,
        rms_norm_eps=1e-6,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_ids=[2, 3],
        pad_token_id=-1,
        extra={"rope_scaling": {"rope_type": "llama3", "factor": 8.0}, "sliding_window": None},
    )
    ops = [
        ir.Op("embedding", ["tokens"], ["h0"], {"weight": "w.f32"}, {}, "model.embed_tokens"),
        ir.Op("rms_norm", ["h0"], ["h1"], {"weight": "w.bf16"}, {"eps": 1e-6, "group": 5}, "model.norm"),
        ir.Op("linear", ["h1"], ["logits"], {"weight": "w.i8", "scales": "w.f16"}, dict(EVERY_ATTR), ""),
    ]
    states = [
        ir.StateSpec(0, "kv", num_kv_heads=1, head_dim=4),
        ir.StateSpec(1, "recurrent", shape=(2, 4, 4)),
    ]
    golden = GoldenSet(
        cases=[
            GoldenCase("Hello", False, [1, 5, 6], [4, 4, 2], [12.5, 11.25, -3.0]),
            GoldenCase("What is 2+2?", True, [1, 3], [], []),
        ],
        logit_atol=0.05,
    )
    return ArtifactContents(
        graph=ir.Graph(arch, ops, tensors, states),
        tokenizer_json='{"version": "1.0", "model": {"type": "BPE", "vocab": {"a": 0, "é": 1}}}' * 20,
        fingerprint=Fingerprint("sha256:abc", "sha256:def", "bf16", "int8", "cpu"),
        chat_template="{% for m in messages %}{{ m.content }}{% endfor %}",
        generation=GenerationDefaults(
            temperature=0.7, top_p=0.9, top_k=50, max_new_tokens=64, stop_token_ids=[9]
        ),
        passes=[
            PassRecord("fuse_qkv", {"enabled": True}, "fused 2 triples"),
            PassRecord("fold_norm", {}, ""),
        ],
        golden=golden,
        metadata={"license": "apache-2.0", "source": "hf://tiny"},
        autotune={"sm_90": [AutotuneEntry("matmul_w8", "M=1,N=5,K=5", {"BLOCK_M": 16, "num_warps": 4})]},
        cuda_kernels={"sm_90a": b"\x7fELF" + bytes(range(256)) * 3, "sm_80": b"\x00cubin"},
    )


def assert_same_contents(a: ArtifactContents, b: ArtifactContents) -> None:
    """Field-by-field equality; tensors are compared by metadata and bytes (arrays defeat ==)."""
    for f in dataclasses.fields(ArtifactContents):
        if f.name != "graph":
            assert getattr(a, f.name) == getattr(b, f.name), f.name
    ga, gb = a.graph, b.graph
    assert (ga.arch, ga.ops, ga.states, ga.inputs, ga.outputs) == (
        gb.arch,
        gb.ops,
        gb.states,
        gb.inputs,
        gb.outputs,
    )
    assert list(ga.tensors) == list(gb.tensors)
    for ta, tb in zip(ga.tensors.values(), gb.tensors.values(), strict=True):
        for name in ("name", "dtype", "shape", "scheme", "scheme_params", "layout"):
            assert getattr(ta, name) == getattr(tb, name), f"{ta.name}.{name}"
        assert ta.data.dtype == tb.data.dtype and ta.data.shape == tb.data.shape, ta.name
        assert ta.data.tobytes() == tb.data.tobytes(), ta.name


@pytest.fixture
def artifact(tmp_path: Path) -> Path:
    path = tmp_path / "model.mgx"
    write_artifact(path, make_contents())
    return path


def _header(path: Path) -> _layout.Header:
    raw = path.read_bytes()
    return _layout.parse_header(raw, len(raw))


def _with_byte_flipped(src: Path, dst: Path, position: int) -> Path:
    raw = bytearray(src.read_bytes())
    raw[position] ^= 0xFF
    dst.write_bytes(bytes(raw))
    return dst


def _with_new_flatbuffer(src: Path, dst: Path, mutate: Callable[[bytes], bytes]) -> Path:
    """Copy ``src`` with its FlatBuffer replaced by ``mutate(fb)`` and all digests made to match,
    so that only the checks after the digests can catch the change."""
    raw = src.read_bytes()
    h = _layout.parse_header(raw, len(raw))
    fb = mutate(raw[h.fb_offset : h.fb_end])
    header = _layout.Header.for_flatbuffer(len(fb), _layout.digest(fb), h.data_size, h.padding_digest)
    dst.write_bytes(header.prefix(fb) + raw[h.data_offset :])
    return dst


def _with_tensor_slot(src: Path, dst: Path, name: str, **changes: int) -> Path:
    """Copy ``src`` with one tensor table entry's offset or length changed (digests made to match)."""

    def mutate(fb: bytes) -> bytes:
        decoded = _fbcodec.decode_model(fb)
        slots = [dataclasses.replace(s, **changes) if s.name == name else s for s in decoded.slots]
        tokenizer = _fbcodec.compress_tokenizer(decoded.contents.tokenizer_json)
        return _fbcodec.encode_model(decoded.contents, slots, tokenizer)

    return _with_new_flatbuffer(src, dst, mutate)


# ---------------------------------------------------------------------------------------------
# Round trip
# ---------------------------------------------------------------------------------------------


def test_round_trip_keeps_everything(artifact: Path) -> None:
    with load_artifact(artifact) as loaded:
        assert_same_contents(loaded.contents, make_contents())
        attrs = loaded.contents.graph.ops[2].attrs
        assert {name: type(value) for name, value in attrs.items()} == {
            k: type(v) for k, v in EVERY_ATTR.items()
        }
        assert loaded.contents.golden.cases[0].chat is False
        assert loaded.format_version == (FORMAT_MAJOR, FORMAT_MINOR)
        assert loaded.file_size == artifact.stat().st_size
        assert loaded.path == artifact


def test_round_trip_of_optional_fields_left_empty(tmp_path: Path) -> None:
    contents = make_contents()
    contents.chat_template, contents.golden, contents.tokenizer_json = None, None, ""
    contents.generation, contents.passes, contents.metadata, contents.autotune, contents.cuda_kernels = (
        GenerationDefaults(),
        [],
        {},
        {},
        {},
    )
    write_artifact(tmp_path / "m.mgx", contents)
    with load_artifact(tmp_path / "m.mgx") as loaded:
        assert_same_contents(loaded.contents, contents)
    raw, h = (tmp_path / "m.mgx").read_bytes(), _header(tmp_path / "m.mgx")
    assert Model.Model.GetRootAs(raw[h.fb_offset : h.fb_end], 0).CudaKernelsIsNone()  # as a 1.0 file: absent


def test_schema_defaults_match_dataclass_defaults() -> None:
    b = flatbuffers.Builder(64)
    Generation.Start(b)
    b.Finish(Generation.End(b))
    empty = Generation.Generation.GetRootAs(b.Output(), 0)
    defaults = GenerationDefaults()
    for name in _fbcodec._GENERATION_SCALARS:
        assert getattr(empty, _fbcodec._camel(name))() == getattr(defaults, name), name


def test_non_contiguous_data_is_written_in_c_order(tmp_path: Path) -> None:
    contents = make_contents()
    t = contents.graph.tensors["w.f16"]
    t.data = np.asfortranarray(t.data)
    write_artifact(tmp_path / "m.mgx", contents)
    with load_artifact(tmp_path / "m.mgx") as loaded:
        assert np.array_equal(loaded.contents.graph.tensors["w.f16"].data, t.data)


def test_tensors_are_zero_copy_aligned_views_of_the_mapping(artifact: Path) -> None:
    with load_artifact(artifact) as loaded:
        whole = np.frombuffer(loaded._mmap, np.uint8)
        lo, hi = whole.ctypes.data, whole.ctypes.data + whole.size
        for t in loaded.contents.graph.tensors.values():
            ptr = t.data.ctypes.data
            assert lo <= ptr and ptr + t.nbytes <= hi, t.name
            assert ptr % ALIGN == 0, t.name  # the mapping is page-aligned, so file offsets are too
            assert not t.data.flags.writeable and not t.data.flags.owndata
        del whole


def test_file_layout(artifact: Path) -> None:
    raw, h = artifact.read_bytes(), _header(artifact)
    assert raw[:4] == b"MGX1" and struct.unpack_from("<HH", raw, 4) == (FORMAT_MAJOR, FORMAT_MINOR)
    assert h.data_offset % ALIGN == 0 and len(raw) % ALIGN == 0 and h.file_size == len(raw)
    slots = _fbcodec.decode_model(raw[h.fb_offset : h.fb_end]).slots
    assert all(s.offset % ALIGN == 0 for s in slots)
    padding = b"".join(raw[a:b] for a, b, _ in h.padding_regions(sorted(slots, key=lambda s: s.offset)))
    assert padding == bytes(len(padding)) and _layout.digest(padding) == h.padding_digest


def test_views_outlive_close(artifact: Path) -> None:
    loaded = load_artifact(artifact)
    data = loaded.contents.graph.tensors["w.f32"].data
    loaded.close()
    loaded.close()
    assert data.tobytes() == make_contents().graph.tensors["w.f32"].data.tobytes()


def test_writer_is_deterministic(tmp_path: Path) -> None:
    write_artifact(tmp_path / "a.mgx", make_contents())
    write_artifact(tmp_path / "b.mgx", make_contents())
    assert (tmp_path / "a.mgx").read_bytes() == (tmp_path / "b.mgx").read_bytes()


def test_progress_reports_tensor_bytes(tmp_path: Path) -> None:
    calls: list[tuple[int, int]] = []
    contents = make_contents()
    write_artifact(tmp_path / "m.mgx", contents, progress=lambda done, total: calls.append((done, total)))
    total = contents.graph.weight_bytes()
    assert calls[0] == (0, total) and calls[-1] == (total, total)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_describe(artifact: Path) -> None:
    with load_artifact(artifact) as loaded:
        d = describe_artifact(loaded)
    contents = make_contents()
    assert (
        d["tensor_count"] == 7
        and d["golden_cases"] == 2
        and d["format_version"] == f"{FORMAT_MAJOR}.{FORMAT_MINOR}"
    )
    assert d["cuda_kernel_bytes"] == {"sm_90a": 772, "sm_80": 6}
    assert d["bytes_by_dtype"]["u8"] == 4097 and d["bytes_by_scheme"]["int8_rowwise"] == 1000
    assert d["tensor_bytes"] == contents.graph.weight_bytes()
    assert d["fingerprint"]["digest"] == contents.fingerprint.digest()
    assert d["architecture"]["model_type"] == "llama" and d["file_size"] == artifact.stat().st_size
    assert [p["name"] for p in d["passes"]] == ["fuse_qkv", "fold_norm"]


def test_fingerprint_digest_is_short_and_field_sensitive() -> None:
    fp = Fingerprint("a", "b", "bf16", "none", "cpu")
    assert len(fp.digest()) == 16 and fp.digest() == Fingerprint("a", "b", "bf16", "none", "cpu").digest()
    assert fp.digest() != dataclasses.replace(fp, target="cuda-sm90").digest()


def test_newer_minor_version_is_readable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_layout, "FORMAT_MINOR", FORMAT_MINOR + 3)
    monkeypatch.setattr(_fbcodec, "FORMAT_MINOR", FORMAT_MINOR + 3)
    write_artifact(tmp_path / "m.mgx", make_contents())
    monkeypatch.undo()
    with load_artifact(tmp_path / "m.mgx") as loaded:
        assert loaded.format_version == (FORMAT_MAJOR, FORMAT_MINOR + 3)
    verify_artifact(tmp_path / "m.mgx")


def test_longer_header_of_a_newer_minor_version_is_readable(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 1.x reader reads the header fields it knows and finds the digest in the header's last 16 bytes."""
    raw, h = artifact.read_bytes(), _header(artifact)
    decoded = _fbcodec.decode_model(raw[h.fb_offset : h.fb_end])
    monkeypatch.setattr(_fbcodec, "FORMAT_MINOR", 9)
    tokenizer = _fbcodec.compress_tokenizer(decoded.contents.tokenizer_json)
    fb = _fbcodec.encode_model(decoded.contents, decoded.slots, tokenizer)
    header_len = _layout.HEADER_SIZE + 32  # 32 bytes of fields this reader does not know
    data_offset = _layout.align_up(header_len + len(fb), ALIGN)
    padding = data_offset - header_len - len(fb) + h.data_size - sum(s.length for s in decoded.slots)
    known = (b"MGX1", FORMAT_MAJOR, 9, header_len, 0, header_len, len(fb), data_offset, h.data_size)
    fields = struct.pack("<4sHHIIQQQQ16s16s", *known, _layout.digest(fb), _layout.zeros_digest(padding))
    fields += b"\x07" * 32
    prefix = fields + _layout.digest(fields) + fb
    path = tmp_path / "future.mgx"
    path.write_bytes(prefix + bytes(data_offset - len(prefix)) + raw[h.data_offset :])
    with load_artifact(path) as loaded:
        assert loaded.format_version == (FORMAT_MAJOR, 9)
        assert_same_contents(loaded.contents, make_contents())
    assert verify_artifact(path).tensor_count == 7


# ---------------------------------------------------------------------------------------------
# Writer errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda c: setattr(c.graph.tensors["w.f32"], "data", None), "tensor 'w.f32' has no data"),
        (
            lambda c: setattr(c.graph.tensors["w.f32"], "data", np.zeros((5, 7), np.float64)),
            "'w.f32': data is float64",
        ),
        (
            lambda c: setattr(c.graph.tensors["w.f32"], "data", np.zeros((7, 5), np.float32)),
            "declared float32\\[5, 7\\]",
        ),
        (lambda c: c.graph.ops[2].attrs.update(bad={"a": 1}), "op 2 .*attribute 'bad': cannot store dict"),
        (lambda c: c.graph.ops[2].attrs.update(bad=[True, False]), "attribute 'bad': cannot store list"),
        (lambda c: c.graph.ops[2].attrs.update(bad=1 << 64), "attribute 'bad': .* does not fit in 64 bits"),
        (lambda c: c.graph.arch.extra.update(bad=object()), "cannot encode arch.extra as JSON"),
        (lambda c: c.metadata.update(bad=3), "metadata 'bad': keys and values must be str"),
        (lambda c: c.cuda_kernels.update(sm_90=b""), "cuda_kernels: the image for sm_90 is empty"),
        (
            lambda c: c.cuda_kernels.update(hopper=b"x"),
            "cuda_kernels: architecture 'hopper' is not of the form",
        ),
        (
            lambda c: c.cuda_kernels.update(sm_86="code"),
            "cuda_kernels: the image for sm_86 is a str, not bytes",
        ),
    ],
)
def test_writer_rejects_bad_contents(tmp_path: Path, mutate: Callable, message: str) -> None:
    contents = make_contents()
    mutate(contents)
    with pytest.raises(ArtifactError, match=message):
        write_artifact(tmp_path / "m.mgx", contents)
    assert list(tmp_path.iterdir()) == []  # no file, no temporary left behind


def test_failed_write_leaves_the_old_file(artifact: Path) -> None:
    before = artifact.read_bytes()
    contents = make_contents(seed=1)
    contents.graph.ops[0].attrs["bad"] = {"nested": True}
    with pytest.raises(ArtifactError):
        write_artifact(artifact, contents)
    assert artifact.read_bytes() == before
    assert [p.name for p in artifact.parent.iterdir()] == [artifact.name]


def test_write_to_a_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="cannot write"):
        write_artifact(tmp_path / "nope" / "m.mgx", make_contents())


# ---------------------------------------------------------------------------------------------
# Bad files
# ---------------------------------------------------------------------------------------------


def test_empty_file(tmp_path: Path) -> None:
    (tmp_path / "e.mgx").write_bytes(b"")
    for check in (load_artifact, verify_artifact):
        with pytest.raises(ArtifactError, match=r"e\.mgx: empty file"):
            check(tmp_path / "e.mgx")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ArtifactError, match="cannot read: No such file"):
        load_artifact(tmp_path / "absent.mgx")


@pytest.mark.parametrize("where", ["header", "magic", "flatbuffer", "data", "last byte"])
def test_truncated_file(artifact: Path, tmp_path: Path, where: str) -> None:
    h = _header(artifact)
    cut = {
        "magic": 2,
        "header": 50,
        "flatbuffer": h.fb_offset + h.fb_size // 2,
        "data": h.data_offset + 100,
        "last byte": h.file_size - 1,
    }[where]
    path = tmp_path / "cut.mgx"
    path.write_bytes(artifact.read_bytes()[:cut])
    with pytest.raises(ArtifactError, match=f"cut.mgx: truncated: file is {cut} bytes"):
        load_artifact(path)


def test_truncated_message_names_the_expected_end(artifact: Path, tmp_path: Path) -> None:
    h = _header(artifact)
    path = tmp_path / "cut.mgx"
    path.write_bytes(artifact.read_bytes()[: h.data_offset + 100])
    with pytest.raises(ArtifactError, match=f"header says data segment ends at {h.file_size}$"):
        load_artifact(path)


def test_trailing_bytes(artifact: Path, tmp_path: Path) -> None:
    path = tmp_path / "long.mgx"
    path.write_bytes(artifact.read_bytes() + b"\0")
    with pytest.raises(ArtifactError, match="trailing bytes"):
        load_artifact(path)


@pytest.mark.parametrize(
    ("start", "hint"),
    [
        (b"GGUF\x03\x00\x00\x00", "GGUF file"),
        (b"PK\x03\x04\x14\x00", "zip archive"),
        (b"\x28\xb5\x2f\xfd", "zstd"),
    ],
)
def test_wrong_magic(tmp_path: Path, start: bytes, hint: str) -> None:
    path = tmp_path / "other.bin"
    path.write_bytes(start + bytes(5000))
    with pytest.raises(ArtifactError, match=f"other.bin: not an MGX artifact: starts with .*{hint}"):
        load_artifact(path)


def test_newer_major_version_is_refused(artifact: Path, tmp_path: Path) -> None:
    raw = bytearray(artifact.read_bytes())
    struct.pack_into("<HH", raw, 4, FORMAT_MAJOR + 1, 2)
    path = tmp_path / "v2.mgx"
    path.write_bytes(bytes(raw))
    message = f"v2.mgx: was written by format {FORMAT_MAJOR + 1}.2; this reader supports {FORMAT_MAJOR}.x"
    for check in (load_artifact, verify_artifact):
        with pytest.raises(ArtifactError, match=message):
            check(path)


def _with_cuda_images(
    src: Path, dst: Path, images: list[tuple[str | None, bytes]], monkeypatch: pytest.MonkeyPatch
) -> Path:
    """Copy ``src`` with Model.cuda_kernels built from ``images`` past the writer's checks (an arch of
    None leaves the required gpu_arch out); digests made to match."""

    def encode_images(b: flatbuffers.Builder, _: dict[str, bytes]) -> int:
        encoded = []
        for arch, code in images:
            fields = {
                "gpu_arch": None if arch is None else b.CreateString(arch),
                "code": b.CreateByteVector(code),
            }
            encoded.append(_fbcodec._table(b, CudaKernelImage, fields))
        return _fbcodec._vector(b, encoded)

    def mutate(fb: bytes) -> bytes:
        decoded = _fbcodec.decode_model(fb)
        with monkeypatch.context() as m:
            m.setattr(_fbcodec, "_encode_cuda_kernels", encode_images)
            tokenizer = _fbcodec.compress_tokenizer(decoded.contents.tokenizer_json)
            return _fbcodec.encode_model(decoded.contents, decoded.slots, tokenizer)

    return _with_new_flatbuffer(src, dst, mutate)


@pytest.mark.parametrize(
    ("images", "message"),
    [
        ([("sm_90a", b"")], "cuda_kernels: the image for sm_90a is empty"),
        ([("gfx942", b"code")], "cuda_kernels: architecture 'gfx942' is not of the form sm_<number>"),
        ([("sm_90a", b"a"), ("sm_90a", b"b")], "cuda_kernels: two images for sm_90a"),
        ([(None, b"code")], "CudaKernelImage.gpu_arch is missing"),
    ],
)
def test_malformed_cuda_kernel_image_is_refused(
    artifact: Path,
    tmp_path: Path,
    images: list[tuple[str | None, bytes]],
    message: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = _with_cuda_images(artifact, tmp_path / "bad.mgx", images, monkeypatch)
    with pytest.raises(ArtifactError, match=f"bad.mgx: corrupt FlatBuffer: {message}"):
        load_artifact(path)


def test_tensor_offset_past_the_end(artifact: Path, tmp_path: Path) -> None:
    path = _with_tensor_slot(artifact, tmp_path / "bad.mgx", "w.f16", offset=1 << 30)
    with pytest.raises(ArtifactError, match="tensor 'w.f16': .* past the end of the file"):
        load_artifact(path)


def test_tensor_offset_misaligned(artifact: Path, tmp_path: Path) -> None:
    path = _with_tensor_slot(artifact, tmp_path / "bad.mgx", "w.f16", offset=ALIGN + 8)
    with pytest.raises(ArtifactError, match="tensor 'w.f16': offset 4104 is not 4096-aligned"):
        load_artifact(path)


def test_tensor_length_disagrees_with_dtype_and_shape(artifact: Path, tmp_path: Path) -> None:
    path = _with_tensor_slot(artifact, tmp_path / "bad.mgx", "w.f32", length=100)
    with pytest.raises(
        ArtifactError, match=r"tensor 'w.f32': length 100 bytes disagrees with f32\[5, 7\] = 140"
    ):
        load_artifact(path)


def test_overlapping_tensors(artifact: Path, tmp_path: Path) -> None:
    path = _with_tensor_slot(artifact, tmp_path / "bad.mgx", "w.f16", offset=0)
    with pytest.raises(ArtifactError, match="overlap"):
        load_artifact(path)


def test_flipped_byte_in_a_tensor_is_caught_by_verify(artifact: Path, tmp_path: Path) -> None:
    h = _header(artifact)
    slot = next(
        s
        for s in _fbcodec.decode_model(artifact.read_bytes()[h.fb_offset : h.fb_end]).slots
        if s.name == "w.u8"
    )
    path = _with_byte_flipped(artifact, tmp_path / "bad.mgx", h.data_offset + slot.offset + 4000)
    load_artifact(path).close()  # loading does not read tensor bytes
    with pytest.raises(ArtifactError, match="bad.mgx: tensor 'w.u8' checksum mismatch"):
        verify_artifact(path)


@pytest.mark.parametrize("region", ["after the FlatBuffer", "between tensors", "at the end"])
def test_flipped_byte_in_padding_is_caught_by_verify(artifact: Path, tmp_path: Path, region: str) -> None:
    h = _header(artifact)
    position = {
        "after the FlatBuffer": h.fb_end + 3,
        "between tensors": h.data_offset + 2 * ALIGN - 1,
        "at the end": h.file_size - 1,
    }[region]
    path = _with_byte_flipped(artifact, tmp_path / "bad.mgx", position)
    with pytest.raises(ArtifactError, match=r"bad.mgx: padding .* is not zero"):
        verify_artifact(path)


def test_flipped_byte_in_the_flatbuffer_is_caught_by_load(artifact: Path, tmp_path: Path) -> None:
    h = _header(artifact)
    path = _with_byte_flipped(artifact, tmp_path / "bad.mgx", h.fb_offset + h.fb_size // 3)
    with pytest.raises(ArtifactError, match="bad.mgx: FlatBuffer is corrupt: digest mismatch"):
        load_artifact(path)


def test_flipped_byte_in_the_header_is_caught_by_load(artifact: Path, tmp_path: Path) -> None:
    path = _with_byte_flipped(artifact, tmp_path / "bad.mgx", 30)  # inside fb_size
    with pytest.raises(ArtifactError, match="header is corrupt: header digest mismatch"):
        load_artifact(path)


@pytest.mark.parametrize("seed", range(6))
def test_random_garbage(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    body = rng.randbytes(rng.choice([1, 7, 95, 96, 500, 9000]))
    if seed % 2:  # starts like an artifact: magic and a supported version
        body = b"MGX1" + struct.pack("<HH", FORMAT_MAJOR, 0) + body
    path = tmp_path / "garbage.mgx"
    path.write_bytes(body)
    for check in (load_artifact, verify_artifact):
        with pytest.raises(ArtifactError, match="garbage.mgx: "):
            check(path)


def test_garbage_flatbuffer_with_valid_digests(artifact: Path, tmp_path: Path) -> None:
    """Past the digests, the decoder still turns any failure into one ArtifactError."""
    rng = random.Random(0)
    for size in (8, 64, 5000):
        path = _with_new_flatbuffer(
            artifact, tmp_path / "bad.mgx", lambda fb, n=size: b"\x04\0\0\0MGXF" + rng.randbytes(n)
        )
        with pytest.raises(ArtifactError, match="bad.mgx: corrupt FlatBuffer"):
            load_artifact(path)


def test_mutated_flatbuffers_with_valid_digests_never_escape(artifact: Path, tmp_path: Path) -> None:
    """Flip bytes of the FlatBuffer and fix the digests: loading either works or raises ArtifactError."""
    rng = random.Random(1)
    failures = 0
    for _ in range(150):

        def mutate(fb: bytes) -> bytes:
            raw = bytearray(fb)
            for _ in range(rng.randint(1, 3)):
                raw[rng.randrange(len(raw))] = rng.randrange(256)
            return bytes(raw)

        path = _with_new_flatbuffer(artifact, tmp_path / "bad.mgx", mutate)
        try:
            load_artifact(path).close()
        except ArtifactError as e:
            assert "\n" not in str(e)
            failures += 1
    assert failures > 0


def test_every_byte_change_is_caught_by_verify(artifact: Path, tmp_path: Path) -> None:
    """All header bytes and 300 random positions: flipping any one byte fails verification."""
    raw = artifact.read_bytes()
    rng = random.Random(2)
    positions = list(range(_layout.HEADER_SIZE)) + rng.sample(range(_layout.HEADER_SIZE, len(raw)), 300)
    path = tmp_path / "flipped.mgx"
    for position in positions:
        changed = bytearray(raw)
        changed[position] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(changed))
        with pytest.raises(ArtifactError):
            verify_artifact(path)
    verify_artifact(artifact)


def test_verify_reports_what_it_checked(artifact: Path) -> None:
    report = verify_artifact(artifact)
    assert report.bytes_checked == artifact.stat().st_size and report.tensor_count == 7
    assert report.format_version == (FORMAT_MAJOR, FORMAT_MINOR)


# ---------------------------------------------------------------------------------------------
# Performance
# ---------------------------------------------------------------------------------------------


def test_load_does_not_touch_weight_bytes(tmp_path: Path) -> None:
    """~300 tensors and ops, ~50 MB: loading decodes the FlatBuffer and maps the file, nothing more.
    Every tensor is a view into the mapping (no copy), and a weight byte changed after writing goes
    unnoticed by the load (it checksums no tensor) but not by ``verify_artifact``. (No clock: a load
    timed under 0.1 s failed once in a full suite on the 2-core VM, at 0.52 s.)"""
    contents = make_contents()
    shape = (576, 152)  # bf16: 175 KB each, 52 MB in all
    pattern = np.arange(shape[0] * shape[1], dtype=np.uint16).reshape(shape)
    for layer in range(30):
        for i in range(10):
            name = f"layers.{layer}.w{i}"
            contents.graph.tensors[name] = ir.Tensor(name, ir.DType.BF16, shape, pattern)
            attrs = {"in_features": shape[1], "out_features": shape[0], "layer": layer}
            contents.graph.ops.append(
                ir.Op("linear", ["x"], [f"y{layer}.{i}"], {"weight": name}, attrs, name)
            )
    path = tmp_path / "big.mgx"
    write_artifact(path, contents)
    assert len(contents.graph.tensors) > 300 and path.stat().st_size > 50e6
    loaded = load_artifact(path)
    last = loaded.contents.graph.tensors["layers.29.w9"]
    at = last.data.ctypes.data + last.data.nbytes - 2  # the file offset of its last element, from the mapping
    base = np.frombuffer(loaded._mmap, np.uint8).ctypes.data
    for tensor in loaded.contents.graph.tensors.values():
        start = tensor.data.ctypes.data - base
        assert 0 <= start and start + tensor.data.nbytes <= loaded.file_size, tensor.name
    assert last.data[-1, -1] == pattern[-1, -1]
    offset = at - base
    loaded.close()
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\xff\xff")
    loaded = load_artifact(path)
    assert loaded.contents.graph.tensors["layers.29.w9"].data[-1, -1] == 0xFFFF
    loaded.close()
    with pytest.raises(ArtifactError, match="layers.29.w9"):
        verify_artifact(path)
