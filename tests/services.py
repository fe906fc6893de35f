"""Real services for the tests: PostgreSQL databases, S3-compatible servers (moto), and private
PostgreSQL instances a test may stop and start.

Loaded as a pytest plugin from ``conftest.py``. A service that cannot be had skips the tests
that need it, with the reason; with ``CKSTORE_REQUIRE_SERVICES=1`` (CI) they fail instead.

Environment:

* ``CKSTORE_TEST_PG`` — admin URL of the shared PostgreSQL server (default
  ``postgresql://postgres@127.0.0.1:5432/postgres``). Each test session creates its own
  database there and drops it at the end; each test gets its own schema in it.
* ``CKSTORE_TEST_PG_BINDIR`` — where ``initdb`` and ``pg_ctl`` live, for private instances
  (default: ``pg_config --bindir``, then ``/usr/lib/postgresql/*/bin``, then ``$PATH``).
* ``CKSTORE_REQUIRE_SERVICES=1`` — a missing service fails the tests instead of skipping them.
"""

from __future__ import annotations

import glob
import importlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TypeVar
from urllib.parse import quote

import pytest

PG_ADMIN_DEFAULT = "postgresql://postgres@127.0.0.1:5432/postgres"
S3_REGION = "eu-west-1"
S3_KEY = "ckstore-test-key"
S3_SECRET = "ckstore-test-secret"


def unavailable(reason: str) -> NoReturn:
    """Skip (or, under CKSTORE_REQUIRE_SERVICES=1, fail) a test whose service cannot be had.

    Every service-dependent skip in the suite goes through here (or :func:`require_module`), so
    CI, which sets ``CKSTORE_REQUIRE_SERVICES=1``, never passes by skipping."""
    if os.environ.get("CKSTORE_REQUIRE_SERVICES") == "1":
        pytest.fail(f"{reason} (CKSTORE_REQUIRE_SERVICES=1 makes this a failure)", pytrace=False)
    pytest.skip(reason)


def require_module(name: str, extra: str | None = None) -> Any:
    """Import an optional dependency, or skip (fail under CKSTORE_REQUIRE_SERVICES=1) without it."""

    try:
        return importlib.import_module(name)
    except ImportError as e:
        unavailable(f"{name} is not installed ({e}); pip install 'ckstore[{extra or name}]'")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def with_search_path(url: str, schema: str) -> str:
    sep = "&" if "?" in url else "?"
    return f"{url}{sep}options={quote(f'-csearch_path={schema}', safe='')}"


# -- PostgreSQL (shared server) ---------------------------------------------------------------------
def _pg_admin_url() -> str:
    return os.environ.get("CKSTORE_TEST_PG", PG_ADMIN_DEFAULT)


def _pg_connect(url: str) -> Any:
    import psycopg

    return psycopg.connect(url, autocommit=True, connect_timeout=5)


def _sqlalchemy_url(libpq_url: str) -> str:
    return "postgresql+psycopg://" + libpq_url.split("://", 1)[1]


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    """SQLAlchemy URL of a database made for this test session on the shared server."""
    admin = _pg_admin_url()
    require_module("psycopg")
    try:
        conn = _pg_connect(admin)
    except Exception as e:  # noqa: BLE001 - server down, refused
        unavailable(f"PostgreSQL at {admin} is not reachable: {e}")
    name = f"ckstore_test_{os.getpid()}_{uuid.uuid4().hex[:8]}"
    with conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    base = admin.rsplit("/", 1)[0]
    try:
        yield _sqlalchemy_url(f"{base}/{name}")
    finally:
        with _pg_connect(admin) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def pg_catalog_url(pg_url: str) -> Iterator[str]:
    """A catalog URL of its own for one test: a fresh schema in the session's database."""
    schema = f"t_{uuid.uuid4().hex[:12]}"
    libpq = "postgresql://" + pg_url.split("://", 1)[1]
    with _pg_connect(libpq) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    try:
        yield with_search_path(pg_url, schema)
    finally:
        with _pg_connect(libpq) as conn:
            conn.execute("SET lock_timeout = '10s'")
            try:
                conn.execute(f'DROP SCHEMA "{schema}" CASCADE')
            except Exception:  # noqa: BLE001 - a connection still open; the database goes at session end
                pass


# -- PostgreSQL (private instance) ------------------------------------------------------------------
def _pg_bindir() -> Path | None:
    env = os.environ.get("CKSTORE_TEST_PG_BINDIR")
    candidates = [env] if env else []
    try:
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, timeout=10)
        candidates.append(out.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    candidates += sorted(glob.glob("/usr/lib/postgresql/*/bin"), reverse=True)
    which = shutil.which("initdb")
    if which:
        candidates.append(os.path.dirname(os.path.realpath(which)))
    for c in candidates:
        if c and os.path.isfile(os.path.join(c, "initdb")) and os.path.isfile(os.path.join(c, "pg_ctl")):
            return Path(c)
    return None


@dataclass
class PrivatePostgres:
    """A PostgreSQL server of one test's own, in a temp folder, on a free port."""

    bindir: Path
    base: Path
    port: int
    as_user: list[str]

    @property
    def data(self) -> Path:
        return self.base / "data"

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _ctl(self, *args: str, timeout: float = 60) -> None:
        cmd = [*self.as_user, str(self.bindir / "pg_ctl"), "-D", str(self.data), *args]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            log = (self.base / "log").read_text() if (self.base / "log").exists() else ""
            raise RuntimeError(f"{' '.join(cmd)} failed: {out.stdout}{out.stderr}\n{log[-2000:]}")

    def start(self) -> None:
        opts = (
            f"-p {self.port} -k {self.base} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c full_page_writes=off -c synchronous_commit=off"
        )
        self._ctl("-l", str(self.base / "log"), "-w", "-t", "60", "-o", opts, "start")

    def stop(self, mode: str = "fast") -> None:
        self._ctl("-m", mode, "-w", "-t", "60", "stop")

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture
def private_postgres() -> Iterator[PrivatePostgres]:
    """A started private PostgreSQL server (trust auth, user postgres); gone after the test."""
    bindir = _pg_bindir()
    if bindir is None:
        unavailable("initdb/pg_ctl not found (set CKSTORE_TEST_PG_BINDIR)")
    as_user: list[str] = []
    base = Path(tempfile.mkdtemp(prefix="ckstore-pg-"))
    if os.geteuid() == 0:  # PostgreSQL refuses to run as root: run it as the postgres user
        import pwd

        try:
            pw = pwd.getpwnam("postgres")
        except KeyError:
            shutil.rmtree(base, ignore_errors=True)
            unavailable("running as root and there is no postgres user to run a private server as")
        os.chown(base, pw.pw_uid, pw.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    init = [*as_user, str(bindir / "initdb"), "-D", str(base / "data"), "-U", "postgres", "-A", "trust"]
    init += ["--no-sync", "-E", "UTF8", "--locale=C"]
    out = subprocess.run(init, capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        shutil.rmtree(base, ignore_errors=True)
        unavailable(f"initdb failed: {out.stderr.strip()[-500:]}")
    pg = PrivatePostgres(bindir, base, free_port(), as_user)
    try:
        pg.start()
        yield pg
    finally:
        try:
            pg.stop("immediate")
        except (RuntimeError, subprocess.SubprocessError):
            pass
        shutil.rmtree(base, ignore_errors=True)


# -- S3-compatible servers (moto) -------------------------------------------------------------------
def _moto_executable() -> str | None:
    here = Path(sys.executable).parent / "moto_server"
    if here.is_file():
        return str(here)
    return shutil.which("moto_server")


@dataclass
class Emulator:
    """An object store emulator process on loopback."""

    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


@dataclass
class S3Server(Emulator):
    """A moto S3 server process on loopback."""

    buckets: list[str] = field(default_factory=list)

    def storage_options(self, **config: Any) -> dict[str, Any]:
        """fsspec options for this server (``config`` goes to botocore's ``Config``)."""
        opts: dict[str, Any] = {
            "endpoint_url": self.endpoint,
            "key": S3_KEY,
            "secret": S3_SECRET,
            "client_kwargs": {"region_name": S3_REGION},
        }
        if config:
            opts["config_kwargs"] = config
        return opts

    def env(self) -> dict[str, str]:
        """The environment through which botocore finds this server and its credentials."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": S3_KEY,
            "AWS_SECRET_ACCESS_KEY": S3_SECRET,
            "AWS_DEFAULT_REGION": S3_REGION,
        }

    def client(self) -> Any:
        """A boto3 S3 client that talks to this server directly."""
        boto3 = require_module("boto3")
        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=S3_KEY,
            aws_secret_access_key=S3_SECRET,
            region_name=S3_REGION,
        )

    def uploads(self, bucket: str) -> dict[str, str]:
        """The unfinished multipart uploads in ``bucket``, as seen by the server: ``{id: key}``."""
        listed = self.client().list_multipart_uploads(Bucket=bucket).get("Uploads", [])
        return {u["UploadId"]: u["Key"] for u in listed}

    def make_bucket(self, name: str | None = None) -> str:
        """Create a bucket (in an explicit region, as real S3 wants) and return its name."""
        name = name or f"ckstore-{uuid.uuid4().hex[:16]}"
        self.client().create_bucket(Bucket=name, CreateBucketConfiguration={"LocationConstraint": S3_REGION})
        self.buckets.append(name)
        return name

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """Stop the server at once (connections are refused from now on)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def freeze(self) -> None:
        """Stop the server without closing its socket: requests hang until a timeout."""
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.thaw()  # a frozen server cannot act on SIGTERM
        super().stop()


def start_s3_server(log_dir: Path) -> S3Server:
    exe = _moto_executable()
    if exe is None:
        unavailable("moto_server is not installed (pip install 'moto[server]')")
    port = free_port()
    cmd = [exe, "-H", "127.0.0.1", "-p", str(port)]
    return _start_emulator(S3Server, "moto_server", cmd, port, log_dir / f"moto-{port}.log", probe="/moto-api/")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """An S3-compatible server shared by the session's tests (make a bucket of your own)."""
    server = start_s3_server(tmp_path_factory.mktemp("moto"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> str:
    """A fresh, empty bucket on the session's S3 server."""
    return s3_server.make_bucket()


@pytest.fixture
def fault_proxy(s3_server: S3Server) -> Iterator[Any]:
    """A :class:`faultproxy.FaultProxy` in front of the session's S3 server (point a store's
    ``endpoint_url`` at its ``endpoint``)."""
    from faultproxy import FaultProxy

    with FaultProxy(s3_server.endpoint) as proxy:
        yield proxy


@pytest.fixture
def private_s3_server(tmp_path: Path) -> Iterator[S3Server]:
    """An S3 server of one test's own, which the test may kill or freeze."""
    server = start_s3_server(tmp_path)
    try:
        yield server
    finally:
        server.stop()


# -- Google Cloud Storage (gcp-storage-emulator) and Azure Blob Storage (Azurite) emulators ----------
#: the Azure storage emulator's documented development account (not a secret)
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
REPO = Path(__file__).resolve().parent.parent
# gcsfs's default class first probes every bucket over gRPC (for zonal and hierarchical buckets),
# which an emulator does not answer: 60 s per call. Read when gcsfs is imported, so set it now.
os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


E = TypeVar("E", bound=Emulator)


def _start_emulator(
    kind: type[E], name: str, cmd: list[str], port: int, log: Path, timeout: float = 60, probe: str = "/"
) -> E:
    """Start ``cmd`` and wait until it answers HTTP on ``port`` (any status) at ``probe``, at most
    ``timeout`` s; a server that exits or never answers is :func:`unavailable`."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    emulator = kind(proc, port, log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            unavailable(f"{name} exited at start: {log.read_text(errors='replace')[-1000:]}")
        try:
            urllib.request.urlopen(emulator.endpoint + probe, timeout=2).close()
            return emulator
        except urllib.error.HTTPError:
            return emulator  # it answers
        except OSError:
            time.sleep(0.1)
    emulator.stop()
    unavailable(f"{name} did not answer on port {port} within {timeout:.0f} s")
    raise AssertionError("unreachable")


class GcsEmulator(Emulator):
    """gcp-storage-emulator (in memory, with GCS's create-only precondition: tests/gcs_emulator.py)."""

    def storage_options(self) -> dict[str, Any]:
        """gcsfs options for this emulator (as ``STORAGE_EMULATOR_HOST`` and ``token="anon"``)."""
        return {"endpoint_url": self.endpoint, "token": "anon", "project": "ckstore-test"}

    def make_bucket(self) -> str:
        import gcsfs

        name = f"ckstore-{uuid.uuid4().hex[:16]}"
        gcsfs.GCSFileSystem(skip_instance_cache=True, **self.storage_options()).mkdir(name)
        return name


class AzuriteEmulator(Emulator):
    """Azurite's blob service."""

    @property
    def connection_string(self) -> str:
        return (
            f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
            f"BlobEndpoint={self.endpoint}/{AZURITE_ACCOUNT};"
        )

    def storage_options(self) -> dict[str, Any]:
        """adlfs options for this emulator (as ``AZURE_STORAGE_CONNECTION_STRING``)."""
        return {"connection_string": self.connection_string}

    def make_container(self) -> str:
        from azure.storage.blob import BlobServiceClient

        name = f"ckstore-{uuid.uuid4().hex[:16]}"
        with BlobServiceClient.from_connection_string(self.connection_string) as client:
            client.create_container(name)
        return name


def _azurite_executable() -> str | None:
    local = REPO / ".cache" / "node" / "node_modules" / ".bin" / "azurite-blob"  # scripts/setup
    if local.is_file() and shutil.which("node"):
        return str(local)
    return shutil.which("azurite-blob")


@pytest.fixture(scope="session")
def gcs_emulator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GcsEmulator]:
    """A GCS emulator shared by the session's tests (make a bucket of your own)."""
    try:
        import gcp_storage_emulator  # noqa: F401
        import gcsfs
    except ImportError as e:
        unavailable(f"{e.name} is not installed (pip install gcp-storage-emulator gcsfs)")
    if gcsfs.GCSFileSystem is not gcsfs.core.GCSFileSystem:
        unavailable("gcsfs was imported before GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false was set")
    port = free_port()
    log = tmp_path_factory.mktemp("gcs") / "emulator.log"
    cmd = [sys.executable, str(Path(__file__).with_name("gcs_emulator.py")), "127.0.0.1", str(port)]
    emulator = _start_emulator(GcsEmulator, "gcp-storage-emulator", cmd, port, log)
    try:
        yield emulator
    finally:
        emulator.stop()


@pytest.fixture
def gcs_bucket(gcs_emulator: GcsEmulator) -> str:
    """A fresh, empty bucket on the session's GCS emulator."""
    return gcs_emulator.make_bucket()


@pytest.fixture(scope="session")
def azurite(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AzuriteEmulator]:
    """An Azurite blob service shared by the session's tests (make a container of your own)."""
    exe = _azurite_executable()
    if exe is None:
        unavailable("azurite-blob or Node.js is not installed (scripts/setup installs Azurite into .cache/node)")
    try:
        import adlfs  # noqa: F401
    except ImportError:
        unavailable("adlfs is not installed (pip install 'ckstore[azure]')")
    port = free_port()
    base = tmp_path_factory.mktemp("azurite")
    cmd = [exe, "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location", str(base / "data")]
    cmd += ["--silent", "--skipApiVersionCheck", "--disableTelemetry"]
    emulator = _start_emulator(AzuriteEmulator, "azurite-blob", cmd, port, base / "azurite.log")
    try:
        yield emulator
    finally:
        emulator.stop()


@pytest.fixture
def az_container(azurite: AzuriteEmulator) -> str:
    """A fresh, empty container on the session's Azurite."""
    return azurite.make_container()
