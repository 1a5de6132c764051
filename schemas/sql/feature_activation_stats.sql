-- feature_activation_stats: one row per (model_id, source_id, feature_index, data_source).
-- A NULL data_source is its own group. Computed from the temp view stats_activations: one row
-- per activation (excerpt) of the features being refreshed (the caller replaces their rows),
-- already reduced to its token count and its active (token, value) pairs (pipeline/materialise.py,
-- _EXCERPT_COLUMNS) — from the activations table, or, inside a load, from the batch's staged
-- rows for the features whose activations it replaces.
WITH per_excerpt AS (
    SELECT
        model_id, source_id, feature_index, data_source,
        max_value, n_tokens,
        -- the active tokens are the pairs with a value above 0 (one pair per such value)
        len(active_pairs)                                              AS n_active_tokens,
        coalesce(list_sum(list_transform(active_pairs, p -> p.value)), 0) AS sum_active
    FROM stats_activations
),

token_best AS (
    SELECT model_id, source_id, feature_index, data_source, token, max(value) AS best
    FROM (
        -- only active tokens are unnested: a few percent of all tokens
        SELECT model_id, source_id, feature_index, data_source, unnest(active_pairs) AS pair
        FROM stats_activations
    )
    CROSS JOIN LATERAL (SELECT pair.token AS token, pair.value AS value)
    GROUP BY ALL
),

top AS (
    -- ties broken by the token, so the list never depends on the order rows were read in
    SELECT model_id, source_id, feature_index, data_source,
           list({'token': token, 'activation': best} ORDER BY best DESC, token)[1:10] AS top_tokens
    FROM token_best
    GROUP BY ALL
),

per_group AS (
    SELECT
        model_id, source_id, feature_index, data_source,
        count(*)                                    AS n_examples,
        sum(n_tokens)                               AS n_tokens,
        sum(n_active_tokens)                        AS n_active_tokens,
        sum(n_active_tokens) / nullif(sum(n_tokens), 0) AS active_token_fraction,
        max(max_value)                              AS max_activation,
        avg(max_value)                              AS mean_max_activation,
        sum(sum_active) / nullif(sum(n_active_tokens), 0) AS mean_active_activation
    FROM per_excerpt
    GROUP BY ALL
)

SELECT
    g.*,
    coalesce(t.top_tokens, []) AS top_tokens,
    now() AT TIME ZONE 'UTC'   AS refreshed_at  -- UTC, whatever the session time zone
FROM per_group AS g
LEFT JOIN top AS t
    ON  t.model_id = g.model_id AND t.source_id = g.source_id
    AND t.feature_index = g.feature_index
    AND t.data_source IS NOT DISTINCT FROM g.data_source
