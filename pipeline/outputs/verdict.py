"""The verdict of a run: PASS, WARN or FAIL by ``VERDICT_RULES``, and what each failure count of
a run is out of. The run report heads its page with it; ``status``, ``serve``'s runs, the fetch
and inbox logs and the published card say it too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["VERDICT_RULES", "Verdict", "verdict", "out_of"]

#: (verdict, condition), checked in order; the first that holds decides. "New inputs" are the
#: inputs the run received minus those already landed by an earlier run.
VERDICT_RULES: tuple[tuple[str, str], ...] = (
    ("FAIL", "the run did not finish successfully (status is not 'succeeded')"),
    ("FAIL", "the run received new inputs but loaded none of them"),
    ("FAIL", "more than half of the new inputs were rejected"),
    ("FAIL", "its fetch failed wholly or mostly: every URL it fetched, or half of them or more, "
             "failed after its retries (fetch_failures)"),
    ("WARN", "an input was rejected, a record was quarantined, an expectation failed, "
             "or a URL could not be fetched"),
    ("PASS", "none of the above: everything new loaded and every expectation held"),
)


@dataclass(frozen=True)
class Verdict:
    """PASS, WARN or FAIL for one run, and why."""

    level: str
    rule: int
    """Index into ``VERDICT_RULES`` of the rule that decided."""
    reason: str
    """The deciding rule applied to this run's numbers, in words."""


def out_of(run: dict[str, Any]) -> dict[str, int]:
    """What each failure count of a run (a ``runs`` row, with ``n_fetch_failed``) is out of, by
    the count's key: rejected inputs of the inputs not already landed, URLs that failed to fetch
    of the URLs fetched (each that landed is an input received; a 404 is neither), failed
    expectation results of all, quarantined records of every record read (loaded or refused)."""
    n = {k: int(run.get(k) or 0) for k in (
        "n_received", "n_duplicates", "n_fetch_failed", "n_expectations", "n_features", "n_activations",
        "n_explanations", "n_quarantined")}
    return {"n_rejected": n["n_received"] - n["n_duplicates"], "n_fetch_failed": n["n_fetch_failed"] + n["n_received"],
            "n_expectations_failed": n["n_expectations"],
            "n_quarantined": n["n_features"] + n["n_activations"] + n["n_explanations"] + n["n_quarantined"]}


def verdict(run: dict[str, Any]) -> Verdict:
    """Judge a run (a ``runs`` row as a dict) by ``VERDICT_RULES``."""
    n = {k: int(run.get(k) or 0) for k in
         ("n_received", "n_duplicates", "n_loaded", "n_rejected", "n_quarantined", "n_expectations_failed",
          "n_fetch_failed")}
    of = out_of(run)
    new = of["n_rejected"]
    if run.get("status") != "succeeded":
        err = f": {run['error']}" if run.get("error") else ""
        return Verdict("FAIL", 0, f"the run's status is '{run.get('status')}'{err}")
    if new > 0 and n["n_loaded"] == 0:
        return Verdict("FAIL", 1, f"{new:,} input(s) not already landed received, none loaded")
    if new > 0 and n["n_rejected"] / new > 0.5:
        return Verdict("FAIL", 2, f"{n['n_rejected']:,} of {new:,} inputs not already landed rejected "
                                  f"({100 * n['n_rejected'] / new:.0f}% > 50%)")
    fetched = of["n_fetch_failed"]
    if n["n_fetch_failed"] and n["n_fetch_failed"] / fetched >= 0.5:  # half a night lost is no pass
        share = ("all" if n["n_fetch_failed"] == fetched else f"{100 * n['n_fetch_failed'] / fetched:.0f}%")
        return Verdict("FAIL", 3, f"{n['n_fetch_failed']:,} of {fetched:,} URL(s) failed to fetch ({share}), "
                                  "see Fetch failures")
    # each count with what it is out of ("50 of 100 URL(s)"): one quarantined record and half a
    # night's URLs lost must not read alike
    problems = [f"{n[k]:,}{f' of {of[k]:,}' if of[k] else ''} {what}" for k, what in (
        ("n_rejected", "input(s) rejected"), ("n_quarantined", "record(s) quarantined"),
        ("n_expectations_failed", "expectation result(s) failed"),
        ("n_fetch_failed", "URL(s) failed to fetch")) if n[k]]
    if problems:
        return Verdict("WARN", 4, ", ".join(problems))
    if new == 0:
        return Verdict("PASS", 5, "nothing new to load: every input was already landed" if n["n_received"]
                       else "the run received no inputs")
    return Verdict("PASS", 5, f"{n['n_loaded']:,} of {new:,} inputs not already landed loaded, no record refused")
