"""The defaults the docs state, compared with the documented values (not the code's constants)."""

from __future__ import annotations

from pathlib import Path

import ckstore
from ckstore.catalog._engine import PG_CONNECT_DEFAULTS

MiB = 1024 * 1024


def test_a_new_store_has_the_documented_settings(tmp_path: Path) -> None:
    s = ckstore.open(tmp_path / "s")
    # docs/benchmarks.md: "The default chunk size, 4 MiB"; docs/backends.md: "4 × 64 MiB with the
    # default pack size"
    assert (s.config.chunk_size, s.config.pack_size) == (4 * MiB, 64 * MiB)
    s.close()
    again = ckstore.open(tmp_path / "s")  # recorded, so every later open agrees
    assert (again.config.chunk_size, again.config.pack_size) == (4 * MiB, 64 * MiB)


def test_postgres_connections_have_the_documented_connect_timeout() -> None:
    # docs/backends.md: "Connections start from PG_CONNECT_DEFAULTS (connect timeout 10 s, TCP
    # keepalives ...)"
    assert PG_CONNECT_DEFAULTS["connect_timeout"] == 10 and PG_CONNECT_DEFAULTS["keepalives"] == 1


def test_the_default_threads_are_twice_the_cores_or_twice_a_rank_share_of_shared_cores() -> None:
    from ckstore._threads import _workers_for

    # one process: twice the cores it may run on, 4 to 16
    assert [_workers_for(c, c, {}) for c in (1, 2, 4, 8, 64)] == [4, 4, 8, 16, 16]
    assert _workers_for(4, 64, {}) == 8  # four CPUs of a larger machine (taskset, a cpuset)
    # several ranks sharing the machine's cores: twice each one's share, at least 2
    assert _workers_for(2, 2, {"LOCAL_WORLD_SIZE": "2"}) == 2  # torchrun
    assert _workers_for(2, 2, {"LOCAL_SIZE": "4"}) == 2  # DeepSpeed's launcher
    assert _workers_for(32, 32, {"OMPI_COMM_WORLD_LOCAL_SIZE": "8"}) == 8
    assert _workers_for(96, 96, {"MPI_LOCALNRANKS": "8"}) == 16
    assert _workers_for(32, 32, {"LOCAL_WORLD_SIZE": "1"}) == 16
    # each rank pinned to cores of its own: its cores are its own, not shared
    assert _workers_for(8, 64, {"LOCAL_WORLD_SIZE": "8"}) == 16
    assert _workers_for(2, 16, {"LOCAL_WORLD_SIZE": "8"}) == 4
    # the first variable that holds a positive integer counts; anything else is no answer
    assert _workers_for(2, 2, {"LOCAL_WORLD_SIZE": "x", "LOCAL_SIZE": "2"}) == 2
    for bad in ("", " ", "0", "-2", "2.0", "²", "二", "0x2"):
        assert _workers_for(2, 2, {"LOCAL_WORLD_SIZE": bad}) == 4, bad
    assert _workers_for(2, 2, {"LOCAL_WORLD_SIZE": " 2\n"}) == 2


def test_a_store_opened_under_a_launcher_of_several_local_ranks_takes_its_share_of_the_cores(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    from ckstore._threads import _LOCAL_PROCESSES_ENV, usable_cores

    cores = usable_cores()
    machine = os.cpu_count() or cores
    code = "import ckstore, sys; s = ckstore.open(sys.argv[1]); print(s.workers); s.close()"
    env = {k: v for k, v in os.environ.items() if k not in _LOCAL_PROCESSES_ENV}
    ranks = machine + 1  # more ranks than the machine has cores: they share them, whatever the affinity
    got = {}
    for local in (None, ranks):
        run_env = env if local is None else {**env, "LOCAL_WORLD_SIZE": str(local)}
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "s")], env=run_env, capture_output=True, text=True, check=True)
        got[local] = int(out.stdout)
    assert got[None] == max(4, min(16, 2 * cores))
    assert got[ranks] == 2
    explicit = ckstore.open(tmp_path / "s", workers=3)
    assert explicit.workers == 3  # said is said
    explicit.close()
