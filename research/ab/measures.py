"""What `python -m research.ab` measures besides training itself: the device and precision it runs in, the tokens of every training
step (`StepTrace`), the per-row loss of the assistant tokens (validation rows, reference solutions), the drift of
the mixing coefficients from identity, whether a completion finished, and arm B's model before training against
arm A's (`check_conversion`)."""

import hashlib

import torch
from transformers import AutoTokenizer, TrainerCallback
from transformers.trainer_callback import ExportableState

from iha.conversion.verify import compared_figures, logits_of_real_tokens, release_memory
from iha.data.messages import load_sft_dataset
from iha.models.iha.modeling_iha import IHAHeadMixing
from iha.training.model import load_model_for_sft, prepare_tokenizer

from .config import ARM_A, ARM_B, ABConfig


def machine_settings() -> dict:
    """Device and precision from the machine: a CUDA device with bf16 mixed precision where it has bf16, else the
    CPU in float32."""
    if torch.cuda.is_available():
        return {"device": "cuda", "bf16": torch.cuda.is_bf16_supported(), "eval_dtype": "bfloat16"}
    return {"device": "cpu", "bf16": False, "eval_dtype": "float32"}


def autocast(settings: dict):
    if settings["bf16"]:
        return torch.autocast(settings["device"], dtype=torch.bfloat16)
    return torch.autocast(settings["device"], enabled=False)


class StepTrace(TrainerCallback, ExportableState):
    """The tokens of every micro-batch the model trains on: a digest of the input ids, their count and the count of
    tokens in the loss. Two runs saw the same data in the same order exactly when their traces are equal.

    It is saved with every checkpoint (`ExportableState`), so a resumed run's trace is complete.
    """

    def __init__(self, steps: list | None = None):
        self.steps = list(steps or [])
        self._hook = None

    def state(self) -> dict:
        return {"args": {"steps": self.steps}, "attributes": {}}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        # A resumed run continues the trace of its checkpoint, cut to the steps the checkpoint had finished.
        self.steps = [step for step in self.steps if step["step"] <= state.global_step]
        self._step = state.global_step

        def record(module, positional, keyword):
            if not module.training:
                return
            input_ids = keyword.get("input_ids", positional[0] if positional else None)
            labels = keyword.get("labels")
            ids = input_ids.detach().to("cpu", torch.int64).contiguous()
            entry = {
                "step": self._step + 1,
                "digest": hashlib.sha1(ids.numpy().tobytes()).hexdigest()[:16],
                "tokens": int(ids.numel()),
            }
            if labels is not None:
                entry["loss_tokens"] = int((labels[..., 1:] != -100).sum())
            self.steps.append(entry)

        self._hook = model.register_forward_pre_hook(record, with_kwargs=True)

    def on_step_end(self, args, state, control, **kwargs):
        self._step = state.global_step

    def on_train_end(self, args, state, control, **kwargs):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


def find_step_trace(trainer) -> StepTrace:
    # A resumed trainer replaces the callback object with one rebuilt from the checkpoint: look it up by type.
    return next(callback for callback in trainer.callback_handler.callbacks if isinstance(callback, StepTrace))


def loss_token_batch(tokenizer, conversations: list[list[dict]]):
    """Right-padded input ids, attention mask and the mask of the tokens in the loss (assistant turns), as training
    computes them (the chat template's `{% generation %}` markers)."""
    encoded = [
        tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, return_tensors=None
        )
        for messages in conversations
    ]
    length = max(len(item["input_ids"]) for item in encoded)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.full((len(encoded), length), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(encoded), length), dtype=torch.long)
    loss_mask = torch.zeros((len(encoded), length), dtype=torch.bool)
    for row, item in enumerate(encoded):
        n = len(item["input_ids"])
        input_ids[row, :n] = torch.tensor(item["input_ids"])
        attention_mask[row, :n] = 1
        loss_mask[row, :n] = torch.tensor(item["assistant_masks"], dtype=torch.bool)
    return input_ids, attention_mask, loss_mask


@torch.no_grad()
def validation_losses(model, tokenizer, rows: list[dict], batch_size: int, settings: dict) -> dict:
    """Per row: the summed negative log-likelihood of its assistant tokens and their number (the training loss's
    tokens), so that per-token losses of any set of rows can be formed (`stats.token_loss_bootstrap`)."""
    tokenizer = prepare_tokenizer(tokenizer, assistant_only_loss=True)
    conversations = load_sft_dataset(rows)["messages"]
    model.eval()
    device = next(model.parameters()).device
    nll, tokens = [], []
    for start in range(0, len(conversations), batch_size):
        input_ids, attention_mask, loss_mask = loss_token_batch(tokenizer, conversations[start : start + batch_size])
        input_ids, attention_mask, loss_mask = input_ids.to(device), attention_mask.to(device), loss_mask.to(device)
        with autocast(settings):
            logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        # Position t predicts token t + 1: a token is in the loss when its own position is an assistant token.
        log_probs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        target_log_probs = log_probs.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
        in_loss = loss_mask[:, 1:]
        nll += (-(target_log_probs * in_loss).sum(dim=1)).tolist()
        tokens += in_loss.sum(dim=1).tolist()
        del logits, log_probs
    total = sum(tokens)
    return {"nll": nll, "tokens": tokens, "loss": sum(nll) / total if total else float("nan")}


def mixing_drift(model) -> list[dict]:
    """Per IHA layer: the Frobenius norm of alpha_q, alpha_k, alpha_v and collapse minus their identity init, and
    relative to the identity's own norm."""
    drift = []
    for name, module in model.named_modules():
        if not isinstance(module, IHAHeadMixing):
            continue
        layer = int(name.split("layers.")[1].split(".")[0]) if "layers." in name else len(drift)
        entry = {"layer": layer}
        for parameter_name, identity in module.identity_tensors().items():
            value = getattr(module, parameter_name).detach().float().cpu()
            difference = torch.linalg.vector_norm(value - identity.float()).item()
            entry[parameter_name] = difference
            entry[f"{parameter_name}_relative"] = difference / max(torch.linalg.vector_norm(identity).item(), 1e-12)
        drift.append(entry)
    return sorted(drift, key=lambda entry: entry["layer"])


def completion_finished(tokenizer, completion: str, max_new_tokens: int) -> bool:
    """Whether a completion ended before the generation limit (re-tokenized length below it: an approximation that
    can count a completion cut exactly at the limit as finished only if re-tokenizing shortens it)."""
    return len(tokenizer(completion, add_special_tokens=False)["input_ids"]) < max_new_tokens


@torch.no_grad()
def check_conversion(source: str, validation_rows: list[dict], config: ABConfig, settings: dict, num_rows: int = 4):
    """Arm B's model before training against arm A's on the first validation rows: the largest |logit difference|
    over the rows' real tokens (as `iha.conversion.verify` compares a converted folder with its source), and both
    validation losses (equal up to rounding for an exact conversion)."""
    tokenizer = prepare_tokenizer(AutoTokenizer.from_pretrained(source), assistant_only_loss=True)
    rows = validation_rows[:num_rows]
    input_ids, attention_mask, _ = loss_token_batch(tokenizer, load_sft_dataset(rows)["messages"])
    batch = {"input_ids": input_ids.to(settings["device"]), "attention_mask": attention_mask.to(settings["device"])}
    results = {}
    logits = {}
    for arm in (ARM_A, ARM_B):
        model, _ = load_model_for_sft(
            source, convert_to_iha=arm == ARM_B, iha_options={"num_pseudo_heads": config.num_pseudo_heads}
        )
        model.to(settings["device"]).eval()
        logits[arm] = logits_of_real_tokens(model, batch).float().cpu()
        results[arm] = validation_losses(model, tokenizer, rows, config.validation_batch_size, settings)["loss"]
        del model
        release_memory()
    max_abs_diff, _ = compared_figures(logits[ARM_A], logits[ARM_B])
    return {"num_rows": len(rows), "max_abs_logit_diff": max_abs_diff, "validation_loss": results}


__all__ = [
    "StepTrace",
    "autocast",
    "check_conversion",
    "completion_finished",
    "find_step_trace",
    "loss_token_batch",
    "machine_settings",
    "mixing_drift",
    "validation_losses",
]
