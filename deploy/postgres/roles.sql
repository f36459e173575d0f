-- Least rights for gateways (docs/FLEET.md, "Threat model"). Run once, as the tables' owner or
-- a superuser, after schema.sql:
--
--   psql -d fleet -f schema.sql -f roles.sql
--
-- The group roles are named after the database (issue 52: roles are global to a PostgreSQL
-- server, and with one bucketd_gateway group a gateway of one fleet was a gateway of every
-- fleet on the server): in database "fleet" they are fleet_gateway, fleet_reader and
-- fleet_maintainer (in a database named "bucketd", the names of earlier releases). Only their
-- members may connect to the database. Then one login role per gateway, named exactly as its
-- upstream.gateway_id, in the database's gateway group:
--
--   CREATE ROLE "site-17" LOGIN PASSWORD '...' IN ROLE fleet_gateway;
--
-- A gateway can then read and write only its own rows: bucketd_buckets rows whose gateway_id and
-- series prefix are its name, and its own bucketd_gateways row (last_seq, origin). It cannot
-- create or alter tables (bucketd skips its schema step when the tables are there and the role
-- may not create them), delete, see another gateway's rows, or connect to another fleet's
-- database. The tables' owner is not limited by these policies.
--
-- Fleet retention drops whole month partitions of every gateway: only members of the
-- maintainer group may run it (issue 52: granted to every gateway, one compromised gateway
-- dropped the whole fleet's data with bucketd_drop_partitions_before('infinity')). Give it to
-- the one role that runs retention (the gateway with upstream.postgres_retention set, or an
-- operator's cron job), trusted with every gateway's data:
--
--   GRANT fleet_maintainer TO "site-01";
--
-- Query nodes (`bucketd query-node`, docs/FLEET.md) and SQL clients such as Grafana's
-- PostgreSQL data source read as members of the reader group: every row, and nothing else.
--
--   CREATE ROLE "query-1" LOGIN PASSWORD '...' IN ROLE fleet_reader;
--
-- Upgrading from a release whose groups were bucketd_* in a database of another name: this
-- script takes the tables' rights away from those groups here and names, in a NOTICE, the
-- GRANT each of their members needs.
--
-- Idempotent: running it again changes nothing.

DO $$
DECLARE
    db text := current_database();
    gateway text := db || '_gateway';
    reader text := db || '_reader';
    maintainer text := db || '_maintainer';
    old text;
    member text;
BEGIN
    IF length(maintainer) > 63 THEN
        RAISE EXCEPTION 'the database name % is too long for its group role names (% is over '
            'PostgreSQL''s 63 bytes): use a database name of at most 52 bytes', db, maintainer;
    END IF;
    FOREACH old IN ARRAY ARRAY[gateway, reader, maintainer] LOOP
        IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = old) THEN
            EXECUTE format('CREATE ROLE %I NOLOGIN', old);
        END IF;
    END LOOP;

    EXECUTE format('GRANT SELECT, INSERT, UPDATE ON bucketd_buckets, bucketd_gateways TO %I',
        gateway);
    EXECUTE format('GRANT SELECT ON bucketd_buckets, bucketd_gateways TO %I', reader);
    -- A batch's rows pass through bucketd_staging (schema.sql). PostgreSQL refuses COPY into a
    -- table with row-level security, so none is on it: a batch moves only the rows with its
    -- own random token, in its own transaction, and the move's INSERT into bucketd_buckets is
    -- held by that table's policies (a gateway's role writes only its own rows there).
    EXECUTE format('GRANT SELECT, INSERT, DELETE ON bucketd_staging TO %I', gateway);

    ALTER TABLE bucketd_buckets ENABLE ROW LEVEL SECURITY;
    ALTER TABLE bucketd_gateways ENABLE ROW LEVEL SECURITY;

    DROP POLICY IF EXISTS bucketd_own_rows ON bucketd_buckets;
    EXECUTE format('CREATE POLICY bucketd_own_rows ON bucketd_buckets TO %I '
        'USING (gateway_id = current_user) '
        'WITH CHECK (gateway_id = current_user AND starts_with(series, current_user || '':''))',
        gateway);
    -- With row-level security on, a role no policy names sees no rows: readers get all of them.
    DROP POLICY IF EXISTS bucketd_read_all ON bucketd_buckets;
    EXECUTE format('CREATE POLICY bucketd_read_all ON bucketd_buckets FOR SELECT TO %I '
        'USING (true)', reader);
    DROP POLICY IF EXISTS bucketd_read_all ON bucketd_gateways;
    EXECUTE format('CREATE POLICY bucketd_read_all ON bucketd_gateways FOR SELECT TO %I '
        'USING (true)', reader);
    DROP POLICY IF EXISTS bucketd_own_row ON bucketd_gateways;
    EXECUTE format('CREATE POLICY bucketd_own_row ON bucketd_gateways TO %I '
        'USING (gateway_id = current_user) WITH CHECK (gateway_id = current_user)', gateway);

    -- Partitions are made as gateways need them (bucketd_ensure_partitions runs as the tables'
    -- owner, and only makes months); fleet retention (upstream.postgres_retention) drops them,
    -- as the maintainer group only (above).
    EXECUTE format('GRANT EXECUTE ON FUNCTION bucketd_ensure_partitions(timestamptz[]) TO %I',
        gateway);
    EXECUTE format('REVOKE EXECUTE ON FUNCTION bucketd_drop_partitions_before(timestamptz) '
        'FROM %I', gateway);
    EXECUTE format('GRANT EXECUTE ON FUNCTION bucketd_drop_partitions_before(timestamptz) TO %I',
        maintainer);

    -- Only this database's groups (and its owner, superusers and whoever runs this script, the
    -- tables' owner) connect to it.
    EXECUTE format('REVOKE CONNECT ON DATABASE %I FROM PUBLIC', db);
    EXECUTE format('GRANT CONNECT ON DATABASE %I TO %I, %I, %I, %I', db, gateway, reader,
        maintainer, current_user);

    -- The shared groups of earlier releases lose what they had here (in a database of another
    -- name); their members are named with the GRANT they need.
    IF db <> 'bucketd' THEN
        FOREACH old IN ARRAY ARRAY['bucketd_gateway', 'bucketd_reader', 'bucketd_maintainer'] LOOP
            CONTINUE WHEN NOT EXISTS (SELECT FROM pg_roles WHERE rolname = old);
            EXECUTE format('REVOKE ALL ON bucketd_buckets, bucketd_gateways FROM %I', old);
            EXECUTE format('REVOKE ALL ON FUNCTION bucketd_ensure_partitions(timestamptz[]), '
                'bucketd_drop_partitions_before(timestamptz) FROM %I', old);
            FOR member IN
                SELECT r.rolname FROM pg_auth_members m
                JOIN pg_roles g ON g.oid = m.roleid JOIN pg_roles r ON r.oid = m.member
                WHERE g.rolname = old
            LOOP
                RAISE NOTICE 'role % was in % (earlier releases): if it belongs to this fleet, '
                    'run GRANT % TO %', member, old,
                    quote_ident(db || substr(old, length('bucketd') + 1)), quote_ident(member);
            END LOOP;
        END LOOP;
    END IF;
END
$$;
