"""Shared-memory segments that cannot leak, and peer-process liveness checks.

Segment kinds, in order of preference:

1. ``memfd``: ``os.memfd_create`` gives an anonymous file; readers open it as
   ``/proc/<writer pid>/fd/<fd>`` (same user only: the kernel applies a ptrace-read check).
   There is no name at all, so a SIGKILLed writer or reader can never leak it.
2. ``/dev/shm`` file (or the temp dir off Linux): created ``O_EXCL`` with mode 0600 under an
   unguessable name and unlinked by the writer as soon as every reader has attached. The name
   says who made it: ``cpmeta-<pid namespace>-<pid>-`` + 32 random hex digits (e.g.
   ``cpmeta-effffffc-4121-9f0c...``), so a name whose writer was killed before it could unlink
   it is reaped (:func:`reap_dead_segments`) by a same-host reader whose setup failed, and by
   the next writer that makes a named segment: a name of this user, this pid namespace and a
   process that no longer runs (a pid reused since is left alone; another namespace's pids mean
   nothing here, so its names are never touched).

Python's ``multiprocessing`` resource tracker is never involved (plain ``os.open`` + ``mmap``).
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import select
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

__all__ = ["Segment", "create_segment", "open_segment", "PeerWatch", "SEGMENT_PREFIX",
           "MEMFD_NAME", "is_segment_path", "reap_dead_segments", "REAP_GRACE_S", "memory_cgroup_room",
           "RESERVE_STEP"]

SEGMENT_PREFIX = "cpmeta-"
MEMFD_NAME = SEGMENT_PREFIX + "ring"  # /proc shows it as "/memfd:cpmeta-ring (deleted)"
NAME_TOKEN_BYTES = 16  # random bytes of a /dev/shm name (32 hex digits)
_NAME_RE = re.compile(re.escape(SEGMENT_PREFIX) + f"([0-9a-f]+)-([0-9]+)-[0-9a-f]{{{2 * NAME_TOKEN_BYTES}}}")
REAP_GRACE_S = 0.5  # a failed reader's wait for a dying writer's process to be gone
_DELETED = " (deleted)"
_SHM_DIR = "/dev/shm"
_MOUNTINFO = "/proc/self/mountinfo"
_PROC_CGROUP = "/proc/self/cgroup"
_MEMINFO = "/proc/meminfo"
_MODE = 0o600
RESERVE_STEP = 64 << 20  # a larger segment's pages are reserved in steps of this many bytes


@dataclass
class Segment:
    """An open segment file: ``fd``, the ``path`` readers open, and ``unlink_path`` (or None)."""

    fd: int
    path: str
    unlink_path: Optional[str]


def _memfd_usable(fd: int) -> Optional[str]:
    path = f"/proc/{os.getpid()}/fd/{fd}"
    try:
        os.close(os.open(path, os.O_RDWR))
    except OSError:
        return None
    return path


def _reserve(fd: int, size: int, where: str) -> None:
    """Give the segment its pages now: on a full tmpfs (a container's small /dev/shm) or a spent
    memory limit the setup fails with ``OSError`` naming it, where a sparse file would kill the
    process with SIGBUS at the first write that touches a page with no room behind it. A file
    system that cannot preallocate is left sparse. A segment over ``RESERVE_STEP`` is reserved
    in steps, the memory cgroup's room read again before each: other processes of the cgroup
    (the drivers of a host's other CP groups making their rings at the same moment) may have
    taken it since :func:`create_segment` looked, and then each can overshoot by a step at most."""
    if not hasattr(os, "posix_fallocate"):
        return
    for start in range(0, size, RESERVE_STEP):
        length = min(RESERVE_STEP, size - start)
        if start:
            _check_cgroup_room(size, where, length)
        try:
            os.posix_fallocate(fd, start, length)
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                return
            raise OSError(e.errno, f"cannot reserve {size} bytes of shared memory for the ring in "
                                   f"{where}: {e.strerror}") from None


def _cgroup_mounts() -> dict[str, tuple[str, str]]:
    """Where this mount namespace shows each cgroup hierarchy that can hold a memory limit:
    ``"memory"`` (the v1 controller) and ``""`` (v2) to ``(mount point, root)``, the root being
    the folder of the hierarchy the mount shows (``/`` unless a subtree is bind-mounted), from
    ``/proc/self/mountinfo``; the first mount of each wins."""
    found: dict[str, tuple[str, str]] = {}
    with open(_MOUNTINFO) as f:
        for line in f:
            left, sep, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if not sep or len(fields) < 5 or len(tail) < 3:
                continue
            root, point = (re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), x) for x in fields[3:5])
            if tail[0] == "cgroup2":
                found.setdefault("", (point, root))
            elif tail[0] == "cgroup" and "memory" in tail[2].split(","):
                found.setdefault("memory", (point, root))
    return found


def memory_cgroup_room() -> Optional[tuple[int, str]]:
    """``(bytes, folder)``: the least room left in the memory cgroups this process is charged to
    (its own and every ancestor with a limit) and the cgroup folder where it is least, or None
    when no limit applies, the files cannot be read, or the host has swap. Room is the limit
    less the usage that reclaim cannot free (the usage less its file pages: a segment's pages
    are shared memory, which stays). A segment's pages are charged to the cgroup of the process
    that reserves them; past the limit the kernel's answer is its OOM killer, not an error. The
    hierarchy is found wherever it is mounted (a hybrid host's v2 at ``/sys/fs/cgroup/unified``,
    a container's bind-mounted subtree). Example: cgroup v2 ``/sys/fs/cgroup/job`` with
    ``memory.max`` 1073741824, ``memory.current`` 805306368 of which 268435456 file pages ->
    ``(536870912, "/sys/fs/cgroup/job")``."""
    try:
        with open(_MEMINFO) as f:
            if any(line.startswith("SwapTotal:") and int(line.split()[1]) for line in f):
                return None  # the kernel may swap other pages out rather than kill
        with open(_PROC_CGROUP) as f:
            lines = f.read().splitlines()
        mounts = _cgroup_mounts()
    except OSError:
        return None
    found = None
    for parts in (line.split(":", 2) for line in lines):
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "" and "" in mounts:  # cgroup v2 (unless memory is a v1 controller)
            found = found or (mounts[""], path, "memory.max", "memory.current", "")
        elif "memory" in controllers.split(",") and "memory" in mounts:
            found = (mounts["memory"], path, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_")
    if found is None:
        return None
    (mount, root), path, limit_file, usage_file, stat_prefix = found
    below = os.path.relpath(path, root)  # the process's folder as the mount shows it
    if below.startswith(".."):
        return None  # the mount shows a subtree that does not hold this process
    best: Optional[tuple[int, str]] = None
    folder = os.path.normpath(os.path.join(mount, below))
    while True:  # the process's own folder up to the mount's root (a cgroup namespace hides the rest)
        try:
            with open(os.path.join(folder, limit_file)) as f:
                raw = f.read().strip()
            if raw != "max" and int(raw) < 1 << 62:  # v1 writes "no limit" as ~2**63
                with open(os.path.join(folder, usage_file)) as f:
                    usage = int(f.read())
                with open(os.path.join(folder, "memory.stat")) as f:
                    stat = dict(line.split() for line in f if line.strip())
                files = sum(int(stat.get(stat_prefix + k, 0)) for k in ("active_file", "inactive_file"))
                room = max(0, int(raw) - max(0, usage - files))
                if best is None or room < best[0]:
                    best = (room, folder)
        except (OSError, ValueError):
            pass  # unreadable, or a level without the controller's files
        if len(folder) <= len(mount):  # the mount's root done
            return best
        folder = os.path.dirname(folder)


def _check_cgroup_room(size: int, where: str, need: Optional[int] = None) -> None:
    """``OSError`` (ENOMEM) when the memory cgroup has less room than ``need`` (default: all
    ``size`` bytes of the segment) more bytes."""
    room = memory_cgroup_room()
    need = size if need is None else need
    if room is not None and need > room[0]:
        step = "" if need == size else f", less than the next step of its reservation ({need} bytes)"
        raise OSError(errno.ENOMEM, f"cannot reserve {size} bytes of shared memory for the ring in {where}: the "
                                    f"memory cgroup {room[1]} has room for {room[0]} more{step}, and past its "
                                    "limit the kernel kills a process instead of failing the call "
                                    "(CPMETA_SHM_SLOT_SIZE x CPMETA_SHM_NUM_SLOTS sets the ring's size)")


def create_segment(size: int, *, use_memfd: bool = True) -> Segment:
    """Create a zero-filled segment of ``size`` bytes readable/writable by this user only, its
    pages reserved (``OSError`` at once when there is no room for them: a full tmpfs, or a memory
    cgroup without room for them, :func:`memory_cgroup_room`)."""
    _check_cgroup_room(size, "a memfd" if use_memfd and hasattr(os, "memfd_create") else _shm_dir())
    if use_memfd and hasattr(os, "memfd_create"):
        fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
        try:
            os.fchmod(fd, _MODE)
            os.ftruncate(fd, size)
            _reserve(fd, size, "a memfd")
            path = _memfd_usable(fd)
        except OSError:
            os.close(fd)
            raise
        if path is not None:
            return Segment(fd, path, None)
        os.close(fd)
    reap_dead_segments()
    name = f"{SEGMENT_PREFIX}{_pid_ns() or '0'}-{os.getpid()}-{secrets.token_hex(NAME_TOKEN_BYTES)}"
    path = os.path.join(_shm_dir(), name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), _MODE)
    try:
        os.ftruncate(fd, size)
        _reserve(fd, size, os.path.dirname(path))
    except OSError:
        os.close(fd)
        os.unlink(path)
        raise
    return Segment(fd, path, path)


def _shm_dir() -> str:
    return _SHM_DIR if os.path.isdir(_SHM_DIR) else tempfile.gettempdir()


def _pid_ns() -> Optional[str]:
    """This process's pid namespace (the inode of ``/proc/self/ns/pid``, hex), None if unknown."""
    try:
        return format(os.stat("/proc/self/ns/pid").st_ino, "x")
    except OSError:
        return None


def reap_dead_segments(grace_s: float = 0.0) -> list[str]:
    """Unlink the named segments whose writer died before it unlinked them; returns their paths.

    A candidate is a name :func:`create_segment` makes, owned by this user, made in this
    process's pid namespace by another process that no longer runs (:class:`PeerWatch`). With
    ``grace_s`` > 0 it waits up to that long, in 10 ms steps, while candidates of live writers
    remain: a reader that saw its writer's connection close may look before the kernel has
    finished the writer's exit. Example: ``cpmeta-effffffc-4121-<hex>`` with pid 4121 killed
    -> unlinked; the same with 4121 running, or ``cpmeta-e0000001-...`` -> left."""
    ns = _pid_ns()
    if ns is None:  # no /proc: pids cannot be told apart from another namespace's
        return []
    directory, me, uid = _shm_dir(), os.getpid(), os.getuid()
    deadline = time.monotonic() + grace_s
    reaped = []
    while True:
        alive = 0
        for name in os.listdir(directory):
            m = _NAME_RE.fullmatch(name)
            if m is None or m[1] != ns or int(m[2]) == me:
                continue
            path = os.path.join(directory, name)
            try:
                if os.lstat(path).st_uid != uid:
                    continue
            except FileNotFoundError:
                continue
            watch = PeerWatch(int(m[2]))
            dead = watch.dead()
            watch.close()
            if not dead:
                alive += 1
                continue
            try:
                os.unlink(path)
                reaped.append(path)
            except FileNotFoundError:
                pass  # another reaper was first
        if not alive or time.monotonic() >= deadline:
            return reaped
        time.sleep(0.01)


def is_segment_path(path: str) -> bool:
    """True when ``path`` -- a ``/proc/<pid>/fd`` link target or the path column of
    ``/proc/<pid>/maps`` -- names a segment made by :func:`create_segment`, exactly:
    ``/memfd:cpmeta-ring`` or ``<shm dir>/cpmeta-<ns hex>-<pid>-<32 hex>``, with or without the
    kernel's `` (deleted)`` suffix. A library under a directory called ``cpmeta`` is not one
    (``/src/cpmeta/.venv/.../libtorch.so`` -> False; ``/dev/shm/cpmeta-effffffc-4121-`` + 32 hex
    -> True).
    """
    if path.endswith(_DELETED):
        path = path[:-len(_DELETED)]
    if path == "/memfd:" + MEMFD_NAME:
        return True
    directory, name = os.path.split(path)
    return directory in (_SHM_DIR, tempfile.gettempdir()) and _NAME_RE.fullmatch(name) is not None


def open_segment(path: str) -> int:
    """Open a segment created by :func:`create_segment` (by its ``path``) read-write."""
    return os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))


class PeerWatch:
    """Tells whether process ``pid`` is gone (exited, killed, or a zombie).

    Uses a pidfd where available (immune to pid reuse, sees zombies as dead), else
    ``os.kill(pid, 0)`` plus the ``/proc/<pid>/stat`` state. The pidfd is polled with a
    ``select.poll`` object registered once (``select.select`` refuses descriptors >= 1024,
    which a process with many open files hands out); one check costs ~1 µs.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._pidfd: Optional[int] = None
        self._poll: Optional[select.poll] = None
        if hasattr(os, "pidfd_open") and hasattr(select, "poll"):
            try:
                self._pidfd = os.pidfd_open(pid)
            except OSError:
                self._pidfd = None  # already gone, or another pid namespace: fall back
            else:
                self._poll = select.poll()
                self._poll.register(self._pidfd, select.POLLIN)

    @property
    def pollable(self) -> Optional[int]:
        """The pidfd when :meth:`dead` polls one (a caller may register it in its own
        ``select.poll`` to watch many peers with one syscall), else ``None``."""
        return self._pidfd if self._poll is not None else None

    def dead(self) -> bool:
        """True when the process no longer runs."""
        if self._poll is not None:
            return bool(self._poll.poll(0))  # a pidfd turns readable when the process exits
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as f:
                return f.read().rsplit(b")", 1)[1].split()[0] in (b"Z", b"X")
        except (OSError, IndexError):
            return False

    def close(self) -> None:
        if self._pidfd is not None:
            self._poll = None
            os.close(self._pidfd)
            self._pidfd = None
