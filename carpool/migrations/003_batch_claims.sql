-- Who runs each unfinished batch: a lease the running server renews (carpool/server/batch/store.py). It replaces a
-- session advisory lock, which a dropped session freed at once while its server still ran the batch's lines.
-- Times are the database's clock (seconds since the epoch), so servers whose clocks differ agree on expiry.
CREATE TABLE batch_claims (
    batch_id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,                     -- the server (store) holding the lease
    expires_at DOUBLE PRECISION NOT NULL     -- free for another server from then on, unless renewed
);
