"""Check converted IHA folders against their source models in a process that cannot import `iha`.

Run by `scripts/transformers_matrix.py` with an interpreter that has torch and one transformers release and nothing
else: the IHA model loads through remote code only (the code files in the folder), like a Hub user's would. Prints one
JSON object on its last line.

    python transformers_matrix_check.py check SOURCE CONVERTED [SOURCE CONVERTED ...] [--batch CONVERTED ...]
    python transformers_matrix_check.py refuse CONVERTED

`--batch` also runs each of those folders with random (trained-looking) head mixing through continuous batching
(`generate_batch`, several requests of different lengths on a small paged cache) against `generate()` on each prompt
alone; where this release's continuous batching cannot be right for the model (sliding-window layers before 5.16),
the check passes only if the model refuses, with the fix in its message.
"""

import json
import sys
import time
from pathlib import Path


def cannot_import_iha() -> bool:
    try:
        import iha  # noqa: F401
    except ImportError:
        return True
    return False


def prompt_batch(source: str, vocab_size: int):
    """A left-padded batch of three prompts: chat prompts where the folder has a tokenizer, random ids otherwise."""
    import torch
    from transformers import AutoTokenizer

    if (Path(source) / "tokenizer_config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(source)
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        questions = ["What is 2 + 3?", "Name a prime number larger than ten.", "Hi"]
        # Older releases do not read a folder's chat_template.jinja: plain prompts there.
        if tokenizer.chat_template:
            texts = [
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
                )
                for q in questions
            ]
        else:
            texts = questions
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=not tokenizer.chat_template)
        return batch["input_ids"], batch["attention_mask"], tokenizer.pad_token_id
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, vocab_size, (3, 11), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :4] = 0
    attention_mask[2, :7] = 0
    input_ids[attention_mask == 0] = 0
    return input_ids, attention_mask, 0


BF16_CHECK_MAX_PARAMETERS = 10_000_000


def check_pair(source: str, converted: str, max_new_tokens: int = 16) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    started = time.perf_counter()
    base = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    base_eager = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, attn_implementation="eager").eval()
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32, trust_remote_code=True).eval()
    result = {"source": Path(source).name, "model_class": type(model).__name__, "loaded_from": type(model).__module__}
    input_ids, attention_mask, pad_token_id = prompt_batch(source, base.config.vocab_size)
    valid = attention_mask.bool()
    with torch.no_grad():
        base_logits = base(input_ids, attention_mask=attention_mask).logits
        eager_logits = base_eager(input_ids, attention_mask=attention_mask).logits
        iha_logits = model(input_ids, attention_mask=attention_mask, use_cache=False).logits
    # The bar the converter uses: fp32 rounding, measured as how far the source moves when only its kernel changes.
    source_noise = (base_logits - eager_logits)[valid].abs().max().item()
    result["logit_difference"] = (base_logits - iha_logits)[valid].abs().max().item()
    result["tolerance"] = max(1e-5, 4 * source_noise)
    result["logits_equal"] = result["logit_difference"] <= result["tolerance"]

    greedy = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_token_id)
    expected = base.generate(input_ids, attention_mask=attention_mask, **greedy)
    for name, options in {
        "dynamic_cache": {},
        "static_cache": {"cache_implementation": "static"},
        "no_cache": {"use_cache": False},
    }.items():
        try:
            tokens = model.generate(input_ids, attention_mask=attention_mask, **greedy, **options)
            result[name] = bool(torch.equal(tokens, expected))
        except Exception as error:  # a crash is a result to report, like a difference
            result[name] = False
            result[f"{name}_error"] = f"{type(error).__name__}: {error}"[:300]
    # The bf16 check exercises code that is the same at every size (the mixing kept in fp32); on a CPU, bf16 optimizer
    # steps of a real model take minutes per release, so it runs on the tiny models only.
    result["bf16_checked"] = sum(p.numel() for p in base.parameters()) <= BF16_CHECK_MAX_PARAMETERS
    if result["bf16_checked"]:
        result.update(check_bf16(source, converted, input_ids, attention_mask))
    result["seconds"] = round(time.perf_counter() - started, 1)
    result["passed"] = (
        result["logits_equal"]
        and all(result[k] for k in ("dynamic_cache", "static_cache", "no_cache"))
        and (
            not result["bf16_checked"]
            or (result["bf16_mixing_fp32"] and result["bf16_logits_equal"] and result["bf16_identity_learns"])
        )
    )
    return result


def check_bf16(source: str, converted: str, input_ids, attention_mask, steps: int = 5) -> dict:
    """Loaded in bf16 through remote code: the mixing is fp32, the logits match the bf16 source within bf16 rounding
    (measured as the source's own sdpa-vs-eager difference), and AdamW steps at 1e-3 move every mixing entry that
    starts at 1.0 (in bf16 such an update rounds away)."""
    import torch
    from transformers import AutoModelForCausalLM

    bf16 = dict(dtype=torch.bfloat16)
    base = AutoModelForCausalLM.from_pretrained(source, **bf16).eval()
    base_eager = AutoModelForCausalLM.from_pretrained(source, **bf16, attn_implementation="eager").eval()
    model = AutoModelForCausalLM.from_pretrained(converted, **bf16, trust_remote_code=True).eval()
    mixing = {name: parameter for name, parameter in model.named_parameters() if ".head_mixing." in name}
    others = {parameter.dtype for name, parameter in model.named_parameters() if name not in mixing}
    result = {"bf16_mixing_fp32": bool(mixing) and {p.dtype for p in mixing.values()} == {torch.float32}}
    result["bf16_mixing_fp32"] = result["bf16_mixing_fp32"] and others == {torch.bfloat16}
    valid = attention_mask.bool()
    with torch.no_grad():
        base_logits = base(input_ids, attention_mask=attention_mask).logits.float()
        eager_logits = base_eager(input_ids, attention_mask=attention_mask).logits.float()
        iha_logits = model(input_ids, attention_mask=attention_mask, use_cache=False).logits.float()
    result["bf16_logit_difference"] = (base_logits - iha_logits)[valid].abs().max().item()
    result["bf16_tolerance"] = max(1e-2, 4 * (base_logits - eager_logits)[valid].abs().max().item())
    result["bf16_logits_equal"] = result["bf16_logit_difference"] <= result["bf16_tolerance"]

    ones = {name: parameter.detach() == 1 for name, parameter in mixing.items()}
    optimizer = torch.optim.AdamW(mixing.values(), lr=1e-3)
    model.train()
    for _ in range(steps):
        model(input_ids, attention_mask=attention_mask, labels=input_ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    still = sum(int((mixing[name].detach()[mask] == 1).sum()) for name, mask in ones.items())
    result["bf16_identity_entries"] = sum(int(mask.sum()) for mask in ones.values())
    result["bf16_identity_entries_unmoved"] = still
    result["bf16_identity_learns"] = result["bf16_identity_entries"] > 0 and still == 0
    return result


def continuous_batching_config():
    """A small paged cache (an unsized one takes about 90% of free memory): 16 blocks of 16 tokens, 32 per batch."""
    from transformers import ContinuousBatchingConfig

    page_size = "page_size" if "page_size" in ContinuousBatchingConfig.__dataclass_fields__ else "block_size"
    return ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=32, **{page_size: 16})


def check_continuous_batching(converted: str, max_new_tokens: int = 10) -> dict:
    import logging

    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32, trust_remote_code=True).eval()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".head_mixing." in name:
                parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator))
    vocab_size = model.config.vocab_size
    prompts = [torch.randint(3, vocab_size, (length,), generator=generator).tolist() for length in (5, 17, 2, 9)]
    greedy = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    expected = [model.generate(torch.tensor([prompt]), **greedy)[0, len(prompt) :].tolist() for prompt in prompts]

    # Releases before 5.2x report a failed batch only in the engine's log.
    logged = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    engine_logger = logging.getLogger("ContinuousBatchingLogger")
    engine_logger.addHandler(handler)
    try:
        outputs = model.generate_batch(
            prompts,
            generation_config=GenerationConfig(**greedy, eos_token_id=-1),
            continuous_batching_config=continuous_batching_config(),
            progress_bar=False,
        )
        generated = [output.generated_tokens for output in outputs.values()]
        errors = [output.error for output in outputs.values() if getattr(output, "error", None)]
    except Exception as error:
        generated, errors = [], [f"{type(error).__name__}: {error}"]
    finally:
        engine_logger.removeHandler(handler)

    sliding = any("sliding" in attention_type for attention_type in model.config.attention_types)
    import transformers

    must_refuse = sliding and tuple(int(part) for part in transformers.__version__.split(".")[:2]) < (5, 16)
    refusal = next((message for message in errors + logged if "sliding-window layers" in message), None)
    if refusal is not None:  # the engine's log line puts its own words before the model's message
        refusal = refusal[refusal.index("Continuous batching of sliding-window") :]
    result = {"folder": Path(converted).name, "must_refuse": must_refuse}
    if must_refuse:
        result["continuous_batching"] = (
            "refused" if refusal and "pip install" in refusal and not any(generated) else "NOT refused"
        )
        result["passed"] = result["continuous_batching"] == "refused"
        result["message"] = (refusal or "")[:300]
    else:
        result["continuous_batching"] = "equal" if generated == expected else "different"
        result["passed"] = generated == expected
        if errors or not result["passed"]:
            result["error"] = "; ".join((errors or [m for m in logged if "rror" in m]) or ["tokens differ"])[:300]
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def refuse(converted: str) -> dict:
    """Below the supported range, loading must fail at once with the version, the range and the fix."""
    from transformers import AutoConfig

    started = time.perf_counter()
    try:
        AutoConfig.from_pretrained(converted, trust_remote_code=True)
    except Exception as error:
        message = str(error)
        import transformers

        clear = (
            type(error).__name__ == "UnsupportedTransformersError"
            and transformers.__version__ in message
            and "pip install" in message
        )
        return {
            "refused": True,
            "clear": clear,
            "error": f"{type(error).__name__}: {message}",
            "seconds": round(time.perf_counter() - started, 1),
        }
    return {"refused": False, "clear": False, "error": None}


def main(argv: list[str]) -> int:
    import transformers

    report = {"transformers": transformers.__version__, "iha_importable": not cannot_import_iha()}
    if argv[0] == "refuse":
        report.update(refuse(argv[1]))
        report["passed"] = report["refused"] and report["clear"] and not report["iha_importable"]
    else:
        folders, batched = argv[1:], []
        if "--batch" in folders:
            folders, batched = folders[: folders.index("--batch")], folders[folders.index("--batch") + 1 :]
        pairs = list(zip(folders[0::2], folders[1::2]))
        report["models"] = [check_pair(source, converted) for source, converted in pairs]
        report["continuous_batching"] = [check_continuous_batching(converted) for converted in batched]
        report["passed"] = (
            not report["iha_importable"]
            and all(m["passed"] for m in report["models"])
            and all(m["passed"] for m in report["continuous_batching"])
        )
    print(json.dumps(report))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
