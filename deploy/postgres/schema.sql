-- bucketd's fleet tier in PostgreSQL (docs/FLEET.md). bucketd runs this itself, under an
-- advisory lock, when it connects; an operator may run it first (psql -f schema.sql).
--
-- One row per (series, hour) over the whole fleet. Series are '<gateway_id>:<sensor>/<metric>'.
-- Gateways add their per-commit deltas with INSERT ... ON CONFLICT DO UPDATE increments;
-- `sketch` (the quantile sketch, bucketd's binary encoding) cannot be merged in SQL: the
-- forwarder locks the row, merges it, and writes the result in the same statement.
--
-- Citus:       SELECT create_distributed_table('bucketd_buckets', 'series');
--              SELECT create_reference_table('bucketd_gateways');
-- TimescaleDB: SELECT create_hypertable('bucketd_buckets', 'start',
--                                       chunk_time_interval => interval '7 days');
-- (the primary key holds both the distribution column and the time column, as both require).

CREATE TABLE IF NOT EXISTS bucketd_buckets (
    series      text             NOT NULL,
    start       timestamptz      NOT NULL,
    gateway_id  text             NOT NULL,
    sensor      text             NOT NULL,
    metric      text             NOT NULL,
    width_secs  integer          NOT NULL,
    count       bigint           NOT NULL,
    -- The sum is sum + sum_comp (compensated summation, as in bucketd's own buckets).
    sum         double precision NOT NULL,
    sum_comp    double precision NOT NULL,
    min         double precision NOT NULL,
    max         double precision NOT NULL,
    -- Nanoseconds since the Unix epoch.
    first_ts_ns bigint           NOT NULL,
    first_value double precision NOT NULL,
    last_ts_ns  bigint           NOT NULL,
    last_value  double precision NOT NULL,
    -- Mean and sum of squared deviations (variance = m2 / (count - 1)).
    mean        double precision NOT NULL,
    m2          double precision NOT NULL,
    sketch      bytea            NOT NULL,
    PRIMARY KEY (series, start)
);

-- The last outbox entry of each gateway applied here, updated in the same transaction as the
-- rows it changed: a retry of an entry at or below it changes nothing (exactly once).
CREATE TABLE IF NOT EXISTS bucketd_gateways (
    gateway_id text        PRIMARY KEY,
    last_seq   bigint      NOT NULL,
    -- The gateway database's creation time: a replaced database numbers from 0 again.
    origin     text        NOT NULL DEFAULT '',
    updated_at timestamptz NOT NULL DEFAULT now()
);
ALTER TABLE bucketd_gateways ADD COLUMN IF NOT EXISTS origin text NOT NULL DEFAULT '';
