"""Run Apache Airflow for real in tests: a fresh AIRFLOW_HOME, a throwaway PostgreSQL, Airflow's
own processes, and the REST API.

The deployment (docker-compose.yml) and these tests share ``deploy/airflow.env`` and
``deploy/airflow-init.sh``; the tests replace only the settings that name a place
(``LOCATION_KEYS``). ``SERVICES`` is what the scheduler-run test starts, and what
tests/test_compose.py holds the compose file to.
"""

from __future__ import annotations

import contextlib
import json
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
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
COMMON_ENV_FILE = DEPLOY / "airflow.env"
SCALE_ENV_FILE = DEPLOY / "airflow-scale.env"
"""Read after COMMON_ENV_FILE by the scale-out deployment (CeleryExecutor, S3 storage)."""
INIT_SCRIPT = DEPLOY / "airflow-init.sh"
AIRFLOW = Path(sys.executable).parent / "airflow"

#: Settings in deploy/airflow.env that name a host or a path; the only ones a test replaces.
LOCATION_KEYS = frozenset({
    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN",
    "AIRFLOW__CORE__EXECUTION_API_SERVER_URL",
    "AIRFLOW__CORE__DAGS_FOLDER",
    "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE",
    "FEATUREHOUSE_CONFIG",
    "FEATUREHOUSE_SCHEMAS",
    "FEATUREHOUSE_WAREHOUSE",
    "FEATUREHOUSE_CATALOG",
    "FEATUREHOUSE_INBOX",
    "PYTHONPATH",  # deploy/, for airflow_local_settings.py
    # the scale-out deployment's (SCALE_ENV_FILE)
    "AIRFLOW__CELERY__BROKER_URL",
    "AIRFLOW__CELERY__RESULT_BACKEND",
    "FEATUREHOUSE_S3_ENDPOINT",
    "FEATUREHOUSE_DATA_PATH",
    "FEATUREHOUSE_LANDING",
    "FEATUREHOUSE_FETCH_BUDGET",
})

#: Settings a test adds that the deployment takes from the environment (secrets, ports, home).
EXTRA_KEYS = frozenset({
    "AIRFLOW_HOME", "AIRFLOW__API__PORT", "AIRFLOW__API__HOST", "AIRFLOW__API_AUTH__JWT_SECRET",
    "AIRFLOW_ADMIN_PASSWORD", "NEURONPEDIA_API_KEY", "FEATUREHOUSE_INBOX_SETTLE_SECONDS",
    "NEURONPEDIA_BASE_URL", "NEURONPEDIA_EXPORTS_URL", "AIRFLOW__LOGGING__BASE_LOG_FOLDER",
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "FEATUREHOUSE_WRITER_SLOTS",
    "AIRFLOW_VAR_FEATUREHOUSE_CONFIG",  # the Airflow Variable naming featurehouse.toml, from the environment
})

#: Settings only the Celery test adds: two workers on one machine need their own task-instance
#: hostnames (containers have theirs), and a killed worker's task is noticed in seconds, not minutes.
CELERY_TEST_KEYS = frozenset({
    "AIRFLOW__CORE__HOSTNAME_CALLABLE",
    "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT",
    "AIRFLOW__SCHEDULER__TASK_INSTANCE_HEARTBEAT_TIMEOUT_DETECTION_INTERVAL",
    "AIRFLOW__WORKERS__MIN_HEARTBEAT_INTERVAL",
})

#: The Airflow processes of a deployment, by docker-compose service name: the arguments to `airflow`.
SERVICES: dict[str, list[str]] = {
    "api-server": ["api-server"],
    "scheduler": ["scheduler"],
    "dag-processor": ["dag-processor"],
    "triggerer": ["triggerer"],
}

#: What the scale-out deployment adds (docker compose --profile scale): Celery workers.
SCALE_SERVICES: dict[str, list[str]] = {
    "airflow-worker": ["celery", "worker"],
}

ADMIN_USER = "admin"


def read_env_file(path: Path = COMMON_ENV_FILE) -> dict[str, str]:
    """KEY=VALUE lines, as docker compose's env_file reads them (comments and blanks skipped)."""
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


def airflow_env(home: Path, *, scale: bool = False, **overrides: str) -> dict[str, str]:
    """The environment for `airflow` commands: the deployment's shared settings, with places replaced
    (``scale``: the scale-out deployment's, deploy/airflow-scale.env read after them).

    Raises AssertionError when asked to replace a setting that is not a place: that would make
    the tests prove a different deployment than the one docker-compose.yml describes.
    """
    bad = set(overrides) - LOCATION_KEYS - EXTRA_KEYS - (CELERY_TEST_KEYS if scale else set())
    assert not bad, f"tests may only replace places and secrets, not {sorted(bad)}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "FEATUREHOUSE_", "NEURONPEDIA_"))}
    env |= read_env_file()
    if scale:
        env |= read_env_file(SCALE_ENV_FILE)
    env |= {
        "AIRFLOW_HOME": str(home),
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": f"sqlite:///{home / 'airflow.db'}",
        "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
        "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(home / "passwords.json"),
        "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": "http://localhost:8080/execution/",
        "AIRFLOW__LOGGING__BASE_LOG_FOLDER": str(home / "logs"),
        "FEATUREHOUSE_CONFIG": str(REPO / "featurehouse.toml"),
        "FEATUREHOUSE_SCHEMAS": str(REPO / "schemas"),
        "FEATUREHOUSE_WAREHOUSE": str(home / "data" / "warehouse"),
        "FEATUREHOUSE_CATALOG": "",  # the embedded catalog in the warehouse folder, unless a test gives one
        "FEATUREHOUSE_INBOX": str(home / "data" / "inbox"),
        # deploy/ (airflow_local_settings.py), then this tree: its pipeline/, not the one the
        # virtualenv's editable install names (another checkout's, from a git worktree)
        "PYTHONPATH": os.pathsep.join([str(DEPLOY), str(REPO)]),
        "AIRFLOW__API_AUTH__JWT_SECRET": "featurehouse-test-jwt-secret-" + home.name,
        "PATH": f"{AIRFLOW.parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    env |= overrides
    return env


def airflow(args: list[str], env: dict[str, str], timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
    """Run one `airflow` command; on failure the error shows its output."""
    proc = subprocess.run([str(AIRFLOW), *args], env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"airflow {' '.join(args)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def init(env: dict[str, str]) -> subprocess.CompletedProcess:
    """What docker-compose's airflow-init service runs: migrate, pools, admin password."""
    proc = subprocess.run(["bash", str(INIT_SCRIPT)], env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise AssertionError(f"{INIT_SCRIPT.name} exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port: int, timeout: float, proc: subprocess.Popen | None = None, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"{what or 'process'} exited with {proc.returncode} before listening on {port}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.3)
    raise AssertionError(f"nothing listened on port {port} within {timeout:.0f}s ({what})")


def stop(proc: subprocess.Popen, grace: float = 20) -> None:
    """SIGTERM the process group a test started, then SIGKILL it if it lingers."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def start(args: list[str], env: dict[str, str], log: Path, cwd: Path | None = None) -> subprocess.Popen:
    """Start a long-running process in its own process group, its output in ``log``."""
    out = log.open("ab")
    return subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=cwd, start_new_session=True)


# --- PostgreSQL --------------------------------------------------------------------------------

def pg_bin() -> Path | None:
    """The newest installed PostgreSQL server's bin folder (Debian layout), if any."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parent.parent.name))
    if found:
        return found[-1].parent
    initdb = shutil.which("initdb")
    return Path(initdb).parent if initdb else None


def _as_postgres(cmd: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: run its tools as the postgres user when we are root."""
    if os.geteuid() != 0:
        return cmd
    runuser = shutil.which("runuser")
    return [runuser, "-u", "postgres", "--", *cmd] if runuser else ["su", "postgres", "-s", "/bin/sh", "-c", " ".join(cmd)]


@dataclass(frozen=True)
class Postgres:
    """A running throwaway cluster: Airflow's database URL and the warehouse catalog's."""

    url: str
    """SQLAlchemy URL of Airflow's metadata database."""
    catalog: str
    """``postgres:<libpq string>`` of the featurehouse database (deploy/postgres-init.sql)."""

    def __str__(self) -> str:
        return self.url


INIT_SQL = DEPLOY / "postgres-init.sql"


@contextlib.contextmanager
def postgres_cluster(user: str = "airflow", password: str = "airflow", db: str = "airflow") -> Iterator[Postgres]:
    """Initialise and start a throwaway PostgreSQL cluster, with the databases the deployment's
    postgres service makes (Airflow's, and deploy/postgres-init.sql's); yield them; stop and
    delete it."""
    bindir = pg_bin()
    if bindir is None:
        raise AssertionError("PostgreSQL is not installed (apt-get install postgresql; .ci/run does it)")
    root = Path(tempfile.mkdtemp(prefix="featurehouse-pg-"))
    data, sock = root / "data", root / "sock"
    sock.mkdir()
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
        shutil.chown(sock, "postgres", "postgres")
    port = free_port()
    pwfile = root / "pw"
    pwfile.write_text(password + "\n")
    if os.geteuid() == 0:
        shutil.chown(pwfile, "postgres", "postgres")
    subprocess.run(_as_postgres([str(bindir / "initdb"), "-D", str(data), "-U", user, "--pwfile", str(pwfile),
                                 "-A", "scram-sha-256", "-E", "UTF8", "--no-sync"]),
                   check=True, capture_output=True, timeout=120)
    opts = f"-p {port} -k {sock} -c listen_addresses=127.0.0.1 -c fsync=off -c full_page_writes=off"
    subprocess.run(_as_postgres([str(bindir / "pg_ctl"), "-D", str(data), "-l", str(root / "log"), "-o", opts,
                                 "-w", "-t", "60", "start"]), check=True, capture_output=True, timeout=90)
    try:
        pg_env = {**os.environ, "PGPASSWORD": password}
        subprocess.run(_as_postgres([str(bindir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", user, db]),
                       check=True, capture_output=True, timeout=60, env=pg_env)
        subprocess.run([str(bindir / "psql"), "-h", "127.0.0.1", "-p", str(port), "-U", user, "-d", db,
                        "-v", "ON_ERROR_STOP=1", "-f", str(INIT_SQL)], check=True, capture_output=True, timeout=60,
                       env=pg_env)
        yield Postgres(f"postgresql+psycopg2://{user}:{password}@127.0.0.1:{port}/{db}",
                       f"postgres:dbname=featurehouse host=127.0.0.1 port={port} user={user} password={password}")
    finally:
        subprocess.run(_as_postgres([str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"]),
                       capture_output=True, timeout=60)
        shutil.rmtree(root, ignore_errors=True)


# --- the REST API ------------------------------------------------------------------------------

class Api:
    """Airflow's public REST API (v2) with a JWT from the simple auth manager's /auth/token."""

    def __init__(self, base_url: str, username: str, password: str):
        self.base_url = base_url.rstrip("/")
        self.token = self._token(username, password)

    def _send(self, method: str, path: str, body: dict | None = None, token: str | None = None):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                return resp.status, json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode(errors="replace")

    def _token(self, username: str, password: str) -> str:
        status, body = self._send("POST", "/auth/token", {"username": username, "password": password})
        assert status in (200, 201), f"POST /auth/token: {status} {body}"
        return body["access_token"]

    def call(self, method: str, path: str, body: dict | None = None, ok=(200,)):
        status, out = self._send(method, path, body, self.token)
        assert status in ok, f"{method} {path}: {status} {out}"
        return out


def wait_until(predicate, timeout: float, interval: float = 1.0, what: str = "condition"):
    """Poll ``predicate`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


@dataclass
class Mailbox:
    """What a loopback SMTP server received: one ``email.message.EmailMessage`` a mail."""

    port: int
    messages: list

    async def handle_DATA(self, server, session, envelope):  # aiosmtpd's handler hook
        import email
        import email.policy

        message = email.message_from_bytes(envelope.content, policy=email.policy.default)
        message["X-Envelope-To"] = ", ".join(envelope.rcpt_tos)
        self.messages.append(message)
        return "250 Message accepted for delivery"


@contextlib.contextmanager
def smtp_server() -> Iterator[Mailbox]:
    """An SMTP server on loopback (aiosmtpd, in a thread of this process) that keeps what it is sent."""
    from aiosmtpd.controller import Controller

    box = Mailbox(port=free_port(), messages=[])
    controller = Controller(box, hostname="127.0.0.1", port=box.port)
    controller.start()
    try:
        yield box
    finally:
        controller.stop()


@contextlib.contextmanager
def fake_neuronpedia_server(log: Path, n_features: int = 200) -> Iterator[str]:
    """``python -m tests.fake_neuronpedia`` in a subprocess (another process, as the real site is);
    yields its base URL."""
    port = free_port()
    proc = start([sys.executable, "-m", "tests.fake_neuronpedia", "--port", str(port), "--n-features", str(n_features)],
                 {**os.environ}, log, cwd=REPO)
    try:
        wait_for_port(port, 30, proc, "fake Neuronpedia")
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc, grace=5)
