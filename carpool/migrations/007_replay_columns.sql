-- What a replay of the recorded traffic needs (`carpool cost whatif`): the columns of carpool/economics/db.py's
-- SCHEMA of the same names (SQLite gets them from its ADDED_COLUMNS). Rows written before have neither: NULL.
ALTER TABLE ledger ADD COLUMN arrived DOUBLE PRECISION;
ALTER TABLE ledger ADD COLUMN prompt_block_chain TEXT;
