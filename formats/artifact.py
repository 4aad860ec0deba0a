"""Write, map, verify and describe .mgx artifacts.

A .mgx file is a fixed header, a FlatBuffer (``formats/mgx.fbs``) and a data segment of 4 KiB-aligned
tensors (layout and compatibility rules: ``formats/README.md``). Loading maps the file and hands out
zero-copy numpy views of the tensors, checking only the header and the FlatBuffer's digest;
``verify_artifact`` checks every byte.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import secrets
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

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
from ._fbcodec import Decoded, compress_tokenizer, decode_model, encode_model
from ._layout import (
    CHECKSUM_ALGORITHM,
    DIGEST_SIZE,
    Header,
    TensorSlot,
    check_slots,
    digest,
    parse_header,
    plan_slots,
    zeros_digest,
)

__all__ = [
    "FORMAT_MAJOR",
    "FORMAT_MINOR",
    "ArtifactError",
    "GenerationDefaults",
    "PassRecord",
    "Fingerprint",
    "GoldenCase",
    "GoldenSet",
    "AutotuneEntry",
    "ArtifactContents",
    "LoadedArtifact",
    "VerifyReport",
    "write_artifact",
    "load_artifact",
    "verify_artifact",
    "describe_artifact",
]

PathLike = str | os.PathLike[str]
_CHUNK = 64 << 20  # bytes written (and hashed) per step; also the progress granularity
_HEAD_READ = 1 << 20  # enough for any header parse_header accepts
_MAX_NDIM = 32  # numpy's limit on older versions


@contextmanager
def _about(path: PathLike) -> Iterator[None]:
    """Prefix the messages of ArtifactErrors raised inside with the file's path."""
    try:
        yield
    except ArtifactError as e:
        raise ArtifactError(f"{os.fspath(path)}: {e}") from None


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def write_artifact(
    path: PathLike, contents: ArtifactContents, progress: Callable[[int, int], None] | None = None
) -> None:
    """Write ``contents`` to ``path`` atomically (a temporary file in the same folder, then a rename).

    Every tensor of ``contents.graph`` must hold its data. Tensor bytes are streamed to disk and hashed
    on the way, never gathered in memory; ``progress(bytes_done, bytes_total)`` is called as they go.
    """
    path = Path(path)
    with _about(path):
        tensors = contents.graph.tensors
        slots, data_size = plan_slots((name, _checked_nbytes(t, name)) for name, t in tensors.items())
        tokenizer_zstd = compress_tokenizer(contents.tokenizer_json)
        # Checksums are fixed-size, so this FlatBuffer has the final size: it fixes the data offset.
        fb_size = len(encode_model(contents, slots, tokenizer_zstd))
        layout = Header.for_flatbuffer(fb_size, bytes(DIGEST_SIZE), data_size, bytes(DIGEST_SIZE))
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as f:
                f.seek(layout.data_offset)
                slots = _write_data(f, slots, tensors, data_size, progress)
                fb = encode_model(contents, slots, tokenizer_zstd)
                if len(fb) != fb_size:  # pragma: no cover - would be a FlatBuffers builder change
                    raise ArtifactError(f"internal: FlatBuffer grew from {fb_size} to {len(fb)} bytes")
                padding = layout.file_size - layout.header_len - fb_size - sum(s.length for s in slots)
                header = Header.for_flatbuffer(fb_size, digest(fb), data_size, zeros_digest(padding))
                f.seek(0)
                f.write(header.prefix(fb))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException as e:
            tmp.unlink(missing_ok=True)
            if isinstance(e, OSError):
                raise ArtifactError(f"cannot write: {e.strerror or e}") from None
            raise


def _checked_nbytes(t: ir.Tensor, key: str) -> int:
    """The tensor's byte length, after checking its data matches its declaration."""
    if t.name != key:
        raise ArtifactError(f"graph.tensors[{key!r}] is named {t.name!r}")
    if t.data is None:
        raise ArtifactError(f"tensor {t.name!r} has no data")
    expected = ir.numpy_dtype(t.dtype)
    if t.data.dtype != expected or tuple(t.data.shape) != t.shape:
        raise ArtifactError(
            f"tensor {t.name!r}: data is {t.data.dtype}{list(t.data.shape)}, declared {expected}{list(t.shape)}"
        )
    return t.nbytes


def _write_data(
    f: BinaryIO,
    slots: list[TensorSlot],
    tensors: dict[str, ir.Tensor],
    data_size: int,
    progress: Callable[[int, int], None] | None,
) -> list[TensorSlot]:
    """Stream the tensors and zero padding from the data segment's start; returns slots with checksums."""
    total, done, pos = sum(s.length for s in slots), 0, 0
    if progress:
        progress(0, total)
    hashed = []
    for slot in slots:
        f.write(bytes(slot.offset - pos))
        # A non-contiguous array is copied here, one tensor at a time, never all at once.
        data = memoryview(np.ascontiguousarray(tensors[slot.name].data).reshape(-1).view(np.uint8))
        h = hashlib.blake2b(digest_size=DIGEST_SIZE)
        for start in range(0, slot.length, _CHUNK):
            chunk = data[start : start + _CHUNK]
            h.update(chunk)
            f.write(chunk)
            done += len(chunk)
            if progress:
                progress(done, total)
        hashed.append(replace(slot, checksum=h.digest()))
        pos = slot.offset + slot.length
    f.write(bytes(data_size - pos))
    return hashed


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


class LoadedArtifact:
    """A mapped artifact: its contents, with tensor data as read-only zero-copy views of the file.

    The mapping stays alive as long as this object or any tensor view does; ``close()`` (or leaving a
    ``with`` block) drops this object's hold on it.
    """

    __slots__ = ("contents", "path", "file_size", "format_version", "load_seconds", "_mmap")

    def __init__(
        self,
        contents: ArtifactContents,
        path: Path,
        file_size: int,
        format_version: tuple[int, int],
        load_seconds: float,
        mapping: mmap.mmap,
    ) -> None:
        self.contents = contents  # the decoded contents; graph.tensors[...].data are views of the file
        self.path = path  # the file it was loaded from
        self.file_size = file_size  # bytes
        self.format_version = format_version  # (major, minor) the file was written with
        self.load_seconds = load_seconds  # wall time load_artifact took
        self._mmap: mmap.mmap | None = mapping

    def close(self) -> None:
        """Release the mapping; views still held elsewhere keep it mapped until they are gone."""
        mapping, self._mmap = self._mmap, None
        if mapping is not None:
            _close_quietly(mapping)

    def __enter__(self) -> LoadedArtifact:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        major, minor = self.format_version
        return f"LoadedArtifact({str(self.path)!r}, format {major}.{minor}, {self.file_size} bytes)"


@dataclass(slots=True)
class _Opened:
    """A mapped file whose header and FlatBuffer digest checked out, and its decoded FlatBuffer."""

    mapping: mmap.mmap
    header: Header
    decoded: Decoded
    slots: list[TensorSlot]  # sorted by offset, checked against the data segment


def _open(path: Path) -> _Opened:
    """Map ``path`` and run every check that does not read tensor bytes. Caller closes the mapping."""
    try:
        with open(path, "rb") as f:
            file_size = os.fstat(f.fileno()).st_size
            head = f.read(_HEAD_READ)
            header = parse_header(head, file_size)
            mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise ArtifactError(f"cannot read: {e.strerror or e}") from None
    try:
        fb = mapping[header.fb_offset : header.fb_end]
        if digest(fb) != header.fb_digest:
            raise ArtifactError(
                f"FlatBuffer is corrupt: digest mismatch over bytes [{header.fb_offset}, {header.fb_end})"
            )
        decoded = decode_model(fb)
        if decoded.version != (header.major, header.minor):
            raise ArtifactError(
                f"FlatBuffer says format {decoded.version[0]}.{decoded.version[1]}, "
                f"the header says {header.major}.{header.minor}"
            )
        slots = check_slots(decoded.slots, header.data_size)
        for tensor, slot in zip(decoded.contents.graph.tensors.values(), decoded.slots, strict=True):
            if len(tensor.shape) > _MAX_NDIM or min(tensor.shape, default=0) < 0:
                raise ArtifactError(
                    f"tensor {tensor.name!r}: shape {list(tensor.shape)} is not a valid shape"
                )
            if slot.length != tensor.nbytes:
                raise ArtifactError(
                    f"tensor {tensor.name!r}: length {slot.length} bytes disagrees with "
                    f"{tensor.dtype.value}{list(tensor.shape)} = {tensor.nbytes} bytes"
                )
    except BaseException:
        mapping.close()
        raise
    return _Opened(mapping, header, decoded, slots)


def load_artifact(path: PathLike) -> LoadedArtifact:
    """Map ``path`` and decode it; tensor data are zero-copy views of the mapping.

    Checks the header, the FlatBuffer's digest, and every tensor's bounds and size; never reads tensor
    bytes (``verify_artifact`` does). Raises ArtifactError naming the first problem.
    """
    start, path = time.perf_counter(), Path(path)
    with _about(path):
        opened = _open(path)
        tensors = opened.decoded.contents.graph.tensors.values()
        try:
            for tensor, slot in zip(tensors, opened.decoded.slots, strict=True):
                tensor.data = _view(opened, tensor, slot)
        except BaseException:
            _close_quietly(opened.mapping)
            raise
    h = opened.header
    seconds = time.perf_counter() - start
    return LoadedArtifact(
        opened.decoded.contents, path, h.file_size, (h.major, h.minor), seconds, opened.mapping
    )


def _view(opened: _Opened, tensor: ir.Tensor, slot: TensorSlot) -> np.ndarray:
    """A read-only, zero-copy view of the tensor's bytes in the mapping."""
    count = slot.length // tensor.dtype.itemsize
    flat = np.frombuffer(
        opened.mapping, ir.numpy_dtype(tensor.dtype), count, opened.header.data_offset + slot.offset
    )
    try:
        return flat.reshape(tensor.shape)
    except ValueError as e:  # e.g. dims whose product overflows although one of them is 0
        raise ArtifactError(f"tensor {tensor.name!r}: cannot map shape {list(tensor.shape)}: {e}") from None


def _close_quietly(mapping: mmap.mmap) -> None:
    """Close ``mapping`` unless views of it are still around (then they keep it alive, safely)."""
    try:
        mapping.close()
    except BufferError:
        pass


# ---------------------------------------------------------------------------------------------
# Verifying
# ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class VerifyReport:
    """What ``verify_artifact`` checked."""

    path: Path  # the file
    format_version: tuple[int, int]  # (major, minor) it was written with
    bytes_checked: int  # bytes covered by a digest or checksum: the whole file
    tensor_count: int  # tensors whose checksum matched
    seconds: float  # wall time of the check


def verify_artifact(path: PathLike) -> VerifyReport:
    """Check every byte of ``path``: header and FlatBuffer digests, each tensor's checksum, and the
    padding (zero, and its digest). Raises ArtifactError naming the first bad region in file order."""
    start, path = time.perf_counter(), Path(path)
    with _about(path):
        opened = _open(path)
        try:
            _verify_data(opened)
        finally:
            opened.mapping.close()
    h = opened.header
    return VerifyReport(path, (h.major, h.minor), h.file_size, len(opened.slots), time.perf_counter() - start)


def _verify_data(opened: _Opened) -> None:
    """Walk the regions after the FlatBuffer in file order: padding must be zero, tensors must hash."""
    if opened.decoded.checksum_algorithm != CHECKSUM_ALGORITHM:
        raise ArtifactError(
            f"tensor checksums use {opened.decoded.checksum_algorithm!r}; this reader knows {CHECKSUM_ALGORITHM!r}"
        )
    h, mapping = opened.header, opened.mapping
    padding = hashlib.blake2b(digest_size=DIGEST_SIZE)
    regions = [(start, end, where, None) for start, end, where in h.padding_regions(opened.slots)]
    regions += [(h.data_offset + s.offset, h.data_offset + s.offset + s.length, "", s) for s in opened.slots]
    regions.sort(key=lambda r: r[0])
    for start, end, where, slot in regions:
        if slot is None:
            pad = mapping[start:end]  # small: less than DATA_ALIGN per gap in files written here
            if pad.count(0) != len(pad):
                raise ArtifactError(f"padding {where} (bytes [{start}, {end})) is not zero")
            padding.update(pad)
        elif _checksum(mapping, start, end) != slot.checksum:
            raise ArtifactError(f"tensor {slot.name!r} checksum mismatch (bytes [{start}, {end}))")
    if padding.digest() != h.padding_digest:
        raise ArtifactError("padding digest mismatch")


def _checksum(mapping: mmap.mmap, start: int, end: int) -> bytes:
    with memoryview(mapping) as view, view[start:end] as part:
        return digest(part)


# ---------------------------------------------------------------------------------------------
# Describing
# ---------------------------------------------------------------------------------------------


def describe_artifact(loaded: LoadedArtifact) -> dict[str, Any]:
    """A JSON-ready summary for ``mgxc inspect``: architecture, tensors, passes, fingerprint, sizes."""
    c = loaded.contents
    tensors = c.graph.tensors.values()
    bytes_by_dtype: Counter[str] = Counter()
    bytes_by_scheme: Counter[str] = Counter()
    for t in tensors:
        bytes_by_dtype[t.dtype.value] += t.nbytes
        bytes_by_scheme[t.scheme] += t.nbytes
    return {
        "path": str(loaded.path),
        "format_version": "{}.{}".format(*loaded.format_version),
        "producer": c.producer,
        "file_size": loaded.file_size,
        "architecture": asdict(c.graph.arch),
        "op_count": len(c.graph.ops),
        "tensor_count": len(c.graph.tensors),
        "tensor_bytes": sum(bytes_by_dtype.values()),
        "bytes_by_dtype": dict(bytes_by_dtype),
        "bytes_by_scheme": dict(bytes_by_scheme),
        "passes": [asdict(p) for p in c.passes],
        "fingerprint": {**asdict(c.fingerprint), "digest": c.fingerprint.digest()},
        "golden_cases": 0 if c.golden is None else len(c.golden.cases),
        "generation": asdict(c.generation),
        "autotune_entries": {arch: len(entries) for arch, entries in c.autotune.items()},
        "cuda_kernel_bytes": {arch: len(code) for arch, code in c.cuda_kernels.items()},
        "metadata": dict(c.metadata),
        "load_seconds": loaded.load_seconds,
    }
