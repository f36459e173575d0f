-- Claims of central bucketd instances that split delta messages with a shared subscription
-- ([central] claims_postgres, docs/FLEET.md). Each delta message, named by its gateway and its
-- position in that gateway's stream, is claimed by the first instance that receives it; only
-- that instance applies it, so a gateway's resend handed to another instance is not applied
-- twice. bucketd runs this file (idempotently, under an advisory lock) at every connection.
-- Trimmed by bucketd to the newest central.claims_keep_entries sequence numbers per gateway.
CREATE TABLE IF NOT EXISTS bucketd_claims (
    gateway_id text        NOT NULL,
    origin     text        NOT NULL,  -- the gateway database's creation time
    seq        bigint      NOT NULL,
    part       integer     NOT NULL,
    instance   text        NOT NULL,  -- the claiming central's mqtt.client_id
    claimed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (gateway_id, origin, seq, part)
);
