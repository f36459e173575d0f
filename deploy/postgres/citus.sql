-- The fleet's tables on a Citus cluster (docs/FLEET.md, "Citus", step by step). Run once on the
-- coordinator, in the fleet's database, as a superuser, after schema.sql and before roles.sql:
--
--   psql -d fleet -v ON_ERROR_STOP=1 -f schema.sql -f citus.sql -f roles.sql
--
-- Both tables distributed by gateway_id and co-located: a gateway's batch (its bucketd_gateways
-- row locked, its rows read and written) is a transaction on the one worker holding its
-- shard, routed there by Citus without a two-phase commit; a query node reading one gateway's
-- series reads one shard, a fleet-wide series every shard (docs/FLEET.md has the figures).
-- Month partitions made later (bucketd_ensure_partitions) are distributed with the table.
-- A table keyed (series, start) by an earlier release must be re-keyed first
-- (migrate-gateway-key.sql); one distributed by series (what earlier docs said) undistributed
-- first: SELECT undistribute_table('bucketd_buckets');

SELECT create_distributed_table('bucketd_buckets', 'gateway_id')
WHERE NOT EXISTS (SELECT FROM pg_dist_partition WHERE logicalrelid = 'bucketd_buckets'::regclass);
SELECT create_distributed_table('bucketd_gateways', 'gateway_id', colocate_with => 'bucketd_buckets')
WHERE NOT EXISTS (SELECT FROM pg_dist_partition WHERE logicalrelid = 'bucketd_gateways'::regclass);
