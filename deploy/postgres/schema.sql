-- bucketd's fleet tier in PostgreSQL (docs/FLEET.md). bucketd runs this itself, under an
-- advisory lock, when it connects; an operator may run it first (psql -f schema.sql).
--
-- One row per (series, hour) over the whole fleet. Series are '<gateway_id>:<sensor>/<metric>'.
-- A gateway applies a batch of its outbox in one transaction: its bucketd_gateways row locked,
-- the batch's rows read (their sketches: bucketd's binary encoding, which SQL cannot merge),
-- staged (bucketd_staging, below) and moved in by one INSERT ... SELECT ... ON CONFLICT DO
-- UPDATE that adds the batch's deltas, with the sketch merged by the forwarder and
-- p50/p90/p99 recomputed from it.
--
-- Partitioned by month of `start` (bucketd_buckets_y2026m11 and so on), made by
-- bucketd_ensure_partitions as gateways need them; fleet retention (upstream.postgres_retention)
-- drops whole partitions (bucketd_drop_partitions_before), never deletes rows.
--
-- The primary key leads with the gateway (issue 57): a gateway's batch reads and writes only
-- its own rows, the query node lists each gateway's series with one index probe a series, and
-- Citus can distribute by gateway_id. A table keyed (series, start) by an earlier release keeps
-- working (bucketd finds the key when it connects); deploy/postgres/migrate-gateway-key.sql
-- moves it, once, and Citus needs that first.
--
-- Citus:       deploy/postgres/citus.sql, on the coordinator after this file and before
--              roles.sql: bucketd_buckets and bucketd_gateways distributed by gateway_id and
--              co-located, so that one gateway's batch is one shard's transaction (docs/FLEET.md,
--              "Citus", step by step; tested by tests/it/fleet/citus.rs).
-- TimescaleDB: make bucketd_buckets a plain table with the same columns and key and
--              SELECT create_hypertable('bucketd_buckets', 'start',
--                                       chunk_time_interval => interval '7 days');
--              before bucketd first connects: bucketd accepts a hypertable in place of the
--              partitioned table, and its partition functions then do nothing (use
--              TimescaleDB's drop_chunks for retention). Untested: TimescaleDB is not
--              installed where bucketd is tested.

-- A table made by a release before partitions is not changed behind the operator's back: its
-- rows may be many. deploy/postgres/migrate-partitioned.sql moves them, once.
DO $$
DECLARE
    hypertable boolean := false;
BEGIN
    IF to_regclass('_timescaledb_catalog.hypertable') IS NOT NULL THEN
        EXECUTE 'SELECT EXISTS (SELECT FROM _timescaledb_catalog.hypertable
                                WHERE table_name = ''bucketd_buckets'')' INTO hypertable;
    END IF;
    IF NOT hypertable AND EXISTS (SELECT FROM pg_class
                                  WHERE oid = to_regclass('bucketd_buckets') AND relkind = 'r') THEN
        RAISE EXCEPTION 'bucketd_buckets is not partitioned (an older bucketd made it): migrate '
                        'it once, as the table''s owner: psql -d <database> -v ON_ERROR_STOP=1 '
                        '-f deploy/postgres/migrate-partitioned.sql'
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
END
$$;

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
    -- Quantiles of the merged sketch, recomputed whenever the row is written (within the
    -- sketch's relative accuracy, clamped to min and max; NULL when the sketch does not cover
    -- every reading): for SQL clients such as Grafana's PostgreSQL data source.
    p50         double precision,
    p90         double precision,
    p99         double precision,
    -- A counter's increase over the row's readings in time order, resets counted (issue 77),
    -- and the count it is the increase of: valid only while inc_count = count (a gateway of a
    -- release before it adds a delta without it, and the row's increase is then unknown).
    inc         double precision,
    inc_count   bigint,
    PRIMARY KEY (gateway_id, series, start)
) PARTITION BY RANGE (start);
-- Changes to a table that exists are made only when missing: ALTER TABLE and CREATE INDEX lock
-- the table even when IF NOT EXISTS finds nothing to do, and a gateway connecting while others
-- write would deadlock with them.
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_attribute
                   WHERE attrelid = 'bucketd_buckets'::regclass AND attname = 'p50') THEN
        ALTER TABLE bucketd_buckets ADD COLUMN IF NOT EXISTS p50 double precision,
                                    ADD COLUMN IF NOT EXISTS p90 double precision,
                                    ADD COLUMN IF NOT EXISTS p99 double precision;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_attribute
                   WHERE attrelid = 'bucketd_buckets'::regclass AND attname = 'inc') THEN
        ALTER TABLE bucketd_buckets ADD COLUMN IF NOT EXISTS inc double precision,
                                    ADD COLUMN IF NOT EXISTS inc_count bigint;
    END IF;
    -- A gateway's series over a range.
    IF to_regclass('bucketd_buckets_gateway') IS NULL THEN
        CREATE INDEX IF NOT EXISTS bucketd_buckets_gateway ON bucketd_buckets (gateway_id, start);
    END IF;
END
$$;

-- A batch's rows on their way in (issue 57): a gateway copies them here (binary COPY) and moves
-- them into bucketd_buckets with one INSERT ... SELECT ... ON CONFLICT, in its batch's
-- transaction, which deletes them again; nothing a gateway stages outlives its transaction. On Citus,
-- distributed by gateway_id beside bucketd_buckets (citus.sql), the move runs on the gateway's
-- shard and the values reach the worker as PostgreSQL's binary: a multi-row INSERT ... VALUES
-- reached it as SQL text, parsed and planned for each statement (3x slower). Unlogged: a crash
-- empties it, which is what it holds between transactions anyway.
CREATE UNLOGGED TABLE IF NOT EXISTS bucketd_staging (
    -- A random number of the batch's own: a batch moves only rows with its token (row-level
    -- security cannot guard this table: PostgreSQL refuses COPY FROM into one with policies).
    batch bigint NOT NULL,
    -- bucketd_buckets' columns, with their NOT NULLs (not its key or partitions).
    LIKE bucketd_buckets
);
-- A batch finds its own rows by its token, past the deleted rows of earlier batches that
-- autovacuum has not reached yet (on gateway_id alone, each batch walked all of them: a
-- gateway's drain into Citus slowed from 61,000 to 40,000 deltas/s from one run to the next).
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_attribute
                   WHERE attrelid = 'bucketd_staging'::regclass AND attname = 'inc') THEN
        ALTER TABLE bucketd_staging ADD COLUMN IF NOT EXISTS inc double precision,
                                    ADD COLUMN IF NOT EXISTS inc_count bigint;
    END IF;
    IF to_regclass('bucketd_staging_batch') IS NULL THEN
        CREATE INDEX IF NOT EXISTS bucketd_staging_batch ON bucketd_staging (gateway_id, batch);
    END IF;
END
$$;

-- The last outbox entry of each gateway applied here, updated in the same transaction as the
-- rows it changed: a retry of an entry at or below it changes nothing (exactly once).
CREATE TABLE IF NOT EXISTS bucketd_gateways (
    gateway_id text        PRIMARY KEY,
    last_seq   bigint      NOT NULL,
    -- The gateway database's creation time: a replaced database numbers from 0 again.
    origin     text        NOT NULL DEFAULT '',
    updated_at timestamptz NOT NULL DEFAULT now()
);
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_attribute
                   WHERE attrelid = 'bucketd_gateways'::regclass AND attname = 'origin') THEN
        ALTER TABLE bucketd_gateways ADD COLUMN IF NOT EXISTS origin text NOT NULL DEFAULT '';
    END IF;
END
$$;

-- The month partitions holding `starts`, made where missing; returns how many were made.
-- SECURITY DEFINER: a gateway's role (roles.sql) may not create tables, but may call this.
-- Called by bucketd in a transaction of its own (creating a partition locks the parent table).
CREATE OR REPLACE FUNCTION bucketd_ensure_partitions(starts timestamptz[]) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT SET TimeZone = 'UTC' AS $$
DECLARE
    month timestamptz;
    name text;
    made integer := 0;
BEGIN
    IF (SELECT relkind FROM pg_class WHERE oid = to_regclass('bucketd_buckets')) IS DISTINCT FROM 'p' THEN
        RETURN 0;  -- a TimescaleDB hypertable
    END IF;
    FOR month IN SELECT DISTINCT date_trunc('month', s) FROM unnest(starts) AS s LOOP
        -- Bounded: a gateway's role may call this, and one partition a month for twenty years
        -- back is the most it can make.
        IF month < date_trunc('month', now()) - interval '20 years'
           OR month > date_trunc('month', now()) + interval '2 months' THEN
            RAISE EXCEPTION 'no partition of bucketd_buckets is made for %: more than 20 years '
                            'before or 2 months after now', month
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        name := 'bucketd_buckets_' || to_char(month, '"y"YYYY"m"MM');
        IF to_regclass(name) IS NULL THEN
            -- Two gateways may make the same month at once: the second finds it made.
            BEGIN
                EXECUTE format('CREATE TABLE %I PARTITION OF bucketd_buckets '
                               'FOR VALUES FROM (%L) TO (%L)',
                               name, month, month + interval '1 month');
                made := made + 1;
            EXCEPTION WHEN duplicate_table OR unique_violation THEN
                NULL;
            END;
        END IF;
    END LOOP;
    RETURN made;
END
$$;

-- Drops the month partitions that end at or before `cutoff` (fleet retention); returns how
-- many. Whole partitions: no row-by-row delete, no vacuum debt.
CREATE OR REPLACE FUNCTION bucketd_drop_partitions_before(cutoff timestamptz) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT SET TimeZone = 'UTC' AS $$
DECLARE
    part record;
    dropped integer := 0;
BEGIN
    FOR part IN
        SELECT c.relname
        FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
        WHERE i.inhparent = to_regclass('bucketd_buckets')
          AND c.relname ~ '^bucketd_buckets_y[0-9]{4}m[0-9]{2}$'
    LOOP
        IF to_timestamp(substr(part.relname, 18, 4) || substr(part.relname, 23, 2), 'YYYYMM')
               + interval '1 month' <= cutoff THEN
            BEGIN
                EXECUTE format('DROP TABLE %I', part.relname);
                dropped := dropped + 1;
            EXCEPTION WHEN undefined_table THEN
                NULL;  -- dropped meanwhile by another gateway's retention
            END;
        END IF;
    END LOOP;
    RETURN dropped;
END
$$;
REVOKE ALL ON FUNCTION bucketd_ensure_partitions(timestamptz[]) FROM PUBLIC;
REVOKE ALL ON FUNCTION bucketd_drop_partitions_before(timestamptz) FROM PUBLIC;
