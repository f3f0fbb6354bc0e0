-- The rule fragments the SQLite room's grants share (durable_singleton.stores.sqlite), the
-- same text as sql/postgresql/admission.sql's and durable_singleton.admission's SQL spellings
-- (tests/test_sql_blocks.py checks each against its twin).

-- fragment: limit_in_force
-- The limit in force (K2): the override, else the declared limit, never below 1:
-- admission.limit_in_force_sql_text(declared, override).
(CASE WHEN COALESCE({{override}}, {{declared}}, 1) < 1 THEN 1 ELSE COALESCE({{override}}, {{declared}}, 1) END)

-- fragment: free_slots
-- A key's free slots (S5, K2): none while paused, else limit - holders, never negative (each
-- argument bracketed: holders may be a sum, S12):
-- admission.free_slots_sql_text(lim, holders, paused).
(CASE WHEN COALESCE({{paused}}, FALSE) THEN 0 WHEN ({{lim}}) > ({{holders}}) THEN ({{lim}}) - ({{holders}}) ELSE 0 END)

-- fragment: holds_slot
-- The run {{run}} holds a slot of its key (S5, S12): a tracked holder not ended, or an untracked
-- run of an older release that runs or is parked: admission.holds_slot_sql_text(run).
(({{run}}.singleton_key IS NOT NULL AND {{run}}.singleton_slot = 'holder' AND {{run}}.status IN ('pending', 'running', 'suspended', 'blocked')) OR ({{run}}.singleton_key IS NOT NULL AND NOT {{run}}.singleton_tracked AND {{run}}.status IN ('running', 'suspended', 'blocked')))

-- fragment: legacy_holder
-- The run {{run}} is an older release's untracked holder (S12): admission.legacy_holder_sql_text(run).
({{run}}.singleton_key IS NOT NULL AND NOT {{run}}.singleton_tracked AND {{run}}.status IN ('running', 'suspended', 'blocked'))

