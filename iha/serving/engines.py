"""The two engines behind `iha serve`: `generate()` one request at a time, or transformers' continuous batching.

Both take a checked request (prompt token ids, a number of new tokens, how to sample) and give back a `TokenStream`
(both in `iha.serving.streams`):
new token ids as they come, then the end, or the failure. The consumer can cancel a stream at any time (the client
left, a stop sequence was reached, the request timed out, the server is stopping) and the engine stops working on it:
`generate()` at its next token, continuous batching by cancelling the request in its scheduler, which frees its pages.

- `GenerateEngine` runs `model.generate()` on one worker thread, one request after the other (the worker of
  transformers' own server does the same). A request that fails is logged with its traceback and answered as failed;
  the worker goes on with the next one.
- `BatchingEngine` runs transformers' `ContinuousBatchingManager` (`model.init_continuous_batching`), which schedules
  every request on one paged cache. The engine has one decoding for all its requests, fixed when it starts
  (transformers' server fixes it from whichever request comes first, and answers every later request with it): greedy
  (argmax, the tokens `generate()` decodes), or, with `sampling`, per-request sampling (`per_request_processors`:
  each request's `temperature`, `top_p` and `top_k`; a greedy request samples its single most likely token, `top_k`
  1, which is its argmax). Sampling costs two sorts of the vocabulary per request at every step (on this project's
  loaded 2-core CPU, 100 tokens of a tiny model took 58 s against 13 s greedy), hence greedy unless asked. If the
  engine's worker dies (transformers fails every request it holds), `supervise` starts a fresh one; the server exits
  if that fails too.
"""

import asyncio
import copy
import logging
import queue
import threading
import time

import torch

from .streams import (
    GenerationFailed,
    GenerationRequest,
    Sampling,
    TokenStream,
    eos_token_ids,
)


logger = logging.getLogger("iha.serving")

# Seconds to wait for the batching engine's worker to build its cache, and for a worker to finish its step and stop
# (a stopping server exits without it after that: `iha.serving.server.main`).
ENGINE_START_SECONDS = 300
ENGINE_STOP_SECONDS = 2


class _Cancelled(Exception):
    """Raised inside `generate()` (by its streamer) to stop a cancelled request at its next token."""


class _Job:
    """A request on the generate worker: its stream, the loop to push to, and its cancellation flag."""

    def __init__(self, request: GenerationRequest, stream: TokenStream, loop: asyncio.AbstractEventLoop):
        self.request = request
        self.stream = stream
        self.loop = loop
        self.cancelled = threading.Event()

    def send(self, method, *args) -> None:
        try:
            self.loop.call_soon_threadsafe(method, *args)
        except RuntimeError:  # the loop is closed: the server has stopped
            self.cancelled.set()


class _JobStreamer:
    """The streamer `generate()` calls: its first call is the prompt, then each step's new token."""

    def __init__(self, job: _Job):
        self.job = job
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if self.job.cancelled.is_set():
            raise _Cancelled()
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.job.send(self.job.stream.push, value.reshape(-1).tolist())

    def end(self) -> None:
        pass


class GenerateEngine:
    """`model.generate()` on one worker thread, one request at a time, in the order they come."""

    name = "generate"
    samples = True  # each request's own generation config
    restarts = 0

    def __init__(self, model, generation_config):
        self.model = model
        self.generation_config = generation_config
        self.eos_token_ids = eos_token_ids(generation_config)
        self._jobs: queue.Queue = queue.Queue()
        self._active: dict[str, _Job] = {}
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        # A daemon: a request stuck in a long forward must not keep a stopping server alive.
        self._thread = threading.Thread(target=self._work, name="iha-generate", daemon=True)
        self._thread.start()

    def worker_thread(self) -> threading.Thread | None:
        return self._thread

    def requests_held(self) -> int:
        """Requests the engine still has: running or waiting their turn."""
        return len(self._active)

    def state(self) -> str:
        return "ok" if self._thread is not None and self._thread.is_alive() else "failed"

    async def submit(self, request: GenerationRequest) -> TokenStream:
        stream = TokenStream(request.request_id)
        job = _Job(request, stream, asyncio.get_running_loop())
        self._active[request.request_id] = job

        def cancel() -> None:
            job.cancelled.set()
            self._active.pop(request.request_id, None)

        stream._on_cancel = cancel
        self._jobs.put(job)
        return stream

    def cancel_all(self, reason: str) -> None:
        for job in list(self._active.values()):
            job.stream.abort(reason)

    async def supervise(self) -> None:
        # The worker catches every failure of a request; should the thread end anyway, start another.
        if self._thread is not None and not self._thread.is_alive():
            logger.error("the generate worker stopped; starting a new one")
            self.start()
            self.restarts += 1

    def stop(self) -> None:
        self.cancel_all("the server is stopping")
        self._jobs.put(None)
        if self._thread is not None:
            self._thread.join(timeout=ENGINE_STOP_SECONDS)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job.cancelled.is_set():
                continue
            try:
                self._generate(job)
            except _Cancelled:
                continue
            except Exception as error:
                logger.error("request %s failed in generate()", job.request.request_id, exc_info=True)
                job.send(job.stream.fail, f"{type(error).__name__}: {error}")
            else:
                job.send(job.stream.end)
            finally:
                job.send(self._active.pop, job.request.request_id, None)

    def _generation_config(self, request: GenerationRequest):
        config = copy.deepcopy(self.generation_config)
        config.max_new_tokens = request.max_new_tokens
        config.max_length = None
        config.num_return_sequences = 1
        if request.sampling.greedy:
            config.do_sample = False
            config.temperature = config.top_p = config.top_k = None
        else:
            config.do_sample = True
            config.temperature = request.sampling.temperature
            config.top_p = request.sampling.top_p
            config.top_k = request.sampling.top_k
        if config.pad_token_id is None:
            eos = eos_token_ids(config)
            config.pad_token_id = eos[0] if eos else 0
        return config

    @torch.no_grad()
    def _generate(self, job: _Job) -> None:
        request = job.request
        if request.seed is not None and not request.sampling.greedy:
            torch.manual_seed(request.seed)  # only this thread generates: the seed makes the request reproducible
        input_ids = torch.tensor([request.input_ids], device=self.model.device)
        self.model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            generation_config=self._generation_config(request),
            streamer=_JobStreamer(job),
        )


def cache_capacity_tokens(cache) -> int | None:
    """How many tokens one request can keep in the paged cache: the pages of its full-attention layers (a sliding
    layer keeps only its window, in a ring of pages). None for a model of sliding layers only."""
    capacities = [
        allocator.tokens_per_page * allocator.num_blocks
        for name, allocator in cache.cache_allocators.items()
        if "sliding" not in name
    ]
    return min(capacities) if capacities else None


class EngineStartError(RuntimeError):
    """The batching engine's worker failed while building its cache."""


class BatchingEngine:
    """transformers' continuous batching: greedy (or per-request sampling), cancellation, a restarted worker."""

    name = "continuous batching"

    def __init__(self, model, generation_config, continuous_batching_config, sampling: bool = False, on_failure=None):
        self.model = model
        self.samples = sampling
        self.continuous_batching_config = copy.deepcopy(continuous_batching_config)
        self.continuous_batching_config.per_request_processors = sampling
        self.eos_token_ids = eos_token_ids(generation_config) or [-1]
        self.engine_config = self._engine_generation_config(generation_config)
        self.on_failure = on_failure
        self.restarts = 0
        self._manager = None
        self._state = "stopped"
        self._ready = asyncio.Event()
        self._active: dict[str, TokenStream] = {}
        self._stopping = False

    def _engine_generation_config(self, generation_config):
        """The engine's generation config: greedy, or sampling with placeholders every request overrides
        (`temperature`, `top_k`, `top_p`): values that are not 1 make transformers build the processors that read
        them."""
        config = copy.deepcopy(generation_config)
        config.do_sample = self.samples
        if self.samples:
            config.temperature, config.top_k, config.top_p = 0.5, 1, 0.5
        else:
            config.temperature = config.top_k = config.top_p = None
        config.num_return_sequences = 1
        config.eos_token_id = self.eos_token_ids
        return config

    # --- lifecycle ---

    def start(self) -> None:
        """Start the worker and wait until its paged cache is built (EngineStartError if that fails)."""
        self._manager = self._start_manager()
        self._state = "ok"
        self._ready.set()

    def _start_manager(self):
        settings = copy.deepcopy(self.continuous_batching_config)
        manager = self.model.init_continuous_batching(
            generation_config=self.engine_config, continuous_batching_config=settings
        )
        manager.start()
        # The cache is built on the worker's thread: wait for it, or for the worker's failure.
        deadline = time.monotonic() + ENGINE_START_SECONDS
        while manager.batch_processor is None:
            error = manager.background_thread_status.fatal_error
            if error is not None or not manager.is_running() or time.monotonic() > deadline:
                manager.stop(block=True, timeout=ENGINE_STOP_SECONDS)
                raise EngineStartError(f"the continuous batching engine did not start: {error or 'it stopped'}")
            time.sleep(0.01)
        return manager

    @property
    def cache(self):
        return self._manager.batch_processor.cache

    def cache_tokens(self) -> int | None:
        return cache_capacity_tokens(self.cache)

    def cache_bytes(self) -> int:
        return self.cache.cache_tensor.nbytes

    def state(self) -> str:
        """The engine's state: ok, restarting (the worker died and a new one is starting), or failed."""
        if self._state == "ok" and self._worker_died():
            return "restarting"
        return self._state

    def _worker_died(self) -> bool:
        manager = self._manager
        if manager is None or self._stopping:
            return False
        return manager.background_thread_status.fatal_error is not None or not manager.is_running()

    async def supervise(self) -> None:
        """Restart a dead worker (called periodically, and before each request): its requests have failed already
        (transformers fails every request of a dying worker); every later request gets the new worker."""
        if self._state != "ok" or not self._worker_died():
            return
        dead = self._manager
        error = dead.background_thread_status.fatal_error
        logger.error("the continuous batching worker died (%s); starting a new one", error)
        self._state = "restarting"
        self._ready.clear()
        for stream in list(self._active.values()):
            stream.fail(f"the continuous batching engine failed: {error}")
        self._active.clear()
        try:
            await asyncio.to_thread(dead.stop, block=True, timeout=ENGINE_STOP_SECONDS)
            self._manager = await asyncio.to_thread(self._start_manager)
        except Exception as restart_error:
            logger.error("the continuous batching engine could not be restarted", exc_info=True)
            self._state = "failed"
            self._ready.set()
            if self.on_failure is not None:
                self.on_failure(f"the continuous batching engine died and could not be restarted: {restart_error}")
            return
        self.restarts += 1
        self._state = "ok"
        self._ready.set()
        logger.warning("continuous batching restarted (%d restart(s) so far)", self.restarts)

    def cancel_all(self, reason: str) -> None:
        for stream in list(self._active.values()):
            stream.abort(reason)

    def worker_thread(self) -> threading.Thread | None:
        return None if self._manager is None else self._manager._generation_thread

    def requests_held(self) -> int:
        """Requests the engine's scheduler still has (active, waiting, or not yet taken from its queue)."""
        manager = self._manager
        if manager is None or manager.batch_processor is None:
            return 0
        scheduler = manager.batch_processor.scheduler
        return len(scheduler.active_requests) + len(scheduler.waiting_requests) + manager.input_queue.qsize()

    def stop(self) -> None:
        self._stopping = True
        self.cancel_all("the server is stopping")
        if self._manager is not None and self._manager.is_running():
            self._manager.stop(block=True, timeout=ENGINE_STOP_SECONDS, hard_stop=True)

    # --- requests ---

    async def submit(self, request: GenerationRequest) -> TokenStream:
        await self.supervise()
        await self._ready.wait()
        if self._state != "ok":
            raise GenerationFailed("the continuous batching engine has failed; the server is stopping")
        manager = self._manager
        stream = TokenStream(request.request_id)
        received = 0

        def on_output(output) -> None:
            # Called on the event loop with the request's tokens so far (transformers' OutputRouter).
            nonlocal received
            if stream.done:
                return
            new_tokens = output.generated_tokens[received:]
            received = len(output.generated_tokens)
            if new_tokens:
                stream.push(list(new_tokens))
            if output.error is not None:
                self._active.pop(request.request_id, None)
                stream.fail(f"the continuous batching engine failed on the request: {output.error}")
            elif output.is_finished():
                self._active.pop(request.request_id, None)
                stream.end()

        def cancel() -> None:
            self._active.pop(request.request_id, None)
            manager.cancel_request(request.request_id)
            # A cancelled request gets no last output, so its handler would stay registered.
            with manager.output_router._lock:
                manager.output_router.result_handlers.pop(request.request_id, None)

        # The handler before the request: a fast request could otherwise finish before anyone listens.
        manager.register_result_handler(request.request_id, on_output)
        added = manager.add_request(
            request.input_ids,
            request_id=request.request_id,
            max_new_tokens=request.max_new_tokens,
            streaming=True,
            eos_token_id=self.eos_token_ids,
            **self._sampling_arguments(request.sampling),
        )
        if added is None:  # the worker died between the check and now
            cancel()
            raise GenerationFailed("the continuous batching engine stopped while taking the request")
        stream._on_cancel = cancel
        self._active[request.request_id] = stream
        return stream

    def _sampling_arguments(self, sampling: Sampling) -> dict:
        if not self.samples:
            return {}
        if sampling.greedy:
            return {"temperature": 1.0, "top_k": 1, "top_p": 1.0}
        vocab_size = self.model.config.get_text_config().vocab_size
        top_k = min(sampling.top_k or vocab_size, vocab_size)
        return {"temperature": float(sampling.temperature), "top_k": int(top_k), "top_p": float(sampling.top_p)}


__all__ = ["BatchingEngine", "EngineStartError", "GenerateEngine"]
