"""One request budget for every fetch running at once (issue 45): two `featurehouse fetch
features` processes into one warehouse take their requests from one bucket beside it, so
together they stay within `--requests-per-hour`; each alone may use all of it, and the night's
plan gives each fetch task the whole budget instead of a static share."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pipeline.sources import budget, night, plan
from tests.fake_neuronpedia import FakeNeuronpedia
from tests.fetch_support import MODEL, SOURCE, pages, settings_in

ROOT = Path(__file__).resolve().parent.parent
RATE = 7200  # requests an hour: 2 a second
BURST = 2


def _most_in(times: list[float], window: float) -> int:
    times = sorted(times)
    return max(sum(1 for u in times[i:] if u < t + window) for i, t in enumerate(times))


def _fetch(np, settings, rng: str, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "fetch", "features", "--model", MODEL, "--source", SOURCE,
         "--range", rng, "--base-url", np.base_url, "--warehouse", str(settings.warehouse), "--concurrency",
         str(BURST), "--requests-per-hour", str(RATE), "--no-progress"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _two_at_once(tmp_path, extra_env: dict) -> list[float]:
    settings = settings_in(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(ROOT), **extra_env)
    with FakeNeuronpedia(pages=pages(24)) as np:
        procs = [_fetch(np, settings, "0:12", env), _fetch(np, settings, "12:24", env)]
        for p in procs:
            out, _ = p.communicate(timeout=180)
            assert p.returncode == 0, out.decode()[-2000:]
        return [s.at for s in np.seen(prefix="/api/feature/")]


def test_two_fetches_at_once_share_one_budget(tmp_path):
    times = _two_at_once(tmp_path, {})
    assert len(times) == 24
    # in any 3 s: at most the burst and 2 a second (one of slack for the clocks' edges)
    assert _most_in(times, 3.0) <= BURST + 3 * RATE / 3600 + 1, sorted(t - min(times) for t in times)
    assert (Path(settings_in(tmp_path).warehouse) / budget.FILE_NAME).exists()


def test_without_the_shared_budget_each_fetch_takes_its_own(tmp_path):
    """The control: with FEATUREHOUSE_FETCH_BUDGET=off two fetches at the same rate together go
    past it (what the shared budget prevents; the plan then splits the budget instead)."""
    times = _two_at_once(tmp_path, {"FEATUREHOUSE_FETCH_BUDGET": "off"})
    assert _most_in(times, 3.0) > BURST + 3 * RATE / 3600 + 1


def test_the_plan_gives_each_fetch_task_the_whole_shared_budget(tmp_path):
    cfg = tmp_path / "featurehouse.toml"
    cfg.write_text(f'[fetch]\nrequests_per_hour = 20000\n[[sources]]\nmodel = "{MODEL}"\nsource = "{SOURCE}"\n'
                   'indices = ["0:100"]\n')
    shared = plan.load_plan(cfg, env={"FEATUREHOUSE_API_SLOTS": "4"})
    assert {c["requests_per_hour"] for c in night.chunks(shared, "w")} == {20000}
    alone = plan.load_plan(cfg, env={"FEATUREHOUSE_API_SLOTS": "4", "FEATUREHOUSE_FETCH_BUDGET": "off"})
    assert {c["requests_per_hour"] for c in night.chunks(alone, "w")} == {5000}
