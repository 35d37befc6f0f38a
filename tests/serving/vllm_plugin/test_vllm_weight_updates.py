"""Weights pushed into a running engine, as a trainer with vLLM rollouts does (TRL's GRPO, `use_vllm=True`): after
the update the engine decodes what `generate()` decodes with the new weights, folded or with the explicit mixing,
tied or untied embeddings; on vLLM's CPU build that needs `IHA_VLLM_UPDATABLE_WEIGHTS=1` (its kernels repack the
weights at load), and without it an update is refused in one line. TRL's GRPOTrainer itself, colocated with the
engine, trains two steps on its rollouts and leaves the engine in step with the trained model."""

import pytest


pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm_cases import reference_greedy, reference_model, run_batch, tiny_iha_folder, vllm_engine  # noqa: E402

from iha.serving.vllm.updatable_weights import UPDATABLE_WEIGHTS_VARIABLE  # noqa: E402


PROMPTS = [[1, 5, 7, 9], list(range(3, 40)), [11] * 3 + list(range(20, 60))]
NEW_TOKENS = 12

# (the folder's config, the engine's `hf_overrides`)
LAYOUTS = {
    "folded-tied": (dict(num_pseudo_heads=2, iha_position_mode="shared"), None),
    "explicit-untied-biases": (
        dict(num_pseudo_heads=3, iha_position_mode="virtual", tie_word_embeddings=False, qkv_bias=True),
        {"iha_fold_mixing": False},
    ),
}


def engine_tokens(llm) -> list[list[int]]:
    return [list(output.outputs[0].token_ids) for output in run_batch(llm, PROMPTS, [NEW_TOKENS] * len(PROMPTS))]


def push_weights(llm, model) -> None:
    """`model`'s tensors into the engine one `load_weights` call each, by their transformers names: TRL's sync."""
    for name, parameter in model.named_parameters():
        llm.apply_model(lambda engine_model, item=(name, parameter.detach()): engine_model.load_weights([item]))
    llm.reset_prefix_cache()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_weights_pushed_into_a_running_engine_decode_like_generate(layout, tmp_path, monkeypatch):
    monkeypatch.setenv(UPDATABLE_WEIGHTS_VARIABLE, "1")
    settings, overrides = LAYOUTS[layout]
    started_from = reference_model(tiny_iha_folder(tmp_path / "start", seed=0, **settings))
    updated = reference_model(tiny_iha_folder(tmp_path / "update", seed=1, **settings))
    expected_before = [reference_greedy(started_from, prompt, NEW_TOKENS) for prompt in PROMPTS]
    expected_after = [reference_greedy(updated, prompt, NEW_TOKENS) for prompt in PROMPTS]
    assert expected_before != expected_after  # so that a sync that changed nothing would fail

    with vllm_engine(tmp_path / "start", hf_overrides=overrides) as llm:
        assert engine_tokens(llm) == expected_before
        push_weights(llm, updated)
        assert engine_tokens(llm) == expected_after


def test_an_update_of_weights_the_cpu_build_packed_is_refused_naming_the_setting(tmp_path, monkeypatch):
    monkeypatch.delenv(UPDATABLE_WEIGHTS_VARIABLE, raising=False)
    folder = tiny_iha_folder(tmp_path / "model", seed=0)
    with vllm_engine(folder) as llm:
        with pytest.raises(Exception, match=f"cannot be updated in place.*{UPDATABLE_WEIGHTS_VARIABLE}=1"):
            push_weights(llm, reference_model(folder))


def completion_length_reward(completions, **kwargs) -> list[float]:
    """Longer completions score higher: random tokens differ in length, so the rewards differ within a group."""
    return [float(len(completion)) for completion in completions]


def test_grpo_trains_on_vllm_rollouts_colocated_and_keeps_the_engine_in_step(tmp_path, monkeypatch):
    pytest.importorskip("trl")
    from datasets import Dataset
    from testing_utils import build_tiny_tokenizer, tiny_iha_model, tokenizer_settings
    from trl import GRPOConfig, GRPOTrainer
    from vllm.distributed import cleanup_dist_env_and_memory

    from iha.training import with_iha_mixing

    monkeypatch.setenv(UPDATABLE_WEIGHTS_VARIABLE, "1")
    tokenizer = build_tiny_tokenizer()
    # Head size 32, one the CPU kernel takes; random mixing, so that the rollouts need the mixing to be right.
    model = tiny_iha_model(
        seed=0, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_pseudo_heads=2, max_position_embeddings=512, tie_word_embeddings=True, **tokenizer_settings(tokenizer),
    )  # fmt: skip
    folder = tmp_path / "model"  # colocated vLLM loads the trainer's model from its folder
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    model = type(model).from_pretrained(folder, dtype=torch.float32)
    start = {name: parameter.detach().clone() for name, parameter in model.named_parameters()}
    prompts = ["Natalia sold clips to", "A store has 5 apples and", "Tom reads 3 pages", "The train leaves at"]
    args = GRPOConfig(
        output_dir=str(tmp_path / "grpo"), max_steps=2, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=8, temperature=1.0, learning_rate=1e-2, lr_scheduler_type="constant",
        gradient_checkpointing=False, logging_steps=1, bf16=False, use_cpu=True, report_to="none",
        save_strategy="no", seed=0, disable_tqdm=True,
        use_vllm=True, vllm_mode="colocate", vllm_max_model_length=256, vllm_enable_sleep_mode=False,
    )  # fmt: skip
    trainer = with_iha_mixing(GRPOTrainer)(
        model=model, reward_funcs=completion_length_reward, args=args,
        train_dataset=Dataset.from_list([{"prompt": prompt} for prompt in prompts]), processing_class=tokenizer,
    )  # fmt: skip
    try:
        trainer.train()
        steps = [entry for entry in trainer.state.log_history if "grad_norm" in entry]
        assert len(steps) == 2 and all(step["grad_norm"] > 0 for step in steps)
        # vLLM's log-probabilities of the tokens it sampled, against the trainer's own: the second step's rollouts
        # came from the weights the first step trained, so the sync in between took.
        assert all(step["sampling/sampling_logp_difference/max"] < 0.02 for step in steps), steps
        trained = dict(trainer.model.named_parameters())
        assert any(
            (trained[name] - value).abs().max() > 1e-3 for name, value in start.items() if ".head_mixing." in name
        )

        trainer.vllm_generation.sync_weights()  # the second step's update, as the next step would push it
        llm = trainer.vllm_generation.llm
        trainer.model.eval().generation_config.eos_token_id = None
        expected = [reference_greedy(trainer.model, prompt, NEW_TOKENS) for prompt in PROMPTS]
        assert engine_tokens(llm) == expected
    finally:
        trainer.vllm_generation.llm.llm_engine.engine_core.shutdown()
        cleanup_dist_env_and_memory()
