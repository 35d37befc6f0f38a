"""Every notebook executes top to bottom on tiny settings (IHA_NOTEBOOK_FAST=1), so none of them rots."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from testing_utils import REPO_ROOT


NOTEBOOKS = sorted((REPO_ROOT / "notebooks").glob("*.ipynb"))


def test_the_three_notebooks_exist():
    assert [path.name for path in NOTEBOOKS] == ["01_quickstart.ipynb", "02_finetune.ipynb", "03_explorer.ipynb"]


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_executes(path: Path, tmp_path, monkeypatch):
    monkeypatch.setenv("IHA_NOTEBOOK_FAST", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    temporary = tmp_path / "tmp"  # the kernel's temporary folder: a notebook must leave nothing behind in it
    temporary.mkdir()
    monkeypatch.setenv("TMPDIR", str(temporary))
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    client.execute()
    errors = [
        output
        for cell in notebook.cells
        if cell.cell_type == "code"
        for output in cell.get("outputs", [])
        if output.get("output_type") == "error"
    ]
    assert not errors
    # Every code cell ran (an execution count on each).
    assert all(cell.get("execution_count") for cell in notebook.cells if cell.cell_type == "code")
    outputs = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.get("outputs", [])]
    text = "".join(output.get("text", "") for output in outputs)
    assert "IProgress not found" not in text  # tqdm's notebook bars need ipywidgets ([dev] installs it)
    setup_cell = next(cell for cell in notebook.cells if cell.cell_type == "code")
    assert not setup_cell.get("outputs")  # the setup cell shows nothing (it used to display 'false')
    assert [entry.name for entry in temporary.iterdir()] == []  # no 0.5 GB converted copy left in /tmp
    if path.stem == "01_quickstart":  # loaded through remote code, in a process that cannot import iha
        assert "loaded as transformers_modules." in text
