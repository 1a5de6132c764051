-- 0001: the warehouse's tables, as a DuckLake (DuckDB's lakehouse format: a SQL catalog and
-- Parquet data files). Migrations are applied in order, each in its own transaction, by the
-- first writer that opens an older warehouse (pipeline/warehouse.py); schema_version records them.
-- DuckLake has no primary keys or indexes: natural keys are kept unique by the loads, which
-- replace rows by key inside one transaction under the warehouse's commit lock.

-- No rows inline in the catalog: every insert writes Parquet (see 0003, which sets this for
-- warehouses created before it).
CALL featurehouse.set_option('data_inlining_row_limit', 0);
-- Timestamps are TIMESTAMP in UTC.

CREATE TABLE schema_version (
    version             INTEGER NOT NULL,        -- the migration's number
    name                VARCHAR NOT NULL,
    applied_at          TIMESTAMP NOT NULL,
    featurehouse_version VARCHAR                 -- the release that applied it
);

CREATE TABLE runs (
    run_id              VARCHAR NOT NULL,
    started_at          TIMESTAMP NOT NULL,
    finished_at         TIMESTAMP,
    status              VARCHAR NOT NULL,        -- running | succeeded | failed
    trigger             VARCHAR,                 -- cli | airflow | fetch | ...
    n_received          BIGINT DEFAULT 0,        -- inputs seen by this run
    n_landed            BIGINT DEFAULT 0,        -- inputs new to the landing area
    n_duplicates        BIGINT DEFAULT 0,        -- inputs already landed by an earlier run (skipped)
    n_loaded            BIGINT DEFAULT 0,        -- inputs parsed and loaded
    n_rejected          BIGINT DEFAULT 0,        -- inputs refused (see raw_inputs.reason)
    n_features          BIGINT DEFAULT 0,
    n_activations       BIGINT DEFAULT 0,
    n_explanations      BIGINT DEFAULT 0,
    n_quarantined       BIGINT DEFAULT 0,
    n_superseded        BIGINT DEFAULT 0,        -- captures not loaded: a newer one won (see superseded)
    n_expectations      BIGINT DEFAULT 0,
    n_expectations_failed BIGINT DEFAULT 0,
    commits             BIGINT DEFAULT 0,        -- snapshots this run committed
    commit_retries      BIGINT DEFAULT 0,        -- transactions retried after losing a commit race
    lock_wait_seconds   DOUBLE DEFAULT 0,        -- waiting for other writers' commits
    commit_seconds      DOUBLE DEFAULT 0,        -- inside its own commits (writing data files, the catalog)
    error               VARCHAR,
    report_path         VARCHAR
);

-- One row per distinct input (by content). The bytes are under landing/sha256/<ab>/<sha256>.
CREATE TABLE raw_inputs (
    input_sha256        VARCHAR NOT NULL,
    origin              VARCHAR NOT NULL,        -- file path or URL it first came from
    format              VARCHAR,                 -- api_json | flight | html | export_jsonl | unknown, "gzip+" when compressed
    n_bytes             BIGINT NOT NULL,
    received_at         TIMESTAMP NOT NULL,
    captured_at         TIMESTAMP,               -- when it was fetched, else the file's modification time
    run_id              VARCHAR NOT NULL,        -- run that first landed it
    status              VARCHAR NOT NULL,        -- landed | loaded | rejected
    reason              VARCHAR,                 -- why it was rejected, in words a person can act on
    landed_path         VARCHAR NOT NULL,
    n_features          BIGINT,
    n_activations       BIGINT,
    n_explanations      BIGINT
);

-- Every time a run saw an input (including re-sends of bytes already landed).
CREATE TABLE run_inputs (
    run_id              VARCHAR NOT NULL,
    input_sha256        VARCHAR NOT NULL,
    origin              VARCHAR NOT NULL,
    outcome             VARCHAR NOT NULL         -- loaded | rejected | duplicate
);

CREATE TABLE models (
    model_id            VARCHAR NOT NULL,
    display_name        VARCHAR,
    owner               VARCHAR,
    tlens_id            VARCHAR,
    n_layers            INTEGER,
    dimension           INTEGER,
    created_at          TIMESTAMP,
    updated_at          TIMESTAMP,
    extra               JSON,
    input_sha256        VARCHAR,
    loaded_at           TIMESTAMP
);

CREATE TABLE source_sets (
    model_id            VARCHAR NOT NULL,
    source_set_name     VARCHAR NOT NULL,
    description         VARCHAR,
    type_name           VARCHAR,
    creator_name        VARCHAR,
    release_name        VARCHAR,
    urls                VARCHAR[],
    created_at          TIMESTAMP,
    extra               JSON,
    input_sha256        VARCHAR,
    loaded_at           TIMESTAMP
);

CREATE TABLE sources (
    model_id            VARCHAR NOT NULL,
    source_id           VARCHAR NOT NULL,        -- Neuronpedia's "layer", e.g. 11-resid-post-aa
    source_set_name     VARCHAR,
    hf_repo_id          VARCHAR,
    hf_folder_id        VARCHAR,
    dataset             VARCHAR,
    num_tokens_in_prompt INTEGER,
    created_at          TIMESTAMP,
    extra               JSON,
    input_sha256        VARCHAR,
    loaded_at           TIMESTAMP
);

-- A feature page is a snapshot of its feature: loading one replaces the feature's row, its
-- activations and its explanations (see feature_captures). captured_at is when that capture was
-- made (fetched, or the file's modification time).
CREATE TABLE features (
    model_id            VARCHAR NOT NULL,
    source_id           VARCHAR NOT NULL,
    feature_index       BIGINT NOT NULL,
    source_set_name     VARCHAR,
    max_act_approx      DOUBLE,
    frac_nonzero        DOUBLE,
    pos_str             VARCHAR[],
    pos_values          DOUBLE[],
    neg_str             VARCHAR[],
    neg_values          DOUBLE[],
    hook_name           VARCHAR,
    has_vector          BOOLEAN,
    creator_id          VARCHAR,
    created_at          TIMESTAMP,
    extra               JSON,                    -- every other field of the page's feature row
    captured_at         TIMESTAMP,
    input_sha256        VARCHAR,
    run_id              VARCHAR,
    loaded_at           TIMESTAMP
);

CREATE TABLE activations (
    activation_id       VARCHAR NOT NULL,
    model_id            VARCHAR NOT NULL,
    source_id           VARCHAR NOT NULL,
    feature_index       BIGINT NOT NULL,
    data_source         VARCHAR,                 -- corpus split ("Chat", "Non-Chat"); NULL is its own group
    data_index          VARCHAR,
    tokens              VARCHAR[],
    "values"            DOUBLE[],
    max_value           DOUBLE,
    max_value_token_index INTEGER,
    min_value           DOUBLE,
    dfa_values          DOUBLE[],
    dfa_target_index    INTEGER,
    dfa_max_value       DOUBLE,
    loss_values         DOUBLE[],
    logit_contributions VARCHAR,
    bin_min             DOUBLE,
    bin_max             DOUBLE,
    bin_contains        DOUBLE,
    qualifying_token_index INTEGER,
    creator_id          VARCHAR,
    created_at          TIMESTAMP,
    captured_at         TIMESTAMP,
    input_sha256        VARCHAR,
    run_id              VARCHAR,
    loaded_at           TIMESTAMP
);

CREATE TABLE explanations (
    explanation_id      VARCHAR NOT NULL,
    model_id            VARCHAR NOT NULL,
    source_id           VARCHAR NOT NULL,
    feature_index       BIGINT NOT NULL,
    description         VARCHAR,
    explanation_model   VARCHAR,
    type_name           VARCHAR,
    author_id           VARCHAR,
    scores              JSON,
    created_at          TIMESTAMP,
    captured_at         TIMESTAMP,
    input_sha256        VARCHAR,
    run_id              VARCHAR,
    loaded_at           TIMESTAMP
);

-- feature_captures: one row per (feature, table) — which capture's rows the table holds now.
-- A capture replaces the feature's rows of a table unless it is older than this one (then it
-- is recorded in superseded). A feature page claims all three tables; an export batch of
-- features, activations or explanations claims only its own.
CREATE TABLE feature_captures (
    model_id            VARCHAR NOT NULL,
    source_id           VARCHAR NOT NULL,
    feature_index       BIGINT NOT NULL,
    table_name          VARCHAR NOT NULL,        -- features | activations | explanations
    captured_at         TIMESTAMP,
    input_sha256        VARCHAR NOT NULL,        -- the input the rows came from
    run_id              VARCHAR NOT NULL,
    loaded_at           TIMESTAMP NOT NULL
);

-- superseded: one row per (input, feature, table) whose capture did not load because a newer
-- capture of that feature won: another in the same batch, or the one already loaded.
CREATE TABLE superseded (
    run_id              VARCHAR NOT NULL,
    input_sha256        VARCHAR NOT NULL,
    model_id            VARCHAR NOT NULL,
    source_id           VARCHAR NOT NULL,
    feature_index       BIGINT NOT NULL,
    table_name          VARCHAR NOT NULL,
    captured_at         TIMESTAMP,
    kept_input_sha256   VARCHAR NOT NULL,        -- the capture that won
    kept_captured_at    TIMESTAMP,
    reason              VARCHAR NOT NULL,
    recorded_at         TIMESTAMP NOT NULL
);

CREATE TABLE quarantine (
    run_id              VARCHAR NOT NULL,
    input_sha256        VARCHAR,
    record_kind         VARCHAR NOT NULL,        -- feature | activation | explanation
    record_key          VARCHAR,
    check_name          VARCHAR NOT NULL,        -- the failed expectation
    detail              VARCHAR NOT NULL,        -- what was wrong, with the offending values
    record_json         JSON,
    quarantined_at      TIMESTAMP
);

CREATE TABLE validation_results (
    run_id              VARCHAR NOT NULL,
    batch_no            INTEGER NOT NULL,
    suite               VARCHAR NOT NULL,
    expectation         VARCHAR NOT NULL,        -- check name, from the suite's meta
    expectation_type    VARCHAR NOT NULL,
    kwargs              JSON,
    success             BOOLEAN NOT NULL,
    element_count       BIGINT,
    unexpected_count    BIGINT,
    unexpected_percent  DOUBLE,
    failing_keys        VARCHAR[],               -- up to 20 keys of failing records
    validated_at        TIMESTAMP
);

-- The materialised aggregate tables; their contents come from
-- schemas/sql/feature_activation_stats.sql and source_activation_stats.sql.

CREATE TABLE feature_activation_stats (
    model_id                VARCHAR NOT NULL,
    source_id               VARCHAR NOT NULL,
    feature_index           BIGINT NOT NULL,
    data_source             VARCHAR,             -- NULL is its own group
    n_examples              BIGINT,              -- activation excerpts
    n_tokens                BIGINT,              -- tokens over all excerpts
    n_active_tokens         BIGINT,              -- tokens with activation > 0
    active_token_fraction   DOUBLE,              -- n_active_tokens / n_tokens
    max_activation          DOUBLE,
    mean_max_activation     DOUBLE,              -- mean of the excerpts' max_value
    mean_active_activation  DOUBLE,              -- mean activation over active tokens
    top_tokens              STRUCT(token VARCHAR, activation DOUBLE)[],  -- distinct tokens by their highest activation, top 10
    refreshed_at            TIMESTAMP
);

CREATE TABLE source_activation_stats (
    model_id                VARCHAR NOT NULL,
    source_id               VARCHAR NOT NULL,
    data_source             VARCHAR,
    n_features              BIGINT,
    n_examples              BIGINT,
    n_tokens                BIGINT,
    n_active_tokens         BIGINT,
    active_token_fraction   DOUBLE,
    max_activation          DOUBLE,
    mean_feature_max_activation   DOUBLE,
    median_feature_max_activation DOUBLE,
    mean_active_activation  DOUBLE,
    refreshed_at            TIMESTAMP
);

-- fetch_failures: one row per URL a fetch could not land, per ingest run that recorded it
-- (pipeline.fetch.ingest_fetched). status is 'failed' (the retry budget was spent; last_error
-- says why) or 'not_found' (HTTP 404). Re-running the fetch with the same window retries them.
CREATE TABLE fetch_failures (
    run_id              VARCHAR NOT NULL,        -- the ingest run that recorded the failure
    "window"            VARCHAR NOT NULL,        -- the fetch window (Airflow: the data interval)
    url                 VARCHAR NOT NULL,
    feature_key         VARCHAR,                 -- model/source/index, model/source/offset/N, or the export key
    status              VARCHAR NOT NULL,        -- failed | not_found
    attempts            INTEGER,
    last_error          VARCHAR,                 -- never carries the API key
    recorded_at         TIMESTAMP NOT NULL
);

-- Row groups of 2,048 rows: an activation row holds two lists of up to 1,024 tokens and values,
-- so DuckLake's default (122,880 rows) would buffer a whole batch in memory before writing it.
CALL featurehouse.set_option('parquet_row_group_size', 2048);
