"""`python -m research.synthetic` under faults: Ctrl-C mid-work gives one line and exit 130 and keeps the finished
runs to resume from; bad input gives one line and exit 2."""

import json
import signal
from pathlib import Path

from testing_utils import finish

from research.synthetic.cli import main


PROG = "python -m research.synthetic"


def listing(folder) -> list[str]:
    return sorted(path.name for path in folder.iterdir())


def test_interrupted_synthetic_keeps_its_finished_runs_to_resume(paused_command, tmp_path):
    output = tmp_path / "synthetic"
    argv = ["--preset", "tiny", "--tasks", "binary", "--max-epochs", "1", "--output-dir", str(output)]
    # Stopped before the second run: the first one is in results.partial.json.
    process = paused_command(
        tmp_path / "ready", "research.synthetic.train:train_one", 2, argv, entry="research.synthetic.cli:main"
    )
    process.send_signal(signal.SIGINT)
    out, err = finish(process)
    assert process.returncode == 128 + signal.SIGINT, err
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last == (
        f"{PROG}: interrupted (SIGINT); the runs finished so far are kept in {output}: the same command resumes from them"
    )
    # Beside the checkpoint: the empty lock files with which several processes share a comparison's runs, and the
    # folder of the runs' states between epochs, empty: the finished run's state went with its result, whose best
    # weights are in weights/.
    assert listing(output) == [".epochs", ".locks", "results.partial.json", "weights"]
    assert all(path.stat().st_size == 0 for path in (output / ".locks").iterdir())
    assert not list((output / ".epochs").iterdir())
    runs = json.loads((output / "results.partial.json").read_text())["runs"]
    assert len(runs) == 1 and (output / runs[0]["weights"]).is_file()
    assert listing(output / "weights") == [Path(runs[0]["weights"]).name]


def test_synthetic_summarize_bad_input_is_one_line(tmp_path, capsys):
    (tmp_path / "results.json").write_text("[]")
    assert main(["--summarize", str(tmp_path / "results.json"), "--output-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        f"{PROG}: error: {tmp_path / 'results.json'} is not a results.json written by `{PROG}`.\n"
    )
