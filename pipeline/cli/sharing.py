"""Handing the warehouse to others: `publish` (a snapshot as a DuckLake and a Hugging Face
dataset) and `serve` (the web app)."""

from __future__ import annotations

import datetime
import signal
import sys

import click
import duckdb

from ..config import Settings
from ..lake import warehouse as warehouse_mod
from ..lake.landing import disk_full
from .common import (
    _USER_ERRORS,
    warehouse_option,
)
from .formats import _print_json
from .stopping import _stopped_by


def _at_time(ctx, param, value):
    if value is None:
        return None
    try:
        return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a time such as 2026-11-29T03:00:00Z") from None


@click.command("publish")
@click.argument("dest")  # text: click's Path would make s3://b/x a local s3:/b/x
@warehouse_option
@click.option("--snapshot", type=click.IntRange(min=0), default=None, help="The warehouse snapshot to publish (default: the latest).")
@click.option("--at", "at", default=None, callback=_at_time, metavar="TIME",
              help="Publish the snapshot the warehouse had at this time (UTC unless it says otherwise).")
@click.option("--tables", default=None, metavar="T1,T2",
              help="Tables to publish (default: models, sources, features, activations, explanations and the statistics).")
@click.option("--format", "fmt", type=click.Choice(["ducklake", "hf", "both"]), default="both", show_default=True,
              help="A DuckLake (DEST/featurehouse.ducklake + DEST/data/), a Hugging Face dataset (DEST/hf/), or both.")
@click.option("--url", default=None, metavar="URL",
              help="Where DEST will be served from (https://host/path or s3://bucket/prefix): the catalog names its "
                   "files there, so `ATTACH 'ducklake:URL/featurehouse.ducklake'` is all a reader needs.")
@click.option("--license", "license_", default=None, help="The licence the dataset card states (e.g. cc-by-4.0).")
@click.option("--include-private", is_flag=True,
              help="Keep the columns left out by default (input paths, hosts, errors) of the tables named.")
@click.option("--dry-run", is_flag=True, help="Say what would be written (to s3://: sent), write (send) nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout instead.")
def publish_cmd(dest, warehouse, snapshot, at, tables, fmt, url, license_, include_private, dry_run, as_json) -> None:
    """Publish a snapshot of the warehouse into DEST: a DuckLake anyone attaches read-only with one
    line (over HTTP, S3 or in place) and a Hugging Face dataset of Parquet files with its card.
    DEST is a folder or s3://bucket/prefix (the lake's S3 endpoint, region and AWS credentials).

    Publishing again into the same DEST sends only what changed: new data files, then the new
    catalog, which replaces the old one last (a reader of the old one keeps reading)."""
    from ..outputs import publish

    settings = Settings.from_env(warehouse=warehouse)
    formats = ("ducklake", "hf") if fmt == "both" else (fmt,)
    names = [t.strip() for t in tables.split(",") if t.strip()] if tables else None
    stopped: list[int] = []

    def stop(signum, frame) -> None:  # said in one line below; what it wrote beside the catalog is removed
        stopped.append(signum)
        raise KeyboardInterrupt

    before = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        to = publish.publish
        if dest.startswith("s3:/"):  # built as a folder by publish.publish's code, then uploaded
            from ..outputs import publish_s3

            to = publish_s3.publish
        r = to(settings, dest, snapshot=snapshot, at=at, tables=names, formats=formats, url=url,
               license=license_, include_private=include_private, dry_run=dry_run)
    except (publish.PublishRefused, *_USER_ERRORS) as exc:
        raise click.ClickException(str(exc)) from None
    except OSError as exc:
        why = "the disk is full" if disk_full(exc) else (exc.strerror or str(exc))
        raise click.ClickException(f"could not publish into {dest}: {why} ({exc.filename or dest}); "
                                   "a publication there before is still whole") from None
    except (KeyboardInterrupt, duckdb.Error, RuntimeError) as exc:  # DuckDB: 'Query interrupted'
        if not stopped and not isinstance(exc, KeyboardInterrupt):
            raise
        signum = stopped[0] if stopped else signal.SIGINT
        click.echo(f"featurehouse: publish {_stopped_by(signum)}: {dest} holds the publication it held before "
                   "(the next publish removes what this one left); run it again to publish", err=True)
        sys.exit(128 + signum)
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    if as_json:
        _print_json({"dest": r.where, "snapshot_id": r.snapshot_id, "snapshot_time": r.snapshot_time.isoformat(),
                     "dry_run": r.dry_run, "formats": list(r.formats), "bytes_written": r.bytes_written,
                     "bytes_by_format": r.bytes_by_format,
                     "files_written": r.files_written, "seconds": round(r.seconds, 2),
                     "tables": [vars(t) for t in r.tables], "open_with": r.lines(),
                     **({"s3": r.upload.as_dict()} if r.upload else {})})
        return
    verb = "would publish" if dry_run else "published"
    up = r.upload
    done = (f"{len(up.sent)} object(s), {up.bytes_sent:,} bytes sent ({up.kept} already there)" if up
            else f"{r.files_written} file(s), {r.bytes_written:,} bytes")
    click.echo(f"{verb} snapshot {r.snapshot_id} ({r.snapshot_time:%Y-%m-%d %H:%M:%S} UTC) into {r.where}"
               + ("" if dry_run else f": {done} in {r.seconds:.1f}s"))
    if up and dry_run:
        click.echo(f"would send {len(up.sent)} object(s), {up.bytes_sent:,} bytes ({up.kept} already there)"
                   + (f", remove {len(up.removed)} stale hf/ object(s)" if up.removed else "") + ":")
        for key, size in up.sent[:20]:
            click.echo(f"  {key} ({size:,} bytes)")
        if len(up.sent) > 20:
            click.echo(f"  ... and {len(up.sent) - 20} more (--json lists them all)")
    for t in r.tables:
        what = {"new": f"{t.rows:,} rows", "whole": f"{t.rows:,} rows, written whole ({t.why})",
                "changes": f"{t.rows:,} rows: +{t.added:,} -{t.removed:,}", "unchanged": f"{t.rows:,} rows, unchanged"}[t.how]
        click.echo(f"  {t.table:<26} {what}")
    if not dry_run:
        click.echo("open it with:")
        for line in r.lines():
            click.echo(f"  {line}")



@click.command("serve")
@warehouse_option
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (loopback by default: the app has no login).")
@click.option("--port", default=8765, show_default=True, type=click.IntRange(0, 65535), help="Port to listen on.")
def serve_cmd(warehouse, host, port) -> None:
    """Browse the warehouse in a web browser: search, features, sources, runs, SQL (read-only).

    Every view is a URL; nothing is written. Builds the find index first when there is none."""
    import uvicorn

    from ..outputs import find, web

    settings = Settings.from_env(warehouse=warehouse)
    try:
        warehouse_mod.connect(settings, read_only=True).close()
        try:
            find.Finder(settings).close()
        except find.FindIndexMissing:
            click.echo("building the find index (search, similar, by-token) ...", err=True)
            find.build_index(settings)
        app = web.make_app(settings, host=host)
    except (*_USER_ERRORS, find.FindIndexUnwritable) as exc:
        raise click.ClickException(str(exc)) from None
    if host not in ("127.0.0.1", "localhost", "::1"):
        click.echo(f"warning: listening on {host}: anyone who can reach this machine on port {port} can read the "
                   "whole warehouse (there is no login)", err=True)
    click.echo(f"featurehouse: http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}/ (Ctrl-C stops it)",
               err=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")
