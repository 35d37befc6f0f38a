"""The whole conversion of a checkpoint folder or Hub id: `convert_checkpoint`.

The weights stream from the source shards to the output shards one tensor at a time; everything is written in a
staging folder that is renamed into place only once verified, with its model card and report.
"""

import logging
import math
import os
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
from transformers.utils import logging as transformers_logging

from ..utils.atomic_folders import staged_folder
from .builtin import builtin_base_model
from .card import write_conversion_card
from .errors import ConversionError, VerificationFailedError
from .options import CheckpointOptions, IHAConversionOptions, refuse_unknown_keywords, settings_from
from .plan import dtype_changes, plan_conversion
from .readers import find_weight_files, open_weight_files, read_source_config, resolve_source
from .report import ConversionReport, function_change_warning, write_report
from .verify import long_verification_plan, verify_conversion
from .writers import copy_source_files, plan_output_tensors, write_config_and_code, write_weights


logger = logging.getLogger(__name__)


def prepare_output_dir(output_dir: Path, overwrite: bool) -> None:
    if output_dir.exists() and not output_dir.is_dir():
        raise ConversionError(f"The output path {output_dir} is a file; give a folder.")
    if output_dir.is_dir() and any(output_dir.iterdir()) and not overwrite:
        raise ConversionError(
            f"The output folder {output_dir} exists and is not empty. Choose another folder, or pass --overwrite "
            "(overwrite=True) to replace it once the new conversion has succeeded."
        )


@contextmanager
def hidden_progress_bars(hide: bool) -> Iterator[None]:
    """Silence transformers' ("Loading weights") and huggingface_hub's (downloads) progress bars in the block."""

    if not hide:
        yield
        return
    transformers_was_on = transformers_logging.is_progress_bar_enabled()
    hub_was_on = not are_progress_bars_disabled()
    transformers_logging.disable_progress_bar()
    disable_progress_bars()
    try:
        yield
    finally:
        if transformers_was_on:
            transformers_logging.enable_progress_bar()
        if hub_was_on:
            enable_progress_bars()


def convert_checkpoint(
    source: str | os.PathLike,
    output_dir: str | os.PathLike,
    options: IHAConversionOptions | Mapping | None = None,
    checkpoint_options: CheckpointOptions | Mapping | None = None,
    *,
    show_progress: bool = True,
    **settings,
) -> ConversionReport:
    """Convert a Llama / Mistral / Qwen2 checkpoint (local folder or Hub id) into a Hub-ready IHA folder.

    `options` (`IHAConversionOptions`) say what the converted model computes; their defaults give an exact
    conversion. `checkpoint_options` (`CheckpointOptions`) say how the checkpoint is read, written and checked:
    `dtype` "auto" keeps each tensor's dtype, "float32", "bfloat16" or "float16" casts the floating-point weights
    (a narrowing cast changes the function, and the report says so); `max_shard_size`, `overwrite`,
    `allow_pickle`, `verify`, `tolerance`, Hub `revision` / `token` / `cache_dir`, `base_model` for the card.
    Any of these settings can also be given by name: `convert_checkpoint(src, dst, num_pseudo_heads=4,
    dtype="bfloat16")`.

    The weights stream from the source shards to the output shards one tensor at a time (memory holds one
    tensor, plus one model at a time during verification). Everything is written to a temporary folder next
    to `output_dir` and renamed into place at the end, so a failed or interrupted conversion leaves nothing.
    With `verify` (the default) both models run on a fixed batch in fp32; when the settings are meant to be
    exact and the logits differ, `VerificationFailedError` is raised and no output is kept.
    """
    started = time.perf_counter()
    options, rest = settings_from(IHAConversionOptions, options, settings)
    checkpoint_options, rest = settings_from(CheckpointOptions, checkpoint_options, rest)
    refuse_unknown_keywords("convert_checkpoint", rest, IHAConversionOptions, CheckpointOptions)
    output_dir = Path(output_dir).expanduser().resolve()
    prepare_output_dir(output_dir, checkpoint_options.overwrite)
    if sys.byteorder != "little":
        raise ConversionError("Writing safetensors needs a little-endian machine.")

    with hidden_progress_bars(not show_progress):
        source_dir, hub_id = resolve_source(
            source,
            revision=checkpoint_options.revision,
            token=checkpoint_options.token,
            cache_dir=checkpoint_options.cache_dir,
            allow_pickle=checkpoint_options.allow_pickle,
        )
    if source_dir.resolve() == output_dir:
        raise ConversionError("The output folder is the source folder; write the IHA checkpoint somewhere else.")
    source_config = read_source_config(source_dir)
    plan = plan_conversion(source_config, options)
    config = plan.config
    kind, weight_files = find_weight_files(source_dir, checkpoint_options.allow_pickle)
    logger.info(f"Converting {hub_id or source_dir} ({plan.architecture}, {len(weight_files)} {kind} file(s)).")

    readers, sources = open_weight_files(kind, weight_files)
    try:
        target_dtype = None if checkpoint_options.dtype == "auto" else getattr(torch, checkpoint_options.dtype)
        tensors, casts = plan_output_tensors(config, sources, target_dtype)
        function_changes = plan.function_changes + dtype_changes(casts)
        out_dtype = target_dtype or sources["model.embed_tokens.weight"].dtype
        config.dtype = out_dtype

        # Written in a staging folder next to output_dir, renamed into place at the end: a failure, Ctrl-C, SIGTERM or
        # SIGHUP removes it (and the parent folders it created); a SIGKILLed run's is removed by the next run.
        with staged_folder(output_dir, "iha-convert", replace=checkpoint_options.overwrite) as staging:
            weight_names = write_weights(staging, tensors, checkpoint_options.max_shard_bytes, show_progress)
            for reader in readers:
                reader.close()
            readers = []
            write_config_and_code(staging, config)
            copy_source_files(source_dir, staging, source_config)

            verification = None
            if checkpoint_options.verify:
                long_length, changed_window = long_verification_plan(config, plan.source_windows)
                logger.info(
                    "Verifying: source and converted model on a fixed batch in fp32"
                    + (
                        f", and on one {long_length}-token input (the settings change the function)"
                        if function_changes
                        else ""
                    )
                    + " ..."
                )
                with hidden_progress_bars(not show_progress):
                    verification = verify_conversion(
                        source_dir,
                        staging,
                        exact_expected=not function_changes,
                        tolerance=checkpoint_options.tolerance,
                        long_length=long_length if function_changes else None,
                        window=changed_window,
                    )
            report = ConversionReport(
                source=hub_id or str(source_dir),
                output_dir=str(output_dir),
                architecture=plan.architecture,
                options=options,
                attention_types=list(config.attention_types),
                sliding_window=config.sliding_window,
                dtype=str(out_dtype).removeprefix("torch."),
                exact=not function_changes,
                function_changes=function_changes,
                weight_files=weight_names,
                total_bytes=sum(tensor.nbytes for tensor in tensors),
                head_mixing_parameters=sum(math.prod(t.shape) for t in tensors if t.source is None),
                verification=verification,
                seconds=0.0,
                base_model=checkpoint_options.base_model or hub_id or builtin_base_model(source_dir),
            )
            if verification is not None and not verification.passed:
                raise VerificationFailedError(
                    f"Verification failed: {verification.message}. Nothing was written to {output_dir}.", report
                )

            write_conversion_card(staging, report, source_dir)
            report.seconds = round(time.perf_counter() - started, 2)
            write_report(staging, report)
    finally:
        for reader in readers:
            reader.close()
    if not report.exact:
        logger.warning(function_change_warning(report))
    return report
