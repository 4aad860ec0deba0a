"""mgx.formats: the IR and the .mgx artifact format (schema, writer, mmap reader, fingerprints).

The IR lives in ``mgx.formats.ir``; the artifact API is re-exported here.
"""

from .artifact import (
    FORMAT_MAJOR,
    FORMAT_MINOR,
    ArtifactContents,
    ArtifactError,
    AutotuneEntry,
    Fingerprint,
    GenerationDefaults,
    GoldenCase,
    GoldenSet,
    LoadedArtifact,
    PassRecord,
    VerifyReport,
    describe_artifact,
    load_artifact,
    verify_artifact,
    write_artifact,
)

__all__ = [
    "FORMAT_MAJOR",
    "FORMAT_MINOR",
    "ArtifactContents",
    "ArtifactError",
    "AutotuneEntry",
    "Fingerprint",
    "GenerationDefaults",
    "GoldenCase",
    "GoldenSet",
    "LoadedArtifact",
    "PassRecord",
    "VerifyReport",
    "describe_artifact",
    "load_artifact",
    "verify_artifact",
    "write_artifact",
]
