"""The OpenAI request bodies this server takes, and their parsing with bounded cost.

Types are strict, as OpenAI's API: a boolean is not an integer, a string is not a number or a boolean (an integer
is a number). A body is parsed by `parse_body`, off the event loop, with limits that stop the work early: a body
may hold at most `BodyLimits.max_numbers` numbers and `max_objects` JSON objects (a token-id prompt far past the
context stops being read once it passes them), and about `max_strings` strings and as many values as all three
(both counted on the raw bytes before anything is built); what passes is then validated by the models. The length
of a text prompt is checked against the context before it is tokenised (`prompt_bound`)."""

from __future__ import annotations

import dataclasses
import itertools
import json
from typing import Annotated, Any, ClassVar, Literal

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_response(status: int, message: str, type_: str = "invalid_request_error", param=None, code=None):
    return JSONResponse(status_code=status,
                        content={"error": {"message": message, "type": type_, "param": param, "code": code}})


def encodable(text: str) -> str:
    """A JSON string may hold a lone surrogate (\\ud800), which no tokenizer can take: reject it."""
    if text.isascii():  # the common case, checked without a copy
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"the text holds a lone surrogate ({text[e.start:e.end]!r}), which is not valid "
                         "Unicode") from e
    return text


INT64_MAX = 2**63 - 1
MAX_LOGPROBS = 20  # as vLLM: completions' `logprobs` and chat's `top_logprobs` go up to this
MAX_STOP = 32  # stop strings per request, each at most MAX_STOP_LEN characters (both bound per-token work)
MAX_STOP_LEN = 512

Finite = Annotated[float, Field(allow_inf_nan=False)]
STRICT = ConfigDict(strict=True)


class StreamOptions(BaseModel):
    model_config = STRICT
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    model: str
    max_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    temperature: Annotated[Finite, Field(ge=0)] | None = None
    top_p: Annotated[Finite, Field(gt=0, le=1)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=INT64_MAX)] | None = None
    stop: str | list[str] | None = None
    n: Annotated[int, Field(ge=1)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False

    # fields of OpenAI's API that this server does not implement: (name, the values that mean "off")
    UNSUPPORTED: ClassVar[tuple] = (("n", (None, 1)), ("presence_penalty", (None, 0)), ("frequency_penalty", (None, 0)),
                                    ("logit_bias", (None, {})), ("tools", (None, [])), ("functions", (None, [])),
                                    ("response_format", (None, {"type": "text"})))

    @field_validator("stop")
    @classmethod
    def _stop_text(cls, v):
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings, got {len(stops)}")
        for x in stops:
            if not 1 <= len(x) <= MAX_STOP_LEN:
                raise ValueError(f"a stop string has 1 to {MAX_STOP_LEN} characters, got {len(x)}")
            encodable(x)
        return v

    def check_supported(self) -> None:
        """A field we accept but do not implement is a 400 naming it, never silently ignored."""
        extra = self.model_extra or {}
        for name, off in self.UNSUPPORTED:
            value = getattr(self, name, None) if name in type(self).model_fields else extra.get(name)
            if value not in off:
                what = f"{name} > 1" if name in ("n", "best_of") else name
                raise APIError(400, f"{what} is not supported by this server", param=name)


class CompletionRequest(_Common):
    prompt: str | list[int]
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None

    UNSUPPORTED: ClassVar[tuple] = _Common.UNSUPPORTED + (("echo", (None, False)), ("suffix", (None, "")),
                                                          ("best_of", (None, 1)))

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_type(cls, v):
        """One clear message for a prompt of the wrong type (the union's own names both branches)."""
        if isinstance(v, str):
            return encodable(v)
        if isinstance(v, list) and all(type(t) is int for t in v):
            return v
        raise ValueError("prompt must be a string or a list of integer token ids")


class ChatMessage(BaseModel):
    model_config = STRICT
    role: Literal["system", "user", "assistant", "tool"]
    content: str

    @field_validator("content")
    @classmethod
    def _content_text(cls, v):
        return encodable(v)


class ChatRequest(_Common):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None


@dataclasses.dataclass(frozen=True)
class BodyLimits:
    """What one body may hold (`parse_body`); `for_context` sizes them from the model's context. A body past
    `max_bytes` is larger than any request this model can run, and is refused before it is read."""

    max_numbers: int
    max_objects: int
    max_strings: int
    max_bytes: int

    @classmethod
    def for_context(cls, context: int, chars_per_token: int) -> "BodyLimits":
        """A prompt of token ids holds at most `context` numbers, a chat at most `context` messages (each renders to
        at least a token) of two strings each; the rest of a request needs a few hundred of each. Bytes: a text of
        prompt_bound characters at 12 bytes each (two \\uXXXX escapes), 64 bytes per token id or message (with
        whitespace), and a MiB for the other fields (stop strings take up to 200 KB)."""
        return cls(max_numbers=context + 256, max_objects=context + 64, max_strings=4 * context + 1024,
                   max_bytes=12 * prompt_bound(context, chars_per_token) + 64 * context + (1 << 20))


class _TooMany(Exception):
    def __init__(self, what: str, limit: int):
        self.what, self.limit = what, limit


def _counting(limit: int, what: str, make):
    """A json.loads hook that builds values with `make` and stops the parse past `limit` calls."""
    count = itertools.count(1)

    def hook(x):
        if next(count) > limit:
            raise _TooMany(what, limit)
        return make(x)

    return hook


def parse_body(body: bytes, model: type[BaseModel], limits: BodyLimits) -> Any:
    """The request model of a JSON body, or an APIError (400) / RequestValidationError (the app's 400 naming the
    field). Blocking work (run it off the event loop); the hooks make the parse Python code, so the loop thread also
    gets the interpreter meanwhile, and it stops as soon as a limit is passed."""
    if not body.strip():
        raise APIError(400, "invalid request: the body is empty; it must be a JSON object")
    param = "prompt" if model is CompletionRequest else "messages"
    quotes = body.count(b'"') - body.count(b'\\"')
    if quotes // 2 > limits.max_strings:
        raise APIError(400, f"the request holds about {quotes // 2} strings; at most {limits.max_strings} for this "
                       "model's context", param=param)
    values = limits.max_numbers + limits.max_objects + limits.max_strings  # JSON separates every value but one by ","
    if body.count(b",") > values:
        raise APIError(400, f"the request holds more than {values} values: a prompt that long exceeds this model's "
                       "context", param=param)
    try:
        obj = json.loads(body, parse_int=_counting(limits.max_numbers, "numbers", int),
                         parse_float=_counting(limits.max_numbers, "numbers", float),
                         object_pairs_hook=_counting(limits.max_objects, "objects", dict))
    except _TooMany as e:
        raise APIError(400, f"the request holds more than {e.limit} {e.what}: a prompt that long exceeds this model's "
                       "context", param=param) from None
    except (ValueError, RecursionError):  # json's errors, bad UTF-8, nesting too deep
        raise APIError(400, "malformed JSON body (it must be UTF-8 JSON)") from None
    if not isinstance(obj, dict):
        raise APIError(400, "invalid request: the body must be a JSON object")
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None


def prompt_bound(context: int, chars_per_token: int) -> int:
    """Characters of text past which a prompt holds at least `context` tokens (each token covers at most
    chars_per_token characters): such a text is refused without tokenising it."""
    return context * chars_per_token
