"""PostgreSQL catalogs: migrations, lock order, secrets, and a server that goes away mid-commit."""

from __future__ import annotations

import json
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import catalog_tools
import pytest
from click.testing import CliRunner
from conformance import assert_consistent, sample_states
from conformance.store import CHUNK, PACK
from helpers import assert_clean, assert_same
from pgproxy import PgProxy
from services import PrivatePostgres
from sqlalchemy import text

import ckstore
from ckstore.catalog import Catalog, NewChunk, Owner
from ckstore.cli import main
from ckstore.layout import WorldLayout

pytestmark = pytest.mark.postgres


def _open(location: Path | str, catalog: str, **kw: Any) -> ckstore.Store:
    return ckstore.open(location, catalog=catalog, run="exp", chunk_size=CHUNK, pack_size=PACK, **kw)


# -- migrations ---------------------------------------------------------------------------------
_DELTA_INDEX = text(
    "SELECT indexdef FROM pg_indexes WHERE indexname = 'ix_chunks_base' AND schemaname = current_schema()"
)


def test_a_fresh_catalog_has_the_partial_delta_index(tmp_path: Path, pg_catalog_url: str) -> None:
    """The models' delta index gets its PostgreSQL WHERE clause when a PostgreSQL catalog is
    opened (not when the schema module is imported: see ``postgresql_options``)."""
    with _open(tmp_path / "store", pg_catalog_url) as store, store.catalog.engine.connect() as conn:
        fresh = conn.execute(_DELTA_INDEX).scalar()
    assert fresh is not None and fresh.endswith("(base) WHERE (base IS NOT NULL)"), fresh


def test_migrations_build_exactly_the_models(tmp_path: Path, pg_catalog_url: str) -> None:
    """`ckstore db upgrade` runs every migration script on an empty PostgreSQL catalog, and
    what they build is exactly what the models describe."""
    ckstore.init(tmp_path / "store").close()  # any store, to point the command at
    runner = CliRunner()
    args = ["--store", str(tmp_path / "store"), "--catalog", pg_catalog_url, "db"]
    out = runner.invoke(main, [*args, "upgrade"])
    assert out.exit_code == 0, out.output
    bare = Catalog(pg_catalog_url, check=False)
    rev, head = bare.revisions()
    assert rev == head and f"upgraded from revision (none) to {head}" in out.output
    assert catalog_tools.schema_differences(bare) == []
    with bare.engine.connect() as conn:  # the delta index is partial, as the models' is (below)
        migrated = conn.execute(_DELTA_INDEX).scalar()
    bare.close()
    assert migrated is not None and migrated.endswith("(base) WHERE (base IS NOT NULL)"), migrated
    out = runner.invoke(main, [*args, "current"])
    assert f"catalog revision {head}" in out.output
    out = runner.invoke(main, [*args, "upgrade"])
    assert f"already at schema revision {head}" in out.output
    with _open(tmp_path / "other", pg_catalog_url) as store:  # a catalog built so serves a store
        store.commit(1, sample_states(1))
        assert_same(store.checkout(1), sample_states(1))


# -- lock order ---------------------------------------------------------------------------------
def test_overlapping_chunk_inserts_wait_instead_of_deadlocking(tmp_path: Path, pg_catalog_url: str) -> None:
    """Two transactions insert the same two chunks in opposite orders; ckstore inserts in digest
    order, so it waits for the other transaction instead of deadlocking with it."""
    store = _open(tmp_path / "store", pg_catalog_url)
    cat = store.catalog
    owner = Owner.me()
    ckpt = cat.begin_checkpoint(
        "exp", 1, kind="checkpoint", replace=False, owner=owner, world_layout=WorldLayout.flat(1), lease_seconds=60
    )
    pack = cat.register_pack(ckpt, owner, "packs/00/mine")
    other_pack = cat.register_pack(ckpt, owner, "packs/00/theirs")
    low, high = b"\x01" * 16, b"\xfe" * 16

    def row(d: bytes) -> dict[str, Any]:
        return {"digest": d, "pack_id": other_pack, "offset": 8, "length": 10, "raw_size": 10, "codec": 0}

    errors: list[BaseException] = []
    with catalog_tools.insert_chunk_meanwhile(cat, row(low)) as insert:  # the other writer, holding `low`

        def ours() -> None:
            try:
                cat.add_chunks(ckpt, owner, pack, 100, [NewChunk(high, 8, 10, 10, 0), NewChunk(low, 18, 10, 10, 0)])
            except BaseException as e:  # noqa: BLE001 - checked below
                errors.append(e)

        t = threading.Thread(target=ours)
        t.start()
        time.sleep(0.5)  # ours now waits on `low`, and (sorted) holds nothing the other needs
        insert(row(high))
    t.join(30)
    assert not t.is_alive() and errors == []
    assert set(cat.chunk_locations([low, high])) == {low, high}
    store.close()


# -- secrets ------------------------------------------------------------------------------------
def test_catalog_password_is_an_environment_reference(
    tmp_path: Path, pg_catalog_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = pg_catalog_url.replace("postgres@", "postgres:${CKSTORE_TEST_PGPASSWORD}@")
    with pytest.raises(ckstore.StoreConfigError, match="CKSTORE_TEST_PGPASSWORD, which is not set"):
        _open(tmp_path / "store", url)
    monkeypatch.setenv("CKSTORE_TEST_PGPASSWORD", "s3cr3t-value")
    with _open(tmp_path / "store", url) as store:
        store.commit(1, sample_states(1, ranks=1))
    recorded = json.loads((tmp_path / "store" / "ckstore.json").read_text())
    assert recorded["catalog"] == url
    assert "s3cr3t-value" not in (tmp_path / "store" / "ckstore.json").read_text()
    with ckstore.open(tmp_path / "store") as again:  # the recorded URL is enough
        assert again.resolve("exp@latest").step == 1
        assert "s3cr3t-value" not in repr(again.catalog)
    literal = pg_catalog_url.replace("postgres@", "postgres:hunter2@")
    with pytest.raises(ckstore.StoreConfigError, match="literal password"):
        ckstore.init(tmp_path / "other", catalog=literal)
    assert not (tmp_path / "other" / "ckstore.json").exists()


def test_a_catalog_belongs_to_one_store(tmp_path: Path, pg_catalog_url: str) -> None:
    with _open(tmp_path / "a", pg_catalog_url) as a:
        a.commit(1, sample_states(1, ranks=1))
    with pytest.raises(ckstore.StoreConfigError, match="another store"):
        ckstore.init(tmp_path / "b", catalog=pg_catalog_url)
    assert not (tmp_path / "b" / "ckstore.json").exists()


# -- a server that goes away --------------------------------------------------------------------
def test_unreachable_catalog_fails_fast(tmp_path: Path, private_postgres: PrivatePostgres) -> None:
    private_postgres.stop()
    t0 = time.monotonic()
    with pytest.raises(ckstore.CatalogError, match=f"cannot open catalog .*:{private_postgres.port}/"):
        _open(tmp_path / "store", private_postgres.url)
    assert time.monotonic() - t0 < 15


def test_server_stopped_during_a_commit(tmp_path: Path, private_postgres: PrivatePostgres) -> None:
    pg = private_postgres
    store = _open(tmp_path / "store", pg.url)
    store.commit(1, sample_states(1))

    def stop_once(_done: int, _total: int) -> None:
        if not stopped:
            stopped.append(True)
            pg.stop()

    stopped: list[bool] = []
    t0 = time.monotonic()
    with pytest.raises(ckstore.CatalogError, match="Retry once the catalog is reachable"):
        store.commit(2, sample_states(2), progress=stop_once)
    assert stopped and time.monotonic() - t0 < 30
    with pytest.raises(ckstore.CatalogError, match="retry once it is reachable"):
        store.checkpoints()
    pg.start()
    assert [c.step for c in store.checkpoints()] == [1]  # nothing of step 2 is visible
    assert [step for _, _, step, _, _ in store.catalog.pending()] == [2]  # its claim, left while down
    store.commit(2, sample_states(2))  # the retry takes the failed commit's claim over
    assert_same(store.checkout(1), sample_states(1))
    assert_same(store.checkout(2), sample_states(2))
    assert_consistent(store)
    store.close()


def test_server_restarted_inside_the_finishing_transaction(tmp_path: Path, private_postgres: PrivatePostgres) -> None:
    pg = private_postgres
    store = _open(tmp_path / "store", pg.url)
    store.commit(1, sample_states(1))
    fired: list[bool] = []

    def restart_before_publishing(statement: str) -> None:
        # entries, metrics and tags are written; the server goes down before the status flips
        if not fired and statement.lstrip().upper().startswith("UPDATE CHECKPOINTS SET STATUS"):
            fired.append(True)
            pg.stop()

    with catalog_tools.on_statement(store.catalog, restart_before_publishing), pytest.raises(ckstore.CatalogError):
        store.commit(2, sample_states(2), {"loss": 0.1}, tags=["two"])
    assert fired
    pg.start()
    assert [c.step for c in store.checkpoints()] == [1]
    with pytest.raises(ckstore.CheckpointNotFoundError):
        store.resolve("two")
    # the rolled-back transaction left no entries
    n = catalog_tools.scalar(
        store.catalog, "SELECT count(*) FROM entries e JOIN checkpoints c ON c.id = e.checkpoint_id WHERE c.step = 2"
    )
    assert n == 0
    store.commit(2, sample_states(2), {"loss": 0.1}, tags=["two"])
    assert store.resolve("two").metrics == {"loss": 0.1}
    assert_same(store.checkout("two"), sample_states(2))
    assert_consistent(store)
    store.close()


def test_server_restarted_between_requests_is_transparent(tmp_path: Path, private_postgres: PrivatePostgres) -> None:
    pg = private_postgres
    store = _open(tmp_path / "store", pg.url)
    store.commit(1, sample_states(1))
    restarted: list[bool] = []

    def restart_once(_done: int, _total: int) -> None:
        if not restarted:
            restarted.append(True)
            pg.restart()

    store.commit(2, sample_states(2), progress=restart_once)  # pooled connections are re-made
    assert restarted
    assert_same(store.checkout(2), sample_states(2))
    assert_consistent(store)
    store.close()


# -- a connection lost at a transaction's COMMIT --------------------------------------------------
# tests/pgproxy.py sits between the store and the server and cuts the connection that sends the
# COMMIT of one chosen transaction (named by a statement only it runs): before forwarding it (the
# server rolls the transaction back) or once the server has answered it (committed; the answer is
# withheld). Pooled connections stay up; the store opens new ones through the proxy afterwards.
PG_SECRET = "pg-secret-never-printed"


def _proxied(tmp_path: Path, pg_catalog_url: str, monkeypatch: pytest.MonkeyPatch) -> tuple[PgProxy, str]:
    """A store holding step 1 (made directly) and a proxy in front of its server; returns the
    proxy and the store's direct catalog URL (with a password, given as an environment reference)."""
    monkeypatch.setenv("CKSTORE_TEST_PGPASSWORD", PG_SECRET)
    direct = pg_catalog_url.replace("postgres@", "postgres:${CKSTORE_TEST_PGPASSWORD}@")
    with _open(tmp_path / "store", direct) as store:
        store.commit(1, sample_states(1))
    return PgProxy.in_front_of(pg_catalog_url), direct


@pytest.mark.parametrize("when", ["after", "before"])
def test_connection_lost_at_the_commit_that_makes_a_checkpoint_visible(
    tmp_path: Path, pg_catalog_url: str, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    """The connection drops at the COMMIT of the transaction that makes step 2 visible; the commit
    fails with a `CatalogError` naming the catalog, never its password, and saying the step may or
    may not have been committed. Cut after the server committed: step 2 is visible, and retrying
    the commit reports the step as committed already, changing nothing. Cut before: nothing of step 2 is visible and the
    retry commits it. Either way step 2 reads back bit-exact and gc + fsck find the store clean."""
    proxy, direct = _proxied(tmp_path, pg_catalog_url, monkeypatch)
    with proxy, _open(tmp_path / "store", proxy.url(direct)) as store, _open(tmp_path / "store", direct) as view:
        proxy.cut_commit("INSERT INTO entries", when)
        with pytest.raises(ckstore.CatalogError) as failed:
            store.commit(2, sample_states(2), {"loss": 0.5}, tags=["two"])
        # the cut landed on that transaction's COMMIT; the server answered it only when it got it
        cut = proxy.cut
        assert cut is not None and cut.when == when, cut
        assert any(s.startswith("INSERT INTO entries") for s in cut.statements), cut.statements
        assert any(s.startswith("UPDATE checkpoints SET status=") for s in cut.statements), cut.statements
        assert any(s.startswith("INSERT INTO chunks") for s in cut.statements), cut.statements  # chunk rows too
        assert cut.forwarded is (when == "after") and cut.server_committed is (when == "after"), cut
        # the client cannot tell the two cuts apart, and says so; the retry tells
        message = str(failed.value)
        assert message.startswith("step 2 of run 'exp' may or may not have been committed: "), message
        assert f"catalog postgresql+psycopg://postgres:***@127.0.0.1:{proxy.port}/" in message, message
        assert "Retry once the catalog is reachable" in message, message
        assert PG_SECRET not in "".join(traceback.format_exception(failed.value))
        assert view.catalog.pending() == []  # the failed commit cleaned up after itself
        # what the server holds, read through a connection of its own
        if when == "after":
            visible = view.resolve(2)
            assert (visible.metrics, visible.tags) == ({"loss": 0.5}, ("two",))
            before = len(proxy.forwarded)
            with pytest.raises(ckstore.AlreadyExistsError, match="run 'exp' already has a checkpoint at step 2"):
                store.commit(2, sample_states(2), {"loss": 0.5}, tags=["two"])  # the retry
            asked = proxy.forwarded[before:]
            # it asked the server (the step's rows), which answered that the step is taken: no pending row
            assert any("FROM checkpoints" in s for s in asked), asked
            assert not any(s.startswith("INSERT INTO checkpoints") for s in asked), asked
            assert view.resolve(2).id == visible.id  # and changed nothing
        else:
            assert [c.step for c in view.checkpoints()] == [1]
            with pytest.raises(ckstore.CheckpointNotFoundError):
                view.resolve("two")
            assert store.commit(2, sample_states(2), {"loss": 0.5}, tags=["two"]).step == 2  # the retry
            assert view.resolve("two").metrics == {"loss": 0.5}
        assert [c.step for c in view.checkpoints()] == [1, 2]
        assert_same(store.checkout(2), sample_states(2))
        assert_same(view.checkout("two"), sample_states(2))
        assert_same(view.checkout(1), sample_states(1))
        assert_consistent(view)
        assert_clean(view)


#: the other transaction of a single process's commit, named by a statement only it runs: it
#: opens the pending checkpoint, references the chunks the catalog has and records the packs
#: before their objects are written (the chunk rows go in with the final transaction, above)
COMMIT_TRANSACTIONS = {"pending row and claim": "INSERT INTO checkpoints"}


@pytest.mark.parametrize("when", ["after", "before"])
@pytest.mark.parametrize("transaction", list(COMMIT_TRANSACTIONS))
def test_connection_lost_at_the_commit_of_an_earlier_transaction(
    tmp_path: Path, pg_catalog_url: str, monkeypatch: pytest.MonkeyPatch, transaction: str, when: str
) -> None:
    """The connection drops at the COMMIT of one of a commit's earlier transactions: the commit
    fails with a `CatalogError` and nothing of it is visible. Only an opened pending row whose
    answer was lost is left (the commit cannot know it has one); retrying the commit takes it
    over and commits the step, bit-exact, and gc + fsck find the store clean."""
    proxy, direct = _proxied(tmp_path, pg_catalog_url, monkeypatch)
    marker = COMMIT_TRANSACTIONS[transaction]
    with proxy, _open(tmp_path / "store", proxy.url(direct)) as store, _open(tmp_path / "store", direct) as view:
        proxy.cut_commit(marker, when)
        with pytest.raises(ckstore.CatalogError, match="Retry once the catalog is reachable"):
            store.commit(2, sample_states(2))
        cut = proxy.cut
        assert cut is not None and any(s.startswith(marker) for s in cut.statements), cut
        assert cut.server_committed is (when == "after"), cut
        assert [c.step for c in view.checkpoints()] == [1]
        left = when == "after"  # the pending row, opened: its answer was lost
        assert [p.step for p in view.catalog.pending()] == ([2] if left else [])
        assert store.commit(2, sample_states(2)).step == 2  # the retry
        assert view.catalog.pending() == []
        assert_same(store.checkout(2), sample_states(2))
        assert_same(view.checkout(1), sample_states(1))
        assert_consistent(view)
        assert_clean(view)


# -- a lease that lapses under a live commit ------------------------------------------------------
def _waits_on_a_lock(cat: Catalog, application_name: str) -> bool:
    with cat.engine.connect() as conn:
        waiting = conn.execute(
            text("SELECT wait_event_type FROM pg_stat_activity WHERE application_name = :name"),
            {"name": application_name},
        ).scalars()
        return "Lock" in list(waiting)


def test_a_takeover_waits_for_the_transaction_that_makes_the_checkpoint_visible(
    tmp_path: Path, pg_catalog_url: str
) -> None:
    """Commit A's lease lapses while A runs the transaction that makes its step visible, and
    commit B of the same step takes the step over meanwhile: B waits for A's transaction, then
    finds the step committed. Neither A's entries nor its committed checkpoint are lost (A
    failed with a raw foreign-key violation, or B deleted A's committed row and both succeeded)."""
    layout = WorldLayout.flat(1)
    store = _open(tmp_path / "store", pg_catalog_url)
    a = store.catalog
    b = Catalog(f"{pg_catalog_url}&application_name=ckstore-takeover")
    owner_a, owner_b = Owner.me(), Owner.me()
    ckpt = a.begin_checkpoint(
        "exp", 1, kind="checkpoint", replace=False, owner=owner_a, world_layout=layout, lease_seconds=60
    )
    outcome: list[BaseException | int] = []
    done = threading.Event()

    def take_over() -> None:  # B finds A's lease lapsed (a lease of 0 s)
        try:
            outcome.append(
                b.begin_checkpoint(
                    "exp", 1, kind="checkpoint", replace=False, owner=owner_b, world_layout=layout, lease_seconds=0
                )
            )
        except BaseException as e:  # noqa: BLE001 - checked below
            outcome.append(e)
        finally:
            done.set()

    def record(_added: int, _facts: Any) -> Any:  # inside A's finishing transaction
        threading.Thread(target=take_over).start()
        while not done.wait(0.01) and not _waits_on_a_lock(a, "ckstore-takeover"):
            pass
        return lambda: None

    entries = [(0, "model_states", b"manifest", 0)]
    committed = a.finish_checkpoint(
        ckpt, owner_a, entries=entries, metrics={}, tags=[], logical_bytes=0, replace=False, record=record
    )
    done.wait()
    assert committed.step == 1
    assert len(outcome) == 1 and isinstance(outcome[0], ckstore.AlreadyExistsError), outcome
    assert [(c.id, c.step) for c in store.checkpoints()] == [(ckpt, 1)]
    assert a.pending() == []
    b.close()
    store.close()
