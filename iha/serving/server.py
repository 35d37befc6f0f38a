"""`iha serve MODEL`: an OpenAI-compatible server for an IHA folder or Hub id, for local and small-scale use.

    iha serve path/to/iha-model --continuous_batching --port 8000

The server loads the model with transformers (`AutoModelForCausalLM`, the IHA classes registered) and generates
with transformers' own machinery: `generate()`, or with `--continuous_batching` the continuous batching manager
behind `transformers serve --continuous-batching`, on a paged cache of a stated size. transformers' HTTP server
itself is not used: it lists models by scanning the Hugging Face cache (and fails where there is none), passes
requests to the engine unchecked (a prompt longer than the paged cache, or an empty one, kills the batching worker
for every later request), answers bad requests with bodies no OpenAI client reads, and fixes the batch's sampling
from its first request. Here every request is checked before any work (`iha.serving.validation`,
`iha.serving.limits`), errors have the OpenAI shape (`iha.serving.errors`), a key and a bound on requests in flight
guard it (`iha.serving.admission`), a dead batching worker is replaced (`iha.serving.engines`), and SIGTERM or Ctrl-C
stops it within seconds, cancelling the requests in flight (`iha.serving.app` has the routes).

For many users or large models, serve with an engine built for it (docs/serving.md).
"""

import contextlib
import dataclasses
import logging
import math
import os
import signal
import sys
import threading

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, ContinuousBatchingConfig
from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager
from transformers.utils import logging as transformers_logging
from transformers.utils.import_utils import is_serve_available

from ..models.iha.version_iha import supported_requirement
from ..utils.errors import WorkFailedError


DEFAULT_HOST = "localhost"
DEFAULT_PORT = 8000
# Continuous batching on CPU: a paged cache this many tokens long (all requests of a batch together), and at most
# this many new tokens per forward. Enough for 8 requests of 1024 tokens; --cb_num_blocks / --cb_max_batch_tokens
# change them.
CPU_CACHE_TOKENS = 8192
CPU_MAX_BATCH_TOKENS = 512
DEFAULT_MAX_CONCURRENT_REQUESTS = 64
DEFAULT_REQUEST_TIMEOUT = 600.0
# Seconds uvicorn waits for connections to close once the server stops (the requests in flight are cancelled first,
# so they end at once; this bounds a client that does not close its connection).
GRACEFUL_STOP_SECONDS = 5
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class ServeError(WorkFailedError):
    """A server that could not start or listen, or stopped on a failure: one line naming the problem and the fix.
    (Flags it cannot run with are ValueErrors, found before the model loads.)"""


def runs_on_cpu(device: str) -> bool:
    if device == "auto":
        return not torch.cuda.is_available()
    return device.startswith("cpu")


def model_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def model_dtype(dtype: str):
    if dtype == "auto":
        return "auto"
    resolved = getattr(torch, dtype, None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"--dtype {dtype} is not a torch dtype; give auto, float32, bfloat16 or float16")
    return resolved


def cache_bytes_per_token(config, dtype: str) -> int:
    """Bytes of keys and values one token takes in the paged cache (every layer; un-mixed, like the base model's)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    torch_dtype = getattr(torch, dtype, None) if dtype != "auto" else getattr(config, "dtype", None)
    element_bytes = torch_dtype.itemsize if isinstance(torch_dtype, torch.dtype) else 4
    return config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * element_bytes


def engine_page_size() -> int:
    """Tokens per block of the paged cache (`page_size` from 5.17, `block_size` before)."""
    defaults = ContinuousBatchingConfig()
    return getattr(defaults, "page_size", None) or defaults.block_size


def continuous_batching_settings(args) -> dict:
    """The paged cache's settings: the ones given, and on CPU a bounded default (unsized, the engine takes about 90%
    of the free memory)."""
    settings = {
        "num_blocks": args.cb_num_blocks,
        "max_batch_tokens": args.cb_max_batch_tokens,
        "max_memory_percent": args.cb_max_memory_percent,
    }
    if runs_on_cpu(args.device):
        if settings["num_blocks"] is None:
            settings["num_blocks"] = math.ceil(CPU_CACHE_TOKENS / engine_page_size())
        if settings["max_batch_tokens"] is None:
            settings["max_batch_tokens"] = CPU_MAX_BATCH_TOKENS
    return {name: value for name, value in settings.items() if value is not None}


def continuous_batching_config(args, sampling: bool):
    """The engine's `ContinuousBatchingConfig`: the cache settings (sampling per request, when asked, is the
    engine's, `iha.serving.engines.BatchingEngine`)."""
    # What the server drives of the engine: result handlers called on the event loop, and cancellation.
    if not all(hasattr(ContinuousBatchingManager, name) for name in ("register_result_handler", "cancel_request")):
        raise ValueError(
            f"the continuous batching of transformers {transformers.__version__} lacks what iha serve drives "
            f"(result handlers, cancellation); upgrade (pip install '{supported_requirement('5.23')}') or serve without "
            "--continuous_batching"
        )
    if sampling and "per_request_processors" not in {
        field.name for field in dataclasses.fields(ContinuousBatchingConfig)
    }:
        raise ValueError(
            f"sampling under continuous batching needs per-request sampling settings, which the continuous batching "
            f"of transformers {transformers.__version__} does not have; upgrade (pip install "
            f"'{supported_requirement('5.23')}'), or serve greedily (without --cb_sampling)"
        )
    return ContinuousBatchingConfig(**continuous_batching_settings(args))


def check_flags(args) -> None:
    if args.max_concurrent_requests < 1:
        raise ValueError(f"--max_concurrent_requests must be at least 1, not {args.max_concurrent_requests}")
    if not args.request_timeout > 0:
        raise ValueError(f"--request_timeout must be a positive number of seconds, not {args.request_timeout}")
    if args.max_model_len is not None and args.max_model_len < 2:
        raise ValueError(f"--max_model_len must be at least 2 (a prompt token and a new one), not {args.max_model_len}")


def load_model(args):
    """The model (on its device, in eval mode) and its tokenizer."""
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(
        args.model,
        dtype=model_dtype(args.dtype),
        device_map=model_device(args.device),
        attn_implementation=args.attn_implementation,
    )
    return model.eval(), tokenizer


def state_cache(engine, prog: str) -> None:
    """One line: the paged cache the engine built, in tokens and bytes, and how it decodes."""
    cache = engine.cache
    tokens = engine.cache_tokens()
    decoding = "each request's own sampling" if engine.samples else "greedy decoding (--cb_sampling to sample)"
    print(
        f"{prog}: continuous batching with a paged cache of {tokens if tokens is not None else 'sliding-window'} "
        f"tokens ({cache.num_blocks} blocks of {engine_page_size()}, {engine.cache_bytes() / 2**20:.1f} MiB "
        f"allocated), at most {cache.max_batch_tokens} new tokens per forward (--cb_num_blocks, "
        f"--cb_max_batch_tokens), {decoding}.",
        flush=True,
    )


def uvicorn_server_class():
    import uvicorn  # the `serve` extra (see serve)

    class Server(uvicorn.Server):
        """uvicorn's server, stopping ours on SIGINT / SIGTERM / SIGHUP: the requests in flight are cancelled at once
        (they end with a 503, or an error event and `[DONE]` in a stream), then uvicorn closes the connections."""

        def __init__(self, config, service):
            super().__init__(config)
            self.service = service
            self.stop_signal = None

        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn re-raises the signal once stopped; the command instead returns and says why it stopped.
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {}
            for signum in STOP_SIGNALS:
                if signum != signal.SIGTERM and signal.getsignal(signum) == signal.SIG_IGN:
                    continue  # started with nohup or in the background: the caller asked to ignore it
                previous[signum] = signal.signal(signum, self.handle_exit)
            try:
                yield
            finally:
                for signum, handler in previous.items():
                    signal.signal(signum, handler)

        def handle_exit(self, sig, frame) -> None:
            if self.stop_signal is None:
                self.stop_signal = sig
                if self.service.loop is not None:
                    self.service.loop.call_soon_threadsafe(self.service.begin_stop)
            super().handle_exit(sig, frame)

    return Server


def serve(args, prog: str, ran: list) -> int:
    if not is_serve_available():
        raise ValueError(
            "serving needs fastapi, uvicorn, pydantic and openai: pip install -e '.[serve]' "
            "(or pip install fastapi uvicorn openai)"
        )
    # fastapi and uvicorn are the `serve` extra: imported once it is known to be installed.
    import uvicorn

    from .admission import API_KEY_VARIABLE, RequestSlots, exposure_warning
    from .app import ServedModel, Service, build_app
    from .engines import BatchingEngine, EngineStartError, GenerateEngine
    from .limits import token_limit

    check_flags(args)
    transformers_logging.set_verbosity(transformers_logging.log_levels[args.log_level.lower()])
    log_handler = logging.StreamHandler()
    log_handler.setFormatter(logging.Formatter(f"%(asctime)s {prog} %(levelname)s: %(message)s"))
    serving_logger = logging.getLogger("iha.serving")
    serving_logger.addHandler(log_handler)
    serving_logger.setLevel(logging.INFO)

    api_key = args.api_key or os.environ.get(API_KEY_VARIABLE) or None
    warning = exposure_warning(args.host, api_key, prog)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    config = AutoConfig.from_pretrained(args.model).get_text_config()
    context = getattr(config, "max_position_embeddings", None)
    token_limit(context, args.max_model_len, None)  # a wrong --max_model_len stops here, before the model loads
    model, tokenizer = load_model(args)
    if args.continuous_batching:
        # A model whose generation config samples would have every request that leaves temperature out sample.
        sampling = args.cb_sampling or bool(model.generation_config.do_sample)
        engine = BatchingEngine(
            model, model.generation_config, continuous_batching_config(args, sampling), sampling=sampling
        )
        try:
            engine.start()
        except EngineStartError as error:
            raise ServeError(f"{error} (a smaller --cb_num_blocks or --cb_max_batch_tokens may fit)") from None
        state_cache(engine, prog)
        limit = token_limit(context, args.max_model_len, engine.cache_tokens())
    else:
        engine = GenerateEngine(model, model.generation_config)
        engine.start()
        limit = token_limit(context, args.max_model_len, None)
    served = ServedModel.describe(args.model, tokenizer, model.generation_config, config.vocab_size, limit)
    service = Service(served, engine, RequestSlots(args.max_concurrent_requests), api_key, args.request_timeout)
    server = uvicorn_server_class()(
        uvicorn.Config(
            build_app(service),
            host=args.host,
            port=args.port,
            log_level="info",
            timeout_graceful_shutdown=GRACEFUL_STOP_SECONDS,
        ),
        service,
    )
    failure = []

    def engine_failure(message: str) -> None:
        failure.append(message)
        server.should_exit = True

    engine.on_failure = engine_failure
    print(
        f"{prog}: serving {args.model} at http://{args.host}:{args.port}/v1 (OpenAI-compatible; {engine.name}; "
        f"at most {limit.tokens} tokens per request, {limit.reason}; at most {args.max_concurrent_requests} "
        f"requests at once; API key {'required' if api_key else 'not required'}); Ctrl-C stops it.",
        flush=True,
    )
    ran.append(True)
    try:
        server.run()
    except SystemExit:  # uvicorn exits when it cannot listen (it logged why)
        raise ServeError(f"the server could not listen on {args.host}:{args.port} (see the error above)") from None
    finally:
        engine.stop()
    if failure:
        raise ServeError(failure[0])
    if not server.started:
        raise ServeError(f"the server did not start on {args.host}:{args.port} (see the log above)")
    if server.stop_signal is not None:
        print(f"{prog}: stopped ({signal.Signals(server.stop_signal).name})", file=sys.stderr, flush=True)
    return 0


__all__ = [
    "CPU_CACHE_TOKENS",
    "CPU_MAX_BATCH_TOKENS",
    "ServeError",
    "continuous_batching_settings",
    "engine_page_size",
    "serve",
]
