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
An admitted request's way through the engine, as a whole answer or a stream, is `iha.serving.generation`.
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
from .errors import APIError, bad_request, install_error_handlers
from .generation import (
    ChatChunks,
    CompletionChunks,
    Generation,
    chat_prompt_ids,
    completion_prompt_ids,
    engine_failed,
    run_to_end,
    shutting_down,
    stream_answer,
)
from .limits import TokenLimit, completion_budget
from .responses import (
    CompletionText,
    chat_completion,
    text_completion,
)
from .streams import GenerationFailed, GenerationRequest, resolve_sampling
from .validation import ChatCompletionRequest, CompletionRequest, parse_request


logger = logging.getLogger("iha.serving")

# How often the engine's worker is checked (`supervise`).
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
    generation = Generation(request_id, len(prompt_ids), stream, text, slot, service.request_timeout)
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
