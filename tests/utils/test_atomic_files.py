"""The package's file writers never leave a half-written file, and never touch the old one when they fail."""

import json
import stat

import matplotlib
import pytest


matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from iha.utils.atomic_files import (
    atomic_destination,
    save_figure_atomic,
    saved_figure,
    write_json_atomic,
    write_jsonl_atomic,
    write_text_atomic,
)


def test_writers_create_folders_and_write_readable_files(tmp_path):
    text_path = write_text_atomic("héllo\n", tmp_path / "a" / "b" / "note.md")
    json_path = write_json_atomic({"value": 1.5, "name": "ü"}, tmp_path / "result.json")
    jsonl_path = write_jsonl_atomic(({"i": i} for i in range(3)), tmp_path / "rows.jsonl")

    assert text_path.read_text(encoding="utf-8") == "héllo\n"
    assert json.loads(json_path.read_text(encoding="utf-8")) == {"value": 1.5, "name": "ü"}
    assert [json.loads(line) for line in jsonl_path.read_text().splitlines()] == [{"i": 0}, {"i": 1}, {"i": 2}]
    # Readable by others (outputs get shared and uploaded), not mkstemp's owner-only mode.
    assert stat.S_IMODE(text_path.stat().st_mode) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "result.json", "rows.jsonl"]


def test_json_default_converts_unknown_values(tmp_path):
    path = write_json_atomic({"path": tmp_path}, tmp_path / "out.json", default=str)
    assert json.loads(path.read_text())["path"] == str(tmp_path)
    with pytest.raises(TypeError):
        write_json_atomic({"path": tmp_path}, tmp_path / "bad.json")
    assert not (tmp_path / "bad.json").exists()


def test_json_writes_numpy_and_torch_scalars_as_numbers(tmp_path):
    import numpy
    import torch

    data = {"numpy": numpy.float32(0.5), "torch": torch.tensor(3), "count": numpy.int64(7)}
    path = write_json_atomic(data, tmp_path / "scalars.json")
    assert json.loads(path.read_text()) == {"numpy": 0.5, "torch": 3, "count": 7}


def test_a_failing_writer_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    destination = tmp_path / "rows.jsonl"
    destination.write_text("the user's data\n")

    def rows_that_fail():
        yield {"ok": 1}
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        write_jsonl_atomic(rows_that_fail(), destination)

    assert destination.read_text() == "the user's data\n"
    assert [p.name for p in tmp_path.iterdir()] == ["rows.jsonl"]


def test_atomic_destination_writes_nothing_until_the_block_ends(tmp_path):
    destination = tmp_path / "report.md"
    with atomic_destination(destination) as temporary:
        temporary.write_text("partial")
        assert not destination.exists()
        assert temporary.parent == tmp_path and temporary.suffix == ".md"
    assert destination.read_text() == "partial"
    assert [p.name for p in tmp_path.iterdir()] == ["report.md"]


def test_save_figure_atomic_writes_the_format_of_the_destination_suffix(tmp_path):
    figure, axis = plt.subplots()
    axis.plot([0, 1], [1, 0])
    png = save_figure_atomic(figure, tmp_path / "curve.png", dpi=50)
    svg = save_figure_atomic(figure, tmp_path / "curve.svg")
    plt.close(figure)

    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert b"<svg" in svg.read_bytes()[:2000]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curve.png", "curve.svg"]


def test_saved_figure_saves_without_pyplot_and_writes_nothing_when_drawing_fails(tmp_path):
    backend, open_before = matplotlib.get_backend(), set(plt.get_fignums())
    with saved_figure(tmp_path / "curve.png", dpi=50, ncols=2, figsize=(4, 2)) as (figure, axes):
        axes[1].plot([0, 1], [1, 0])
    assert (tmp_path / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert list(figure.get_size_inches()) == [4, 2]

    (tmp_path / "old.png").write_bytes(b"old figure")
    with pytest.raises(ZeroDivisionError):
        with saved_figure(tmp_path / "old.png") as (_, axis):
            axis.plot([0, 1], [1, 1 / 0])
    assert (tmp_path / "old.png").read_bytes() == b"old figure"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["curve.png", "old.png"]
    # pyplot never saw these figures, and the backend a user chose is left alone.
    assert set(plt.get_fignums()) == open_before and matplotlib.get_backend() == backend
