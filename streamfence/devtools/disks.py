"""A small real disk for storage-fault tests and chaos runs: a tmpfs mounted
on a folder (root only), and a file that fills it to ENOSPC."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path


def mount(where: Path, mib: int) -> str | None:
    """Mount a tmpfs of `mib` MiB (mode 0700) on `where` (made if missing);
    None, or why it could not be mounted (not root, say)."""
    where.mkdir(mode=0o700, parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m,mode=0700", "tmpfs",
                           str(where)], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        return f"cannot mount a tmpfs at {where}: {done.stderr.strip() or done.returncode}"
    return None


def unmount(where: Path) -> None:
    """Unmount `where` (lazily if something still holds it open)."""
    if subprocess.run(["umount", str(where)], capture_output=True, timeout=30).returncode:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=30)


@contextlib.contextmanager
def small_disk(where: Path, mib: int) -> Iterator[str | None]:
    """`mount` for the block; yields None, or why no disk could be mounted."""
    why = mount(where, mib)
    try:
        yield why
    finally:
        if why is None:
            unmount(where)


def fill(where: Path) -> Path:
    """Write a filler file in `where` until its disk is full (ENOSPC); the
    file (remove it to free the space)."""
    filler = where / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            try:
                os.write(fd, b"\0" * 65536)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                return filler
    finally:
        os.close(fd)
