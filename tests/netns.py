"""Network-namespace "hosts" for multi-host tests (root on Linux; the tests skip elsewhere).

One run builds, every name unique to it (``P`` = the owner's pid, ``R`` = 8 random hex digits)::

        host a                     host b                     host c
    cpmeta-nst-P-R-a           cpmeta-nst-P-R-b           cpmeta-nst-P-R-c
    eth0 10.77.0.1/24          eth0 10.77.0.2/24          eth0 10.77.0.3/24
         | veth                     | veth                     | veth
    -----+--pa------------- br0 in cpmeta-nst-P-R-sw ------pc--+-------------
                                    pb

Addresses exist only inside these namespaces (the root namespace gets no interface, route or
address), so concurrent runs may use the same subnet. ``link_down(h)`` sets host ``h``'s switch
port down: a pulled cable (both directions dropped, both ends keep their addresses, TCP
connections stay open and retransmit); ``link_up(h)`` plugs it back in. tc's netem qdisc
(delay, loss) is not available on the machines this runs on.

How cpmeta tells these hosts apart: namespaces share the hostname and the kernel boot id, which
``transport`` keys hosts by, so every rank gets ``CPMETA_HOST_ID=<host letter>`` (read by
``transport.envs.host_id``; docs/transport.md, "Host identity"). gloo binds the address of
``GLOO_SOCKET_IFNAME=eth0`` (the hostname resolves to 127.0.0.1 here, which a rank on another
host cannot reach); ``MASTER_ADDR`` is host a's address.

Ranks: :meth:`NetnsHosts.spawn` / :meth:`NetnsHosts.run` start ``fn(rank, world, *args)``
through ``multiproc.spawn_ranks`` with the host of every rank given as a layout string (``"aabbc"``:
ranks 0, 1 on a, 2, 3 on b, 4 on c); each child first enters its host's namespace with
``setns(2)`` (:class:`EnterNetns`: the call ``ip netns exec`` makes before it runs a command),
so multiproc's pipes, deadline and watchdog work unchanged. Commands (torchrun) run under
``ip netns exec`` itself: :meth:`NetnsHosts.exec_argv`.

Cleanup: :meth:`NetnsHosts.close` (the context manager / pytest fixture teardown, also after a
failed test) kills what still runs inside this run's namespaces and deletes them by exact name;
the veth pairs and the bridge vanish with their namespaces. A run killed before it could clean
up leaves namespaces named ``cpmeta-nst-<pid>-<hex>-<role>``: the next run deletes those whose
owner pid is gone (:func:`reap_stale`: an exact pattern, never a substring; a live owner's
namespaces are left alone).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

from cpmeta.testing.ranks import pid_alive
from multiproc import RankGroup, spawn_ranks

__all__ = ["NetnsHosts", "NetnsUnavailable", "EnterNetns", "reap_stale", "netns_hosts",
           "HOST_NAMES", "SUBNET", "IFNAME"]

PREFIX = "cpmeta-nst"
HOST_NAMES = "abc"
SUBNET = "10.77.0"  # host i has SUBNET.(i+1)/24
IFNAME = "eth0"  # every host's interface (inside its own namespace)
NETNS_DIR = "/run/netns"
CLONE_NEWNET = 0x40000000
IP_TIMEOUT_S = 20.0  # one `ip` command (a loaded machine)
_NAME = re.compile(rf"{PREFIX}-(\d+)-([0-9a-f]{{8}})-(sw|[a-z])")


class NetnsUnavailable(RuntimeError):
    """Namespaces, veth pairs or a bridge cannot be made here (not root, no ``ip``, a sandbox)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """``ip <args>``; ``NetnsUnavailable`` naming the command and its stderr when it fails."""
    try:
        res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NetnsUnavailable(f"`ip {' '.join(args)}`: {e}") from None
    if check and res.returncode:
        raise NetnsUnavailable(f"`ip {' '.join(args)}` failed ({res.returncode}): "
                               f"{res.stderr.strip() or res.stdout.strip()}")
    return res


def _namespaces() -> list[str]:
    """Names of every named network namespace (``ip netns list``, first word of each line)."""
    out = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def reap_stale() -> list[str]:
    """Delete the namespaces of earlier runs whose owner process is gone; return their names.

    Only names that match ``cpmeta-nst-<pid>-<8 hex>-<role>`` EXACTLY are considered, and only
    when ``<pid>`` is not a live process (a live owner may still be using them).
    """
    gone = []
    for name in _namespaces():
        m = _NAME.fullmatch(name)
        if m and int(m.group(1)) != os.getpid() and not pid_alive(int(m.group(1))):
            _ip("netns", "del", name, check=False)
            gone.append(name)
    return gone


class EnterNetns:
    """``child_setup`` for ``multiproc.spawn_ranks``: move rank ``r`` into namespace
    ``names[r]`` (``setns(2)`` on ``/run/netns/<name>``; ``None`` stays). Picklable."""

    def __init__(self, names: Sequence[Optional[str]]) -> None:
        self.names = list(names)

    def __call__(self, rank: int) -> None:
        name = self.names[rank]
        if name is None:
            return
        fd = os.open(os.path.join(NETNS_DIR, name), os.O_RDONLY)
        try:
            if hasattr(os, "setns"):  # Python 3.12+
                os.setns(fd, CLONE_NEWNET)
            else:
                libc = ctypes.CDLL(None, use_errno=True)
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns({name}): {os.strerror(err)}")
            if os.stat("/proc/thread-self/ns/net").st_ino != os.fstat(fd).st_ino:
                raise OSError(f"setns({name}): still in another network namespace")
        finally:
            os.close(fd)


class NetnsHosts:
    """2-3 hosts on one bridge; see the module docstring. Build with :meth:`create`."""

    def __init__(self, token: str, hosts: str) -> None:
        self.token = token
        self.hosts = hosts  # "ab" or "abc"
        self.switch = f"{PREFIX}-{token}-sw"
        self.made: list[str] = []  # namespaces created so far (deleted by close)

    # ---- construction ----------------------------------------------------------------------
    @classmethod
    def create(cls, n_hosts: int = 3) -> "NetnsHosts":
        """Build ``n_hosts`` (2 or 3) hosts; ``NetnsUnavailable`` (nothing left behind) where
        this machine cannot."""
        if not 2 <= n_hosts <= len(HOST_NAMES):
            raise ValueError(f"n_hosts: expected 2..{len(HOST_NAMES)}, got {n_hosts}")
        if not sys.platform.startswith("linux"):
            raise NetnsUnavailable(f"network namespaces need Linux, this is {sys.platform}")
        if os.geteuid() != 0:
            raise NetnsUnavailable("network namespaces need root (ip netns add)")
        if shutil.which("ip") is None:
            raise NetnsUnavailable("the `ip` command (iproute2) is not installed")
        reap_stale()
        self = cls(f"{os.getpid()}-{secrets.token_hex(4)}", HOST_NAMES[:n_hosts])
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self.made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        sw = self.switch
        self._add_ns(sw)
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        for h in self.hosts:
            ns = self.ns(h)
            self._add_ns(ns)
            _ip("-n", ns, "link", "add", IFNAME, "type", "veth", "peer", "name", self.port(h),
                "netns", sw)
            _ip("-n", ns, "addr", "add", f"{self.addr(h)}/24", "dev", IFNAME)
            _ip("-n", ns, "link", "set", IFNAME, "up")
            _ip("-n", sw, "link", "set", self.port(h), "master", "br0")
            _ip("-n", sw, "link", "set", self.port(h), "up")

    # ---- names -----------------------------------------------------------------------------
    def ns(self, host: str) -> str:
        """Namespace of ``host`` ("a", "b", "c")."""
        self._check(host)
        return f"{PREFIX}-{self.token}-{host}"

    def addr(self, host: str) -> str:
        """IPv4 address of ``host`` (inside its namespace only)."""
        self._check(host)
        return f"{SUBNET}.{HOST_NAMES.index(host) + 1}"

    @staticmethod
    def port(host: str) -> str:
        """The switch-side end of ``host``'s veth pair (inside the switch namespace)."""
        return f"p{host}"

    def _check(self, host: str) -> None:
        if len(host) != 1 or host not in self.hosts:
            raise ValueError(f"host: expected one of {list(self.hosts)}, got {host!r}")

    # ---- faults ----------------------------------------------------------------------------
    def link_down(self, host: str) -> None:
        """Pull ``host``'s cable: its switch port goes down (every packet to or from it dropped)."""
        _ip("-n", self.switch, "link", "set", self.port(host), "down")

    def link_up(self, host: str) -> None:
        """Plug ``host``'s cable back in."""
        _ip("-n", self.switch, "link", "set", self.port(host), "up")

    def heal(self) -> None:
        """Every link up (a test that failed mid-partition must not poison the next one)."""
        for h in self.hosts:
            self.link_up(h)

    # ---- processes -------------------------------------------------------------------------
    def rank_env(self, layout: str) -> list[dict[str, str]]:
        """Per-rank variables for ranks on ``layout`` ("aab": ranks 0, 1 on a, 2 on b)."""
        for h in layout:
            self._check(h)
        return [{"CPMETA_HOST_ID": h, "GLOO_SOCKET_IFNAME": IFNAME, "MASTER_ADDR": self.addr("a")}
                for h in layout]

    def spawn(self, fn: Callable[..., Any], layout: str, *args: Any, timeout: float = 120.0,
              env: Optional[Mapping[str, str]] = None) -> RankGroup:
        """``multiproc.spawn_ranks(fn, len(layout), *args)`` with rank r on host ``layout[r]``
        (the driver, rank 0, on host a: ``MASTER_ADDR`` is a's address)."""
        return spawn_ranks(fn, len(layout), *args, timeout=timeout, env=env,
                           rank_env=self.rank_env(layout),
                           child_setup=EnterNetns([self.ns(h) for h in layout]))

    def run(self, fn: Callable[..., Any], layout: str, *args: Any, timeout: float = 120.0,
            env: Optional[Mapping[str, str]] = None) -> list[Any]:
        """:meth:`spawn` then collect every rank's result (``multiproc.run_ranks`` semantics)."""
        with self.spawn(fn, layout, *args, timeout=timeout, env=env) as group:
            return group.results()

    def exec_argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``host``'s namespace: ``ip netns exec <ns> argv...``."""
        return ["ip", "netns", "exec", self.ns(host), *argv]

    def pids(self, ns: str) -> list[int]:
        """Processes inside namespace ``ns`` (``ip netns pids``)."""
        out = _ip("netns", "pids", ns, check=False).stdout
        return [int(p) for p in out.split() if p.isdigit()]

    # ---- cleanup ---------------------------------------------------------------------------
    def close(self) -> None:
        """Kill this run's processes still inside its namespaces, delete the namespaces, and
        check that none is left (``RuntimeError`` naming what could not be deleted)."""
        for ns in self.made:
            for pid in self.pids(ns):
                if pid != os.getpid():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
        for ns in reversed(self.made):
            _ip("netns", "del", ns, check=False)
        left = [ns for ns in _namespaces() if ns in self.made]
        self.made = left
        if left:
            raise RuntimeError(f"netns: could not delete {left}")

    def __enter__(self) -> "NetnsHosts":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def netns_hosts(n_hosts: int = 3) -> Iterator[NetnsHosts]:
    """Hosts for a pytest fixture: ``pytest.skip`` (with the reason) where they cannot be made;
    every link healed after use, everything deleted at the end (also when the test failed)."""
    import pytest

    try:
        hosts = NetnsHosts.create(n_hosts)
    except NetnsUnavailable as e:
        pytest.skip(f"network-namespace hosts unavailable here: {e}")
    with hosts:
        yield hosts
