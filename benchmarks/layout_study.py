"""What the paper's layout costs in quality on a real model, and what the same healing SFT gives back (issue 54).

Four models from the same weights, SmolLM2-135M-Instruct (the built-in offline copy, `iha.conversion.builtin`):

- `base`: the model as it is, every layer global;
- `identity`: IHA in every layer, global, P = 2, identity mixing (`iha-convert SOURCE OUT`): the same function, the
  sanity arm of the harness (its RULER answers must be the base's);
- `hybrid`: the paper's layout (`iha-convert SOURCE OUT --layers hybrid --training_length 2048`): 4 sliding IHA
  layers with the flat window of W * P = 512 virtual tokens (W = 256), then one standard global layer;
- `global_local`: the paper's rival with the same pattern, 4 standard sliding layers then 1 global, with the FLOP-
  matched window P^2 * W = 1024 tokens (a sliding IHA layer attends N * P queries over W * P keys, a standard one N
  queries over P^2 * W). No converter option writes it: it is built here, an IHA-class folder whose layers are all
  standard (`sliding_attention` / `full_attention`), with the base's weights.

Each is measured with lm-eval's RULER tasks (niah_single_1, niah_multikey_2, niah_multikey_3 at 4,096 tokens, the
first `--ruler-samples` samples of each, the same for every model: `--model hf`, float32, greedy, the tasks' own
128 new tokens) and a short-context score on GSM8K's test split: the reference solutions' loss teacher-forced (the
first `--reference-problems`) and greedy pass@1 (the first `--pass-problems`, up to 320 new tokens). Then the
same healing SFT (`iha sft`: the GSM8K train rows, packed without regard to row boundaries into rows of 2,048
tokens, `--packing_strategy wrapped`, so that every step attends over the training length; equal steps, tokens,
learning rate and data order per seed) trains `hybrid`, `global_local` and, as the control that separates healing
from what SFT on GSM8K does to any model, `base`, for each of `--seeds`; each trained model is measured again.

Everything is resumable and runs unit by unit (build, one RULER task of one model, the GSM8K scores of one model,
one SFT run); a unit's result is a file under `--results-dir`, written atomically when the unit ends, and a later
call skips every unit whose file is there. Within a unit: RULER answers are cached per request (lm-eval's
`use_cache`), GSM8K batches per batch, SFT checkpoints every `--save-steps` steps. Several workers may run at once
(each takes a unit by a lock file): `--only sft` in one process and `--only eval` in another keeps both cores busy.

    python benchmarks/layout_study.py                      # every unit not done yet, then the report
    python benchmarks/layout_study.py --only eval          # only RULER and GSM8K units (those whose model exists)
    python benchmarks/layout_study.py --report             # the report from the result files only
    python benchmarks/layout_study.py --quick              # a smoke run: 1 sample per task, 2 SFT steps

The report (`report.md`, `report.json` in the results folder) is `benchmarks/layout_study_report.py`'s.
"""

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path


REPO_ROOT = Path(__file__).resolve().parent.parent
# GSM8K: the offline copy of this project's machines (../shared/data/gsm8k beside the repository, the Hub's openai/gsm8k
# main splits) where it is, else the Hub; `--gsm8k` gives a folder of train.jsonl and test.jsonl, or a Hub id.
LOCAL_GSM8K = REPO_ROOT.parent / "shared" / "data" / "gsm8k"
GSM8K = str(LOCAL_GSM8K) if LOCAL_GSM8K.is_dir() else "openai/gsm8k"

# Everything else the study reads is local (the built-in model, lm-eval's RULER haystacks): offline where GSM8K is
# too, so that no call waits on a network this machine may not have; elsewhere GSM8K comes from the Hub. Set before
# anything imports huggingface_hub, which reads these once.
if LOCAL_GSM8K.is_dir():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))

from layout_study_report import (  # noqa: E402
    ARMS,
    BEFORE_MODELS,
    CONTROL_ARM,
    RULER_TASKS,
    healed_name,
    paper_window,
    write_report,
)

from iha.utils.atomic_files import write_json_atomic  # noqa: E402


RESULTS_DIR = REPO_ROOT / "benchmarks" / "results" / "layout_study"
WORK_DIR = REPO_ROOT / "runs" / "layout_study"


def gsm8k_source(split: str) -> str:
    """The GSM8K `split` ("train" or "test"): a file of the folder `GSM8K`, or the Hub id (its split chosen by the
    reader)."""
    folder = Path(GSM8K)
    return str(folder / f"{split}.jsonl") if folder.is_dir() else GSM8K


@dataclass
class StudySettings:
    """What the study measures and trains; recorded in `settings.json`, and a later call with other settings is
    refused (pass another --results-dir and --work-dir)."""

    num_pseudo_heads: int = 2
    training_length: int = 2048
    global_local_window: int | None = None  # None: P^2 * W, the FLOP-matched window
    ruler_length: int = 4096
    ruler_samples: int = 10
    reference_problems: int = 100
    pass_problems: int = 32
    max_new_tokens: int = 320
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    sft_steps: int = 12
    learning_rate: float = 1e-4
    train_rows: int = 400
    save_steps: int = 4

    @property
    def window(self) -> int:
        return paper_window({"training_length": self.training_length, "num_pseudo_heads": self.num_pseudo_heads})

    @property
    def flop_matched_window(self) -> int:
        return self.global_local_window or self.num_pseudo_heads**2 * self.window


QUICK = dict(
    ruler_samples=1,
    reference_problems=8,
    pass_problems=4,
    max_new_tokens=32,
    seeds=[0],
    sft_steps=2,
    train_rows=40,
    save_steps=1,
)


def log(message: str) -> None:
    print(f"[layout-study {datetime.now().strftime('%H:%M:%S')}] {message}", flush=True)


def load_average() -> list[float]:
    return [round(value, 2) for value in os.getloadavg()]


@contextlib.contextmanager
def measured(record: dict):
    """Wall and process CPU seconds and the load average around a unit, into `record`."""
    record["load_average_start"] = load_average()
    wall, cpu = time.perf_counter(), time.process_time()
    yield
    record["seconds"] = {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu}
    record["load_average_end"] = load_average()


def release_memory() -> None:
    gc.collect()


# --------------------------------------------------------------------------------------------------------------------
# The four models
# --------------------------------------------------------------------------------------------------------------------


def base_dir() -> Path:
    from iha.conversion.builtin import smollm2_dir

    return Path(smollm2_dir())


def model_dir(name: str, work_dir: Path) -> Path:
    """Where model `name` is: the built-in base, a converted folder, or an SFT run's output."""
    if name == "base":
        return base_dir()
    if name in BEFORE_MODELS:
        return work_dir / "models" / name
    return work_dir / "sft" / name


def model_ready(name: str, work_dir: Path) -> bool:
    if name == "base":
        return True
    return (model_dir(name, work_dir) / "config.json").is_file() and any(
        model_dir(name, work_dir).glob("*.safetensors")
    )


def convert_command(settings: StudySettings, name: str, output: Path) -> list[str]:
    command = ["iha-convert", str(base_dir()), str(output)]
    if name == "hybrid":
        command += ["--layers", "hybrid", "--training_length", str(settings.training_length)]
    return command + ["--num_pseudo_heads", str(settings.num_pseudo_heads)]


def build_global_local(settings: StudySettings, hybrid: Path, output: Path) -> None:
    """Global+Local: the hybrid's pattern with standard layers, the base's weights, the FLOP-matched window. An
    IHA-class folder whose layers are all standard attention (`IHAForCausalLM` computes them as Llama does, with the
    window on the sliding ones), so that transformers and the vLLM plugin both run the window; a Llama folder with
    `layer_types` would be read with the window by vLLM and without it by transformers' LlamaForCausalLM."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    import iha
    from iha.utils.atomic_folders import staged_folder

    hybrid_config = AutoConfig.from_pretrained(hybrid)
    standard = {"iha_sliding_attention": "sliding_attention", "iha_full_attention": "full_attention"}
    values = hybrid_config.to_dict()
    for derived in ("layer_types", "auto_map", "architectures", "model_type", "transformers_version"):
        values.pop(derived, None)
    values["attention_types"] = [standard.get(kind, kind) for kind in hybrid_config.attention_types]
    values["sliding_window"] = settings.flop_matched_window
    config = iha.IHAConfig(**values)
    source = AutoModelForCausalLM.from_pretrained(base_dir(), dtype=torch.float32)
    with torch.device("meta"):
        model = iha.IHAForCausalLM(config)
    state = {name: tensor for name, tensor in source.state_dict().items() if name != "lm_head.weight"}
    result = model.load_state_dict(state, strict=False, assign=True)
    missing = sorted(set(result.missing_keys) - {"lm_head.weight"})
    if missing or result.unexpected_keys:
        raise RuntimeError(f"Global+Local: weights do not fit: missing {missing}, unexpected {result.unexpected_keys}")
    for name, buffer in source.named_buffers():
        module_name, _, buffer_name = name.rpartition(".")
        model.get_submodule(module_name)._buffers[buffer_name] = buffer.clone()
    model.tie_weights()
    model.generation_config = source.generation_config
    with staged_folder(output, "global-local") as staging:
        model.save_pretrained(staging)
        AutoTokenizer.from_pretrained(base_dir()).save_pretrained(staging)


def logit_check(name: str, folder: Path, lengths: tuple[int, ...]) -> dict:
    """The model against the base on one GSM8K text cut to `lengths` tokens: max |logit difference| and top-1
    agreement over the positions before and after the first window edge."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import iha  # noqa: F401  (registers the IHA classes)

    tokenizer = AutoTokenizer.from_pretrained(base_dir())
    from iha.data.gsm8k import read_gsm8k_rows

    rows = read_gsm8k_rows(gsm8k_source("test"), split="test", limit=40)
    text = "\n\n".join(row["question"] + "\n" + row["answer"] for row in rows)
    ids = tokenizer(text, return_tensors="pt")["input_ids"][:, : max(lengths)]
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(base_dir(), dtype=torch.float32).eval()(ids).logits[0]
        other = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()(ids).logits[0]
    spans, start = {}, 0
    for end in lengths:
        difference = (base[start:end] - other[start:end]).abs().max().item()
        agreement = (base[start:end].argmax(-1) == other[start:end].argmax(-1)).float().mean().item()
        spans[f"{start + 1}-{end}"] = {"max_abs_logit_diff": difference, "top1_agreement": agreement}
        start = end
    return spans


def run_build(settings: StudySettings, work_dir: Path) -> dict:
    """The three converted or constructed folders, each checked against the base."""
    import subprocess

    record = {"source": str(base_dir()), "models": {}}
    with measured(record):
        for name in ("identity", "hybrid"):
            output = model_dir(name, work_dir)
            command = convert_command(settings, name, output)
            if not model_ready(name, work_dir):
                log(f"build: {' '.join(command)}")
                subprocess.run([str(Path(sys.executable).parent / command[0]), *command[1:], "--overwrite"], check=True)
            record["models"][name] = {"command": " ".join(["iha-convert", "SMOLLM2", output.name, *command[3:]])}
        output = model_dir("global_local", work_dir)
        if not model_ready("global_local", work_dir):
            log("build: global_local (script-level: the hybrid's pattern with standard layers)")
            build_global_local(settings, model_dir("hybrid", work_dir), output)
        written = json.loads((output / "config.json").read_text(encoding="utf-8"))
        layout = {"attention_types": written["attention_types"], "sliding_window": written["sliding_window"]}
        record["models"]["global_local"] = {"command": "benchmarks/layout_study.py (build_global_local)", **layout}
        lengths = (settings.window, settings.flop_matched_window, settings.training_length)
        for name in ("identity", "hybrid", "global_local"):
            log(f"build: {name} against the base on one {max(lengths)}-token GSM8K text")
            record["models"][name]["against_base"] = logit_check(name, model_dir(name, work_dir), lengths)
            release_memory()
    return record


# --------------------------------------------------------------------------------------------------------------------
# RULER through lm-eval
# --------------------------------------------------------------------------------------------------------------------


def ruler_limit(settings: StudySettings, cap: int | None) -> int:
    """The samples a RULER unit asks for: the study's, or fewer under `--ruler-sample-cap` (a partial unit, which a
    later call without the cap extends from lm-eval's cache)."""
    return settings.ruler_samples if cap is None else min(cap, settings.ruler_samples)


def ruler_command(settings: StudySettings, folder: str, task: str, cap: int | None = None) -> str:
    return (
        f"lm_eval --model hf --model_args pretrained={folder},dtype=float32,trust_remote_code=True --tasks {task} "
        f"--metadata '{{\"max_seq_lengths\":[{settings.ruler_length}]}}' --limit {ruler_limit(settings, cap)} "
        "--batch_size 1 --device cpu --log_samples --output_path OUT"
    )


def run_ruler(settings: StudySettings, work_dir: Path, model: str, task: str, cap: int | None = None) -> dict:
    """One RULER task on one model: lm-eval's own scoring of each sample, with its answer."""
    import lm_eval

    import iha  # noqa: F401

    folder = model_dir(model, work_dir)
    cache = work_dir / "cache" / "ruler" / model / task
    cache.parent.mkdir(parents=True, exist_ok=True)
    record = {"model": model, "task": task, "command": ruler_command(settings, "MODEL", task, cap)}
    record["samples_planned"] = settings.ruler_samples
    with measured(record):
        output = lm_eval.simple_evaluate(
            model="hf",
            model_args={"pretrained": str(folder), "dtype": "float32", "trust_remote_code": True},
            tasks=[task],
            batch_size=1,
            device="cpu",
            limit=ruler_limit(settings, cap),
            use_cache=str(cache),
            log_samples=True,
            metadata={"max_seq_lengths": [settings.ruler_length]},
        )
    metric = str(settings.ruler_length)
    samples = sorted(output["samples"][task], key=lambda sample: sample["doc_id"])
    record["lm_eval"] = {"version": lm_eval.__version__, "config": output["configs"][task].get("generation_kwargs")}
    record["score"] = output["results"][task][f"{metric},none"]
    record["samples"] = [
        {
            "doc_id": sample["doc_id"],
            "doc_hash": sample["doc_hash"],
            "target": sample["target"],
            "response": sample["filtered_resps"][0],
            "score": sample[metric],
        }
        for sample in samples
    ]
    return record


# --------------------------------------------------------------------------------------------------------------------
# GSM8K: the reference solutions' loss and greedy pass@1
# --------------------------------------------------------------------------------------------------------------------

REFERENCE_BATCH = 8
GENERATION_BATCH = 16


def run_gsm8k(settings: StudySettings, work_dir: Path, model: str) -> dict:
    """The reference solutions of the first test problems teacher-forced (summed NLL and loss tokens per problem)
    and greedy answers to the first test problems (correct or not, per problem), batch by batch with a resumable
    cache of finished batches."""
    from iha.data.gsm8k import gsm8k_file_to_openthoughts
    from iha.data.messages import BOXED_INSTRUCTION, without_system_prompt
    from iha.evaluation.math_eval import (
        build_prompt,
        generate_completions,
        load_model_and_tokenizer,
        load_problems,
        score_completions,
    )
    from iha.evaluation.settings import SamplingConfig
    from research.ab.measures import completion_finished, validation_losses

    cache_path = work_dir / "cache" / "gsm8k" / f"{model}.json"
    cache = json.loads(cache_path.read_text(encoding="utf-8")) if cache_path.is_file() else {}
    cache.setdefault("reference", [])
    cache.setdefault("completions", [])
    record = {"model": model, "test_data": f"GSM8K test split ({Path(gsm8k_source('test')).name})"}
    with measured(record):
        loaded, tokenizer = load_model_and_tokenizer(str(model_dir(model, work_dir)), dtype="float32", device="cpu")
        rows = gsm8k_file_to_openthoughts(gsm8k_source("test"), limit=settings.reference_problems, split="test")
        rows = [without_system_prompt(row) for row in rows]
        settings_cpu = {"device": "cpu", "bf16": False, "eval_dtype": "float32"}
        for start in range(len(cache["reference"]) * REFERENCE_BATCH, len(rows), REFERENCE_BATCH):
            losses = validation_losses(
                loaded, tokenizer, rows[start : start + REFERENCE_BATCH], REFERENCE_BATCH, settings_cpu
            )
            cache["reference"].append({"nll": losses["nll"], "tokens": losses["tokens"]})
            write_json_atomic(cache, cache_path)
            log(f"gsm8k {model}: reference solutions {min(start + REFERENCE_BATCH, len(rows))}/{len(rows)}")
        problems = load_problems(gsm8k_source("test"), benchmark="gsm8k", limit=settings.pass_problems)
        prompts = [build_prompt(tokenizer, BOXED_INSTRUCTION + problem.question, "", None) for problem in problems]
        greedy = SamplingConfig(temperature=0.0, top_p=1.0, num_samples=1, max_new_tokens=settings.max_new_tokens)
        for start in range(len(cache["completions"]) * GENERATION_BATCH, len(prompts), GENERATION_BATCH):
            batch = generate_completions(
                loaded,
                tokenizer,
                prompts[start : start + GENERATION_BATCH],
                greedy,
                GENERATION_BATCH,
                description=f"{model} gsm8k",
            )
            cache["completions"].append(batch)
            write_json_atomic(cache, cache_path)
            log(f"gsm8k {model}: answers {min(start + GENERATION_BATCH, len(prompts))}/{len(prompts)}")
        completions = [samples for batch in cache["completions"] for samples in batch]
        scored = score_completions(problems, completions)
        finished = [completion_finished(tokenizer, samples[0], settings.max_new_tokens) for samples in completions]
    record["reference"] = {
        "nll": [value for batch in cache["reference"] for value in batch["nll"]],
        "tokens": [value for batch in cache["reference"] for value in batch["tokens"]],
    }
    record["pass"] = {
        "max_new_tokens": settings.max_new_tokens,
        "problems": [
            {
                "id": problem["id"],
                "correct": bool(problem["samples"][0]["correct"]),
                "finished": done,
                "answer": problem["samples"][0].get("answer"),
                "completion": completion[0],
            }
            for problem, done, completion in zip(scored["problems"], finished, completions)
        ],
    }
    del loaded
    release_memory()
    return record


# --------------------------------------------------------------------------------------------------------------------
# The healing SFT
# --------------------------------------------------------------------------------------------------------------------


def training_rows_path(settings: StudySettings, work_dir: Path) -> Path:
    return work_dir / "data" / f"gsm8k-train-{settings.train_rows}.jsonl"


def write_training_rows(settings: StudySettings, work_dir: Path) -> Path:
    """The first GSM8K train rows in the OpenThoughts format without its system prompt (as `iha ab --preset cpu`)."""
    from iha.data.gsm8k import gsm8k_file_to_openthoughts
    from iha.data.messages import without_system_prompt
    from iha.utils.atomic_files import write_jsonl_atomic

    path = training_rows_path(settings, work_dir)
    if not path.is_file():
        rows = gsm8k_file_to_openthoughts(gsm8k_source("train"), limit=settings.train_rows, split="train")
        write_jsonl_atomic((without_system_prompt(row) for row in rows), path)
    return path


def sft_argv(settings: StudySettings, work_dir: Path, arm: str, seed: int) -> list[str]:
    """The `iha sft` flags of one healing run: the same for every arm but the model."""
    return [
        "--model_name_or_path", str(model_dir(arm, work_dir)),
        "--no_convert_to_iha",
        "--dataset_name", str(training_rows_path(settings, work_dir)),
        "--output_dir", str(model_dir(healed_name(arm, seed), work_dir)),
        "--dtype", "float32",
        "--seed", str(seed),
        "--max_steps", str(settings.sft_steps),
        "--learning_rate", str(settings.learning_rate),
        "--lr_scheduler_type", "cosine",
        "--warmup_steps", "0.1",
        "--per_device_train_batch_size", "1",
        "--gradient_accumulation_steps", "1",
        "--max_length", str(settings.training_length),
        "--packing", "true",
        "--packing_strategy", "wrapped",
        "--logging_steps", "1",
        "--save_steps", str(settings.save_steps),
        "--save_total_limit", "1",
        "--restore_callback_states_from_checkpoint", "true",
        "--report_to", "none",
        "--use_cpu", "true",
        "--dataloader_num_workers", "0",
    ]  # fmt: skip


def run_sft(settings: StudySettings, work_dir: Path, arm: str, seed: int) -> dict:
    """One healing run, `iha sft`'s own parse of its flags and `train_sft`, with the step trace of the tokens it
    trained on (equal digests across arms: the same rows in the same order)."""
    import shutil

    from transformers.trainer_utils import get_last_checkpoint

    from iha.cli.sft import parse_args
    from iha.training.train import train_sft
    from research.ab.measures import StepTrace, find_step_trace

    write_training_rows(settings, work_dir)
    argv = sft_argv(settings, work_dir, arm, seed)
    output = Path(argv[argv.index("--output_dir") + 1])
    checkpoint = get_last_checkpoint(str(output)) if output.is_dir() else None
    if checkpoint is not None:
        log(f"sft {arm} seed {seed}: resuming from {Path(checkpoint).name}")
        argv += ["--resume_from_checkpoint", checkpoint]
    model_args, script_args, training_args = parse_args(argv, prog="iha sft")
    record = {"arm": arm, "seed": seed, "resumed_from": Path(checkpoint).name if checkpoint else None}
    record["command"] = "iha sft " + " ".join(sft_argv(settings, Path("WORK"), arm, seed)).replace(
        str(base_dir()), "SMOLLM2"
    )
    with measured(record):
        trainer = train_sft(script_args, training_args, model_args, callbacks=[StepTrace()])
    trace = find_step_trace(trainer).steps
    record.update(
        steps=trainer.state.global_step,
        trained_tokens=sum(step["tokens"] for step in trace),
        loss_tokens=sum(step.get("loss_tokens", 0) for step in trace),
        step_trace=trace,
        losses=[entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        learning_rates=[entry["learning_rate"] for entry in trainer.state.log_history if "learning_rate" in entry],
    )
    for folder in output.glob("checkpoint-*"):
        shutil.rmtree(folder, ignore_errors=True)
    del trainer
    release_memory()
    return record


# --------------------------------------------------------------------------------------------------------------------
# Units, locks and the worker loop
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Unit:
    kind: str  # build, ruler, gsm8k, sft
    model: str = ""
    task: str = ""
    seed: int | None = None

    @property
    def name(self) -> str:
        return ":".join(str(part) for part in (self.kind, self.model, self.task, self.seed) if part not in ("", None))

    def result_path(self, results_dir: Path) -> Path:
        if self.kind == "build":
            return results_dir / "models.json"
        if self.kind == "ruler":
            return results_dir / "ruler" / self.model / f"{self.task}.json"
        if self.kind == "gsm8k":
            return results_dir / "gsm8k" / f"{self.model}.json"
        return results_dir / "sft" / f"{healed_name(self.model, self.seed)}.json"

    def ready(self, results_dir: Path) -> bool:
        """Whether what the unit needs is there: the models built, or the SFT run finished."""
        if self.kind in ("build",):
            return True
        build = Unit("build").result_path(results_dir).is_file()
        if self.kind == "sft" or self.model in BEFORE_MODELS:
            return build
        arm, seed = self.model.rsplit("-seed", 1)
        return Unit("sft", arm.removesuffix("-healed"), seed=int(seed)).result_path(results_dir).is_file()


def study_units(settings: StudySettings, only: set[str], models: set[str] | None = None) -> list[Unit]:
    """Every unit, in the order a single worker runs them (two workers take the next ready units, so two SFT runs
    go side by side): the models; the four models' first RULER task (the identity check and the first comparison
    come with it) and GSM8K scores; per seed, the SFT run of each healed arm (hybrid, global_local) with the same
    two scores of the healed model; the four models' other RULER tasks (multi-key retrieval, at the floor for this
    base model); per seed, the control arm (the base trained by the same run: without it, what healing does to the
    GSM8K scores cannot be told from what this SFT does to any model) with the same two scores; last the healed
    models' other RULER tasks."""
    first, others = RULER_TASKS[0], RULER_TASKS[1:]
    healing_arms = [arm for arm in ARMS if arm != CONTROL_ARM]

    def healing(arms: list[str]) -> list[Unit]:
        """Per seed, each arm's SFT run, then its healed model's first RULER task and GSM8K scores."""
        return [
            unit
            for seed in settings.seeds
            for arm in arms
            for unit in (
                Unit("sft", arm, seed=seed),
                Unit("ruler", healed_name(arm, seed), first),
                Unit("gsm8k", healed_name(arm, seed)),
            )
        ]

    healed = [healed_name(arm, seed) for seed in settings.seeds for arm in (*healing_arms, CONTROL_ARM)]
    units = [Unit("build")]
    units += [Unit("ruler", model, first) for model in BEFORE_MODELS] + [
        Unit("gsm8k", model) for model in BEFORE_MODELS
    ]
    units += healing(healing_arms)
    units += [Unit("ruler", model, task) for model in BEFORE_MODELS for task in others]
    units += healing([CONTROL_ARM])
    units += [Unit("ruler", model, task) for model in healed for task in others]
    kinds = {"eval": {"ruler", "gsm8k"}}
    wanted = set().union(*(kinds.get(kind, {kind}) for kind in only)) if only else None
    units = [unit for unit in units if wanted is None or unit.kind in wanted or unit.kind == "build"]
    if models:
        units = [
            unit
            for unit in units
            if unit.kind == "build"
            or unit.model in models
            or (unit.kind == "sft" and healed_name(unit.model, unit.seed) in models)
        ]
    return units


def take_lock(path: Path) -> bool:
    """Create `path` holding this process's id; a lock whose process is gone is taken over."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        try:
            owner = int(path.read_text() or 0)
            os.kill(owner, 0)
            return False
        except (ValueError, ProcessLookupError):
            path.unlink(missing_ok=True)
            return take_lock(path)
        except PermissionError:
            return False
    with os.fdopen(descriptor, "w") as handle:
        handle.write(str(os.getpid()))
    return True


def unit_done(unit: Unit, settings: StudySettings, results_dir: Path, cap: int | None = None) -> bool:
    """Whether the unit's result file is there, and for RULER with the samples asked for now (a unit cut short by
    `--ruler-sample-cap` is done for a call with that cap, not for one asking for more)."""
    result = unit.result_path(results_dir)
    if not result.is_file():
        return False
    if unit.kind != "ruler":
        return True
    return len(json.loads(result.read_text(encoding="utf-8"))["samples"]) >= ruler_limit(settings, cap)


def run_unit(unit: Unit, settings: StudySettings, work_dir: Path, results_dir: Path, cap: int | None = None) -> dict:
    if unit.kind == "build":
        return run_build(settings, work_dir)
    if unit.kind == "ruler":
        return run_ruler(settings, work_dir, unit.model, unit.task, cap)
    if unit.kind == "gsm8k":
        return run_gsm8k(settings, work_dir, unit.model)
    return run_sft(settings, work_dir, unit.model, unit.seed)


# The settings only the healing runs read: they may change while no SFT run has finished (the scores before healing
# do not depend on them); the others define every unit and never change within a results folder.
HEALING_SETTINGS = {"seeds", "sft_steps", "learning_rate", "train_rows", "save_steps"}


def check_settings(settings: StudySettings, results_dir: Path) -> None:
    path = results_dir / "settings.json"
    now = dataclasses.asdict(settings)
    if path.is_file():
        earlier = json.loads(path.read_text(encoding="utf-8"))
        changed = sorted(name for name in set(now) | set(earlier) if now.get(name) != earlier.get(name))
        if not changed:
            return
        healed = sorted((results_dir / "sft").glob("*.json"))
        if set(changed) <= HEALING_SETTINGS and not healed:
            log(f"settings: {', '.join(changed)} changed before any SFT run finished; {path.name} updated")
            write_json_atomic(now, path)
            return
        reason = f" and {len(healed)} SFT runs finished with them" if set(changed) <= HEALING_SETTINGS else ""
        raise SystemExit(
            f"{results_dir} holds a study made with other settings ({', '.join(changed)} differ{reason}): give "
            "another --results-dir and --work-dir, or the same settings"
        )
    write_json_atomic(now, path)


def machine_record() -> dict:
    import torch
    import transformers

    return {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_threads": torch.get_num_threads(),
    }


def work(settings: StudySettings, args) -> int:
    """Run every unit that is ready and not done (or taken by another worker), until none is left; returns how many
    units are still waiting (for an SFT run another worker has, or has not yet started)."""
    units = study_units(settings, set(args.only or []), set(args.models or []))
    while True:
        ran = False
        waiting = 0
        for unit in units:
            result = unit.result_path(args.results_dir)
            if unit_done(unit, settings, args.results_dir, args.ruler_sample_cap):
                continue
            if not unit.ready(args.results_dir):
                waiting += 1
                continue
            if unit.kind != "build" and not model_ready(unit.model, args.work_dir) and unit.kind != "sft":
                waiting += 1
                continue
            lock = args.work_dir / "locks" / f"{unit.name.replace(':', '_')}.lock"
            if not take_lock(lock):
                waiting += 1
                continue
            try:
                if unit_done(unit, settings, args.results_dir, args.ruler_sample_cap):
                    continue
                done = sum(unit_done(u, settings, args.results_dir, args.ruler_sample_cap) for u in units)
                log(f"unit {unit.name} ({done}/{len(units)} done)")
                record = run_unit(unit, settings, args.work_dir, args.results_dir, args.ruler_sample_cap)
                record["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
                record["machine"] = machine_record()
                write_json_atomic(record, result)
                log(
                    f"unit {unit.name} done in {record['seconds']['wall']:.0f} s wall, "
                    f"{record['seconds']['cpu']:.0f} s CPU, load {record['load_average_end'][0]}"
                )
                ran = True
                write_report(args.results_dir)
            finally:
                lock.unlink(missing_ok=True)
            break  # back to the first unit: an earlier one may have become ready
        if ran:
            continue
        if waiting and args.wait:
            time.sleep(60)
            continue
        return waiting


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter, allow_abbrev=False
    )
    defaults = StudySettings()
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR, help="the result files and the report")
    parser.add_argument("--work-dir", type=Path, default=WORK_DIR, help="models, SFT runs and caches (large)")
    parser.add_argument(
        "--only",
        nargs="+",
        choices=["build", "ruler", "gsm8k", "eval", "sft"],
        help="run only these kinds of unit (eval: ruler and gsm8k)",
    )
    parser.add_argument(
        "--models",
        nargs="+",
        help="run only the units of these models (base, identity, hybrid, "
        "global_local, hybrid-healed-seed0, ...; an SFT run counts as its healed model's)",
    )
    parser.add_argument("--wait", action="store_true", help="wait for units another worker is running")
    parser.add_argument("--report", action="store_true", help="write the report from the result files and stop")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 sample per task, 2 SFT steps")
    parser.add_argument(
        "--gsm8k",
        default=GSM8K,
        help="GSM8K: a folder of train.jsonl and test.jsonl, or a Hub id (default: this project's offline copy where "
        "it is, else openai/gsm8k; where that copy is, the study runs offline: a Hub id then needs HF_HUB_OFFLINE=0 "
        "HF_DATASETS_OFFLINE=0)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: cores shared with other work)")
    parser.add_argument(
        "--ruler-sample-cap",
        type=int,
        help="ask each RULER unit of this call for at most this many samples (a partial unit, labelled so in the "
        "report; a later call without the cap extends it from lm-eval's cache)",
    )
    for setting in dataclasses.fields(StudySettings):
        default = getattr(defaults, setting.name)
        flag = "--" + setting.name.replace("_", "-")
        if isinstance(default, list):
            parser.add_argument(flag, type=int, nargs="+", default=None, help=f"default {default}")
        else:
            kind = float if isinstance(default, float) else int
            parser.add_argument(flag, type=kind, default=None, help=f"default {default}")
    args = parser.parse_args(argv)
    given = {
        s.name: getattr(args, s.name) for s in dataclasses.fields(StudySettings) if getattr(args, s.name) is not None
    }
    settings = StudySettings(**{**(QUICK if args.quick else {}), **given})
    if args.quick and args.results_dir == RESULTS_DIR:
        args.results_dir = WORK_DIR.parent / "layout_study_quick" / "results"
        args.work_dir = WORK_DIR.parent / "layout_study_quick" / "work"
    return args, settings


# lm-eval's RULER tasks import these when they build their haystacks; lm-eval itself does not require them.
RULER_MODULES = ("wonderwords", "nltk")


def check_ruler_modules(settings: StudySettings, args) -> None:
    """Refuse before any unit runs where a RULER unit is still to run and lm-eval's `ruler` extra is missing (it
    would fail only when that unit starts, possibly after hours of SFT)."""
    import importlib.util

    missing = [name for name in RULER_MODULES if importlib.util.find_spec(name) is None]
    units = study_units(settings, set(args.only or []), set(args.models or []))
    pending = [
        unit
        for unit in units
        if unit.kind == "ruler" and not unit_done(unit, settings, args.results_dir, args.ruler_sample_cap)
    ]
    if missing and pending:
        raise SystemExit(
            f"RULER needs {' and '.join(missing)} ({len(pending)} RULER units to run): "
            'pip install "lm-eval[ruler]==0.4.13", or run the other units with --only sft gsm8k'
        )


def main(argv=None) -> int:
    global GSM8K
    args, settings = parse_args(argv)
    GSM8K = args.gsm8k
    if args.report:
        write_report(args.results_dir)
        log(f"report: {args.results_dir / 'report.md'}")
        return 0
    import torch

    torch.set_num_threads(args.threads)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    check_settings(settings, args.results_dir)
    check_ruler_modules(settings, args)
    waiting = work(settings, args)
    write_report(args.results_dir)
    log(
        f"report: {args.results_dir / 'report.md'}; {waiting} units waiting for another worker"
        if waiting
        else f"every unit done; report: {args.results_dir / 'report.md'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
