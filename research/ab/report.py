"""The A/B report as people read it: report.md (`render_markdown`: tables, paired tests, what the run shows and what
it cannot) and its two plots (`plot_curves`: the training curves of both arms; `plot_drift`: the drift of arm B's
mixing coefficients). The figures come from `research.ab.summary.summarize` (report.json).
"""

from pathlib import Path

from iha.utils.atomic_files import saved_figure

from ..statistics import describe_paired
from .summary import ALPHA, MIXING_NAMES, POWER


# ---------------------------------------------------------------------------------------------------------------------
# Markdown
# ---------------------------------------------------------------------------------------------------------------------


def _over_seeds(paired: dict, scale: float = 1.0, digits: int = 4) -> str:
    """A table cell: B - A paired seed by seed, its t interval and the two p-values (or why there are none)."""
    if paired["ci"] is None:
        return "n/a (one seed)"
    low, high = (scale * bound for bound in paired["ci"])
    return (
        f"{scale * paired['mean']:+.{digits}f} [{low:+.{digits}f}, {high:+.{digits}f}]; t p {paired['t_p_value']:.2g}, "
        f"sign-flip p {paired['permutation_p_value']:.2g}"
    )


def _over_seeds_sentence(paired: dict, scale: float = 1.0, digits: int = 4, unit: str = "") -> str:
    if paired["ci"] is None:
        return "With one seed per arm there is no seed-to-seed spread to test it against."
    excludes = "excludes" if paired["interval_excludes_zero"] else "includes"
    return (
        f"Paired seed by seed (same data and order in both arms): {describe_paired(paired, scale, digits, unit)}; the "
        f"interval {excludes} 0 (with {paired['n']} seeds the sign-flip test cannot go below "
        f"{paired['smallest_permutation_p_value']:.3g})."
    )


def _loss_sentence(name: str, loss: dict) -> str:
    paired = loss["paired"]
    difference = paired["difference"]
    excludes_zero = difference["ci"][0] > 0 or difference["ci"][1] < 0
    direction = "lower" if difference["estimate"] < 0 else "higher"
    needed = paired.get("rows_for_target")
    needed_text = (
        f"; detecting {paired['target_difference']} would take about {needed:,} such rows" if needed is not None else ""
    )
    return (
        f"{name}: arm B (IHA) is {direction} by {abs(difference['estimate']):.4f} nats/token over "
        f"{paired['num_rows']} rows, 95% CI {_interval(difference['ci'])} (paired bootstrap over rows, per-row losses "
        f"averaged over seeds); the interval {'excludes' if excludes_zero else 'includes'} 0. The smallest difference "
        f"this measures at alpha {ALPHA} with power {POWER} is {paired['detectable_difference']:.4f}{needed_text}. "
        + _over_seeds_sentence(loss["paired_over_seeds"])
    )


def _spread(spread: dict, scale: float = 1.0, digits: int = 4) -> str:
    return f"{scale * spread['mean']:.{digits}f} ± {scale * spread['std']:.{digits}f}"


def _interval(ci, scale: float = 1.0, digits: int = 4, signed: bool = True) -> str:
    sign = "+" if signed else ""
    return f"[{scale * ci[0]:{sign}.{digits}f}, {scale * ci[1]:{sign}.{digits}f}]"


def _exact_floor(power: dict, num_problems: int) -> str:
    """The smallest accuracy difference an exact McNemar test can call significant on `num_problems` problems."""
    if power["exact_test_floor"] > 1:
        return f"no difference can reach p < {power['alpha']} on {num_problems} problems with an exact test"
    return (
        f"an exact test needs at least {power['minimum_discordant_pairs']} one-sided disagreements: "
        f"{100 * power['exact_test_floor']:.1f} points"
    )


def conclusions(report: dict) -> list[str]:
    """What the run shows, sentence by sentence, from the numbers alone."""
    lines = []
    if report.get("reference_loss") is not None:
        lines.append(
            _loss_sentence("Reference-solution loss on the test problems (the headline)", report["reference_loss"])
        )
    lines.append(
        _loss_sentence("Validation loss (the split the mixing learning rate was chosen on)", report["validation_loss"])
    )
    for name, bench in report["benchmarks"].items():
        test = bench["mcnemar"]
        metric = bench["metrics"][test["metric"]]
        difference = metric["b"]["mean"] - metric["a"]["mean"]
        p_values = ", ".join(f"{t['p_value']:.3g}" for t in test["per_seed"])
        power = bench["power"]
        detectable = power["detectable_difference"]
        detectable_text = (
            f"{100 * detectable:.1f} points" if detectable is not None else "undefined (the arms never disagreed)"
        )
        lines.append(
            f"{name} {test['metric']}: B - A = {100 * difference:+.1f} points (mean over seeds); exact McNemar p per "
            f"seed {p_values}. With {bench['num_problems']} problems and the observed disagreement "
            f"({100 * power['mean_discordant_share']:.1f}% of problems), the smallest difference this run detects at "
            f"alpha {power['alpha']} with power {power['power']} is {detectable_text} "
            f"({_exact_floor(power, bench['num_problems'])}). "
            + _over_seeds_sentence(metric["paired_over_seeds"], 100, 1, " points")
        )
    return lines


def render_markdown(report: dict) -> str:
    config = report["config"]
    seeds = config["seeds"]
    loss = report["validation_loss"]
    same_data_summary = ", ".join(
        f"seed {entry['seed']}: {entry['steps'][0]} steps, {entry['tokens'][0]} tokens" for entry in report["same_data"]
    )
    lines = [
        "# Does converting to IHA pay off? SFT of the source model (A) vs its IHA conversion (B)",
        "",
        f"Source model: {report['source_model']}. Arm A trains it as it is; arm B trains its IHA conversion "
        f"(P = {config['num_pseudo_heads']} pseudo-heads, identity mixing: the same function before training). "
        f"Same rows, order, steps, optimizer, schedule (lr {config['learning_rate']}, {config['lr_scheduler_type']}), "
        f"packing (max length {config['max_length']}) and assistant-only loss; seeds {seeds}. Device: "
        f"{report['machine']['device']}{' (bf16 mixed precision)' if report['machine']['bf16'] else ' (fp32)'}.",
        "",
        f"Data: {report['data']['num_train_rows']} training rows and {report['data']['num_validation_rows']} "
        f"validation rows carved (seed {config['split_seed']}) from `{config['train_data']}`; test: "
        + ", ".join(f"{bench['num_problems']} {name} problems" for name, bench in report["benchmarks"].items())
        + f" (max {config['max_new_tokens']} new tokens).",
        "",
        f"Before training, B's logits match A's to {report['conversion']['max_abs_logit_diff']:.2e} "
        f"(max |difference| over {report['conversion']['num_rows']} validation rows). Same training tokens in the same "
        f"order in both arms: {all(entry['same_data'] for entry in report['same_data'])} "
        f"({same_data_summary}).",
        "",
        "## Results (mean ± std over seeds)",
        "",
        "The headline is the loss on the test problems' reference solutions: held out, never used for a choice. "
        "The validation rows are the split arm B's mixing learning rate was chosen on (B's first seed is the "
        "candidate that did best there), so B's validation loss is biased in its favour.",
        "",
        "| metric | A (base) | B (IHA) | B - A | 95% CI of B - A (paired bootstrap over items) | B - A paired seed by "
        "seed: mean [95% t CI]; paired t p, sign-flip p |",
        "|---|---:|---:|---:|---|---|",
    ]
    losses = [("reference-solution loss, test (nats/token)", report.get("reference_loss"))]
    losses.append(("validation loss, selection split (nats/token)", loss))
    for label, values in losses:
        if values is None:
            continue
        lines.append(
            f"| {label} | {_spread(values['a'])} | {_spread(values['b'])} | "
            f"{values['b']['mean'] - values['a']['mean']:+.4f} | {_interval(values['paired']['difference']['ci'])} | "
            f"{_over_seeds(values['paired_over_seeds'])} |"
        )
    for name, bench in report["benchmarks"].items():
        for metric, values in bench["metrics"].items():
            bootstrap = values.get("bootstrap")
            ci = _interval(bootstrap["difference"]["ci"], 100, 1) if bootstrap else "-"
            lines.append(
                f"| {name} {metric} (%) | {_spread(values['a'], 100, 1)} | {_spread(values['b'], 100, 1)} | "
                f"{100 * (values['b']['mean'] - values['a']['mean']):+.1f} | {ci} | "
                f"{_over_seeds(values['paired_over_seeds'], 100, 1)} |"
            )
    lines += ["", "Per seed:", "", "| metric | " + " | ".join(f"A s{s} | B s{s}" for s in seeds) + " |"]
    lines.append("|---|" + "---:|" * (2 * len(seeds)))
    for label, values in (("reference-solution loss", report.get("reference_loss")), ("validation loss", loss)):
        if values is not None:
            cells = " | ".join(f"{a:.4f} | {b:.4f}" for a, b in zip(values["a"]["values"], values["b"]["values"]))
            lines.append(f"| {label} | {cells} |")
    for name, bench in report["benchmarks"].items():
        for metric, values in bench["metrics"].items():
            cells = " | ".join(
                f"{100 * a:.1f} | {100 * b:.1f}" for a, b in zip(values["a"]["values"], values["b"]["values"])
            )
            lines.append(f"| {name} {metric} (%) | {cells} |")
    lines += ["", "## Paired tests and power", ""]
    for label, values in (("Reference-solution loss", report.get("reference_loss")), ("Validation loss", loss)):
        if values is None:
            continue
        paired = values["paired"]
        needed = paired.get("rows_for_target")
        lines.append(
            f"- {label}, B - A per token over {paired['num_rows']} rows ({paired['num_tokens']} tokens; per-row "
            f"losses averaged over seeds): {paired['difference']['estimate']:+.4f}, 95% CI "
            f"{_interval(paired['difference']['ci'])} (half-width {paired['difference']['half_width']:.4f}; "
            f"{paired['num_resamples']} resamples). A: {paired['a']['estimate']:.4f} "
            f"{_interval(paired['a']['ci'], signed=False)}, B: {paired['b']['estimate']:.4f} "
            f"{_interval(paired['b']['ci'], signed=False)}. Smallest difference detectable at alpha {ALPHA} with power "
            f"{POWER}: {paired['detectable_difference']:.4f} nats/token"
            + (f"; {paired['target_difference']} would need about {needed:,} rows" if needed is not None else "")
            + ". These intervals hold the trained models fixed; the seed-by-seed comparison is what covers training "
            "noise."
        )
    for name, bench in report["benchmarks"].items():
        test = bench["mcnemar"]
        per_seed = "; ".join(
            f"seed {seed}: only A right {t['only_a']}, only B right {t['only_b']}, p = {t['p_value']:.3g}"
            for seed, t in zip(seeds, test["per_seed"])
        )
        power = bench["power"]
        detectable = power["detectable_difference"]
        lines.append(
            f"- {name} {test['metric']}, exact McNemar on {bench['num_problems']} problems: {per_seed}. Detectable "
            f"difference (alpha {power['alpha']}, power {power['power']}, discordant share "
            f"{100 * power['mean_discordant_share']:.1f}%): "
            + (f"{100 * detectable:.1f} points" if detectable is not None else "undefined (no disagreement)")
            + f"; {_exact_floor(power, bench['num_problems'])}."
        )
    lines += ["", "## What it shows", ""] + [f"- {line}" for line in conclusions(report)]
    lines += [
        "",
        "## What it cannot show",
        "",
        f"- One source model, one training set and {len(seeds)} seed(s) per arm: the seed spread is estimated from "
        f"{len(seeds)} value(s) per arm, and the conclusion holds for this model, data and budget only.",
        "- Differences smaller than the detectable differences above are not ruled out: a result without "
        "significance here is not evidence of no effect.",
        "- The validation rows come from the training distribution and chose arm B's mixing learning rate; the "
        "reference-solution loss and the accuracy on the test problems are the out-of-sample measures (no choice was "
        "made on them).",
        "- The paired bootstrap over rows or problems holds the trained models fixed: it says whether these models "
        "differ, not whether another training seed would; the seed-by-seed comparison covers that, with as few "
        "degrees of freedom as there are seeds.",
        "",
        f"## Arm B's mixing learning rate (chosen on validation loss, seed {seeds[0]})",
        "",
        "| mixing lr | validation loss |",
        "|---:|---:|",
    ]
    for entry in report["mixing_learning_rate_selection"]:
        chosen = " (chosen)" if entry["mixing_learning_rate"] == report["chosen_mixing_learning_rate"] else ""
        lines.append(f"| {entry['mixing_learning_rate']:g}{chosen} | {entry['validation_loss']:.4f} |")
    lines += [
        "",
        "## Drift of the mixing coefficients from identity (Frobenius norm, mean over B's seeds)",
        "",
        "![drift](drift.png)",
        "",
        "| layer | " + " | ".join(MIXING_NAMES) + " | " + " | ".join(f"{n} (relative)" for n in MIXING_NAMES) + " |",
        "|---:|" + "---:|" * (2 * len(MIXING_NAMES)),
    ]
    for entry in report["mixing_drift"]:
        lines.append(
            f"| {entry['layer']} | "
            + " | ".join(f"{entry[name]:.4f}" for name in MIXING_NAMES)
            + " | "
            + " | ".join(f"{entry[f'{name}_relative']:.4f}" for name in MIXING_NAMES)
            + " |"
        )
    lines += ["", "## Training curves", "", "![training curves](curves.png)", "", "## Time (wall-clock seconds)", ""]
    lines += ["| run | training | validation loss |", "|---|---:|---:|"]
    for run, seconds in report["seconds"].items():
        lines.append(f"| {run} | {seconds['train']:.0f} | {seconds['validation']:.0f} |")
    lines += ["", "| evaluation | generation |", "|---|---:|"]
    for name, seconds in report.get("eval_seconds", {}).items():
        lines.append(f"| {name} | {seconds:.0f} |")
    lines += ["", f"Reproduce: `{report['command']}`", ""]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------------
# Plots
# ---------------------------------------------------------------------------------------------------------------------


def plot_curves(report: dict, path: Path) -> Path:
    """The training loss of every run: arm A in blue, arm B in orange (the chosen mixing lr), other candidates grey."""
    chosen = set(report["arms"]["b"]["runs"])
    with saved_figure(path, dpi=120, figsize=(7, 4)) as (_, axis):
        for run, points in report["curves"].items():
            if not points:
                continue
            steps, losses = zip(*points)
            if run in report["arms"]["a"]["runs"]:
                style = {"color": "tab:blue", "label": f"A {run}"}
            elif run in chosen:
                style = {"color": "tab:orange", "label": f"B {run}"}
            else:
                style = {"color": "grey", "linestyle": "--", "alpha": 0.6, "label": f"B candidate {run}"}
            axis.plot(steps, losses, linewidth=1.2, **style)
        axis.set_xlabel("optimizer step")
        axis.set_ylabel("training loss (assistant tokens)")
        axis.set_title("SFT: source model (A) vs its IHA conversion (B)")
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)
    return Path(path)


def plot_drift(report: dict, runs_b: list[dict], path: Path) -> Path:
    """Per layer, the Frobenius norm of each mixing parameter minus its identity init, one line per seed of B."""
    with saved_figure(path, dpi=120, ncols=len(MIXING_NAMES), figsize=(12, 3.2), sharex=True) as (_, axes):
        for axis, name in zip(axes, MIXING_NAMES):
            for run in runs_b:
                layers = [entry["layer"] for entry in run["mixing_drift"]]
                axis.plot(
                    layers, [entry[name] for entry in run["mixing_drift"]], marker="o", markersize=3, label=run["run"]
                )
            axis.set_title(name)
            axis.set_xlabel("layer")
            axis.grid(alpha=0.3)
        axes[0].set_ylabel("||W - W_identity||_F")
        axes[-1].legend(fontsize=7)
    return Path(path)


__all__ = ["conclusions", "plot_curves", "plot_drift", "render_markdown"]
