"""Reasoning SFT data: OpenThoughts-style rows turned into chat messages for TRL.

Every supported row schema becomes one `messages` column of `{"role", "content"}` dicts that keeps the system
prompt (TRL's own conversion of `conversations` rows renames keys only and drops the `system` column):

| schema | columns | roles |
|---|---|---|
| `"openthoughts"` (OpenThoughts-114k, Bespoke-Stratos, ShareGPT) | `conversations` [+ `system`] | `from`: user / assistant, human / gpt, system |
| `"messages"` (TRL conversational) | `messages` [+ `system`] | `role`: system / user / assistant |
| `"prompt_completion"` | `prompt`, `completion` [+ `system`] | strings, or lists of messages |

OpenThoughts3-1.2M rows (`difficulty, source, domain, conversations` with human / gpt roles) are the
`"openthoughts"` schema without a `system` column. A malformed row raises `DataFormatError` naming its index and
what is wrong with it.
`without_system_prompt` drops a row's system prompt and keeps its schema.

GSM8K rows (their reference answer and their OpenThoughts-format conversion) live in `iha.data.gsm8k`, the `iha data`
command in `iha.cli.data`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..utils.atomic_files import write_jsonl_atomic


if TYPE_CHECKING:
    from datasets import Dataset


logger = logging.getLogger(__name__)

# The system prompt of OpenThoughts-114k (inherited from Sky-T1 / Bespoke-Stratos), verbatim: the typos and the
# literal backslash-n characters are part of the dataset, and a model fine-tuned on it expects exactly this text.
# The name `default_system_prompt` takes for OpenThoughts' own system prompt (`load_sft_dataset`).
OPENTHOUGHTS_ALIAS = "openthoughts"
OPENTHOUGHTS_SYSTEM_PROMPT = (
    "Your role as an assistant involves thoroughly exploring questions through a systematic long thinking process "
    "before providing the final precise and accurate solutions. This requires engaging in a comprehensive cycle of "
    "analysis, summarizing, exploration, reassessment, reflection, backtracing, and iteration to develop "
    "well-considered thinking process. Please structure your response into two main sections: Thought and Solution. "
    "In the Thought section, detail your reasoning process using the specified format: <|begin_of_thought|> "
    "{thought with steps separated with '\\n\\n'} <|end_of_thought|> Each step should include detailed "
    "considerations such as analisying questions, summarizing relevant findings, brainstorming new ideas, verifying "
    "the accuracy of the current steps, refining any errors, and revisiting previous steps. In the Solution section, "
    "based on various attempts, explorations, and reflections from the Thought section, systematically present the "
    "final solution that you deem correct. The solution should remain a logical, accurate, concise expression style "
    "and detail necessary step needed to reach the conclusion, formatted as follows: <|begin_of_solution|> {final "
    "formatted, precise, and clear solution} <|end_of_solution|> Now, try to solve the following question through "
    "the above guidelines:"
)
BEGIN_OF_THOUGHT = "<|begin_of_thought|>"
END_OF_THOUGHT = "<|end_of_thought|>"
BEGIN_OF_SOLUTION = "<|begin_of_solution|>"
END_OF_SOLUTION = "<|end_of_solution|>"
# OpenThoughts math questions carry this instruction in front of the problem.
BOXED_INSTRUCTION = "Return your final response within \\boxed{}. "

SCHEMAS = ("openthoughts", "messages", "prompt_completion")

# ShareGPT / OpenThoughts `from` values and their chat roles. OpenThoughts-114k uses user/assistant,
# OpenThoughts3 and most ShareGPT dumps use human/gpt.
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
}
CHAT_ROLES = ("system", "user", "assistant")


class DataFormatError(ValueError):
    """A row (or a whole dataset) does not match any supported SFT schema."""


# ---------------------------------------------------------------------------------------------------------------------
# Row conversion
# ---------------------------------------------------------------------------------------------------------------------


def detect_schema(column_names: Iterable[str]) -> str:
    """Which supported schema a dataset with these columns follows: "openthoughts", "messages" or "prompt_completion"."""
    columns = set(column_names)
    if "conversations" in columns:
        return "openthoughts"
    if "messages" in columns:
        return "messages"
    if {"prompt", "completion"} <= columns:
        return "prompt_completion"
    raise DataFormatError(
        f"Cannot tell the dataset's schema from its columns {sorted(columns)}. Supported: `conversations` "
        "(OpenThoughts-114k / OpenThoughts3 / ShareGPT, optional `system`), `messages` (role/content), or `prompt` + "
        "`completion`. Rename your columns to one of these, or convert the rows yourself to a `messages` column."
    )


def _system_from_column(row: dict, index: int) -> str | None:
    system = row.get("system")
    if system is None:
        return None
    if not isinstance(system, str):
        raise DataFormatError(f"Row {index}: `system` must be a string, got {type(system).__name__}.")
    return system if system.strip() else None


def _check_content(content: Any, where: str) -> str:
    if content is None:
        raise DataFormatError(f"{where} has no content (missing or null).")
    if not isinstance(content, str):
        raise DataFormatError(f"{where}: content must be a string, got {type(content).__name__}.")
    return content


def _sharegpt_turns_to_messages(turns: Any, index: int, column: str = "conversations") -> list[dict]:
    if not isinstance(turns, list):
        raise DataFormatError(
            f"Row {index}: `{column}` must be a list of {{'from', 'value'}} turns, got {type(turns).__name__}."
        )
    messages = []
    for turn_index, turn in enumerate(turns):
        where = f"Row {index}, turn {turn_index}"
        if not isinstance(turn, Mapping):
            raise DataFormatError(f"{where}: a turn must be a {{'from', 'value'}} dict, got {type(turn).__name__}.")
        speaker = turn.get("from")
        if speaker is None:
            raise DataFormatError(f"{where} has no `from` field (expected one of {sorted(SHAREGPT_ROLES)}).")
        role = SHAREGPT_ROLES.get(str(speaker).lower()) if isinstance(speaker, str) else None
        if role is None:
            raise DataFormatError(f"{where}: unknown speaker {speaker!r}; expected one of {sorted(SHAREGPT_ROLES)}.")
        messages.append({"role": role, "content": _check_content(turn.get("value"), where)})
    return messages


def _chat_messages(messages: Any, index: int, column: str) -> list[dict]:
    if not isinstance(messages, list):
        raise DataFormatError(
            f"Row {index}: `{column}` must be a list of {{'role', 'content'}} messages, got {type(messages).__name__}."
        )
    checked = []
    for turn_index, message in enumerate(messages):
        where = f"Row {index}, `{column}` message {turn_index}"
        if not isinstance(message, Mapping):
            raise DataFormatError(f"{where} must be a {{'role', 'content'}} dict, got {type(message).__name__}.")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise DataFormatError(f"{where}: role {role!r} is not one of {list(CHAT_ROLES)}.")
        checked.append({"role": role, "content": _check_content(message.get("content"), where)})
    return checked


def _add_system(messages: list[dict], system: str | None, index: int, default_system_prompt: str | None) -> list[dict]:
    has_system_turn = bool(messages) and messages[0]["role"] == "system"
    if system is not None and has_system_turn:
        raise DataFormatError(
            f"Row {index} has both a `system` column and a system turn in its conversation; keep only one of them."
        )
    if system is None and not has_system_turn and default_system_prompt is not None:
        system = default_system_prompt
    if system is not None:
        messages = [{"role": "system", "content": system}, *messages]
    return messages


def _check_conversation(messages: list[dict], index: int) -> list[dict]:
    for turn_index, message in enumerate(messages):
        if message["role"] == "system" and turn_index != 0:
            raise DataFormatError(f"Row {index}: a system turn may only come first, found one at turn {turn_index}.")
    if not any(message["role"] == "assistant" and message["content"].strip() for message in messages):
        raise DataFormatError(f"Row {index} has no non-empty assistant turn: there is nothing to train on.")
    if not any(message["role"] == "user" for message in messages):
        raise DataFormatError(f"Row {index} has no user turn.")
    return messages


def row_to_messages(row: dict, index: int = 0, schema: str | None = None, default_system_prompt: str | None = None):
    """Turn one row of any supported schema into a list of `{"role", "content"}` messages, system prompt first.

    `default_system_prompt` is used only for rows that carry no system prompt of their own (for example
    `OPENTHOUGHTS_SYSTEM_PROMPT` for OpenThoughts3 rows). Raises `DataFormatError` naming `index` for a malformed row.
    """
    if not isinstance(row, Mapping):
        raise DataFormatError(f"Row {index} must be a dict of columns, got {type(row).__name__}.")
    schema = schema or detect_schema(row.keys())
    system = _system_from_column(row, index)
    if schema == "openthoughts":
        messages = _sharegpt_turns_to_messages(row.get("conversations"), index)
    elif schema == "messages":
        messages = _chat_messages(row.get("messages"), index, "messages")
    elif schema == "prompt_completion":
        prompt, completion = row.get("prompt"), row.get("completion")
        if isinstance(prompt, str) and isinstance(completion, str):
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        elif isinstance(prompt, list) and isinstance(completion, list):
            messages = _chat_messages(prompt, index, "prompt") + _chat_messages(completion, index, "completion")
            if not completion or any(message["role"] != "assistant" for message in messages[len(prompt) :]):
                raise DataFormatError(f"Row {index}: `completion` must hold assistant messages only.")
        else:
            raise DataFormatError(
                f"Row {index}: `prompt` and `completion` must both be strings or both be lists of messages, got "
                f"{type(prompt).__name__} and {type(completion).__name__}."
            )
    else:
        raise ValueError(f"Unknown schema {schema!r}; expected one of {list(SCHEMAS)}.")
    messages = _add_system(messages, system, index, default_system_prompt)
    return _check_conversation(messages, index)


def without_system_prompt(row: dict) -> dict:
    """The row without its system prompt (a `system` column, or a leading system turn of its `conversations` or
    `messages`), in its own schema; the chat template's own default system prompt, if it has one, takes its place."""
    row = {key: value for key, value in row.items() if key != "system"}
    for column, role_key in (("conversations", "from"), ("messages", "role")):
        turns = row.get(column)
        if isinstance(turns, list) and turns and isinstance(turns[0], dict) and turns[0].get(role_key) == "system":
            row[column] = turns[1:]
    return row


def to_messages_dataset(
    dataset: Dataset | Sequence[dict],
    default_system_prompt: str | None = None,
    num_proc: int | None = None,
) -> Dataset:
    """Convert a dataset (or a list of row dicts) of any supported schema to a dataset with one `messages` column."""
    from datasets import Dataset

    if not isinstance(dataset, Dataset):
        rows = list(dataset)
        for index, row in enumerate(rows):
            if not isinstance(row, Mapping):
                raise DataFormatError(f"Row {index} must be a dict of columns, got {type(row).__name__}.")
        # Convert in Python first: `Dataset.from_list` would have to unify the types of malformed rows otherwise.
        converted = [row_to_messages(row, index, None, default_system_prompt) for index, row in enumerate(rows)]
        return Dataset.from_dict({"messages": converted})
    if len(dataset) == 0:
        raise DataFormatError("The dataset is empty.")
    schema = detect_schema(dataset.column_names)

    def convert(row, index):
        return {"messages": row_to_messages(row, index, schema, default_system_prompt)}

    return dataset.map(
        convert,
        with_indices=True,
        remove_columns=dataset.column_names,
        num_proc=num_proc,
        desc=f"Converting {schema} rows to chat messages",
    )


# ---------------------------------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------------------------------

LOCAL_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}


def _local_builder(path: Path) -> tuple[str, list[str]]:
    if path.is_dir():
        files = sorted(str(p) for p in path.iterdir() if p.suffix in LOCAL_BUILDERS)
        builders = {LOCAL_BUILDERS[Path(f).suffix] for f in files}
        if len(builders) != 1:
            raise DataFormatError(
                f"Folder {path} must hold .json/.jsonl files or .parquet files (one kind), found "
                f"{sorted(p.name for p in path.iterdir())}."
            )
        return builders.pop(), files
    if path.suffix not in LOCAL_BUILDERS:
        raise DataFormatError(f"Unsupported data file {path}: use .json, .jsonl or .parquet.")
    return LOCAL_BUILDERS[path.suffix], [str(path)]


def local_data_path(source: str | os.PathLike) -> Path | None:
    """The local file or folder `source` names, or None when it names a Hub dataset (`org/name`, `gsm8k`).

    A source that looks like a path (a data file's suffix, or starting with `.`, `/` or `~`) and names nothing that
    exists raises FileNotFoundError saying so, instead of reaching the Hub or a reader with a missing file.
    """
    path = Path(source).expanduser()
    if path.exists():
        return path
    if path.suffix in LOCAL_BUILDERS or str(source).startswith((".", "/", "~")):
        raise FileNotFoundError(f"Data file {source} does not exist (and it does not look like a Hub dataset id).")
    return None


def load_sft_dataset(
    source: str | os.PathLike | Dataset | Sequence[dict],
    split: str = "train",
    config_name: str | None = None,
    default_system_prompt: str | None = None,
    max_rows: int | None = None,
    num_proc: int | None = None,
) -> Dataset:
    """Load SFT rows from a Hub id, a local .json / .jsonl / .parquet file (or a folder of them), a `Dataset` or a list
    of dicts, and return a dataset with one `messages` column (system prompt kept). `default_system_prompt` is given
    to rows without one; `"openthoughts"` stands for `OPENTHOUGHTS_SYSTEM_PROMPT` (the alias every command takes).

    ```python
    >>> train = load_sft_dataset("open-thoughts/OpenThoughts-114k")            # system + conversations (user/assistant)
    >>> train = load_sft_dataset("open-thoughts/OpenThoughts3-1.2M",           # human/gpt, no system column
    ...                          default_system_prompt="openthoughts")
    >>> train = load_sft_dataset("gsm8k_openthoughts.jsonl")
    ```
    """
    from datasets import Dataset, load_dataset

    if default_system_prompt == OPENTHOUGHTS_ALIAS:
        default_system_prompt = OPENTHOUGHTS_SYSTEM_PROMPT

    if isinstance(source, Dataset) or (isinstance(source, Sequence) and not isinstance(source, str)):
        dataset = source
    else:
        path = local_data_path(source)
        if path is not None:
            builder, files = _local_builder(path)
            dataset = load_dataset(builder, data_files=files, split="train")
        else:
            try:
                dataset = load_dataset(str(source), config_name, split=split)
            except (ConnectionError, FileNotFoundError) as error:  # offline, unreachable, or no such dataset
                local = "a local .jsonl / .json / .parquet file (or a folder of them) works instead, offline too"
                raise type(error)(f"{str(error).rstrip('.')}; {local}.") from error
    if max_rows is not None:
        if isinstance(dataset, Dataset):
            dataset = dataset.select(range(min(max_rows, len(dataset))))
        else:
            dataset = list(dataset)[:max_rows]
    return to_messages_dataset(dataset, default_system_prompt=default_system_prompt, num_proc=num_proc)


# ---------------------------------------------------------------------------------------------------------------------
# Length filtering
# ---------------------------------------------------------------------------------------------------------------------


def filter_by_length(
    dataset: Dataset,
    tokenizer,
    max_length: int,
    chat_template: str | None = None,
    num_proc: int | None = None,
) -> tuple[Dataset, int]:
    """Drop conversations longer than `max_length` tokens once rendered with the chat template.

    Reasoning traces cut short by truncation would teach the model to stop before its solution, so long rows are
    dropped rather than truncated. Returns `(kept_dataset, number_dropped)` and logs the count.
    """
    if max_length is None or max_length < 1:
        raise ValueError(f"`max_length` must be a positive number of tokens, got {max_length!r}.")
    if "messages" not in dataset.column_names:
        raise DataFormatError("filter_by_length expects a `messages` column: convert the rows with load_sft_dataset.")

    def count_tokens(row):
        ids = tokenizer.apply_chat_template(
            row["messages"], chat_template=chat_template, tokenize=True, return_dict=False
        )
        return {"num_tokens": len(ids)}

    counted = dataset.map(count_tokens, num_proc=num_proc, desc="Counting tokens")
    kept = counted.filter(lambda n: n <= max_length, input_columns="num_tokens", num_proc=num_proc)
    kept = kept.remove_columns("num_tokens")
    dropped = len(dataset) - len(kept)
    if dropped:
        logger.warning(
            "Length filter dropped %d of %d rows longer than %d tokens (%.1f%%).",
            dropped,
            len(dataset),
            max_length,
            100.0 * dropped / len(dataset),
        )
    else:
        logger.info("Length filter: all %d rows fit in %d tokens.", len(dataset), max_length)
    if len(kept) == 0:
        raise DataFormatError(
            f"Every one of the {len(dataset)} rows is longer than max_length={max_length} tokens: raise max_length."
        )
    return kept, dropped


# ---------------------------------------------------------------------------------------------------------------------
# JSONL files
# ---------------------------------------------------------------------------------------------------------------------


def read_jsonl(path: str | os.PathLike, limit: int | None = None) -> list[dict]:
    """Rows of a .jsonl file; a line that is not a JSON object raises an error naming its line number.

    The package's one JSONL reader. It is not `datasets.load_dataset("json", ...)` on purpose: that costs the
    `datasets` import and an Arrow cache on disk for a file read once, unifies the rows' columns (a key missing
    from one row becomes None there) and cannot say which line is broken.
    """
    rows = []
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if limit is not None and len(rows) >= limit:
                break
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as error:
                raise DataFormatError(f"{path}, line {line_number}: not valid JSON ({error.msg}).") from None
    return rows


def write_jsonl(rows: Iterable[dict], path: str | os.PathLike) -> Path:
    """Write rows as JSON lines, atomically: to a temporary file in the same folder, then renamed over `path`."""
    return write_jsonl_atomic(rows, path)


__all__ = [
    "BOXED_INSTRUCTION",
    "OPENTHOUGHTS_SYSTEM_PROMPT",
    "DataFormatError",
    "detect_schema",
    "filter_by_length",
    "load_sft_dataset",
    "read_jsonl",
    "row_to_messages",
    "to_messages_dataset",
    "write_jsonl",
]
