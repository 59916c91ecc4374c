"""Tests of the environment-variable parsers (transport.envs) and the registries that use them
(transport, cpmeta, launch): every value compared exactly, every bad value named in the error."""

from __future__ import annotations

import os
from typing import Any, Callable

import pytest

from cpmeta import envs as cpmeta_envs
from cpmeta.launch import envs as launch_envs
from cpmeta.transport import envs
from cpmeta.transport.envs import env_bool, env_choice, env_float, env_int, env_str

VAR = "CPMETA_TEST_ENV_VALUE"
CHOICES = ("auto", "packed", "collective")

# (parser, value set or None = unset, expected result)
GOOD: list[tuple[str, Callable[[], Any], Any, Any]] = [
    ("bool unset", lambda: env_bool(VAR, True), None, True),
    ("bool blank", lambda: env_bool(VAR, True), "  ", True),
    ("bool yes", lambda: env_bool(VAR, False), " Yes ", True),
    ("bool off", lambda: env_bool(VAR, True), "OFF", False),
    ("bool 0", lambda: env_bool(VAR, True), "0", False),
    ("int unset", lambda: env_int(VAR, 7), None, 7),
    ("int value", lambda: env_int(VAR, 7, minimum=0), " 0 ", 0),
    ("int negative", lambda: env_int(VAR, 7), "-3", -3),
    ("float value", lambda: env_float(VAR, 1.5, positive=True), "0.25", 0.25),
    ("float minimum", lambda: env_float(VAR, 1.5, minimum=0.0), "0", 0.0),
    ("choice unset", lambda: env_choice(VAR, "auto", CHOICES), None, "auto"),
    ("choice case", lambda: env_choice(VAR, "auto", CHOICES), "Packed", "packed"),
    ("str unset", lambda: env_str(VAR, "d"), None, "d"),
    ("str kept as set", lambda: env_str(VAR, "d"), " /tmp/x ", " /tmp/x "),
]

# (parser, bad value, exact error message)
BAD: list[tuple[str, Callable[[], Any], str, str]] = [
    ("bool", lambda: env_bool(VAR, False), "maybe", f"{VAR}: expected 0/1/true/false, got 'maybe'"),
    ("int text", lambda: env_int(VAR, 1), "1.5", f"{VAR}: expected an int, got '1.5'"),
    ("int minimum", lambda: env_int(VAR, 1, minimum=1), "0", f"{VAR}: expected an int >= 1, got '0'"),
    ("float text", lambda: env_float(VAR, 1.0, positive=True), "soon",
     f"{VAR}: expected a float > 0, got 'soon'"),
    ("float zero", lambda: env_float(VAR, 1.0, positive=True), "0", f"{VAR}: expected a float > 0, got '0'"),
    ("float minimum", lambda: env_float(VAR, 1.0, minimum=0.0), "-1",
     f"{VAR}: expected a float >= 0, got '-1'"),
    ("choice", lambda: env_choice(VAR, "auto", CHOICES), "nccl",
     f"{VAR}: expected one of ('auto', 'packed', 'collective'), got 'nccl'"),
]


@pytest.mark.parametrize("name,parse,value,expected", GOOD, ids=[c[0] for c in GOOD])
def test_parsers(monkeypatch: pytest.MonkeyPatch, name: str, parse: Callable[[], Any],
                 value: Any, expected: Any) -> None:
    if value is None:
        monkeypatch.delenv(VAR, raising=False)
    else:
        monkeypatch.setenv(VAR, value)
    got = parse()
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize("name,parse,value,message", BAD, ids=[c[0] for c in BAD])
def test_parser_errors(monkeypatch: pytest.MonkeyPatch, name: str, parse: Callable[[], Any],
                       value: str, message: str) -> None:
    monkeypatch.setenv(VAR, value)
    with pytest.raises(ValueError) as info:
        parse()
    assert str(info.value) == message


def test_registry_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (envs.FORCE_REMOTE, envs.TRANSPORT_TIMEOUT, envs.SHM_SLOT_SIZE, envs.SHM_NUM_SLOTS,
                 envs.SHM_SPIN_US, envs.MAX_MESSAGE_BYTES, cpmeta_envs.TENSOR_PATH,
                 cpmeta_envs.PACKED_MAX_BYTES, cpmeta_envs.CHECKSUM, "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                 "TORCHELASTIC_ERROR_FILE"):
        monkeypatch.delenv(name, raising=False)
    assert (envs.force_remote(), envs.transport_timeout(), envs.shm_slot_size(), envs.shm_num_slots(),
            envs.shm_spin_us(), envs.max_message_bytes()) == (False, 300.0, 65536, 64, None, 1 << 30)
    assert (cpmeta_envs.tensor_path(), cpmeta_envs.packed_max_bytes(), cpmeta_envs.checksum()) == \
        ("auto", 1 << 20, False)
    assert (launch_envs.local_rank(), launch_envs.local_world_size(), launch_envs.error_file()) == (0, 1, "")


def test_registry_errors_name_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    cases = [(cpmeta_envs.TENSOR_PATH, cpmeta_envs.tensor_path, "fast"),
             (cpmeta_envs.PACKED_MAX_BYTES, cpmeta_envs.packed_max_bytes, "-1"),
             (cpmeta_envs.CHECKSUM, cpmeta_envs.checksum, "2"),
             (envs.SHM_SPIN_US, envs.shm_spin_us, "-5"),
             ("LOCAL_RANK", launch_envs.local_rank, "x"),
             ("LOCAL_WORLD_SIZE", launch_envs.local_world_size, "0")]
    for name, fn, bad in cases:
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=f"^{name}: expected .*, got '{bad}'$"):
            fn()


def test_warm_jobs_share_the_cpus_among_the_hosts_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    cpus = len(os.sched_getaffinity(0))
    monkeypatch.delenv(cpmeta_envs.WARM_JOBS, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert cpmeta_envs.warm_jobs() == max(1, min(8, cpus))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cpus + 1))  # more ranks than CPUs: each compiles alone
    assert cpmeta_envs.warm_jobs() == 1
    monkeypatch.setenv(cpmeta_envs.WARM_JOBS, "3")
    assert cpmeta_envs.warm_jobs() == 3
    monkeypatch.setenv(cpmeta_envs.WARM_JOBS, "0")
    with pytest.raises(ValueError, match=r"^CPMETA_WARM_JOBS: expected an int >= 1, got '0'$"):
        cpmeta_envs.warm_jobs()
