"""``mgx-run``: run a compiled MGX model (.mgx) from the command line."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])

# Exit codes: 0 ok; 1 a bad request or a golden mismatch; 2 a damaged or unreadable artifact.
EXIT_ERROR = 1
EXIT_ARTIFACT = 2


def _fail(message: str, code: int = EXIT_ERROR) -> None:
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def _user_errors(fn: F) -> F:
    """Turn the errors a user can cause into one ``error: ...`` line and an exit code, not a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from mgx.formats.artifact import ArtifactError

        from .errors import EngineError

        try:
            return fn(*args, **kwargs)
        except ArtifactError as e:
            _fail(str(e), EXIT_ARTIFACT)
        except (EngineError, OSError) as e:
            _fail(str(e))
        except KeyboardInterrupt:
            click.echo("", err=True)
            sys.exit(130)

    return wrapper  # type: ignore[return-value]


_KV_MEMORY_HELP = (
    "KV cache budget: bytes (512MiB, 2GB) or a fraction of available memory (0.3, 30%). "
    "Default: 25% of available memory, capped at what the running sequences could use."
)


def _engine_config(kv_memory: str | None, **kw: Any) -> Any:
    from .config import EngineConfig
    from .errors import EngineError

    try:
        return EngineConfig(kv_memory=kv_memory, **kw)
    except ValueError as e:
        raise EngineError(str(e)) from None


_warm_up_option = click.option(
    "--warm-up",
    is_flag=True,
    help="First run throwaway greedy and sampling requests at each batch size and prompt length the backend "
    "records steps for (cuda: the decode graphs up to --max-num-seqs, the prefill graphs up to "
    "--max-tokens-per-step), so that no request waits for those captures and compiles.",
)


def _warm_up(engine: Any) -> None:
    """``--warm-up``: ``Engine.warm_up``, and a line on stderr of what it ran."""
    backend = engine.runner.backend
    before = backend.graph_stats().get("captures", {})
    sizes, seconds = engine.warm_up()
    click.echo(warm_up_line(sizes, seconds, before, backend.graph_stats().get("captures", {})), err=True)


def warm_up_line(sizes: int, seconds: float, before: dict[str, int], after: dict[str, int]) -> str:
    """What ``--warm-up`` prints: the batch sizes run, the seconds, and the graphs it captured by kind
    (``before`` and ``after``: ``graph_stats()["captures"]`` around it; none where nothing is recorded)."""
    taken = {kind: n - before.get(kind, 0) for kind, n in sorted(after.items()) if n > before.get(kind, 0)}
    line = f"warm-up: {sizes} batch sizes in {seconds:.1f} s"
    if taken:
        line += "; graphs captured: " + ", ".join(f"{kind} {n}" for kind, n in taken.items())
    return line


def _scheduler_options(fn: F) -> F:
    """The KV cache and scheduler options of the commands that serve many requests (bench, serve)."""
    options = [
        click.option("--kv-memory", help=_KV_MEMORY_HELP),
        click.option(
            "--block-size", type=click.IntRange(min=1), default=16, show_default=True, help="Tokens per KV block."
        ),
        click.option(
            "--max-num-seqs", type=click.IntRange(min=1), default=64, show_default=True, help="Most sequences per step."
        ),
        click.option(
            "--max-tokens-per-step",
            type=click.IntRange(min=1),
            default=512,
            show_default=True,
            help="Token budget of a step.",
        ),
        click.option("--no-prefix-cache", is_flag=True, help="Turn prefix caching off."),
    ]
    for option in reversed(options):  # the first listed ends up outermost, as with stacked decorators
        fn = option(fn)
    return fn


def _scheduler_config(
    kv_memory: str | None, block_size: int, max_num_seqs: int, max_tokens_per_step: int, no_prefix_cache: bool
) -> Any:
    """The engine configuration from ``_scheduler_options``' values."""
    return _engine_config(
        kv_memory,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_tokens_per_step=max_tokens_per_step,
        prefix_caching=not no_prefix_cache,
    )


def _backend_options(fn: F) -> F:
    """``--backend`` and ``--threads``, shared by every command that runs a model."""
    fn = click.option(
        "--threads", type=click.IntRange(min=1), help="CPU kernel threads (default: all cores; MGX_NUM_THREADS)."
    )(fn)
    return click.option(
        "--backend",
        type=click.Choice(["auto", "cpu", "cuda", "reference"]),
        default="auto",
        show_default=True,
        help="Where the model runs: cpu (C++ kernels), cuda (Triton kernels on an NVIDIA GPU; needs torch), "
        "reference (numpy, slow; the oracle). auto: cpu when its kernels are built, else reference.",
    )(fn)


def _backend(name: str, threads: int | None) -> str:
    """The backend to run on (``auto`` resolved); ``threads`` reaches the CPU kernels through the environment."""
    from .errors import EngineError

    if threads:  # read by mgx.kernels.cpu when the CPU backend loads it
        os.environ["MGX_NUM_THREADS"] = str(threads)
    if name not in ("auto", "cpu"):
        return name
    try:
        import mgx.kernels.cpu  # noqa: F401
    except ImportError:
        if name == "cpu":
            return name  # the backend says what is missing
        click.echo("note: the C++ CPU kernels are not built; running the slow numpy reference backend", err=True)
        return "reference"
    except ValueError as e:  # a bad MGX_NUM_THREADS or MGX_CPU_ISA (CPUSettingError)
        raise EngineError(str(e)) from None
    return "cpu"


def _model_path(path: str) -> str:
    if not os.path.exists(path):
        _fail(f"no such model file: {path}")
    if not os.path.isfile(path):
        _fail(f"not a file: {path} (expected a compiled .mgx model)")
    return path


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Run a compiled MGX model (a .mgx file made by `mgxc compile`).

    \b
    Examples:
      mgx-run generate model.mgx --prompt "Once upon a time"
      mgx-run generate model.mgx --prompt "What is 2+2?" --chat --temperature 0
      mgx-run check model.mgx          # verify the file and replay its golden outputs
      mgx-run bench model.mgx --num-prompts 64 --prompt-len 16-128 --output-len 32 --shared-prefix 0.5
      mgx-run tune model.mgx           # on the serving GPU: each projection's kernel by the decode step's time

    Unset sampling options use the defaults recorded in the artifact.
    """


@main.command()
@click.argument("model", metavar="MODEL.mgx")
@click.option("-p", "--prompt", required=True, help="Text to continue (or the user message with --chat).")
@click.option("-n", "--max-tokens", type=click.IntRange(min=1), help="Most tokens to generate.")
@click.option("-t", "--temperature", type=click.FloatRange(min=0), help="0 = greedy; higher = more random.")
@click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), help="Nucleus sampling mass.")
@click.option("--top-k", type=click.IntRange(min=0), help="Sample among the K most likely tokens (0 = all).")
@click.option(
    "--repetition-penalty", type=click.FloatRange(min=0, min_open=True), help="> 1 discourages repeats."
)
@click.option("--seed", type=int, help="Random seed: the same seed gives the same output.")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template as a user turn.")
@click.option("--stop", multiple=True, help="Stop when the text contains this string (repeatable).")
@click.option("--kv-memory", help=_KV_MEMORY_HELP)
@_backend_options
@_user_errors
def generate(
    model: str,
    prompt: str,
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    repetition_penalty: float | None,
    seed: int | None,
    chat: bool,
    stop: tuple[str, ...],
    kv_memory: str | None,
    backend: str,
    threads: int | None,
) -> None:
    """Generate text from MODEL.mgx, streaming it to stdout; timings go to stderr."""
    from .engine import Engine, GenerationResult

    engine = Engine(_model_path(model), config=_engine_config(kv_memory), backend=_backend(backend, threads))
    events = engine.generate(
        prompt,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        repetition_penalty=repetition_penalty,
        seed=seed,
        chat=chat,
        stream=True,
        stop=stop,
    )
    click.echo(engine.cache_plan.describe(), err=True)
    for note in (engine.tuning_note, engine.kernels_note):
        if note:
            click.echo(note, err=True)
    result = None
    for event in events:
        if isinstance(event, GenerationResult):
            result = event
        elif event.text:
            click.echo(event.text, nl=False)
            sys.stdout.flush()
    click.echo()
    assert result is not None
    t = result.timings
    click.echo(
        f"load {t.load_s * 1e3:.1f} ms | prompt {result.prompt_tokens} tokens, prefill "
        f"{t.prefill_tokens_per_s:.1f} tok/s | {len(result.token_ids)} tokens generated, decode "
        f"{t.tokens_per_s:.1f} tok/s | finish: {result.finish_reason}",
        err=True,
    )


@main.command()
@click.argument("model", metavar="MODEL.mgx")
@_backend_options
@_user_errors
def check(model: str, backend: str, threads: int | None) -> None:
    """Verify MODEL.mgx and replay its golden set; exit 1 on a mismatch, 2 on a damaged file."""
    from mgx.formats.artifact import verify_artifact

    from .engine import Engine
    from .golden import check_golden

    path = _model_path(model)
    verify_artifact(path)
    click.echo(f"{path}: file ok")
    engine = Engine(path, backend=_backend(backend, threads))
    golden = engine.contents.golden
    if golden is None or not golden.cases:
        _fail(f"{path} has no golden set to replay (compile it with one)")
    report = check_golden(engine, golden)
    for case in report.cases:
        label = f"case {case.index} {case.prompt[:40]!r}" if case.prompt else f"case {case.index}"
        if case.ok:
            click.echo(
                f"{label}: ok ({case.tokens} tokens, max top-1 logit error {case.max_logit_error:.2e})"
            )
        else:
            assert case.divergence is not None
            click.echo(f"{label}: MISMATCH at {case.divergence.describe()}")
    if not report.ok:
        failed = sum(not c.ok for c in report.cases)
        _fail(f"{failed} of {len(report.cases)} golden cases differ (logit atol {report.logit_atol:g})")
    click.echo(f"all {len(report.cases)} golden cases match")


@main.command()
@click.argument("model", metavar="MODEL.mgx")
@click.option(
    "-o", "--out", type=click.Path(dir_okay=False), help="Write the tuned model here (default: over MODEL.mgx)."
)
@click.option(
    "--prompt-len", type=click.IntRange(min=1), default=512, show_default=True, help="Context of the timed steps."
)
@click.option("--rounds", type=click.IntRange(1, 5), default=1, show_default=True, help="Passes over the shapes.")
@click.option(
    "--min-gain",
    type=click.FloatRange(0, 0.5),
    default=0.005,
    show_default=True,
    help="Shortest gain of the step (a fraction) for which a kernel replaces the stored one.",
)
@click.option("--dry-run", is_flag=True, help="Time and report the choices; write nothing.")
@_user_errors
def tune(model: str, out: str | None, prompt_len: int, rounds: int, min_gain: float, dry_run: bool) -> None:
    """Choose each one-row projection's kernel (and the greedy LM head's) by timing the whole decode
    step on this GPU, and store the choices in the model (the runtime reads them; it never tunes at
    start-up)."""
    from pathlib import Path

    import numpy as np

    from .engine import Engine
    from .errors import EngineError

    path = _model_path(model)
    try:
        from .tune import DECODE_STEPS, decode_step_ms, no_gpu_reason, tune_in_graph, write_tunings
    except ImportError as e:
        _fail(f"tune times decode steps on a CUDA GPU through torch and triton: {e}")
    reason = no_gpu_reason()
    if reason:
        _fail(reason)
    engine = Engine(path, backend="cuda", config=_engine_config(None, max_num_seqs=1))
    if prompt_len + DECODE_STEPS > engine.max_position:
        raise EngineError(f"--prompt-len {prompt_len} and {DECODE_STEPS} decode steps exceed the model's "
                          f"{engine.max_position} positions")  # fmt: skip
    click.echo(engine.tuning_note, err=True)
    click.echo(engine.kernels_note, err=True)
    vocab = engine.graph.arch.vocab_size
    prompt = np.random.default_rng(0).integers(0, vocab, prompt_len).tolist()
    report = tune_in_graph(engine, lambda: decode_step_ms(engine, prompt), rounds=rounds, min_gain=min_gain,
                           progress=lambda line: click.echo(line, err=True))  # fmt: skip
    for line in report.lines():
        click.echo(line)
    click.echo(report.summary())
    if dry_run:
        return
    target = Path(out) if out else Path(path)
    write_tunings(Path(path), target, report, {"prompt_len": prompt_len, "rounds": rounds, "min_gain": min_gain})
    click.echo(f"wrote {target}")


@main.command()
@click.argument("model", metavar="MODEL.mgx")
@click.option(
    "--num-prompts", type=click.IntRange(min=1), default=32, show_default=True, help="Requests to send."
)
@click.option(
    "--prompt-len", default="32", show_default=True, help="Prompt tokens: N or a uniform range LOW-HIGH."
)
@click.option("--output-len", default="16", show_default=True, help="Generated tokens: N or LOW-HIGH.")
@click.option(
    "--shared-prefix",
    type=click.FloatRange(0, 1),
    default=0.0,
    show_default=True,
    help="Share of each prompt that is a prefix common to all prompts (exercises the prefix cache).",
)
@click.option(
    "--request-rate",
    default="inf",
    show_default=True,
    help="Requests per second (Poisson arrivals); inf: all at once.",
)
@click.option(
    "--seed", type=int, default=0, show_default=True, help="Seed of the random prompts and arrivals."
)
@_scheduler_options
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False),
    help="Also write the report as JSON here ('-': stdout only).",
)
@_warm_up_option
@_backend_options
@_user_errors
def bench(
    model: str,
    num_prompts: int,
    prompt_len: str,
    output_len: str,
    shared_prefix: float,
    request_rate: str,
    seed: int,
    kv_memory: str | None,
    block_size: int,
    max_num_seqs: int,
    max_tokens_per_step: int,
    no_prefix_cache: bool,
    json_path: str | None,
    warm_up: bool,
    backend: str,
    threads: int | None,
) -> None:
    """Run an offline workload of random prompts on MODEL.mgx; print throughput, latency and cache figures."""
    import json

    from .bench import Workload, format_report, parse_range, run_bench
    from .engine import Engine
    from .errors import EngineError

    try:
        workload = Workload(
            num_prompts=num_prompts,
            prompt_len=parse_range(prompt_len),
            output_len=parse_range(output_len),
            shared_prefix=shared_prefix,
            request_rate=float(request_rate),
            seed=seed,
        )
    except ValueError as e:
        raise EngineError(str(e)) from None
    config = _scheduler_config(kv_memory, block_size, max_num_seqs, max_tokens_per_step, no_prefix_cache)
    engine = Engine(_model_path(model), config=config, backend=_backend(backend, threads))
    click.echo(engine.cache_plan.describe(), err=True)
    for note in (engine.tuning_note, engine.kernels_note):
        if note:
            click.echo(note, err=True)
    if warm_up:
        _warm_up(engine)
    report = run_bench(engine, workload)
    text = json.dumps(report, indent=2)
    if json_path == "-":
        click.echo(text)
        return
    click.echo(format_report(report))
    if json_path:
        with open(json_path, "w") as f:
            f.write(text + "\n")
    else:
        click.echo(text)


@main.command()
@click.argument("model", metavar="MODEL.mgx")
@click.option(
    "--host", default="127.0.0.1", show_default=True, help="Address to bind (0.0.0.0: every interface)."
)
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="Port to bind.")
@click.option(
    "--api-key",
    envvar="MGX_API_KEY",
    help="Require 'Authorization: Bearer KEY' on every endpoint but /health (env: MGX_API_KEY).",
)
@click.option(
    "--served-model-name",
    multiple=True,
    help="Model id clients name (repeatable). Default: the artifact's name, else the file name.",
)
@_scheduler_options
@click.option(
    "--max-pending",
    type=click.IntRange(min=1),
    default=256,
    show_default=True,
    help="Requests held at once (running or queued); more are answered 429 with Retry-After.",
)
@click.option(
    "--shutdown-timeout",
    type=click.FloatRange(min=0),
    default=30.0,
    show_default=True,
    help="On SIGTERM, seconds to let running requests finish before aborting them.",
)
@click.option(
    "--log-level",
    type=click.Choice(["critical", "error", "warning", "info", "debug"]),
    default="info",
    show_default=True,
)
@click.option("--access-log", is_flag=True, help="Log every HTTP request.")
@_warm_up_option
@_backend_options
@_user_errors
def serve(
    model: str,
    host: str,
    port: int,
    api_key: str | None,
    served_model_name: tuple[str, ...],
    kv_memory: str | None,
    block_size: int,
    max_num_seqs: int,
    max_tokens_per_step: int,
    no_prefix_cache: bool,
    max_pending: int,
    shutdown_timeout: float,
    log_level: str,
    access_log: bool,
    warm_up: bool,
    backend: str,
    threads: int | None,
) -> None:
    """Serve MODEL.mgx over an OpenAI-compatible HTTP API until SIGTERM.

    \b
    Endpoints: POST /v1/completions, POST /v1/chat/completions (stream: true for server-sent
    events), GET /v1/models, /health, /metrics (Prometheus), /dashboard (live charts).
    """
    from .engine import Engine
    from .errors import EngineError

    try:
        from .server import ServerConfig
        from .server import serve as run_server
    except ImportError as e:  # a trimmed install
        raise EngineError(
            f"serving needs starlette and uvicorn ({e}); pip install starlette uvicorn"
        ) from None

    path = _model_path(model)
    config = _scheduler_config(kv_memory, block_size, max_num_seqs, max_tokens_per_step, no_prefix_cache)
    engine = Engine(path, config=config, backend=_backend(backend, threads))
    names = served_model_name or (
        engine.contents.metadata.get("name") or os.path.basename(path).removesuffix(".mgx"),
    )
    try:
        server_config = ServerConfig(model_names=tuple(names), api_key=api_key, max_pending=max_pending)
    except ValueError as e:
        raise EngineError(str(e)) from None
    click.echo(engine.cache_plan.describe(), err=True)
    for note in (engine.tuning_note, engine.kernels_note):
        if note:
            click.echo(note, err=True)
    if warm_up:
        _warm_up(engine)
    click.echo(f"serving {names[0]!r} on http://{host}:{port} (dashboard: /dashboard)", err=True)
    run_server(
        engine,
        server_config,
        host=host,
        port=port,
        shutdown_timeout=shutdown_timeout,
        log_level=log_level,
        access_log=access_log,
    )
