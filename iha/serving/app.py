"""The HTTP side of `iha serve`: the routes, and the way every generation request goes through them.

    POST /v1/chat/completions, /v1/completions    GET /v1/models, /v1/models/{model}, /health

A generation request is answered in this order, each step refusing before any later work starts: the API key (401),
the JSON and every field (400, `iha.serving.validation`), the model's name (404), a slot among the requests in flight
(429), the prompt's tokens against the per-request limit (400, `iha.serving.limits`); then the engine generates, and
the request ends when it is finished, when the client leaves (its generation is cancelled and its slot freed), when it
runs past `--request_timeout` (504), or when the server stops (503). A failure of the engine or the server is a 500
with a message, logged with its traceback; the next request is served as usual.

`/v1/models` lists the one model served, by the name it was given to `iha serve` (a request may name it so, in any
spelling of the same folder, or leave `model` out); the server never looks at a Hugging Face cache.
`/health` is 200 `{"status": "ok"}` only while the engine can take requests, 503 while it restarts or the server stops.
"""

import asyncio
import logging
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from .admission import APIKeyCheck, RequestSlots
from .engines import GenerationCancelled, GenerationFailed, GenerationRequest, resolve_sampling
from .errors import SERVER_ERROR, APIError, bad_request, install_error_handlers, server_failure
from .limits import TokenLimit, completion_budget
from .responses import (
    STREAM_END,
    CompletionText,
    chat_chunk,
    chat_completion,
    server_sent_event,
    text_completion,
    usage,
    usage_chunk,
)
from .validation import ChatCompletionRequest, CompletionRequest, parse_request


logger = logging.getLogger("iha.serving")

# How often a waiting non-streamed request checks whether its client is still there, and the engine its worker.
DISCONNECT_POLL_SECONDS = 0.5
SUPERVISE_SECONDS = 0.5


def folder_key(name: str) -> str | None:
    """The resolved path of `name` when it is a local folder (any spelling of it), else None."""
    try:
        path = Path(name).expanduser()
        return str(path.resolve()) if path.is_dir() else None
    except (OSError, ValueError):
        return None


@dataclass
class ServedModel:
    """The model a server serves: its name as given to `iha serve`, its tokenizer and defaults, its limit."""

    name: str
    tokenizer: object
    generation_config: object
    vocab_size: int
    limit: TokenLimit
    created: int
    owned_by: str
    folder: str | None = None

    @classmethod
    def describe(cls, name: str, tokenizer, generation_config, vocab_size: int, limit: TokenLimit) -> "ServedModel":
        folder = folder_key(name)
        if folder is not None:
            config = Path(folder) / "config.json"
            created = int(config.stat().st_mtime) if config.is_file() else int(time.time())
            owned_by = "local"
        else:
            created, owned_by = int(time.time()), name.partition("/")[0] if "/" in name else "local"
        return cls(name, tokenizer, generation_config, vocab_size, limit, created, owned_by, folder)

    def named_by(self, name: str | None) -> bool:
        """Whether a request's `model` names this model: left out, as given, or another spelling of its folder."""
        if name is None or name == self.name:
            return True
        return self.folder is not None and folder_key(name) == self.folder

    def card(self) -> dict:
        """The model's `/v1/models` entry."""
        return {
            "id": self.name,
            "object": "model",
            "created": self.created,
            "owned_by": self.owned_by,
            "max_model_len": self.limit.tokens,
        }

    def check_named(self, name: str | None) -> None:
        if not self.named_by(name):
            raise APIError(
                404,
                f"The model '{name}' does not exist on this server: it serves '{self.name}' (GET /v1/models), which "
                "requests name as given to iha serve, as another path to the same folder, or leave out.",
                param="model",
                code="model_not_found",
            )


class Service:
    """Everything the routes share: the model, the engine, the slots and the settings, and the server's state."""

    def __init__(self, served: ServedModel, engine, slots: RequestSlots, api_key: str | None, request_timeout: float):
        self.served = served
        self.engine = engine
        self.slots = slots
        self.check_key = APIKeyCheck(api_key)
        self.request_timeout = request_timeout
        self.stopping = False
        self.loop: asyncio.AbstractEventLoop | None = None

    def begin_stop(self) -> None:
        """Stop taking requests and cancel those in flight (on the event loop)."""
        if not self.stopping:
            self.stopping = True
            self.engine.cancel_all("the server is stopping")

    def health(self) -> tuple[int, dict]:
        state = "stopping" if self.stopping else self.engine.state()
        body = {
            "status": state,
            "model": self.served.name,
            "engine": self.engine.name,
            "engine_restarts": self.engine.restarts,
            "requests_in_flight": self.slots.in_use,
            "engine_requests": self.engine.requests_held(),
            "max_model_len": self.served.limit.tokens,
        }
        if hasattr(self.engine, "cache_bytes") and state == "ok":
            body["paged_cache"] = {"tokens": self.engine.cache_tokens(), "bytes": self.engine.cache_bytes()}
        return (200 if state == "ok" else 503), body

    def refuse_if_stopping(self) -> None:
        if self.stopping:
            raise shutting_down()


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
    """One admitted request on its way through the engine: its stream, its text, its deadline, its slot."""

    def __init__(self, service: Service, request_id: str, prompt_tokens: int, stream, text: CompletionText, slot):
        self.service = service
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self.stream = stream
        self.text = text
        self.slot = slot
        self.deadline = time.monotonic() + service.request_timeout

    async def next_text(self) -> str | None:
        """The next piece of text to send (possibly empty), or None once generation is over."""
        if self.text.finished:
            return None
        remaining = self.deadline - time.monotonic()
        try:
            tokens = await asyncio.wait_for(self.stream.next(), timeout=max(remaining, 0))
        except TimeoutError:
            raise timed_out(self.service.request_timeout, len(self.text.token_ids)) from None
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


async def generate(service: Service, request: Request, kind: str) -> Response:
    """A chat (`kind` "chat") or text completion request, from its body to its answer."""
    service.refuse_if_stopping()
    is_chat = kind == "chat"
    parsed = parse_request(await request.body(), ChatCompletionRequest if is_chat else CompletionRequest)
    served = service.served
    served.check_named(parsed.model)
    sampling = resolve_sampling(parsed.temperature, parsed.top_p, served.generation_config)
    if not sampling.greedy and not service.engine.samples:
        param = "temperature" if parsed.temperature is not None else "top_p"
        raise bad_request(
            f"Unsupported '{param}' {getattr(parsed, param)}: this server's continuous batching decodes greedily (one "
            "decoding for the whole batch, fixed when the server starts). Send temperature 0 or leave it out, or "
            "start iha serve with --cb_sampling to let requests sample.",
            param=param,
            code="unsupported_value",
        )
    if parsed.seed is not None and not sampling.greedy and service.engine.name == "continuous batching":
        raise bad_request(
            "Unsupported 'seed' for a sampled request under continuous batching: every request of the batch samples "
            "from one generator, so a seed cannot make it reproducible. Leave it out, decode greedily "
            "(temperature 0), or serve without --continuous_batching.",
            param="seed",
            code="unsupported_parameter",
        )
    request_id = f"{'chatcmpl' if is_chat else 'cmpl'}-{uuid.uuid4().hex}"
    prompt_param = "messages" if is_chat else "prompt"
    slot = service.slots.take()
    try:
        if is_chat:
            prompt_ids = await asyncio.to_thread(chat_prompt_ids, served.tokenizer, parsed)
        else:
            prompt_ids = await asyncio.to_thread(completion_prompt_ids, served.tokenizer, parsed, served.vocab_size)
        max_tokens, max_tokens_param = parsed.requested_max_tokens()
        max_new_tokens = completion_budget(served.limit, len(prompt_ids), max_tokens, max_tokens_param, prompt_param)
        service.refuse_if_stopping()
        job = GenerationRequest(request_id, prompt_ids, max_new_tokens, sampling, parsed.seed)
        try:
            stream = await service.engine.submit(job)
        except GenerationFailed as error:
            raise engine_failed(str(error)) from None
    except BaseException:
        slot.release()
        raise
    logger.info(
        "%s: %d prompt tokens, up to %d new (%s)", request_id, len(prompt_ids), max_new_tokens, service.engine.name
    )
    text = CompletionText(served.tokenizer, parsed.stop, service.engine.eos_token_ids, max_new_tokens)
    generation = Generation(service, request_id, len(prompt_ids), stream, text, slot)
    if parsed.stream:
        include_usage = bool(parsed.stream_options and parsed.stream_options.include_usage)
        chunks = (ChatChunks if is_chat else CompletionChunks)(request_id, served.name, include_usage)
        return StreamingResponse(
            stream_answer(generation, chunks),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        if not await run_to_end(generation, request):
            return Response(status_code=499)  # nobody reads it: the client has gone
    finally:
        generation.close()
    answer = generation.text.full_text()
    finish_reason = generation.text.finish_reason()
    if is_chat:
        return JSONResponse(chat_completion(request_id, served.name, answer, finish_reason, generation.usage()))
    return JSONResponse(text_completion(request_id, served.name, answer, finish_reason, generation.usage()))


def build_app(service: Service) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        service.loop = asyncio.get_running_loop()
        supervisor = asyncio.create_task(supervise(service))
        try:
            yield
        finally:
            supervisor.cancel()

    app = FastAPI(lifespan=lifespan, title="iha serve", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    authorized = [Depends(service.check_key)]

    @app.post("/v1/chat/completions", dependencies=authorized)
    async def chat_completions(request: Request):
        return await generate(service, request, "chat")

    @app.post("/v1/completions", dependencies=authorized)
    async def completions(request: Request):
        return await generate(service, request, "completion")

    @app.get("/v1/models", dependencies=authorized)
    async def list_models():
        return {"object": "list", "data": [service.served.card()]}

    @app.get("/v1/models/{model:path}", dependencies=authorized)
    async def retrieve_model(model: str):
        service.served.check_named(model)
        return service.served.card()

    @app.get("/health")
    async def health():
        status, body = service.health()
        return JSONResponse(body, status_code=status)

    return app


async def supervise(service: Service) -> None:
    """Keep the engine's worker alive (a dead one is replaced even when no request comes to notice it)."""
    while True:
        await asyncio.sleep(SUPERVISE_SECONDS)
        try:
            await service.engine.supervise()
        except Exception:
            logger.error("supervising the engine failed", exc_info=True)


__all__ = ["ServedModel", "Service", "build_app", "folder_key"]
