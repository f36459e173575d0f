//! Security against a real Mosquitto the test starts: bucketd connects over TLS (rustls) with a
//! username and password from a file, or with a client certificate; secrets come from
//! `$CREDENTIALS_DIRECTORY` (systemd's `LoadCredential=`); the HTTP bearer tokens guard the API
//! and `/metrics`; and no secret ever appears in the logs, even at trace level.
//!
//! The broker has two listeners: a plain one for the test's publisher and a TLS one with a
//! password file for bucketd (`per_listener_settings`). Certificates are made here with rcgen.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use bucketd::config::{Protocol, RawConfig};
use bucketd::daemon;
use bucketd::store::StoreReader;

use crate::support::*;

use crate::own_mosquitto::OwnMosquitto;

const USER: &str = "gateway-7";
const PASSWORD: &str = "pw-Zq8rT5vXn2";

/// Certificates and the broker's password file, in a directory the `mosquitto` user can read.
struct Pki {
    dir: tempfile::TempDir,
    /// The first lines of the client key's base64, to look for in logs.
    client_key_marker: String,
}

impl Pki {
    fn new() -> Pki {
        let dir = tempfile::tempdir().unwrap();
        let mut perms = std::fs::metadata(dir.path()).unwrap().permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o755);
        std::fs::set_permissions(dir.path(), perms).unwrap();
        let write = |name: &str, text: &str| std::fs::write(dir.path().join(name), text).unwrap();

        let ca = |name: &str| {
            let key = rcgen::KeyPair::generate().unwrap();
            let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
            params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
            params
                .distinguished_name
                .push(rcgen::DnType::CommonName, name);
            let cert = params.self_signed(&key).unwrap();
            (cert.pem(), rcgen::Issuer::new(params, key))
        };
        let (ca_pem, issuer) = ca("bucketd test CA");
        let (rogue_pem, _) = ca("someone else's CA");
        write("ca.pem", &ca_pem);
        write("rogue-ca.pem", &rogue_pem);

        // The broker's certificate names "localhost" only: connecting to 127.0.0.1 must fail
        // the name check.
        let server_key = rcgen::KeyPair::generate().unwrap();
        let server = rcgen::CertificateParams::new(vec!["localhost".to_owned()])
            .unwrap()
            .signed_by(&server_key, &issuer)
            .unwrap();
        write("server.pem", &server.pem());
        write("server.key", &server_key.serialize_pem());

        let client_key = rcgen::KeyPair::generate().unwrap();
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, USER);
        let client = params.signed_by(&client_key, &issuer).unwrap();
        write("client.pem", &client.pem());
        let client_key_pem = client_key.serialize_pem();
        write("client.key", &client_key_pem);
        let client_key_marker = client_key_pem.lines().nth(1).unwrap()[..40].to_owned();

        let passwd = dir.path().join("passwd");
        let status = Command::new("mosquitto_passwd")
            .args(["-c", "-b"])
            .arg(&passwd)
            .args([USER, PASSWORD])
            .status()
            .expect("mosquitto_passwd (apt-get install mosquitto)");
        assert!(status.success());
        // Mosquitto reads it after dropping to the `mosquitto` user.
        let mut perms = std::fs::metadata(&passwd).unwrap().permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut perms, 0o644);
        std::fs::set_permissions(&passwd, perms).unwrap();
        Pki {
            dir,
            client_key_marker,
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

/// Mosquitto with a plain listener (anonymous, for the publisher) and a TLS listener that
/// wants a username and password, and a client certificate when `require_certificate`.
struct TlsBroker {
    _mosquitto: OwnMosquitto,
    /// The plain listener, for the test's publisher.
    plain: Broker,
    tls_port: u16,
}

impl TlsBroker {
    fn start(pki: &Pki, require_certificate: bool) -> TlsBroker {
        let tls_port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let p = |name: &str| pki.path(name).display().to_string();
        let mosquitto = OwnMosquitto::start_with(
            false,
            "per_listener_settings true",
            &format!(
                "listener {tls_port} 127.0.0.1\nallow_anonymous false\npassword_file {}\n\
                 cafile {}\ncertfile {}\nkeyfile {}\nrequire_certificate {require_certificate}\n",
                p("passwd"),
                p("ca.pem"),
                p("server.pem"),
                p("server.key"),
            ),
        );
        eventually_sync(Duration::from_secs(10), || {
            std::net::TcpStream::connect(("127.0.0.1", tls_port)).is_ok()
        });
        let plain = Broker {
            name: "mosquitto-tls",
            host: "127.0.0.1".into(),
            v311_port: mosquitto.port,
            v5_port: mosquitto.port,
            sets_dup: true,
        };
        TlsBroker {
            _mosquitto: mosquitto,
            plain,
            tls_port,
        }
    }

    /// A daemon config that reaches the TLS listener as `localhost` (the certificate's name),
    /// trusting the test CA, with the username and `password_file`.
    fn raw_config(
        &self,
        pki: &Pki,
        protocol: Protocol,
        db: &Path,
        topics: &Topics,
        password_file: &str,
    ) -> RawConfig {
        let mut raw = raw_config(&self.plain, protocol, db, topics);
        raw.mqtt.host = "localhost".into();
        raw.mqtt.port = self.tls_port;
        raw.mqtt.username = USER.into();
        raw.mqtt.password_file = password_file.into();
        raw.mqtt.tls.enabled = true;
        raw.mqtt.tls.ca_file = pki.path("ca.pem").display().to_string();
        raw
    }
}

/// TLS with a password, both protocol versions: every reading arrives, exactly.
async fn tls_with_a_password_ingests_exactly(protocol: Protocol) {
    let pki = Pki::new();
    let broker = TlsBroker::start(&pki, false);
    let secrets = tempfile::tempdir().unwrap();
    let password_file = secrets.path().join("password");
    std::fs::write(&password_file, format!("{PASSWORD}\n")).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("bucketd.redb");
    let topics = Topics::new();
    let raw = broker.raw_config(
        &pki,
        protocol,
        &db,
        &topics,
        password_file.to_str().unwrap(),
    );
    let d = daemon::start(&config(&raw)).unwrap();
    wait_subscribed(&d).await;
    let work = stamped_workload(&topics, 71, 2000);
    publish_all(&broker.plain, &work.messages, 1).await;
    wait_ingested(&d, work.readings.len() as u64, work.rejected_total()).await;
    d.stop().await.unwrap();
    let docs = StoreReader::open(&db)
        .unwrap()
        .buckets(None, i64::MIN, i64::MAX)
        .unwrap();
    assert_matches_truth(&docs, &truth(&work.readings, 3600));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_a_password_ingests_exactly_v5() {
    tls_with_a_password_ingests_exactly(Protocol::V5).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_a_password_ingests_exactly_v311() {
    tls_with_a_password_ingests_exactly(Protocol::V311).await;
}

fn get(url: &str, token: Option<&str>) -> (u16, String) {
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into();
    let mut request = agent.get(url);
    if let Some(token) = token {
        request = request.header("Authorization", format!("Bearer {token}"));
    }
    let response = request.call().unwrap();
    let status = response.status().as_u16();
    (status, response.into_body().read_to_string().unwrap())
}

/// What systemd does with `LoadCredential=`: the password, the client key and both HTTP tokens
/// are files in `$CREDENTIALS_DIRECTORY`, named relatively in the config. The broker requires a
/// client certificate. Everything is ingested; each HTTP token opens only its own endpoints;
/// no secret appears in the trace-level log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_certificate_and_secrets_from_the_credentials_directory() {
    const API_TOKEN: &str = "api-Hk3mW9pQ";
    const METRICS_TOKEN: &str = "scrape-Tb6yL1sD";
    let pki = Pki::new();
    let broker = TlsBroker::start(&pki, true);
    let credentials = tempfile::tempdir().unwrap();
    for (name, value) in [
        ("mqtt-password", PASSWORD),
        ("api-token", API_TOKEN),
        ("metrics-token", METRICS_TOKEN),
    ] {
        std::fs::write(credentials.path().join(name), format!("{value}\n")).unwrap();
    }
    std::fs::copy(
        pki.path("client.key"),
        credentials.path().join("client.key"),
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("bucketd.redb");
    let topics = Topics::new();
    let mut raw = broker.raw_config(&pki, Protocol::V5, &db, &topics, "mqtt-password");
    raw.mqtt.tls.cert_file = pki.path("client.pem").display().to_string();
    raw.mqtt.tls.key_file = "client.key".into();
    raw.http.token_file = "api-token".into();
    raw.http.metrics_token_file = "metrics-token".into();
    let config_file = write_config(dir.path(), &raw);
    let daemon = Daemon::start_with_env(
        &config_file,
        &[
            ("CREDENTIALS_DIRECTORY", credentials.path().as_os_str()),
            ("RUST_LOG", "trace".as_ref()),
        ],
    );
    let mut lines = daemon.wait_for_line("saying it subscribed", |l| {
        l.contains("Subscribed to every")
    });
    let base = format!("http://{}", http_addr(&lines));

    let work = stamped_workload(&topics, 72, 1500);
    publish_all(&broker.plain, &work.messages, 1).await;
    let want = format!(
        "\nbucketd_readings_ingested_total {}\n",
        work.readings.len()
    );
    let metrics_url = format!("{base}/metrics");
    tokio::task::spawn_blocking(move || {
        eventually_sync(Duration::from_mins(1), || {
            get(&metrics_url, Some(METRICS_TOKEN)).1.contains(&want)
        });
    })
    .await
    .unwrap();

    let series = format!("{base}/api/v1/series");
    let checks = [
        (series.clone(), None, 401),
        (series.clone(), Some(METRICS_TOKEN), 401),
        (series.clone(), Some(API_TOKEN), 200),
        (format!("{base}/metrics"), Some(API_TOKEN), 401),
        (format!("{base}/metrics"), None, 401),
        (format!("{base}/readyz"), None, 200),
    ];
    for (url, token, want) in checks {
        let (status, body) = tokio::task::spawn_blocking({
            let url = url.clone();
            move || get(&url, token)
        })
        .await
        .unwrap();
        assert_eq!(status, want, "{url} with {token:?}: {body}");
        if want == 200 && url.ends_with("/series") {
            let name = format!("\"name\":\"{}\"", work.readings[0].series);
            assert!(body.contains(&name), "{body}");
        }
    }

    // `bucketd query` sends the token from --token-file, and says what to do without it.
    let query = |token: Option<&Path>| {
        let mut cmd = Command::new(crate::support::BIN);
        cmd.args(["query", "--url", &base, "--format", "json", "series"]);
        if let Some(file) = token {
            cmd.arg("--token-file").arg(file);
        }
        cmd.output().unwrap()
    };
    let out = query(Some(&credentials.path().join("api-token")));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains(&work.readings[0].series));
    let out = query(None);
    let message = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && message.contains("--token-file"),
        "{message}"
    );

    let (status, rest) = daemon.terminate();
    assert!(status.success(), "{status:?}");
    lines.extend(rest);
    let docs = StoreReader::open(&db)
        .unwrap()
        .buckets(None, i64::MIN, i64::MAX)
        .unwrap();
    assert_matches_truth(&docs, &truth(&work.readings, 3600));
    // The most verbose log there is: bucketd's debug lines (rustls is built without its
    // `logging` feature since issue 55's round, so its handshake no longer logs at all).
    assert!(
        lines.iter().any(|l| l.contains("DEBUG")),
        "the log is at its most verbose level"
    );
    for secret in [PASSWORD, API_TOKEN, METRICS_TOKEN, &pki.client_key_marker] {
        let leaked: Vec<_> = lines.iter().filter(|l| l.contains(secret)).collect();
        assert!(leaked.is_empty(), "{secret} in the log: {leaked:#?}");
    }
}

/// What an operator sees when the TLS setup or the credentials are wrong: a log line that says
/// what failed and which keys to check, `/readyz` not ready, and the secret nowhere in the log.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_credentials_and_certificates_say_what_to_fix() {
    let pki = Pki::new();
    let broker = TlsBroker::start(&pki, false);
    let mtls = TlsBroker::start(&pki, true);
    let secrets = tempfile::tempdir().unwrap();
    let wrong = "wrong-Yd4nV7cM";
    std::fs::write(secrets.path().join("wrong"), wrong).unwrap();
    std::fs::write(secrets.path().join("right"), PASSWORD).unwrap();
    let topics = Topics::new();
    let dir = tempfile::tempdir().unwrap();

    type Tweak = fn(&mut RawConfig, &Pki);
    let cases: [(&str, &TlsBroker, &str, Tweak, &str); 4] = [
        (
            "wrong password",
            &broker,
            "wrong",
            |_, _| {},
            "refused the connection; check mqtt.username",
        ),
        (
            "untrusted CA",
            &broker,
            "right",
            |raw, pki| raw.mqtt.tls.ca_file = pki.path("rogue-ca.pem").display().to_string(),
            "TLS connection to the MQTT broker failed",
        ),
        (
            "name not in the certificate",
            &broker,
            "right",
            |raw, _| raw.mqtt.host = "127.0.0.1".into(),
            "TLS connection to the MQTT broker failed",
        ),
        (
            "client certificate missing",
            &mtls,
            "right",
            |_, _| {},
            "TLS connection to the MQTT broker failed",
        ),
    ];
    let mut daemons = Vec::new();
    for (i, (name, broker, password, tweak, _)) in cases.iter().enumerate() {
        let case_dir = dir.path().join(i.to_string());
        std::fs::create_dir(&case_dir).unwrap();
        let mut raw = broker.raw_config(
            &pki,
            Protocol::V5,
            &case_dir.join("b.redb"),
            &topics,
            secrets.path().join(password).to_str().unwrap(),
        );
        raw.mqtt.client_id = format!("bucketd-{}-{i}", topics.prefix);
        tweak(&mut raw, &pki);
        let daemon = Daemon::start_with_env(
            &write_config(&case_dir, &raw),
            &[("RUST_LOG", "trace".as_ref())],
        );
        daemons.push((*name, daemon));
    }
    for ((name, daemon), (_, _, _, _, says)) in daemons.into_iter().zip(&cases) {
        let mut lines = daemon.wait_for_line(says, |l| l.contains(says));
        let base = format!("http://{}", http_addr(&lines));
        let (status, body) =
            tokio::task::spawn_blocking(move || get(&format!("{base}/readyz"), None))
                .await
                .unwrap();
        assert_eq!(status, 503, "{name}: {body}");
        assert!(body.contains("\"mqtt_connected\":false"), "{name}: {body}");
        let (_, rest) = daemon.terminate();
        lines.extend(rest);
        for secret in [wrong, PASSWORD] {
            let leaked: Vec<_> = lines.iter().filter(|l| l.contains(secret)).collect();
            assert!(
                leaked.is_empty(),
                "{name}: {secret} in the log: {leaked:#?}"
            );
        }
        eprintln!(
            "{name}: {}",
            lines.iter().find(|l| l.contains(says)).unwrap()
        );
    }
}

/// Issue 20: a gateway forwards its deltas to the upstream broker over TLS with a password
/// (`[upstream.mqtt_tls]`), and a central reads them over TLS too: the fleet's totals equal the
/// gateway's ground truth, and the broker's plain listener carried none of it.
#[cfg(feature = "central")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_forwards_over_tls_to_a_central() {
    use crate::fleet::{central_with, fleet_truth, merged, metric, mqtt_gateway_with, restart};
    let pki = Pki::new();
    let upstream = TlsBroker::start(&pki, false);
    let secrets = tempfile::tempdir().unwrap();
    let password_file = secrets.path().join("password");
    std::fs::write(&password_file, format!("{PASSWORD}\n")).unwrap();
    let password_file = password_file.display().to_string();
    let ca = pki.path("ca.pem").display().to_string();
    let central = central_with(&upstream._mosquitto, "bucketd/+/deltas", |raw| {
        raw.mqtt.host = "localhost".into();
        raw.mqtt.port = upstream.tls_port;
        raw.mqtt.username = USER.into();
        raw.mqtt.password_file.clone_from(&password_file);
        raw.mqtt.tls.enabled = true;
        raw.mqtt.tls.ca_file.clone_from(&ca);
    });
    let devices = Broker::hermetic();
    let gateway = mqtt_gateway_with(&devices, &upstream._mosquitto, "gw-tls", 0x715, |raw| {
        raw.upstream.mqtt_host = "localhost".into();
        raw.upstream.mqtt_port = upstream.tls_port;
        raw.upstream.mqtt_username = USER.into();
        raw.upstream.password_file.clone_from(&password_file);
        raw.upstream.mqtt_tls.enabled = true;
        raw.upstream.mqtt_tls.ca_file.clone_from(&ca);
    });
    let (daemon, _) = restart(&gateway.config);
    publish_all(&devices, &gateway.work.messages, 1).await;
    let n = gateway.work.readings.len() as f64;
    crate::fleet::until_metric("the central has every reading", async || {
        metric(&central.addr, "bucketd_readings_ingested_total").await >= n
    })
    .await;
    assert!(daemon.terminate().0.success());
    assert!(central.daemon.terminate().0.success());
    let docs = merged(std::slice::from_ref(&central.db));
    assert_matches_truth(&docs, &fleet_truth(&[("gw-tls", &gateway.work)]));
}
