-- source_activation_stats: one row per (model_id, source_id, data_source), over its features.
-- A NULL data_source is its own group. Computed from feature_activation_stats for the sources
-- listed in the temp table changed_sources(model_id, source_id); the caller replaces their rows.
WITH source AS (
    SELECT f.*
    FROM feature_activation_stats AS f
    SEMI JOIN changed_sources AS c USING (model_id, source_id)
)

SELECT
    model_id, source_id, data_source,
    count(*)                                        AS n_features,
    sum(n_examples)                                 AS n_examples,
    sum(n_tokens)                                   AS n_tokens,
    sum(n_active_tokens)                            AS n_active_tokens,
    sum(n_active_tokens) / nullif(sum(n_tokens), 0) AS active_token_fraction,
    max(max_activation)                             AS max_activation,
    avg(max_activation)                             AS mean_feature_max_activation,
    median(max_activation)                          AS median_feature_max_activation,
    sum(mean_active_activation * n_active_tokens) / nullif(sum(n_active_tokens), 0)
                                                    AS mean_active_activation,
    now() AT TIME ZONE 'UTC'                        AS refreshed_at  -- UTC, whatever the session time zone
FROM source
GROUP BY ALL
