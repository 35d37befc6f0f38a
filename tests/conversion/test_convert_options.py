"""The typed conversion settings: one name and type per setting, the command line generated from them, and bad
settings refused with one message that names them."""

import dataclasses
import json

import pytest
import testing_utils
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from iha.cli.arguments import dataclass_values
from iha.cli.convert import make_parser
from iha.conversion import CheckpointOptions, ConversionError, IHAConversionOptions, llama_to_iha
from iha.conversion.plan import plan_conversion


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**testing_utils.TINY, "num_hidden_layers": 3})).eval()


def parsed(argv: list[str]) -> tuple[IHAConversionOptions, CheckpointOptions]:
    args = make_parser().parse_args(["source", "output", *argv])
    return IHAConversionOptions(**dataclass_values(args, IHAConversionOptions)), CheckpointOptions(
        **dataclass_values(args, CheckpointOptions)
    )


def test_the_command_line_defaults_are_the_dataclass_defaults():
    assert parsed([]) == (IHAConversionOptions(), CheckpointOptions())


def test_every_flag_parses_into_its_setting():
    argv = "-P 4 --layers 0,2 --training-length 256 --mask-mode token_causal --position-mode virtual "
    argv += "--collapse-mode global --collapse-init mean --dtype bfloat16 --max-shard-size 2GB --overwrite "
    argv += "--base-model org/base --allow-pickle --revision v1 --token hf_x --cache-dir /cache --no-verify "
    argv += "--tolerance 0.001"
    assert parsed(argv.split()) == (
        IHAConversionOptions(
            num_pseudo_heads=4,
            layers="0,2",
            training_length=256,
            mask_mode="token_causal",
            position_mode="virtual",
            collapse_mode="global",
            collapse_init="mean",
        ),
        CheckpointOptions(
            dtype="bfloat16",
            max_shard_size="2GB",
            overwrite=True,
            base_model="org/base",
            allow_pickle=True,
            revision="v1",
            token="hf_x",
            cache_dir="/cache",
            verify=False,
            tolerance=0.001,
        ),
    )


@pytest.mark.parametrize(
    "argv",
    [["--overwrite", "SRC", "DST"], ["SRC", "--overwrite", "DST"], ["SRC", "DST", "--overwrite"]],
)
def test_yes_no_flags_take_no_value_and_leave_the_folders_alone(argv):
    """`iha-convert`'s yes/no flags go anywhere: none of them takes the folder after it as its value."""
    args = make_parser().parse_args([*argv, "--no_verify", "--allow_pickle"])
    assert (args.source, args.output_dir) == ("SRC", "DST")
    assert args.overwrite is True and args.allow_pickle is True and args.verify is False
    defaults = make_parser().parse_args(["SRC", "DST"])
    assert defaults.overwrite is False and defaults.allow_pickle is False and defaults.verify is True


def test_a_new_setting_gets_its_flag_without_touching_the_command_line():
    destinations = {action.dest for action in make_parser()._actions}
    for options_class in (IHAConversionOptions, CheckpointOptions):
        assert {setting.name for setting in dataclasses.fields(options_class)} <= destinations


def test_choices_are_refused_by_the_command_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parsed(["--mask-mode", "causal"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'causal'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"mask_mode": "causal"}, r"`mask_mode` must be one of \['flat_causal', 'token_causal'\], got 'causal'"),
        ({"num_pseudo_heads": 0}, r"`num_pseudo_heads` must be an integer >= 1, got 0"),
        ({"num_pseudo_heads": "2"}, r"`num_pseudo_heads` must be an integer >= 1, got '2'"),
        ({"training_length": -1}, r"`training_length` must be a positive integer or None, got -1"),
        ({"layers": 3}, r"`layers` must be 'all', 'hybrid', or layer indices"),
    ],
)
def test_bad_iha_settings_are_named(settings, message):
    with pytest.raises(ValueError, match=message):
        IHAConversionOptions(**settings)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"dtype": "int8"}, r"--dtype must be 'auto' or one of \['float32', 'bfloat16', 'float16'\], got 'int8'"),
        ({"tolerance": 0.0}, r"--tolerance must be a positive number of logits, got 0.0"),
        ({"max_shard_size": "big"}, r"--max_shard_size must look like 5GB, 500MB or a number of bytes, got 'big'"),
    ],
)
def test_bad_checkpoint_settings_are_named(settings, message):
    with pytest.raises(ConversionError, match=message):
        CheckpointOptions(**settings)


def test_json_settings_and_their_unknown_keys():
    assert IHAConversionOptions.from_json('{"num_pseudo_heads": 4, "layers": [0, 2]}') == IHAConversionOptions(
        num_pseudo_heads=4, layers=[0, 2]
    )
    with pytest.raises(ValueError, match=r"Unknown IHAConversionOptions setting\(s\) \['num_pseudo_head'\]: "):
        IHAConversionOptions.from_json('{"num_pseudo_head": 4}')
    with pytest.raises(ValueError, match="not valid JSON"):
        IHAConversionOptions.from_json("{num_pseudo_heads: 4}")
    with pytest.raises(ValueError, match="must be a JSON object"):
        IHAConversionOptions.from_json("[4]")


def test_the_settings_fill_the_config_fields_of_their_meaning():
    options = IHAConversionOptions(num_pseudo_heads=3, mask_mode="token_causal", collapse_init="first")
    config = plan_conversion(tiny_llama().config, options).config
    assert (config.num_pseudo_heads, config.iha_mask_mode, config.iha_position_mode, config.iha_collapse_init) == (
        3,
        "token_causal",
        "shared",
        "first",
    )


def test_options_keywords_and_a_dict_convert_alike():
    model = tiny_llama()
    input_ids, attention_mask = testing_utils.left_padded_batch()
    by_options = llama_to_iha(model, IHAConversionOptions(num_pseudo_heads=3, layers=[0, 2]))
    by_keywords = llama_to_iha(model, num_pseudo_heads=3, layers="0,2")
    by_dict = llama_to_iha(model, json.loads('{"num_pseudo_heads": 3, "layers": [0, 2]}'))
    for other in (by_keywords, by_dict):
        assert other.config.to_dict() == by_options.config.to_dict()
        with torch.no_grad():
            logits = other(input_ids=input_ids, attention_mask=attention_mask).logits
            assert torch.equal(logits, by_options(input_ids=input_ids, attention_mask=attention_mask).logits)


def test_unknown_keywords_are_refused_with_the_list_of_settings():
    with pytest.raises(TypeError, match=r"llama_to_iha\(\) got unknown setting\(s\) \['pseudo_heads'\]: the settings"):
        llama_to_iha(tiny_llama(), pseudo_heads=2)


def test_sft_refuses_unknown_iha_options_before_loading_anything(tmp_path, capsys):
    from iha.cli.sft import main as sft_main

    argv = ["--model_name_or_path", str(tmp_path / "no-model"), "--dataset_name", str(tmp_path / "no-rows.jsonl")]
    argv += ["--output_dir", str(tmp_path / "out"), "--iha_options", '{"num_pseudo_head": 2}']
    assert sft_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("iha-sft: error: Unknown IHAConversionOptions setting(s) ['num_pseudo_head']: ")
    assert not (tmp_path / "out").exists()
