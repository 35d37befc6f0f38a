"""Check converted IHA folders on one transformers release, in a fresh interpreter, with or without the `iha` package.

Run by `scripts/transformers_matrix.py` with an interpreter that has torch and one transformers release. Without
`--with-iha` nothing else is importable: the IHA model loads through remote code only (the code files in the folder),
like a Hub user's would, and runs transformers' own attention functions. With `--with-iha` the repository is on
PYTHONPATH and `import iha` runs first: the same folders, still loaded with `trust_remote_code=True`, find the
package's fast paths (`iha|sdpa`, `iha|paged`) in transformers' registries. Prints one JSON object on its last line.

    python transformers_matrix_check.py check [--with-iha] [--pairs SOURCE CONVERTED ...] [--batch FOLDER ...]
        [--outputs OUT.pt FOLDER ...]
    python transformers_matrix_check.py refuse CONVERTED

- `--pairs` (without the package): each converted folder against its source model, logits and greedy tokens with
  every cache, and in bf16 (`check_pair`).
- `--batch`: continuous batching (`generate_batch`, several requests of different lengths on a small paged cache).
  Without the package it must refuse in one line, `modeling_iha.NEEDS_THE_PACKAGE`; with it, it must decode what
  `generate()` decodes on each prompt alone, or refuse with the fix where this release's continuous batching cannot
  be right for the model (sliding-window layers before 5.16). Either way `generate()` must decode the same tokens
  afterwards (5.4.0 and 5.13.1 switch the model to `paged|<implementation>` when continuous batching starts, and
  5.4.0 never switches it back: the package does).
- `--outputs`: the logits and greedy tokens `scripts/transformers_matrix.py` compares between a process without the
  package and one with it (`outputs_of`), saved to OUT.pt; with the package, which of its plans ran.
"""

import argparse
import json
import sys
import time
from collections import Counter
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


# --- without the package against with it -------------------------------------------------------------------------

# The long left-padded batch: rows of LONG_LENGTH tokens, the later ones after this much left padding. Long enough that
# the package runs sliding IHA layers blocked (`iha.attention.blocked_local`: more tokens than the blocks a window
# reads, 64 at P = 2 for the matrix's windows of 4 and 16 tokens).
LONG_LENGTH = 96
LEFT_PADDING = (0, 10, 37)
# The packed row: documents of these lengths, restarting position ids and no mask (TRL's padding-free packing).
PACKED_DOCUMENTS = (41, 33, 22)
# Greedy tokens after the long prompts: every decoding step is past the window of the sliding layers.
GREEDY_TOKENS = 20


def long_inputs(vocab_size: int) -> dict:
    """The inputs of `outputs_of`, the same in every process (a seeded generator)."""
    import torch

    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(3, vocab_size, (len(LEFT_PADDING), LONG_LENGTH), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    for row, padding in enumerate(LEFT_PADDING):
        attention_mask[row, :padding] = 0
    input_ids[attention_mask == 0] = 0
    packed_ids = torch.randint(3, vocab_size, (1, sum(PACKED_DOCUMENTS)), generator=generator)
    packed_positions = torch.cat([torch.arange(length) for length in PACKED_DOCUMENTS])[None]
    return dict(
        input_ids=input_ids, attention_mask=attention_mask, packed_ids=packed_ids, packed_positions=packed_positions
    )


class PlanRecorder:
    """Counts which plan the package's `iha|sdpa` attention ran (its mask's kind: `BlockedLocalMask`,
    `PackedDocumentsMask`, or a dense tensor), by wrapping the function registered under that name: the model looks it
    up by name at every call. With no package, nothing is registered and nothing is counted."""

    def __init__(self):
        self.counts = Counter()
        from transformers import AttentionInterface
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        registered = "iha|sdpa" in ALL_ATTENTION_FUNCTIONS
        self.registered = registered
        if not registered:
            return
        original = ALL_ATTENTION_FUNCTIONS["iha|sdpa"]

        def recorded(module, query, key, value, attention_mask, *args, **kwargs):
            self.counts[type(attention_mask).__name__] += 1
            return original(module, query, key, value, attention_mask, *args, **kwargs)

        AttentionInterface.register("iha|sdpa", recorded)

    def take(self) -> dict:
        counts, self.counts = dict(self.counts), Counter()
        return counts


def load_folder(folder: str, loader: str, **options):
    """`folder` in fp32, by `loader`: "auto" is `AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True)`,
    which runs the folder's own code where `iha` was not imported and the package's classes where it was; "folder"
    takes the folder's own classes (its `auto_map`) whatever is imported, as a model loaded before `import iha` has."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    options = dict(dtype=torch.float32, **options)
    if loader == "auto":
        return AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, **options).eval()
    auto_map = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))["auto_map"]
    model_class = get_class_from_dynamic_module(auto_map["AutoModelForCausalLM"], folder)
    return model_class.from_pretrained(folder, **options).eval()


def outputs_of(folder: str, recorder: PlanRecorder, loader: str, with_eager: bool) -> dict:
    """Logits of the long left-padded batch and of the packed row, and greedy tokens after the long prompts with
    DynamicCache and StaticCache, of `folder` loaded by `loader` (`load_folder`) in fp32 (sdpa, the default; with
    `with_eager` also the logits under eager attention, the bar of fp32 rounding). With the package, the plans each
    ran."""
    import torch

    started = time.perf_counter()
    model = load_folder(folder, loader)
    inputs = long_inputs(model.config.vocab_size)
    saved = {"loaded_from": type(model).__module__, "attn_implementation": model.config._attn_implementation}
    plans = {}
    recorder.take()
    with torch.no_grad():
        saved["padded_logits"] = model(
            inputs["input_ids"], attention_mask=inputs["attention_mask"], use_cache=False
        ).logits
        plans["padded"] = recorder.take()
        saved["packed_logits"] = model(
            inputs["packed_ids"], position_ids=inputs["packed_positions"], use_cache=False
        ).logits
        plans["packed"] = recorder.take()
    greedy = dict(max_new_tokens=GREEDY_TOKENS, do_sample=False, pad_token_id=0)
    for name, options in {"dynamic_cache": {}, "static_cache": {"cache_implementation": "static"}}.items():
        try:
            saved[f"{name}_tokens"] = model.generate(
                inputs["input_ids"], attention_mask=inputs["attention_mask"], **greedy, **options
            )
        except Exception as error:  # a crash is a result to report, like a difference
            saved[f"{name}_error"] = f"{type(error).__name__}: {error}"[:300]
        plans[name] = recorder.take()
    if with_eager:
        eager = load_folder(folder, loader, attn_implementation="eager")
        with torch.no_grad():
            saved["padded_logits_eager"] = eager(
                inputs["input_ids"], attention_mask=inputs["attention_mask"], use_cache=False
            ).logits
            saved["packed_logits_eager"] = eager(
                inputs["packed_ids"], position_ids=inputs["packed_positions"], use_cache=False
            ).logits
    saved["attention_mask"] = inputs["attention_mask"]
    saved["plans"] = plans
    saved["seconds"] = round(time.perf_counter() - started, 1)
    return saved


# How the folders are loaded in each process: without the package through remote code only; with it, as
# `AutoModelForCausalLM` loads them once `iha` is imported (the package's classes) and by the folder's own classes.
LOADERS = {False: ("auto",), True: ("auto", "folder")}


def write_outputs(path: str, folders: list[str], with_iha: bool) -> list[dict]:
    """`outputs_of` every folder by every loader of this process into `path` (torch.save, keyed by folder name, then
    loader); returns a summary per folder and loader."""
    import torch

    recorder = PlanRecorder()
    everything, summary = {}, []
    for folder in folders:
        for loader in LOADERS[with_iha]:
            name = Path(folder).name
            try:
                saved = outputs_of(folder, recorder, loader, with_eager=not with_iha)
            except Exception as error:
                summary.append({"folder": name, "loader": loader, "error": f"{type(error).__name__}: {error}"[:500]})
                continue
            everything.setdefault(name, {})[loader] = saved
            summary.append(
                {
                    "folder": name,
                    "loader": loader,
                    "loaded_from": saved["loaded_from"],
                    "plans": saved["plans"],
                    "seconds": saved["seconds"],
                    **{key: saved[key] for key in saved if key.endswith("_error")},
                }
            )
    torch.save(everything, path)
    return summary


# --- continuous batching -----------------------------------------------------------------------------------------


def continuous_batching_config():
    """A small paged cache (an unsized one takes about 90% of free memory): 16 blocks of 16 tokens, 32 per batch."""
    from transformers import ContinuousBatchingConfig

    page_size = "page_size" if "page_size" in ContinuousBatchingConfig.__dataclass_fields__ else "block_size"
    return ContinuousBatchingConfig(num_blocks=16, max_batch_tokens=32, **{page_size: 16})


def needs_the_package_line(model) -> str:
    """`NEEDS_THE_PACKAGE` of the folder's own `modeling_iha` (a Gemma 3 model's class lives beside it)."""
    import importlib

    package = type(model).__module__.rpartition(".")[0]
    return importlib.import_module(f"{package}.modeling_iha").NEEDS_THE_PACKAGE


# Prompt lengths and new tokens of the continuous-batching check: the longest request runs past the windows of the
# matrix's sliding folders (4 and 16 tokens).
BATCH_PROMPT_LENGTHS = (5, 21, 2, 9)
BATCH_NEW_TOKENS = 12


def check_continuous_batching(converted: str, with_iha: bool) -> dict:
    import logging

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32, trust_remote_code=True).eval()
    generator = torch.Generator().manual_seed(0)
    vocab_size = model.config.vocab_size
    prompts = [torch.randint(3, vocab_size, (length,), generator=generator).tolist() for length in BATCH_PROMPT_LENGTHS]
    greedy = dict(max_new_tokens=BATCH_NEW_TOKENS, do_sample=False, pad_token_id=0)

    def generate_each():
        try:
            return [model.generate(torch.tensor([prompt]), **greedy)[0, len(prompt) :].tolist() for prompt in prompts]
        except Exception as error:
            return f"{type(error).__name__}: {error}"[:300]

    expected = generate_each()

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
    # The model goes on after continuous batching, refused or not: generate() decodes what it decoded before.
    after = generate_each()

    result = {"folder": Path(converted).name, "generate_after": "equal" if after == expected else "different"}
    if isinstance(after, str):
        result["generate_after"] = "error"
        result["generate_after_error"] = after
    if not with_iha:
        # Without the package: the one line that names the fix, and nothing generated.
        needed = needs_the_package_line(model)
        result["expected"] = "refused: needs the package"
        refused = any(needed in message for message in errors + logged) and not any(generated)
        result["continuous_batching"] = "refused" if refused else "NOT refused"
        result["passed"] = refused and result["generate_after"] == "equal"
        result["message"] = next((m for m in errors + logged if needed in m), "; ".join(errors)[:300])
        result["seconds"] = round(time.perf_counter() - started, 1)
        return result

    sliding = any("sliding" in attention_type for attention_type in model.config.attention_types)
    release = tuple(int(part) for part in transformers.__version__.split(".")[:2])
    must_refuse = sliding and release < (5, 16)
    refusal = next((message for message in errors + logged if "sliding-window layers" in message), None)
    if refusal is not None:  # the engine's log line puts its own words before the model's message
        refusal = refusal[refusal.index("Continuous batching of sliding-window") :]
    if must_refuse:
        result["expected"] = "refused: sliding windows before 5.16"
        result["continuous_batching"] = (
            "refused" if refusal and "pip install" in refusal and not any(generated) else "NOT refused"
        )
        result["passed"] = result["continuous_batching"] == "refused" and result["generate_after"] == "equal"
        result["message"] = (refusal or "; ".join(errors))[:300]
    else:
        result["expected"] = "equal to generate()"
        result["continuous_batching"] = "equal" if generated == expected else "different"
        result["passed"] = generated == expected and result["generate_after"] == "equal"
        if errors or generated != expected:
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


def parse_args(argv: list[str]):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    commands = parser.add_subparsers(dest="command", required=True)
    refused = commands.add_parser(
        "refuse", help="loading must be refused (a release below the range)", allow_abbrev=False
    )
    refused.add_argument("converted")
    check = commands.add_parser("check", help="the checks of a supported release", allow_abbrev=False)
    check.add_argument("--with-iha", action="store_true", help="import iha first (it must be importable)")
    check.add_argument("--pairs", nargs="*", default=[], metavar="FOLDER", help="SOURCE CONVERTED pairs")
    check.add_argument("--batch", nargs="*", default=[], metavar="FOLDER", help="folders for continuous batching")
    check.add_argument("--outputs", nargs="*", default=[], metavar="PATH", help="OUT.pt, then folders")
    args = parser.parse_args(argv)
    if args.command == "check":
        if len(args.pairs) % 2:
            parser.error("--pairs takes SOURCE CONVERTED pairs")
        if len(args.outputs) == 1:
            parser.error("--outputs takes OUT.pt, then at least one folder")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    with_iha = args.command == "check" and args.with_iha
    if with_iha:
        import iha  # noqa: F401  (registers the fast paths, as a user's `import iha` does)
    import transformers

    report = {"transformers": transformers.__version__, "iha_importable": not cannot_import_iha()}
    if args.command == "refuse":
        report.update(refuse(args.converted))
        report["passed"] = report["refused"] and report["clear"] and not report["iha_importable"]
        print(json.dumps(report))
        return 0 if report["passed"] else 1

    report["with_iha"] = with_iha
    if args.pairs and with_iha:
        raise SystemExit("--pairs checks folders where the package cannot be imported: run it without --with-iha")
    pairs = list(zip(args.pairs[0::2], args.pairs[1::2]))
    report["models"] = [check_pair(source, converted) for source, converted in pairs]
    report["continuous_batching"] = [check_continuous_batching(folder, with_iha) for folder in args.batch]
    if args.outputs:
        report["outputs"] = write_outputs(args.outputs[0], args.outputs[1:], with_iha)
    report["passed"] = (
        report["iha_importable"] == with_iha
        and all(m["passed"] for m in report["models"])
        and all(m["passed"] for m in report["continuous_batching"])
        and not any("error" in folder for folder in report.get("outputs", []))
    )
    print(json.dumps(report))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
