"""The paper's polynomial-filter claim, trained: `run_experiment` trains, from random initialisations on fresh random
features every step, MHA with ceil(sqrt(k)) and with k heads and IHA with ceil(sqrt(k)) heads (P = the same) on the
filter of order k (k = 4: 2, 4 and 2 heads; k = 9: 3, 9 and 3), with linear and softmax attention, and reports the
relative error on held-out features against steps (`python -m research.polynomial_filter --output-dir DIR`; k = 9 with
`--order 9`).

The task, the attention layer and the hand-set constructions that show why the claim holds are in `constructions`
(this folder); the settings and graphs in `config`, one run in `runs`, the numbers of the report in `summary`, its
text and figure in `report`.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from iha.utils.atomic_files import write_json_atomic, write_text_atomic

from .config import PolynomialConfig
from .report import plot_curves, render_markdown
from .runs import saved_runs, train_filter
from .summary import summarize


def run_experiment(
    config: PolynomialConfig,
    output_dir: str | Path,
    command: str = "",
    progress: bool = True,
    runs_from: list[str | Path] = (),
    train: bool = True,
) -> dict:
    """Every attention x model x seed (reusing the runs saved with the same task settings in OUTPUT_DIR's
    runs.partial.json or report.json, or in the folders `runs_from`), then report.md/.json and error.png in
    `output_dir`. With `train=False` nothing is trained: the report is of the saved runs and lists the missing ones."""
    output_dir = Path(output_dir)
    checkpoint = output_dir / "runs.partial.json"
    runs = saved_runs(config, [output_dir, *runs_from])
    done = {(run["attention"], run["model"], run["seed"]) for run in runs}
    # Seed by seed, every model of a seed before the next seed: runs cut short still pair by seed.
    work = [(a, m, s) for a in config.attentions for s in config.seeds for m in config.models if (a, m, s) not in done]
    if not train:
        work = []
    for index, (attention, model, seed) in enumerate(work, 1):
        run = train_filter(config, model, attention, seed)
        runs.append(run)
        write_json_atomic({"config": asdict(config), "runs": runs}, checkpoint)
        if progress:
            final = run["final_relative_error"]
            print(
                f"[{index}/{len(work)}] {attention} {model} seed {seed}: relative error "
                f"{'diverged' if final is None else f'{final:.3g}'} ({run['cpu_seconds']:.0f} CPU-s)",
                flush=True,
            )
    summary = summarize(config, runs)
    report = {"config": asdict(config), "summary": summary, "runs": runs, "command": command}
    write_json_atomic(report, output_dir / "report.json")
    plot_curves(config, runs, output_dir / "error.png")
    write_text_atomic(render_markdown(config, summary, runs, command), output_dir / "report.md")
    checkpoint.unlink(missing_ok=True)
    return report
