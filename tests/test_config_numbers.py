"""Numbers in featurehouse.toml must be finite and fit what they set, and a bad one is refused
naming its key; a retry delay no timer can hold keeps the nightly DAG and fails its ``plan`` task.

TOML has ``nan`` and ``inf``, and a JSON Schema ``minimum`` does not stop them (every comparison
with NaN is false): ``[schedule] retry_delay = inf`` (or ``nan``, or ``1e300``) passed the plan's
check and made the nightly DAG file fail to import (``timedelta`` cannot hold it), so the DAG
vanished from Airflow instead of its ``plan`` task failing naming the key. (Found by reviewing
issue 20's fixes from outside: `airflow dags test` on a fresh clone.)
"""

from __future__ import annotations

import pytest

from pipeline.sources.plan import ConfigError, load_plan
from tests.test_dags import DAGS, _run

SOURCE = '\n[[sources]]\nmodel = "m"\nsource = "s"\nindices = ["0:10"]\n'


@pytest.mark.parametrize(("text", "where"), [
    ("[schedule]\nretry_delay = nan\n", "[schedule] retry_delay"),
    ("[schedule]\nretry_delay = inf\n", "[schedule] retry_delay"),
    ("[fetch]\ntask_retry_delay = inf\n", "[fetch] task_retry_delay"),
    ("[fetch]\nbackoff = inf\n", "[fetch] backoff"),
    ("[fetch]\nmax_failed_fraction = nan\n", "[fetch] max_failed_fraction"),
    ("[inbox]\nsettle_seconds = -inf\n", "[inbox] settle_seconds"),
    ("[inbox]\nkeep_days = nan\n", "[inbox] keep_days"),
])
def test_a_number_that_is_not_finite_is_refused_naming_the_key(tmp_path, text, where):
    cfg = tmp_path / "fh.toml"
    cfg.write_text(text + SOURCE)
    with pytest.raises(ConfigError) as err:
        load_plan(cfg, env={})
    assert str(cfg) in str(err.value) and f"{where} must be " in str(err.value)


@pytest.mark.parametrize("text", ["[schedule]\nretry_delay = 1e300\n", "[fetch]\ntask_retry_delay = 1e300\n"])
def test_a_retry_delay_no_timer_can_hold_is_refused(tmp_path, text):
    cfg = tmp_path / "fh.toml"
    cfg.write_text(text + SOURCE)
    with pytest.raises(ConfigError, match=r"retry_delay must be a number of seconds"):
        load_plan(cfg, env={})


_DAG_AND_PLAN = r"""
import json, sys
import pendulum
from airflow.dag_processing.dagbag import DagBag
bag = DagBag(dag_folder=sys.argv[1], known_pools={"default_pool", "neuronpedia_api", "warehouse_writer"})
dag = bag.dags.get("featurehouse_nightly")
out = {"import_errors": {k: str(v)[-300:] for k, v in bag.import_errors.items()}, "plan_error": None,
       "retry_delay": None}
if dag:
    out["retry_delay"] = {t: dag.get_task(t).retry_delay.total_seconds() for t in ("plan", "fetch")}
    try:
        dag.get_task("plan").python_callable(data_interval_start=pendulum.datetime(2026, 11, 28, 3, tz="UTC"))
    except Exception as exc:
        out["plan_error"] = f"{type(exc).__module__}.{type(exc).__name__}: {exc}"
print("JSON:" + json.dumps(out))
"""


@pytest.mark.parametrize("text", ["[schedule]\nretry_delay = inf\n[fetch]\ntask_retry_delay = nan\n",
                                  "[schedule]\nretry_delay = 1e300\n[fetch]\ntask_retry_delay = 1e300\n"])
def test_an_impossible_retry_delay_keeps_the_dag_and_fails_its_plan_task(tmp_path, text):
    cfg = tmp_path / "fh.toml"
    cfg.write_text(text + SOURCE)
    got = _run(_DAG_AND_PLAN, [str(DAGS)], tmp_path, FEATUREHOUSE_CONFIG=str(cfg),
               FEATUREHOUSE_WAREHOUSE=str(tmp_path / "wh"))
    assert got["import_errors"] == {}, "a bad retry delay must not make the DAG file fail to import"
    assert got["retry_delay"] == {"plan": 60.0, "fetch": 60.0}  # the defaults, until the file is fixed
    assert got["plan_error"] and got["plan_error"].startswith(
        "airflow.sdk.exceptions.AirflowFailException: pipeline.sources.plan.ConfigError: ")
    assert str(cfg) in got["plan_error"] and "[schedule] retry_delay must be " in got["plan_error"]
    assert "[fetch] task_retry_delay must be " in got["plan_error"]
