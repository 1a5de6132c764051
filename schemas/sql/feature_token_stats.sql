-- feature_token_stats: one row per (model_id, source_id, feature_index, data_source, token),
-- for every token on which an excerpt of the feature is active (activation > 0). A NULL
-- data_source is its own group. Computed, as feature_activation_stats is, from the temp view
-- stats_activations (one row per excerpt of the features being refreshed, reduced to its
-- active (token, value) pairs and its peak token: pipeline/stages/materialise.py, EXCERPT).
WITH active AS (
    SELECT model_id, source_id, feature_index, data_source, pair.token AS token, pair.value AS value
    FROM (
        SELECT model_id, source_id, feature_index, data_source, unnest(active_pairs) AS pair
        FROM stats_activations
    )
),

per_token AS (
    SELECT model_id, source_id, feature_index, data_source, token,
           max(value)  AS max_activation,
           count(*)    AS n_active
    FROM active
    WHERE token IS NOT NULL
    GROUP BY ALL
),

peaks AS (
    -- an excerpt peaks on the token at its max_value_token_index, when it is active there
    SELECT model_id, source_id, feature_index, data_source, peak_token AS token,
           count(*) AS n_peak_excerpts
    FROM stats_activations
    WHERE peak_token IS NOT NULL
    GROUP BY ALL
)

SELECT
    t.model_id, t.source_id, t.feature_index, t.data_source, t.token,
    t.max_activation, t.n_active,
    coalesce(p.n_peak_excerpts, 0) AS n_peak_excerpts,
    now() AT TIME ZONE 'UTC'       AS refreshed_at  -- UTC, whatever the session time zone
FROM per_token AS t
LEFT JOIN peaks AS p
    ON  p.model_id = t.model_id AND p.source_id = t.source_id
    AND p.feature_index = t.feature_index
    AND p.data_source IS NOT DISTINCT FROM t.data_source
    AND p.token = t.token
