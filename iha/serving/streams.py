"""What the engines of `iha serve` (`iha.serving.engines`) take and give back: a checked request (prompt token ids, a
number of new tokens, how to sample) and a `TokenStream` of its new token ids, which the consumer reads as they come
and can cancel at any time; and the two ways a request ends early (`GenerationFailed`, `GenerationCancelled`).
"""

import asyncio
from dataclasses import dataclass


class GenerationFailed(Exception):
    """The engine failed on a request (the message says why; the traceback is in the log)."""


class GenerationCancelled(Exception):
    """The server cancelled the request itself (it is stopping)."""


@dataclass(frozen=True)
class Sampling:
    """How a request picks its tokens: greedily, or sampled at `temperature` from the `top_p` nucleus (and the
    `top_k` most likely tokens, when the model's generation config sets it)."""

    greedy: bool
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None


def resolve_sampling(temperature: float | None, top_p: float | None, defaults) -> Sampling:
    """A request's sampling: `temperature` 0 is greedy and any other samples; a request that names neither takes the
    model's generation config (`defaults`: greedy unless it samples, as SmolLM2's does not), and one that names only
    `top_p` samples at temperature 1, OpenAI's default."""
    if temperature is None and top_p is None:
        if not defaults.do_sample:
            return Sampling(greedy=True)
        return Sampling(
            greedy=False,
            temperature=defaults.temperature if defaults.temperature is not None else 1.0,
            top_p=defaults.top_p if defaults.top_p is not None else 1.0,
            top_k=defaults.top_k or None,
        )
    if temperature == 0:
        return Sampling(greedy=True)
    return Sampling(
        greedy=False,
        temperature=1.0 if temperature is None else float(temperature),
        top_p=1.0 if top_p is None else float(top_p),
        top_k=defaults.top_k or None,
    )


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    input_ids: list[int]
    max_new_tokens: int
    sampling: Sampling
    seed: int | None = None


class TokenStream:
    """One request's new tokens, from an engine to the route answering it. Lives on the event loop: engines push
    from there (`loop.call_soon_threadsafe` from their threads)."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        # True once the engine has nothing more to say: ended, failed, or cancelled.
        self.done = False
        self._events: asyncio.Queue = asyncio.Queue()
        self._on_cancel = None

    # The engine's side.
    def push(self, token_ids: list[int]) -> None:
        if not self.done:
            self._events.put_nowait(("tokens", token_ids))

    def end(self) -> None:
        self._close(("end", None))

    def fail(self, message: str) -> None:
        self._close(("failed", message))

    def _close(self, event) -> None:
        if not self.done:
            self.done = True
            self._on_cancel = None
            self._events.put_nowait(event)

    # The server's side.
    def abort(self, reason: str) -> None:
        """The server cancels the request (it is stopping): the engine stops, the consumer gets GenerationCancelled."""
        on_cancel = self._on_cancel
        self._close(("cancelled", reason))
        if on_cancel is not None:
            on_cancel()

    # The consumer's side.
    async def next(self) -> list[int] | None:
        """The next new tokens, or None at the end; GenerationFailed / GenerationCancelled if the engine says so."""
        kind, value = await self._events.get()
        if kind == "tokens":
            return value
        if kind == "failed":
            raise GenerationFailed(value)
        if kind == "cancelled":
            raise GenerationCancelled(value)
        return None

    def cancel(self) -> None:
        """The consumer wants no more tokens: the engine stops working on the request. Idempotent."""
        self.done = True
        on_cancel, self._on_cancel = self._on_cancel, None
        if on_cancel is not None:
            on_cancel()


def eos_token_ids(generation_config) -> list[int]:
    eos = generation_config.eos_token_id
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


__all__ = [
    "GenerationCancelled",
    "GenerationFailed",
    "GenerationRequest",
    "Sampling",
    "TokenStream",
    "eos_token_ids",
    "resolve_sampling",
]
