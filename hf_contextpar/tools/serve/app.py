"""transformers' own serving app (`transformers serve`: FastAPI, the OpenAI schemas, its chat-completions and
completions handlers, its streamer), with the model and the generate call made context-parallel.

What is reused as it is: `build_server` (the routes, the request-id middleware, /v1/models, /health), the
handlers' request flow (the chat template, the generation config a request builds, streaming and non-streaming
responses, SSE chunks) and `DirectStreamer`. What is ours, each by the seam transformers leaves for it:

- `KeptModelManager`: the one model every rank loaded and patched (transformers' manager would load another, on
  rank 0 alone); nothing is unloaded, since the other ranks hold their shares of it;
- `LockstepManager`: the generate manager; a call becomes a `Job` for the lockstep loop (every rank runs it)
  instead of a `generate()` on a thread of rank 0;
- the handlers' prologue (`requests.py`): every bad request is a 4xx with an OpenAI error body, decided here
  before anything reaches the other ranks (transformers' handlers answer several of them with a 500);
- completions take token ids as well as text (the OpenAI API takes both; lm-eval sends ids);
- `usage.prompt_tokens_details.cached_tokens`: the tokens a request reused from a kept conversation.

Routes transformers' app has that a context-parallel server cannot serve (loading another model on rank 0,
/reset, audio, responses) are removed rather than left to fail.
"""

from __future__ import annotations

import asyncio
import contextvars
import json

import torch
from fastapi import HTTPException
from fastapi.responses import JSONResponse
from openai.types.completion_usage import PromptTokensDetails
from transformers import BatchEncoding
from transformers.cli.serving import utils as serving_utils
from transformers.cli.serving.chat_completion import ChatCompletionHandler
from transformers.cli.serving.completion import CompletionHandler
from transformers.cli.serving.model_manager import ModelManager, TimedModel
from transformers.cli.serving.server import build_server
from transformers.cli.serving.utils import DirectStreamer, GenerateManager, GenerationState, _StreamError

from ...models import max_positions
from . import requests, responses
from .lockstep import Job, Lockstep, RequestCancelled, Unavailable

SERVED = {
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/health",
    "/tokenize",
    "/detokenize",
    "/tokenizer_info",
}
_request: contextvars.ContextVar[dict | None] = contextvars.ContextVar("hf_contextpar_request", default=None)


class KeptModelManager(ModelManager):
    """The patched model every rank holds, under the name it is served as; never loaded or unloaded here."""

    def __init__(self, model, tokenizer, name: str):
        super().__init__(device=str(model.device), model_timeout=-1)  # no force_model: it would load one
        self.force_model = name
        self.loaded_models[self.process_model_name(name)] = TimedModel(model, timeout_seconds=-1, processor=tokenizer)
        self._kept = (model, tokenizer)

    def load_model_and_processor(self, model_id_and_revision, progress_callback=None, tqdm_class=None, gguf_file=None):
        return self._kept

    def process_model_name(self, model_id: str) -> str:
        return model_id  # the name it is served as, not a hub revision ('name@main')

    def shutdown(self):
        """The other ranks hold their shares of this model: rank 0 alone must not free it."""


class AgreedStreamer(DirectStreamer):
    """transformers' streamer, whose cancel (the client went away) is rank 0's stop bit for the next step
    (`StopBit`) instead of an exception inside rank 0's generate alone."""

    def __init__(self, job: Job, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.job = job

    def cancel(self) -> None:
        self.job.cancelled.set()


class LockstepManager(GenerateManager):
    """Each generate call as a job of the lockstep loop, which every rank runs."""

    def __init__(self, lockstep: Lockstep):
        self.lockstep = lockstep
        self.jobs: dict[str, Job] = {}

    def _job(self, inputs: dict, gen_config, request_id: str) -> Job:
        ids = inputs["input_ids"][0].tolist()
        limit = max_positions(self.lockstep.model)
        asked = _request.get() or {}
        given = asked.get("max_tokens")
        requests.check_length(len(ids), gen_config, limit, given)
        vocab = getattr(self.lockstep.model.config.get_text_config(decoder=True), "vocab_size", None)
        if vocab is not None and max(ids) >= vocab:
            raise requests.BadRequest(
                f"'prompt' holds token id {max(ids)}; this model's ids end at {vocab - 1}.", "prompt"
            )
        self._check_budget(len(ids), gen_config, given)
        job = Job(ids, gen_config, asked.get("seed"), scores=asked.get("logprobs"))
        self.jobs[request_id] = job
        while len(self.jobs) > 1024:  # requests that failed before reporting their usage
            self.jobs.pop(next(iter(self.jobs)))
        return job

    def _check_budget(self, prompt: int, config, given: int | None) -> None:
        """A request whose KV alone would exceed the budget is a 400 (kept, it would evict every conversation and
        still not fit); one that did not ask for a number of new tokens gets what fits, as with positions."""
        conversations = self.lockstep.conversations
        new = config.max_new_tokens or 0
        if given is None and new > 1 and (room := conversations.room()) is not None:
            new = config.max_new_tokens = max(1, min(new, room - prompt))
        if not conversations.fits(prompt + new):
            need, budget = conversations.footprint.need(prompt + new), conversations.budget
            raise requests.BadRequest(
                f"the prompt ({prompt} tokens) and up to {new} new ones need about {need / 2**20:.2f} MiB of KV "
                f"on each rank; this server keeps at most {budget / 2**20:.2f} MiB (--kv-budget): shorten the "
                f"prompt or max_tokens, or start the server with a larger --kv-budget or more processes.",
                "max_tokens" if given is not None and conversations.fits(prompt + 1) else "prompt",
            )

    def generate_streaming(self, model, processor, inputs, gen_config, request_id, response_parser=None):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        job = self._job(inputs, gen_config, request_id)
        tokenizer = getattr(processor, "tokenizer", processor)._tokenizer
        job.streamer = AgreedStreamer(job, tokenizer, loop, queue, response_parser=response_parser)
        self._submit(job)
        job.future.add_done_callback(lambda f: _stream_failure(f, loop, queue))
        return queue, job.streamer

    async def generate_non_streaming(self, model, processor, inputs, gen_config, request_id):
        job = self._submit(self._job(inputs, gen_config, request_id))
        result = await _answered(job, requests.client.get())
        generated = result.sequences[0, result.prompt_tokens :]
        return processor.decode(generated, skip_special_tokens=True), result.prompt_tokens, generated

    def _submit(self, job: Job) -> Job:
        try:
            return self.lockstep.submit(job)
        except Unavailable as e:
            raise HTTPException(status_code=503, detail=str(e), headers={"Retry-After": "1"}) from None

    def pop_cached(self, request_id: str) -> int | None:
        """The tokens a finished request reused (None: not one of ours, or already reported)."""
        job = self.pop_job(request_id)
        return None if job is None else job.cached_tokens

    def pop_job(self, request_id: str) -> Job | None:
        return self.jobs.pop(request_id, None)

    def stop(self) -> None:
        pass


async def _answered(job: Job, client, every: float = 0.25):
    """The job's result; a client that hangs up before it cancels the job (a streamed request learns of it from
    its stream; this one asks its connection), which stops on every rank at the next agreed point."""
    future = asyncio.wrap_future(job.future)
    while client is not None and not job.cancelled.is_set():
        done, _ = await asyncio.wait({future}, timeout=every)
        if done:
            break
        if await client.is_disconnected():
            job.cancelled.set()
    try:
        return await future
    except RequestCancelled as e:  # nobody reads the answer: no error to log either (nginx's 499)
        raise HTTPException(status_code=499, detail=str(e)) from None


def _stream_failure(future, loop, queue) -> None:
    """A generate that raised ends its stream with the error (one that finished ended it itself)."""
    if (e := future.exception()) is not None:
        loop.call_soon_threadsafe(queue.put_nowait, _StreamError(f"{type(e).__name__}: {e}"))


class LockstepState(GenerationState):
    """One generate manager, the lockstep one, for the one model served."""

    def __init__(self, lockstep: Lockstep):
        super().__init__()
        self.manager = LockstepManager(lockstep)

    def get_manager(self, model_id, use_cb=False):
        return self.manager

    def use_continuous_batching(self, model, modality) -> bool:
        return False

    def is_cb_alive(self) -> bool:  # what transformers' /health asks
        return self.manager.lockstep.healthy


class _Prologue:
    """What both handlers do first: the request checked (a 4xx names the problem), its seed and max_tokens kept
    for the generate manager (transformers' handler would seed rank 0's global generator on the event loop)."""

    check = None
    scores = False  # the handler takes `logprobs` and `echo` (completions)

    async def handle_request(self, body: dict, request_id: str):
        type(self).check(body, self.model_manager.force_model)
        self.prepare(body)
        asked = {"seed": body.pop("seed", None), "max_tokens": requests.max_tokens(body)}
        if self.scores:
            asked.update(logprobs=body.pop("logprobs", None), echo=body.pop("echo", False))
        token = _request.set(asked)
        try:
            return await super().handle_request(body, request_id)
        finally:
            _request.reset(token)

    def prepare(self, body: dict) -> None:
        """The checked request, put in the form transformers' handler reads."""

    def _build_generation_config(self, body: dict, model_generation_config, use_cb: bool = False):
        config = super()._build_generation_config(body, model_generation_config, use_cb)
        if body.get("temperature") is not None and float(body["temperature"]) > 0:
            config.do_sample = True  # OpenAI's meaning of a temperature above 0: sample
        return config

    def _usage(self, usage, request_id: str):
        """The usage of a response's last part, with the tokens the request reused from a kept conversation."""
        if usage is not None and (cached := self.generation_state.manager.pop_cached(request_id)) is not None:
            usage.prompt_tokens_details = PromptTokensDetails(cached_tokens=cached)
        return usage


class ChatHandler(_Prologue, ChatCompletionHandler):
    check = staticmethod(requests.check_chat)

    def _build_completion(self, request_id, content, model_id, finish_reason, usage=None, **kwargs):
        return super()._build_completion(
            request_id, content, model_id, finish_reason, self._usage(usage, request_id), **kwargs
        )

    def _build_chunk_sse(self, request_id="", content=None, model=None, role=None, finish_reason=None, **kwargs):
        kwargs["usage"] = self._usage(kwargs.get("usage"), request_id)
        return super()._build_chunk_sse(request_id, content, model, role, finish_reason, **kwargs)


class TextCompletionHandler(_Prologue, CompletionHandler):
    """Completions, with a prompt of text or of token ids."""

    check = staticmethod(requests.check_completion)
    scores = True

    def prepare(self, body: dict) -> None:
        ids = requests.prompt_ids(body)
        if ids is not None:  # transformers' handler tokenises a string: the ids ride on one to the tokenizer
            body["prompt"] = _IdsPrompt(ids)

    def _build_chunk_sse(self, request_id, model_id, text="", finish_reason=None, usage=None):
        return super()._build_chunk_sse(request_id, model_id, text, finish_reason, self._usage(usage, request_id))

    async def _non_streaming(self, request_id, *args, **kwargs):
        """transformers' response, with what its handler leaves out: the cached tokens in its usage, the prompt
        before the answer (`echo`) and the tokens' log-probabilities (`logprobs`)."""
        asked = _request.get() or {}
        response = await super()._non_streaming(request_id, *args, **kwargs)
        job = self.generation_state.manager.pop_job(request_id)
        if job is None:
            return response
        body = json.loads(response.body)
        body["usage"]["prompt_tokens_details"] = {"cached_tokens": job.cached_tokens}
        result, choice = job.future.result(), body["choices"][0]
        tokenizer = self.model_manager.load_model_and_processor(None)[1]
        prompt_text = tokenizer.decode(job.ids) if asked.get("echo") else ""
        choice["text"] = prompt_text + choice["text"]
        if result.scores is not None:
            start = 0 if asked.get("echo") else len(job.ids)
            choice["logprobs"] = responses.logprobs(tokenizer, result.scores, start)
        return JSONResponse(body)


class _IdsPrompt(str):
    """A prompt given as token ids, carried through transformers' handler (which tokenises a string): the served
    tokenizer answers it with the ids themselves (`_TakesIds`)."""

    def __new__(cls, ids: list[int]):
        self = super().__new__(cls, "")
        self.ids = ids
        return self


class _TakesIds:
    """Mixed into the served tokenizer's class: an `_IdsPrompt` tokenises to its ids, any other text as before."""

    def __call__(self, text=None, *args, **kwargs):
        if isinstance(text, _IdsPrompt):
            ids = torch.tensor([text.ids])
            return BatchEncoding({"input_ids": ids, "attention_mask": torch.ones_like(ids)})
        return super().__call__(text, *args, **kwargs)


def takes_ids(tokenizer):
    """The server's own tokenizer object, made to take `_IdsPrompt`s (its class, with `_TakesIds` first)."""
    cls = type(tokenizer)
    tokenizer.__class__ = type(cls.__name__, (_TakesIds, cls), {})
    return tokenizer


def _fitting_response_template(processor, model):
    """transformers' response template for parsing a chat answer, where it fits the model's chat template.

    Its fallback is chosen by model type alone (every `qwen2` gets Qwen's `<|im_start|>assistant` parser), so a
    model of that type with a chat template of its own (needle-lm's, plain text) would have its prompt parsed back
    into its answer. A fallback whose start anchor the chat template never writes is not used: the answer is the
    decoded text, as for a model with no response template."""
    template = _family_response_template(processor, model)
    tokenizer = getattr(processor, "tokenizer", processor)
    if template is None or getattr(tokenizer, "response_template", None) is not None:
        return template
    anchor = template.get("start_anchor")
    return template if anchor is None or anchor.strip() in (getattr(tokenizer, "chat_template", None) or "") else None


_family_response_template = serving_utils.get_response_template


def _tokenizer_routes(app, tokenizer, limit: int | None) -> None:
    """/tokenize, /detokenize and /tokenizer_info, as vLLM answers them: lm-eval's `local-completions` probes
    them and, finding them, tokenises through the server (the served tokenizer, whatever the client has)."""

    @app.post("/tokenize")
    def tokenize(body: dict):
        text = body.get("prompt")
        if not isinstance(text, str):
            raise requests.BadRequest("'prompt' must be a string.", "prompt")
        ids = tokenizer(text, add_special_tokens=bool(body.get("add_special_tokens", True))).input_ids
        return {"tokens": ids, "count": len(ids), "max_model_len": limit}

    @app.post("/detokenize")
    def detokenize(body: dict):
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and 0 <= t < len(tokenizer) for t in ids):
            raise requests.BadRequest(f"'tokens' must be a list of token ids below {len(tokenizer)}.", "tokens")
        return {"prompt": tokenizer.decode(ids)}

    @app.get("/tokenizer_info")
    def tokenizer_info():
        names = ("eos_token", "bos_token", "pad_token", "unk_token", "chat_template")
        return {
            **{name: getattr(tokenizer, name, None) for name in names},
            "model_max_length": limit,
            "tokenizer_class": type(tokenizer).__mro__[2].__name__,
        }


def make_app(model, tokenizer, name: str, lockstep: Lockstep, api_key: str | None = None, max_body: int = 0):
    """The FastAPI app rank 0 serves: transformers' own, over the lockstep loop."""
    serving_utils.get_response_template = _fitting_response_template  # read by its chat handler's parsers
    manager = KeptModelManager(model, takes_ids(tokenizer), name)
    state = LockstepState(lockstep)
    chat, completion = ChatHandler(manager, state), TextCompletionHandler(manager, state)
    app = build_server(manager, chat, completion, None, None, None, state)
    _tokenizer_routes(app, tokenizer, max_positions(model))
    app.router.routes[:] = [r for r in app.router.routes if getattr(r, "path", None) in SERVED]
    requests.install_errors(app, api_key=api_key, max_body=max_body, healthy=lambda: lockstep.healthy)
    return app
