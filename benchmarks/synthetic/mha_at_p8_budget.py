"""IHA P = 8 of `paper-ternary/` against MHA at the same budget (`paper-ternary-mha/`: 100 epochs, no early stopping).

    python benchmarks/synthetic/mha_at_p8_budget.py     # writes paper-ternary-mha/against-iha-p8.md and .json

Per seed: the best validation accuracy so far of both runs at every epoch both have run (how many epochs each led),
the test exact match each run's best model had, and, where both runs saved their best weights (IHA P = 8: seeds 1
and 2), McNemar within the seed on the test relations (`relations.seed_relation_tests`: the same test split, rebuilt
as training made it); over the seeds where both finished, the paired difference of test exact match
(`statistics.paired_differences`). An MHA run still training is compared over the epochs it has run (from its epoch
state), and said to be unfinished. Reads only the committed folders; trains nothing.
"""

import json
import sys
from dataclasses import replace
from pathlib import Path

from iha.utils.atomic_files import write_json_atomic, write_text_atomic


HERE = Path(__file__).resolve().parent
# research/ is not installed with the package: it is read from the checkout this script is in (run as a file, the
# script's own folder is on the path, not the repository's root).
sys.path.insert(0, str(HERE.parents[1]))
from research.statistics import holm_adjusted, paired_differences  # noqa: E402
from research.synthetic.checkpoints import runs_in_progress  # noqa: E402
from research.synthetic.config import PRESETS, config_from_saved  # noqa: E402
from research.synthetic.relations import seed_relation_tests  # noqa: E402
from research.synthetic.summary import best_so_far  # noqa: E402


SEEDS = (0, 1, 2)


def finished_run(seed_dir: Path, model: str) -> dict | None:
    for name in ("results.json", "results.partial.json"):
        path = seed_dir / name
        if path.is_file():
            for run in json.loads(path.read_text(encoding="utf-8"))["runs"]:
                if run["model"] == model:
                    return run
    return None


def compare_seed(seed: int) -> dict:
    p8 = finished_run(HERE / "paper-ternary" / f"seed-{seed}", "IHA P=8")
    mha_dir = HERE / "paper-ternary-mha" / f"seed-{seed}"
    mha = finished_run(mha_dir, "MHA")
    entry = {"seed": seed, "mha_finished": mha is not None}
    if mha is None:
        config = replace(PRESETS["paper-ternary-mha"], seed=seed)
        progress = runs_in_progress(config, mha_dir / "results.partial.json")
        if not progress:
            entry["mha_epochs_run"] = 0
            return entry
        mha = progress[0]
    p8_curve, mha_curve = best_so_far(p8["history"]), best_so_far(mha["history"])
    common = min(len(p8_curve), len(mha_curve))
    entry.update(
        mha_epochs_run=len(mha_curve),
        p8_epochs_run=len(p8_curve),
        common_epochs=common,
        p8_led=sum(p8_curve[epoch] > mha_curve[epoch] for epoch in range(common)),
        mha_led=sum(mha_curve[epoch] > p8_curve[epoch] for epoch in range(common)),
        at_common_epoch={"IHA P=8": p8_curve[common - 1], "MHA": mha_curve[common - 1]},
        p8_test_exact_match=100 * p8["test_exact_match"],
    )
    if entry["mha_finished"]:
        entry["mha_test_exact_match"] = 100 * mha["test_exact_match"]
        entry["mha_best_epoch"] = mha["best_epoch"]
    if entry["mha_finished"] and "weights" in p8 and "weights" in mha:
        # Both runs' weights, named from this folder, in one results dict of the paper-ternary configuration: the
        # two runs share the data (same seed, task, sizes and data streams), so one test split serves both.
        saved = json.loads((HERE / "paper-ternary" / f"seed-{seed}" / "results.json").read_text(encoding="utf-8"))
        runs = [
            {**p8, "weights": str(HERE / "paper-ternary" / f"seed-{seed}" / p8["weights"])},
            {**mha, "weights": str(mha_dir / mha["weights"])},
        ]
        config = config_from_saved(saved["config"])
        tests = seed_relation_tests(config, {"config": saved["config"], "runs": runs}, HERE, "cpu")
        entry["mcnemar"] = tests["tasks"]["ternary"]["pairs"][0]
        entry["unseen"] = {model: run["unseen"] for model, run in tests["tasks"]["ternary"]["runs"].items()}
    return entry


def render(seeds: list[dict], paired: dict | None) -> str:
    lines = [
        "# IHA P = 8 (paper-ternary) against MHA trained to the same 100 epochs (paper-ternary-mha)",
        "",
        "Best validation accuracy so far (%) at equal epochs; test exact match (%) of each run's best model; McNemar "
        "within a seed from the saved weights (Holm over this table's tests). Made by "
        "`python benchmarks/synthetic/mha_at_p8_budget.py`.",
        "",
        "| seed | MHA epochs run | epochs compared | IHA P = 8 led | MHA led | at the last compared epoch: P = 8 / MHA "
        "| test exact match: P = 8 / MHA | McNemar: only P = 8 / only MHA right, p (Holm) |",
        "|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for entry in seeds:
        if not entry.get("mha_epochs_run"):
            lines.append(f"| {entry['seed']} | 0 (not started) | | | | | | |")
            continue
        status = str(entry["mha_epochs_run"]) + ("" if entry["mha_finished"] else " (training)")
        at = entry["at_common_epoch"]
        test = f"{entry['p8_test_exact_match']:.2f} / " + (
            f"{entry['mha_test_exact_match']:.2f}" if entry["mha_finished"] else "unfinished"
        )
        mcnemar = "–"
        if "mcnemar" in entry:
            pair = entry["mcnemar"]
            only = {pair["models"][0]: pair["only_a_right"], pair["models"][1]: pair["only_b_right"]}
            mcnemar = f"{only['IHA P=8']} / {only['MHA']}, p = {pair['p_value']:.3g} ({pair['p_value_holm']:.3g})"
        lines.append(
            f"| {entry['seed']} | {status} | {entry['common_epochs']} | {entry['p8_led']} | {entry['mha_led']} | "
            f"{at['IHA P=8']:.2f} / {at['MHA']:.2f} | {test} | {mcnemar} |"
        )
    lines.append("")
    if paired is None:
        lines.append("Paired over seeds: not yet (it needs every seed's MHA run finished).")
    else:
        low, high = paired["ci"]
        lines.append(
            f"Paired over {paired['n']} seeds, test exact match IHA P = 8 − MHA: {paired['mean']:+.2f} points, 95% t "
            f"interval [{low:+.2f}, {high:+.2f}], paired t p = {paired['t_p_value']:.3g}, sign-flip p = "
            f"{paired['permutation_p_value']:.3g}, {paired['positive']} of {paired['n']} seeds positive."
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    seeds = [compare_seed(seed) for seed in SEEDS]
    tested = [entry["mcnemar"] for entry in seeds if "mcnemar" in entry]
    for pair, adjusted in zip(tested, holm_adjusted([pair["p_value"] for pair in tested])):
        pair["p_value_holm"] = adjusted
    finished = [entry for entry in seeds if entry.get("mha_finished")]
    paired = None
    if len(finished) == len(SEEDS):
        paired = paired_differences(
            [entry["mha_test_exact_match"] for entry in finished],
            [entry["p8_test_exact_match"] for entry in finished],
            labels=[entry["seed"] for entry in finished],
        )
    output = HERE / "paper-ternary-mha"
    write_json_atomic({"seeds": seeds, "paired": paired}, output / "against-iha-p8.json")
    text = render(seeds, paired)
    write_text_atomic(text, output / "against-iha-p8.md")
    print(text)


if __name__ == "__main__":
    main()
