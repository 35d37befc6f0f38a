"""What a conversion did and measured: the `ConversionReport` that `convert_checkpoint` returns and writes next to
the weights (`iha_conversion.json`, read by the model card too), and its warning when the settings change the
function."""

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from ..models.iha.layer_iha import is_iha_layer
from .options import IHAConversionOptions
from .verify import VerificationResult


REPORT_NAME = "iha_conversion.json"


@dataclass
class ConversionReport:
    """What `convert_checkpoint` did: the settings it ran with (`options`, as given), the layout they gave
    (`attention_types`, `sliding_window`) and what it wrote and measured."""

    source: str
    output_dir: str
    architecture: str
    options: IHAConversionOptions
    attention_types: list[str]
    sliding_window: int | None
    dtype: str
    exact: bool
    function_changes: list[str]
    weight_files: list[str]
    total_bytes: int
    head_mixing_parameters: int
    verification: VerificationResult | None
    seconds: float
    base_model: str | None = None

    @property
    def num_pseudo_heads(self) -> int:
        return self.options.num_pseudo_heads

    @property
    def iha_layers(self) -> list[int]:
        return [i for i, attention_type in enumerate(self.attention_types) if is_iha_layer(attention_type)]

    def to_dict(self) -> dict:
        return asdict(self)


def write_report(folder: Path, report: ConversionReport) -> Path:
    """`folder/iha_conversion.json`: the report without the local output path (the folder may go to the Hub)."""
    saved_report = {key: value for key, value in report.to_dict().items() if key != "output_dir"}
    path = folder / REPORT_NAME
    path.write_text(json.dumps(saved_report, indent=2) + "\n")
    return path


def function_change_warning(report: ConversionReport) -> str:
    lines = ["WARNING: these settings change what the model computes; this is not an exact conversion:"]
    lines += [f"  - {change}" for change in report.function_changes]
    if report.verification is not None:
        lines.append(
            f"  measured change: max |logit difference| {report.verification.max_abs_diff:.2e}, top-1 agreement "
            f"{100 * report.verification.top1_agreement:.2f}% over {report.verification.positions} positions; "
            "by input length:"
        )
        lines += [
            f"    {entry['input']} (tokens {entry['tokens']}): max |logit difference| {entry['max_abs_diff']:.2e}, "
            f"top-1 agreement {100 * entry['top1_agreement']:.2f}%"
            for entry in report.verification.by_length
        ]
    else:
        lines.append("  (not measured: verification was skipped)")
    return "\n".join(lines)
