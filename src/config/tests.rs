// Test scenarios read top to bottom; the 100-line limit (clippy.toml) holds the library.
#![allow(clippy::too_many_lines)]
use std::io::Write;

use super::*;

fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect()
}

fn file(text: &str) -> tempfile::NamedTempFile {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(text.as_bytes()).unwrap();
    f
}

fn load(text: &str) -> Result<Config, ConfigError> {
    let f = file(text);
    Config::load(Some(f.path()), env(&[]))
}

fn error_of(text: &str) -> String {
    load(text)
        .expect_err("config should be refused")
        .to_string()
}

#[test]
fn default_toml_alone_is_a_valid_config_with_documented_defaults() {
    let c = Config::load(None, env(&[])).unwrap();
    assert_eq!(c.mqtt.host, "localhost");
    assert_eq!(c.mqtt.port, 1883);
    assert_eq!(c.mqtt.protocol, Protocol::V5);
    assert_eq!(c.mqtt.receive_maximum, 1024);
    assert_eq!(c.mqtt.broker_window, None, "learned unless stated");
    assert_eq!(c.batch.flush_interval, Duration::from_secs(1));
    assert_eq!(c.store.bucket_width, Duration::from_hours(1));
    assert_eq!(c.store.cache_bytes, 16 << 20);
    assert_eq!(c.limits.max_payload_bytes, 64 << 10);
    assert_eq!(c.subscriptions.len(), 2);
    assert_eq!(c.http.bind, "127.0.0.1:9470".parse().unwrap());
}

#[test]
fn file_then_environment_override_defaults() {
    let f =
        file("[mqtt]\nport = 1999\nhost = \"from-file\"\n[batch]\nflush_interval = \"250ms\"\n");
    let c = Config::load(
        Some(f.path()),
        env(&[
            ("BUCKETD__MQTT__HOST", "from-env"),
            ("BUCKETD__STORE__CACHE_SIZE", "4MiB"),
            ("UNRELATED", "x"),
        ]),
    )
    .unwrap();
    assert_eq!(c.mqtt.port, 1999);
    assert_eq!(c.mqtt.host, "from-env");
    assert_eq!(c.batch.flush_interval, Duration::from_millis(250));
    assert_eq!(c.store.cache_bytes, 4 << 20);
}

#[test]
fn subscriptions_in_a_file_replace_the_default_ones() {
    let c = load(
        "[[subscriptions]]\nfilter = \"a/+/+\"\ntemplate = \"a/{sensor}/{metric}\"\nformat = \"value\"\n",
    )
    .unwrap();
    assert_eq!(c.subscriptions.len(), 1);
    assert_eq!(c.subscriptions[0].filter, "a/+/+");
    assert_eq!(c.subscriptions[0].qos, 1, "qos defaults to 1");
}

#[test]
fn unknown_keys_are_errors_that_name_the_key() {
    let e = error_of("[mqtt]\npasswrod = \"x\"\n");
    assert!(e.contains("passwrod"), "{e}");
    let e = error_of("[nonsense]\nx = 1\n");
    assert!(e.contains("nonsense"), "{e}");
    let e = Config::load(None, env(&[("BUCKETD__BATCH__FLUSH_INTERVALL", "1s")]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("flush_intervall"), "{e}");
}

#[test]
fn bad_values_are_errors_that_name_the_key() {
    let cases = [
        ("[batch]\nflush_interval = \"soon\"\n", "flush_interval"),
        ("[batch]\nflush_interval = \"0s\"\n", "batch.flush_interval"),
        (
            "[batch]\nflush_interval = \"25h\"\n",
            "batch.flush_interval",
        ),
        (
            "[batch]\nflush_interval = \"500000000000y\"\n",
            "flush_interval",
        ),
        (
            "[limits]\ndedup_window = 9223372036854775807\n",
            "limits.dedup_window",
        ),
        ("[limits]\ndedup_window = 1048577\n", "limits.dedup_window"),
        ("[store]\nbucket_width = \"7m\"\n", "store.bucket_width"),
        // Issue 51: "16EiB" was accepted, and the first start's zero fill wrote until the
        // disk was full.
        ("[store]\njournal_size = \"16EiB\"\n", "store.journal_size"),
        ("[store]\njournal_size = \"2GiB\"\n", "store.journal_size"),
        ("[store]\njournal_size = \"4KiB\"\n", "store.journal_size"),
        ("[store]\ncache_size = \"lots\"\n", "cache_size"),
        ("[store]\ndurability = \"none\"\n", "durability"),
        ("[mqtt]\nprotocol = \"v4\"\n", "protocol"),
        ("[mqtt]\nreceive_maximum = 0\n", "mqtt.receive_maximum"),
        (
            "[mqtt]\nmax_packet_size_to_drop = \"100KiB\"\n",
            "mqtt.max_packet_size_to_drop",
        ),
        (
            "[mqtt]\nmax_packet_size_to_drop = \"1GiB\"\n",
            "mqtt.max_packet_size_to_drop",
        ),
        ("[http]\nmax_connections = 0\n", "http.max_connections"),
        (
            "[http]\nmax_concurrent_queries = 0\n",
            "http.max_concurrent_queries",
        ),
        (
            "[http]\nheader_read_timeout = \"10m\"\n",
            "http.header_read_timeout",
        ),
        (
            "[http]\nrequest_timeout = \"1ms\"\n",
            "http.request_timeout",
        ),
        (
            "[http]\nmax_connections_per_address = 0\n",
            "http.max_connections_per_address",
        ),
        (
            "[http]\nallowed_hosts = [\"gateway:9470\"]\n",
            "http.allowed_hosts",
        ),
        (
            "[http]\nallowed_hosts = [\"http://gateway\"]\n",
            "http.allowed_hosts",
        ),
        ("[mqtt]\nreceive_maximum = 70000\n", "receive_maximum"),
        ("[mqtt]\nbroker_window = 70000\n", "broker_window"),
        ("[mqtt]\nbroker_window = -1\n", "broker_window"),
        ("[mqtt]\nsessions = 0\n", "mqtt.sessions"),
        ("[mqtt]\nsessions = 17\n", "mqtt.sessions"),
        (
            "[mqtt]\nsessions = 2\nclient_id = \"site/gw1\"\n",
            "mqtt.client_id",
        ),
        // Four sessions may each have 1024 messages to redeliver: 4096 > 2048.
        (
            "[mqtt]\nsessions = 4\n[limits]\ndedup_window = 2048\n",
            "limits.dedup_window",
        ),
        ("[mqtt]\nport = \"x\"\n", "port"),
        ("[mqtt]\npassword_file = \"/p\"\n", "mqtt.username"),
        ("[mqtt.tls]\nca_file = \"/ca.pem\"\n", "mqtt.tls.enabled"),
        (
            "[mqtt.tls]\nenabled = true\ncert_file = \"/c.pem\"\n",
            "mqtt.tls.key_file",
        ),
        (
            "[mqtt.tls]\nenabled = true\nkey_file = \"k.pem\"\n",
            "mqtt.tls.cert_file",
        ),
        ("[mqtt.tls]\nenabled = \"maybe\"\n", "enabled"),
        ("[mqtt.tls]\ncafile = \"/ca.pem\"\n", "cafile"),
        (
            "[limits]\nmax_payload_bytes = \"1MiB\"\n",
            "limits.max_payload_bytes",
        ),
        ("[log]\nlevel = \"loud!!\"\n", "log.level"),
        ("[upstream]\ntarget = \"kafka\"\n", "upstream.target"),
        // The shared-subscription centrals are retired (issue 43): their keys and a shared
        // delta filter are refused with what to do instead.
        (
            "[central]\nclaims_postgres = \"host=db\"\n",
            "central.claims_postgres",
        ),
        (
            "[central]\nclaims_keep_entries = 10000\n",
            "central.claims_keep_entries",
        ),
        (
            "[[subscriptions]]\nfilter = \"$share/central/bucketd/+/deltas\"\nformat = \"delta\"\n",
            "subscriptions[0].filter",
        ),
        (
            "[query_node]\nmax_rows_per_query = 0\n",
            "query_node.max_rows_per_query",
        ),
        ("[central]\nclaims = \"host=db\"\n", "claims"),
        (
            "[upstream]\ntarget = \"mqtt\"\ngateway_id = \"g\"\n",
            "upstream.mqtt_host",
        ),
        (
            "[upstream]\ntarget = \"postgres\"\npostgres = \"host=db\"\n",
            "upstream.gateway_id",
        ),
        (
            "[upstream]\ntarget = \"postgres\"\ngateway_id = \"a/b\"\npostgres = \"host=db\"\n",
            "upstream.gateway_id",
        ),
        (
            "[upstream]\ntarget = \"postgres\"\ngateway_id = \"gw1\"\n",
            "upstream.postgres",
        ),
        (
            "[upstream]\ntarget = \"mqtt\"\ngateway_id = \"gw1\"\nmqtt_host = \"h\"\nbatch_entries = 0\n",
            "upstream.batch_entries",
        ),
        ("[upstream]\nbroker = \"x\"\n", "broker"),
        ("[http]\nbind = \"localhost\"\n", "http.bind"),
        ("[store]\nsketch_accuracy = 0.5\n", "store.sketch_accuracy"),
        ("[store]\nsketch_max_bins = 1\n", "store.sketch_max_bins"),
        ("[store]\nraw_retention = \"800d\"\n", "store.raw_retention"),
        ("[store]\nretention_batch = 0\n", "store.retention_batch"),
        (
            "[http]\nmax_buckets_per_query = 0\n",
            "http.max_buckets_per_query",
        ),
        (
            "[http]\nmax_points_per_query = 0\n",
            "http.max_points_per_query",
        ),
        (
            "[http]\nmax_points_per_query = 1000000000\n",
            "http.max_points_per_query",
        ),
    ];
    for (text, key) in cases {
        let e = error_of(text);
        assert!(e.contains(key), "{text:?}: {e}");
    }
}

#[test]
fn subscriptions_are_checked_against_their_format_and_filter() {
    let sub = |body: &str| format!("[[subscriptions]]\n{body}\n");
    let cases = [
        (
            "filter = \"a/+\"\ntemplate = \"a/{sensor}\"\nformat = \"value\"",
            "needs {sensor} and {metric}",
        ),
        (
            "filter = \"a/+/+\"\ntemplate = \"a/{sensor}\"\nformat = \"value\"",
            "does not line up",
        ),
        (
            "filter = \"a/+/+\"\ntemplate = \"b/{sensor}/{metric}\"\nformat = \"value\"",
            "does not line up",
        ),
        (
            "filter = \"a/+\"\ntemplate = \"a/{sensor}\"\nformat = \"json\"\nsensor_field = \"id\"",
            "exactly one",
        ),
        (
            "filter = \"a/b+\"\ntemplate = \"a/b\"\nformat = \"json\"",
            "filter",
        ),
        (
            "filter = \"a/+/+\"\ntemplate = \"a/{sensor}/{metric}\"\nformat = \"value\"\nqos = 2",
            "QoS 2 is not supported",
        ),
        (
            "filter = \"a/+/+\"\ntemplate = \"a/{sensor}/{metric}\"\nformat = \"value\"\nfoo = 1",
            "foo",
        ),
        (
            "filter = \"a/+/+\"\ntemplate = \"a/{sensor}/{metric}\"\nformat = \"value\"\nroot = \"x\"",
            "root and fields need format = \"json\"",
        ),
        (
            "filter = \"a/+\"\ntemplate = \"a/{sensor}\"\nformat = \"json\"\nroot = \"a..b\"",
            "dotted path",
        ),
        (
            "filter = \"a/+\"\ntemplate = \"a/{sensor}\"\nformat = \"json\"\ntimestamp_field = \"\"",
            "dotted path",
        ),
        (
            "filter = \"a/+\"\ntemplate = \"a/{sensor}\"\nformat = \"json\"\nfields = []",
            "must list 1 to 256",
        ),
        (
            "filter = \"a/+\"\ntemplate = \"a/{sensor}\"\nformat = \"json\"\nfields = [\"ok\", \".bad\"]",
            "`.bad` is not",
        ),
    ];
    for (body, needle) in cases {
        let e = error_of(&sub(body));
        assert!(e.contains(needle), "{body:?}: {e}");
        assert!(e.contains("subscriptions"), "{body:?}: {e}");
    }
    let ok = load(&sub(
        "filter = \"$share/g/devices/+/telemetry\"\ntemplate = \"devices/{sensor}/telemetry\"\nformat = \"json\"",
    ));
    assert!(ok.is_ok(), "{ok:?}");
}

/// A subscription that takes its sensor from the payload needs no template (it was refused
/// with `missing configuration field "subscriptions[0]template"`); one that needs names from
/// the topic says what to write.
#[test]
fn a_subscription_without_template_uses_its_filter() {
    let sub = |body: &str| format!("[[subscriptions]]\n{body}\n");
    let cfg = load(&sub(
        "filter = \"$share/g/gw/+/json\"\nformat = \"json\"\nsensor_field = \"id\"",
    ))
    .expect("sensor_field without a template loads");
    let s = &cfg.subscriptions[0];
    assert_eq!(
        s.template,
        crate::decode::Template::parse("gw/+/json").unwrap()
    );
    assert_eq!(s.template.capture("gw/7/json"), Some(Default::default()));
    for (body, needle) in [
        (
            "filter = \"a/+/+\"\nformat = \"value\"",
            "needs {sensor} and {metric}",
        ),
        (
            "filter = \"a/+\"\nformat = \"json\"",
            "{sensor} in the template or as sensor_field",
        ),
    ] {
        let e = error_of(&sub(body));
        assert!(
            e.contains(needle) && e.contains("template"),
            "{body:?}: {e}"
        );
    }
}

/// `protocol = "v3.1.1"` was refused with serde's "unknown variant"; the spellings users write
/// are understood, in the file and in the environment, and a wrong one says what to write.
#[test]
fn the_mqtt_version_is_understood_as_users_write_it() {
    for (text, want) in [
        ("\"v5\"", Protocol::V5),
        ("\"5\"", Protocol::V5),
        ("5", Protocol::V5),
        ("\"5.0\"", Protocol::V5),
        ("\"MQTT5\"", Protocol::V5),
        ("\"v311\"", Protocol::V311),
        ("\"v3.1.1\"", Protocol::V311),
        ("\"3.1.1\"", Protocol::V311),
        ("\"311\"", Protocol::V311),
        ("311", Protocol::V311),
        ("\"MQTT-3.1.1\"", Protocol::V311),
    ] {
        let cfg = load(&format!("[mqtt]\nprotocol = {text}\n"));
        assert_eq!(cfg.map(|c| c.mqtt.protocol).ok(), Some(want), "{text}");
    }
    let cfg = Config::load(None, env(&[("BUCKETD__MQTT__PROTOCOL", "3.1.1")])).unwrap();
    assert_eq!(cfg.mqtt.protocol, Protocol::V311);
    for bad in ["\"3.1\"", "\"v4\"", "4"] {
        let e = error_of(&format!("[mqtt]\nprotocol = {bad}\n"));
        assert!(e.contains("write \"5\" or \"3.1.1\""), "{bad}: {e}");
    }
}

/// `check-config` printed PostgreSQL connection strings with their passwords.
#[test]
fn rendered_config_hides_passwords_in_connection_strings() {
    for (given, shown) in [
        (
            "postgresql://bucketd:s3cret@db:5432/fleet",
            "postgresql://bucketd:***@db:5432/fleet",
        ),
        (
            "postgres://u:p%40ss@db/f?sslmode=require&password=x",
            "postgres://u:***@db/f?sslmode=require&password=***",
        ),
        (
            "postgresql://db/fleet?user=u&PASSWORD=x",
            "postgresql://db/fleet?user=u&PASSWORD=***",
        ),
        ("postgresql://u@db/fleet", "postgresql://u@db/fleet"),
        // Issue 41: a password holding `/` or `?` was printed.
        (
            "postgresql://u:pa/ss?w0rd@db:5432/fleet?sslmode=require",
            "postgresql://u:***@db:5432/fleet?sslmode=require",
        ),
        ("postgres://u:a?b@db", "postgres://u:***@db"),
        ("postgres://u:a@b/c@db/f", "postgres://u:***@db/f"),
        (
            "host=db user=u password=s3cret dbname=f",
            "host=db user=u password=*** dbname=f",
        ),
        (
            "host=db password = 'a \\' b' dbname=f",
            "host=db password=*** dbname=f",
        ),
        ("password=x", "password=***"),
        (
            "host=/run/postgresql dbname=fleet",
            "host=/run/postgresql dbname=fleet",
        ),
        (
            "user=password_owner dbname=f",
            "user=password_owner dbname=f",
        ),
        ("", ""),
    ] {
        assert_eq!(redact_conninfo(given), shown, "{given}");
    }
    let mut raw = RawConfig::load(None, env(&[])).unwrap();
    raw.upstream.postgres = "host=db password=s3cret".into();
    raw.query_node.postgres = "postgresql://c:t0psecret@db/fleet".into();
    let text = render(&raw);
    assert!(
        !text.contains("s3cret") && !text.contains("t0psecret"),
        "{text}"
    );
    assert!(text.contains("host=db password=***"), "{text}");
}

#[test]
fn relative_store_path_resolves_against_the_state_directory() {
    let c = Config::load(None, env(&[])).unwrap();
    assert_eq!(
        c.resolved_store_path(Some(Path::new("/var/lib/bucketd"))),
        Path::new("/var/lib/bucketd/bucketd.redb")
    );
    assert_eq!(c.resolved_store_path(None), Path::new("bucketd.redb"));
}

#[test]
#[cfg(feature = "tls")]
fn tls_and_tokens_are_read_from_file_environment_and_defaults() {
    let c = Config::load(None, env(&[])).unwrap();
    assert_eq!(c.mqtt.tls, None);
    assert_eq!(c.http.token_file, None);
    let f = file(
        "[mqtt.tls]\nenabled = true\ncert_file = \"/etc/bucketd/client.pem\"\n\
         key_file = \"client-key\"\n[http]\nmetrics_token_file = \"/run/scrape\"\n",
    );
    let c = Config::load(
        Some(f.path()),
        env(&[
            ("BUCKETD__MQTT__TLS__CA_FILE", "/etc/bucketd/ca.pem"),
            ("BUCKETD__HTTP__TOKEN_FILE", "api-token"),
        ]),
    )
    .unwrap();
    assert_eq!(
        c.mqtt.tls,
        Some(TlsFiles {
            ca_file: Some("/etc/bucketd/ca.pem".into()),
            client: Some(("/etc/bucketd/client.pem".into(), "client-key".into())),
        })
    );
    assert_eq!(c.http.token_file, Some("api-token".into()));
    assert_eq!(c.http.metrics_token_file, Some("/run/scrape".into()));
    // TLS on with nothing else: the system's roots, no client certificate.
    let c = Config::load(None, env(&[("BUCKETD__MQTT__TLS__ENABLED", "true")])).unwrap();
    assert_eq!(
        c.mqtt.tls,
        Some(TlsFiles {
            ca_file: None,
            client: None
        })
    );
}

#[test]
fn rendered_config_reloads_to_the_same_config() {
    let f = file("[mqtt]\nusername = \"u\"\npassword_file = \"/run/secret\"\n");
    let raw = RawConfig::load(Some(f.path()), env(&[])).unwrap();
    let text = render(&raw);
    let again = file(&text);
    let reloaded = RawConfig::load(Some(again.path()), env(&[])).unwrap();
    assert_eq!(render(&reloaded), text);
    assert!(text.contains("password_file = \"/run/secret\""));
}

#[test]
fn the_shipped_small_gateway_profile_is_a_valid_config() {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config/small-gateway.toml");
    let c = Config::load(Some(&path), env(&[])).unwrap();
    assert_eq!(c.store.cache_bytes, 4 << 20);
    assert_eq!(c.limits.dedup_window, 1024);
    assert_eq!(c.mqtt.receive_maximum, 256);
    assert_eq!(c.subscriptions.len(), 2, "the default subscriptions stay");
}

#[test]
#[cfg(feature = "postgres")]
fn upstream_is_off_by_default_and_postgres_when_complete() {
    assert!(load("").unwrap().upstream.is_none());
    let c = load(
        "[upstream]\ntarget = \"postgres\"\ngateway_id = \"site-7.gw\"\n\
         postgres = \"host=db user=bucketd\"\npassword_file = \"pg-pass\"\n",
    )
    .unwrap();
    let u = c.upstream.expect("configured");
    assert_eq!(u.gateway_id, "site-7.gw");
    assert!(
        matches!(&u.target, UpstreamTarget::Postgres { conninfo } if conninfo == "host=db user=bucketd")
    );
    assert_eq!(u.password_file.as_deref(), Some(Path::new("pg-pass")));
    assert_eq!(u.outbox_max_entries, 100_000);
}

#[test]
fn a_setting_this_build_left_out_names_the_feature() {
    let cases = [
        ("tls", "[mqtt.tls]\nenabled = true\n", "mqtt.tls.enabled"),
        (
            "postgres",
            "[upstream]\ntarget = \"postgres\"\ngateway_id = \"gw1\"\npostgres = \"host=db\"\n",
            "upstream.target",
        ),
        (
            "central",
            "[[subscriptions]]\nfilter = \"bucketd/+/deltas\"\ntemplate = \"bucketd/{gateway}/deltas\"\n\
             format = \"delta\"\n",
            "subscriptions[0].format",
        ),
    ];
    for (feature, text, key) in cases {
        let built = match feature {
            "tls" => cfg!(feature = "tls"),
            "postgres" => cfg!(feature = "postgres"),
            _ => cfg!(feature = "central"),
        };
        match load(text) {
            Ok(_) => assert!(built, "{feature}: accepted without the feature"),
            Err(e) => {
                let message = e.to_string();
                assert!(!built, "{feature}: refused with the feature: {message}");
                assert!(
                    message.contains(key) && message.contains(&format!("--features {feature}")),
                    "{message}"
                );
            }
        }
    }
}

#[test]
fn a_stated_broker_window_reaches_the_config() {
    let c = load("[mqtt]\nprotocol = \"v311\"\nbroker_window = 20\n").unwrap();
    assert_eq!(c.mqtt.broker_window, Some(20));
    let c = Config::load(None, env(&[("BUCKETD__MQTT__BROKER_WINDOW", "100")])).unwrap();
    assert_eq!(c.mqtt.broker_window, Some(100));
}

#[test]
fn sessions_name_their_client_ids_and_share_the_subscriptions() {
    let c = load("[mqtt]\nclient_id = \"gw1\"\n").unwrap();
    assert_eq!(c.mqtt.sessions, 1, "one session by default");
    assert_eq!(c.mqtt.session_client_id(0), "gw1", "the id it always had");
    assert_eq!(c.mqtt.session_filter("a/+/b"), "a/+/b");
    let c = load("[mqtt]\nclient_id = \"gw1\"\nsessions = 4\n").unwrap();
    assert_eq!(c.mqtt.session_client_id(3), "gw1-3");
    assert_eq!(c.mqtt.session_filter("a/+/b"), "$share/gw1/a/+/b");
    // A filter the operator already shares keeps its own group.
    assert_eq!(c.mqtt.session_filter("$share/g/a/#"), "$share/g/a/#");
}

/// Issue 20: a delta subscription names the gateway's level, so that a message can be checked
/// against its topic; without a template it is where the forwarder publishes.
#[cfg(feature = "central")]
#[test]
fn a_delta_subscription_names_the_gateway_level_of_its_topic() {
    let sub = |filter: &str, template: Option<&str>| {
        let template = template.map_or(String::new(), |t| format!("template = \"{t}\"\n"));
        format!("[[subscriptions]]\nfilter = \"{filter}\"\n{template}format = \"delta\"\n")
    };
    let c = load(&sub("bucketd/+/deltas", None)).unwrap();
    let captured = c.subscriptions[0].template.capture("bucketd/site-1/deltas");
    assert_eq!(captured.and_then(|c| c.gateway), Some("site-1"));
    // One gateway's topic by name.
    let c = load(&sub("bucketd/site-1/deltas", None)).unwrap();
    let captured = c.subscriptions[0].template.capture("bucketd/site-1/deltas");
    assert_eq!(captured.and_then(|c| c.gateway), Some("site-1"));
    // The template of earlier releases: refused, saying what to write.
    let message = load(&sub("bucketd/+/deltas", Some("bucketd/+/deltas")))
        .unwrap_err()
        .to_string();
    assert!(
        message.contains("subscriptions[0].template")
            && message.contains("bucketd/{gateway}/deltas"),
        "{message}"
    );
    let message = error_of(
        "[[subscriptions]]\nfilter = \"gw/+/x\"\ntemplate = \"gw/{gateway}/x\"\nformat = \"json\"\n\
         sensor_field = \"s\"\n",
    );
    assert!(message.contains("needs format = \"delta\""), "{message}");
    let message = error_of("[central]\nmax_series_per_gateway = 0\n");
    assert!(
        message.contains("central.max_series_per_gateway"),
        "{message}"
    );
}

/// Issue 20: TLS to the upstream broker takes the keys of `[mqtt.tls]`, under its own table.
#[cfg(feature = "tls")]
#[test]
fn upstream_tls_is_configured_like_the_brokers() {
    let c = load(
        "[upstream]\ntarget = \"mqtt\"\ngateway_id = \"gw1\"\nmqtt_host = \"hub\"\n\
         mqtt_port = 8883\n[upstream.mqtt_tls]\nenabled = true\nca_file = \"ca.pem\"\n",
    )
    .unwrap();
    let target = c.upstream.unwrap().target;
    let crate::config::UpstreamTarget::Mqtt {
        tls: Some(files), ..
    } = &target
    else {
        panic!("{target:?}")
    };
    assert_eq!(files.ca_file.as_deref(), Some(Path::new("ca.pem")));
    let message = error_of("[upstream.mqtt_tls]\nca_file = \"ca.pem\"\n");
    assert!(
        message.contains("upstream.mqtt_tls.enabled") && message.contains("upstream.mqtt_port"),
        "{message}"
    );
    let message = error_of(
        "[upstream]\ntarget = \"postgres\"\ngateway_id = \"gw1\"\npostgres = \"host=db\"\n\
         [upstream.mqtt_tls]\nenabled = true\n",
    );
    assert!(message.contains("sslmode"), "{message}");
}

/// Issue 20: libpq's `sslmode` and `sslrootcert` are taken out of a connection string (in
/// either form) for the TLS bucketd does itself; what tokio-postgres gets is a mode it knows.
#[test]
fn sslmode_and_sslrootcert_are_read_from_either_form_of_connection_string() {
    use crate::config::{SslMode, pg_tls};
    let t = pg_tls("host=db user=gw sslmode=verify-full sslrootcert='/etc/my ca.pem' dbname=f")
        .unwrap();
    assert_eq!(t.mode, SslMode::VerifyFull);
    assert_eq!(t.root_cert.as_deref(), Some(Path::new("/etc/my ca.pem")));
    let words: Vec<&str> = t.conninfo.split_whitespace().collect();
    assert_eq!(words, ["host=db", "user=gw", "dbname=f", "sslmode=require"]);
    #[cfg(feature = "postgres")]
    assert!(t.conninfo.parse::<tokio_postgres::Config>().is_ok());
    let t = pg_tls("postgresql://gw@db/fleet?sslrootcert=ca.pem&sslmode=verify-ca").unwrap();
    assert_eq!(
        (t.mode, t.root_cert.as_deref()),
        (SslMode::VerifyCa, Some(Path::new("ca.pem")))
    );
    assert_eq!(t.conninfo, "postgresql://gw@db/fleet?sslmode=require");
    let t = pg_tls("postgres://db/fleet").unwrap();
    assert_eq!(
        (t.mode, t.conninfo.as_str()),
        (SslMode::Prefer, "postgres://db/fleet?sslmode=prefer")
    );
    let t = pg_tls("host=db sslmode = disable").unwrap();
    assert_eq!(
        (t.mode, t.conninfo.as_str()),
        (SslMode::Disable, "host=db sslmode=disable")
    );
    assert_eq!(
        pg_tls("host=db sslmode=require").unwrap().mode,
        SslMode::Require
    );
    let e = pg_tls("host=db sslmode=always").unwrap_err();
    assert!(e.contains("sslmode=always"), "{e}");
}
