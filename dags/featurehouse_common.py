"""What the featurehouse DAG files share: where `featurehouse.toml` is, the failure notifier its
`[notify]` asks for and the warehouse's tables as Assets whose URIs name the warehouse (read
when a DAG file is parsed); a run's key, and the translation of a configuration error.

Stdlib and Airflow only: a DAG file is parsed every few seconds, so nothing here imports the
pipeline (DuckDB, Arrow). It travels with the DAG files (a DAG bundle is this folder, whose root
Airflow puts on ``sys.path``) and `.airflowignore` keeps Airflow from parsing it as a DAG file.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

from airflow.sdk import Asset

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

CONFIG_VARIABLE = "featurehouse_config"
"""The Airflow Variable naming featurehouse.toml, when ``$FEATUREHOUSE_CONFIG`` does not."""

RAW_TABLES = ("models", "source_sets", "sources", "features", "activations", "explanations")
"""The tables an ingest loads (``pipeline.stages.stage.STAGED_TABLES``): the nightly's ingest
parts and the inbox's drain publish them."""

STATS_TABLES = ("feature_activation_stats", "feature_token_stats", "source_activation_stats")
"""The statistics a load refreshes: the nightly's materialise and the inbox's drain publish them."""

ADDRESS = re.compile(r"[^@\s]+@[^@\s]+")
"""An e-mail address, as schemas/featurehouse.toml.schema.json holds ``[notify] email`` to it."""

ASSET_SCHEME = "x-ducklake"
"""Airflow gives a scheme starting ``x-`` no meaning and leaves its URIs as written."""

SUBJECT = ("featurehouse: {{ dag.dag_id }} failed{% if ti is defined %} in task {{ ti.task_id }}"
           "{% if ti.map_index is defined and ti.map_index is not none and ti.map_index >= 0 %}"
           "[{{ ti.map_index }}]{% endif %}{% endif %} (run {{ run_id }})")
"""The mail's subject unless ``[notify] subject`` gives one (a Jinja template, as Airflow renders it)."""

BODY = """<p>The DAG run <b>{{ run_id }}</b> of <b>{{ dag.dag_id }}</b> failed{% if reason is defined and reason %} ({{ reason }}){% endif %}.</p>
{% if ti is defined %}<p>Task <b>{{ ti.task_id }}</b>{% if ti.map_index is not none and ti.map_index >= 0 %}[{{ ti.map_index }}]{% endif %},
try {{ ti.try_number }}: <a href="{{ ti.log_url }}">its log</a>.</p>{% endif %}
{% if featurehouse_error is defined and featurehouse_error %}<p>Its error:</p>
<pre>{{ featurehouse_error | e }}</pre>{% endif %}
{% set wh = (" --warehouse " ~ featurehouse_warehouse) if featurehouse_warehouse is defined and featurehouse_warehouse else "" %}
{% if featurehouse_run_id is defined %}<p>If the night got as far as loading, its run in the warehouse{% if wh %} {{ featurehouse_warehouse }}{% endif %} is <b>{{ featurehouse_run_id }}</b>:
<code>featurehouse status{{ wh }}</code> and <code>featurehouse report --run {{ featurehouse_run_id }}{{ wh }}</code> say what it loaded and why
it is not PASS (they answer "no run" when it stopped before loading: then the error above is all there is).</p>
{% else %}<p>If the run got as far as loading, <code>featurehouse status{{ wh }}</code> and its report say what it loaded and why it is not PASS.</p>{% endif %}"""
"""The mail's body: the run, the task that failed it with its error and log, and where the
warehouse's own account of the run is, when there is one."""

ERROR_KEY = "featurehouse_error"
"""The XCom in which a failed task instance keeps its exception's text (:func:`remember_error`),
for the run's failure mail: a DAG's failure callback is given the task, not its exception."""

MAX_ERROR_CHARS = 4000


def run_key(context: dict):
    """The run's key: its data interval start (a manual run without one: its logical date / run_after)."""
    return context.get("data_interval_start") or context.get("logical_date") or context["dag_run"].run_after


@contextmanager
def not_transient():
    """A configuration error (``pipeline.sources.plan.ConfigError``, a bad environment value,
    a source Neuronpedia does not have) fails the task at once: retrying cannot mend it. The
    library never imports Airflow; the translation is here."""
    from pipeline.config import BadSetting  # ConfigError and SourceNotFound are BadSettings

    try:
        yield
    except BadSetting as exc:
        from airflow.sdk.exceptions import AirflowFailException

        raise AirflowFailException(f"{type(exc).__module__}.{type(exc).__name__}: {exc}") from exc


def remember_error(context: dict) -> None:
    """A task's ``on_failure_callback`` (its last try failed): keep the exception's text in the
    task instance's XCom ``featurehouse_error``, where the DAG's failure mail finds it."""
    exc = context.get("exception")
    if exc is None:
        return
    text = f"{type(exc).__name__}: {exc}"
    context["ti"].xcom_push(key=ERROR_KEY, value=text[:MAX_ERROR_CHARS])


def failed_task_error(context: dict) -> str | None:
    """The exception text of the task instance a failure callback's ``context`` names (``exception``
    when the context is a task's; else what :func:`remember_error` kept); None when unknown."""
    if context.get("exception") is not None:
        exc = context["exception"]
        return f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]
    ti = context.get("ti")
    if ti is None:
        return None
    try:  # the dag-processor runs a DAG's callbacks with the task API (XComs among it)
        return ti.xcom_pull(task_ids=ti.task_id, map_indexes=ti.map_index, key=ERROR_KEY)
    except Exception:  # noqa: BLE001 - `airflow dags test` runs them in its own process, beside the database
        pass
    try:
        from airflow.models.xcom import XComModel
        from airflow.utils.session import create_session

        with create_session() as session:
            row = session.scalars(XComModel.get_many(run_id=ti.run_id, key=ERROR_KEY, task_ids=ti.task_id,
                                                     dag_ids=ti.dag_id, map_indexes=ti.map_index, limit=1)).first()
            return XComModel.deserialize_value(row) if row is not None else None
    except Exception:  # noqa: BLE001 - a mail without it beats no mail
        return None


def config_path() -> Path:
    """featurehouse.toml: ``$FEATUREHOUSE_CONFIG``, else the Airflow Variable
    ``featurehouse_config``, else the project's own (the file beside the ``pipeline`` package
    the tasks import, which ``featurehouse`` commands read too). Never found from this file's
    own place: a bundle is copied where Airflow pleases."""
    named = os.environ.get("FEATUREHOUSE_CONFIG", "").strip() or _variable(CONFIG_VARIABLE)
    return Path(named).expanduser() if named else project_config()


def project_config() -> Path:
    """``pipeline.sources.plan.DEFAULT_CONFIG``, found without importing the pipeline."""
    spec = importlib.util.find_spec("pipeline")
    origin = spec.origin if spec is not None and spec.origin else None
    return (Path(origin).resolve().parents[1] if origin else Path.cwd()) / "featurehouse.toml"


def _variable(key: str) -> str | None:
    from airflow.sdk import Variable

    value = Variable.get(key, default=None)
    return value.strip() if isinstance(value, str) and value.strip() else None


def read_config(path: Path) -> dict:
    """The file as a dict; empty when it cannot be read (the task that loads the plan then fails
    with the real error, naming the file)."""
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError):
        return {}
    return raw if isinstance(raw, dict) else {}


def failure_notifier(config: dict):
    """An ``SmtpNotifier`` as ``[notify]`` asks (``email``, ``smtp_conn_id``, ``from_email``,
    ``subject``), for a DAG's ``on_failure_callback``; None when the section is absent, or holds a
    mistake (the nightly's ``plan`` task fails naming it, as for any mistake in the file)."""
    notify = config.get("notify")
    if not isinstance(notify, dict):
        return None
    to = [notify["email"]] if isinstance(notify.get("email"), str) else notify.get("email")
    options = {k: notify[k] for k in ("smtp_conn_id", "from_email", "subject") if k in notify}
    if (set(notify) - {"email", *options} or not isinstance(to, list) or not to
            or not all(isinstance(a, str) and ADDRESS.fullmatch(a) for a in to)
            or not all(isinstance(v, str) and v.strip() for v in options.values())
            or ("from_email" in options and not ADDRESS.fullmatch(options["from_email"]))):
        return None
    from airflow.providers.smtp.notifications.smtp import SmtpNotifier

    class RunFailedNotifier(SmtpNotifier):
        """Airflow's SmtpNotifier, whose templates also render when the context's DAG is a
        ``SerializedDAG``, as `airflow dags test` gives a DAG's callbacks (it has no template
        environment; apache/airflow#64649): then in Airflow's sandboxed default."""

        def get_template_env(self, dag=None):
            return super().get_template_env(dag=dag if hasattr(dag, "get_template_env") else None)

        def render_template_fields(self, context, jinja_env=None):
            """The warehouse's run id beside Airflow's (``featurehouse status`` and the report
            name runs by it): the one the DAG's tasks give their runs; and the failed task's error."""
            context["featurehouse_error"] = failed_task_error(context)
            try:
                from pipeline.sources.night import run_id_for

                context["featurehouse_run_id"] = run_id_for(run_key(context), context["dag"].dag_id)
            except Exception:  # noqa: BLE001 - a mail without it beats no mail
                pass
            try:  # the warehouse the tasks load (review: the mail's commands named none)
                path = config_path()
                context["featurehouse_warehouse"] = str(_warehouse_dir(read_config(path), path))
            except Exception:  # noqa: BLE001
                pass
            super().render_template_fields(context, jinja_env)

    return RunFailedNotifier(to=to, from_email=options.get("from_email"),
                             smtp_conn_id=options.get("smtp_conn_id", "smtp_default"),
                             subject=options.get("subject", SUBJECT), html_content=BODY)


def table_assets(config: dict, path: Path, tables: tuple[str, ...]) -> list[Asset]:
    """The warehouse's ``tables`` as Assets, ``x-ducklake://<catalog>/<table>``: the catalog
    (the warehouse's identity: DuckLake keeps everything else in it) is
    ``/<absolute path of catalog.sqlite>`` or ``<host>:<port>/<database>`` for PostgreSQL, so
    two warehouses are two sets of Assets. The URI is the Asset's name too (Airflow wants names
    unique as well)."""
    where = warehouse_location(config, path)
    return [Asset(uri=f"{ASSET_SCHEME}://{where}/{table}", group="featurehouse", extra={"table": table})
            for table in tables]


def warehouse_location(config: dict, path: Path) -> str:
    """The warehouse's catalog as a URI's authority and path, with no user or password: the
    settings ``pipeline.config.Settings`` reads (``$FEATUREHOUSE_CATALOG``, else
    ``catalog.sqlite`` in the warehouse folder: ``$FEATUREHOUSE_WAREHOUSE``, else ``[paths]
    warehouse`` relative to the file's folder)."""
    catalog = os.environ.get("FEATUREHOUSE_CATALOG", "").strip()
    kind, _, rest = catalog.partition(":")
    if kind.lower() in ("postgres", "postgresql"):
        return _postgres(rest)
    file = Path(rest) if kind.lower() == "sqlite" else _warehouse_dir(config, path) / "catalog.sqlite"
    return quote(str(file.expanduser().absolute()))


def _warehouse_dir(config: dict, path: Path) -> Path:
    given = os.environ.get("FEATUREHOUSE_WAREHOUSE", "").strip()
    if given:
        return Path(given)
    paths = config.get("paths")
    value = paths.get("warehouse") if isinstance(paths, dict) else None
    folder = Path(value if isinstance(value, str) and value else "warehouse").expanduser()
    return folder if folder.is_absolute() else path.expanduser().absolute().parent / folder


def _postgres(dsn: str) -> str:
    """``host:port/database`` of a libpq connection string (``key=value`` words or a
    ``postgresql://`` URI), with libpq's defaults (``$PGHOST``, ``$PGPORT``, ``$PGDATABASE``)."""
    dsn = dsn.strip()
    if dsn.startswith(("postgres://", "postgresql://")):
        url = urlsplit(dsn)
        words = {"host": unquote(url.hostname or ""), "port": str(url.port or ""),
                 "dbname": unquote(url.path.lstrip("/")), "user": unquote(url.username or "")}
    else:
        words = dict(w.split("=", 1) for w in dsn.split() if "=" in w)
        words = {k.strip(): v.strip().strip("'") for k, v in words.items()}
    host = words.get("host") or os.environ.get("PGHOST") or "localhost"
    port = words.get("port") or os.environ.get("PGPORT") or "5432"
    database = words.get("dbname") or os.environ.get("PGDATABASE") or words.get("user") or os.environ.get("PGUSER") or ""
    return f"{quote(host, safe='')}:{quote(port, safe='')}/{quote(database, safe='')}"
