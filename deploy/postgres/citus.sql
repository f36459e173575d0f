-- The fleet's tables on a Citus cluster (docs/FLEET.md, "Citus", step by step). Run once on the
-- coordinator, in the fleet's database, as a superuser, after schema.sql and before roles.sql:
--
--   psql -d fleet -v ON_ERROR_STOP=1 -f schema.sql -f citus.sql -f roles.sql
--
-- The three tables distributed by gateway_id and co-located, one shard a worker: a gateway's
-- batch (its bucketd_gateways row locked, its rows read, staged in bucketd_staging and moved in)
-- is a transaction on the one worker holding its shard, routed there by Citus without a
-- two-phase commit; a query node reading one gateway's series reads one shard, a fleet-wide
-- series every shard (docs/FLEET.md has the figures).
-- Month partitions made later (bucketd_ensure_partitions) are distributed with the table.
-- A table keyed (series, start) by an earlier release must be re-keyed first
-- (migrate-gateway-key.sql); one distributed by series (what earlier docs said) undistributed
-- first: SELECT undistribute_table('bucketd_buckets');

-- One shard a worker (Citus's default is 32 in all): a fleet-wide series reads a shard of each
-- gateway it merges, one task a shard, and the coordinator's and the workers' cost per task is
-- most of such a read (docs/FLEET.md: 32 shards made a fleet-wide day 4.4x the single server's,
-- two a worker 2.4x with 16 gateways, one a worker 1.9-2.0x); a gateway's batch is one shard's
-- whatever the count. More workers later:
-- SELECT alter_distributed_table('bucketd_buckets', shard_count := <workers>,
--                                cascade_to_colocated := true);
SELECT create_distributed_table('bucketd_buckets', 'gateway_id',
    shard_count := greatest(1, (SELECT count(*)::int FROM pg_dist_node
                                WHERE noderole = 'primary' AND groupid <> 0)))
WHERE NOT EXISTS (SELECT FROM pg_dist_partition WHERE logicalrelid = 'bucketd_buckets'::regclass);
SELECT create_distributed_table('bucketd_gateways', 'gateway_id', colocate_with => 'bucketd_buckets')
WHERE NOT EXISTS (SELECT FROM pg_dist_partition WHERE logicalrelid = 'bucketd_gateways'::regclass);
SELECT create_distributed_table('bucketd_staging', 'gateway_id', colocate_with => 'bucketd_buckets')
WHERE NOT EXISTS (SELECT FROM pg_dist_partition WHERE logicalrelid = 'bucketd_staging'::regclass);
