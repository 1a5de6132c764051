"""Timestamps are UTC on every road, whatever the machine's time zone.

A timestamp without an offset (``2025-09-24T04:30:34.656``; the explanation export writes
``2026-02-18T17:18:05.554834``) is UTC; one with an offset is converted to UTC. The same page
through the DuckDB road (one-line API JSON, gzip export rows) and the Python road (pretty-printed
JSON, flight text, plain export rows) must store the same instants. The ingest runs in a child
process whose ``TZ`` is not UTC, which is where a cast that follows the session's time zone
goes wrong.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: What each createdAt is sent as, and the UTC time it must be stored as.
SENT = {
    "feature": ("2025-09-24T04:30:34.656", "2025-09-24 04:30:34.656000"),
    "activation": ("2025-09-24T04:45:09.601-04:00", "2025-09-24 08:45:09.601000"),
    "explanation": ("2025-09-24T06:00:00+02:00", "2025-09-24 04:00:00"),
    "model": ("2025-09-11T08:50:59.351Z", "2025-09-11 08:50:59.351000"),
    "source": ("2025-09-11 08:50:59", "2025-09-11 08:50:59"),
    "export_explanation": ("2026-02-18T17:18:05.554834", "2026-02-18 17:18:05.554834"),
}

_CHILD = r"""
import gzip, json, sys
from pathlib import Path
import duckdb, orjson
from pipeline import Settings
from pipeline.lake import warehouse
from pipeline.ingest import ingest
from tests.conftest import good_page

sent = json.loads(sys.argv[2])
root = Path(sys.argv[1])
page = good_page(11)
page["createdAt"] = sent["feature"][0]
for a in page["activations"]:
    a["createdAt"] = sent["activation"][0]
page["explanations"][0]["createdAt"] = sent["explanation"][0]
page["model"]["createdAt"] = sent["model"][0]
page["source"]["createdAt"] = sent["source"][0]
export_row = {"id": "exp-auto-interp", "modelId": page["modelId"], "layer": page["layer"], "index": "11",
              "description": "auto-interp", "authorId": "a", "typeName": "oai_token-act-pair",
              "explanationModelName": "gpt-4o-mini", "createdAt": sent["export_explanation"][0]}
body = orjson.dumps(page)
for key in ("feature", "model"):  # flight dates: "$D<iso>", one without a zone, one with "Z"
    body = body.replace(b'"' + sent[key][0].encode() + b'"', b'"$D' + sent[key][0].encode() + b'"')
flight = b'0:["$","div",null,{"initialNeuron":' + body + b"}]\n"
shapes = {
    "api_json": orjson.dumps(page),                                    # DuckDB road
    "pretty_json": orjson.dumps(page, option=orjson.OPT_INDENT_2),     # Python road
    "flight": flight,                                                  # Python road, a $D date
    "export_gzip": gzip.compress(orjson.dumps(export_row) + b"\n"),    # DuckDB road
    "export_plain": orjson.dumps(export_row) + b"\n",                  # Python road
}
out = {"session_time_zone": duckdb.connect().sql("SELECT current_setting('TimeZone')").fetchone()[0]}
for name, data in shapes.items():
    (root / name).mkdir()
    (root / name / "input").write_bytes(data)
    settings = Settings(warehouse=root / name / "wh")
    s = ingest([root / name / "input"], settings, progress=False, report_after=False)
    assert s.n_loaded == 1 and s.n_rejected == 0, (name, s.rejected)
    with warehouse.connect(settings, read_only=True) as c:
        got = {}
        for table, key in [("features", "feature"), ("activations", "activation"), ("models", "model"),
                           ("sources", "source")]:
            got[key] = sorted({str(t) for (t,) in c.execute(f"SELECT created_at FROM {table}").fetchall()})
        got["explanation"] = sorted(str(t) for (t,) in c.execute(
            "SELECT created_at FROM explanations WHERE explanation_id <> 'exp-auto-interp'").fetchall())
        got["export_explanation"] = sorted(str(t) for (t,) in c.execute(
            "SELECT created_at FROM explanations WHERE explanation_id = 'exp-auto-interp'").fetchall())
    out[name] = got
print("JSON:" + json.dumps(out))
"""


@pytest.fixture(scope="module", params=["America/New_York", "Asia/Kolkata"])
def stored(request, tmp_path_factory):
    zone = request.param
    env = dict(os.environ, TZ=zone, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path_factory.mktemp("tz")), json.dumps(SENT)],
                          env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("JSON:")][-1][5:])
    assert out.pop("session_time_zone") == zone  # the child really ran in another zone
    return out


@pytest.mark.parametrize("road", ["api_json", "pretty_json", "flight"])
@pytest.mark.parametrize("field", ["feature", "activation", "explanation", "model", "source"])
def test_a_page_stores_utc_on_every_road(stored, road, field):
    assert stored[road][field] == [SENT[field][1]], f"{field} createdAt through {road}"


@pytest.mark.parametrize("road", ["export_gzip", "export_plain"])
def test_an_explanation_export_row_without_a_zone_is_utc(stored, road):
    assert stored[road]["export_explanation"] == [SENT["export_explanation"][1]]


def test_the_expected_values_are_the_utc_instants():
    """The table above, worked out with Python's own zone arithmetic (naive means UTC)."""
    from datetime import timezone

    for sent, want in SENT.values():
        dt = datetime.fromisoformat(sent.replace("Z", "+00:00"))
        dt = dt.astimezone(timezone.utc).replace(tzinfo=None) if dt.tzinfo else dt
        assert str(dt) == want, sent
