"""Writing folders so that a failed, interrupted or killed run never leaves a half-written one behind.

A folder is built in a hidden staging folder next to its destination (`.<name>.<tool>-XXXXXXXX`, same file
system) and renamed into place only once complete. On an error, Ctrl-C (SIGINT), SIGTERM or SIGHUP the staging
folder is removed, and so are the parent folders the run created. SIGKILL cannot be caught: a staging folder left
by a killed run carries a lock file that its process held until it died, so the next run to the same destination
can prove the folder is ours and no longer in use, and removes it.

`staged_folder` is the one way the package writes a folder; `signals_raise` turns SIGTERM and SIGHUP into an
exception like Ctrl-C, so that every `finally` block and `staged_folder` clean up (`iha.cli.running.run_command`
runs every command's work under it).
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .atomic_files import default_mode, give_default_modes


try:
    import fcntl
except ImportError:  # Windows: no flock, so stale staging folders cannot be proven unused and are left alone
    fcntl = None

logger = logging.getLogger(__name__)

# Inside every staging folder while it is being written; its owner holds an exclusive flock on it.
LOCK_NAME = ".iha-staging.lock"
# Signals that end a run the way Ctrl-C does: the run cleans up, then exits with 128 + the signal number.
TERMINATING_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP, raised like KeyboardInterrupt (so whatever cleans up after Ctrl-C cleans up after it)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextmanager
def signals_raise() -> Iterator[None]:
    """Within the block, SIGTERM and SIGHUP raise `Terminated` (by default they end the process at once, and no
    cleanup runs). Outside the main thread, where Python cannot install handlers, this does nothing."""
    if not _in_main_thread():
        yield
        return

    def raise_terminated(signum, frame):
        raise Terminated(signum)

    previous = {}
    for signum in TERMINATING_SIGNALS:
        if signum == signal.SIGINT:
            continue  # Python already raises KeyboardInterrupt (unless the parent ignores Ctrl-C, which we respect)
        if signal.getsignal(signum) == signal.SIG_IGN:
            continue  # started with nohup or the like: the caller asked to ignore it
        previous[signum] = signal.signal(signum, raise_terminated)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT / SIGTERM / SIGHUP back while the block runs (a cleanup or the final renames), then deliver them:
    a second Ctrl-C must not stop a cleanup halfway."""
    if not _in_main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, TERMINATING_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def staging_prefix(destination: Path, tool: str) -> str:
    return f".{destination.name}.{tool}-"


def _try_lock(path: Path) -> int | None:
    """An open descriptor holding an exclusive flock on `path`, or None when another process holds it."""
    if fcntl is None:
        raise OSError(errno.ENOSYS, "no flock on this platform")
    descriptor = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as error:
        os.close(descriptor)
        if error.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
            return None
        raise
    return descriptor


def _create_lock(staging: Path) -> int | None:
    """Put LOCK_NAME in `staging`, locked by this process until it closes the returned descriptor (or dies).

    The file is locked under another name and then renamed, so that no other run ever sees it unlocked while this one
    is alive. None where the file system has no flock: the folder then never counts as provably abandoned.
    """
    if fcntl is None:
        return None
    pending = staging / (LOCK_NAME + ".new")
    descriptor = os.open(pending, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(descriptor)
        pending.unlink()
        return None
    os.rename(pending, staging / LOCK_NAME)
    return descriptor


def remove_stale_staging(destination: str | os.PathLike, tool: str) -> list[Path]:
    """Remove the staging folders that killed runs of `tool` left next to `destination`; returns them.

    Only folders named like ours that hold our lock file, and whose lock nobody holds (their process is gone), are
    removed: a run still writing holds its lock, and a folder without the lock file is not provably ours.
    """
    destination = Path(destination)
    removed = []
    if not destination.parent.is_dir():
        return removed
    for candidate in sorted(destination.parent.glob(staging_prefix(destination, tool) + "*")):
        lock_path = candidate / LOCK_NAME
        if candidate.is_symlink() or not candidate.is_dir() or not lock_path.is_file():
            continue
        try:
            descriptor = _try_lock(lock_path)
        except OSError:  # a file system without flock: we cannot prove the folder is unused, so it stays
            continue
        if descriptor is None:
            logger.warning(f"{candidate} belongs to a run of {tool} that is still writing {destination}; left alone.")
            continue
        try:
            shutil.rmtree(candidate, ignore_errors=True)
        finally:
            os.close(descriptor)
        removed.append(candidate)
    if removed:
        logger.warning(
            f"Removed {len(removed)} staging folder(s) that a killed earlier run of {tool} left next to "
            f"{destination}: {', '.join(path.name for path in removed)}."
        )
    return removed


def check_output_folder(folder: str | os.PathLike) -> Path:
    """`folder` as a Path, once writing into it can work: raises now, before a command's work, what writing into it
    would raise at the end. A file where the folder (or one of its parents) should be is NotADirectoryError; a nearest
    existing folder this process may not write into is PermissionError. Nothing is created."""
    folder = Path(folder).expanduser()
    for ancestor in [folder, *folder.parents]:
        if not ancestor.exists():
            continue
        if not ancestor.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, f"{ancestor} is a file, not a folder; choose another output")
        if not os.access(ancestor, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, f"{ancestor} may not be written by this user; choose another output")
        return folder
    return folder


def make_missing_parents(folder: Path) -> list[Path]:
    """`mkdir -p folder`; returns the folders it created, deepest first (to remove them again after a failure)."""
    missing = []
    for ancestor in [folder, *folder.parents]:
        if ancestor.exists():
            if not ancestor.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, f"{ancestor} is a file, not a folder; choose another output")
            break
        missing.append(ancestor)
    folder.mkdir(parents=True, exist_ok=True)
    return missing


def remove_created_parents(created: list[Path]) -> None:
    """Remove folders `make_missing_parents` created, deepest first, as long as they are empty."""
    for folder in created:
        try:
            folder.rmdir()
        except OSError:  # not empty (something else wrote there meanwhile) or already gone
            break


def move_into_place(staging: Path, destination: Path, replace: bool) -> None:
    """Rename the finished folder to `destination`. An existing destination is replaced only when it is an empty
    folder or `replace` is set, and then removed only after the new folder is in place."""
    if not destination.exists() and not destination.is_symlink():
        staging.rename(destination)
        return
    if destination.is_dir() and not destination.is_symlink() and not any(destination.iterdir()):
        destination.rmdir()
        staging.rename(destination)
        return
    if not replace:
        raise FileExistsError(errno.EEXIST, f"{destination} appeared while this run was writing it; it was kept")
    retired = Path(tempfile.mkdtemp(prefix=f".{destination.name}.old-", dir=destination.parent))
    retired.rmdir()
    destination.rename(retired)
    try:
        staging.rename(destination)
    except BaseException:
        retired.rename(destination)
        raise
    if retired.is_dir() and not retired.is_symlink():
        shutil.rmtree(retired, ignore_errors=True)
    else:
        retired.unlink()


def merge_into_place(staging: Path, destination: Path) -> None:
    """Rename every entry of the finished staging folder into the existing folder `destination` (replacing entries of
    the same name), then remove the staging folder. Renames only: no entry is ever seen half-written."""
    for entry in sorted(staging.iterdir()):
        target = destination / entry.name
        if entry.is_dir() and target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        os.replace(entry, target)
    staging.rmdir()


@contextmanager
def staged_folder(
    destination: str | os.PathLike, tool: str, *, replace: bool = False, merge: bool = False
) -> Iterator[Path]:
    """Yield an empty staging folder next to `destination`; rename it to `destination` when the block succeeds.

    When the block raises (an error, Ctrl-C, or SIGTERM / SIGHUP inside `signals_raise`) the staging folder and the
    parent folders this call created are removed, and whatever was at `destination` is left as it was. Staging
    folders of killed earlier runs to the same destination are removed first (see `remove_stale_staging`).
    `replace`: an existing non-empty `destination` is replaced (only once the new folder is complete).
    `merge`: `destination` is a folder that stays (a training run's, holding its checkpoints); the finished entries
    are renamed into it, replacing those of the same name.
    The staging folder gets the mode an ordinary new folder gets (mkdtemp would make it private), and so does
    everything written in it, files included (`give_default_modes`).
    """
    destination = Path(destination).absolute()
    try:
        created_parents = make_missing_parents(destination.parent)
    except NotADirectoryError:
        raise
    except OSError as error:
        raise OSError(
            error.errno, f"cannot create the folder {destination.parent} ({error.strerror}); choose another output"
        ) from None
    try:
        remove_stale_staging(destination, tool)
        try:
            staging = Path(tempfile.mkdtemp(prefix=staging_prefix(destination, tool), dir=destination.parent))
        except OSError as error:
            raise OSError(
                error.errno,
                f"cannot write in {destination.parent} ({error.strerror}); choose an output folder you can write to",
            ) from None
        lock = None
        try:
            staging.chmod(default_mode(executable=True))
            lock = _create_lock(staging)
            yield staging
            give_default_modes(staging)  # what the block wrote through temporary files was private to its owner
            with signals_deferred():
                if lock is not None:
                    (staging / LOCK_NAME).unlink()
                    os.close(lock)
                    lock = None
                if merge and destination.is_dir():
                    merge_into_place(staging, destination)
                else:
                    move_into_place(staging, destination, replace)
        except BaseException:
            with signals_deferred():
                if lock is not None:
                    os.close(lock)
                shutil.rmtree(staging, ignore_errors=True)
            raise
    except BaseException:
        with signals_deferred():
            remove_created_parents(created_parents)
        raise


__all__ = [
    "Terminated",
    "check_output_folder",
    "remove_stale_staging",
    "signals_deferred",
    "signals_raise",
    "staged_folder",
]
