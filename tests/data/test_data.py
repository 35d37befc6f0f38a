"""SFT data: every row schema to chat messages (system prompt kept), malformed-row errors, length filtering,
GSM8K -> OpenThoughts conversion, and the SmolLM2 chat template with generation markers."""

import copy
import json
import logging
import re

import pytest
from datasets import Dataset
from trl.data_utils import maybe_convert_to_chatml

from iha.cli.data import main
from iha.data.gsm8k import gsm8k_file_to_openthoughts, gsm8k_final_answer, gsm8k_to_openthoughts, read_gsm8k_rows
from iha.data.messages import (
    BEGIN_OF_SOLUTION,
    BEGIN_OF_THOUGHT,
    END_OF_SOLUTION,
    END_OF_THOUGHT,
    OPENTHOUGHTS_SYSTEM_PROMPT,
    DataFormatError,
    filter_by_length,
    load_sft_dataset,
    read_jsonl,
    row_to_messages,
    to_messages_dataset,
    without_system_prompt,
    write_jsonl,
)
from iha.training.chat_template import (
    GEMMA3_CHAT_TEMPLATE,
    GEMMA3_TRAINING_CHAT_TEMPLATE,
    SMOLLM2_CHAT_TEMPLATE,
    SMOLLM2_TRAINING_CHAT_TEMPLATE,
    has_generation_markers,
    training_chat_template,
    write_chat_template,
)


SYSTEM = "You are a careful solver."
OT114K_ROWS = [
    {
        "system": SYSTEM,
        "conversations": [
            {"from": "user", "value": "What is 2 + 3?"},
            {"from": "assistant", "value": "<|begin_of_thought|>\n\n2 + 3 = 5\n\n<|end_of_thought|> 5"},
        ],
    },
    {
        "system": SYSTEM,
        "conversations": [
            {"from": "user", "value": "Name a prime."},
            {"from": "assistant", "value": "7"},
            {"from": "user", "value": "Another?"},
            {"from": "assistant", "value": "11"},
        ],
    },
]
OT3_ROWS = [
    {
        "difficulty": 3,
        "source": "ai2-adapt-dev/openmath-2-math",
        "domain": "math",
        "conversations": [
            {"from": "human", "value": "What is 6 * 7?"},
            {"from": "gpt", "value": "<think>\n6 * 7 = 42\n</think>\n\n\\boxed{42}"},
        ],
    }
]


def write_json_lines(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


# ---------------------------------------------------------------------------------------------------------------------
# Schemas
# ---------------------------------------------------------------------------------------------------------------------


def test_openthoughts_114k_rows_keep_the_system_prompt(tmp_path):
    dataset = load_sft_dataset(write_json_lines(tmp_path / "ot114k.jsonl", OT114K_ROWS))
    assert dataset.column_names == ["messages"]
    assert dataset[0]["messages"] == [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "<|begin_of_thought|>\n\n2 + 3 = 5\n\n<|end_of_thought|> 5"},
    ]
    assert [m["role"] for m in dataset[1]["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    # The reason this loader exists: TRL's own conversion of the same row loses the system prompt.
    trl_converted = maybe_convert_to_chatml(copy.deepcopy(OT114K_ROWS[0]))  # it renames keys in place
    assert all(message["role"] != "system" for message in trl_converted["messages"])


def test_openthoughts3_rows_map_human_gpt_and_drop_metadata(tmp_path):
    dataset = load_sft_dataset(write_json_lines(tmp_path / "ot3.jsonl", OT3_ROWS))
    assert dataset.column_names == ["messages"]
    assert dataset[0]["messages"] == [
        {"role": "user", "content": "What is 6 * 7?"},
        {"role": "assistant", "content": "<think>\n6 * 7 = 42\n</think>\n\n\\boxed{42}"},
    ]
    with_default = load_sft_dataset(
        tmp_path / "ot3.jsonl", default_system_prompt=OPENTHOUGHTS_SYSTEM_PROMPT, max_rows=1
    )
    assert with_default[0]["messages"][0] == {"role": "system", "content": OPENTHOUGHTS_SYSTEM_PROMPT}
    # A row's own system prompt wins over the default.
    own = load_sft_dataset(OT114K_ROWS, default_system_prompt=OPENTHOUGHTS_SYSTEM_PROMPT)
    assert own[0]["messages"][0]["content"] == SYSTEM


def test_messages_rows_from_parquet(tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], "system": SYSTEM},
        {
            "messages": [
                {"role": "system", "content": "terse"},
                {"role": "user", "content": "1+1"},
                {"role": "assistant", "content": "2"},
            ],
            "system": None,
        },
    ]
    path = tmp_path / "chat.parquet"
    Dataset.from_list(rows).to_parquet(path)
    dataset = load_sft_dataset(path)
    assert dataset[0]["messages"][0] == {"role": "system", "content": SYSTEM}
    assert dataset[1]["messages"] == rows[1]["messages"]


def test_prompt_completion_rows_strings_and_conversational(tmp_path):
    string_rows = [{"prompt": "Q: 3 * 3?", "completion": " 9", "system": SYSTEM}]
    path = tmp_path / "pc.json"
    path.write_text(json.dumps(string_rows), encoding="utf-8")  # a JSON array, not JSON lines
    assert load_sft_dataset(path)[0]["messages"] == [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Q: 3 * 3?"},
        {"role": "assistant", "content": " 9"},
    ]
    conversational = [
        {
            "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "3 * 3?"}],
            "completion": [{"role": "assistant", "content": "9"}],
        }
    ]
    assert load_sft_dataset(Dataset.from_list(conversational))[0]["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "3 * 3?"},
        {"role": "assistant", "content": "9"},
    ]


def test_folder_of_jsonl_files(tmp_path):
    folder = tmp_path / "shards"
    folder.mkdir()
    write_json_lines(folder / "a.jsonl", OT114K_ROWS[:1])
    write_json_lines(folder / "b.jsonl", OT114K_ROWS[1:])
    assert len(load_sft_dataset(folder)) == 2


# ---------------------------------------------------------------------------------------------------------------------
# Malformed rows
# ---------------------------------------------------------------------------------------------------------------------

GOOD_TURNS = [{"from": "user", "value": "q"}, {"from": "assistant", "value": "a"}]
MALFORMED = {
    "conversations is a string": ({"conversations": "q then a"}, r"Row 2: `conversations` must be a list"),
    "turn without value": (
        {"conversations": [{"from": "user"}, {"from": "assistant", "value": "a"}]},
        r"Row 2, turn 0 has no content",
    ),
    "turn without from": ({"conversations": [{"value": "q"}, GOOD_TURNS[1]]}, r"Row 2, turn 0 has no `from`"),
    "unknown speaker": (
        {"conversations": [{"from": "bot", "value": "q"}, GOOD_TURNS[1]]},
        r"Row 2, turn 0: unknown speaker 'bot'",
    ),
    "no assistant turn": ({"conversations": [GOOD_TURNS[0]]}, r"Row 2 has no non-empty assistant turn"),
    "empty assistant turn": (
        {"conversations": [GOOD_TURNS[0], {"from": "gpt", "value": "  "}]},
        r"Row 2 has no non-empty assistant turn",
    ),
    "non-string value": (
        {"conversations": [GOOD_TURNS[0], {"from": "gpt", "value": 42}]},
        r"Row 2, turn 1: content must be a string, got int",
    ),
    "system column and system turn": (
        {"system": "s", "conversations": [{"from": "system", "value": "t"}, *GOOD_TURNS]},
        r"Row 2 has both a `system` column and a system turn",
    ),
    "late system turn": (
        {"conversations": [*GOOD_TURNS, {"from": "system", "value": "t"}]},
        r"Row 2: a system turn may only come first",
    ),
    "system not a string": ({"system": ["s"], "conversations": GOOD_TURNS}, r"Row 2: `system` must be a string"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_openthoughts_row_names_index_and_problem(tmp_path, case):
    bad_row, message = MALFORMED[case]
    rows = [{"conversations": GOOD_TURNS}, {"conversations": GOOD_TURNS}, bad_row, {"conversations": GOOD_TURNS}]
    with pytest.raises(DataFormatError, match=message):
        load_sft_dataset(rows)
    # Same error through a real file and `datasets` (rows with mixed types load as JSON values).
    with pytest.raises(DataFormatError, match=message):
        load_sft_dataset(write_json_lines(tmp_path / "bad.jsonl", rows))


def test_malformed_messages_and_prompt_completion_rows():
    with pytest.raises(DataFormatError, match=r"Row 0, `messages` message 1: role 'bot' is not one of"):
        row_to_messages({"messages": [{"role": "user", "content": "q"}, {"role": "bot", "content": "a"}]})
    with pytest.raises(DataFormatError, match=r"Row 4: `prompt` and `completion` must both be strings"):
        row_to_messages({"prompt": "q", "completion": None}, index=4)
    with pytest.raises(DataFormatError, match=r"Row 1: `completion` must hold assistant messages only"):
        row_to_messages(
            {"prompt": [{"role": "user", "content": "q"}], "completion": [{"role": "user", "content": "a"}]}, index=1
        )


def test_unknown_schema_and_missing_file_errors(tmp_path):
    with pytest.raises(
        DataFormatError, match=r"Cannot tell the dataset's schema from its columns \['answer', 'question'\]"
    ):
        to_messages_dataset(Dataset.from_list([{"question": "q", "answer": "a"}]))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_sft_dataset(tmp_path / "missing.jsonl")
    # A missing GSM8K file is reported as missing, not as a file of the wrong kind.
    with pytest.raises(FileNotFoundError, match=r"^Data file .*missing\.jsonl does not exist"):
        read_gsm8k_rows(tmp_path / "missing.jsonl")
    # Offline (the tests run with HF_HUB_OFFLINE=1), a Hub id says that a local file works instead.
    with pytest.raises(ConnectionError, match=r"someone/not-a-cached-dataset.*a local \.jsonl / \.json / \.parquet"):
        load_sft_dataset("someone/not-a-cached-dataset")
    bad = tmp_path / "broken.jsonl"
    bad.write_text('{"question": "q", "answer": "a\\n#### 1"}\n{not json\n', encoding="utf-8")
    with pytest.raises(DataFormatError, match=r"broken.jsonl, line 2: not valid JSON"):
        read_jsonl(bad)


# ---------------------------------------------------------------------------------------------------------------------
# GSM8K -> OpenThoughts
# ---------------------------------------------------------------------------------------------------------------------


def test_gsm8k_train_converts_to_openthoughts_format(test_data, tmp_path):
    source = test_data / "gsm8k" / "train.jsonl"
    originals = read_jsonl(source)
    converted = gsm8k_file_to_openthoughts(source)
    assert len(converted) == len(originals) == 315
    layout = re.compile(
        re.escape(BEGIN_OF_THOUGHT)
        + r"\n\n(?P<thought>.+)\n\n"
        + re.escape(END_OF_THOUGHT)
        + r"\n\n"
        + re.escape(BEGIN_OF_SOLUTION)
        + r"\n\n(?P<solution>.+)\n\n"
        + re.escape(END_OF_SOLUTION),
        re.S,
    )
    for original, row in zip(originals, converted):
        assert row["system"] == OPENTHOUGHTS_SYSTEM_PROMPT
        user, assistant = row["conversations"]
        assert (user["from"], assistant["from"]) == ("user", "assistant")
        assert user["value"] == "Return your final response within \\boxed{}. " + original["question"].strip()
        match = layout.fullmatch(assistant["value"])
        assert match, assistant["value"]
        expected = original["answer"].split("####")[1].strip().replace(",", "")
        assert re.findall(r"\\boxed\{([^}]*)\}", match["solution"]) == [expected]
        assert "<<" not in assistant["value"] and "####" not in assistant["value"]
    # The first row, spelled out.
    assert converted[0]["conversations"][1]["value"] == (
        "<|begin_of_thought|>\n\nNatalia sold 48/2 = 24 clips in May.\n\nNatalia sold 48+24 = 72 clips altogether in "
        "April and May.\n\n<|end_of_thought|>\n\n<|begin_of_solution|>\n\nNatalia sold 48+24 = 72 clips altogether in "
        "April and May.\n\nThe final answer is $\\boxed{72}$.\n\n<|end_of_solution|>"
    )
    # Written as JSON lines, the rows load back through the OpenThoughts-114k path with the system prompt kept.
    path = write_jsonl(converted[:50], tmp_path / "gsm8k_openthoughts.jsonl")
    assert not list(tmp_path.glob(".*"))  # no temporary file left behind
    dataset = load_sft_dataset(path)
    assert len(dataset) == 50
    assert dataset[3]["messages"][0] == {"role": "system", "content": OPENTHOUGHTS_SYSTEM_PROMPT}
    assert dataset[3]["messages"][2]["content"] == converted[3]["conversations"][1]["value"]


def test_gsm8k_malformed_rows():
    assert gsm8k_final_answer("a\n#### 1,200") == "1200"
    with pytest.raises(DataFormatError, match=r"GSM8K row 7: a GSM8K answer must end in exactly one `#### N`"):
        gsm8k_to_openthoughts({"question": "q", "answer": "no marker"}, index=7)
    with pytest.raises(DataFormatError, match=r"GSM8K row 3: `question` is missing"):
        gsm8k_to_openthoughts({"answer": "x\n#### 2"}, index=3)
    with pytest.raises(DataFormatError, match=r"GSM8K row 0: the answer has no worked steps"):
        gsm8k_to_openthoughts({"question": "q", "answer": "#### 2"})


# ---------------------------------------------------------------------------------------------------------------------
# Length filtering and the chat template (SmolLM2 tokenizer)
# ---------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from iha.conversion.builtin import smollm2_dir

    return AutoTokenizer.from_pretrained(smollm2_dir())


def test_filter_by_length_drops_and_reports(smollm2_tokenizer, caplog):
    rows = [
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "word " * n}]}
        for n in (1, 200, 5, 300, 10)
    ]
    dataset = Dataset.from_list(rows)
    lengths = [
        len(smollm2_tokenizer.apply_chat_template(row["messages"], tokenize=True, return_dict=False)) for row in rows
    ]
    limit = sorted(lengths)[2]  # keeps the three short rows exactly
    with caplog.at_level(logging.WARNING, logger="iha.data.messages"):
        kept, dropped = filter_by_length(dataset, smollm2_tokenizer, limit)
    assert dropped == 2
    assert [row["messages"] for row in kept] == [rows[0]["messages"], rows[2]["messages"], rows[4]["messages"]]
    assert f"dropped 2 of 5 rows longer than {limit} tokens" in caplog.text
    with pytest.raises(DataFormatError, match="Every one of the 5 rows is longer than max_length=3"):
        filter_by_length(dataset, smollm2_tokenizer, 3)


CONVERSATIONS = [
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
    [
        {"role": "system", "content": OPENTHOUGHTS_SYSTEM_PROMPT},
        {"role": "user", "content": "Return your final response within \\boxed{}. 2+2?"},
        {"role": "assistant", "content": "<|begin_of_thought|>\n\n2+2=4\n\n<|end_of_thought|>\\boxed{4}"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6"},
    ],
    [{"role": "user", "content": "only a question"}],
]


def test_training_chat_template_renders_like_smollm2(smollm2_tokenizer):
    assert smollm2_tokenizer.chat_template == SMOLLM2_CHAT_TEMPLATE
    assert not has_generation_markers(SMOLLM2_CHAT_TEMPLATE)
    assert training_chat_template(smollm2_tokenizer) == SMOLLM2_TRAINING_CHAT_TEMPLATE
    for messages in CONVERSATIONS:
        for add_generation_prompt in (False, True):
            own = smollm2_tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            drop_in = smollm2_tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                chat_template=SMOLLM2_TRAINING_CHAT_TEMPLATE,
            )
            assert drop_in == own


def test_training_chat_template_masks_assistant_replies_with_their_end_token(smollm2_tokenizer):
    messages = CONVERSATIONS[1]
    encoded = smollm2_tokenizer.apply_chat_template(
        messages,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
        chat_template=SMOLLM2_TRAINING_CHAT_TEMPLATE,
    )
    ids, mask = encoded["input_ids"], encoded["assistant_masks"]
    assert ids == smollm2_tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    trained = smollm2_tokenizer.decode([token for token, keep in zip(ids, mask) if keep])
    assert trained == messages[2]["content"] + "<|im_end|>" + messages[4]["content"] + "<|im_end|>"


def test_gemma3_templates_render_gemmas_turns_and_alike(smollm2_tokenizer):
    """Gemma's turn format for base checkpoints without a template; a system prompt opens the first user turn."""
    without_template = copy.deepcopy(smollm2_tokenizer)
    without_template.chat_template = GEMMA3_CHAT_TEMPLATE
    assert training_chat_template(without_template) == GEMMA3_TRAINING_CHAT_TEMPLATE
    for messages in CONVERSATIONS:
        for add_generation_prompt in (False, True):
            texts = [
                smollm2_tokenizer.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=template
                )
                for template in (GEMMA3_CHAT_TEMPLATE, GEMMA3_TRAINING_CHAT_TEMPLATE)
            ]
            assert texts[0] == texts[1]
    text = smollm2_tokenizer.apply_chat_template(
        CONVERSATIONS[1][:3], tokenize=False, chat_template=GEMMA3_TRAINING_CHAT_TEMPLATE
    )
    assert text == (
        f"{smollm2_tokenizer.bos_token}<start_of_turn>user\n{OPENTHOUGHTS_SYSTEM_PROMPT}\n\n{CONVERSATIONS[1][1]['content']}"
        f"<end_of_turn>\n<start_of_turn>model\n{CONVERSATIONS[1][2]['content']}<end_of_turn>\n"
    )
    assert has_generation_markers(GEMMA3_TRAINING_CHAT_TEMPLATE) and not has_generation_markers(GEMMA3_CHAT_TEMPLATE)


def test_write_chat_template(tmp_path):
    path = write_chat_template(SMOLLM2_TRAINING_CHAT_TEMPLATE, tmp_path / "t.jinja")
    assert path.read_text(encoding="utf-8") == SMOLLM2_TRAINING_CHAT_TEMPLATE
    with pytest.raises(ValueError, match=r"only for \.jinja or \.j2 files"):
        write_chat_template(SMOLLM2_TRAINING_CHAT_TEMPLATE, tmp_path / "t.txt")


def test_command_line_writes_openthoughts_and_messages_files(test_data, tmp_path):
    openthoughts = tmp_path / "gsm8k_openthoughts.jsonl"
    assert (
        main(["gsm8k-to-openthoughts", str(test_data / "gsm8k" / "train.jsonl"), str(openthoughts), "--limit", "5"])
        == 0
    )
    assert read_jsonl(openthoughts) == gsm8k_file_to_openthoughts(test_data / "gsm8k" / "train.jsonl", limit=5)
    messages = tmp_path / "messages" / "train.jsonl"
    assert main(["to-messages", str(openthoughts), str(messages), "--max_rows", "3"]) == 0
    written = read_jsonl(messages)
    assert len(written) == 3 and list(written[0]) == ["messages"]
    assert written[0]["messages"][0] == {"role": "system", "content": OPENTHOUGHTS_SYSTEM_PROMPT}


def test_command_line_writes_gsm8k_rows_without_the_system_prompt(test_data, tmp_path):
    source = test_data / "gsm8k" / "train.jsonl"
    output = tmp_path / "rows.jsonl"
    assert main(["gsm8k-to-openthoughts", str(source), str(output), "--limit", "3", "--without_system_prompt"]) == 0
    written = read_jsonl(output)
    assert written == [without_system_prompt(row) for row in gsm8k_file_to_openthoughts(source, limit=3)]
    assert all("system" not in row for row in written) and written[0]["conversations"][0]["from"] == "user"


def test_gsm8k_to_openthoughts_takes_a_hub_id_and_says_so_when_offline(tmp_path, capsys):
    output = tmp_path / "rows.jsonl"
    assert main(["gsm8k-to-openthoughts", "someone/not-a-cached-gsm8k", str(output)]) == 2
    err = capsys.readouterr().err
    assert "Could not load 'someone/not-a-cached-gsm8k' from the Hugging Face Hub" in err
    assert "pass a local GSM8K .jsonl file" in err and not output.exists()


def test_the_openthoughts_alias_is_the_openthoughts_system_prompt_for_rows_without_one():
    rows = [{"conversations": [{"from": "user", "value": "1 + 1?"}, {"from": "assistant", "value": "2"}]}]
    messages = load_sft_dataset(rows, default_system_prompt="openthoughts")[0]["messages"]
    assert messages[0] == {"role": "system", "content": OPENTHOUGHTS_SYSTEM_PROMPT}
    assert load_sft_dataset(rows, default_system_prompt="Be brief.")[0]["messages"][0]["content"] == "Be brief."
