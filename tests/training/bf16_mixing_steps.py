"""The bf16 training steps of tests/training/test_mixing_precision.py, importing only torch: the same code runs in
the test process and in a process where `import iha` fails (remote code)."""

import torch


# The measurement: 5 AdamW steps at the mixing learning rate.
TRAINING_STEPS = 5
LEARNING_RATE = 1e-3


def train_a_few_steps(model, steps: int = TRAINING_STEPS, learning_rate: float = LEARNING_RATE):
    generator = torch.Generator().manual_seed(3)
    input_ids = torch.randint(3, model.config.vocab_size, (2, 12), generator=generator)
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    model.train()
    for _ in range(steps):
        model(input_ids, labels=input_ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def mixing_dtypes(model) -> set[torch.dtype]:
    return {parameter.dtype for name, parameter in model.named_parameters() if ".head_mixing." in name}


def other_dtypes(model) -> set[torch.dtype]:
    return {parameter.dtype for name, parameter in model.named_parameters() if ".head_mixing." not in name}


def unmoved_identity_entries(model) -> tuple[int, int]:
    """(entries still exactly 1.0, entries that are 1.0 at identity) over every mixing tensor of `model`."""
    still, total = 0, 0
    for module in model.modules():
        if hasattr(module, "identity_tensors"):  # IHAHeadMixing, the package's class or a remote-code copy
            for name, identity in module.identity_tensors().items():
                ones = identity == 1
                still += int((getattr(module, name).detach()[ones] == 1).sum())
                total += int(ones.sum())
    return still, total
