-- Key scopes and the audit log (carpool/economics/db.py's SCHEMA describes each column). A key made before scopes
-- keeps NULL: carpool.economics.keys.ApiKey.from_row reads an admin one (is_admin = 1) as ADMIN_SCOPES
-- (usage:read, batches:read-all), never files:read-all.
ALTER TABLE keys ADD COLUMN scopes TEXT;
CREATE TABLE audit_log (
    id BIGSERIAL PRIMARY KEY,
    time DOUBLE PRECISION NOT NULL,
    key_id TEXT,
    tenant TEXT,
    action TEXT NOT NULL,
    target TEXT NOT NULL,
    owner TEXT
);
-- A billed row's request_id is unique (carpool/economics/ledger.py): a second row under the id is written withheld.
CREATE UNIQUE INDEX ledger_request_id ON ledger (request_id) WHERE finish_reason <> 'withheld';
