-- Moves a bucketd_buckets table made by a release before partitions (docs/FLEET.md) into the
-- partitioned table, once, in one transaction. Run as the table's owner, from this directory:
--
--   psql -d fleet -v ON_ERROR_STOP=1 -f migrate-partitioned.sql
--
-- Gateways may keep running: their transactions wait for it (it locks the old table), and a
-- gateway that connects meanwhile is told to run this. Takes about as long as copying the
-- table; p50/p90/p99 of the moved rows stay NULL until a gateway writes the row again.
-- If roles.sql was used, run it again afterwards: its policies were on the old table.

BEGIN;
LOCK TABLE bucketd_buckets IN ACCESS EXCLUSIVE MODE;
ALTER TABLE bucketd_buckets RENAME TO bucketd_buckets_unpartitioned;
ALTER INDEX bucketd_buckets_pkey RENAME TO bucketd_buckets_unpartitioned_pkey;
\ir schema.sql
SELECT bucketd_ensure_partitions(array_agg(DISTINCT date_trunc('month', start)))
FROM bucketd_buckets_unpartitioned;
INSERT INTO bucketd_buckets (series, start, gateway_id, sensor, metric, width_secs, count, sum,
    sum_comp, min, max, first_ts_ns, first_value, last_ts_ns, last_value, mean, m2, sketch)
SELECT series, start, gateway_id, sensor, metric, width_secs, count, sum, sum_comp, min, max,
    first_ts_ns, first_value, last_ts_ns, last_value, mean, m2, sketch
FROM bucketd_buckets_unpartitioned;
DROP TABLE bucketd_buckets_unpartitioned;
COMMIT;
