-- The materialised aggregate tables; their contents come from
-- feature_activation_stats.sql and source_activation_stats.sql.

CREATE TABLE IF NOT EXISTS feature_activation_stats (
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

CREATE TABLE IF NOT EXISTS source_activation_stats (
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
