"""``cpmeta.jit.warm_all()`` compiles what the step path runs: after it, real steps add no kernel
signature (a missing one is a compile of seconds at an engine's first steps, or a cache load the
warm-up did not pay)."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from cpmeta.testing import run_ranks


ROOT = Path(__file__).resolve().parents[1]


def kernel_dispatchers() -> list[Any]:
    """Every kernel of cpmeta (numba dispatchers defined in the kernel modules)."""
    import numba

    import cpmeta.jit as jit

    got = []
    for name in jit.kernel_modules():
        mod = importlib.import_module(name)
        got += [obj for obj in vars(mod).values()
                if isinstance(obj, numba.core.dispatcher.Dispatcher) and obj.py_func.__module__ == name]
    return got


def kernel_signatures() -> set[tuple[str, tuple[str, ...]]]:
    """``(kernel, its argument types)`` of every compiled kernel of cpmeta this process holds."""
    return {(f"{d.py_func.__module__}.{d.py_func.__name__}", tuple(map(str, sig))) for d in kernel_dispatchers()
            for sig in d.signatures}


# every strategy of the launch on both models: prompts (chunked), decode with drafts, the mirror,
# the driver's rebuild (--verify), the interleaved KV slot mapping of the plain model
COMMON = ["--workload", "mixed", "--steps", "12", "--cp-mirror", "--verify", "--decode-seqs", "16",
          "--prompt-seqs", "2", "--max-prompt", "300", "--attn-info"]
RUNS = [[*COMMON, "--strategy", strategy, "--model", model]
        for model in ("seed", "plain") for strategy in ("broadcast", "replicate", "replicate-defer")]
RUNS += [[*r, "--kv-interleave", "4"] for r in RUNS if "plain" in r]


def _named(new: list[tuple[str, tuple[str, ...]]], warm: set[tuple[str, tuple[str, ...]]]) -> list[str]:
    """Each new signature as the kernel and the arguments where it differs from a warm one."""
    import inspect

    lines = []
    for name, sig in new:
        mod, fn = name.rsplit(".", 1)
        params = list(inspect.signature(getattr(importlib.import_module(mod), fn).py_func).parameters)
        diffs = [[f"{p}: {w} -> {m}" for p, w, m in zip(params, ws, sig) if w != m]
                 for n, ws in warm if n == name]
        lines.append(f"{name}: " + ("; ".join(min(diffs, key=len)) if diffs else "no warm signature"))
    return lines


def _steps_after_warm(rank: int, world: int) -> list[str]:
    import cpmeta.jit as jit
    from cpmeta.launch.worker import build_parser, check_args, run_steps

    jit.warm_all()
    warm = kernel_signatures()
    for argv, checksum in [(r, "0") for r in RUNS] + [(r, "1") for r in RUNS[:3]]:
        os.environ["CPMETA_CHECKSUM"] = checksum  # checksummed frames: the crc kernels on them
        args = build_parser().parse_args(argv)
        assert check_args(args, world) is None
        run_steps(args, rank, world, torch.device("cpu"))
    return _named(sorted(kernel_signatures() - warm), warm)


def test_steps_after_warm_all_add_no_kernel_signature() -> None:
    driver, follower = run_ranks(_steps_after_warm, 2, timeout=600)
    assert (driver, follower) == ([], []), "kernel signatures warm_all() left out:\n" + "\n".join(
        f"rank {r}: {line}" for r, lines in enumerate((driver, follower)) for line in lines)


def _inplace_after_warm(rank: int, world: int) -> list[str]:
    """The in-place decode path on the CPU (its torch kernels): from a batch, and staged straight
    from a state with int32 and int64 drafts, on the launch's seed and plain models."""
    import numpy as np

    import cpmeta.jit as jit
    from cpmeta import BatchState
    from cpmeta.config import blocks_needed
    from cpmeta.gpu.decode_inplace import DecodeStaging, prepare_decode_inplace
    from cpmeta.gpu.decode_staging import stage_decode
    from cpmeta.launch.scheduler import default_config, plain_config

    jit.warm_all()
    warm = kernel_signatures()
    for cfg in (default_config(), plain_config()):
        st = BatchState(cfg, max_seqs=4)
        lens = [300 + 50 * i for i in range(3)]  # each sequence's seqlen_k at its decode step
        slots = np.array([st.add_request(i, list(range(1, n)), list(range(100 * i, 100 * i + blocks_needed(n, cfg))),
                                         i, num_computed=n - 1) for i, n in enumerate(lens)])
        prepare_decode_inplace(st.decode_batch(slots), cfg, device="cpu", backend="torch")
        staging = DecodeStaging("cpu", 8)
        for dtype in (np.int32, np.int64):
            stage_decode(staging, st, slots, np.array([5, 6, 7], dtype), 1)
    return _named(sorted(kernel_signatures() - warm), warm)


def test_inplace_steps_after_warm_all_add_no_kernel_signature() -> None:
    [got] = run_ranks(_inplace_after_warm, 1, timeout=300)
    assert got == [], "kernel signatures warm_all() left out:\n" + "\n".join(got)


def test_warm_all_waits_for_claimed_warmers_and_names_a_stuck_one(tmp_path: Path, monkeypatch: Any,
                                                                   caplog: Any) -> None:
    """The last pass waits for a warmer a live process claimed until its ``.done`` appears; one
    finished, or claimed by a process gone, is not waited for; a claimant still at it after
    ``CLAIM_WAIT_S`` is named in a warning and the warmer runs here."""
    import threading

    import cpmeta.jit as jit

    jit.warm_all(jobs=1)  # every kernel module imported, every warmer registered
    done, dead, waited, stuck = [n for n in jit.warmers() if n != "cpmeta.base_njit._warm"][:4]
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    for name, pid in ((done, os.getpid()), (dead, gone.pid), (waited, os.getpid()), (stuck, os.getpid())):
        (tmp_path / name).write_text(str(pid))
    (tmp_path / f"{done}.done").touch()
    monkeypatch.setattr(jit, "_claims_folder", lambda cold: str(tmp_path))
    monkeypatch.setattr(jit, "CLAIM_WAIT_S", 5)
    finish = threading.Timer(0.5, (tmp_path / f"{waited}.done").touch)
    finish.start()
    with caplog.at_level("WARNING", logger="cpmeta.jit"):
        jit.warm_all(jobs=1)
    finish.join()
    said = [r.getMessage() for r in caplog.records]
    assert said == [f"cpmeta.jit.warm_all: {stuck}, claimed by pid {os.getpid()}, unfinished after 5 s; compiling "
                    "it here"], said


def test_a_claim_this_user_cannot_read_counts_as_live_until_done(tmp_path: Path, monkeypatch: Any) -> None:
    """Another user's claim (unreadable here): its claimant is taken as alive, pid unknown (0)."""
    import builtins

    import cpmeta.jit as jit

    claim, real_open = tmp_path / "cpmeta.x._warm", builtins.open

    def guarded(path: Any, *args: Any, **kw: Any) -> Any:
        if str(path) == str(claim):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kw)

    claim.write_text("1")
    monkeypatch.setattr(builtins, "open", guarded)
    assert jit._claimant(str(claim)) == 0
    (tmp_path / "cpmeta.x._warm.done").touch()
    assert jit._claimant(str(claim)) is None


def test_a_numba_without_the_cache_index_warms_without_a_pool(monkeypatch: Any) -> None:
    """The cache's coldness is read from numba's private index; where a numba release moved it,
    the cache reads as warm (no claims folder, no helper) and ``warm_all`` still runs every
    warmer."""
    import cpmeta.base_njit as base
    import cpmeta.jit as jit

    assert jit._cache_is_cold(base.fail) is False  # this run's cache holds the kernels already

    class Moved:  # a dispatcher as a numba without ``_cache._cache_file`` would have
        _cache = object()

    assert jit._cache_is_cold(Moved()) is False
    folders: list[bool] = []
    monkeypatch.setattr(jit, "_cache_is_cold", lambda kernel: False)
    monkeypatch.setattr(jit, "_claims_folder", lambda cold: folders.append(cold))
    took = jit.warm_all(jobs=4)
    assert folders == [False] and set(took) == set(jit.warmers())


def test_a_numba_without_the_private_locators_still_imports_and_runs_kernels(tmp_path: Path) -> None:
    """cpmeta stamps its kernels' cache entries through numba's private locator list; a numba
    release that moved it must not break ``import cpmeta``: a warning names the numba and the
    kernels compile and cache on numba's own stamps (a fresh cache: the shared one keeps its
    stamps). One small kernel compiles in the child."""
    import cpmeta.jit as jit
    from numba.core import caching

    assert jit.STAMPED and caching.CacheImpl._locator_classes[0] is jit._KernelSourcesLocator
    code = ("import zlib, numpy as np; from numba.core import caching; del caching._CacheLocator; "
            "import cpmeta.jit as j, cpmeta.base_njit as b; assert not j.STAMPED; "
            "x = np.frombuffer(b'cpmeta', np.uint8); "
            "assert b.crc32(x, 0, 6, 0) == zlib.crc32(b'cpmeta'), b.crc32(x, 0, 6, 0); "
            "assert not any(c.__name__ == '_KernelSourcesLocator' for c in caching.CacheImpl._locator_classes); "
            "print(sorted(p.suffix for p in __import__('pathlib').Path(%r).rglob('*crc32*')))" % str(tmp_path))
    run = subprocess.run([sys.executable, "-c", code], env={**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)},
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert f"numba {__import__('numba').__version__} moved the private cache locators" in run.stderr
    assert run.stdout.split() == ["['.nbc',", "'.nbi']"], run.stdout


@pytest.mark.long
def test_ranks_warming_a_cold_cache_share_it_out_and_leave_it_whole(tmp_path: Path) -> None:
    """Two ranks of a host call ``warm_all`` at once on an empty cache (one with a helper process,
    ``jobs=2``, one alone): every warmer is claimed once, both ranks took some, each claim is
    finished; once the cache is lost, a later cold warm-up starts a pool of its own rather than
    finding every warmer taken; a fresh process then loads every kernel and compiles none."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    ranks = [subprocess.Popen([sys.executable, "-c", f"import cpmeta.jit as j; j.warm_all(jobs={jobs})"], env=env,
                              cwd=ROOT) for jobs in (2, 1)]
    assert [r.wait(timeout=600) for r in ranks] == [0, 0]
    [claims] = tmp_path.rglob("cpmeta-warm-*")
    taken = {p.name: p.read_text() for p in claims.iterdir() if p.name != "owner" and p.suffix != ".done"}
    import cpmeta.jit as jit

    for mod in jit.kernel_modules():
        importlib.import_module(mod)
    assert sorted(taken) == sorted(n for n in jit.warmers() if n != "cpmeta.base_njit._warm")
    assert all((claims / f"{n}.done").exists() for n in taken)
    assert {str(r.pid) for r in ranks} <= set(taken.values()), "a rank took no warmer"
    # the cache lost, its finished pool left: a cold warm-up makes a new pool and shares it out
    for entry in [*tmp_path.rglob("*.nbi"), *tmp_path.rglob("*.nbc")]:
        entry.unlink()
    again = subprocess.Popen([sys.executable, "-c", "import cpmeta.jit as j; j.warm_all(jobs=2)"], env=env, cwd=ROOT)
    assert again.wait(timeout=600) == 0
    [claims] = tmp_path.rglob("cpmeta-warm-*")
    assert (claims / "owner").read_text() == str(again.pid)
    assert str(again.pid) in {p.read_text() for p in claims.iterdir() if p.suffix != ".done"}
    check = ("import cpmeta.jit as j; j.warm_all(jobs=1); import tests.test_warm as t; "
             "print(sum(1 for _ in t.kernel_signatures())); "
             "print([f'{d.py_func.__qualname__}{s}' for d in t.kernel_dispatchers() for s in d.stats.cache_misses])")
    out = subprocess.run([sys.executable, "-c", check], env=env, check=True, timeout=600, cwd=ROOT,
                         capture_output=True, text=True).stdout.splitlines()
    assert int(out[0]) > 50 and out[1] == "[]", out
