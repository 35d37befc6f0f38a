"""What the GPU check's steps came to (scripts/gpu_check.py runs them): each step's outcome, the failures its results
show, the readers of the reports the steps write (pytest's JUnit XML, the tools' JSON), and summary.md written from
the outcomes."""

import json
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path


class StepFailed(Exception):
    """A step whose results show a failure (whatever its exit code); the message says which."""


class DetailedFailure(StepFailed):
    """A failure that comes with the details read so far."""

    def __init__(self, message: str, details: dict):
        super().__init__(message)
        self.details = details


@dataclass
class Outcome:
    name: str
    title: str
    status: (
        str  # passed, skipped (it cannot run on this machine; details["skipped"] says why), failed, timed_out, not_run
    )
    seconds: float = 0.0
    cpu_seconds: float = 0.0  # of the step's processes (what a loaded machine does not inflate)
    limit: int = 0
    commands: list[str] = field(default_factory=list)
    error: str | None = None
    details: dict = field(default_factory=dict)


def succeeded(outcome: Outcome) -> bool:
    """Whether a step leaves the check passing: it passed, or it cannot run on this machine and said so."""
    return outcome.status in ("passed", "skipped")


# --- reading what the steps wrote -----------------------------------------------------------------------------------


def read_junit(path: Path, device: str) -> dict:
    """Counts, failures and skips of a pytest run from its JUnit XML; CUDA-only tests skipped on a CUDA run fail it."""
    if not path.is_file():
        raise StepFailed(f"pytest wrote no report ({path.name}): it stopped before running the tests")
    counts = {"passed": 0, "failed": 0, "skipped": 0, "xfailed": 0}
    failures, skips, flex = [], [], {}
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        test = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name', '')}"
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        skipped = case.find("skipped")
        if problem is not None:
            counts["failed"] += 1
            message = (problem.get("message") or problem.text or "").strip()
            failures.append({"test": test, "message": message[:400]})
            outcome = "failed"
        elif skipped is not None:
            reason = (skipped.get("message") or "").strip()
            if skipped.get("type") == "pytest.xfail":
                counts["xfailed"] += 1
                outcome = "xfailed"
            else:
                counts["skipped"] += 1
                outcome = "skipped"
            skips.append({"test": test, "reason": reason[:300]})
        else:
            counts["passed"] += 1
            outcome = "passed"
        if "flex" in test:
            flex[test.rsplit("::", 1)[-1]] = outcome
    details = {**counts, "failures": failures, "skips": skips}
    if flex:
        details["flex"] = flex
    if device.startswith("cuda"):
        unseen = [skip for skip in skips if "cuda" in skip["reason"].lower()]
        if unseen:
            details["cuda_tests_skipped"] = unseen
    if sum(counts.values()) == 0:
        raise StepFailed("no test ran")
    problems = []
    if counts["failed"]:
        problems.append(f"{counts['failed']} test(s) failed: " + "; ".join(f["test"] for f in failures[:5]))
    if details.get("cuda_tests_skipped"):
        problems.append(f"{len(details['cuda_tests_skipped'])} CUDA test(s) skipped on a CUDA run")
    if problems:
        raise DetailedFailure(" and ".join(problems), details)
    return details


def read_json(path: Path) -> dict:
    if not path.is_file():
        raise StepFailed(f"{path.name} was not written")
    return json.loads(path.read_text(encoding="utf-8"))


# --- the summaries --------------------------------------------------------------------------------------------------


def one_line(outcome: Outcome) -> str:
    details = outcome.details
    if outcome.status == "skipped":
        return details["skipped"]
    if outcome.status != "passed":
        return (outcome.error or "").splitlines()[0][:160]
    if outcome.name == "vllm":
        line = f"{details['passed']} passed, {details['failed']} failed, {details['skipped']} skipped"
        folded = [row for row in details["bench_rows"] if row["variant"] == "iha"]
        line += "; bench_vllm IHA / base decode tok/s (wall): " + ", ".join(
            f"{row['requests']} requests {row['decode_speed']['wall']:.2f}" for row in folded
        )
        return line
    if "passed" in details and "skipped" in details:
        line = f"{details['passed']} passed, {details['skipped']} skipped, {details['xfailed']} xfailed"
        flex = list(details.get("flex", {}).values())
        if flex:
            line += "; flex tests: " + ", ".join(f"{flex.count(kind)} {kind}" for kind in sorted(set(flex)))
        return line
    if outcome.name == "smollm2":
        return f"{details['layers']} of {details['of_layers']} layers, P = {details['num_pseudo_heads']}"
    if outcome.name == "sft":
        return f"{details['precision']}, loss {details['loss_first']:.3f} -> {details['loss_last']:.3f}"
    if outcome.name == "eval":
        metrics = ", ".join(f"{name} {100 * value:.1f}%" for name, value in details["metrics"].items())
        return f"{details['benchmark']}: {metrics}"
    if outcome.name == "synthetic":
        return f"{details['device']}: " + ", ".join(
            f"{run} {value:.3f}" for run, value in details["test_accuracy"].items()
        )
    if outcome.name == "paper_regime":
        return (
            f"{details['device']}: {len(details['test_exact_match'])} runs of one epoch; the whole grid "
            f"({len(details['seeds'])} seeds, up to {details['max_epochs']} epochs) projected at "
            f"{details['projected_grid_minutes']:.1f} minutes"
        )
    if outcome.name == "bench_sft":
        return "IHA / base " + ", ".join(f"{layout} {ratio:.2f}" for layout, ratio in details["ratios"].items())
    if outcome.name == "bench_perf":
        trains = [row["iha_over_base"]["train"] for row in details["rows"]]
        return f"{details['device']} {details['dtype']}: IHA / base train time {min(trains):.2f} - {max(trains):.2f}"
    if outcome.name == "environment":
        return f"torch {details.get('torch')}, {details.get('device_name')}"
    if outcome.name == "wheels":
        return f"{len(details.get('installed', []))} wheels"
    return ""


def markdown_table(outcomes: list[Outcome]) -> str:
    lines = ["| step | status | seconds | CPU seconds | result |", "|---|---|---:|---:|---|"]
    for outcome in outcomes:
        lines.append(
            f"| {outcome.name} | {outcome.status} | {outcome.seconds:.0f} | {outcome.cpu_seconds:.0f} | "
            f"{one_line(outcome)} |"
        )
    return "\n".join(lines)


def bench_perf_table(details: dict) -> list[str]:
    lines = [
        f"## bench_perf ({details['device']}, {details['dtype']}, {details['clock']} time; all of it in bench_perf.md)",
        "",
        "| shape | forward ms base / IHA | train ms base / IHA | IHA / base: forward, train, decode speed |",
        "|---|---|---|---|",
    ]
    for row in details["rows"]:
        forward, train = row.get("forward_ms"), row["train_ms"]
        ratios = ", ".join(f"{name} {value:.2f}" for name, value in row["iha_over_base"].items())
        forward_text = f"{forward['base']:.1f} / {forward['iha']:.1f}" if forward else "-"
        lines.append(f"| {row['what']} | {forward_text} | {train['base']:.1f} / {train['iha']:.1f} | {ratios} |")
    return [*lines, ""]


def vllm_bench_table(details: dict) -> list[str]:
    bench = details["bench"]
    lines = [
        f"## bench_vllm --quick (vLLM {bench['vllm']}, torch {bench['torch']}, {bench['dtype']}; all of it in "
        "bench_vllm.md)",
        "",
        "| requests | IHA | decode tok/s IHA / base, wall (CPU) | x decode FLOP ratio, wall (CPU) | TTFT IHA / base, "
        "wall (CPU) | same tokens as base |",
        "|---|---|---|---|---|---|",
    ]
    for row in details["bench_rows"]:
        speed, relative, ttft = row["decode_speed"], row["speed_over_inverse_flops"], row["ttft"]
        lines.append(
            f"| {row['requests']} | {'folded' if row['variant'] == 'iha' else 'explicit'} | {speed['wall']:.2f} "
            f"({speed['cpu']:.2f}) | {relative['wall']:.2f} ({relative['cpu']:.2f}) | {ttft['wall']:.2f} "
            f"({ttft['cpu']:.2f}) | {'yes' if row['same_tokens_as_base'] else 'no'} |"
        )
    kv_bytes = details["kv_bytes_per_token"]
    lines += ["", f"KV-cache bytes per token: base {kv_bytes['base']:,}, IHA {kv_bytes['iha']:,}.", ""]
    return lines


def markdown_summary(summary: dict, outcomes: list[Outcome]) -> str:
    meta, environment = summary["meta"], summary["environment"]
    skipped = [outcome.name for outcome in outcomes if outcome.status == "skipped"]
    verdict = "every step passed" if summary["passed"] else "NOT every step passed"
    if summary["passed"] and skipped:
        verdict += f" or was skipped ({', '.join(skipped)})"
    lines = [
        "# GPU check",
        "",
        f"{meta['started']}; device `{meta['device']}`{' (quick)' if meta['quick'] else ''}; "
        f"{meta['wall_seconds']:.0f} s of a {meta['budget_seconds']} s budget: **{verdict}**.",
    ]
    if environment:
        packages = ", ".join(f"{name} {version}" for name, version in environment.get("packages", {}).items())
        lines += [
            "",
            f"Machine: {environment.get('device_name')}; Python {environment.get('python')}, torch "
            f"{environment.get('torch')} (CUDA {environment.get('cuda_version')}); {packages}.",
        ]
    lines += ["", markdown_table(outcomes), ""]
    for outcome in outcomes:
        if outcome.status != "passed" and outcome.error:
            lines += [f"## {outcome.name}: {outcome.status}", "", "```", outcome.error[:3000], "```", ""]
        failures = outcome.details.get("failures") if isinstance(outcome.details, dict) else None
        for failure in failures or []:
            lines += [
                f"- `{failure['test']}`: {failure['message'].splitlines()[0][:300] if failure['message'] else ''}"
            ]
        if failures:
            lines.append("")
    flex = [(o.name, test, result) for o in outcomes for test, result in o.details.get("flex", {}).items()]
    if flex:
        lines += ["## Flex attention", "", "| step | test | result |", "|---|---|---|"]
        lines += [f"| {name} | `{test}` | {result} |" for name, test, result in flex]
        lines.append("")
    skipped = [(o.name, s) for o in outcomes if isinstance(o.details, dict) for s in o.details.get("skips", [])]
    if skipped:
        lines += ["## Skipped and expected failures", ""]
        lines += [f"- {name}: `{skip['test']}`: {skip['reason'][:200]}" for name, skip in skipped]
        lines.append("")
    for outcome in outcomes:
        if outcome.name == "bench_perf" and outcome.status == "passed":
            lines += bench_perf_table(outcome.details)
        if outcome.name == "vllm" and outcome.details.get("bench_rows"):
            lines += vllm_bench_table(outcome.details)
        if outcome.name in ("sft", "eval", "smollm2", "bench_sft") and outcome.status == "passed":
            lines += [f"## {outcome.name}", "", "```json", json.dumps(outcome.details, indent=1), "```", ""]
    return "\n".join(lines)
