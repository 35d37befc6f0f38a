"""`iha serve MODEL`: an OpenAI-compatible server for an IHA folder or Hub id, transformers' server underneath.

`transformers serve` serves any model transformers knows, with `/v1/chat/completions`, `/v1/completions`,
`/v1/models` and `/health`, and `--continuous-batching` (requests batched together on a paged cache). For a
remote-code model such as IHA it stops at the class lookup (it takes `config.architectures[0]` from the `transformers`
module); this command registers the IHA classes and puts `IHAForCausalLM` where the server looks, then starts the
same server. Continuous batching on CPU gets a stated, bounded paged cache (`CPU_CACHE_TOKENS`): unsized, the engine
takes about 90% of the free memory.

    iha serve path/to/iha-model --continuous_batching --port 8000
"""

import argparse
import inspect
import math
import sys
import time
from collections.abc import Sequence

from .arguments import ArgumentParser
from .running import run_command


DEFAULT_HOST = "localhost"
DEFAULT_PORT = 8000
# Continuous batching on CPU: a paged cache this many tokens long (all requests of a batch together), and at most
# this many new tokens per forward. Enough for 8 requests of 1024 tokens; --cb_num_blocks / --cb_max_batch_tokens
# change them.
CPU_CACHE_TOKENS = 8192
CPU_MAX_BATCH_TOKENS = 512


class ServeError(Exception):
    """A server that cannot start as asked: one line naming the problem and the fix."""


def make_parser(prog: str = "iha serve") -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog=prog,
        description="Serve an IHA model over HTTP with an OpenAI-compatible API (POST /v1/chat/completions, "
        "/v1/completions; GET /v1/models, /health), with transformers' server underneath. Requests name the model "
        "as it is given here. Stop it with Ctrl-C.\n\nexample:\n  iha serve path/to/iha-model --continuous_batching",
    )
    parser.add_argument("model", help="an IHA model folder or Hub id (config.json with model_type 'iha')")
    parser.add_argument("--host", default=DEFAULT_HOST, help="address to listen on (0.0.0.0 for every interface)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to listen on")
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
        type=int,
        help=f"paged cache size in blocks of the engine's page size (default on CPU: {CPU_CACHE_TOKENS} tokens; on "
        "a GPU: sized from free memory)",
    )
    parser.add_argument(
        "--cb_max_batch_tokens",
        type=int,
        help=f"most new tokens per forward under continuous batching (default on CPU: {CPU_MAX_BATCH_TOKENS})",
    )
    parser.add_argument(
        "--cb_max_memory_percent", type=float, help="share of free GPU memory the paged cache may take (0.0-1.0)"
    )
    parser.add_argument("--log_level", default="warning", help="transformers' logging level (info, warning, ...)")
    return parser


def serving_dependencies_missing() -> bool:
    from transformers.utils.import_utils import is_serve_available

    return not is_serve_available()


def expose_model_class(config) -> None:
    """Put the model's class where transformers' server looks it up: `getattr(transformers, architectures[0])`.

    The server loads every model through the class its config names on the `transformers` module, so remote-code
    classes are not found there. The IHA classes are this package's own (registered with the Auto classes, they win
    over a folder's copies of the same code).
    """
    import transformers

    from ..models.iha.modeling_iha import IHAForCausalLM

    architectures = getattr(config, "architectures", None) or ["IHAForCausalLM"]
    if config.model_type == "iha" and not hasattr(transformers, architectures[0]):
        setattr(transformers, architectures[0], IHAForCausalLM)


def runs_on_cpu(device: str) -> bool:
    import torch

    if device == "auto":
        return not torch.cuda.is_available()
    return device.startswith("cpu")


def cache_bytes_per_token(config, dtype: str) -> int:
    """Bytes of keys and values one token takes in the paged cache (every layer; un-mixed, like the base model's)."""
    import torch

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    torch_dtype = getattr(torch, dtype, None) if dtype != "auto" else getattr(config, "dtype", None)
    element_bytes = torch_dtype.itemsize if isinstance(torch_dtype, torch.dtype) else 4
    return config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * element_bytes


def engine_page_size() -> int:
    """Tokens per block of the paged cache (`page_size` from 5.17, `block_size` before)."""
    from transformers import ContinuousBatchingConfig

    defaults = ContinuousBatchingConfig()
    return getattr(defaults, "page_size", None) or defaults.block_size


def continuous_batching_settings(args, config, prog: str) -> dict:
    """The paged cache flags for transformers' server: the ones given, and on CPU a bounded default, stated."""
    settings = {
        "cb_num_blocks": args.cb_num_blocks,
        "cb_max_batch_tokens": args.cb_max_batch_tokens,
        "cb_max_memory_percent": args.cb_max_memory_percent,
    }
    if runs_on_cpu(args.device):
        page_size = engine_page_size()
        if settings["cb_num_blocks"] is None:
            settings["cb_num_blocks"] = math.ceil(CPU_CACHE_TOKENS / page_size)
        if settings["cb_max_batch_tokens"] is None:
            settings["cb_max_batch_tokens"] = CPU_MAX_BATCH_TOKENS
        tokens = settings["cb_num_blocks"] * page_size
        mib = tokens * cache_bytes_per_token(config, args.dtype) / 2**20
        print(
            f"{prog}: continuous batching on CPU with a paged cache of {tokens} tokens ({settings['cb_num_blocks']} "
            f"blocks of {page_size}, {mib:.0f} MiB for this model) and at most {settings['cb_max_batch_tokens']} new "
            "tokens per forward (--cb_num_blocks, --cb_max_batch_tokens).",
            flush=True,
        )
    return {name: value for name, value in settings.items() if value is not None}


def serve_options(args, config, prog: str, accepted: set[str]) -> dict:
    """Keyword arguments for transformers' `Serve`, checked against the ones this release's server takes."""
    options = {
        "force_model": args.model,
        "host": args.host,
        "port": args.port,
        "device": args.device,
        "dtype": args.dtype,
        "attn_implementation": args.attn_implementation,
        "continuous_batching": args.continuous_batching,
        "log_level": args.log_level,
        "non_blocking": True,
    }
    if args.continuous_batching:
        options.update(continuous_batching_settings(args, config, prog))
    unsupported = sorted(name for name in options if name not in accepted)
    if unsupported:
        import transformers

        flags = ", ".join("--" + name for name in unsupported)
        raise ServeError(
            f"the server of transformers {transformers.__version__} takes no {flags}; upgrade transformers within the "
            f"supported range (pip install 'transformers>=5.13,<5.25'), or leave the flag out"
        )
    return options


def main(argv: Sequence[str] | None = None, prog: str = "iha serve") -> int:
    """`iha serve`."""
    args = make_parser(prog).parse_args(list(sys.argv[1:] if argv is None else argv))

    def serve() -> int:
        if serving_dependencies_missing():
            raise ServeError(
                "serving needs fastapi, uvicorn, pydantic and openai: pip install -e '.[serve]' "
                "(or pip install fastapi uvicorn openai)"
            )
        from transformers import AutoConfig
        from transformers.cli.serve import Serve

        config = AutoConfig.from_pretrained(args.model)
        expose_model_class(config)
        accepted = set(inspect.signature(Serve.__init__).parameters)
        server = Serve(**serve_options(args, config, prog, accepted))
        try:
            print(
                f"{prog}: serving {args.model} at http://{args.host}:{args.port}/v1 (OpenAI-compatible; continuous "
                f"batching {'on' if args.continuous_batching else 'off'}); Ctrl-C stops it.",
                flush=True,
            )
            # Sleep rather than join: a join interrupted by Ctrl-C / SIGTERM leaves the thread reported as stopped,
            # and `kill_server` would then skip stopping it.
            while server._thread.is_alive():
                time.sleep(0.5)
            if not server.server.started:
                raise ServeError(f"the server did not start on {args.host}:{args.port} (see the log above)")
            return 0
        finally:
            server.kill_server()

    return run_command(prog, serve, errors=(ServeError, ValueError), error_status=1)


__all__ = ["CPU_CACHE_TOKENS", "CPU_MAX_BATCH_TOKENS", "ServeError", "expose_model_class", "main", "make_parser"]
