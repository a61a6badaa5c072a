-- Prompt tokens written under a cache breakpoint's TTL pin (Anthropic's cache_control), by TTL: the columns of
-- carpool/economics/db.py's SCHEMA of the same names (SQLite gets them from its ADDED_COLUMNS). Rows written
-- before had no pins: 0. ADD COLUMN with a constant default rewrites no row on PostgreSQL 11 and later.
ALTER TABLE ledger ADD COLUMN cache_write_5m_tokens INTEGER NOT NULL DEFAULT 0;
ALTER TABLE ledger ADD COLUMN cache_write_1h_tokens INTEGER NOT NULL DEFAULT 0;
