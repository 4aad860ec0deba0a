"""``mgxc``: the MGX compiler command line."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from mgx.formats.artifact import ArtifactError, describe_artifact, load_artifact, verify_artifact

__all__ = ["main"]


def _fail(message: str, code: int = 1) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mgx", prog_name="mgxc")
def main() -> None:
    """Compile Hugging Face models into .mgx artifacts and look inside them.

    \b
    Typical use:
      mgxc compile examples/smollm2-135m.yaml -o smollm2.mgx   # build an artifact
      mgxc inspect smollm2.mgx                                 # what is inside
      mgxc verify smollm2.mgx                                  # check every byte
    Then serve or run it with `mgx-run` (see `mgx-run --help`).
    """


@main.command()
@click.argument("spec_path", metavar="MODEL.yaml", type=click.Path(dir_okay=False, path_type=Path))
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path),
              help="Where to write the artifact (default: the YAML's `output`, else NAME.mgx here).")
@click.option("--golden-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("golden"),
              show_default=True, help="Folder for golden/<name>.json, the reviewable copy of the golden outputs.")
@click.option("-q", "--quiet", is_flag=True, help="Print only the result line.")
def compile(spec_path: Path, output: Path | None, golden_dir: Path, quiet: bool) -> None:  # noqa: A001
    """Compile the model that MODEL.yaml describes into one .mgx file.

    MODEL.yaml names the source weights (a Hugging Face folder, a GGUF file, or a GGUF file inside an
    installed Python package), the storage dtype, the passes, the target, and the golden prompts whose
    greedy outputs (from Hugging Face transformers) are recorded for `mgx-run check`.
    """
    from ._progress import Progress
    from .pipeline import CompileError, compile_model
    from .spec import SpecError, load_spec

    try:
        spec = load_spec(spec_path)
    except SpecError as exc:
        _fail(str(exc), 2)
    progress = Progress(enabled=not quiet)
    if not quiet:
        click.echo(f"compiling {spec.name} ({spec.source.description}, {spec.dtype}, target {spec.target})", err=True)
    try:
        result = compile_model(spec, output, golden_dir, progress)
    except (CompileError, ArtifactError) as exc:
        _fail(str(exc))
    total = sum(result.timings.values())
    click.echo(f"wrote {result.output} ({result.file_size / 1e6:.1f} MB, {len(result.graph.ops)} ops, "
               f"{len(result.graph.tensors)} tensors) in {total:.1f}s")
    if result.golden_json is not None:
        click.echo(f"golden outputs: {result.golden_json}")


@main.command()
@click.argument("artifact", metavar="MODEL.mgx", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
def inspect(artifact: Path, as_json: bool) -> None:
    """Show the architecture, tensors, bytes by dtype and scheme, passes and fingerprint."""
    try:
        loaded = load_artifact(artifact)
        info = describe_artifact(loaded)
    except ArtifactError as exc:
        _fail(str(exc), 2)
    if as_json:
        click.echo(json.dumps(info, indent=2, default=str))
        return
    for key, value in info.items():
        if isinstance(value, dict):
            click.echo(f"{key}:")
            for k, v in value.items():
                click.echo(f"  {k}: {v}")
        elif isinstance(value, list):
            click.echo(f"{key}: {len(value)}")
            for item in value:
                click.echo(f"  - {item}")
        else:
            click.echo(f"{key}: {value}")


@main.command()
@click.argument("artifact", metavar="MODEL.mgx", type=click.Path(dir_okay=False, path_type=Path))
def verify(artifact: Path) -> None:
    """Check the artifact's integrity: every tensor checksum, the FlatBuffer and all padding."""
    try:
        report = verify_artifact(artifact)
    except ArtifactError as exc:
        _fail(str(exc), 2)
    click.echo(f"ok: {artifact} ({report})")
