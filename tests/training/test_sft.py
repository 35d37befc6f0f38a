"""SFT of tiny IHA models with TRL: loss goes down, mixing moves, LoRA saves / reloads / merges, resume is exact."""

import json
import math
import os
import stat
import warnings

import pytest
import torch
from safetensors.torch import load_file
from testing_utils import (
    QUIET_RUN_FLAGS,
    TRAINING_MODEL,
    build_tiny_tokenizer,
    gsm8k_openthoughts_rows,
    identity_mixing,
    mixing_parameters,
    tiny_iha_config,
    tiny_iha_model,
    tokenizer_settings,
)
from transformers import AutoModelForCausalLM, AutoTokenizer

import iha
import iha.conversion  # the conversion on the fly: a broken import fails these tests, it does not skip them
from iha.cli.sft import make_parser, run_cli
from iha.data.messages import write_jsonl
from iha.hub.licenses import package_license_text
from iha.hub.model_card import read_model_card
from iha.training import (
    BASE_RECORD_NAME,
    IHAModelConfig,
    IHAScriptArguments,
    IHASFTConfig,
    IHASFTTrainer,
    bf16_supported_here,
    is_mixing_parameter,
    load_sft_output,
    merge_lora,
    train_sft,
)


MAX_LENGTH = 640


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    build_tiny_tokenizer(path)
    return path


@pytest.fixture
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def rows():
    return gsm8k_openthoughts_rows(96)


def sft_config(output_dir, **overrides) -> IHASFTConfig:
    settings = dict(
        output_dir=str(output_dir),
        max_steps=30,
        per_device_train_batch_size=2,
        learning_rate=3e-3,
        mixing_learning_rate=3e-2,
        lr_scheduler_type="constant",
        logging_steps=1,
        max_length=MAX_LENGTH,
        packing=True,
        bf16=False,
        report_to="none",
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    return IHASFTConfig(**{**settings, **overrides})


def losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def logits(model, input_ids) -> torch.Tensor:
    # On the CPU whatever the model's device: a trainer leaves its model on the GPU where there is one.
    model.eval()
    with torch.no_grad():
        return model(input_ids=input_ids.to(model.device)).logits.cpu()


def test_mixing_parameter_names():
    assert is_mixing_parameter("model.layers.3.self_attn.head_mixing.alpha_q")
    assert is_mixing_parameter("model.layers.3.self_attn.head_mixing.collapse")
    assert is_mixing_parameter("base_model.model.model.layers.0.self_attn.head_mixing.modules_to_save.default.alpha_v")
    assert is_mixing_parameter("_fsdp_wrapped_module.model.layers.0.self_attn.head_mixing.alpha_k")
    assert not is_mixing_parameter("model.layers.0.self_attn.head_mixing.alpha_q_extra")
    assert not is_mixing_parameter("model.layers.0.self_attn.q_proj.weight")


def test_optimizer_gives_mixing_parameters_their_own_lr_and_weight_decay(tokenizer, rows, tmp_path):
    model = tiny_iha_model(randomize=False, **TRAINING_MODEL, **tokenizer_settings(tokenizer))
    args = sft_config(tmp_path, weight_decay=0.1, mixing_learning_rate=5e-2, mixing_weight_decay=0.0)
    trainer = IHASFTTrainer(model=model, args=args, train_dataset=_messages(rows[:8]), processing_class=tokenizer)
    optimizer = trainer.create_optimizer()
    groups = {group["iha_group"]: group for group in optimizer.param_groups}
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    mixing_names = {names[id(p)] for p in groups["mixing"]["params"]}
    expected = {name for name, _ in model.named_parameters() if ".head_mixing." in name}
    assert mixing_names == expected and len(expected) == 2 * 4  # 2 IHA layers x (alpha_q, alpha_k, alpha_v, collapse)
    assert (groups["mixing"]["lr"], groups["mixing"]["weight_decay"]) == (5e-2, 0.0)
    assert (groups["decay"]["lr"], groups["decay"]["weight_decay"]) == (3e-3, 0.1)
    assert groups["no_decay"]["weight_decay"] == 0.0
    assert all("norm" in names[id(p)] for p in groups["no_decay"]["params"])
    grouped = [id(p) for group in optimizer.param_groups for p in group["params"]]
    assert sorted(grouped) == sorted(id(p) for p in model.parameters()) and len(set(grouped)) == len(grouped)


def _messages(rows):
    from iha.data.messages import load_sft_dataset

    return load_sft_dataset(rows)


def test_full_sft_loss_decreases_mixing_moves_and_saves_hub_ready(tokenizer, rows, tmp_path):
    model = tiny_iha_model(randomize=False, **TRAINING_MODEL, **tokenizer_settings(tokenizer))
    output_dir = tmp_path / "full"
    trainer = train_sft(
        IHAScriptArguments(), sft_config(output_dir), IHAModelConfig(), model=model, train_dataset=rows,
        processing_class=tokenizer,
    )  # fmt: skip

    history = losses(trainer)
    assert len(history) == 30 and all(math.isfinite(loss) for loss in history)
    assert sum(history[-5:]) / 5 < sum(history[:5]) / 5 - 1.0, history

    # Every mixing tensor (alpha_q, alpha_k, alpha_v, collapse of both layers) left its identity start.
    identity = identity_mixing(model)
    trained = mixing_parameters(model)
    assert trained.keys() == identity.keys() and len(trained) == 8
    for name, value in trained.items():
        assert (value - identity[name]).abs().max() > 1e-3, name

    # The loss was on assistant turns only: labelled tokens hold the reasoning, never the system prompt or question.
    first = trainer.train_dataset[0]
    labelled = tokenizer.decode([t for t, label in zip(first["input_ids"], first["labels"]) if label != -100])
    everything = tokenizer.decode(first["input_ids"])
    assert "Your role as an assistant" in everything and "Your role as an assistant" not in labelled
    assert "<|begin_of_thought|>" in labelled and "<|end_of_solution|><|im_end|>" in labelled
    assert "Return your final response" not in labelled

    # Hub-ready: code files + auto_map, tokenizer with the generation-marked template; reloads to the same logits.
    config = json.loads((output_dir / "config.json").read_text())
    assert config["model_type"] == "iha" and "AutoModelForCausalLM" in config["auto_map"]
    assert (output_dir / "modeling_iha.py").is_file() and (output_dir / "configuration_iha.py").is_file()
    assert "{% generation %}" in AutoTokenizer.from_pretrained(output_dir).chat_template
    input_ids = torch.tensor([tokenizer.encode("Natalia sold 48/2 = 24 clips in May.")])
    reloaded = AutoModelForCausalLM.from_pretrained(output_dir)
    torch.testing.assert_close(logits(reloaded, input_ids), logits(model, input_ids), rtol=0, atol=1e-5)
    assert_shareable_folder(output_dir)
    assert json.loads((output_dir / "training_args.json").read_text())["learning_rate"] == 3e-3


def assert_shareable_folder(folder):
    """What a folder meant for the Hub holds: no pickle (the training arguments are JSON), files with the user's
    usual mode (transformers' save_pretrained stages model.safetensors as a private temporary file), the package's
    LICENSE for the code files and a `license:` in the card."""
    umask = os.umask(0)
    os.umask(umask)
    files = [path for path in folder.rglob("*") if path.is_file()]
    assert not [path.name for path in files if path.suffix in (".bin", ".pt", ".pth", ".pkl")]
    modes = {path.name: oct(stat.S_IMODE(path.stat().st_mode)) for path in files}
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes
    assert (folder / "LICENSE").read_text() == package_license_text()
    assert read_model_card(folder).metadata["license"] == "apache-2.0"


def test_lora_adapter_saves_mixing_reloads_and_merges(tokenizer_dir, tokenizer, rows, tmp_path, monkeypatch):
    base_dir = tmp_path / "base"
    tiny_iha_model(seed=1, randomize=False, **TRAINING_MODEL, **tokenizer_settings(tokenizer)).save_pretrained(base_dir)
    tokenizer.save_pretrained(base_dir)
    write_jsonl(rows, tmp_path / "train.jsonl")
    output_dir = tmp_path / "lora"
    # Relative paths, as a user types them; no --bf16 flag: on this CPU-only machine the default must be fp32.
    monkeypatch.chdir(tmp_path)
    trainer = run_cli(
        [
            "--model_name_or_path", "base",
            "--dataset_name", "train.jsonl",
            "--output_dir", "lora",
            "--use_peft",
            "--lora_r", "8",
            "--max_steps", "8",
            "--per_device_train_batch_size", "2",
            "--learning_rate", "1e-2",
            "--mixing_learning_rate", "3e-2",
            "--max_length", str(MAX_LENGTH),
            "--packing",
            *QUIET_RUN_FLAGS,
            "--merge_adapter",
        ]
    )  # fmt: skip
    assert trainer.args.bf16 is bf16_supported_here()
    monkeypatch.chdir(tokenizer_dir)  # everything below must work from another working directory
    peft_model = trainer.model
    assert all(math.isfinite(loss) for loss in losses(trainer))

    # The adapter file holds LoRA weights and the trained mixing weights; the base weights themselves are not in it.
    adapter_config = json.loads((output_dir / "adapter_config.json").read_text())
    assert set(adapter_config["target_modules"]) == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"
    }  # fmt: skip
    assert "head_mixing" in adapter_config["modules_to_save"]
    saved = load_file(output_dir / "adapter_model.safetensors")
    saved_mixing = {k: v for k, v in saved.items() if is_mixing_parameter(k)}
    assert len(saved_mixing) == 8 and any("lora_A" in k for k in saved)
    assert not any(k.endswith("q_proj.weight") for k in saved)
    identity = identity_mixing(peft_model)
    trained = mixing_parameters(peft_model)
    for name, value in trained.items():
        assert (value - identity[name]).abs().max() > 1e-3, name
    # The base is recorded as an absolute path, in our record and in PEFT's own config.
    assert json.loads((output_dir / BASE_RECORD_NAME).read_text())["base_model_name_or_path"] == str(base_dir)
    assert adapter_config["base_model_name_or_path"] == str(base_dir)

    input_ids = torch.tensor([tokenizer.encode("Weng earns 12/60 = $0.2 per minute.")])
    expected = logits(peft_model, input_ids)
    # Reloaded from disk on a fresh base: same outputs. Merged (in memory and the folder --merge_adapter wrote): same.
    reloaded = load_sft_output(output_dir)
    torch.testing.assert_close(logits(reloaded, input_ids), expected, rtol=0, atol=1e-5)
    merged = load_sft_output(output_dir, merge=True)
    assert isinstance(merged, iha.IHAForCausalLM)
    torch.testing.assert_close(logits(merged, input_ids), expected, rtol=0, atol=1e-5)
    merged_from_folder = AutoModelForCausalLM.from_pretrained(output_dir / "merged")
    torch.testing.assert_close(logits(merged_from_folder, input_ids), expected, rtol=0, atol=1e-5)
    assert (output_dir / "merged" / "modeling_iha.py").is_file()
    assert_shareable_folder(output_dir)  # the adapter's folder, merged/ included
    assert_shareable_folder(output_dir / "merged")
    assert "{% generation %}" in AutoTokenizer.from_pretrained(output_dir / "merged").chat_template
    # The merge must differ from the untouched base, or the comparison above would prove nothing.
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    assert (logits(base, input_ids) - expected).abs().max() > 1e-3
    with pytest.raises(FileExistsError, match="choose a new folder"):
        merge_lora(output_dir, output_dir / "merged")

    # The cards: no "None" base, no raw enum, a local base is not put in the Hub metadata, merged/ has its own.
    card = read_model_card(output_dir)
    text = (output_dir / "README.md").read_text()
    assert "None" not in text and "SchedulerType" not in text and "(linear)" in card.sections["Training"]
    assert "base_model" not in card.metadata and card.metadata["library_name"] == "peft"
    assert 'load_sft_output("lora")' in card.sections["How to load"]  # the folder as the command named it
    merged_card = read_model_card(output_dir / "merged")
    assert merged_card.sections["Training"] == card.sections["Training"]
    assert "trust_remote_code=True" in merged_card.sections["How to load"]
    assert 'from_pretrained("lora/merged")' in merged_card.sections["How to load"]

    # A base that has gone: one error naming it, not a network error about a path taken for a Hub id.
    base_dir.rename(tmp_path / "moved")
    with pytest.raises(FileNotFoundError, match=f"trained on the base model {base_dir}, which does not exist"):
        load_sft_output(output_dir)
    reloaded = load_sft_output(output_dir, base_model=str(tmp_path / "moved"))
    torch.testing.assert_close(logits(reloaded, input_ids), expected, rtol=0, atol=1e-5)


def test_bf16_follows_the_hardware_unless_set(tmp_path):
    assert IHASFTConfig(output_dir=str(tmp_path)).bf16 is bf16_supported_here()
    assert IHASFTConfig(output_dir=str(tmp_path), use_cpu=True).bf16 is True  # TRL's default, where it can run
    assert IHASFTConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False).bf16 is False
    assert IHASFTConfig(output_dir=str(tmp_path), bf16=False).bf16 is False


def test_activation_checkpointing_keeps_trls_default_under_its_current_name_without_a_warning(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # transformers: "`gradient_checkpointing` is deprecated"
        default = IHASFTConfig(output_dir=str(tmp_path), use_cpu=True)
        off = IHASFTConfig(output_dir=str(tmp_path), use_cpu=True, gradient_checkpointing=False)
    assert default.activation_checkpointing is True and default.gradient_checkpointing is True  # TRL's default
    assert off.activation_checkpointing is False and off.gradient_checkpointing is False


def test_resume_from_checkpoint_continues_the_same_run(tokenizer, rows, tmp_path):
    overrides = dict(max_steps=6, save_strategy="steps", save_steps=3, lr_scheduler_type="linear", warmup_steps=2)
    uninterrupted = tiny_iha_model(seed=2, randomize=False, **TRAINING_MODEL, **tokenizer_settings(tokenizer))
    in_memory = dict(train_dataset=rows, processing_class=tokenizer)
    full = train_sft(
        IHAScriptArguments(), sft_config(tmp_path / "a", **overrides), IHAModelConfig(), model=uninterrupted,
        **in_memory,
    )  # fmt: skip
    assert (tmp_path / "a" / "checkpoint-3" / "optimizer.pt").is_file()

    resumed_model = tiny_iha_model(seed=2, randomize=False, **TRAINING_MODEL, **tokenizer_settings(tokenizer))
    # As `--resume_from_checkpoint`: the training config's own setting.
    resume = sft_config(tmp_path / "b", resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-3"), **overrides)
    resumed = train_sft(IHAScriptArguments(), resume, IHAModelConfig(), model=resumed_model, **in_memory)
    assert resumed.state.global_step == 6
    by_step = {entry["step"]: entry["loss"] for entry in full.state.log_history if "loss" in entry}
    resumed_by_step = {entry["step"]: entry["loss"] for entry in resumed.state.log_history if "loss" in entry}
    assert resumed_by_step == pytest.approx(by_step, rel=1e-5)
    # Same batches, same optimizer moments and schedule: the same final weights.
    final = dict(uninterrupted.named_parameters())
    for name, parameter in resumed_model.named_parameters():
        torch.testing.assert_close(parameter, final[name], rtol=1e-5, atol=1e-6, msg=name)
    # ... and they moved on from the checkpoint's weights, so the resumed run did train steps 4-6.
    at_step_3 = AutoModelForCausalLM.from_pretrained(tmp_path / "a" / "checkpoint-3")
    assert (at_step_3.model.embed_tokens.weight - resumed_model.model.embed_tokens.weight).abs().max() > 1e-4


def test_converts_a_llama_checkpoint_on_the_fly(tokenizer, rows, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    llama_settings = tiny_iha_config(**TRAINING_MODEL, **tokenizer_settings(tokenizer)).to_dict()
    llama_config = LlamaConfig(
        **{k: llama_settings[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")},
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(3)
    llama_dir = tmp_path / "llama"
    LlamaForCausalLM(llama_config).save_pretrained(llama_dir)
    tokenizer.save_pretrained(llama_dir)
    args = sft_config(tmp_path / "converted", max_steps=3)
    model_args = IHAModelConfig(model_name_or_path=str(llama_dir), iha_options='{"num_pseudo_heads": 2}')
    assert model_args.iha_options["num_pseudo_heads"] == 2  # the flag's JSON, read into the dict Python passes
    trainer = train_sft(IHAScriptArguments(), args, model_args, train_dataset=rows[:16])
    assert isinstance(trainer.model, iha.IHAForCausalLM)
    assert trainer.model.config.num_pseudo_heads == 2
    assert json.loads((tmp_path / "converted" / "config.json").read_text())["model_type"] == "iha"
    card = read_model_card(tmp_path / "converted")
    assert "None" not in (tmp_path / "converted" / "README.md").read_text()
    assert "converted" in card.intro and "trust_remote_code=True" in card.sections["How to load"]
    assert "base_model" not in card.metadata  # a local folder is no Hub id

    baseline = train_sft(
        IHAScriptArguments(),
        sft_config(tmp_path / "baseline", max_steps=2),
        IHAModelConfig(model_name_or_path=str(llama_dir), convert_to_iha=False),
        train_dataset=rows[:16],
    )
    assert type(baseline.model).__name__ == "LlamaForCausalLM"


def test_converts_a_gemma3_checkpoint_on_the_fly_trains_and_saves_it_hub_ready(tokenizer, rows, tmp_path):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    gemma3_config = Gemma3TextConfig(
        **{
            key: value
            for key, value in tiny_iha_config(**TRAINING_MODEL, **tokenizer_settings(tokenizer)).to_dict().items()
            if key in TINY_GEMMA3_FIELDS
        },
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=64,
        sliding_window_pattern=2,
    )
    torch.manual_seed(3)
    gemma3_dir = tmp_path / "gemma3"
    Gemma3ForCausalLM(gemma3_config).save_pretrained(gemma3_dir)
    tokenizer.save_pretrained(gemma3_dir)
    output_dir = tmp_path / "converted"
    trainer = train_sft(
        IHAScriptArguments(),
        sft_config(output_dir, max_steps=12),
        IHAModelConfig(model_name_or_path=str(gemma3_dir), iha_options={"num_pseudo_heads": 2}),
        train_dataset=rows[:32],
    )
    assert type(trainer.model) is iha.IHAGemma3ForCausalLM
    assert trainer.model.config.attention_types == ["iha_sliding_attention", "iha_full_attention"]
    history = losses(trainer)
    assert sum(history[-3:]) / 3 < sum(history[:3]) / 3 - 0.5, history
    for name, value in identity_mixing(trainer.model).items():
        assert (mixing_parameters(trainer.model)[name] - value).abs().max() > 1e-3, name

    config = json.loads((output_dir / "config.json").read_text())
    assert config["model_type"] == "iha_gemma3"
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_iha_gemma3.IHAGemma3ForCausalLM"
    assert (output_dir / "modeling_iha_gemma3.py").is_file() and (output_dir / "modeling_iha.py").is_file()
    input_ids = torch.tensor([tokenizer.encode("Natalia sold 48/2 = 24 clips in May.")])
    reloaded = AutoModelForCausalLM.from_pretrained(output_dir)
    assert type(reloaded) is iha.IHAGemma3ForCausalLM
    torch.testing.assert_close(logits(reloaded, input_ids), logits(trainer.model, input_ids), rtol=0, atol=1e-5)


TINY_GEMMA3_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "max_position_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)


def test_launch_without_use_cpu_is_refused(tokenizer, rows, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="pass `--use_cpu true`"):
        train_sft(
            IHAScriptArguments(),
            sft_config(tmp_path),
            IHAModelConfig(),
            model=tiny_iha_model(randomize=False, **TRAINING_MODEL, **tokenizer_settings(tokenizer)),
            train_dataset=rows[:4],
            processing_class=tokenizer,
        )


def test_the_old_call_is_refused_with_its_migration(tokenizer, rows, tmp_path):
    model = tiny_iha_model(randomize=False, **TRAINING_MODEL, **tokenizer_settings(tokenizer))
    with pytest.raises(TypeError, match=r"train_sft\(IHAScriptArguments\(dataset_name=\.\.\.\), IHASFTConfig"):
        train_sft(model, rows, sft_config(tmp_path), processing_class=tokenizer)
    with pytest.raises(ValueError, match="give one"):  # an object and a path: which one trains is not guessed
        train_sft(
            IHAScriptArguments(), sft_config(tmp_path), IHAModelConfig(model_name_or_path="elsewhere"), model=model,
            train_dataset=rows,
        )  # fmt: skip


def test_configs_take_trls_own_and_refuse_what_no_run_can_do(tmp_path):
    from trl import ModelConfig, ScriptArguments

    from iha.training.config import as_iha_config

    # TRL's own configs, as `trl sft` parses them: the same settings, the IHA ones at their defaults.
    model_args = as_iha_config(ModelConfig(model_name_or_path="m", use_peft=True, lora_r=4), IHAModelConfig)
    assert (model_args.model_name_or_path, model_args.lora_r, model_args.convert_to_iha) == ("m", 4, True)
    script_args = as_iha_config(ScriptArguments(dataset_name="d", dataset_train_split="t"), IHAScriptArguments)
    assert (script_args.dataset_name, script_args.dataset_train_split, script_args.filter_long_rows) == ("d", "t", True)
    with pytest.raises(ValueError, match="with --use_peft"):
        IHAModelConfig(model_name_or_path="m", load_in_8bit=True)
    with pytest.raises(ValueError, match="Unknown IHAConversionOptions setting"):
        IHAModelConfig(iha_options='{"num_pseudo_head": 2}')
    with pytest.raises(ValueError, match="--dataset_streaming is not supported"):
        IHAScriptArguments(dataset_name="d", dataset_streaming=True)


def test_command_line_help_lists_the_iha_flags():
    text = make_parser().format_help()  # argparse fails on a stray "%" in any help string
    for flag in ("--mixing_learning_rate", "--mixing_weight_decay", "--convert_to_iha", "--iha_options", "--use_peft"):
        assert flag in text


def test_only_tied_copies_leave_a_gathered_state_dict():
    # FSDP gathers separate tensors: the copy of a tied lm_head is dropped; an untied lm_head stays even when its
    # values happen to equal the embeddings (the class lists the tie the architecture allows, not the config's).
    from transformers import LlamaConfig, LlamaForCausalLM

    from iha.training.trainer import without_tied_copies

    for tie in (True, False):
        config = LlamaConfig(
            vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            tie_word_embeddings=tie,
        )  # fmt: skip
        model = LlamaForCausalLM(config)
        with torch.no_grad():
            model.lm_head.weight.copy_(model.model.embed_tokens.weight)
        gathered = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        kept = without_tied_copies(model, gathered)
        assert ("lm_head.weight" in kept) == (not tie)
        assert set(gathered) - set(kept) == ({"lm_head.weight"} if tie else set())
