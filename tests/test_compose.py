"""docker-compose.yml stays honest: no Docker engine runs here, so the compose file is held to what
tests/test_airflow_scheduler.py really runs — the same Airflow subcommands, the same settings file
(deploy/airflow.env) and init script, and places that agree with the Dockerfile."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from pipeline.config import Settings
from tests.airflow_helpers import (
    COMMON_ENV_FILE,
    EXTRA_KEYS,
    INIT_SCRIPT,
    LOCATION_KEYS,
    REPO,
    SCALE_ENV_FILE,
    SCALE_SERVICES,
    SERVICES,
    read_env_file,
)

COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SVC = COMPOSE["services"]
AIRFLOW_SERVICES = sorted(SERVICES)
SCALE_INFRA = {"redis", "minio", "minio-init"}
DOTENV = REPO / "deploy" / "dotenv.sh"
COMPOSE_TEXT = (REPO / "docker-compose.yml").read_text()
#: Secrets compose adds that the tests give another way: their throwaway PostgreSQL's password
#: is in the URLs they put in place of deploy/airflow.env's (which carry none).
COMPOSE_ONLY_SECRETS = {"PGPASSWORD"}
DOCKERFILE = (REPO / "Dockerfile").read_text()
ENV = read_env_file()
SCALE_ENV = read_env_file(SCALE_ENV_FILE)
ENV_FILES = [str(COMMON_ENV_FILE.relative_to(REPO)), "deploy/airflow-${FEATUREHOUSE_DEPLOYMENT:-single}.env"]


def command(service: dict) -> list[str]:
    cmd = service.get("command", [])
    return shlex.split(cmd) if isinstance(cmd, str) else list(cmd)


def mounts(service: dict) -> dict[str, str]:
    """container path -> volume name or host path."""
    out = {}
    for v in service.get("volumes", []):
        source, target = v.split(":")[:2] if not v.startswith("${") else (v[: v.index("}") + 1], v[v.index("}") + 2:].split(":")[0])
        out[target] = source
    return out


def copied_to(source: str) -> str:
    """Where the Dockerfile COPYs ``source`` to (an absolute path), following WORKDIR."""
    workdir = "/"
    for line in DOCKERFILE.splitlines():
        words = line.split()
        if words[:1] == ["WORKDIR"]:
            workdir = words[1]
        if words[:1] == ["COPY"]:
            args = [w for w in words[1:] if not w.startswith("--")]
            *sources, dest = args
            if source in sources:
                dest = dest if dest.startswith("/") else str(Path(workdir) / dest)
                if dest.endswith("/") or len(sources) > 1:
                    return str(Path(dest) / source)
                return str(Path(dest))
    raise AssertionError(f"the Dockerfile does not COPY {source}")


def test_the_services_are_the_ones_the_scheduler_test_starts():
    assert set(SVC) == {"postgres", "airflow-init", "inbox-init", *SERVICES, *SCALE_SERVICES, *SCALE_INFRA}
    for name in AIRFLOW_SERVICES:
        assert command(SVC[name]) == SERVICES[name], name
    # the single-machine deployment is the default: only the scale profile adds the rest
    assert {n for n, s in SVC.items() if "profiles" in s} == {*SCALE_SERVICES, *SCALE_INFRA}
    assert all(SVC[n]["profiles"] == ["scale"] for n in (*SCALE_SERVICES, *SCALE_INFRA))


def test_the_scale_profile_is_the_one_the_celery_test_starts():
    """The Celery test reads deploy/airflow-scale.env after deploy/airflow.env, replacing only
    places: here the places must be the profile's services."""
    for name in SCALE_SERVICES:
        assert command(SVC[name]) == SCALE_SERVICES[name], name
        assert SVC[name]["env_file"] == ENV_FILES and SVC[name]["image"] == SVC["scheduler"]["image"]
    assert SCALE_ENV["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor"
    assert int(SCALE_ENV["AIRFLOW__CELERY_BROKER_TRANSPORT_OPTIONS__VISIBILITY_TIMEOUT"]) >= 86400
    assert set(SCALE_ENV) - LOCATION_KEYS <= {"AIRFLOW__CORE__EXECUTOR", "AIRFLOW__CELERY__WORKER_CONCURRENCY",
                                              "AIRFLOW__CELERY_BROKER_TRANSPORT_OPTIONS__VISIBILITY_TIMEOUT",
                                              "AWS_REGION"}
    assert not {k for k in SCALE_ENV if "SECRET" in k or "PASSWORD" in k or k == "AWS_ACCESS_KEY_ID"}
    broker = urlsplit(SCALE_ENV["AIRFLOW__CELERY__BROKER_URL"])
    assert broker.scheme == "redis" and broker.hostname == "redis" and broker.port == 6379
    budget = urlsplit(SCALE_ENV["FEATUREHOUSE_FETCH_BUDGET"])  # the workers' fetches share one request budget
    assert (budget.scheme, budget.hostname, budget.port) == ("redis", "redis", 6379) and budget.path != broker.path
    backend = urlsplit(SCALE_ENV["AIRFLOW__CELERY__RESULT_BACKEND"].removeprefix("db+"))
    db = urlsplit(ENV["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"])
    assert (backend.hostname, backend.username, backend.password, backend.path) == (
        db.hostname, db.username, db.password, db.path)
    s3 = urlsplit(SCALE_ENV["FEATUREHOUSE_S3_ENDPOINT"])
    assert s3.hostname == "minio" and s3.port == 9000
    bucket = urlsplit(SCALE_ENV["FEATUREHOUSE_DATA_PATH"]).hostname
    assert urlsplit(SCALE_ENV["FEATUREHOUSE_LANDING"]).hostname == bucket
    assert SCALE_ENV["FEATUREHOUSE_DATA_PATH"].startswith("s3://")
    assert f"minio/{bucket}" in " ".join(command(SVC["minio-init"]))  # made at start
    assert SVC["minio-init"]["depends_on"]["minio"]["condition"] == "service_healthy"
    # MinIO's root credentials are the ones every Airflow service uses
    for name in ("minio", "minio-init"):
        env = SVC[name]["environment"]
        assert env["MINIO_ROOT_USER"] == SVC["scheduler"]["environment"]["AWS_ACCESS_KEY_ID"]
        assert env["MINIO_ROOT_PASSWORD"] == SVC["scheduler"]["environment"]["AWS_SECRET_ACCESS_KEY"]
    # Airflow's services wait for the profile's services when it is active, and only then
    deps = SVC["scheduler"]["depends_on"]
    assert deps["redis"] == {"condition": "service_healthy", "required": False}
    assert deps["minio-init"] == {"condition": "service_completed_successfully", "required": False}
    for f in ("airflow-single.env", "airflow-scale.env"):
        assert (REPO / "deploy" / f).exists()
    test = (REPO / "tests" / "test_airflow_celery.py").read_text()
    assert "scale=True" in test and 'SCALE_SERVICES["airflow-worker"]' in test


def test_init_runs_the_script_the_tests_run():
    init = command(SVC["airflow-init"])
    assert init == ["bash", str(Path(copied_to("deploy")) / INIT_SCRIPT.name)]
    text = INIT_SCRIPT.read_text()
    assert "airflow db migrate" in text
    # the pools every DAG names; the writer pool bounds memory, not correctness (commit lock)
    # (made by one `airflow pools import`; tests/test_airflow_dags_test.py reads them back)
    assert '"warehouse_writer": {"slots": slots("FEATUREHOUSE_WRITER_SLOTS", 2)' in text
    assert '"neuronpedia_api": {"slots": slots("FEATUREHOUSE_API_SLOTS", 4)' in text
    assert 'airflow pools import "$pools"' in text
    assert "AIRFLOW_ADMIN_PASSWORD" in SVC["airflow-init"]["environment"]


@pytest.mark.parametrize("name", ["airflow-init", *AIRFLOW_SERVICES])
def test_every_airflow_service_reads_the_shared_settings_and_only_adds_secrets(name):
    s = SVC[name]
    assert s["env_file"] == ENV_FILES
    # what compose adds is what the tests add too (secrets and keys from the environment)
    assert set(s["environment"]) <= EXTRA_KEYS | COMPOSE_ONLY_SECRETS, set(s["environment"]) - EXTRA_KEYS
    assert s["environment"]["NEURONPEDIA_API_KEY"].startswith("${NEURONPEDIA_API_KEY")
    assert s["environment"]["AIRFLOW__API_AUTH__JWT_SECRET"].startswith("${AIRFLOW_JWT_SECRET")
    assert s["build"] == {"context": ".", "dockerfile": "Dockerfile"}
    assert s["image"] == SVC["scheduler"]["image"]


def test_the_shared_settings_run_the_local_executor_the_tests_run():
    assert ENV["AIRFLOW__CORE__EXECUTOR"] == "LocalExecutor"
    assert ENV["AIRFLOW__CORE__LOAD_EXAMPLES"] == "False"
    assert ENV["AIRFLOW__CORE__AUTH_MANAGER"].endswith("SimpleAuthManager")
    assert ENV["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS"].split(",")[0].split(":")[:2] == ["admin", "admin"]
    assert LOCATION_KEYS <= set(ENV) | set(SCALE_ENV), LOCATION_KEYS - set(ENV) - set(SCALE_ENV)


def test_places_agree_with_the_services_and_the_image():
    db = urlsplit(ENV["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"])
    pg = SVC["postgres"]["environment"]
    assert db.scheme.startswith("postgresql") and db.hostname == "postgres"
    assert (db.username, db.path.lstrip("/")) == (pg["POSTGRES_USER"], pg["POSTGRES_DB"])
    assert db.password is None  # PGPASSWORD, from .env
    api = urlsplit(ENV["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"])
    assert api.hostname == "api-server" and api.port == 8080 and api.path == "/execution/"
    assert any(p.endswith(":8080") for p in SVC["api-server"]["ports"])

    assert ENV["AIRFLOW__CORE__DAGS_FOLDER"] == copied_to("dags")
    assert ENV["FEATUREHOUSE_CONFIG"] == copied_to("featurehouse.toml")
    assert ENV["FEATUREHOUSE_SCHEMAS"] == copied_to("schemas")
    # Airflow imports airflow_local_settings (the preload) from deploy/, as the tests do
    assert ENV["PYTHONPATH"] == copied_to("deploy")
    assert (REPO / "deploy" / "airflow_local_settings.py").exists()


def test_the_catalog_is_its_own_database_on_the_deployments_postgres():
    pg = SVC["postgres"]["environment"]
    kind, _, conninfo = ENV["FEATUREHOUSE_CATALOG"].partition(":")
    fields = dict(part.split("=", 1) for part in conninfo.split())
    assert kind == "postgres" and fields["host"] == "postgres"
    assert fields["user"] == pg["POSTGRES_USER"] and "password" not in fields  # PGPASSWORD, from .env
    assert fields["dbname"] != pg["POSTGRES_DB"], "the catalog must not share Airflow's database"
    # the database is made by the same file the tests' PostgreSQL runs
    init = [v for v in SVC["postgres"]["volumes"] if "docker-entrypoint-initdb.d" in v]
    assert init and init[0].split(":")[0] == "./deploy/postgres-init.sql"
    assert f"CREATE DATABASE {fields['dbname']};" in (REPO / "deploy" / "postgres-init.sql").read_text()


@pytest.mark.parametrize("name", ["airflow-init", *AIRFLOW_SERVICES])
def test_volumes_hold_the_warehouse_the_landing_area_and_the_inbox(name):
    m = mounts(SVC[name])
    settings = Settings(warehouse=Path(ENV["FEATUREHOUSE_WAREHOUSE"]))
    assert m[str(settings.warehouse)] == "warehouse"  # data files, reports, Great Expectations' files
    assert m[str(settings.landing_dir)] == "landing"  # where the pipeline lands inputs
    assert ENV["FEATUREHOUSE_INBOX"] in m
    assert m[str(Path(ENV["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"]).parent)] == "airflow-auth"
    named = {v for v in m.values() if not v.startswith(("$", ".", "/"))}
    assert named <= set(COMPOSE["volumes"])


def test_the_image_is_airflow_3_3_with_this_package():
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    pin = next(d for d in pyproject["project"]["optional-dependencies"]["airflow"] if d.startswith("apache-airflow=="))
    version = pin.split("==")[1]
    assert re.search(rf"^FROM apache/airflow:{re.escape(version)}-python3\.11$", DOCKERFILE, re.M)
    assert re.search(r"pip install .*-e \"\.\[airflow\]\"", DOCKERFILE)
    assert copied_to("pipeline") == "/opt/featurehouse/pipeline"


def _recipe(makefile: str, target: str) -> str:
    found = re.search(rf"^{target}: .*## .+\n((?:\t.*\n)+)", makefile, re.M)
    assert found, f"no documented `{target}` target"
    return found.group(1)


def test_make_up_and_down_drive_compose():
    makefile = (REPO / "Makefile").read_text()
    up, down, up_scale = (_recipe(makefile, t) for t in ("up", "down", "up-scale"))
    assert "docker compose up -d" in up
    assert re.search(r"docker compose (--profile scale )?down", down)
    assert "FEATUREHOUSE_DEPLOYMENT=scale" in up_scale
    assert "docker compose --profile scale up -d" in up_scale and "--scale airflow-worker=" in up_scale
    for recipe in (up, up_scale):
        assert "deploy/dotenv.sh secrets" in recipe
    assert "deploy/dotenv.sh scale-secrets" in up_scale


def _required(text: str) -> set[str]:
    """The variables compose refuses to start without (``${NAME:?...}``)."""
    return set(re.findall(r"\$\{([A-Z_][A-Z0-9_]*):\?", text))


def test_the_secrets_compose_insists_on_are_the_ones_make_up_writes(tmp_path):
    env = {"PATH": os.environ["PATH"], "DOTENV": str(tmp_path / ".env"), "PYTHON": sys.executable}
    subprocess.run(["bash", str(DOTENV), "secrets"], env=env, check=True, cwd=tmp_path)
    subprocess.run(["bash", str(DOTENV), "scale-secrets"], env=env, check=True, cwd=tmp_path)
    written = read_env_file(tmp_path / ".env")
    assert _required(COMPOSE_TEXT) == {"AIRFLOW_JWT_SECRET", "AIRFLOW_ADMIN_PASSWORD", "POSTGRES_PASSWORD"}
    assert _required(COMPOSE_TEXT) | {"AIRFLOW_UID", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(written)
    assert all(len(written[k]) >= 16 for k in ("AIRFLOW_JWT_SECRET", "AIRFLOW_ADMIN_PASSWORD", "POSTGRES_PASSWORD"))
    assert written["POSTGRES_PASSWORD"] != "airflow"
    assert oct((tmp_path / ".env").stat().st_mode & 0o777) == "0o600"
    # once made, a secret stays (a new one would lock the deployment out of its own database)
    subprocess.run(["bash", str(DOTENV), "secrets"], env=env, check=True, cwd=tmp_path)
    assert read_env_file(tmp_path / ".env") == written


def test_no_password_is_kept_in_the_repository():
    """PostgreSQL's password is in .env like every other secret: not in compose, not in deploy/."""
    pg = SVC["postgres"]["environment"]
    assert pg["POSTGRES_PASSWORD"].startswith("${POSTGRES_PASSWORD:?")
    for name in AIRFLOW_SERVICES + ["airflow-init", *SCALE_SERVICES]:
        assert SVC[name]["environment"]["PGPASSWORD"] == pg["POSTGRES_PASSWORD"], name
    for f in (COMMON_ENV_FILE, SCALE_ENV_FILE):
        for key, value in read_env_file(f).items():
            if "postgres" in value:
                url = urlsplit(value.removeprefix("db+"))
                assert url.password is None and "password=" not in value, (f.name, key)


def test_the_chosen_deployment_is_recorded_so_a_later_up_keeps_it(tmp_path):
    """`make up-scale` writes its choice to .env, which compose reads on every `up`: the env
    file, the profile (COMPOSE_PROFILES), the workers and the writer slots."""
    makefile = (REPO / "Makefile").read_text()
    up_scale = _recipe(makefile, "up-scale")
    recorded = re.search(r"deploy/dotenv\.sh set ((?:[A-Z_]+=\S*\s*(?:\\\n\t\s*)?)+)", up_scale)
    assert recorded, up_scale
    keys = dict(kv.split("=", 1) for kv in recorded.group(1).replace("\\\n", " ").split())
    assert keys["FEATUREHOUSE_DEPLOYMENT"] == "scale" and keys["COMPOSE_PROFILES"] == "scale"
    assert {"FEATUREHOUSE_WORKERS", "FEATUREHOUSE_WRITER_SLOTS"} <= set(keys)
    # ... and what compose reads them for
    assert "deploy/airflow-${FEATUREHOUSE_DEPLOYMENT:-single}.env" in SVC["scheduler"]["env_file"]
    assert SVC["airflow-worker"]["deploy"]["replicas"] == "${FEATUREHOUSE_WORKERS:-2}"
    assert SVC["airflow-init"]["environment"]["FEATUREHOUSE_WRITER_SLOTS"] == "${FEATUREHOUSE_WRITER_SLOTS:-2}"
    # the script records and replaces, never appends a second value compose would not read
    env = {"PATH": os.environ["PATH"], "DOTENV": str(tmp_path / ".env")}
    for kv in ("FEATUREHOUSE_DEPLOYMENT=scale", "FEATUREHOUSE_DEPLOYMENT=single"):
        subprocess.run(["bash", str(DOTENV), "set", kv, "COMPOSE_PROFILES="], env=env, check=True)
    assert (tmp_path / ".env").read_text() == "FEATUREHOUSE_DEPLOYMENT=single\nCOMPOSE_PROFILES=\n"


@pytest.mark.parametrize("name", ["minio", "minio-init"])
def test_images_are_pinned_to_a_release(name):
    image = SVC[name]["image"]
    assert re.fullmatch(r"minio/(minio|mc):RELEASE\.\d{4}-\d\d-\d\dT\d\d-\d\d-\d\dZ", image), image


def test_the_inbox_a_missing_folder_becomes_belongs_to_the_services():
    """A bind mount Docker has to make is owned by root; inbox-init gives it to AIRFLOW_UID
    before any Airflow service starts (as root, changing only a folder root owns)."""
    init = SVC["inbox-init"]
    assert init["user"] == "0:0" and init["restart"] == "no"
    assert mounts(init)["/data/inbox"] == mounts(SVC["scheduler"])["/data/inbox"]
    script = " ".join(command(init))
    assert 'chown "$$AIRFLOW_UID:0" /data/inbox' in script and "stat -c %u /data/inbox" in script
    assert SVC["scheduler"]["user"] == f"{init['environment']['AIRFLOW_UID']}:0"  # the same uid
    for name in [*AIRFLOW_SERVICES, *SCALE_SERVICES]:
        assert SVC[name]["depends_on"]["inbox-init"] == {"condition": "service_completed_successfully"}, name
