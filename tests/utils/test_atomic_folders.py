"""The staging folder every command writes through."""

import fcntl
import os

import pytest

from iha.utils.atomic_folders import LOCK_NAME, remove_stale_staging, staged_folder


def listing(folder) -> list[str]:
    return sorted(path.name for path in folder.iterdir())


def test_a_finished_folder_is_renamed_into_place_without_the_lock(tmp_path):
    destination = tmp_path / "new" / "out"
    with staged_folder(destination, "tool") as staging:
        assert staging.parent == destination.parent and staging.name.startswith(".out.tool-")
        (staging / "weights.bin").write_text("complete")
    assert listing(destination) == ["weights.bin"]
    assert listing(destination.parent) == ["out"]
    assert oct(destination.stat().st_mode & 0o777) != oct(0o700)  # not mkdtemp's private mode


def test_a_failure_removes_the_staging_folder_and_the_parents_it_created(tmp_path):
    (tmp_path / "kept").mkdir()
    destination = tmp_path / "kept" / "new" / "deeper" / "out"
    with pytest.raises(RuntimeError, match="disk full"):
        with staged_folder(destination, "tool") as staging:
            (staging / "half.bin").write_text("half")
            raise RuntimeError("disk full")
    assert listing(tmp_path) == ["kept"] and listing(tmp_path / "kept") == []


def test_an_existing_folder_is_replaced_only_when_asked_and_only_once_complete(tmp_path):
    destination = tmp_path / "out"
    destination.mkdir()
    (destination / "mine.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        with staged_folder(destination, "tool") as staging:
            (staging / "new.txt").write_text("new")
    assert listing(tmp_path) == ["out"] and listing(destination) == ["mine.txt"]

    with pytest.raises(KeyboardInterrupt):
        with staged_folder(destination, "tool", replace=True) as staging:
            (staging / "new.txt").write_text("new")
            raise KeyboardInterrupt
    assert listing(tmp_path) == ["out"] and listing(destination) == ["mine.txt"]

    with staged_folder(destination, "tool", replace=True) as staging:
        (staging / "new.txt").write_text("new")
    assert listing(tmp_path) == ["out"] and listing(destination) == ["new.txt"]


def test_only_provably_abandoned_staging_folders_are_removed(tmp_path, caplog):
    destination = tmp_path / "out"
    abandoned = tmp_path / ".out.tool-abandoned"  # what a SIGKILLed run leaves: its lock file, held by nobody
    abandoned.mkdir()
    (abandoned / LOCK_NAME).touch()
    (abandoned / "model.safetensors").write_text("half")
    in_use = tmp_path / ".out.tool-in-use"  # a run still writing holds its lock
    in_use.mkdir()
    (in_use / LOCK_NAME).touch()
    holder = os.open(in_use / LOCK_NAME, os.O_RDWR)
    fcntl.flock(holder, fcntl.LOCK_EX)
    unknown = tmp_path / ".out.tool-unknown"  # no lock file: not provably ours
    unknown.mkdir()
    other_tool = tmp_path / ".out.other-abandoned"
    other_tool.mkdir()
    (other_tool / LOCK_NAME).touch()
    try:
        with caplog.at_level("WARNING", logger="iha.utils.atomic_folders"):
            assert remove_stale_staging(destination, "tool") == [abandoned]
        assert "Removed 1 staging folder(s) that a killed earlier run of tool left" in caplog.text
        assert "still writing" in caplog.text
        assert listing(tmp_path) == [".out.other-abandoned", ".out.tool-in-use", ".out.tool-unknown"]
    finally:
        os.close(holder)
