"""What a request may ask, checked on rank 0 before anything reaches the other ranks, and the OpenAI error body
every refusal gets.

transformers' handlers check the names of a request's fields, not their values: a negative `max_tokens`, a
chat without a template or a temperature that is not a number fail inside generate as a 500. Here each is a
4xx whose message names the field and says what to send, and the ranks never hear of it (they stay in step, the
next request is exact). Fields transformers' handlers accept but ignore are refused where they would change the
answer (`n`, `best_of`, `logprobs`, `echo`, `presence_penalty`): an ignored setting is a silent wrong answer.
"""

from __future__ import annotations

import contextvars
import hmac
import os

from fastapi import HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from ...errors import ContextParallelError

ROLES = {"system", "developer", "user", "assistant", "tool"}
# fields transformers' handlers take and ignore; what each would have to be for the answer to be what was asked
IGNORED = {"n": 1, "best_of": 1, "presence_penalty": 0, "top_logprobs": None}


class BadRequest(HTTPException):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(status_code=status, detail=message)
        self.param = param


def _int(body: dict, name: str, low: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"'{name}' must be an integer, got {value!r}.", name)
    if low is not None and value < low:
        raise BadRequest(f"'{name}' must be at least {low}, got {value}.", name)
    return value


def _number(body: dict, name: str, low: float, high: float, open_low: bool = False) -> None:
    value = body.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"'{name}' must be a number, got {value!r}.", name)
    if value > high or value < low or (open_low and value == low):
        raise BadRequest(f"'{name}' must be in {'(' if open_low else '['}{low}, {high}], got {value}.", name)


def max_tokens(body: dict) -> int | None:
    """The new tokens a request allows itself (None: the server's default)."""
    given = body.get("max_completion_tokens", body.get("max_tokens"))
    return given if isinstance(given, int) and not isinstance(given, bool) else None


def _common(body: dict, served: str) -> None:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object.")
    model = body.get("model")
    if model is not None and model != served:
        raise BadRequest(f"this server serves the model '{served}', not {model!r}.", "model", status=404)
    for name in ("max_tokens", "max_completion_tokens"):
        _int(body, name, low=1)
    _int(body, "seed")
    _number(body, "temperature", 0, 2)
    _number(body, "top_p", 0, 1, open_low=True)
    _number(body, "frequency_penalty", -2, 2)
    if "stream" in body and not isinstance(body["stream"], bool):
        raise BadRequest(f"'stream' must be true or false, got {body['stream']!r}.", "stream")
    stop = body.get("stop")
    if stop is not None and not (
        isinstance(stop, str) or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
    ):
        raise BadRequest("'stop' must be a string or a list of strings.", "stop")
    for name, default in IGNORED.items():
        if body.get(name) not in (None, default):
            raise BadRequest(
                f"'{name}' = {body[name]!r} is not supported by this server; leave it out (or send {default!r}).",
                name,
            )


def check_chat(body: dict, served: str) -> None:
    _common(body, served)
    if body.get("logprobs") not in (None, False):
        raise BadRequest("chat 'logprobs' is not supported by this server (completions' is); leave it out.", "logprobs")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list of {'role': ..., 'content': ...} objects.", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise BadRequest(f"messages[{i}] needs a 'role', one of {sorted(ROLES)}.", f"messages[{i}].role")
        content = m.get("content")
        if not isinstance(content, (str, list)) and not (content is None and m["role"] == "assistant"):
            raise BadRequest(f"messages[{i}].content must be a string or a list of parts.", f"messages[{i}].content")


def check_completion(body: dict, served: str) -> None:
    _common(body, served)
    if "prompt" not in body:
        raise BadRequest("'prompt' is required: a string, or a list of token ids.", "prompt")
    prompt_ids(body)  # its form
    top = _int(body, "logprobs", low=0)
    if top is not None and top > 20:
        raise BadRequest(f"'logprobs' is at most 20, got {top}.", "logprobs")
    if "echo" in body and not isinstance(body["echo"], bool):
        raise BadRequest(f"'echo' must be true or false, got {body['echo']!r}.", "echo")
    if body.get("stream") and (top is not None or body.get("echo")):
        raise BadRequest("'logprobs' and 'echo' are answered whole: send them without 'stream'.", "stream")
    if body.get("suffix") is not None:
        raise BadRequest("'suffix' is not supported by this server; leave it out.", "suffix")


def prompt_ids(body: dict) -> list[int] | None:
    """A completions prompt given as token ids (a list of ints, or a list of one such list), else None for text.
    One prompt a request: a list of several prompts is refused."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
        body["prompt"] = prompt
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("'prompt' is empty.", "prompt")
        return None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if min(prompt) < 0:
            raise BadRequest("'prompt' holds a negative token id.", "prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise BadRequest("one prompt per request: send each prompt of the list as a request of its own.", "prompt")
    raise BadRequest("'prompt' must be a non-empty string or a non-empty list of token ids.", "prompt")


def check_length(prompt: int, config, limit: int | None, given: int | None) -> None:
    """The prompt and its new tokens within the model's positions: a request that did not say how many new
    tokens it wants gets what fits."""
    if limit is None:
        return
    if prompt >= limit:
        raise BadRequest(f"the prompt has {prompt} tokens; this model takes at most {limit - 1} (and 1 new).", "prompt")
    room = limit - prompt
    if (config.max_new_tokens or 0) > room:
        if given is not None:
            raise BadRequest(
                f"the prompt ({prompt} tokens) plus max_tokens ({given}) exceeds the model's {limit} positions: "
                f"ask for at most {room}.",
                "max_tokens",
            )
        config.max_new_tokens = room


client: contextvars.ContextVar = contextvars.ContextVar("client", default=None)  # the request's connection


def error_body(message: str, status: int, param: str | None = None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def install_errors(app, *, api_key: str | None, max_body: int, healthy) -> None:
    """OpenAI-style error bodies for every refusal; the bearer token and the body size checked before a handler
    reads the body; /health red once the ranks fell out of step."""
    api_key = api_key or os.environ.get("HF_CONTEXTPAR_API_KEY") or None

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):
        message = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        return JSONResponse(
            error_body(message, exc.status_code, getattr(exc, "param", None)),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )

    @app.exception_handler(ContextParallelError)
    async def refused(request: Request, exc: ContextParallelError):  # what one process runs but CP does not
        return JSONResponse(error_body(str(exc), 400), 400)

    @app.exception_handler(Exception)
    async def failed(request: Request, exc: Exception):  # a rank died under the request, or a bug of ours
        status = 500 if healthy() else 503
        why = "" if healthy() else "a rank of the server failed; it is going down. "
        return JSONResponse(error_body(f"{why}{type(exc).__name__}: {exc}", status), status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        return JSONResponse(error_body("the request body must be a JSON object (it did not parse as one).", 400), 400)

    @app.middleware("http")
    async def gate(request: Request, call_next):
        if api_key is not None and not _authorised(request, api_key):
            return JSONResponse(error_body("a valid API key is required (Authorization: Bearer KEY).", 401), 401)
        size = request.headers.get("content-length")
        if max_body and size is not None and size.isdigit() and int(size) > max_body:
            return JSONResponse(error_body(f"the request body is over {max_body} bytes.", 413), 413)
        if request.url.path == "/health" and not healthy():
            return JSONResponse({"status": "unhealthy", "reason": "a rank failed"}, 503)
        client.set(request)
        return await call_next(request)


def _authorised(request: Request, key: str) -> bool:
    given = request.headers.get("authorization", "")
    return given.startswith("Bearer ") and hmac.compare_digest(given[7:].encode(), key.encode())
