"""Every rank runs every generate call together: rank 0 plans each one, sends the whole plan, then all run it.

The HTTP server lives on rank 0 only; `generate()` of a context-parallel model is a collective, so every rank
must enter it with the same inputs, the same settings and the same cache, and leave it at the same step. The
plan rank 0 sends before any collective (`Call`) holds everything that decides which collectives run: the token
ids, the generation config and the seed, which kept conversation it continues and how much of it, which ones are
evicted. No rank decides anything alone:

- **stopping**: a stop bit is agreed at every decode step and, in a prefill, before every decoder layer (`StopBit`,
  one small broadcast from rank 0): a client gone ends the generation on every rank at the same point;
- **sampling**: every rank seeds torch's generator with the plan's seed (rank 0 draws one when the request has
  none), so every rank draws the same tokens, and they equal one process's with that seed;
- **idle**: a rank waits for the next plan inside a broadcast; rank 0 sends an idle beat every `beat` seconds, so
  a follower hears from it well within the timeout, and a rank that died ends the others' wait with an error
  within it (`timeout`), never a hang.

The control messages travel on a gloo group of their own, whatever the model's device.
"""

from __future__ import annotations

import dataclasses
import queue
import random
import threading
from concurrent.futures import Future
from datetime import timedelta

import torch
import torch.distributed as dist
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from ...api import get_runtime
from ...cache import cache_argument, returned_cache
from ...models import max_positions
from .conversations import Conversations, Reuse


@dataclasses.dataclass
class Call:
    """One generate call, as every rank runs it (rank 0 makes it; `Lockstep.share` sends it)."""

    ids: list[int]
    generation: dict  # GenerationConfig.to_diff_dict() of the request's config
    seed: int
    reuse: Reuse | None = None
    evict: list = dataclasses.field(default_factory=list)
    scores: int | None = None  # the prompt's and the answer's log-probabilities, with this many top alternatives


IDLE, STOP = "idle", "stop"  # the other messages: nothing to do yet; the server is going down


@dataclasses.dataclass
class Job:
    """A request waiting for rank 0's loop: its inputs, and where its result goes."""

    ids: list[int]
    generation: GenerationConfig
    seed: int | None
    streamer: object = None
    future: Future = dataclasses.field(default_factory=Future)
    cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)
    cached_tokens: int = 0
    scores: int | None = None


@dataclasses.dataclass
class Result:
    sequences: torch.Tensor  # (1, prompt + new)
    prompt_tokens: int
    cached_tokens: int
    scores: dict | None = None  # `scored`: per token of prompt and answer, its log-probability and the top ones


class Unavailable(Exception):
    """No request is taken now (the queue holds --max-queue already, the server is stopping, or a rank failed):
    the server answers 503 with Retry-After."""


class Lockstep:
    """The loop every rank runs (`run_forever`); rank 0's HTTP threads hand it jobs (`submit`)."""

    def __init__(self, model, tokenizer, *, budget: int, max_queue: int, timeout: float, beat: float = 1.0):
        self.model, self.tokenizer = model, tokenizer
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout)) if self.world > 1 else None
        self.conversations = Conversations(budget)
        self.checkpoints = prefill_checkpoints(model)
        self.jobs: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self.beat, self.stopping = beat, threading.Event()
        self.healthy = True
        self.failure: BaseException | None = None

    # -- rank 0's side: requests in --------------------------------------------------------------------------
    def submit(self, job: Job) -> Job:
        if not self.healthy:
            raise Unavailable(f"a rank of the server failed ({type(self.failure).__name__}); it is going down")
        if self.stopping.is_set():
            raise Unavailable("the server is shutting down")
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise Unavailable(f"{self.jobs.maxsize} requests are already waiting") from None
        return job

    def stop(self) -> None:
        """Stop taking requests; the loop ends what runs, tells every rank and returns."""
        self.stopping.set()

    # -- every rank ----------------------------------------------------------------------------------------
    def measure(self) -> None:
        """Before the first request: the KV that two short prompts leave on this rank, fitted as a fixed part plus
        a part per token (`Footprint`), so a request whose KV alone would exceed the budget is refused before
        it runs, the first one included. Every rank makes the same two calls (no plan to share)."""
        vocab = self.model.config.get_text_config(decoder=True).vocab_size
        limit = max_positions(self.model) or 2**31
        sizes = sorted({min(32 * n * self.world, limit - 2) for n in (1, 2)})
        measured = []
        for n in sizes:
            ids = torch.tensor([[(7 * i + 3) % vocab for i in range(n)]], device=self.model.device)
            config = GenerationConfig(max_new_tokens=1, do_sample=False, return_dict_in_generate=True)
            with torch.no_grad():
                out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
            cache = returned_cache(out)
            measured.append((cache.get_seq_length(), _cache_bytes(cache)) if cache is not None else (n, 0))
        footprint = self.conversations.footprint
        (t1, b1), (t2, b2) = measured[0], measured[-1]
        footprint.per_token = max(0.0, (b2 - b1) / (t2 - t1)) if t2 > t1 else b1 / max(t1, 1)
        footprint.fixed = max(0.0, b1 - footprint.per_token * t1)

    def share(self, message):
        """Rank 0's message on every rank (a broadcast on the control group; one process: itself)."""
        if self.group is None:
            return message
        box = [message]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def run_forever(self) -> None:
        """Plan (rank 0), share and run calls until rank 0 says stop. A failure of the collectives (a rank that
        died) marks the server unhealthy, fails the request in flight and re-raises: the process exits non-zero."""
        job = None
        try:
            while True:
                job = self._next_job() if self.rank == 0 else None
                message = self.share(self._plan(job) if job is not None else STOP if self._done() else IDLE)
                if message == STOP:
                    return
                if message != IDLE:
                    self._run(message, job)
                job = None
        except BaseException as e:
            self.healthy, self.failure = False, e
            if job is not None and not job.future.done():
                job.future.set_exception(e)
            self._fail_waiting(e)
            raise

    def _done(self) -> bool:
        return self.stopping.is_set() and self.jobs.empty()

    def _next_job(self) -> Job | None:
        """The next request still wanted (one whose client left while it waited fails here, on rank 0 alone: the
        other ranks never heard of it)."""
        while True:
            try:
                job = self.jobs.get(timeout=0 if self.stopping.is_set() else self.beat)
            except queue.Empty:
                return None
            if not job.cancelled.is_set():
                return job
            job.future.set_exception(RequestCancelled("the client went away before its request ran"))

    def _fail_waiting(self, e: BaseException) -> None:
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            job.future.set_exception(e)

    def _plan(self, job: Job) -> Call:
        """Rank 0: the call every rank runs for this job."""
        reuse, evict = self.conversations.plan(job.ids, job.generation.max_new_tokens or 0)
        if job.scores is not None:
            reuse = None  # every prompt token's logits come from the call's own forward (`_score`)
        seed = job.seed if job.seed is not None else random.SystemRandom().randrange(2**63)
        job.cached_tokens = reuse.tokens if reuse is not None else 0
        return Call(job.ids, job.generation.to_diff_dict(), seed, reuse, evict, job.scores)

    def _run(self, call: Call, job: Job | None) -> None:
        """One call, on every rank: its cache out of the table, the prompt scored (if asked), generate, the
        conversation kept. An exception is the same on every rank (same plan): the request fails, the loop goes on."""
        self.conversations.evict(call.evict)
        cache = self.conversations.take(call.reuse)
        ids = torch.tensor([call.ids], device=self.model.device)
        torch.manual_seed(call.seed)
        stop = StopBit(self, job)
        hooks = [layer.register_forward_pre_hook(stop.before_layer) for layer in self.checkpoints]
        try:
            with torch.no_grad():
                prompt_logits, cache = self._score(ids, cache) if call.scores is not None else (None, cache)
                out = self.model.generate(**self._generate_kwargs(call, ids, cache, job, stop))
        except Exception as e:
            if isinstance(e, PrefillCancelled) and self.rank == 0:
                print(f"request cancelled: {e}", flush=True)
            if job is not None:
                job.future.set_exception(e)
            return
        finally:
            for hook in hooks:
                hook.remove()
        self._keep(out.sequences[0].tolist(), returned_cache(out))
        if job is not None:
            result = Result(out.sequences, len(call.ids), call.reuse.tokens if call.reuse is not None else 0)
            if call.scores is not None:
                result.scores = scored(call.ids, prompt_logits, out, call.scores)
            job.future.set_result(result)

    def _score(self, ids, cache):
        """The prompt's logits, every rank's (gathered): one forward over all its tokens but the last, whose cache
        generate continues (it prefills the last token). A scored call reuses no conversation: every prompt
        token's logits come from this forward."""
        if ids.shape[1] < 2:
            return None, cache
        out = self.model(ids[:, :-1], use_cache=True)
        return out.logits, returned_cache(out)

    def _generate_kwargs(self, call: Call, ids, cache, job: Job | None, stop: StopBit) -> dict:
        config = GenerationConfig.from_dict(call.generation)
        config.return_dict_in_generate, config.output_logits = True, call.scores is not None
        kwargs = dict(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            generation_config=config,
            stopping_criteria=StoppingCriteriaList([stop]),
            tokenizer=self.tokenizer,  # stop strings: every rank checks them alike
        )
        if cache is not None:
            kwargs[cache_argument(self.model)] = cache
        if job is not None and job.streamer is not None:
            kwargs["streamer"] = job.streamer
        return kwargs

    def _keep(self, tokens: list[int], cache) -> None:
        """The finished call's conversation: the tokens its cache holds (its prompt and all but the last new one)."""
        if cache is None:
            return
        self.conversations.keep(tokens[: cache.get_seq_length()], cache, _cache_bytes(cache))


class RequestCancelled(Exception):
    """The client went away: its request stopped (or never started) on every rank alike."""


class PrefillCancelled(RequestCancelled):
    """The client went away while its prompt was prefilled: every rank stopped before the same layer."""


class StopBit(StoppingCriteria):
    """Rank 0's stop bit (its client went away), agreed by every rank at the same points, so that none is left
    inside a collective the others never enter: after every new token (as generate's stopping criterion), and while
    the prompt is prefilled before every decoder layer (`before_layer`, a forward pre-hook), so a long prefill stops
    within a layer of the disconnect instead of running to its end."""

    def __init__(self, lockstep: Lockstep, job: Job | None):
        self.lockstep, self.job, self.prefilling = lockstep, job, True

    def agreed(self) -> bool:
        stop = self.job is not None and self.job.cancelled.is_set()
        if self.lockstep.group is not None:
            flag = torch.tensor([int(stop)], dtype=torch.uint8)
            dist.broadcast(flag, src=0, group=self.lockstep.group)
            stop = bool(flag.item())
        return stop

    def __call__(self, input_ids, scores, **kwargs):
        self.prefilling = False  # generate asks after each new token: the prefill is over
        return torch.full((input_ids.shape[0],), self.agreed(), dtype=torch.bool, device=input_ids.device)

    def before_layer(self, module, args):
        if self.prefilling and self.agreed():
            raise PrefillCancelled(f"the client went away; the prefill stopped before layer {module.hf_contextpar_at}")


def prefill_checkpoints(model) -> list:
    """The decoder layers a prefill may stop before (`StopBit.before_layer`): the model's list of its hidden
    layers. None where a check between layers would cost the prefill its overlap: a model whose recurrent states
    pass down the ranks, and KV-Runahead and CSA, which run ahead of the other ranks a layer at a time (every rank
    would wait for the slowest at each layer's check); there a prefill stops at its first new token."""
    runtime = get_runtime(model)
    if runtime is not None and (
        runtime.patched.chain or runtime.settings.strategy == "kv_runahead" or runtime.settings.sparse is not None
    ):
        return []
    count = getattr(model.config.get_text_config(decoder=True), "num_hidden_layers", None)
    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == count:
            for i, layer in enumerate(module):
                layer.hf_contextpar_at = i
            return list(module)
    return []


def scored(ids: list[int], prompt_logits, out, top: int) -> dict:
    """Log-probabilities of the prompt's tokens (the first has none) and of the new ones, each with the `top`
    likeliest tokens at its place: OpenAI's completions `logprobs` (lm-eval's loglikelihood reads them)."""
    new = out.sequences[0, len(ids) :].tolist()
    rows = [] if prompt_logits is None else list(prompt_logits[0].float().log_softmax(-1))
    rows += [step[0].float().log_softmax(-1) for step in out.logits[: len(new)]]
    tokens = ids + new
    token_logprobs, tops = [None], [None]
    for row, token in zip(rows, tokens[1:]):
        token_logprobs.append(float(row[token]))
        values, where = row.topk(top) if top else (row[:0], row[:0].long())
        tops.append(list(zip(where.tolist(), values.tolist())))
    return dict(tokens=tokens, token_logprobs=token_logprobs, top=tops)


def _cache_bytes(cache) -> int:
    """Bytes of this rank's share of a cache (a sharded one counts its own; a stock one, one process's K/V)."""
    if hasattr(cache, "local_nbytes"):
        return cache.local_nbytes()
    total = 0
    for layer in getattr(cache, "layers", ()):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total
