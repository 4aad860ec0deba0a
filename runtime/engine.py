"""The engine: continuous batching over a paged KV cache.

One step (``Engine.step``) is: schedule (which sequences, how many tokens each, which blocks) ->
run the model on that packed batch -> sample, append, stream, free. Requests join with
``add_request`` at any step and leave when they stop or are aborted. ``generate`` is the
one-request convenience; ``AsyncEngine`` and ``LLM`` (``async_engine.py``) drive an engine from a
background thread for many concurrent callers.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from mgx.formats.artifact import ArtifactContents, LoadedArtifact, load_artifact, verify_artifact

from .backend import Backend, create_backend
from .batch import SeqChunk
from .block_manager import BlockManager
from .config import CachePlan, EngineConfig, plan_cache
from .errors import EngineError, PromptError
from .metrics import EngineMetrics, Gauges, RequestMetrics
from .model_runner import LaunchedStep, ModelRunner
from .request import FinishReason, GenerationResult, Request, RequestOutput, TextDelta, Timings
from .sampler import SamplingParams
from .scheduler import Scheduler, SchedulerConfig, StepPlan
from .scheduler import Sequence as Seq
from .tokenizer import Tokenizer

__all__ = ["Engine", "FinishReason", "GenerationResult", "RequestOutput", "TextDelta", "Timings"]


class Engine:
    """Loads an artifact and serves generation requests from it, many at a time.

    Not thread-safe: one thread drives it (``AsyncEngine``/``LLM`` do that for concurrent callers).
    """

    def __init__(
        self,
        source: str | os.PathLike[str] | LoadedArtifact | ArtifactContents,
        *,
        verify: bool = False,
        backend: Backend | str = "reference",
        config: EngineConfig | None = None,
    ) -> None:
        """Map ``source`` (a path; or an artifact already loaded, or in-memory contents).

        ``verify`` checks every checksum of a file first (it reads the whole file once).
        """
        self.load_seconds = 0.0  # time to map the artifact; 0 for contents built in this process
        self._artifact: LoadedArtifact | None = None  # keeps the mapping alive while weights are in use
        if isinstance(source, (str, os.PathLike)):
            if not os.path.isfile(source):
                raise EngineError(f"no such model file: {os.fspath(source)}")
            if verify:
                verify_artifact(source)
            source = load_artifact(source)
        if isinstance(source, LoadedArtifact):
            self._artifact, self.load_seconds = source, float(source.load_seconds)
            source = source.contents
        self.contents = source
        self.graph = source.graph
        arch = self.graph.arch
        self.tokenizer = Tokenizer(
            source.tokenizer_json,
            source.chat_template,
            bos_token_id=arch.bos_token_id,
            eos_token_ids=arch.eos_token_ids,
        )
        self.defaults = source.generation
        self.config = config = config or EngineConfig()
        backend = create_backend(backend, self.graph) if isinstance(backend, str) else backend
        self.tuning_note = backend.use_tunings(source.autotune)  # stored launch configurations (GPU)
        self.kernels_note = backend.use_cuda_kernels(source.cuda_kernels)  # stored native GPU code
        try:
            self.cache_plan: CachePlan = plan_cache(
                config,
                bytes_per_block=backend.kv_bytes_per_block(config.block_size),
                bytes_per_state_slot=backend.state_bytes_per_slot(),
                memory_available=backend.memory_available(),
                max_position=arch.max_position,
            )
        except ValueError as e:
            raise EngineError(str(e)) from None
        self.blocks = BlockManager(
            self.cache_plan.num_blocks,
            config.block_size,
            num_state_slots=self.cache_plan.num_state_slots,
            prefix_caching=config.prefix_caching,
            cache_salt=source.fingerprint.digest().encode(),
        )
        self.runner = ModelRunner(self.graph, backend, blocks=self.blocks)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_tokens_per_step), self.blocks
        )
        self.metrics = EngineMetrics(
            max_num_seqs=config.max_num_seqs,
            max_tokens_per_step=config.max_tokens_per_step,
            gauges=self._gauges,
            window=config.metrics_window,
        )
        self._requests: dict[str, Request] = {}  # unfinished requests by id
        self._by_seq: dict[int, Request] = {}
        self._seq_ids = itertools.count()
        # The greedy decode step launched ahead of the schedule (``_launch_ahead``), not yet adopted.
        self._ahead: LaunchedStep | None = None
        # Steps launched ahead without the requests that end now, and adopted without those that
        # ended since (False: only steps of the same sequences; an A/B switch for benches).
        self.ahead_subsets = True

    @classmethod
    def from_contents(
        cls, contents: ArtifactContents, *, backend: Backend | str = "reference", **kw: Any
    ) -> Engine:
        """An engine over in-memory contents (tests, or an artifact built in this process)."""
        return cls(contents, backend=backend, **kw)

    @property
    def max_position(self) -> int:
        return self.graph.arch.max_position

    # -- requests -------------------------------------------------------------------------------

    def sampling_params(
        self,
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        repetition_penalty: float | None = None,
        seed: int | None = None,
        **options: Any,
    ) -> SamplingParams:
        """Request parameters: the given ones, the artifact's defaults for the rest.

        ``options`` are any other ``SamplingParams`` fields (``stop``, ``min_p``, ``logprobs``, ...).
        """
        d = self.defaults
        try:
            return self._with_stop_ids(
                SamplingParams(
                    max_tokens=d.max_new_tokens if max_tokens is None else max_tokens,
                    temperature=d.temperature if temperature is None else temperature,
                    top_p=d.top_p if top_p is None else top_p,
                    top_k=d.top_k if top_k is None else top_k,
                    repetition_penalty=d.repetition_penalty
                    if repetition_penalty is None
                    else repetition_penalty,
                    seed=seed,
                    **options,
                )
            )
        except (ValueError, TypeError) as e:
            raise EngineError(str(e)) from None

    def encode_prompt(self, prompt: str | Sequence[int], *, chat: bool = False) -> list[int]:
        """Token ids of a prompt: text is encoded (through the chat template with ``chat``), ids kept."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode_prompt(prompt, chat=chat)
        else:
            if chat:
                raise PromptError("chat formatting needs a text prompt, not token ids")
            ids = [int(t) for t in prompt]
        if not ids:
            raise PromptError("the prompt is empty (no tokens to start from)")
        vocab = self.graph.arch.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise PromptError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return ids

    def prepare(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, *, chat: bool = False
    ) -> tuple[list[int], SamplingParams]:
        """Validate a request without touching engine state: its prompt ids and final parameters."""
        params = self.sampling_params() if params is None else self._with_stop_ids(params)
        prompt_ids = self.encode_prompt(prompt, chat=chat)
        self._check_fits(len(prompt_ids), params.max_tokens)
        return prompt_ids, params

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        chat: bool = False,
    ) -> str:
        """Queue a request (it joins the batch at the next step); returns its id.

        ``params`` None takes the artifact's defaults; the model's EOS ids are added to the stop ids
        unless ``params.ignore_eos``.
        """
        prompt_ids, params = self.prepare(prompt, params, chat=chat)
        seq = Seq(next(self._seq_ids), list(prompt_ids), len(prompt_ids))
        request_id = f"req-{seq.seq_id}" if request_id is None else request_id
        if request_id in self._requests:
            raise EngineError(f"request id {request_id!r} is already in use")
        metrics = RequestMetrics(arrival_time=time.perf_counter(), prompt_tokens=len(prompt_ids))
        detok = self.tokenizer.detokenizer(context=prompt_ids)
        req = self._requests[request_id] = Request(request_id, seq, params, detok, metrics)
        self._by_seq[seq.seq_id] = req
        self.scheduler.add(seq)
        self.metrics.on_added()
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output (None if it is not running)."""
        req = self._requests.get(request_id)
        if req is None:
            return None
        self.scheduler.abort(req.seq)
        self._forget(req)
        self.metrics.on_finished(req.metrics, aborted=True)
        return req.abort()

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def warm_up(self) -> tuple[int, float]:
        """Run throwaway requests (two tokens out each) so that no served request waits for the
        captures and kernel compiles they take. First prompts of each length the backend records
        prefill steps for, each twice, alone, with nothing cached before it
        (``Backend.warm_prompt_lengths``: the CUDA backend's prefill-graph buckets up to
        ``max_tokens_per_step``), whole and as the chunk after a step's budget, as far as the context
        and the KV cache hold them; each one's decode step attends over its whole context, up to two
        budgets of tokens (the CUDA backend splits that attention in more pieces: other kernel
        variants, and batch-1 graphs captured with wider block tables). Then the decode graphs are
        dropped (``Backend.drop_graphs``), so that one-token prompts at each batch size the backend
        records decode steps for (``Backend.warm_batch_sizes``; the CUDA backend's graph buckets up
        to ``max_num_seqs``) capture them as narrow as short contexts need: a longer context later
        captures its bucket again, with no compile. Greedy requests, then sampling ones (their steps
        have graphs of their own: logits out instead of the fused argmax). Then the prefix cache and
        the metrics start empty. The engine must be idle. Returns (batch sizes run, seconds)."""
        if self.has_unfinished():
            raise EngineError("warm_up needs an idle engine")
        t0 = time.perf_counter()
        backend = self.runner.backend
        sizes = backend.warm_batch_sizes(self.config.max_num_seqs)
        budget = self.config.max_tokens_per_step
        # Each length whole, then as the chunk after a full step's (a prompt the budget cuts: it
        # attends through the paged prefill kernel, not SDPA, and has graphs of its own); what the
        # context or the KV cache cannot hold is left out.
        prompts = [t for n in backend.warm_prompt_lengths(budget) for t in (n, budget + n)
                   if t + 2 <= self.max_position and self.blocks.fits(t + 2)]  # fmt: skip
        arch = self.graph.arch
        special = {*arch.eos_token_ids, arch.bos_token_id, arch.pad_token_id}
        token = next(t for t in range(arch.vocab_size) if t not in special)
        samplings = [SamplingParams(max_tokens=2, temperature=t, ignore_eos=True, seed=0) for t in (0.0, 1.0)]
        for params in samplings:
            for n in prompts:
                for _ in range(2):  # a bucket's first prompt runs eagerly, its second captures
                    self.reset_prefix_cache()  # the same prompt again: nothing of it cached
                    self.add_request([token] * n, params)
                    self._drain()
        if prompts:
            backend.drop_graphs(("decode",))  # the batch-1 ones are as wide as the prompts' contexts
        for params in samplings:
            for n in sizes:
                for _ in range(n):
                    self.add_request([token], params)
                self._drain()
        self.reset_prefix_cache()
        self.metrics.reset()
        return len(sizes), time.perf_counter() - t0

    def _drain(self) -> None:
        while self.has_unfinished():
            self.step()

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no request uses; returns how many."""
        return self.blocks.reset_prefix_cache()

    # -- the loop -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule -> run the model -> sample and postprocess; returns what requests gained."""
        plan = self.scheduler.schedule()
        if not plan.seqs:
            if self.scheduler.has_unfinished():
                raise EngineError("the scheduler found nothing to run although requests are waiting")
            return []
        start, kv_used = time.perf_counter(), self.blocks.num_used_blocks
        by_seq = self._by_seq
        seq_ids = [s.seq_id for s in plan.seqs]
        reqs = [by_seq[i] for i in seq_ids]
        samples = plan.samples()
        sampling = reqs if all(samples) else [r for r, s in zip(reqs, samples) if s]
        # The runner takes the step as flat lists (no object per sequence) and returns one row per
        # sampling sequence, in order.
        run = (seq_ids, plan.token_ids(), plan.num_new, samples)
        ahead, self._ahead = self._ahead, None
        if all(r.plain_greedy for r in sampling):
            # The LM head fused with the argmax: no [R, V] logits leave the backend.
            launched = self._adopt(ahead, plan, seq_ids, run[1]) if ahead is not None else None
            if launched is None:
                launched = self.runner.launch_greedy_packed(*run)
            if len(sampling) == len(reqs) and self.runner.backend.overlaps_steps:
                self._ahead = self._launch_ahead(launched, sampling)
            ids, _ = launched.picks()
            now = time.perf_counter()  # every token of the step came out now
            outputs = [r.accept(t, None, now) for r, t in zip(sampling, ids.tolist())]
        else:
            if ahead is not None:
                ahead.out.discard()
            logits = self.runner.step_packed(*run)  # [R, V]
            outputs = [self._sample(r, row) for r, row in zip(sampling, logits)]
        for req, out in zip(sampling, outputs):
            if out.finished:
                self._finished(req)
        self._account(plan, reqs, start, time.perf_counter(), len(outputs), kv_used)
        return outputs

    def _adopt(self, ahead: LaunchedStep, plan: StepPlan, seq_ids: list[int], token_ids: list[int]) -> LaunchedStep | None:
        """``ahead`` when it holds this plan's step (each of its sequences, one token each, from the
        same positions; its tokens are then the picks it was fed on the device), committed; else
        None. ``ahead`` may hold more sequences: requests that ended on a stop token or were aborted
        after it was launched. Their rows are left unread.

        A step not taken is left to finish on the device unread: it wrote each of its sequences'
        K/V one position past the committed ones, which the next step that reaches there rewrites
        (and a freed block is handed out only to steps launched after it)."""
        if len(token_ids) == len(seq_ids):
            if ahead.batch.seq_ids == seq_ids:
                if ahead.starts == plan.starts:
                    return self.runner.adopt(ahead, token_ids)
            elif self.ahead_subsets:
                at = {seq_id: i for i, seq_id in enumerate(ahead.batch.seq_ids)}
                rows = [at.get(seq_id, -1) for seq_id in seq_ids]
                if -1 not in rows and [ahead.starts[i] for i in rows] == plan.starts:
                    return self.runner.adopt(ahead, token_ids, rows)
        ahead.out.discard()
        return None

    def _launch_ahead(self, launched: LaunchedStep, reqs: list[Request]) -> LaunchedStep | None:
        """On a backend that overlaps steps, the next decode step of the sequences of ``launched``
        that go on, fed their picks on the device, so the device runs it while the host handles
        this step's picks; the next ``step`` adopts it when the schedule is the same. A request that
        takes its last token now (``max_tokens``) is left out of it: the schedule drops it too. Not
        when the schedule will differ anyway: a request waits and there is room to admit it, or
        will be once a request ends now."""
        sched = self.scheduler
        if sched.waiting and len(sched.running) < sched.config.max_num_seqs:
            return None
        rows = [i for i, r in enumerate(reqs) if r.tokens_left > 1]
        if not rows or (len(rows) < len(reqs) and (sched.waiting or not self.ahead_subsets)):
            return None
        return self.runner.launch_ahead(launched, None if len(rows) == len(reqs) else rows)

    def _sample(self, req: Request, logits: np.ndarray) -> RequestOutput:
        token = req.sampler.sample(logits, req.seq.token_ids, req.output_ids)
        logprobs = req.sampler.logprobs(logits, token) if req.params.logprobs is not None else None
        return req.accept(token, logprobs, time.perf_counter())

    def _finished(self, req: Request) -> None:
        self.scheduler.finish(req.seq)
        self._forget(req)
        req.metrics.finished_time = req.metrics.last_token_time
        self.metrics.on_finished(req.metrics)

    def _account(
        self, plan: StepPlan, reqs: list[Request], start: float, end: float, generated: int, kv_used: int
    ) -> None:
        seconds = end - start
        for req in reqs:
            m = req.metrics
            first = m.first_token_time
            if first is not None and first < start:  # the common case: a decoding request
                m.decode_seconds += seconds
                continue
            if m.first_scheduled_time is None:
                seq = req.seq
                m.first_scheduled_time = start
                m.cached_tokens = seq.num_cached_tokens
                self.metrics.on_admitted(seq.num_prompt_tokens, seq.num_cached_tokens)
            m.prefill_seconds += seconds
        for seq in plan.preempted:  # a sequence's count changes only when a schedule preempts it
            self._by_seq[seq.seq_id].metrics.preemptions = seq.num_preemptions
        self.metrics.on_step(
            end,
            plan.num_tokens,
            len(plan.seqs),
            generated,
            len(plan.preempted),
            kv_used,
            seconds,
        )

    def _forget(self, req: Request) -> None:
        del self._requests[req.request_id]
        del self._by_seq[req.seq.seq_id]

    def _gauges(self) -> Gauges:
        b = self.blocks
        return Gauges(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_blocks_total=b.num_blocks,
            kv_blocks_used=b.num_used_blocks,
            kv_blocks_free=b.num_free_blocks,
            kv_blocks_cached=b.num_cached_blocks,
        )

    # -- one request at a time --------------------------------------------------------------------

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        repetition_penalty: float | None = None,
        seed: int | None = None,
        chat: bool = False,
        stream: bool = False,
        **options: Any,
    ) -> GenerationResult | Iterator[TextDelta | GenerationResult]:
        """Generate a continuation of ``prompt`` (text or token ids); unset options use the artifact's defaults.

        ``options`` are other ``SamplingParams`` fields (``stop``, ``min_p``, ``logprobs``, ...). With
        ``stream`` it returns an iterator of ``TextDelta``s that ends with the ``GenerationResult``.
        This drives the engine itself: do not mix it with ``step`` calls from elsewhere.
        """
        params = self.sampling_params(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            repetition_penalty=repetition_penalty,
            seed=seed,
            **options,
        )
        events = self._events(self.add_request(prompt, params, chat=chat))
        if stream:
            return events
        for event in events:
            if isinstance(event, GenerationResult):
                return event
        raise AssertionError("the event stream ended without a result")  # pragma: no cover

    def _events(self, request_id: str) -> Iterator[TextDelta | GenerationResult]:
        req = self._requests[request_id]
        try:
            while not req.finished:
                for out in self.step():
                    if out.request_id != request_id:
                        continue
                    for token in out.token_ids:
                        if out.finish_reason == "stop" and out.stop_reason == token:  # a stop token
                            if out.text:
                                yield TextDelta(out.text, None)
                        else:
                            yield TextDelta(out.text, token)
            yield req.result(self.load_seconds)
        finally:
            if not req.finished:
                self.abort(request_id)

    def greedy_with_logits(self, prompt_ids: Sequence[int], n: int) -> tuple[list[int], list[float]]:
        """Exactly ``n`` greedy tokens (stop tokens do not stop it) and the top-1 logit at each step.

        Runs the one sequence on its own, outside the scheduler (the reference for golden checks).
        """
        prompt_ids = self.encode_prompt(prompt_ids)
        self._check_fits(len(prompt_ids), n)
        seq_id = next(self._seq_ids)
        ids: list[int] = []
        top1: list[float] = []
        try:
            chunk = prompt_ids
            for _ in range(n):
                ((picked, logit),) = self.runner.step_greedy([SeqChunk(seq_id, chunk)])
                ids.append(int(picked[-1]))
                top1.append(float(logit[-1]))
                chunk = [ids[-1]]
        finally:
            self.runner.free(seq_id)
        return ids, top1

    # -- checks ---------------------------------------------------------------------------------

    def _with_stop_ids(self, params: SamplingParams) -> SamplingParams:
        if params.ignore_eos:
            return params
        # The artifact's stop ids are extra ones: EOS always stops too.
        extra = [*self.graph.arch.eos_token_ids, *self.defaults.stop_token_ids]
        stop = tuple(dict.fromkeys([*params.stop_token_ids, *extra]))
        return params if stop == params.stop_token_ids else dataclasses.replace(params, stop_token_ids=stop)

    def _check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        total = prompt_tokens + max_tokens
        if total > self.max_position:
            raise PromptError(
                f"the prompt has {prompt_tokens} tokens; with max_tokens {max_tokens} that is "
                f"{total} > the model's context of {self.max_position} tokens; "
                "shorten the prompt or lower max_tokens"
            )
        if not self.blocks.fits(total):
            raise PromptError(
                f"the prompt has {prompt_tokens} tokens; with max_tokens {max_tokens} that is {total} tokens, "
                f"more than the KV cache holds ({self.cache_plan.num_tokens} tokens); "
                "raise --kv-memory or lower max_tokens"
            )

