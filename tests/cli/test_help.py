"""Every console script answers `--help` with its flags in order, and the IHA classes are registered with the Auto
classes by `import iha`, so also before a command runs."""

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest
from testing_utils import REPO_ROOT

from iha.cli import main as cli
from iha.cli import sft as sft_cli
from iha.conversion import options
from iha.models.iha import layer_iha
from iha.training.config import DEFAULT_LORA_TARGET_MODULES
from iha.training.model import iha_peft_config


# Runs a console script of iha.cli.main (argv: FUNCTION PROG ARGS...) and prints its exit status as the last line of
# stderr.
RUN_SCRIPT = """
import json, sys
from iha.cli import main as cli

function = getattr(cli, sys.argv[1])
sys.argv = sys.argv[2:]
try:
    status = function()
except SystemExit as exit:
    status = exit.code
print(json.dumps({"status": status}), file=sys.stderr)
"""
ENV = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_script(function: str, prog: str, *args: str, cwd=None) -> tuple[dict, str, str]:
    result = subprocess.run(
        [sys.executable, "-c", RUN_SCRIPT, function, prog, *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd or REPO_ROOT,
        env=ENV,
    )
    *errors, outcome = result.stderr.strip().splitlines() or [""]
    return json.loads(outcome), result.stdout, "\n".join(errors)


def help_page(function: str, prog: str, *args: str, capsys, monkeypatch) -> tuple[object, str]:
    """(exit status, page) of `PROG ARGS --help` through console script FUNCTION of iha.cli.main, in this process: the same
    call as run_script's without starting an interpreter (one per page cost seconds each of importing torch)."""
    monkeypatch.setattr(sys, "argv", [prog, *args, "--help"])
    monkeypatch.setenv("COLUMNS", "80")  # the width a page gets when its output is not a terminal
    try:
        status = getattr(cli, function)()
    except SystemExit as exit:
        status = exit.code
    return status, capsys.readouterr().out


# (console script function, its words before --help, the command's own flags in the order its help shows them)
HELP_PAGES = [
    ("main", ["iha"], []),
    ("main", ["iha", "demo"], ["--output_dir", "--model", "--num_pseudo_heads"]),
    ("main", ["iha", "convert"], ["source", "output_dir", "--num_pseudo_heads", "--layers", "--dtype", "--no_verify"]),
    ("main", ["iha", "convert", "push"], ["folder", "repo_id", "--private"]),
    ("main", ["iha", "sft"], ["--model_name_or_path", "--convert_to_iha", "--dataset_name", "--learning_rate"]),
    ("main", ["iha", "eval"], ["math", "needle", "compare"]),
    ("main", ["iha", "eval", "math"], ["--model", "--dataset", "--preset", "--temperature"]),
    ("main", ["iha", "card"], ["folder", "--base_model"]),
    ("main", ["iha", "push"], ["folder", "repo_id", "--private", "--token"]),
    ("main", ["iha", "data"], ["gsm8k-to-openthoughts", "to-messages"]),
    ("main", ["iha", "data", "to-messages"], ["source", "output", "--max_rows"]),
    ("main", ["iha", "chat-template"], ["output", "--tokenizer"]),
    ("convert", ["iha-convert"], ["source", "output_dir", "--num_pseudo_heads", "--layers"]),
    ("convert", ["iha-convert", "push"], ["folder", "repo_id"]),
    ("sft", ["iha-sft"], ["--model_name_or_path", "--use_peft", "--dataset_name", "--bf16", "--mixing_learning_rate"]),
    ("evaluate", ["iha-eval"], ["math", "needle", "compare"]),
]


@pytest.mark.parametrize("function, words, flags", HELP_PAGES, ids=[" ".join(words) for _, words, _ in HELP_PAGES])
def test_help_lists_the_commands_flags_in_order(function, words, flags, capsys, monkeypatch):
    status, out = help_page(function, *words, capsys=capsys, monkeypatch=monkeypatch)
    assert status == 0
    assert out.lower().startswith("usage")
    body = out[out.index("\n\n") :]  # after the usage lines: each flag where it is described, at a line's start
    positions = [re.search(rf"\n +{re.escape(flag)}\b", body).start() for flag in flags]
    assert positions == sorted(positions), f"the flags are not listed in this order: {flags}"
    if not flags:  # `iha --help`: every command with its one-line summary
        for name, summary in cli.COMMANDS.items():
            assert f"  {name:<17} {summary}" in out


def test_sft_help_lists_trl_flags_in_the_groups_of_its_configs_and_marks_the_packages(capsys, monkeypatch):
    status, out = help_page("sft", "iha-sft", capsys=capsys, monkeypatch=monkeypatch)
    assert status == 0
    for flag in ("--model_name_or_path", "--lora_r", "--load_in_4bit", "--learning_rate", "--packing", "--max_length"):
        assert f"  {flag} " in out, flag
    # One group per config `train_sft` takes (IHAModelConfig, IHAScriptArguments, IHASFTConfig), in that order, each
    # holding TRL's flags and the package's own.
    groups = [out.index(f"\n{group}:\n") for group in ("model", "data", "training")]
    assert groups == sorted(groups)
    for group, flags in (
        (0, ("--model_name_or_path", "--load_in_4bit", "--iha_options")),
        (1, ("--dataset_name", "--default_system_prompt")),
        (2, ("--learning_rate", "--mixing_learning_rate")),
    ):
        end = groups[group + 1] if group + 1 < len(groups) else len(out)
        assert all(groups[group] < out.index(f"  {flag} ") < end for flag in flags), flags
    # The package's own flags say so first; TRL's do not.
    described = re.sub(r"\s+", " ", out)
    for flag in ("--iha_options IHA_OPTIONS", "--default_system_prompt DEFAULT_SYSTEM_PROMPT"):
        assert f"{flag} (iha) " in described, flag
    assert "--lora_r LORA_R (iha)" not in described and "--lora_r LORA_R LoRA R value." in described


def hf_declaration(action: argparse.Action) -> dict:
    """What a flag accepts, as `argparse` declares it (the bool converter compared by what it reads)."""
    converts = action.type
    if converts is not None and converts.__name__ == "string_to_bool":
        converts = tuple(converts(word) for word in ("yes", "TRUE", "t", "y", "1", "no", "False", "f", "n", "0"))
    declared = ("nargs", "const", "default", "required", "choices", "help", "dest")
    return {"options": action.option_strings, "type": converts, **{key: getattr(action, key) for key in declared}}


def test_sft_parses_trls_model_and_script_flags_as_trl_declares_them():
    from trl import ModelConfig, ScriptArguments, TrlParser

    ours = {action.dest: hf_declaration(action) for action in sft_cli.make_parser()._actions}
    for dataclass_type in (ModelConfig, ScriptArguments):
        trls = [hf_declaration(action) for action in TrlParser(dataclass_type)._actions if action.dest != "help"]
        assert trls and all(ours[declaration["dest"]] == declaration for declaration in trls), dataclass_type


def test_sft_command_line_accepts_trl_flags_and_checks_its_own(tmp_path, capsys):
    argv = ["--model_name_or_path", "m", "--dataset_name", "d", "--learning_rate", "1e-3", "--packing"]
    argv += ["--lora_target_modules", "q_proj", "k_proj", "--max_length", "64", "--use_peft", "--output_dir", "o"]
    arguments = sft_cli.parse_args(argv)
    assert arguments.model.use_peft is True and arguments.model.lora_target_modules == ["q_proj", "k_proj"]
    training = arguments.training
    assert training.learning_rate == 1e-3 and training.packing is True and training.max_length == 64
    # TRL turns one module into a string (PEFT's regex of full names): it still names that module.
    one_module = sft_cli.parse_args([*argv[:-6], "--lora_target_modules", "v_proj", "--use_peft", "--output_dir", "o"])
    assert one_module.model.lora_target_modules == "v_proj"
    assert iha_peft_config(one_module.model).target_modules == {"v_proj"}
    # TRL's own LoRA config of the flags, with the mixing trained in full and every projection adapted by default.
    lora = iha_peft_config(arguments.model)
    assert (lora.target_modules, lora.modules_to_save, lora.r) == ({"q_proj", "k_proj"}, ["head_mixing"], 16)
    default = iha_peft_config(sft_cli.parse_args([*argv[:-8], "--use_peft", "--output_dir", "o"]).model)
    assert default.target_modules == set(DEFAULT_LORA_TARGET_MODULES)
    assert iha_peft_config(sft_cli.parse_args(argv[:-3] + ["--output_dir", "o"]).model) is None  # no --use_peft
    config = tmp_path / "run.yaml"
    config.write_text("model_name_or_path: m\ndataset_name: d\noutput_dir: o\nmixing_learning_rate: 0.01\nlora_r: 4\n")
    from_file = sft_cli.parse_args([str(config)])
    assert (from_file.model.model_name_or_path, from_file.model.lora_r, from_file.training.mixing_learning_rate) == (
        "m",
        4,
        0.01,
    )
    with pytest.raises(SystemExit) as exit:
        sft_cli.parse_args(["--model_name_or_path", "m", "--dataset_name", "d", "--lora_r", "many"])
    assert exit.value.code == 2 and "--lora_r" in capsys.readouterr().err


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_sft_config_file_missing_a_required_setting_is_one_line(tmp_path, capsys, suffix):
    config = tmp_path / f"run{suffix}"
    config.write_text(json.dumps({"dataset_name": "d.jsonl", "output_dir": str(tmp_path / "out")}))  # JSON is YAML
    assert sft_cli.main([str(config)]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("iha-sft: error: --model_name_or_path is required") and "\n" not in error
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "flags, problem",
    [
        (["--dataset_streaming"], "--dataset_streaming is not supported"),
        (["--ignore_bias_buffers"], "--ignore_bias_buffers has no effect"),
        (["--load_in_8bit"], "with --use_peft"),
    ],
)
def test_sft_refuses_trl_flags_it_cannot_honour(tmp_path, capsys, flags, problem):
    argv = ["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", str(tmp_path / "out"), *flags]
    assert sft_cli.main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("iha-sft: error: ") and problem in error and "\n" not in error


def test_conversion_choices_and_defaults_are_the_configs():
    # Each setting that fills a config field takes that field's choices and default (layer_iha.py), except the one
    # default an exact conversion needs: shared positions.
    for setting in dataclasses.fields(options.IHAConversionOptions):
        field_name = setting.metadata.get("config_field")
        if field_name is None:
            continue
        assert setting.metadata["choices"] is layer_iha.FIELD_CHOICES[field_name], setting.name
        expected_default = "shared" if setting.name == "position_mode" else layer_iha.FIELD_DEFAULTS[field_name]
        assert setting.default == expected_default, setting.name


IMPORT_REGISTERS = """
import iha
from transformers import AutoConfig, AutoModelForCausalLM
from iha import IHAConfig, IHAForCausalLM, IHAHeadMixing, paper_hybrid_layout

config = AutoConfig.for_model("iha", vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                              num_attention_heads=4, num_key_value_heads=4)
model = AutoModelForCausalLM.from_config(config)
print(type(config).__name__, type(model).__name__, IHAConfig.__name__, type(model)._auto_class)
"""


def test_import_iha_registers_the_auto_classes():
    result = subprocess.run(
        [sys.executable, "-c", IMPORT_REGISTERS],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=REPO_ROOT,
        env=ENV,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["IHAConfig", "IHAForCausalLM", "IHAConfig", "AutoModelForCausalLM"]


@pytest.mark.slow
def test_a_command_run_from_the_console_script_has_the_classes_registered(tmp_path):
    # `iha eval` loads the model with AutoModelForCausalLM and without trust_remote_code: it works on an IHA folder
    # only if the dispatcher registered the IHA classes before the command ran.
    from testing_utils import tiny_llama_for_tokenizer
    from transformers import AutoTokenizer

    from iha.conversion import llama_to_iha
    from iha.conversion.builtin import smollm2_dir

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir())
    llama_to_iha(tiny_llama_for_tokenizer(tokenizer)).save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    problems = tmp_path / "problems.jsonl"
    problems.write_text(json.dumps({"question": "What is 1 + 1?", "answer": "1 + 1 = 2\n#### 2"}) + "\n")
    argv = ["math", "--model", f"tiny={tmp_path / 'tiny'}", "--dataset", f"gsm8k={problems}", "--max-new-tokens", "2"]
    argv += ["--device", "cpu", "--output-dir", str(tmp_path / "eval")]
    outcome, out, err = run_script("evaluate", "iha-eval", *argv)
    assert outcome["status"] == 0, err[-2000:]
    result = json.loads((tmp_path / "eval" / "tiny_gsm8k.json").read_text())
    assert result["model"] == "tiny" and len(result["problems"]) == 1


def test_a_yes_no_flag_and_its_no_flag_each_say_what_they_do(capsys, monkeypatch):
    status, out = help_page("convert", "iha-convert", capsys=capsys, monkeypatch=monkeypatch)
    assert status == 0
    described = re.sub(r"\s+", " ", out)
    assert "--verify run the source and the converted model on a fixed batch and compare their logits" in described
    assert "--no_verify skip that check: write the converted folder unverified" in described
