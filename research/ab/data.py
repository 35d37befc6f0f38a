"""The data of `python -m research.ab`: the training rows and a validation split, carved once (seeded) and kept in OUTPUT_DIR/data
so that every run and every later call reads the same rows; the test problems, and their reference solutions in
the training rows' format."""

import random
from pathlib import Path

from iha.data.gsm8k import gsm8k_file_to_openthoughts, gsm8k_to_openthoughts, read_gsm8k_rows
from iha.data.messages import read_jsonl, without_system_prompt
from iha.evaluation.math_eval import load_problems
from iha.utils.atomic_files import write_json_atomic, write_jsonl_atomic

from .config import ABConfig


def read_training_rows(source: str) -> list[dict]:
    """Rows of a Hub dataset or .jsonl file: GSM8K-style rows (question, answer) in the OpenThoughts format,
    rows of any other schema that `iha.data.messages` reads as they are."""
    rows = read_gsm8k_rows(source, split="train")
    if rows and {"question", "answer"} <= set(rows[0]):
        return [gsm8k_to_openthoughts(row, index) for index, row in enumerate(rows)]
    return rows


def prepare_data(config: ABConfig, output_dir: Path) -> tuple[list[dict], list[dict]]:
    """The training and validation rows, carved once (seeded shuffle) and kept in OUTPUT_DIR/data."""
    data_dir = output_dir / "data"
    train_path, validation_path = data_dir / "train.jsonl", data_dir / "validation.jsonl"
    split_path = data_dir / "split.json"
    if not split_path.is_file():
        rows = read_training_rows(config.train_data)
        num_validation = config.num_validation_rows
        num_train = len(rows) - num_validation if config.num_train_rows is None else config.num_train_rows
        if num_validation + num_train > len(rows) or num_train < 1:
            raise ValueError(
                f"{config.train_data} has {len(rows)} rows: too few for {num_validation} validation rows and "
                f"{num_train} training rows. Lower --num-validation-rows or --num-train-rows"
            )
        order = list(range(len(rows)))
        random.Random(config.split_seed).shuffle(order)
        validation_indices, train_indices = order[:num_validation], order[num_validation : num_validation + num_train]
        if not config.keep_system_prompt:
            rows = [without_system_prompt(row) for row in rows]
        write_jsonl_atomic((rows[i] for i in train_indices), train_path)
        write_jsonl_atomic((rows[i] for i in validation_indices), validation_path)
        split = {
            "source": config.train_data,
            "num_source_rows": len(rows),
            "split_seed": config.split_seed,
            "train_indices": train_indices,
            "validation_indices": validation_indices,
        }
        write_json_atomic(split, split_path)  # last: its presence means both files are complete
    return read_jsonl(train_path), read_jsonl(validation_path)


def prepare_reference_rows(config: ABConfig) -> list[dict]:
    """The GSM8K test problems with their reference solutions, in the training rows' format (the OpenThoughts
    conversation, without its system prompt where the training rows have none): what `score_reference` scores
    teacher-forced. Problem i is the same row for both arms, so their losses pair per problem."""
    rows = gsm8k_file_to_openthoughts(config.test_data, limit=config.num_reference_problems, split="test")
    return rows if config.keep_system_prompt else [without_system_prompt(row) for row in rows]


def load_test_problems(source: str, benchmark: str, limit: int | None):
    """The test problems of `benchmark` (`gsm8k`, `math500`) from a Hub dataset or .jsonl file, the first `limit`."""
    return load_problems(source, benchmark=benchmark, limit=limit)


__all__ = ["load_test_problems", "prepare_data", "prepare_reference_rows", "read_training_rows"]
