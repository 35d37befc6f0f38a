"""TRL's DPOTrainer and GRPOTrainer train a tiny IHA model with `with_iha_mixing`: the mixing in its own optimizer
group leaves identity, the DPO loss falls, and GRPO with the math-verify `\\boxed{}` reward makes the rewarded answer
more likely."""

import pytest
import torch
from datasets import Dataset
from testing_utils import (
    GSM8K_TRAIN,
    TRAINING_MODEL,
    build_tiny_tokenizer,
    identity_mixing,
    mixing_parameters,
    tiny_iha_model,
    tokenizer_settings,
)
from transformers import AutoModelForCausalLM

from iha.training import IHAMixingMixin, boxed_answer_reward, math_prompt_rows, with_iha_mixing


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def shortest_gsm8k_rows(count: int, answer: str | None = None) -> list[dict]:
    """GRPO rows (`prompt`, `answer`) of the shortest GSM8K training questions, with the given answer if one is set."""
    rows = math_prompt_rows(str(GSM8K_TRAIN), limit=2000)
    rows = [row for row in rows if answer is None or row["answer"] == answer]
    return sorted(rows, key=lambda row: len(row["prompt"][0]["content"]))[:count]


def assert_mixing_left_identity(model, minimum: float = 1e-3):
    identity = identity_mixing(model)
    trained = mixing_parameters(model)
    assert len(trained) == 8
    for name, value in trained.items():
        assert (value - identity[name]).abs().max() > minimum, name


def mixing_group_learning_rate(trainer) -> float:
    groups = {group["iha_group"]: group for group in trainer.optimizer.param_groups}
    assert set(groups) == {"decay", "no_decay", "mixing"}
    return groups["mixing"]["lr"]


def test_boxed_answer_reward_reads_the_final_answer_like_the_evaluation():
    completions = [
        "so \\boxed{5}.",
        [{"role": "assistant", "content": "#### 5"}],
        "\\boxed{3}",
        "no answer",
        "\\boxed{5.0}",
    ]
    assert boxed_answer_reward(completions, answer=["5"] * 5) == [1.0, 1.0, 0.0, 0.0, 1.0]


def test_with_iha_mixing_builds_one_subclass():
    from transformers import Trainer

    from iha.training import IHASFTTrainer

    trainer_class = with_iha_mixing(Trainer)
    assert trainer_class.__name__ == "IHATrainer" and issubclass(trainer_class, (IHAMixingMixin, Trainer))
    assert with_iha_mixing(IHASFTTrainer) is IHASFTTrainer  # already has the mixing groups


def test_dpo_trainer_trains_an_iha_model_with_the_mixing_group(tokenizer, tmp_path):
    from trl import DPOConfig, DPOTrainer

    model_dir = tmp_path / "model"
    tiny_iha_model(seed=0, randomize=False, **TRAINING_MODEL, **tokenizer_settings(tokenizer)).save_pretrained(
        model_dir
    )
    tokenizer.save_pretrained(model_dir)
    pairs = [
        {
            "prompt": row["prompt"],
            "chosen": [{"role": "assistant", "content": f"The answer is \\boxed{{{row['answer']}}}."}],
            "rejected": [{"role": "assistant", "content": f"The answer is \\boxed{{{int(row['answer']) + 1}}}."}],
        }
        for row in shortest_gsm8k_rows(4)
    ]
    args = DPOConfig(
        output_dir=str(tmp_path / "dpo"), max_steps=8, per_device_train_batch_size=4, learning_rate=1e-3,
        lr_scheduler_type="constant", gradient_checkpointing=True, logging_steps=1, bf16=False, use_cpu=True,
        report_to="none", save_strategy="no", seed=0, disable_tqdm=True,
    )  # fmt: skip
    # The policy and its reference as models: TRL below 1.7 cannot load a custom architecture from a path.
    policy = AutoModelForCausalLM.from_pretrained(model_dir)
    reference = AutoModelForCausalLM.from_pretrained(model_dir)
    trainer = with_iha_mixing(DPOTrainer)(
        model=policy, ref_model=reference, args=args, train_dataset=Dataset.from_list(pairs),
        processing_class=tokenizer, mixing_learning_rate=1e-2,
    )  # fmt: skip
    trainer.train()

    history = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert history[0]["loss"] == pytest.approx(0.6931, abs=1e-3)  # the policy starts as its reference: log 2
    assert history[-1]["loss"] < history[0]["loss"] - 0.1 and history[-1]["rewards/margins"] > 0.1
    assert mixing_group_learning_rate(trainer) == 1e-2
    assert_mixing_left_identity(trainer.model)
    assert trainer.model.is_gradient_checkpointing
    assert trainer.model.lm_head.weight is trainer.model.model.embed_tokens.weight  # the tie survives training
    assert mixing_parameters(trainer.ref_model).keys() == identity_mixing(trainer.ref_model).keys()
    for name, value in mixing_parameters(trainer.ref_model).items():
        assert torch.equal(value, identity_mixing(trainer.ref_model)[name]), name  # the reference stays put


def answer_log_probability(model, tokenizer, rows, answer: str) -> float:
    """Mean over the rows' prompts of log p(`\\boxed{answer}` + end of turn) under `model`."""
    completion = tokenizer(f"\\boxed{{{answer}}}{tokenizer.eos_token}", add_special_tokens=False)["input_ids"]
    model.eval()
    total = 0.0
    with torch.no_grad():
        for row in rows:
            prompt_text = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
            prompt = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
            log_probs = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
            total += log_probs.gather(-1, torch.tensor(completion)[:, None]).sum().item()
    return total / len(rows)


def teach_the_answer_format(model, tokenizer, rows, answers=("3", "5"), steps: int = 40, learning_rate: float = 1e-2):
    """A few supervised steps so that the model answers `\\boxed{3}` or `\\boxed{5}`, equally often, to every prompt,
    with the mixing frozen at identity: GRPO then has reward differences to learn from."""
    sequences, labels = [], []
    for row in rows:
        prompt_text = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
        prompt = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
        for answer in answers:
            completion = tokenizer(f"\\boxed{{{answer}}}{tokenizer.eos_token}", add_special_tokens=False)["input_ids"]
            sequences.append(prompt + completion)
            labels.append([-100] * len(prompt) + completion)
    length = max(map(len, sequences))
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (length - len(ids)) + ids for ids in sequences])
    label_ids = torch.tensor([[-100] * (length - len(ids)) + ids for ids in labels])
    attention_mask = torch.tensor([[0] * (length - len(ids)) + [1] * len(ids) for ids in sequences])
    trained = [parameter for name, parameter in model.named_parameters() if ".head_mixing." not in name]
    optimizer = torch.optim.AdamW(trained, lr=learning_rate)
    model.train()
    for _ in range(steps):
        model(input_ids, attention_mask=attention_mask, labels=label_ids).loss.backward()
        for name, parameter in model.named_parameters():
            if ".head_mixing." in name:
                parameter.grad = None
        optimizer.step()
        optimizer.zero_grad()


def test_grpo_trainer_raises_the_boxed_answer_reward_of_an_iha_model(tokenizer, tmp_path):
    from trl import GRPOConfig, GRPOTrainer

    rows = shortest_gsm8k_rows(4, answer="5")
    model = tiny_iha_model(seed=0, randomize=False, **TRAINING_MODEL, **tokenizer_settings(tokenizer))
    teach_the_answer_format(model, tokenizer, rows)
    before = answer_log_probability(model, tokenizer, rows, "5")
    assert -1.2 < before < -0.3  # about even between the two answers: log 1/2, less what the format still misses
    args = GRPOConfig(
        output_dir=str(tmp_path / "grpo"), max_steps=10, per_device_train_batch_size=8, num_generations=4,
        max_completion_length=8, temperature=1.0, learning_rate=5e-4, lr_scheduler_type="constant",
        gradient_checkpointing=False, logging_steps=1, bf16=False, use_cpu=True, report_to="none",
        save_strategy="no", seed=0, disable_tqdm=True,
    )  # fmt: skip
    trainer = with_iha_mixing(GRPOTrainer)(
        model=model, reward_funcs=boxed_answer_reward, args=args, train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer, mixing_learning_rate=5e-3,
    )  # fmt: skip
    trainer.train()

    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    assert len(rewards) == 10 and 0 < max(rewards) and min(rewards) < 1  # answers were sampled both ways
    # The rewarded answer became more likely: the expected reward rose.
    after = answer_log_probability(model, tokenizer, rows, "5")
    assert after > before + 0.2, (before, after)
    assert mixing_group_learning_rate(trainer) == 5e-3
    assert_mixing_left_identity(model)
    assert model.lm_head.weight is model.model.embed_tokens.weight
