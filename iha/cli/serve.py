"""`iha serve MODEL`: the command of the OpenAI-compatible server in `iha.serving` (its docstring says what the
server does and why it is not transformers' own)."""

import argparse
import logging
import os
import sys
from collections.abc import Sequence

from ..serving.server import (
    CPU_CACHE_TOKENS,
    CPU_MAX_BATCH_TOKENS,
    DEFAULT_HOST,
    DEFAULT_MAX_CONCURRENT_REQUESTS,
    DEFAULT_PORT,
    DEFAULT_REQUEST_TIMEOUT,
    check_address,
    check_flags,
    serve,
)
from ..utils.model_source import check_model_source
from .arguments import (
    ArgumentParser,
    add_threads_argument,
    fraction,
    port_number,
    positive_float,
    positive_int,
    set_threads,
    whole_number,
)
from .running import run_command


# transformers' logging levels (`transformers.utils.logging.log_levels`), named here so that the parser needs no
# transformers.
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def make_parser(prog: str = "iha serve") -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog=prog,
        description="Serve an IHA model over HTTP with an OpenAI-compatible API (POST /v1/chat/completions, "
        "/v1/completions; GET /v1/models, /health), generating with transformers (generate() or continuous "
        "batching). Requests name the model as it is given here (or leave it out). Bad requests get OpenAI-shaped "
        "errors before any work. For local and small-scale use. Stop it with Ctrl-C or SIGTERM.\n\nexample:\n"
        "  iha serve path/to/iha-model --continuous_batching",
    )
    parser.add_argument("model", help="an IHA model folder or Hub id (config.json with model_type 'iha')")
    parser.add_argument("--host", default=DEFAULT_HOST, help="address to listen on (0.0.0.0 for every interface)")
    parser.add_argument("--port", type=port_number, default=DEFAULT_PORT, help="port to listen on (1-65535)")
    parser.add_argument("--device", default="auto", help="where the model runs: auto, cpu, cuda, cuda:1, ...")
    parser.add_argument("--dtype", default="auto", help="model dtype (auto: as the weights were saved)")
    parser.add_argument(
        "--attn_implementation",
        default=None,
        help="attention implementation (default: transformers' choice, sdpa); continuous batching runs IHA with "
        "sdpa or eager",
    )
    parser.add_argument(
        "--continuous_batching",
        action="store_true",
        help="batch concurrent requests together on a paged cache (transformers' continuous batching)",
    )
    parser.add_argument(
        "--cb_num_blocks",
        type=positive_int,
        help=f"paged cache size in blocks of the engine's page size (default on CPU: {CPU_CACHE_TOKENS} tokens; on "
        "a GPU: sized from free memory)",
    )
    parser.add_argument(
        "--cb_max_batch_tokens",
        type=positive_int,
        help=f"most new tokens per forward under continuous batching (default on CPU: {CPU_MAX_BATCH_TOKENS})",
    )
    parser.add_argument(
        "--cb_max_memory_percent", type=fraction, help="share of free GPU memory the paged cache may take (0.0-1.0)"
    )
    parser.add_argument(
        "--cb_sampling",
        action="store_true",
        help="let requests sample under continuous batching (each its own temperature / top_p; default: greedy "
        "only, unless the model's generation config samples): costs two sorts of the vocabulary per request at every "
        "step",
    )
    parser.add_argument(
        "--max_model_len",
        type=whole_number(2),
        help="most tokens per request, prompt and completion together (default: the model's context, "
        "max_position_embeddings; under continuous batching also at most the paged cache)",
    )
    parser.add_argument(
        "--api_key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every /v1 request (default: the IHA_API_KEY environment "
        "variable, which keeps the key out of the process list; none: no key)",
    )
    parser.add_argument(
        "--max_concurrent_requests",
        type=positive_int,
        default=DEFAULT_MAX_CONCURRENT_REQUESTS,
        help="most generation requests in flight (running or waiting); beyond it 429 with Retry-After",
    )
    parser.add_argument(
        "--request_timeout",
        type=positive_float,
        default=DEFAULT_REQUEST_TIMEOUT,
        help="seconds a request may take from its arrival, waiting included; past it, it is cancelled (504)",
    )
    parser.add_argument(
        "--log_level",
        default="warning",
        type=str.lower,
        choices=LOG_LEVELS,
        help="transformers' logging level",
    )
    add_threads_argument(parser)
    return parser


def main(argv: Sequence[str] | None = None, prog: str = "iha serve") -> int:
    """`iha serve`. Once a server has run, the process exits here (`os._exit`, after flushing its output): Python's
    teardown of torch and transformers takes seconds on a busy machine (3 to 14 s measured here) and a worker stuck in
    a forward would hold it longer, while a stopped server has nothing left to clean up."""
    args = make_parser(prog).parse_args(list(sys.argv[1:] if argv is None else argv))
    ran = []
    set_threads(args.threads)

    def run() -> int:
        # Everything the command was given, before anything is loaded: the flags, the model's folder, the address.
        check_flags(args)
        check_model_source(args.model)
        check_address(args.host, args.port)
        return serve(args, prog, ran)

    status = run_command(prog, run)
    if ran:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status
