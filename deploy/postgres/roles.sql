-- Least rights for gateways (docs/FLEET.md, "Threat model"). Run once, as the tables' owner or
-- a superuser, after schema.sql:
--
--   psql -d fleet -f schema.sql -f roles.sql
--
-- and then one login role per gateway, named exactly as its upstream.gateway_id, in the group:
--
--   CREATE ROLE "site-17" LOGIN PASSWORD '...' IN ROLE bucketd_gateway;
--
-- A gateway can then read and write only its own rows: bucketd_buckets rows whose gateway_id and
-- series prefix are its name, and its own bucketd_gateways row (last_seq, origin). It cannot
-- create or alter tables (bucketd skips its schema step when the tables are there and the role
-- may not create them), delete, or see another gateway's rows. The tables' owner is not limited
-- by these policies.
--
-- Fleet retention drops whole month partitions of every gateway: only members of
-- bucketd_maintainer may run it (issue 52: granted to every gateway, one compromised gateway
-- dropped the whole fleet's data with bucketd_drop_partitions_before('infinity')). Give it to
-- the one role that runs retention (the gateway with upstream.postgres_retention set, or an
-- operator's cron job), trusted with every gateway's data:
--
--   GRANT bucketd_maintainer TO "site-01";
--
-- Query nodes (`bucketd query-node`, docs/FLEET.md) and SQL clients such as Grafana's
-- PostgreSQL data source read as members of bucketd_reader: every row, and nothing else.
--
--   CREATE ROLE "query-1" LOGIN PASSWORD '...' IN ROLE bucketd_reader;
--
-- Idempotent: running it again changes nothing.

DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'bucketd_gateway') THEN
        CREATE ROLE bucketd_gateway NOLOGIN;
    END IF;
END
$$;

DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'bucketd_reader') THEN
        CREATE ROLE bucketd_reader NOLOGIN;
    END IF;
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'bucketd_maintainer') THEN
        CREATE ROLE bucketd_maintainer NOLOGIN;
    END IF;
END
$$;

GRANT SELECT, INSERT, UPDATE ON bucketd_buckets, bucketd_gateways TO bucketd_gateway;
GRANT SELECT ON bucketd_buckets, bucketd_gateways TO bucketd_reader;

ALTER TABLE bucketd_buckets ENABLE ROW LEVEL SECURITY;
ALTER TABLE bucketd_gateways ENABLE ROW LEVEL SECURITY;

DROP POLICY IF EXISTS bucketd_own_rows ON bucketd_buckets;
CREATE POLICY bucketd_own_rows ON bucketd_buckets TO bucketd_gateway
    USING (gateway_id = current_user)
    WITH CHECK (gateway_id = current_user AND starts_with(series, current_user || ':'));

-- With row-level security on, a role no policy names sees no rows: readers get all of them.
DROP POLICY IF EXISTS bucketd_read_all ON bucketd_buckets;
CREATE POLICY bucketd_read_all ON bucketd_buckets FOR SELECT TO bucketd_reader USING (true);
DROP POLICY IF EXISTS bucketd_read_all ON bucketd_gateways;
CREATE POLICY bucketd_read_all ON bucketd_gateways FOR SELECT TO bucketd_reader USING (true);

DROP POLICY IF EXISTS bucketd_own_row ON bucketd_gateways;
CREATE POLICY bucketd_own_row ON bucketd_gateways TO bucketd_gateway
    USING (gateway_id = current_user)
    WITH CHECK (gateway_id = current_user);

-- Partitions are made as gateways need them (bucketd_ensure_partitions runs as the tables'
-- owner, and only makes months); fleet retention (upstream.postgres_retention) drops them, as
-- bucketd_maintainer only (above). The REVOKE undoes the grant of earlier releases.
GRANT EXECUTE ON FUNCTION bucketd_ensure_partitions(timestamptz[]) TO bucketd_gateway;
REVOKE EXECUTE ON FUNCTION bucketd_drop_partitions_before(timestamptz) FROM bucketd_gateway;
GRANT EXECUTE ON FUNCTION bucketd_drop_partitions_before(timestamptz) TO bucketd_maintainer;
