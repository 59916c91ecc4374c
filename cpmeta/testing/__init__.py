"""Multi-rank equivalence tests in a few lines: spawn real ranks, check that every rank holds
what the driver built (as ``torch.testing`` is for tensors).

A complete test module (``test_equivalence.py``; run it with ``python -m pytest -q``)::

    import cpmeta
    from cpmeta import MetadataConfig, SequenceMetadata
    from cpmeta.testing import assert_same_on_ranks, run_ranks


    def _step(rank: int, world_size: int, seqlen: int) -> int:  # module level: spawn imports it
        md = None
        if rank == 0:  # the driver builds the step's metadata
            seqs = [SequenceMetadata(seqlen_q=seqlen, seqlen_k=seqlen, block_table=[7, 3],
                                     state_id=0, token_ids=list(range(seqlen)))]
            md = cpmeta.prepare_prompt(seqs, MetadataConfig())
        with cpmeta.MetadataBroadcaster(src=0) as bc:  # collective: every rank constructs it
            md = bc.broadcast(md)
        assert_same_on_ranks(md, src=0)  # every field of every rank == rank 0's, bit for bit
        return int(md.positions[-1])


    def test_every_rank_holds_the_drivers_metadata() -> None:
        assert run_ranks(_step, 3, 20) == [19, 19, 19]

When a rank holds something else, every rank raises the same ``AssertionError`` and
``run_ranks`` raises :class:`RankFailure` with it, e.g.
``rank 2: 'positions' differs from rank 0's: 1 of 20 elements, first at index (4,): 9 here,
4 on rank 0``.

:func:`run_ranks` starts ``world_size`` processes -- forks of one server process that imported torch
and cpmeta and loaded (on a cold numba cache: compiled) every kernel once (``forkserver``: ~0.1 s a
rank, where a fresh interpreter importing torch takes ~1.5 s on 2 cores), or fresh interpreters
(``spawn``: with ``child_setup``, or ``CPMETA_TEST_START=spawn``); either way the function must be
importable, i.e. defined at module level, and its arguments and result picklable -- gives each
``MASTER_ADDR``/``MASTER_PORT`` (a free port), ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``OMP_NUM_THREADS=1`` and ``CPMETA_TEST_SEED`` (plus ``env`` and
``rank_env[rank]``) on top of the test process's environment of the moment (a spawned rank before
its first instruction; a forked one takes it over before anything else runs, so only what torch
reads while it is imported comes from the server, which starts with ``OMP_NUM_THREADS=1``; cpmeta
reads nothing at import), seeds ``random`` and torch with ONE seed on every rank (printed to stderr;
``CPMETA_TEST_SEED=<seed>`` reproduces a run), initialises the process group (``gloo`` by default),
runs ``fn(rank, world_size, *args)`` and returns the per-rank results. ONE deadline (``timeout``
seconds, the start included) bounds the run; after the first failure the others get
:data:`FAIL_GRACE_S` seconds before they are killed; the :class:`RankFailure` carries every failing
rank's traceback under ``--- rank r FAILED ---``. Children exit on their own when the parent
disappears. :func:`spawn_ranks` returns the running :class:`RankGroup` instead (kill a rank, then
collect the others: fault-injection tests).

Already inside a process group (torchrun, an engine's own test harness)? Call
:func:`assert_same_on_ranks` there directly; ``group=`` picks a subgroup, ``src`` is a rank of it.
:func:`assert_same` is the same field-by-field check of two values in one process.

Two modules: ``ranks`` (spawning ranks, collecting their results; the only one that pickles, as
multiprocessing does) and ``compare`` (the field-by-field checks, over the group's collectives).
"""

from __future__ import annotations

from .compare import assert_same, assert_same_on_ranks
from .ranks import FAIL_GRACE_S, RankFailure, RankGroup, free_port, run_ranks, spawn_ranks

__all__ = ["run_ranks", "spawn_ranks", "RankGroup", "RankFailure", "free_port", "assert_same",
           "assert_same_on_ranks", "FAIL_GRACE_S"]
