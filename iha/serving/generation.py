"""One admitted generation request of `iha serve` on its way through the engine: its prompt's token ids, the engine's
tokens read as a whole answer or as a stream of chunks, and the errors a running request ends with (503 when the
server stops, 504 past `--request_timeout`, 500 when generation fails). The routes that admit it are in
`iha.serving.app`.
"""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import Request

from .errors import SERVER_ERROR, APIError, bad_request, server_failure
from .responses import STREAM_END, CompletionText, chat_chunk, server_sent_event, text_completion, usage, usage_chunk
from .streams import GenerationCancelled, GenerationFailed
from .validation import ChatCompletionRequest, CompletionRequest


logger = logging.getLogger("iha.serving")

# How often a waiting non-streamed request checks whether its client is still there.
DISCONNECT_POLL_SECONDS = 0.5


def shutting_down() -> APIError:
    return APIError(
        503,
        "The server is shutting down: the request was not (or no longer) served. Retry on a running server.",
        type=SERVER_ERROR,
        code="server_shutting_down",
    )


def timed_out(timeout: float, tokens: int) -> APIError:
    return APIError(
        504,
        f"The request ran past the server's request timeout of {timeout:g} s (--request_timeout) and was cancelled "
        f"after {tokens} generated tokens. Ask for fewer tokens (max_tokens), or raise the timeout.",
        type=SERVER_ERROR,
        code="request_timeout",
    )


def engine_failed(message: str) -> APIError:
    return APIError(
        500,
        f"Generation failed on the server: {message}. The traceback is in the server's log; the server keeps serving.",
        type=SERVER_ERROR,
        code="generation_failed",
    )


# --- prompts ---


def chat_prompt_ids(tokenizer, request: ChatCompletionRequest) -> list[int]:
    """The chat template applied to the messages (and the assistant's turn opened): token ids."""
    if not getattr(tokenizer, "chat_template", None):
        raise bad_request(
            "This model has no chat template, so it cannot take messages; send the prompt text to /v1/completions.",
            param="messages",
            code="no_chat_template",
        )
    messages = [
        {"role": "system" if message.role == "developer" else message.role, "content": message.text()}
        for message in request.messages
    ]
    # jinja2 renders chat templates; it is not a requirement of transformers itself (only of chat templates).
    from jinja2.exceptions import TemplateError

    try:
        encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    except TemplateError as error:
        raise bad_request(f"The model's chat template refused the messages: {error}", param="messages") from None
    return list(encoded["input_ids"])


def completion_prompt_ids(tokenizer, request: CompletionRequest, vocab_size: int) -> list[int]:
    if isinstance(request.prompt, str):
        return list(tokenizer(request.prompt)["input_ids"])
    for index, token_id in enumerate(request.prompt):
        if not 0 <= token_id < vocab_size:
            raise bad_request(
                f"Invalid 'prompt[{index}]': token id {token_id} is outside the model's vocabulary "
                f"(0 to {vocab_size - 1}).",
                param=f"prompt[{index}]",
            )
    return list(request.prompt)


# --- answering ---


class Generation:
    """One admitted request on its way through the engine: its stream, its text, its deadline (`request_timeout`
    seconds from now, the server's `--request_timeout`), its slot."""

    def __init__(self, request_id: str, prompt_tokens: int, stream, text: CompletionText, slot, request_timeout: float):
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.stream = stream
        self.text = text
        self.slot = slot
        self.request_timeout = request_timeout
        self.deadline = time.monotonic() + request_timeout

    async def next_text(self) -> str | None:
        """The next piece of text to send (possibly empty), or None once generation is over."""
        if self.text.finished:
            return None
        remaining = self.deadline - time.monotonic()
        try:
            tokens = await asyncio.wait_for(self.stream.next(), timeout=max(remaining, 0))
        except TimeoutError:
            raise timed_out(self.request_timeout, len(self.text.token_ids)) from None
        except GenerationFailed as error:
            raise engine_failed(str(error)) from None
        except GenerationCancelled:
            raise shutting_down() from None
        if tokens is None:
            return None
        return self.text.add(tokens)

    def usage(self) -> dict:
        return usage(self.prompt_tokens, len(self.text.token_ids))

    def close(self) -> None:
        """Stop the engine's work on the request (if any is left) and free its slot."""
        if not self.stream.done and not self.text.finished:
            logger.info("%s: generation cancelled after %d tokens", self.request_id, len(self.text.token_ids))
        self.stream.cancel()
        self.slot.release()


async def run_to_end(generation: Generation, request: Request) -> bool:
    """Generate the whole answer, watching the client: False if it left (its generation is cancelled)."""

    async def drain() -> None:
        while await generation.next_text() is not None:
            pass

    task = asyncio.ensure_future(drain())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
            if done:
                task.result()  # raises the request's error, if any
                return True
            if await request.is_disconnected():
                logger.info("%s: the client left; its generation is cancelled", generation.request_id)
                return False
    finally:
        task.cancel()


def error_event(error: Exception, request_id: str) -> str:
    if not isinstance(error, APIError):
        logger.error("%s failed while streaming", request_id, exc_info=error)
        error = server_failure("streaming the answer")
    return server_sent_event(error.body())


async def stream_answer(generation: Generation, chunks) -> object:
    """The server-sent events of a streamed answer; always `data: [DONE]` last. `chunks` builds the objects."""
    try:
        try:
            first = chunks.opening()
            if first is not None:
                yield server_sent_event(first)
            while (piece := await generation.next_text()) is not None:
                if piece:
                    yield server_sent_event(chunks.piece(piece))
            rest = generation.text.rest()
            if rest:
                yield server_sent_event(chunks.piece(rest))
            yield server_sent_event(chunks.closing(generation.text.finish_reason()))
            if chunks.include_usage:
                yield server_sent_event(chunks.usage(generation.usage()))
        except Exception as error:
            # The status line went out with the first event: the error goes in the stream, as OpenAI's does.
            yield error_event(error, generation.request_id)
        yield STREAM_END
    finally:
        # Also when the client leaves mid-stream (the stream is cancelled): the generation stops, the slot is free.
        generation.close()


class ChatChunks:
    def __init__(self, request_id: str, model: str, include_usage: bool):
        self.request_id, self.model, self.include_usage = request_id, model, include_usage

    def opening(self) -> dict:
        return chat_chunk(self.request_id, self.model, {"role": "assistant", "content": ""})

    def piece(self, text: str) -> dict:
        return chat_chunk(self.request_id, self.model, {"content": text})

    def closing(self, finish_reason: str) -> dict:
        return chat_chunk(self.request_id, self.model, {}, finish_reason)

    def usage(self, token_usage: dict) -> dict:
        return usage_chunk(self.request_id, self.model, "chat.completion.chunk", token_usage)


class CompletionChunks(ChatChunks):
    def opening(self) -> None:
        return None

    def piece(self, text: str) -> dict:
        return text_completion(self.request_id, self.model, text, None)

    def closing(self, finish_reason: str) -> dict:
        return text_completion(self.request_id, self.model, "", finish_reason)

    def usage(self, token_usage: dict) -> dict:
        return usage_chunk(self.request_id, self.model, "text_completion", token_usage)
