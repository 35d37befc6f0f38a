"""docs/serving.md's "Choosing a layout": its tables are what `benchmarks/layout_decision.py` computes from the
committed results (the layout study's result files and the vLLM layouts benchmark's JSON), and its prose quotes no
figure those tables do not hold."""

import re
import sys

from testing_utils import REPO_ROOT


sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
from layout_decision import DOCS_PATH, END_MARKER, START_MARKER, decision_tables, docs_tables, load_inputs  # noqa: E402


SECTION_TITLE = "## 6. Choosing a layout"
NUMBER = re.compile(r"(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?")


def section_text() -> str:
    text = DOCS_PATH.read_text(encoding="utf-8")
    section = text.split(SECTION_TITLE, 1)[1]
    return section.split("\n## ", 1)[0]


def test_the_docs_hold_the_tables_the_committed_results_give():
    study, served = load_inputs()
    assert docs_tables(DOCS_PATH.read_text(encoding="utf-8")) == decision_tables(study, served)


def test_the_prose_beside_the_tables_quotes_only_their_figures():
    section = section_text()
    tables = section.split(START_MARKER, 1)[1].split(END_MARKER, 1)[0]
    prose = section.replace(tables, "")
    prose = re.sub(r"```.*?```", "", prose, flags=re.DOTALL)  # the commands: settings, not measurements
    prose = re.sub(r"`[^`]*`", "", prose)  # file names and flags
    allowed = set(NUMBER.findall(tables)) | {
        "6",
        "4",
        "1",
        "2",
    }  # the section number; "4 sliding ... : 1 global", P = 2
    quoted = set(NUMBER.findall(prose))
    assert quoted <= allowed, f"figures in the prose that the tables do not hold: {sorted(quoted - allowed)}"
