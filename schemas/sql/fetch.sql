-- fetch_failures: one row per URL a fetch could not land, per ingest run that recorded it
-- (pipeline.fetch.ingest_fetched). status is 'failed' (the retry budget was spent; last_error
-- says why) or 'not_found' (HTTP 404). Re-running the fetch with the same window retries them.
CREATE TABLE IF NOT EXISTS fetch_failures (
    run_id              VARCHAR NOT NULL,        -- the ingest run that recorded the failure
    "window"            VARCHAR NOT NULL,        -- the fetch window (Airflow: the data interval)
    url                 VARCHAR NOT NULL,
    feature_key         VARCHAR,                 -- model/source/index, model/source/offset/N, or the export key
    status              VARCHAR NOT NULL,        -- failed | not_found
    attempts            INTEGER,
    last_error          VARCHAR,                 -- never carries the API key
    recorded_at         TIMESTAMP NOT NULL
);
