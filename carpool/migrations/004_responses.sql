-- The Responses API's stored responses (carpool/server/responses_api/store.py), for replicas sharing a PostgreSQL
-- --db: any replica answers GET /v1/responses/{id} and continues a previous_response_id.
CREATE TABLE responses (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,                     -- the API key's id ('' on an open server): no other key sees the row
    created_at BIGINT NOT NULL,
    response TEXT NOT NULL,                  -- JSON: the response object as it was answered
    context TEXT NOT NULL                    -- JSON: the input items it answered, earlier turns' included
);
CREATE INDEX responses_owner ON responses (owner, created_at);
