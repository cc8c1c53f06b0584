"""Where fetched and converted models live, and how they get there without leaving half-written files.

Everything specdecode stores goes under one cache root, so a user can find, size and delete it in one
place. Writers build into a temporary sibling and rename it into place: a crash or Ctrl-C mid-write
leaves at worst a temporary that the next writer removes, never a file that looks complete but is not.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from platformdirs import user_cache_dir

CACHE_ENV = "SPECDECODE_CACHE"
_TMP_MARK = ".tmp-"


def cache_root() -> Path:
    """The cache root: `$SPECDECODE_CACHE` if set, else the platform's user cache dir."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path(user_cache_dir("specdecode"))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(parent: Path) -> None:
    """Delete temporaries left by writers that died (their pid is in the name and no longer runs)."""
    if not parent.is_dir():
        return
    for entry in parent.iterdir():
        if _TMP_MARK not in entry.name:
            continue
        try:
            pid = int(entry.name.split(_TMP_MARK, 1)[1].split("-", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _pid_alive(pid):
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def _publish_mode(path: Path, directory: bool) -> None:
    """Give a finished temporary the permissions a normal write would have (mkstemp makes it private)."""
    umask = os.umask(0)
    os.umask(umask)
    path.chmod((0o777 if directory else 0o666) & ~umask)


def _temp_name(final: Path) -> str:
    return f".{final.name}{_TMP_MARK}{os.getpid()}-"


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield an empty temporary directory that becomes `final` only if the block completes.

    If another process finished the same directory first, ours is discarded and theirs kept: both
    were built from the same source, so either is right.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(final.parent)
    tmp = Path(tempfile.mkdtemp(prefix=_temp_name(final), dir=final.parent))
    try:
        yield tmp
        _publish_mode(tmp, directory=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def atomic_file(final: Path) -> Iterator[Path]:
    """Yield a temporary path in `final`'s directory that replaces `final` only if the block completes."""
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(final.parent)
    fd, name = tempfile.mkstemp(prefix=_temp_name(final), dir=final.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        _publish_mode(tmp, directory=False)
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def scratch_dir(parent: Path, label: str) -> Iterator[Path]:
    """A temporary directory in `parent` (same disk as the cache) removed afterwards, even by a later run."""
    parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{label}{_TMP_MARK}{os.getpid()}-", dir=parent))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
