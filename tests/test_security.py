"""Security: no pickle (or other code-executing deserializer) anywhere, inert hostile bytes,
private and unguessable shared-memory segments.

1. An AST scan of every module of ``cpmeta/``, ``cpmeta/transport/`` and ``cpmeta/launch/``: no import of
   pickle-family modules, no ``eval``/``exec``/``compile``/``__import__``, no ``torch.load`` /
   ``numpy.load``, no torch.distributed ``*_object*`` collectives (they pickle). The scanner is
   itself tested on a snippet holding each banned construct.
2. At run time, on 3 gloo ranks (ring, forced process-group and collective tensor paths): every
   pickle entry point (``pickle.loads``/``load``/``Unpickler``, torch's ``_unpickler``,
   ``torch.load``) is replaced by a tripwire before the broadcaster is built; none fires.
3. A pickle whose ``__reduce__`` would create a marker file is fed to ``decode`` and written
   through the live ring and the process-group path in every wrapping (bare, behind a frame
   prefix, behind a valid codec header, as tensor bytes, as a bytes value): the marker never
   appears.
4. Checksum policy: ranks that disagree on the checksum fail at construction, naming the ranks;
   a follower running with it refuses a frame without the crc flag (resealed, so only the policy
   can refuse it) and one whose flag was set by hand.
5. Segments: the /dev/shm fallback is mode 0600, created ``O_EXCL`` (a planted file or symlink
   is refused, never followed), named ``cpmeta-<pid namespace>-<pid>-`` + 32 random hex digits;
   another user cannot open either kind (memfd through /proc needs ptrace rights); after the
   broadcaster is built no segment has a name (before Python 3.13 one anonymous descriptor per
   rank remains, held by CPython's mmap).
"""

from __future__ import annotations

import ast
import contextlib
import os
import pickle
import re
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any, Iterator

import pytest

from multiproc import run_ranks
from reliability_cases import make_payload, project_fds, project_mappings, verify_payload
from cpmeta.transport import CodecError, decode, encode

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cpmeta",)
BANNED_MODULES = {"pickle", "_pickle", "cPickle", "pickletools", "marshal", "shelve", "dill",
                  "cloudpickle", "joblib", "copyreg", "jsonpickle"}
BANNED_BUILTINS = {"eval", "exec", "compile", "__import__"}
BANNED_ATTR_CALLS = {  # (object name, attribute): a call of obj.attr
    ("torch", "load"), ("np", "load"), ("numpy", "load"), ("jit", "load"),
}
BANNED_ATTRS = {  # attributes that pickle whatever object they are reached through
    "broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list",
    "send_object_list", "recv_object_list", "_object_to_tensor", "_tensor_to_object",
    "read_pickle", "to_pickle", "loads_pickle", "allow_pickle",
}
NOBODY_UID = 65534
SEGMENT_NAME = re.compile(r"^cpmeta-([0-9a-f]+)-([0-9]+)-([0-9a-f]{32})$")


# ----------------------------------------------------------------------------- 1. static scan

def _dotted(node: ast.AST) -> list[str]:
    """``a.b.c`` -> ["a", "b", "c"] (empty when the chain does not start at a name)."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return parts[::-1]
    return []


def scan_source(src: str, filename: str = "<src>") -> list[str]:
    """Every banned construct in ``src`` as ``file:line: what``."""
    found = []
    for node in ast.walk(ast.parse(src, filename)):
        what = None
        if isinstance(node, ast.Import):
            bad = [a.name for a in node.names if a.name.split(".")[0] in BANNED_MODULES]
            what = bad and f"import {', '.join(bad)}"
        elif isinstance(node, ast.ImportFrom):
            mod = (node.module or "").split(".")[0]
            names = {a.name for a in node.names}
            if mod in BANNED_MODULES:
                what = f"from {node.module} import ..."
            elif names & (BANNED_MODULES | BANNED_BUILTINS | BANNED_ATTRS):
                what = f"from {node.module} import {sorted(names & (BANNED_MODULES | BANNED_ATTRS))}"
        elif isinstance(node, ast.Call):
            chain = _dotted(node.func)
            if len(chain) == 1 and chain[0] in BANNED_BUILTINS:
                what = f"call {chain[0]}()"
            elif len(chain) >= 2 and (chain[-2], chain[-1]) in BANNED_ATTR_CALLS:
                what = f"call {'.'.join(chain)}()"
            elif chain[-1:] in (["getattr"], ["import_module"]) and any(
                    isinstance(a, ast.Constant) and a.value in BANNED_MODULES | BANNED_ATTRS
                    for a in node.args):
                what = f"dynamic access {ast.unparse(node)}"
        elif isinstance(node, ast.Attribute) and node.attr in BANNED_ATTRS:
            what = f"use of .{node.attr}"
        elif isinstance(node, ast.keyword) and node.arg == "allow_pickle":
            what = "allow_pickle= keyword"
        if what:
            found.append(f"{filename}:{getattr(node, 'lineno', '?')}: {what}")
    return found


def _package_files() -> Iterator[Path]:
    for pkg in PACKAGES:
        yield from sorted((ROOT / pkg).rglob("*.py"))


def test_scanner_flags_every_banned_construct() -> None:
    snippet = "\n".join([
        "import pickle", "import _pickle as p", "from marshal import loads", "import dill.core",
        "from shelve import open", "from torch.distributed import broadcast_object_list",
        "eval('1')", "exec('x = 1')", "compile('1', 'f', 'eval')", "__import__('os')",
        "torch.load('f')", "np.load('f', allow_pickle=True)", "dist.all_gather_object(o, x)",
        "getattr(mod, 'pickle')", "importlib.import_module('cloudpickle')",
        "c10d._tensor_to_object(t, n, g)",
    ])
    found = scan_source(snippet)
    lines = {int(f.split(":")[1]) for f in found}
    assert lines == set(range(1, snippet.count("\n") + 2)), found


#: The test harness users import in THEIR tests (the package ``cpmeta.testing``): its ``ranks``
#: module spawns the test's own processes with multiprocessing, which pickles each rank's return
#: value on its way back to pytest -- between processes of one test, never on a wire between ranks.
#: Nothing else in the library imports the package (checked below), so no step path can reach it.
TEST_HARNESS = "cpmeta/testing/"
HARNESS_PICKLER = "cpmeta/testing/ranks.py"  # the one file exempt from the scan below


def test_no_pickle_family_in_library_code() -> None:
    files = [f for f in _package_files() if f.relative_to(ROOT).as_posix() != HARNESS_PICKLER]
    assert len(files) >= 10 and all(f.stat().st_size for f in files[:3])
    found = [hit for f in files for hit in scan_source(f.read_text(), str(f.relative_to(ROOT)))]
    assert not found, "\n".join(found)


def test_no_library_module_imports_the_test_harness() -> None:
    users = [f.relative_to(ROOT).as_posix() for f in _package_files()
             if not f.relative_to(ROOT).as_posix().startswith(TEST_HARNESS) and re.search(
                 r"^\s*(from\s+(cpmeta|\.+\w*)(\.testing\b|\s+import\s+.*\btesting\b)|import\s+cpmeta\.testing"
                 r"|from\s+\.+testing\b)",
                 f.read_text(), re.M)]
    assert not users, users


# ----------------------------------------------------------------------------- 2+3. live ranks

class _Evil:
    """Unpickling this creates the marker file (if anything ever unpickles it)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (open, (self.marker, "w"))


_LEN = struct.Struct("<Q")


@contextlib.contextmanager
def _tripwires(hits: list[str]) -> Iterator[None]:
    """Replace every pickle entry point reachable from library code with a recorder (restored
    on exit: the test harness pickles the rank's return value)."""
    import torch
    import torch.distributed.distributed_c10d as c10d

    def wire(name: str) -> Any:
        def tripped(*args: Any, **kw: Any) -> Any:
            hits.append(name)
            raise RuntimeError(f"security test: {name} called")
        return tripped

    targets = [(m, a) for m, a in ((pickle, "loads"), (pickle, "load"), (pickle, "Unpickler"),
                                   (pickle, "dumps"), (pickle, "Pickler"), (c10d, "_unpickler"),
                                   (c10d, "_pickler"), (torch, "load")) if hasattr(m, a)]
    saved = [(m, a, getattr(m, a)) for m, a in targets]
    for m, a in targets:
        setattr(m, a, wire(f"{m.__name__}.{a}"))
    try:
        yield
    finally:
        for m, a, v in saved:
            setattr(m, a, v)


def _hostile_frames(marker: str, schema: bytes) -> list[bytes]:
    raw = pickle.dumps(_Evil(marker))  # made BEFORE the tripwires go up
    head = encode(None, schema=schema)[:-1]  # valid codec header, body stripped
    valid = encode([{"x": raw}, []], schema=schema)
    # the broadcast frame's own header (cpmeta.broadcast.wire.HEADER) around a pickle as its
    # layout block and as its values block
    from cpmeta.broadcast.wire import MESSAGE_VERSION

    frame_head = struct.Struct("<4sHH16sIIIIIIQQ")
    as_layout = frame_head.pack(b"CPMB", MESSAGE_VERSION, 1, schema[:16].ljust(16, b"0"),
                                zlib.crc32(raw), 0, len(raw), 0, 0, 0, 0, 11) + raw
    as_values = frame_head.pack(b"CPMB", MESSAGE_VERSION, 0, schema[:16].ljust(16, b"0"), 0, 0, 0,
                                len(raw), 0, 0, 0, 11) + raw
    return [raw, _LEN.pack(len(raw)) + raw, _LEN.pack(len(head) + len(raw)) + head + raw,
            _LEN.pack(len(valid)) + valid, raw * 50, as_layout, as_values]


def _security_rank(rank: int, world: int, marker: str, seed: int) -> dict:
    from cpmeta.broadcast import SCHEMA_FINGERPRINT
    from cpmeta.transport._dist import bcast_frame

    frames = _hostile_frames(marker, SCHEMA_FINGERPRINT.encode())
    hits: list[str] = []
    out: dict = {"outcomes": [], "steps": 0}
    with _tripwires(hits):
        step = _security_steps(rank, seed, frames, out, bcast_frame)
    out["steps"], out["hits"], out["marker"] = step, hits, os.path.exists(marker)
    return out


def _security_steps(rank: int, seed: int, frames: list[bytes], out: dict, bcast_frame: Any) -> int:
    """Valid broadcasts and hostile frames on the ring, process-group and collective paths."""
    import cpmeta

    step = 0
    for remote, path in ((False, "auto"), (True, "auto"), (False, "collective")):
        with cpmeta.MetadataBroadcaster(src=0, timeout=30.0, force_remote=remote,
                                        tensor_path=path) as bc:
            if not remote:
                out["fds_after_setup"] = project_fds()
                out["maps_after_setup"] = len(project_mappings())
            for _ in range(10):
                got = bc.broadcast(make_payload(seed, step) if rank == 0 else None)
                verify_payload(got, step)
                step += 1
            for frame in frames:
                out["outcomes"].append(_send_raw(bc, rank, frame, remote, bcast_frame))
            got = bc.broadcast(make_payload(seed, step) if rank == 0 else None)
            verify_payload(got, step)  # still in step after the hostile frames
            step += 1
    return step


def _send_raw(bc: Any, rank: int, frame: bytes, remote: bool, bcast_frame: Any) -> str:
    import torch

    ch = bc._objects
    if rank == 0:
        if remote:
            bcast_frame(torch.frombuffer(bytearray(frame), dtype=torch.uint8), 0, ch._remote_group)
        else:
            ch.ring.write(frame)
        bc._ch.writer.step += 1  # the hostile message took the followers' next step
        return "sent"
    try:
        bc.broadcast(None)
    except (RuntimeError, ValueError, TypeError, KeyError, AttributeError) as e:
        return type(e).__name__
    return "accepted"


@pytest.fixture(scope="module")
def security_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], Path]:
    marker = tmp_path_factory.mktemp("security") / "PWNED"
    out = run_ranks(_security_rank, 3, str(marker), 11, env={"CPMETA_SHM_SLOT_SIZE": "4096",
                    "CPMETA_SHM_NUM_SLOTS": "16"}, timeout=150)
    return out, marker


def test_no_pickle_entry_point_runs(security_run: tuple[list[dict], Path]) -> None:
    out, _ = security_run
    for r in out:
        assert r["hits"] == [] and r["steps"] == 33, r


def test_pickle_payload_never_executes(security_run: tuple[list[dict], Path]) -> None:
    out, marker = security_run
    assert not marker.exists()
    for r in out[1:]:
        assert not r["marker"]
        # 7 wrappings x 3 paths, every one refused (the follower then reads the next message)
        assert len(r["outcomes"]) == 21 and set(r["outcomes"]) <= {"RuntimeError", "ValueError"}, r
    # the control: the payload really is live (unpickling it in THIS process creates the file)
    pickle.loads(pickle.dumps(_Evil(str(marker))))
    assert marker.exists()
    marker.unlink()


def test_decode_refuses_pickles_in_every_wrapping(tmp_path: Path) -> None:
    marker = tmp_path / "PWNED"
    for frame in _hostile_frames(str(marker), b"s" * 16):
        for data in (frame, frame[_LEN.size:]):
            try:
                decode(data, schema=b"s" * 16)
            except CodecError:
                pass
    assert not marker.exists()


def test_segment_has_no_name_after_setup(security_run: tuple[list[dict], Path]) -> None:
    """After construction nothing is reachable by name. Before Python 3.13 each rank keeps ONE
    anonymous descriptor: CPython's ``mmap`` dups the fd it maps, so the ring stays reachable as
    /proc/<pid>/fd/<n> -- only to processes with ptrace rights over the rank, which can read its
    memory anyway (see test_other_user_cannot_open_a_segment); from 3.13 on the ring maps with
    ``trackfd=False`` and keeps none."""
    out, _ = security_run
    kept = 1 if sys.version_info < (3, 13) else 0
    for r in out:
        fds = r["fds_after_setup"]
        assert len(fds) <= kept and all(f.startswith("/memfd:") or f.endswith("(deleted)") for f in fds), r
        assert r["maps_after_setup"] >= 1  # the ring itself is mapped


# ----------------------------------------------------------------------------- checksum policy

def _checksum_disagreement(rank: int, world: int) -> str:
    import cpmeta

    try:
        cpmeta.MetadataBroadcaster(src=0, timeout=30.0, checksum=rank == 1).close()
    except ValueError as e:
        return str(e)
    return "constructed"


def test_checksum_setting_must_agree_at_construction() -> None:
    """A follower that requires the crc and a driver that does not stamp it would refuse every
    frame; worse, a follower without it would accept what the driver meant to protect. The
    setting is exchanged once at construction: every rank raises, naming the ranks on each side
    (never a silent downgrade)."""
    out = run_ranks(_checksum_disagreement, 2, timeout=90)
    for msg in out:
        assert "checksum setting differs" in msg and "on at ranks [1]" in msg and \
            "off at ranks [0]" in msg, out


def _checksum_required(rank: int, world: int) -> list[str]:
    """Both ranks run with the checksum; rank 0 then writes a frame WITHOUT the crc flag
    (resealed: its meta crc is right) straight into the ring."""
    import cpmeta
    from reliability_cases import make_payload, verify_payload
    from reliability_wire import AT, FLAG_CRC, loopback, parts, reseal

    out = []
    with cpmeta.MetadataBroadcaster(src=0, timeout=30.0, checksum=True) as bc:
        verify_payload(bc.broadcast(make_payload(5, 0) if rank == 0 else None), 0)
        if rank == 0:
            with loopback() as make:
                drv = make(0, False)  # a driver that never stamps a crc
                drv.broadcast(make_payload(5, 1))
            frame = drv._objects.frames[-1]
            assert not parts(frame)["flags"] & FLAG_CRC
            bc._objects.ring.write(reseal(frame))
            bad = bytearray(frame)  # the same frame with the flag set by hand: no crc behind it
            struct.pack_into("<H", bad, AT["flags"], parts(frame)["flags"] | FLAG_CRC)
            bc._objects.ring.write(bytes(bad))
            bc._ch.writer.step += 2  # the two messages took the followers' next steps
        else:
            for _ in range(2):
                try:
                    bc.broadcast(None)
                    out.append("accepted")
                except RuntimeError as e:
                    out.append(str(e))
        verify_payload(bc.broadcast(make_payload(5, 2) if rank == 0 else None), 2)
    return out


def test_follower_with_checksum_refuses_frames_without_crc() -> None:
    _, fol = run_ranks(_checksum_required, 2, timeout=90)
    no_flag, wrong = fol
    assert "rank 1" in no_flag and "no crc32" in no_flag, no_flag
    assert "rank 1" in wrong and "crc32" in wrong, wrong


# ----------------------------------------------------------------------------- 5. segments

def test_named_segments_are_private_random_and_exclusive(monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path: Path) -> None:
    from cpmeta.transport import _segment

    # the same code path in a private directory: other tests compare /dev/shm listings
    monkeypatch.setattr(_segment, "_SHM_DIR", str(tmp_path))
    segs = [_segment.create_segment(4096, use_memfd=False) for _ in range(64)]
    try:
        names = [os.path.basename(s.path) for s in segs]
        parts = [SEGMENT_NAME.match(n) for n in names]
        assert all(parts), names[:3]
        # who made it (pid namespace, pid: what the reaper of a killed writer's name needs) ...
        ns = format(os.stat("/proc/self/ns/pid").st_ino, "x")
        assert {(m[1], int(m[2])) for m in parts if m} == {(ns, os.getpid())}, names[:3]
        assert len(set(names)) == len(names)
        for s in segs:
            st = os.fstat(s.fd)
            assert st.st_mode & 0o777 == 0o600 and st.st_uid == os.geteuid()
        # ... then 64 x 128 random bits: no shared prefix longer than chance allows, no pid/time
        hexes = [m[3] for m in parts if m]
        longest = max(len(os.path.commonprefix([a, b])) for a in hexes for b in hexes if a != b)
        assert longest <= 6, longest
        # a name made from the pid carries it in every name; random hex holds a 4-5 digit run
        # by chance (~3 % of runs saw one in 64 names), three or more at ~1e-6
        assert sum(str(os.getpid()) in h for h in hexes) <= 2, hexes
    finally:
        for s in segs:
            os.close(s.fd)
            os.unlink(s.path)
    # a planted file or symlink at the next name is refused, never opened or followed
    monkeypatch.setattr(_segment.secrets, "token_hex", lambda n: "ab" * n)
    planted = tmp_path / f"cpmeta-{ns}-{os.getpid()}-{'ab' * 16}"
    target = tmp_path / "victim"
    target.write_text("keep")
    planted.symlink_to(target)
    try:
        with pytest.raises(FileExistsError):
            _segment.create_segment(4096, use_memfd=False)
        assert target.read_text() == "keep"
    finally:
        planted.unlink()


def test_a_killed_writers_name_is_reaped_and_nothing_else(monkeypatch: pytest.MonkeyPatch,
                                                          tmp_path: Path) -> None:
    """``reap_dead_segments`` unlinks a name of this user and pid namespace whose process is
    gone, and leaves a live process's name, another namespace's, its own and any other file."""
    from cpmeta.transport import _segment

    monkeypatch.setattr(_segment, "_SHM_DIR", str(tmp_path))
    ns = format(os.stat("/proc/self/ns/pid").st_ino, "x")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # exited and reaped: its pid names no process (unless reused within the test)
    other_ns = format(int(ns, 16) ^ 1, "x")
    names = {
        "dead": f"cpmeta-{ns}-{gone.pid}-{'1a' * 16}",
        "live": f"cpmeta-{ns}-{os.getppid()}-{'2b' * 16}",
        "mine": f"cpmeta-{ns}-{os.getpid()}-{'3c' * 16}",
        "other-ns": f"cpmeta-{other_ns}-{gone.pid}-{'4d' * 16}",
        "not-ours": f"cpmeta-{ns}-{gone.pid}-short",
    }
    for n in names.values():
        (tmp_path / n).write_bytes(b"")
    assert _segment.reap_dead_segments() == [str(tmp_path / names["dead"])]
    assert sorted(os.listdir(tmp_path)) == sorted(v for k, v in names.items() if k != "dead")
    # the next named segment reaps first: a second dead writer's name goes when it is made
    (tmp_path / names["dead"]).write_bytes(b"")
    seg = _segment.create_segment(4096, use_memfd=False)
    os.close(seg.fd)
    os.unlink(seg.path)
    assert not (tmp_path / names["dead"]).exists()
    # a grace waits for a live writer, and only that long
    t0 = time.monotonic()
    assert _segment.reap_dead_segments(grace_s=0.1) == []
    assert time.monotonic() - t0 >= 0.1


def test_memfd_segment_mode_and_no_name() -> None:
    from cpmeta.transport import _segment

    seg = _segment.create_segment(4096)
    try:
        if seg.unlink_path is not None:
            pytest.skip("memfd unavailable here; the /dev/shm fallback is tested above")
        assert seg.path.startswith(f"/proc/{os.getpid()}/fd/")
        assert os.fstat(seg.fd).st_mode & 0o777 == 0o600
        assert os.readlink(seg.path).startswith("/memfd:")  # anonymous: no file system name
    finally:
        os.close(seg.fd)


def _open_as_nobody(path: str) -> str:
    """Fork, drop to uid/gid ``nobody`` and try to open ``path`` read-write (only os calls run
    in the child). Returns "OPENED", "PermissionError" or "OSError"."""
    pid = os.fork()
    if pid == 0:  # child: no Python-level cleanup, just the exit code
        code = 3
        try:
            os.setgroups([])
            os.setgid(NOBODY_UID)
            os.setuid(NOBODY_UID)
            os.close(os.open(path, os.O_RDWR))
            code = 0
        except PermissionError:
            code = 1
        except OSError:
            code = 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return {0: "OPENED", 1: "PermissionError", 2: "OSError"}.get(os.waitstatus_to_exitcode(status), "?")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a probe as another user")
@pytest.mark.parametrize("use_memfd", [True, False], ids=["memfd", "devshm"])
def test_other_user_cannot_open_a_segment(use_memfd: bool) -> None:
    from cpmeta.transport import ShmRing

    ring = ShmRing.create(1, slot_size=64, num_slots=2, use_memfd=use_memfd)
    try:
        assert os.path.exists(ring.handle.path)  # the window before the reader attaches
        assert _open_as_nobody(ring.handle.path) == "PermissionError"
    finally:
        ring.mark_absent(0)
        ring.close()
