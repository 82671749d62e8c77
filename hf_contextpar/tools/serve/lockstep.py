"""Every rank runs every generate call together: rank 0 plans each one, sends the whole plan, then all run it.

The HTTP server lives on rank 0 only; `generate()` of a context-parallel model is a collective, so every rank
must enter it with the same inputs, the same settings and the same cache, and leave it at the same step. The
plan rank 0 sends before any collective (`Call`) holds everything that decides which collectives run: the token
ids, the generation config and the seed, which kept conversation it continues and how much of it, which ones are
evicted. No rank decides anything alone:

- **stopping**: a stop bit is agreed at every decode step (`AgreedStop`, one small broadcast from rank 0): a
  client gone, or the server shutting down, ends the generation on every rank at the same step;
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
import time
from concurrent.futures import Future
from datetime import timedelta

import torch
import torch.distributed as dist
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList

from ...cache import cache_argument, returned_cache
from .conversations import Conversations, Reuse


@dataclasses.dataclass
class Call:
    """One generate call, as every rank runs it (rank 0 makes it; `Lockstep.share` sends it)."""

    ids: list[int]
    generation: dict  # GenerationConfig.to_diff_dict() of the request's config
    seed: int
    reuse: Reuse | None = None
    evict: list = dataclasses.field(default_factory=list)


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


@dataclasses.dataclass
class Result:
    sequences: torch.Tensor  # (1, prompt + new)
    prompt_tokens: int
    cached_tokens: int


class QueueFull(Exception):
    """More requests wait than --max-queue allows: the server answers 503 with Retry-After."""


class Lockstep:
    """The loop every rank runs (`run_forever`); rank 0's HTTP threads hand it jobs (`submit`)."""

    def __init__(self, model, tokenizer, *, budget: int, max_queue: int, timeout: float, beat: float = 1.0):
        self.model, self.tokenizer = model, tokenizer
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout)) if self.world > 1 else None
        self.conversations = Conversations(budget)
        self.jobs: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self.beat, self.stopping = beat, threading.Event()
        self.healthy = True
        self.failure: BaseException | None = None

    # -- rank 0's side: requests in --------------------------------------------------------------------------
    def submit(self, job: Job) -> Job:
        if self.stopping.is_set() or not self.healthy:
            raise QueueFull("the server is shutting down")
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise QueueFull(f"{self.jobs.maxsize} requests are already waiting") from None
        return job

    def stop(self) -> None:
        """Stop taking requests; the loop ends what runs, tells every rank and returns."""
        self.stopping.set()

    # -- every rank ----------------------------------------------------------------------------------------
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
        try:
            return self.jobs.get(timeout=0 if self.stopping.is_set() else self.beat)
        except queue.Empty:
            return None

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
        seed = job.seed if job.seed is not None else random.SystemRandom().randrange(2**63)
        job.cached_tokens = reuse.tokens if reuse is not None else 0
        return Call(job.ids, job.generation.to_diff_dict(), seed, reuse, evict)

    def _run(self, call: Call, job: Job | None) -> None:
        self.conversations.evict(call.evict)
        cache = self.conversations.take(call.reuse)
        ids = torch.tensor([call.ids], device=self.model.device)
        config = GenerationConfig.from_dict(call.generation)
        kwargs = dict(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            generation_config=config,
            stopping_criteria=StoppingCriteriaList([AgreedStop(self, job)]),
            return_dict_in_generate=True,
            tokenizer=self.tokenizer,  # stop strings: every rank checks them alike
        )
        if cache is not None:
            kwargs[cache_argument(self.model)] = cache
        if job is not None and job.streamer is not None:
            kwargs["streamer"] = job.streamer
        torch.manual_seed(call.seed)
        start = time.perf_counter()
        try:
            with torch.no_grad():
                out = self.model.generate(**kwargs)
        except Exception as e:  # the same on every rank (same plan): the request fails, the server goes on
            if job is not None:
                job.future.set_exception(e)
            return
        kept = returned_cache(out)
        if kept is not None:
            held = kept.get_seq_length()
            nbytes = kept.local_nbytes() if hasattr(kept, "local_nbytes") else _nbytes(kept)
            self.conversations.keep(out.sequences[0, :held].tolist(), kept, nbytes)
        if job is not None:
            cached = call.reuse.tokens if call.reuse is not None else 0
            job.future.set_result(Result(out.sequences, len(call.ids), cached))
        self.last_seconds = time.perf_counter() - start


class AgreedStop(StoppingCriteria):
    """One bit a decode step, rank 0's: its client went away. Every rank stops at the step
    rank 0 says, so none is left inside a collective the others never enter."""

    def __init__(self, lockstep: Lockstep, job: Job | None):
        self.lockstep, self.job = lockstep, job

    def __call__(self, input_ids, scores, **kwargs):
        stop = self.job is not None and self.job.cancelled.is_set()
        if self.lockstep.group is not None:
            flag = torch.tensor([int(stop)], dtype=torch.uint8)
            dist.broadcast(flag, src=0, group=self.lockstep.group)
            stop = bool(flag.item())
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


def _nbytes(cache) -> int:
    """Bytes of a stock cache's K/V (one process)."""
    total = 0
    for layer in getattr(cache, "layers", ()):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total
