-- Re-keys bucketd_buckets from (series, start), as releases before issue 57 made it, to
-- (gateway_id, series, start), once, in one transaction. Run as the table's owner:
--
--   psql -d fleet -v ON_ERROR_STOP=1 -f migrate-gateway-key.sql
--
-- Needed before distributing the table on Citus (deploy/postgres/citus.sql: Citus wants the
-- distribution column in the key). On a single PostgreSQL server optional: bucketd works with
-- either key (it finds which when it connects), but with this one the query node lists each
-- gateway's series without touching the others'.
--
-- It rebuilds the key's index on every month partition and holds an exclusive lock on the
-- table meanwhile: gateways' transactions and query nodes' reads wait (about as long as a
-- CREATE INDEX over the table). Gateways connected before keep their old statements, whose
-- ON CONFLICT names the old key: restart them afterwards (or let them reconnect after their
-- first failed batch, which they retry).

BEGIN;
LOCK TABLE bucketd_buckets IN ACCESS EXCLUSIVE MODE;
DO $$
DECLARE
    key text;
BEGIN
    SELECT string_agg(a.attname::text, ', ' ORDER BY k.n) INTO key
    FROM pg_index i
    CROSS JOIN LATERAL unnest(i.indkey) WITH ORDINALITY AS k(attnum, n)
    JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
    WHERE i.indrelid = 'bucketd_buckets'::regclass AND i.indisprimary;
    IF key = 'gateway_id, series, start' THEN
        RAISE NOTICE 'bucketd_buckets is keyed (gateway_id, series, start) already: nothing to do';
    ELSIF key = 'series, start' THEN
        ALTER TABLE bucketd_buckets DROP CONSTRAINT bucketd_buckets_pkey;
        ALTER TABLE bucketd_buckets ADD PRIMARY KEY (gateway_id, series, start);
    ELSE
        RAISE EXCEPTION 'bucketd_buckets has the key (%), which is not bucketd''s', key;
    END IF;
END
$$;
COMMIT;
