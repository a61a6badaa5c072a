-- Keys and ledger: the columns of carpool/economics/db.py's SCHEMA (one description of what each column means,
-- there; check_postgres holds these tables to its column names), in PostgreSQL's types: DOUBLE PRECISION for
-- times and dollars (PostgreSQL's REAL is 4 bytes, SQLite's is 8).
CREATE TABLE keys (
    key_id TEXT PRIMARY KEY,
    key_hash TEXT NOT NULL UNIQUE,
    tenant TEXT NOT NULL,
    is_admin INTEGER NOT NULL DEFAULT 0,
    allowed_tiers TEXT,
    budget DOUBLE PRECISION,
    budget_period TEXT CHECK (budget_period IN ('day', 'month')),
    rpm INTEGER,
    tpm INTEGER,
    created DOUBLE PRECISION NOT NULL,
    revoked DOUBLE PRECISION
);
CREATE TABLE ledger (
    id BIGSERIAL PRIMARY KEY,
    time DOUBLE PRECISION NOT NULL,
    request_id TEXT,
    key_id TEXT,
    tenant TEXT,
    model TEXT NOT NULL,
    tier TEXT NOT NULL,
    uncached_prompt_tokens INTEGER NOT NULL,
    cache_read_tokens INTEGER NOT NULL,
    cache_write_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    queue_seconds DOUBLE PRECISION NOT NULL,
    prefill_seconds DOUBLE PRECISION NOT NULL,
    decode_seconds DOUBLE PRECISION NOT NULL,
    finish_reason TEXT NOT NULL,
    cost DOUBLE PRECISION NOT NULL,
    purpose TEXT NOT NULL DEFAULT 'request',
    parent_request_id TEXT,
    cascade TEXT,
    cascade_step INTEGER,
    cascade_accepted INTEGER,
    constraint_kind TEXT,
    original_prompt_tokens INTEGER
);
CREATE INDEX ledger_time ON ledger (time);
CREATE INDEX ledger_key_time ON ledger (key_id, time);

-- Shared admission (carpool/economics/shared_admission.py): what every replica holds budgets and rate limits to.
-- Each key's spend per budget period, raised in the transaction that writes the request's ledger row.
CREATE TABLE budget_spend (
    key_id TEXT NOT NULL,
    period TEXT NOT NULL CHECK (period IN ('day', 'month')),
    period_start DOUBLE PRECISION NOT NULL,  -- unix time the UTC day or month began
    spent DOUBLE PRECISION NOT NULL DEFAULT 0,
    PRIMARY KEY (key_id, period, period_start)
);
-- What admitted requests may still cost: taken at admission, deleted with the request's ledger row. A replica
-- that dies leaves its reservations behind; they lapse at expires_at, which a live replica keeps pushing ahead.
CREATE TABLE reservations (
    id BIGSERIAL PRIMARY KEY,
    key_id TEXT NOT NULL,
    holder TEXT NOT NULL,                    -- the replica (gate) that admitted the request
    amount DOUBLE PRECISION NOT NULL,        -- dollars: the request's worst case
    created DOUBLE PRECISION NOT NULL,
    expires_at DOUBLE PRECISION NOT NULL
);
CREATE INDEX reservations_key ON reservations (key_id, expires_at);
CREATE INDEX reservations_holder ON reservations (holder);
-- Every admission of a rate-limited key in the last minute (the sliding window of carpool/economics/rate_limit.py).
CREATE TABLE rate_events (
    key_id TEXT NOT NULL,
    admitted_at DOUBLE PRECISION NOT NULL,
    tokens INTEGER NOT NULL
);
CREATE INDEX rate_events_key_time ON rate_events (key_id, admitted_at);
