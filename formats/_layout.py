"""The byte layout of a .mgx file: fixed header, FlatBuffer, data segment, padding and digests.

See formats/README.md for the picture. Everything here is plain bytes and integers; the FlatBuffer's
contents are ``_fbcodec``'s business.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable
from dataclasses import dataclass

from ._contents import FORMAT_MAJOR, FORMAT_MINOR, ArtifactError

MAGIC = b"MGX1"
DATA_ALIGN = 4096  # the data segment and every tensor start on this boundary (a page on common hosts)
FLATBUFFER_ALIGN = 16  # the FlatBuffer's start, so a C reader can access its scalars in place
DIGEST_SIZE = 16  # bytes of every digest in the file: hashlib.blake2b(digest_size=16)
CHECKSUM_ALGORITHM = "blake2b-128"  # the name Model.checksum_algorithm records for DIGEST_SIZE blake2b

# Header fields before the header digest, all little-endian:
# magic, major, minor, header_len, flags, fb_offset, fb_size, data_offset, data_size, fb_digest, padding_digest
_FIELDS = struct.Struct("<4sHHIIQQQQ16s16s")
HEADER_SIZE = _FIELDS.size + DIGEST_SIZE  # 96 bytes in format 1.0; the header digest is its last 16
_MAX_HEADER_SIZE = 1 << 20  # a larger header_len is corruption, not a future format

# What a file that is not an MGX artifact usually is, by its first bytes (for the error message).
_KNOWN_MAGICS = {
    b"GGUF": "a GGUF file; compile it with `mgxc compile` first",
    b"PK\x03\x04": "a zip archive (a PyTorch checkpoint?)",
    b"\x28\xb5\x2f\xfd": "a zstd frame; unpack a .mgx.zst before loading it",
    b"\x7fELF": "an ELF binary",
}


def digest(data: bytes | memoryview) -> bytes:
    """The 16-byte blake2b digest used for the header, the FlatBuffer, padding and tensor checksums."""
    return hashlib.blake2b(data, digest_size=DIGEST_SIZE).digest()


def zeros_digest(n: int) -> bytes:
    """``digest(bytes(n))`` without allocating ``n`` bytes at once."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    chunk = bytes(min(n, 1 << 20))
    while n > 0:
        h.update(chunk[:n])
        n -= len(chunk)
    return h.digest()


def align_up(n: int, alignment: int) -> int:
    """The smallest multiple of ``alignment`` that is >= ``n``."""
    return -(-n // alignment) * alignment


@dataclass(frozen=True, slots=True)
class TensorSlot:
    """Where one tensor's bytes are in the data segment, and their checksum."""

    name: str  # tensor name
    offset: int  # from the start of the data segment; a multiple of DATA_ALIGN
    length: int  # bytes
    checksum: bytes  # digest() of the bytes


def plan_slots(named_lengths: Iterable[tuple[str, int]]) -> tuple[list[TensorSlot], int]:
    """Lay tensors out back to back, each DATA_ALIGN-aligned; returns the slots (zero checksums) and
    the data segment size (padded to DATA_ALIGN)."""
    slots, end = [], 0
    for name, length in named_lengths:
        offset = align_up(end, DATA_ALIGN)
        slots.append(TensorSlot(name, offset, length, bytes(DIGEST_SIZE)))
        end = offset + length
    return slots, align_up(end, DATA_ALIGN)


@dataclass(frozen=True, slots=True)
class Header:
    """The fixed header at the start of the file."""

    major: int  # format MAJOR version
    minor: int  # format MINOR version
    header_len: int  # bytes of the header, digest included
    flags: int  # bit field; none are defined in 1.x, writers write 0, readers ignore unknown bits
    fb_offset: int  # file offset of the FlatBuffer
    fb_size: int  # bytes of the FlatBuffer
    data_offset: int  # file offset of the data segment; a multiple of DATA_ALIGN
    data_size: int  # bytes of the data segment, trailing padding included; a multiple of DATA_ALIGN
    fb_digest: bytes  # digest() of the FlatBuffer
    padding_digest: bytes  # digest() of all padding bytes, concatenated in file order

    @classmethod
    def for_flatbuffer(cls, fb_size: int, fb_digest: bytes, data_size: int, padding_digest: bytes) -> Header:
        """The current version's header for a FlatBuffer of ``fb_size`` bytes and a data segment."""
        fb_offset = align_up(HEADER_SIZE, FLATBUFFER_ALIGN)
        data_offset = align_up(fb_offset + fb_size, DATA_ALIGN)
        return cls(
            FORMAT_MAJOR,
            FORMAT_MINOR,
            HEADER_SIZE,
            0,
            fb_offset,
            fb_size,
            data_offset,
            data_size,
            fb_digest,
            padding_digest,
        )

    @property
    def fb_end(self) -> int:
        return self.fb_offset + self.fb_size

    @property
    def file_size(self) -> int:
        return self.data_offset + self.data_size

    def pack(self) -> bytes:
        """The header's bytes, digest included (current version's header length only)."""
        fields = _FIELDS.pack(
            MAGIC,
            self.major,
            self.minor,
            self.header_len,
            self.flags,
            self.fb_offset,
            self.fb_size,
            self.data_offset,
            self.data_size,
            self.fb_digest,
            self.padding_digest,
        )
        assert self.header_len == HEADER_SIZE, "pack() writes the current header version only"
        return fields + digest(fields)

    def prefix(self, fb: bytes) -> bytes:
        """Everything before the data segment: header, zero padding, FlatBuffer, zero padding."""
        return b"".join(
            (self.pack(), bytes(self.fb_offset - self.header_len), fb, bytes(self.data_offset - self.fb_end))
        )

    def padding_regions(self, slots: list[TensorSlot]) -> list[tuple[int, int, str]]:
        """Every padding byte range ``(start, end, description)`` in file order, empty ones left out.

        ``slots`` must be sorted by offset and not overlap (``check_slots``)."""
        regions = [
            (self.header_len, self.fb_offset, "between the header and the FlatBuffer"),
            (self.fb_end, self.data_offset, "between the FlatBuffer and the data segment"),
        ]
        end, after = self.data_offset, "at the start of the data segment"
        for slot in slots:
            regions.append((end, self.data_offset + slot.offset, after))
            end, after = self.data_offset + slot.offset + slot.length, f"after tensor {slot.name!r}"
        regions.append((end, self.file_size, after))
        return [r for r in regions if r[1] > r[0]]


def parse_header(head: bytes, file_size: int) -> Header:
    """Validate the header at the start of a file of ``file_size`` bytes; ``head`` is at least its
    first min(file_size, 1 MiB) bytes. Raises ArtifactError naming the first problem."""
    if file_size == 0:
        raise ArtifactError("empty file (0 bytes); not an MGX artifact")
    if head[:4] != MAGIC:
        if file_size < len(MAGIC) and MAGIC.startswith(head):
            raise ArtifactError(
                f"truncated: file is {file_size} bytes, shorter than the {HEADER_SIZE}-byte header"
            )
        hint = next((f" ({what})" for magic, what in _KNOWN_MAGICS.items() if head.startswith(magic)), "")
        raise ArtifactError(f"not an MGX artifact: starts with {head[:8]!r}{hint}, expected {MAGIC!r}")
    if file_size < 8:
        raise ArtifactError(
            f"truncated: file is {file_size} bytes, shorter than the {HEADER_SIZE}-byte header"
        )
    major, minor = struct.unpack_from("<HH", head, 4)
    if major != FORMAT_MAJOR:
        raise ArtifactError(
            f"was written by format {major}.{minor}; this reader supports {FORMAT_MAJOR}.x "
            f"(up to {FORMAT_MAJOR}.{FORMAT_MINOR})"
        )
    if file_size < HEADER_SIZE:
        raise ArtifactError(
            f"truncated: file is {file_size} bytes, shorter than the {HEADER_SIZE}-byte header"
        )
    _, _, _, header_len, *rest = _FIELDS.unpack_from(head)
    if not HEADER_SIZE <= header_len <= _MAX_HEADER_SIZE:
        raise ArtifactError(f"header is corrupt: header length {header_len} (format 1.0 has {HEADER_SIZE})")
    if header_len > file_size:
        raise ArtifactError(
            f"truncated: file is {file_size} bytes, header says the header alone is {header_len}"
        )
    if digest(head[: header_len - DIGEST_SIZE]) != head[header_len - DIGEST_SIZE : header_len]:
        raise ArtifactError("header is corrupt: header digest mismatch")
    header = Header(major, minor, header_len, *rest)
    _check_regions(header, file_size)
    return header


def _check_regions(h: Header, file_size: int) -> None:
    """The header's regions are in order and aligned, and the file is exactly as long as they say."""
    problems = [
        (
            h.fb_offset < h.header_len,
            f"FlatBuffer offset {h.fb_offset} is inside the {h.header_len}-byte header",
        ),
        (h.fb_offset % 8 != 0, f"FlatBuffer offset {h.fb_offset} is not 8-aligned"),
        (h.fb_size < 8, f"FlatBuffer size {h.fb_size} is too small for a root offset and identifier"),
        (h.data_offset % DATA_ALIGN != 0, f"data segment offset {h.data_offset} is not {DATA_ALIGN}-aligned"),
        (h.data_size % DATA_ALIGN != 0, f"data segment size {h.data_size} is not a multiple of {DATA_ALIGN}"),
        (
            h.data_offset < h.fb_end,
            f"data segment at {h.data_offset} overlaps the FlatBuffer ending at {h.fb_end}",
        ),
    ]
    for bad, message in problems:
        if bad:
            raise ArtifactError(f"header is inconsistent: {message}")
    if file_size < h.fb_end:
        raise ArtifactError(
            f"truncated: file is {file_size} bytes, header says the FlatBuffer ends at {h.fb_end}"
        )
    if file_size < h.file_size:
        raise ArtifactError(
            f"truncated: file is {file_size} bytes, header says data segment ends at {h.file_size}"
        )
    if file_size > h.file_size:
        raise ArtifactError(
            f"file is {file_size} bytes but the header says it ends at {h.file_size} (trailing bytes)"
        )


def check_slots(slots: list[TensorSlot], data_size: int) -> list[TensorSlot]:
    """Check alignment, bounds and overlaps of the tensor slots; returns them sorted by offset."""
    for s in slots:
        if s.offset % DATA_ALIGN != 0:
            raise ArtifactError(f"tensor {s.name!r}: offset {s.offset} is not {DATA_ALIGN}-aligned")
        if s.offset + s.length > data_size:
            raise ArtifactError(
                f"tensor {s.name!r}: offset {s.offset} + length {s.length} lies past the end of the file "
                f"(the data segment is {data_size} bytes)"
            )
    ordered = sorted(slots, key=lambda s: (s.offset, s.length))
    for a, b in zip(ordered, ordered[1:], strict=False):
        if a.offset + a.length > b.offset:
            raise ArtifactError(f"tensors {a.name!r} and {b.name!r} overlap in the data segment")
    return ordered
