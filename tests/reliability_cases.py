"""Checksummed random metadata and process probes for the reliability tests and ``scripts/soak.py``.

A payload is an ``InputMetadata`` whose fields hold random data (the broadcaster does not look at
meanings, only at paths, dtypes and shapes) plus two carriers that make every message
self-checking:

- ``num_seqs`` = the step number (a lost or duplicated message shows up as a wrong step);
- ``total_k_compressed`` = ``{path key: crc32}`` over EVERY tensor path of the message (dtype,
  shape and bytes), so a missing, extra, truncated or corrupted field is caught without
  regenerating the payload. The key of a path is a ratio-like decimal string (``str(crc32(path)
  + 1)``), the only key type the broadcast schema allows in a dict field.

Sizes are drawn per step from four classes relative to ``ring_bytes`` (the shared-memory ring of
the test): tiny (< 1 KiB), small (1-16 KiB), ring-sized (up to the ring) and larger than the ring
(1x-3x, streamed slot by slot). Every rank can regenerate step ``i`` from ``(seed, i)`` with
:func:`make_payload` for an exact comparison.

Example (one process)::

    md = make_payload(seed=7, step=3, ring_bytes=65536)
    assert verify_payload(md, step=3) > 0      # bytes checked
"""

from __future__ import annotations

import os
import random
import zlib
from typing import Any, Optional

import torch

from cpmeta.metadata import InputMetadata
from cpmeta.transport._segment import SEGMENT_PREFIX, is_segment_path

__all__ = [
    "CHECKSUM_FIELD",
    "STEP_FIELD",
    "SIZE_CLASSES",
    "make_payload",
    "verify_payload",
    "payload_equal",
    "field_checksum",
    "path_key",
    "rss_bytes",
    "project_shm_entries",
    "project_fds",
    "project_mappings",
    "maps_path",
]

STEP_FIELD = "num_seqs"  # int carrier of the step number
CHECKSUM_FIELD = "total_k_compressed"  # dict[str, int] carrier of the per-path crc32 map
# (name, probability, low bytes, high bytes as a multiple of ring_bytes or absolute)
SIZE_CLASSES = (("tiny", 0.40), ("small", 0.35), ("ring", 0.17), ("over_ring", 0.08))
_ROW_FIELDS = ("positions", "input_ids", "slot_mapping_store_swa", "query_indices", "context_lens")
_DICT_FIELDS = ("klen", "kv_ca_index_len", "positions_c", "slot_mapping_store_ca")
_INT32_MAX = 2**31 - 1


def field_checksum(t: torch.Tensor) -> int:
    """crc32 of ``t``'s dtype, shape and bytes (a contiguous CPU copy is hashed).

    Example: two tensors with the same bytes but shapes [4] and [2, 2] differ.
    """
    c = t.detach().cpu().contiguous()
    head = f"{c.dtype}|{tuple(c.shape)}".encode()
    data = c.view(torch.uint8).numpy() if c.numel() else b""
    return zlib.crc32(data, zlib.crc32(head))


def _target_bytes(rng: random.Random, ring_bytes: int) -> int:
    r, acc = rng.random(), 0.0
    for name, p in SIZE_CLASSES:
        acc += p
        if r < acc:
            break
    if name == "tiny":
        return rng.randint(0, 1024)
    if name == "small":
        return rng.randint(1024, 16 * 1024)
    if name == "ring":
        return rng.randint(16 * 1024, max(16 * 1024, ring_bytes))
    return rng.randint(ring_bytes + 1, 3 * ring_bytes)


def _rand(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen, dtype=torch.int8).bool()
    if dtype == torch.float32:
        return torch.randn(shape, generator=gen)
    return torch.randint(-1, _INT32_MAX, shape, generator=gen, dtype=dtype)


def make_payload(seed: int, step: int, ring_bytes: int = 64 * 1024) -> InputMetadata:
    """Random checksummed metadata for ``step`` (deterministic in ``(seed, step)``).

    Total tensor bytes follow :data:`SIZE_CLASSES`; the rows ``q`` of the per-row fields are
    ``target // 4 // (number of row fields)``. Example: target 40 KiB with 5 int32 row fields
    gives ``q = 2048`` rows per field. Aliasing (``positions_cp is positions``) and empty dicts
    (``ks == {}``) appear on some steps.
    """
    rng = random.Random(seed * 1_000_003 + step)
    gen = torch.Generator().manual_seed(rng.randrange(2**62))
    target = _target_bytes(rng, ring_bytes)
    rows = rng.sample(_ROW_FIELDS, rng.randint(1, len(_ROW_FIELDS)))
    dicts = rng.sample(_DICT_FIELDS, rng.randint(0, 2))
    n_parts = len(rows) + 2 * len(dicts) + 1
    q = max(0, target // 4 // n_parts)
    kw: dict[str, Any] = {name: _rand(gen, (q,), torch.int32) for name in rows}
    for name in dicts:
        kw[name] = {str(r): _rand(gen, (q,), torch.int32) for r in rng.sample((1, 4, 16, 128), 2)}
    kw["valid_token_mask"] = _rand(gen, (q,), torch.bool)
    w = rng.choice((1, 4))
    kw["block_tables"] = _rand(gen, (q // w, w), torch.int32)
    if rng.random() < 0.3:
        kw["mirror_cp_index"] = _rand(gen, (rng.randint(0, 64),), torch.float32).view(torch.int32)
    if "positions" in kw and rng.random() < 0.3:
        kw["positions_cp"] = kw["positions"]  # aliasing: sent once, re-created on the receiver
    if rng.random() < 0.3:
        kw["ks"] = {}
    kw.update(is_prompt=rng.random() < 0.5, total_q=q, max_seqlen_q=rng.randint(0, 1 << 20))
    md = InputMetadata(**kw)
    md.num_seqs = step
    md.total_k_compressed = _checksums(md)
    return md


def _checksums(md: InputMetadata) -> dict[str, int]:
    return {path_key(path): field_checksum(v)
            for path, v in md.to_flatten_dict().items() if isinstance(v, torch.Tensor)}


def path_key(path: str) -> str:
    """The checksum map's key of a tensor path: a positive decimal string (a valid ratio key).

    Example: ``path_key("klen.4") == str(zlib.crc32(b"klen.4") + 1)``.
    """
    return str(zlib.crc32(path.encode()) + 1)


def verify_payload(md: InputMetadata, step: int) -> int:
    """Raise ``AssertionError`` unless ``md`` is step ``step`` with every checksum matching;
    return the number of tensor bytes checked."""
    got_step = getattr(md, STEP_FIELD)
    assert got_step == step, f"expected step {step}, received step {got_step} (lost or duplicated)"
    want = getattr(md, CHECKSUM_FIELD)
    assert isinstance(want, dict), f"step {step}: checksum map missing ({want!r})"
    have = _checksums(md)
    names = {path_key(p): p for p in md.to_flatten_dict()}  # key -> path, for the messages
    diff = sorted(names.get(k, k) for k in set(have) ^ set(want))
    assert set(have) == set(want), f"step {step}: paths differ: {diff}"
    bad = [names[p] for p in want if have[p] != want[p]]
    assert not bad, f"step {step}: checksum mismatch in {bad}"
    return sum(v.numel() * v.element_size() for v in md.to_flatten_dict().values()
               if isinstance(v, torch.Tensor))


def payload_equal(a: InputMetadata, b: InputMetadata) -> Optional[str]:
    """None when every path of ``a`` and ``b`` holds an identical value (tensors: dtype, shape,
    bytes via ``torch.equal`` on the raw bytes, so NaN patterns compare too), else the first path."""
    fa, fb = a.to_flatten_dict(), b.to_flatten_dict()
    if fa.keys() != fb.keys():
        return f"paths {sorted(fa.keys() ^ fb.keys())}"
    for p, x in fa.items():
        y = fb[p]
        if isinstance(x, torch.Tensor):
            if not isinstance(y, torch.Tensor) or x.dtype != y.dtype or x.shape != y.shape or \
                    not torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)):
                return p
        elif x != y or type(x) is not type(y):
            return p
    if (a.positions_cp is a.positions) != (b.positions_cp is b.positions):
        return "positions_cp aliasing"
    return None


# ----------------------------------------------------------------------------- process probes

def rss_bytes(pid: Optional[int] = None) -> int:
    """Resident set size of ``pid`` (default: this process) from /proc/<pid>/statm."""
    with open(f"/proc/{pid or 'self'}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def project_shm_entries() -> set[str]:
    """Names in /dev/shm this project could create (``SEGMENT_PREFIX``). Other processes on the
    machine create unrelated entries concurrently, so only the prefix is compared."""
    if not os.path.isdir("/dev/shm"):
        return set()
    return {n for n in os.listdir("/dev/shm") if n.startswith(SEGMENT_PREFIX)}


def project_fds(pid: Optional[int] = None) -> list[str]:
    """Open descriptors of ``pid`` that point at a project segment (memfd or /dev/shm file),
    matched exactly by ``is_segment_path`` (never a substring of a path)."""
    base = f"/proc/{pid or 'self'}/fd"
    out = []
    for fd in os.listdir(base):
        try:
            target = os.readlink(f"{base}/{fd}")
        except OSError:
            continue
        if is_segment_path(target):
            out.append(target)
    return out


def maps_path(line: str) -> str:
    """The path column of one ``/proc/<pid>/maps`` line ('' for an anonymous mapping).

    Example: ``7f..-7f.. rw-s 00000000 00:01 42   /memfd:cpmeta-ring (deleted)`` ->
    ``/memfd:cpmeta-ring (deleted)`` (the path may hold spaces: split at most 5 times).
    """
    fields = line.rstrip("\n").split(maxsplit=5)
    return fields[5] if len(fields) == 6 else ""


def project_mappings(pid: Optional[int] = None, lines: Optional[list[str]] = None) -> list[str]:
    """Lines of /proc/<pid>/maps (or the given ``lines``) that map a project segment (a ring not
    unmapped). Exact: the venv of a clone in a directory named ``cpmeta`` does not count."""
    if lines is None:
        with open(f"/proc/{pid or 'self'}/maps") as f:
            lines = f.readlines()
    return [line.strip() for line in lines if is_segment_path(maps_path(line))]


# ----------------------------------------------------------------------------- soak (one rank)

SOAK_WARMUP_STEPS = 200  # RSS is measured from here on (allocator arenas settle first)
SOAK_RSS_SAMPLES = 10  # RSS samples over the run (start .. end)


def soak_rank(rank: int, world: int, seed: int, steps: int, ring_bytes: int, check_every: int,
              timeout: float = 120.0, force_remote: bool = False) -> dict:
    """One rank of a soak: ``steps`` broadcasts of :func:`make_payload` from rank 0.

    Every follower checks the step number and every field's crc32 of every message, and every
    ``check_every``-th message field by field against a local regeneration (exact bytes).
    Mismatches are counted (the first few kept), not raised, so one run reports them all.
    Returns plain numbers: ``mismatches``, ``bytes``, ``seconds``, ``rss`` samples (bytes, the
    first after :data:`SOAK_WARMUP_STEPS`), ``fds`` (open file descriptors, sampled with ``rss``:
    a ring, socket or eventfd opened per message shows as growth), ``rss_peak`` (VmHWM),
    ``over_ring`` (messages larger than ``ring_bytes``) and the smallest / largest message.
    """
    import time

    import cpmeta

    sample_at = {SOAK_WARMUP_STEPS + i * max(1, (steps - 1 - SOAK_WARMUP_STEPS)) // (SOAK_RSS_SAMPLES - 1)
                 for i in range(SOAK_RSS_SAMPLES)} if steps > SOAK_WARMUP_STEPS else {0, steps - 1}
    out: dict = {"rank": rank, "mismatches": 0, "errors": [], "bytes": 0, "over_ring": 0,
                 "min_bytes": None, "max_bytes": 0, "rss": [], "fds": [], "exact_checks": 0}
    with cpmeta.MetadataBroadcaster(src=0, timeout=timeout, force_remote=force_remote) as bc:
        out["rss_construct"] = rss_bytes()
        t0 = time.perf_counter()
        for step in range(steps):
            md = make_payload(seed, step, ring_bytes) if rank == 0 else None
            got = bc.broadcast(md)
            try:
                n = verify_payload(got, step)
                if rank != 0 and step % check_every == 0:
                    bad = payload_equal(make_payload(seed, step, ring_bytes), got)
                    out["exact_checks"] += 1
                    assert bad is None, f"step {step}: {bad} differs from the regenerated payload"
            except AssertionError as e:
                out["mismatches"] += 1
                if len(out["errors"]) < 5:
                    out["errors"].append(str(e)[:300])
                continue
            out["bytes"] += n
            out["over_ring"] += n > ring_bytes
            out["min_bytes"] = n if out["min_bytes"] is None else min(out["min_bytes"], n)
            out["max_bytes"] = max(out["max_bytes"], n)
            del got, md
            if step in sample_at:
                out["rss"].append(rss_bytes())
                out["fds"].append(open_fds())
        out["seconds"] = time.perf_counter() - t0
    out["rss_peak"] = max(_vm_hwm(), *out["rss"])  # VmHWM is updated lazily by the kernel
    out["steps"] = steps
    return out


def open_fds() -> int:
    """This process's open file descriptors (entries of /proc/self/fd)."""
    return len(os.listdir("/proc/self/fd"))


def _vm_hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0
