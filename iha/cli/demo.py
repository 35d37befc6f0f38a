"""`iha demo`: the command line of the offline demo (`iha.demo.pipeline.run_demo`)."""

import inspect
import os

from ..demo import pipeline
from ..demo.pipeline import (
    run_demo,
)
from .arguments import (
    ArgumentParser,
    HelpFormatter,
    add_threads_argument,
    non_negative_int,
    positive_float,
    positive_int,
    set_threads,
)
from .running import run_command


def make_parser(prog: str = "iha demo") -> ArgumentParser:
    # The command line's defaults are run_demo's, so the two never drift apart.
    defaults = {name: parameter.default for name, parameter in inspect.signature(run_demo).parameters.items()}
    parser = ArgumentParser(prog=prog, description=pipeline.__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--output-dir", default="iha-demo", help="where everything is written (default: iha-demo)")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an output folder that holds more than an earlier demo's output",
    )
    parser.add_argument(
        "--model", default=None, help="Llama-style folder or Hub id (default: built-in SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--train-data", default=None, help="training rows: a .jsonl / .json / .parquet file or Hub id")
    parser.add_argument("--eval-data", default=None, help="held-out problems: a GSM8K or MATH-500 .jsonl")
    parser.add_argument("--num-train", type=positive_int, default=defaults["num_train"], help="training rows")
    parser.add_argument(
        "--num-eval", type=positive_int, default=defaults["num_eval"], help="held-out problems evaluated"
    )
    parser.add_argument(
        "--max-steps", type=positive_int, default=defaults["max_steps"], help="optimizer steps of fine-tuning"
    )
    parser.add_argument(
        "--batch-size", type=positive_int, default=defaults["batch_size"], help="training rows per step"
    )
    parser.add_argument(
        "--learning-rate",
        type=positive_float,
        default=defaults["learning_rate"],
        help="learning rate of the base weights",
    )
    parser.add_argument(
        "--mixing-learning-rate",
        type=positive_float,
        default=defaults["mixing_learning_rate"],
        help="learning rate of the IHA mixing coefficients",
    )
    parser.add_argument(
        "--max-length", type=positive_int, default=defaults["max_length"], help="longest training row in tokens"
    )
    parser.add_argument(
        "--max-new-tokens", type=positive_int, default=defaults["max_new_tokens"], help="tokens generated per problem"
    )
    parser.add_argument(
        "--num-pseudo-heads",
        type=positive_int,
        default=defaults["num_pseudo_heads"],
        help="P, the pseudo-heads per head",
    )
    parser.add_argument(
        "--seed", type=non_negative_int, default=defaults["seed"], help="seed of the data and the training"
    )
    add_threads_argument(parser)
    return parser


def main(argv: list[str] | None = None, prog: str = "iha demo") -> int:
    args = make_parser(prog).parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    settings = {key.replace("-", "_"): value for key, value in vars(args).items() if key != "threads"}

    def demo() -> int:
        threads = set_threads(args.threads)
        if args.threads is not None:
            chosen = "--threads"
        elif os.environ.get("OMP_NUM_THREADS"):
            chosen = "OMP_NUM_THREADS"
        else:
            chosen = "the cores idle now; --threads N to choose"
        pipeline.log(f"computing with {threads} CPU thread{'s' * (threads > 1)} ({chosen})")
        run_demo(**settings)
        return 0

    return run_command(
        prog,
        demo,
        interrupted=f"nothing was written to {args.output_dir}",
    )
