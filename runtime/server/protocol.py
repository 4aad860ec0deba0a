"""OpenAI request bodies -> what the engine runs, and engine outputs -> OpenAI response objects.

Parsing is table-driven: each accepted field names its JSON type and range, so a wrong type or value
is a 400 naming the field. Fields the OpenAI API has but this server cannot honour (``echo``,
``logit_bias``, tools...) are rejected when they would change the output, and ignored when they do
not (``user``, ``metadata``...); a field OpenAI does not know is rejected, as OpenAI does.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..engine import Engine
from ..errors import EngineError
from ..sampler import SamplingParams, TokenLogprobs

__all__ = [
    "APIError",
    "Choice",
    "GenerationPlan",
    "TokenText",
    "chat_prompt_ids",
    "parse_chat",
    "parse_completion",
]


class APIError(Exception):
    """An error the client caused (or overload); rendered as OpenAI's ``{"error": {...}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# -- field table ----------------------------------------------------------------------------------------

Check = Callable[[str, Any], Any]  # (field name, JSON value) -> the value to use; raises APIError


def _type_error(name: str, expected: str, value: Any) -> APIError:
    got = {bool: "a boolean", int: "an integer", float: "a decimal", str: "a string", list: "an array",
           dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)  # fmt: skip
    return APIError(
        400, f"Invalid type for '{name}': expected {expected}, but got {got} instead.", param=name,
        code="invalid_type",
    )  # fmt: skip


def _value_error(name: str, message: str) -> APIError:
    return APIError(400, f"Invalid '{name}': {message}", param=name, code="invalid_value")


def number(lo: float, hi: float, *, lo_open: bool = False) -> Check:
    def check(name: str, v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise _type_error(name, "a decimal", v)
        if not math.isfinite(v) or v < lo or v > hi or (lo_open and v == lo):
            bound = f"({lo}, {hi}]" if lo_open else f"[{lo}, {hi}]"
            raise _value_error(name, f"expected a value in {bound}, but got {v} instead.")
        return float(v)

    return check


def integer(lo: int, hi: int | None = None) -> Check:
    def check(name: str, v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            if isinstance(v, float) and v.is_integer():  # JSON has one number type; 8.0 is 8
                v = int(v)
            else:
                raise _type_error(name, "an integer", v)
        if v < lo or (hi is not None and v > hi):
            bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise _value_error(name, f"expected an integer {bound}, but got {v} instead.")
        return v

    return check


def boolean(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise _type_error(name, "a boolean", v)
    return v


def string(name: str, v: Any) -> str:
    if not isinstance(v, str):
        raise _type_error(name, "a string", v)
    return v


def stop_strings(name: str, v: Any) -> tuple[str, ...]:
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise _type_error(name, "a string or an array of strings", v)
    if len(items) > 16:
        raise _value_error(name, f"at most 16 stop sequences, got {len(items)}.")
    if any(not s for s in items):
        raise _value_error(name, "stop sequences must not be empty.")
    return tuple(items)


def stream_options(name: str, v: Any) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise _type_error(name, "an object", v)
    for key in v:
        if key != "include_usage":
            raise APIError(400, f"Unrecognized field '{name}.{key}'.", param=f"{name}.{key}")
    if "include_usage" in v:
        boolean(f"{name}.include_usage", v["include_usage"])
    return v


def anything(name: str, v: Any) -> Any:
    return v


def must_be(*allowed: Any) -> Check:
    """Accepted only with a value that changes nothing (``echo: false``, ``logit_bias: {}``)."""

    def check(name: str, v: Any) -> Any:
        if v not in allowed:
            raise APIError(
                400, f"'{name}' is not supported by this server (only {allowed!r} is accepted).",
                param=name, code="unsupported_parameter",
            )  # fmt: skip
        return v

    return check


def unsupported(name: str, v: Any) -> Any:
    if v is None or v == [] or v == {}:  # null / empty: asks for nothing
        return v
    raise APIError(
        400, f"'{name}' is not supported by this server.", param=name, code="unsupported_parameter"
    )


# What both endpoints accept. null means "unset" for every optional field, as in OpenAI's API.
COMMON: dict[str, Check] = {
    "model": string,
    "max_tokens": integer(1),
    "temperature": number(0, 2),
    "top_p": number(0, 1, lo_open=True),
    "top_k": integer(-1),  # an extension (vLLM's): -1 or 0 = all
    "min_p": number(0, 1),  # extension
    "repetition_penalty": number(0, 10, lo_open=True),  # extension
    "presence_penalty": number(-2, 2),
    "frequency_penalty": number(-2, 2),
    "seed": integer(-(2**63), 2**64 - 1),  # negative ones wrap to unsigned (see _plan)
    "stop": stop_strings,
    "n": integer(1, 128),
    "stream": boolean,
    "stream_options": stream_options,
    "ignore_eos": boolean,  # extension
    "logit_bias": unsupported,
    "user": anything,  # ignored: OpenAI uses it only for abuse monitoring
}
COMPLETION: dict[str, Check] = {
    **COMMON,
    "prompt": anything,  # checked by _completion_prompts
    "logprobs": integer(0, 20),
    "echo": must_be(False),
    "suffix": must_be(None, ""),
    "best_of": integer(1, 128),  # must equal n: checked below
}
CHAT: dict[str, Check] = {
    **COMMON,
    "messages": anything,  # checked by _chat_messages
    "logprobs": boolean,
    "top_logprobs": integer(0, 20),
    "max_completion_tokens": integer(1),
    "response_format": anything,  # checked below: only {"type": "text"}
    "tools": unsupported,
    "tool_choice": must_be(None, "none"),
    "functions": unsupported,
    "function_call": must_be(None, "none"),
    "parallel_tool_calls": anything,  # ignored: meaningless without tools
    "modalities": must_be(None, ["text"]),
    "audio": unsupported,
    "prediction": unsupported,
    "store": anything,  # ignored: nothing is stored
    "metadata": anything,  # ignored (it only tags stored completions)
    "service_tier": anything,  # ignored: there is one tier
    "reasoning_effort": anything,  # ignored: not a reasoning model API
}


def _fields(body: dict[str, Any], table: dict[str, Check]) -> dict[str, Any]:
    """Every field of ``body`` checked against ``table``; null fields are dropped (unset)."""
    out = {}
    for name, value in body.items():
        check = table.get(name)
        if check is None:
            raise APIError(400, f"Unrecognized request argument supplied: {name}", param=name,
                           code="unknown_parameter")  # fmt: skip
        if value is not None:
            out[name] = check(name, value)
    if "stream_options" in out and not out.get("stream", False):
        raise APIError(400, "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
                       param="stream_options")  # fmt: skip
    return out


# -- plans ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Choice:
    """One generated choice: which prompt and how to sample it."""

    index: int
    prompt_index: int
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(slots=True)
class GenerationPlan:
    """A validated request: its choices and how to shape the response."""

    kind: str  # "completion" | "chat"
    model: str
    choices: list[Choice]
    stream: bool
    include_usage: bool
    logprobs: bool  # report logprobs in the response
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens over distinct prompts (``n`` choices share one prompt, counted once)."""
        seen = {c.prompt_index: len(c.prompt_ids) for c in self.choices}
        return sum(seen.values())


def parse_completion(engine: Engine, body: Any, models: Sequence[str]) -> GenerationPlan:
    """A ``/v1/completions`` body -> a plan (raises ``APIError``)."""
    f = _fields(_object(body), COMPLETION)
    if "prompt" not in body:
        raise APIError(
            400, "Missing required parameter: 'prompt'.", param="prompt", code="missing_required_parameter"
        )
    if "best_of" in f and f["best_of"] != f.get("n", 1):
        raise APIError(400, "'best_of' other than n is not supported by this server.", param="best_of",
                       code="unsupported_parameter")  # fmt: skip
    prompts = [
        engine.encode_prompt(p) if isinstance(p, str) else p for p in _completion_prompts(body["prompt"])
    ]
    logprobs = f.get("logprobs")
    return _plan("completion", engine, f, models, prompts, "prompt", logprobs)


def parse_chat(engine: Engine, body: Any, models: Sequence[str]) -> GenerationPlan:
    """A ``/v1/chat/completions`` body -> a plan (raises ``APIError``)."""
    f = _fields(_object(body), CHAT)
    if "messages" not in body:
        raise APIError(400, "Missing required parameter: 'messages'.", param="messages",
                       code="missing_required_parameter")  # fmt: skip
    fmt = f.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise APIError(400, "'response_format' other than {\"type\": \"text\"} is not supported by this server.",
                       param="response_format", code="unsupported_parameter")  # fmt: skip
    if "max_completion_tokens" in f:
        f.setdefault("max_tokens", f["max_completion_tokens"])
    if "top_logprobs" in f and not f.get("logprobs"):
        raise APIError(400, "'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs")
    logprobs = f.get("top_logprobs", 0) if f.get("logprobs") else None
    try:
        ids = chat_prompt_ids(engine, _chat_messages(body["messages"]))
    except EngineError as e:
        raise APIError(400, str(e), param="messages") from None
    return _plan("chat", engine, f, models, [ids], "messages", logprobs)


def chat_prompt_ids(engine: Engine, messages: list[dict[str, Any]]) -> list[int]:
    """The prompt ids of a conversation: the artifact's chat template, ending with the assistant's turn."""
    tok = engine.tokenizer
    return tok.encode(tok.render_chat(messages), add_special_tokens=False)


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.", code="invalid_body")
    return body


def _completion_prompts(p: Any) -> list[str | list[int]]:
    """``prompt`` as OpenAI allows it: a string, strings, token ids, or lists of token ids."""

    def ids(x: Any) -> bool:
        return (
            isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)
        )

    if isinstance(p, str):
        return [p]
    if ids(p):
        return [p]
    if isinstance(p, list) and p and all(isinstance(s, str) for s in p):
        return list(p)
    if isinstance(p, list) and p and all(ids(x) for x in p):
        return list(p)
    raise _type_error(
        "prompt", "a string, an array of strings, an array of token ids or an array of those", p
    )


_CONTENT_ROLES = {"system", "user", "assistant", "developer", "tool"}


def _chat_messages(messages: Any) -> list[dict[str, Any]]:
    """Messages with string content (text parts joined); roles and shapes checked."""
    if not isinstance(messages, list):
        raise _type_error("messages", "an array", messages)
    if not messages:
        raise _value_error("messages", "expected a non-empty array.")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _type_error(where, "an object", m)
        role = m.get("role")
        if role not in _CONTENT_ROLES:
            raise _value_error(f"{where}.role", f"expected one of {sorted(_CONTENT_ROLES)}, got {role!r}.")
        content = m.get("content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if (
                    not isinstance(part, dict)
                    or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)
                ):
                    raise APIError(400, f"Only text content parts are supported ({where}.content[{j}]).",
                                   param=f"{where}.content[{j}]", code="unsupported_content")  # fmt: skip
                parts.append(part["text"])
            content = "".join(parts)
        elif content is None and role == "assistant":
            content = ""
        elif not isinstance(content, str):
            raise _type_error(f"{where}.content", "a string or an array of text parts", content)
        if m.get("tool_calls"):
            raise APIError(400, "tool calls are not supported by this server.", param=f"{where}.tool_calls",
                           code="unsupported_parameter")  # fmt: skip
        # OpenAI treats "developer" as the system prompt of models that predate it.
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


def _plan(
    kind: str,
    engine: Engine,
    f: dict[str, Any],
    models: Sequence[str],
    prompts: list[list[int]],
    prompt_field: str,
    logprobs: int | None,
) -> GenerationPlan:
    model = f.get("model", models[0])
    if model not in models:
        raise APIError(404, f"The model '{model}' does not exist; this server serves {list(models)}.",
                       param="model", code="model_not_found")  # fmt: skip
    limit = engine.max_position
    capacity = engine.cache_plan.num_tokens
    choices: list[Choice] = []
    n = f.get("n", 1)
    for pi, ids in enumerate(prompts):
        try:
            ids = engine.encode_prompt(ids)
        except EngineError as e:
            raise APIError(400, str(e), param=prompt_field) from None
        if len(ids) >= limit:
            raise APIError(
                400, f"This model's maximum context length is {limit} tokens. However, your "
                f"{prompt_field} has {len(ids)} tokens, leaving no room to generate.",
                param=prompt_field, code="context_length_exceeded",
            )  # fmt: skip
        max_tokens = f.get("max_tokens")
        if max_tokens is not None and len(ids) + max_tokens > limit:
            raise APIError(
                400, f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(ids) + max_tokens} tokens ({len(ids)} in the {prompt_field}, {max_tokens} for "
                "max_tokens). Please reduce the length of the prompt or max_tokens.",
                param="max_tokens", code="context_length_exceeded",
            )  # fmt: skip
        if max_tokens is None:  # the artifact's default, cut to the room the context leaves
            max_tokens = min(engine.defaults.max_new_tokens, limit - len(ids), max(capacity - len(ids), 1))
        for j in range(n):
            seed = f.get("seed")
            if seed is not None:
                # n choices of one seeded request must differ, and each stays reproducible: seed + j.
                # OpenAI takes any int64; the sampler's generator wants an unsigned one: wrap, as C does.
                seed = (seed + j) % 2**64
            params = _sampling_params(engine, f, max_tokens, seed, logprobs)
            try:
                ids, params = engine.prepare(ids, params)
            except EngineError as e:
                raise APIError(400, str(e), param="max_tokens", code="context_length_exceeded") from None
            choices.append(Choice(len(choices), pi, ids, params))
    stream = f.get("stream", False)
    include_usage = bool(f.get("stream_options", {}).get("include_usage", False))
    return GenerationPlan(kind, model, choices, stream, include_usage, logprobs is not None)


def _sampling_params(
    engine: Engine, f: dict[str, Any], max_tokens: int, seed: int | None, logprobs: int | None
) -> SamplingParams:
    top_k = f.get("top_k")
    options = {k: f[k] for k in ("min_p", "presence_penalty", "frequency_penalty", "ignore_eos") if k in f}
    try:
        return engine.sampling_params(
            max_tokens=max_tokens,
            temperature=f.get("temperature"),
            top_p=f.get("top_p"),
            top_k=None if top_k is None else max(top_k, 0),
            repetition_penalty=f.get("repetition_penalty"),
            seed=seed,
            stop=f.get("stop", ()),
            logprobs=logprobs,
            **options,
        )
    except EngineError as e:  # a combination the sampler refuses
        raise APIError(400, str(e)) from None


# -- responses ------------------------------------------------------------------------------------------


class TokenText:
    """Token id -> its text and UTF-8 bytes, as logprobs report them (cached: the vocabulary is fixed)."""

    def __init__(self, engine: Engine) -> None:
        self._tok = engine.tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = self._cache[token_id] = self._tok.decode([token_id], skip_special_tokens=False)
        return s

    def chat_logprobs(self, lps: Sequence[TokenLogprobs]) -> list[dict[str, Any]]:
        """Chat format: ``[{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]``."""
        return [
            {
                **self._entry(lp.token_id, lp.logprob),
                "top_logprobs": [self._entry(t, v) for t, v in lp.top],
            }
            for lp in lps
        ]

    def completion_logprobs(self, lps: Sequence[TokenLogprobs], offset: int = 0) -> dict[str, Any]:
        """Legacy completions format; ``top_logprobs`` holds the top N and the chosen token."""
        tokens = [self(lp.token_id) for lp in lps]
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [_finite(lp.logprob) for lp in lps],
            "top_logprobs": [
                {**{self(t): _finite(v) for t, v in lp.top}, self(lp.token_id): _finite(lp.logprob)}
                for lp in lps
            ],
            "text_offset": offsets,
        }

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        s = self(token_id)
        return {"token": s, "logprob": _finite(logprob), "bytes": list(s.encode("utf-8"))}


def _finite(x: float) -> float:
    """JSON has no -inf: a token the model rules out gets OpenAI's floor value instead."""
    return x if math.isfinite(x) else -9999.0


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
