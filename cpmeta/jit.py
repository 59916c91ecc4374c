"""The compiled per-step kernels' one decorator, error convention and cache warm-up.

Every per-step stage (the step's ``BatchState`` mutations, the decode build, the prompt build, the
per-rank work on what a rank received) is ONE call of a numba kernel that writes into
preallocated numpy arrays: plain loops, no Python objects, no allocation per step. The kernels
are compiled on first use and cached on disk (``cache=True``): next to the module when its
folder is writable (a checkout), else in numba's per-user cache directory (a wheel installed
into a read-only site-packages), or wherever ``NUMBA_CACHE_DIR`` points. A process that finds
the cache loads the machine code instead of compiling it (:func:`warm_all` measures both).

Errors: a kernel never raises. It returns an int code (:data:`OK` = 0) and writes what went
wrong into a small int64 array ``err`` (:func:`error_slot`): ``err[0]`` the code, ``err[1]`` the
sequence (or slot / row) index, ``err[2]`` the offending value, ``err[3]`` the limit it broke.
The Python wrapper of each kernel owns the table from code to message and raises the named
``ValueError`` (field, sequence, limit) -- the same words the per-token references in ``tests/``
expect.

Cache validity: numba keys a function's cache on its own file's modification time and size, so a
kernel whose callee in another module changed would load stale machine code. Every kernel of
cpmeta is therefore stamped with ONE hash over the source of every kernel module and this one
(:func:`sources_stamp`): any edit recompiles them all. The cache stays where numba would put it.
The stamp goes in through numba's private locator list; a numba without it gets a warning at
import and caches on its own per-file stamps (:data:`STAMPED` False).

Warm-up: kernel modules are named ``*_njit.py`` (found by that name, nothing to list); a
function that calls the kernels once on a tiny input is registered with :func:`warmer` in the
kernel module or in its wrapper beside it (``prompt.py`` for ``prompt_njit.py``, when the
warm-up needs the wrapper's layout code); :func:`warm_all` imports both (:func:`kernel_modules`)
and runs every warmer, so one process (the test session, an engine at start-up) pays the compile or
the cache load before the step loop -- and spawned test processes only load.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from functools import lru_cache
from typing import Any, Callable, Optional, TypeVar, cast

import numba
import numpy as np
from numba.core import caching, types

__all__ = ["kernel", "OK", "error_slot", "warmer", "warm_all", "warmers", "claim_and_warm", "kernel_modules", "sources_stamp"]

F = TypeVar("F", bound=Callable[..., Any])

#: The code a kernel returns when every check passed.
OK = 0

_WARMERS: dict[str, Callable[[], None]] = {}


_HERE = os.path.dirname(os.path.abspath(__file__))

logger = logging.getLogger(__name__)

#: How long :func:`warm_all`'s last pass waits, all warmers together, for ones other processes
#: claimed (a warmer compiles in 0.1-10 s on the 2-core VM alone) before compiling them itself.
CLAIM_WAIT_S = 120


def _is_kernel_file(path: str) -> bool:
    path = os.path.abspath(path)
    return path.startswith(_HERE + os.sep) and path.endswith("_njit.py")


@lru_cache(maxsize=1)
def sources_stamp() -> str:
    """sha256 over this module and every ``*_njit.py`` under ``cpmeta/`` (paths and bytes, sorted):
    the stamp every kernel's cache entry is checked against."""
    h = hashlib.sha256()
    files = [os.path.abspath(__file__)]
    for root, _dirs, names in os.walk(_HERE):
        files += [os.path.join(root, n) for n in names if n.endswith("_njit.py")]
    for f in sorted(files):
        h.update(os.path.relpath(f, _HERE).encode())
        with open(f, "rb") as fh:
            h.update(fh.read())
    return h.hexdigest()


# numba's private cache machinery (every numba since the 0.59 floor has it): a numba that moved it
# still compiles and caches cpmeta's kernels, on numba's own per-file stamps (a warning says so)
_NUMBA_BASE: Any = getattr(caching, "_CacheLocator", object)
_NUMBA_ORDER: Any = getattr(getattr(caching, "CacheImpl", None), "_locator_classes", None)
_NUMBA_PLACEMENT: Any = tuple(getattr(caching, n, None) for n in (
    "UserProvidedCacheLocator", "InTreeCacheLocator", "UserWideCacheLocator"))


class _KernelSourcesLocator(_NUMBA_BASE):
    """Numba's own cache placement (``NUMBA_CACHE_DIR``, else the module's ``__pycache__``, else
    the per-user cache), with :func:`sources_stamp` as the source stamp of every cpmeta kernel."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def ensure_cache_path(self) -> None:
        self._inner.ensure_cache_path()

    def get_cache_path(self) -> str:
        return str(self._inner.get_cache_path())

    def get_source_stamp(self) -> Any:
        return sources_stamp()

    def get_disambiguator(self) -> str:
        return str(self._inner.get_disambiguator())

    @classmethod
    def from_function(cls, py_func: Any, py_file: str) -> Optional["_KernelSourcesLocator"]:
        if not _is_kernel_file(py_file):
            return None
        for placement in _NUMBA_PLACEMENT:
            inner = placement.from_function(py_func, py_file)
            if inner is not None:
                return cls(inner)
        return None


#: Whether every kernel's cache entry carries :func:`sources_stamp` (numba tries its locators in
#: ``_locator_classes``' order; ours goes first).
STAMPED = _NUMBA_BASE is not object and None not in _NUMBA_PLACEMENT and isinstance(_NUMBA_ORDER, list)
if not STAMPED:
    logger.warning("cpmeta.jit: numba %s moved the private cache locators cpmeta stamps its kernels "
                   "through (numba.core.caching); kernels are cached on numba's own "
                   "per-file stamps, so after editing a kernel module clear the cache (NUMBA_CACHE_DIR or "
                   "__pycache__)", numba.__version__)
elif _KernelSourcesLocator not in _NUMBA_ORDER:
    _NUMBA_ORDER.insert(0, _KernelSourcesLocator)


def kernel(fn: F) -> F:
    """``numba.njit(cache=True, nogil=True)``: the one way a per-step kernel is compiled
    (``nogil``: an engine may overlap the build with another thread).

    A call from another kernel is compiled for its arguments' plain types: numba would otherwise
    compile a callee once per constant it is passed (``fail(err, E_X, ...)`` for every error code,
    ``le_word(buf, 24, 4)`` for every offset: 174 signatures and 91 s of compiling for
    :func:`warm_all` on the 2-core VM, 94 and 53 s with plain types), and the step path would
    meet signatures the warm-up never compiled. LLVM still sees the constant when it inlines the
    callee (the hot builds and replays timed the same)."""
    disp = numba.njit(cache=True, nogil=True)(fn)
    typed = disp.get_call_template

    def get_call_template(args: Any, kws: Any) -> Any:
        return typed(tuple(map(types.unliteral, args)), {k: types.unliteral(v) for k, v in kws.items()})

    disp.get_call_template = get_call_template  # type: ignore[method-assign]  # this dispatcher only
    return cast(F, disp)


def error_slot() -> np.ndarray:
    """A zeroed ``int64[4]`` for a kernel's error report: ``[code, index, value, limit]``."""
    return np.zeros(4, np.int64)


def warmer(fn: Callable[[], None]) -> Callable[[], None]:
    """Register ``fn`` (no arguments: it calls its module's kernels once on a tiny input)."""
    _WARMERS[f"{fn.__module__}.{fn.__qualname__}"] = fn
    return fn


def warmers() -> list[str]:
    """The registered warmers' names in registration order (those of the modules imported so far;
    :func:`warm_all` imports them all). Example: ``"cpmeta.base_njit._warm"``."""
    return list(_WARMERS)


def kernel_modules() -> list[str]:
    """Every ``cpmeta`` module named ``*_njit`` and its wrapper beside it (``x.py`` for
    ``x_njit.py``) where one exists, sorted. Example: ``cpmeta.builders.prompt_njit`` and
    ``cpmeta.builders.prompt``."""
    mods = []
    for root, _dirs, names in os.walk(_HERE):
        rel = os.path.relpath(root, _HERE)
        pkg = "cpmeta" if rel == "." else "cpmeta." + rel.replace(os.sep, ".")
        for n in names:
            if n.endswith("_njit.py"):
                mods.append(f"{pkg}.{n[:-3]}")
                if os.path.exists(os.path.join(root, n[:-len("_njit.py")] + ".py")):
                    mods.append(f"{pkg}.{n[:-len('_njit.py')]}")
    return sorted(mods)


def warm_all(jobs: Optional[int] = None) -> dict[str, float]:
    """Import every kernel module and run its warmers; returns ``{warmer: seconds}`` (the first
    process compiles and writes the cache; later ones load it -- the README states both times).

    A cold cache (no entry for the base module's first kernel) is filled by every process warming it
    at once, not by each of them: the torchrun ranks of a host and ``jobs - 1`` helpers each rank
    starts (``python -c``, this package's folder first on their path) each take the next warmer no
    other took (a claim file in one folder beside the cache, :func:`claim_and_warm`; registration
    order: a module's after those of the kernel modules it imports, so a composite kernel mostly
    finds its callees cached). Then this process runs every warmer, after waiting for a claimed
    one to finish (:data:`CLAIM_WAIT_S` at most, then a warning naming it), loading what the
    others wrote (compiling whatever they did not); the seconds returned are that last run's.
    ``jobs``: default ``CPMETA_WARM_JOBS`` (``cpmeta.envs.warm_jobs``: this process's CPUs over
    the host's torchrun ranks, at most 8); 1 starts no helper. Numba's compiler holds one lock per
    process, hence processes. docs/build.md gives the measured times (an empty cache: 36-41 s
    on the 2-core VM with its default of 2, 18.1 s on an H100 host's 16 cores with 8)."""
    for mod in kernel_modules():
        importlib.import_module(mod)
    base = "cpmeta.base_njit._warm"
    cold = _cache_is_cold(importlib.import_module("cpmeta.base_njit").fail)
    claims = _claims_folder(cold)
    t0 = time.perf_counter()
    _WARMERS[base]()
    took = {base: time.perf_counter() - t0}
    if jobs is None:
        from .envs import warm_jobs

        jobs = warm_jobs()
    rest = [n for n in warmers() if n != base]
    if claims is not None:
        code = (f"import sys; sys.path.insert(0, {os.path.dirname(_HERE)!r}); import cpmeta.jit as j; "
                f"j.claim_and_warm({rest!r}, {claims!r})")
        helpers: list[subprocess.Popen[bytes]] = []
        try:  # a helper that cannot start or dies leaves its warmers to this process's last pass
            helpers += [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL)
                        for _ in range(jobs - 1 if cold else 0)]
        except OSError:
            pass
        try:
            claim_and_warm(rest, claims)
        except BaseException:
            for h in helpers:
                h.kill()
            raise
        finally:
            for h in helpers:
                h.wait()
    deadline = time.monotonic() + CLAIM_WAIT_S
    for name in rest:
        while claims is not None and (pid := _claimant(os.path.join(claims, name))) is not None:
            if time.monotonic() > deadline:  # a stuck claimant: compile it here, and say so
                logger.warning("cpmeta.jit.warm_all: %s, claimed by pid %d, unfinished after %d s; compiling it "
                               "here", name, pid, CLAIM_WAIT_S)
                break
            time.sleep(0.02)
        t0 = time.perf_counter()
        _WARMERS[name]()
        took[name] = time.perf_counter() - t0
    return took


def _cache_is_cold(kernel: Any) -> bool:
    """Whether numba's cache has no entry for ``kernel``, read from its index before this
    process compiles anything (the pool exists before its cache entries do, so a rank loading
    them finds it). The index is numba's private API: a numba that moved it reads as a warm
    cache (no pool; every process compiles what it lacks itself, as with ``jobs=1``)."""
    try:
        return not kernel._cache._cache_file._load_index()
    except Exception as e:  # noqa: BLE001 -- any change of numba's internals means "unknown"
        logger.debug("cpmeta.jit: numba's cache index unreadable (%r); warming without a pool", e)
        return False


def claim_and_warm(names: list[str], claims: str) -> None:
    """Run each warmer of ``names`` (in order) that no other process of :func:`warm_all` claimed
    first: a claim is a file created exclusively in the folder ``claims`` holding the claimer's
    pid; ``<claim>.done`` follows once the warmer returned."""
    for mod in kernel_modules():
        importlib.import_module(mod)
    for name in names:
        path = os.path.join(claims, name)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            continue
        except OSError:  # the folder is gone (another warm-up found it stale): run it anyway
            _WARMERS[name]()
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        _WARMERS[name]()
        try:
            os.close(os.open(path + ".done", os.O_CREAT | os.O_WRONLY))
        except OSError:  # the folder is gone: no one waits on it
            pass


def _claims_folder(cold: bool) -> Optional[str]:
    """The folder where the warm-ups of this cache share out the warmers: beside the base module's
    cache entries, named by the kernels' sources stamp, numba and Python. A warm cache uses the one
    that exists (other ranks may still be filling it), else none; a cold one makes it anew where
    no process that made or claimed in it lives (left by a finished or killed warm-up: the cache
    was lost since), and removes such dead ones of other stamps. ``None`` where none can be made."""
    mod = importlib.import_module("cpmeta.base_njit")
    locator = (_KernelSourcesLocator.from_function(mod.fail.py_func, mod.fail.py_func.__code__.co_filename)
               if STAMPED else None)
    key = hashlib.sha256(f"{sources_stamp()} {numba.__version__} {sys.version}".encode()).hexdigest()[:16]
    parent = locator.get_cache_path() if locator is not None else tempfile.gettempdir()
    folder = os.path.join(parent, f"cpmeta-warm-{key}")
    if not cold:
        return folder if os.path.isdir(folder) else None
    try:
        for name in os.listdir(parent):
            old = os.path.join(parent, name)
            if re.fullmatch("cpmeta-warm-[0-9a-f]{16}", name) and not _filling(old):
                gone = f"{old}.gone-{os.getpid()}"
                os.rename(old, gone)  # atomic: a warm-up beside this one cannot lose a fresh folder to it
                shutil.rmtree(gone, ignore_errors=True)
    except OSError:
        pass
    try:
        made = tempfile.mkdtemp(prefix="cpmeta-warm-new-", dir=parent)
        with open(os.path.join(made, "owner"), "w") as f:
            f.write(str(os.getpid()))
        try:
            os.rename(made, folder)
        except OSError:  # another rank made it first: use theirs
            shutil.rmtree(made, ignore_errors=True)
    except OSError:
        return None
    return folder if os.path.isdir(folder) else None


def _filling(folder: str) -> bool:
    """Whether the process that made ``folder`` or one with a warmer claimed in it lives."""
    names = os.listdir(folder)
    return any(_claimant(os.path.join(folder, n)) is not None for n in names if not n.endswith(".done"))


def _claimant(claim: str) -> Optional[int]:
    """The pid in ``claim`` while that process lives and ``<claim>.done`` does not exist, else
    None. Example: a missing ``claim`` -> None; an empty one (its pid being written) -> 0."""
    pid = 0  # unknown: a claim this user may not read (another user's, alive)
    try:
        with open(claim) as f:
            text = f.read()
        pid = int(text or 0)
        if pid:
            os.kill(pid, 0)
    except PermissionError:  # alive, another user's
        pass
    except (OSError, ValueError):  # no claim, a garbled one, or its process is gone
        return None
    return None if os.path.exists(claim + ".done") else pid
