-- featurehouse warehouse: the tables users query. Applied idempotently on every connect.
-- Timestamps are TIMESTAMP in UTC. Keys are natural keys; loads upsert by them.

CREATE TABLE IF NOT EXISTS runs (
    run_id              VARCHAR PRIMARY KEY,
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
    n_expectations      BIGINT DEFAULT 0,
    n_expectations_failed BIGINT DEFAULT 0,
    error               VARCHAR,
    report_path         VARCHAR
);

-- One row per distinct input (by content). The bytes are under landing/sha256/<ab>/<sha256>.
CREATE TABLE IF NOT EXISTS raw_inputs (
    input_sha256        VARCHAR NOT NULL,
    origin              VARCHAR NOT NULL,        -- file path or URL it first came from
    format              VARCHAR,                 -- api_json | flight | html | export_jsonl | unknown, "gzip+" when compressed
    n_bytes             BIGINT NOT NULL,
    received_at         TIMESTAMP NOT NULL,
    run_id              VARCHAR NOT NULL,        -- run that first landed it
    status              VARCHAR NOT NULL,        -- landed | loaded | rejected
    reason              VARCHAR,                 -- why it was rejected, in words a person can act on
    landed_path         VARCHAR NOT NULL,
    n_features          BIGINT,
    n_activations       BIGINT,
    n_explanations      BIGINT
);

-- Every time a run saw an input (including re-sends of bytes already landed).
CREATE TABLE IF NOT EXISTS run_inputs (
    run_id              VARCHAR NOT NULL,
    input_sha256        VARCHAR NOT NULL,
    origin              VARCHAR NOT NULL,
    outcome             VARCHAR NOT NULL         -- loaded | rejected | duplicate
);

CREATE TABLE IF NOT EXISTS models (
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

CREATE TABLE IF NOT EXISTS source_sets (
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

CREATE TABLE IF NOT EXISTS sources (
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

-- Large tables carry no index: loads replace by key with a delete + insert in one transaction.
CREATE TABLE IF NOT EXISTS features (
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
    input_sha256        VARCHAR,
    run_id              VARCHAR,
    loaded_at           TIMESTAMP
);

CREATE TABLE IF NOT EXISTS activations (
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
    input_sha256        VARCHAR,
    run_id              VARCHAR,
    loaded_at           TIMESTAMP
);

CREATE TABLE IF NOT EXISTS explanations (
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
    input_sha256        VARCHAR,
    run_id              VARCHAR,
    loaded_at           TIMESTAMP
);

CREATE TABLE IF NOT EXISTS quarantine (
    run_id              VARCHAR NOT NULL,
    input_sha256        VARCHAR,
    record_kind         VARCHAR NOT NULL,        -- feature | activation | explanation
    record_key          VARCHAR,
    check_name          VARCHAR NOT NULL,        -- the failed expectation
    detail              VARCHAR NOT NULL,        -- what was wrong, with the offending values
    record_json         JSON,
    quarantined_at      TIMESTAMP
);

CREATE TABLE IF NOT EXISTS validation_results (
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
