//! Readings as real devices send them (issue 54): each payload format end to end through a real
//! broker and a real redb file, from the producer library people use (the InfluxDB Python
//! client's line-protocol writer, kpn-senml, Eclipse Tahu's Sparkplug client for Node.js) or, for
//! nested JSON, payloads modelled on the examples in the documentation of Tasmota, Zigbee2MQTT,
//! Shelly Gen2 and The Things Stack (written here, not captured from devices). Every bucket's
//! count, sum, extremes, mean, variance and
//! quantiles are checked against the readings the producer says it sent.
//!
//! The producer libraries are installed by `.ci/producers` under `target/producers` (a Python
//! venv and `node_modules`); without them these tests say so and pass, except in CI.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use bucketd::config::{Protocol, RawSubscription};
use bucketd::daemon;
use bucketd::decode::{Format, TimestampUnit};
use bucketd::reject::DecodeError;
use bucketd::stats::Stats;
use bucketd::store::StoreReader;

use crate::on_every_broker;
use crate::support::{
    Broker, Daemon, Expected, Topics, WAIT, assert_matches_truth, config, publish_all, raw_config,
    truth, unique, wait_ingested, wait_subscribed, write_config,
};

/// Where `.ci/producers` put the producer libraries; `None` (the test passes, saying so)
/// outside CI when they are missing.
fn producers() -> Option<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("target/producers");
    let installed =
        dir.join("venv/bin/python").exists() && dir.join("node_modules/sparkplug-client").exists();
    if installed {
        return Some(dir);
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "the producer libraries are required in CI: .ci/producers installs them"
    );
    eprintln!("not run: the producer libraries are not installed (run .ci/producers)");
    None
}

fn script(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/producers")
        .join(name)
}

fn subscription(filter: String, template: Option<String>, format: Format) -> RawSubscription {
    RawSubscription {
        filter,
        template,
        format,
        qos: 1,
        timestamp_field: None,
        timestamp_unit: TimestampUnit::Auto,
        sensor_field: None,
        root: None,
        fields: None,
        rebirth_interval: None,
        store_raw: true,
    }
}

/// What a producer printed: the messages to publish, the readings they hold, and the
/// rejections (by reason) bucketd must count.
#[derive(Default)]
struct Produced {
    messages: Vec<(String, Vec<u8>)>,
    readings: Vec<Expected>,
    rejected: BTreeMap<String, u64>,
}

impl Produced {
    /// Takes one line of a producer's output; returns its phase, if it names one.
    fn take(&mut self, line: &str) -> Option<String> {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {line}"));
        if let Some(m) = v.get("message") {
            let topic = m[0].as_str().unwrap().to_owned();
            self.messages
                .push((topic, m[1].as_str().unwrap().as_bytes().to_vec()));
        } else if let Some(r) = v.get("reading") {
            self.readings.push(Expected {
                series: r[0].as_str().unwrap().to_owned(),
                ts: Some(
                    r[1].as_i64()
                        .unwrap_or_else(|| r[1].as_f64().unwrap() as i64),
                ),
                value: r[2].as_f64().unwrap(),
            });
        } else if let Some(reason) = v.get("rejected") {
            *self
                .rejected
                .entry(reason.as_str().unwrap().to_owned())
                .or_default() += 1;
        } else if let Some(phase) = v.get("phase") {
            return Some(phase.as_str().unwrap().to_owned());
        }
        None
    }

    fn rejected_total(&self) -> u64 {
        self.rejected.values().sum()
    }
}

fn now_secs() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

/// Runs a Python producer to its end.
fn python(dir: &std::path::Path, name: &str, prefix: &str) -> Produced {
    let out = Command::new(dir.join("venv/bin/python"))
        .arg(script(name))
        .args([prefix, &now_secs().to_string()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{name}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut produced = Produced::default();
    for line in String::from_utf8(out.stdout).unwrap().lines() {
        produced.take(line);
    }
    produced
}

fn rejected_by_reason(stats: &Stats) -> BTreeMap<String, u64> {
    DecodeError::ALL
        .iter()
        .map(|e| (e.reason().to_owned(), stats.rejected(*e)))
        .filter(|(_, n)| *n > 0)
        .collect()
}

/// Publishes what a producer made through `broker` to a daemon with `subs`, then checks every
/// bucket and every rejection against what the producer says it sent.
async fn ingest_and_check(
    broker: &Broker,
    protocol: Protocol,
    topics: &Topics,
    subs: Vec<RawSubscription>,
    produced: &Produced,
) {
    let dir = tempfile::tempdir().unwrap();
    let db = dir.path().join("bucketd.redb");
    let mut raw = raw_config(broker, protocol, &db, topics);
    raw.subscriptions = subs;
    let d = daemon::start(&config(&raw)).unwrap();
    wait_subscribed(&d).await;
    publish_all(broker, &produced.messages, 1).await;
    wait_ingested(
        &d,
        produced.readings.len() as u64,
        produced.rejected_total(),
    )
    .await;
    assert_eq!(rejected_by_reason(&d.stats), produced.rejected);
    d.stop().await.unwrap();
    let docs = StoreReader::open(&db)
        .unwrap()
        .buckets(None, i64::MIN, i64::MAX)
        .unwrap();
    assert_matches_truth(&docs, &truth(&produced.readings, 3600));
}

/// InfluxDB line protocol from the InfluxDB Python client's `Point.to_line_protocol()`.
async fn influx_line_protocol_from_the_influxdb_client(broker: Broker, protocol: Protocol) {
    let Some(dir) = producers() else { return };
    let topics = Topics::new();
    let produced = python(&dir, "influx.py", &topics.prefix);
    assert_eq!(produced.messages.len(), 40);
    let sub = subscription(format!("{}/telegraf", topics.prefix), None, Format::Influx);
    ingest_and_check(&broker, protocol, &topics, vec![sub], &produced).await;
}
on_every_broker!(influx_line_protocol_from_the_influxdb_client);

/// SenML packs from kpn-senml, base name, time and value applied as RFC 8428 says.
async fn senml_packs_from_kpn_senml(broker: Broker, protocol: Protocol) {
    let Some(dir) = producers() else { return };
    let topics = Topics::new();
    let produced = python(&dir, "senml.py", &topics.prefix);
    assert_eq!(produced.messages.len(), 30);
    let sub = subscription(
        format!("{}/senml/+", topics.prefix),
        Some(format!("{}/senml/{{sensor}}", topics.prefix)),
        Format::Senml,
    );
    ingest_and_check(&broker, protocol, &topics, vec![sub], &produced).await;
}
on_every_broker!(senml_packs_from_kpn_senml);

/// Nested JSON as Tasmota, Zigbee2MQTT, Shelly Gen2 and The Things Stack send it (payloads
/// modelled on their documentation's examples): nested objects named by their dotted keys,
/// booleans 1 and 0, a root and dotted timestamp and sensor paths.
async fn nested_json_as_devices_send_it(broker: Broker, protocol: Protocol) {
    let topics = Topics::new();
    let p = &topics.prefix;
    let now = now_secs();
    let hour = now / 3600 * 3600 - 3600;
    let mut produced = Produced::default();
    let mut expect = |series: &str, ts: Option<i64>, value: f64| {
        produced.readings.push(Expected {
            series: series.into(),
            ts,
            value,
        });
    };
    // Tasmota (docs: "Commands", tele SENSOR of an energy monitoring plug). Its Time has no
    // offset unless SetOption52 is on: read at the receive time.
    let tasmota = r#"{"Time":"2026-11-27T10:00:00","ENERGY":{"TotalStartTime":"2026-01-01T00:00:00","Total":12.345,"Yesterday":0.5,"Today":0.25,"Period":3,"Power":45,"ApparentPower":50,"ReactivePower":20,"Factor":0.9,"Voltage":230,"Current":0.196}}"#;
    for (k, v) in [
        ("Total", 12.345),
        ("Yesterday", 0.5),
        ("Today", 0.25),
        ("Period", 3.0),
        ("Power", 45.0),
        ("ApparentPower", 50.0),
        ("ReactivePower", 20.0),
        ("Factor", 0.9),
        ("Voltage", 230.0),
        ("Current", 0.196),
    ] {
        expect(&format!("plug1/ENERGY.{k}"), None, v);
    }
    // Zigbee2MQTT (docs: "MQTT topics and messages", a sensor's state).
    let z2m = r#"{"battery":97,"humidity":55.21,"linkquality":120,"occupancy":true,"temperature":21.5,"voltage":3005,"update_available":false,"update":{"state":"idle","installed_version":-1,"latest_version":-1}}"#;
    for (k, v) in [
        ("battery", 97.0),
        ("humidity", 55.21),
        ("linkquality", 120.0),
        ("occupancy", 1.0),
        ("temperature", 21.5),
        ("voltage", 3005.0),
        ("update_available", 0.0),
        ("update.installed_version", -1.0),
        ("update.latest_version", -1.0),
    ] {
        expect(&format!("hall_sensor/{k}"), None, v);
    }
    // Shelly Gen2 (docs: "Notifications", NotifyStatus of a switch), its time in params.ts.
    let shelly_ts = hour + 600;
    let shelly = format!(
        r#"{{"src":"shellyplus1pm-a8032ab12345","dst":"user_1","method":"NotifyStatus","params":{{"ts":{shelly_ts}.25,"switch:0":{{"id":0,"apower":12.5,"voltage":230.1,"current":0.054,"output":true,"aenergy":{{"total":11.679,"by_minute":[0,0,0],"minute_ts":{shelly_ts}}},"temperature":{{"tC":45.2,"tF":113.4}}}}}}}}"#
    );
    let shelly_ns = Some(shelly_ts * 1_000_000_000 + 250_000_000);
    for (k, v) in [
        ("switch:0.id", 0.0),
        ("switch:0.apower", 12.5),
        ("switch:0.voltage", 230.1),
        ("switch:0.current", 0.054),
        ("switch:0.output", 1.0),
        ("switch:0.aenergy.total", 11.679),
        ("switch:0.aenergy.minute_ts", shelly_ts as f64),
        ("switch:0.temperature.tC", 45.2),
        ("switch:0.temperature.tF", 113.4),
    ] {
        expect(&format!("shellyplus1pm-a8032ab12345/{k}"), shelly_ns, v);
    }
    // The Things Stack (docs: "Data Formats", an uplink message), with `root`.
    let tts_at = hour + 1200;
    let received = chrono::DateTime::from_timestamp(tts_at, 123_456_789)
        .unwrap()
        .to_rfc3339_opts(chrono::SecondsFormat::Nanos, true);
    let tts = format!(
        r#"{{"end_device_ids":{{"device_id":"eui-70b3d57ed0000001","application_ids":{{"application_id":"farm"}},"dev_eui":"70B3D57ED0000001"}},"correlation_ids":["as:up:01"],"received_at":"{received}","uplink_message":{{"session_key_id":"AXA=","f_port":1,"f_cnt":42,"frm_payload":"AQI=","decoded_payload":{{"temperature":21.5,"humidity":40,"battery":{{"volts":3.6}},"alarm":false}},"rx_metadata":[{{"gateway_ids":{{"gateway_id":"gw1"}},"rssi":-42,"snr":9.5}}],"settings":{{"data_rate":{{"lora":{{"bandwidth":125000,"spreading_factor":7}}}},"frequency":"868100000"}},"received_at":"{received}","consumed_airtime":"0.056576s"}}}}"#
    );
    let tts_ns = Some(tts_at * 1_000_000_000 + 123_456_789);
    for (k, v) in [
        ("temperature", 21.5),
        ("humidity", 40.0),
        ("battery.volts", 3.6),
        ("alarm", 0.0),
    ] {
        expect(&format!("eui-70b3d57ed0000001/{k}"), tts_ns, v);
    }
    produced.messages = vec![
        (
            format!("{p}/tele/plug1/SENSOR"),
            tasmota.as_bytes().to_vec(),
        ),
        (
            format!("{p}/zigbee2mqtt/hall_sensor"),
            z2m.as_bytes().to_vec(),
        ),
        (
            format!("{p}/shellyplus1pm-a8032ab12345/events/rpc"),
            shelly.into_bytes(),
        ),
        (
            format!("{p}/v3/farm@ttn/devices/eui-70b3d57ed0000001/up"),
            tts.into_bytes(),
        ),
    ];
    let json =
        |filter: String, template: Option<String>| subscription(filter, template, Format::Json);
    let shelly_sub = RawSubscription {
        sensor_field: Some("src".into()),
        timestamp_field: Some("params.ts".into()),
        root: Some("params".into()),
        ..json(format!("{p}/+/events/rpc"), None)
    };
    let tts_sub = RawSubscription {
        sensor_field: Some("end_device_ids.device_id".into()),
        timestamp_field: Some("received_at".into()),
        root: Some("uplink_message.decoded_payload".into()),
        ..json(format!("{p}/v3/+/devices/+/up"), None)
    };
    let subs = vec![
        json(
            format!("{p}/tele/+/SENSOR"),
            Some(format!("{p}/tele/{{sensor}}/SENSOR")),
        ),
        json(
            format!("{p}/zigbee2mqtt/+"),
            Some(format!("{p}/zigbee2mqtt/{{sensor}}")),
        ),
        shelly_sub,
        tts_sub,
    ];
    ingest_and_check(&broker, protocol, &topics, subs, &produced).await;
}
on_every_broker!(nested_json_as_devices_send_it);

/// A producer running beside the test: its output lines arrive on a channel.
struct Running {
    child: std::process::Child,
    lines: mpsc::Receiver<String>,
    produced: Produced,
}

impl Running {
    /// Reads lines until the producer names `phase`.
    fn until(&mut self, phase: &str) {
        let deadline = std::time::Instant::now() + WAIT;
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let line = self
                .lines
                .recv_timeout(left)
                .unwrap_or_else(|e| panic!("no phase {phase:?} from the producer: {e}"));
            if self.produced.take(&line).as_deref() == Some(phase) {
                return;
            }
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Sparkplug B from Eclipse Tahu's Node.js client: births with aliases, data by alias, then
/// bucketd restarts (its births forgotten), asks the edge node for a rebirth at the first alias
/// it cannot name, and names the data again.
async fn sparkplug_b_from_eclipse_tahu_with_a_rebirth_after_restart(
    broker: Broker,
    protocol: Protocol,
) {
    let Some(dir) = producers() else { return };
    let topics = Topics::new();
    let group = unique("g");
    let tmp = tempfile::tempdir().unwrap();
    let db = tmp.path().join("bucketd.redb");
    let mut raw = raw_config(&broker, protocol, &db, &topics);
    raw.subscriptions = vec![RawSubscription {
        rebirth_interval: Some(Duration::from_mins(1)),
        ..subscription(format!("spBv1.0/{group}/#"), None, Format::SparkplugB)
    }];
    let cfg = config(&raw);
    let d = daemon::start(&cfg).unwrap();
    wait_subscribed(&d).await;

    let now_ms = now_secs() * 1000;
    let mut child = Command::new("node")
        .arg(script("sparkplug.js"))
        .args([
            &broker.host,
            &broker.port(Protocol::V311).to_string(),
            &group,
            &now_ms.to_string(),
        ])
        .env("NODE_PATH", dir.join("node_modules"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("node runs (Node.js 20 is on the machine)");
    let (tx, rx) = mpsc::channel();
    let stdout = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut tahu = Running {
        child,
        lines: rx,
        produced: Produced::default(),
    };
    let until = |tahu: &mut Running, phase: &'static str| {
        tokio::task::block_in_place(|| tahu.until(phase));
    };
    until(&mut tahu, "sent");
    let first = (
        tahu.produced.readings.len() as u64,
        tahu.produced.rejected_total(),
    );
    wait_ingested(&d, first.0, first.1).await;
    assert_eq!(d.stats.rejected(DecodeError::NotNumeric), first.1);
    d.stop().await.unwrap();

    // A new bucketd knows no alias: the first data it cannot name makes it ask for a rebirth.
    let d = daemon::start(&cfg).unwrap();
    wait_subscribed(&d).await;
    let stdin = tahu.child.stdin.as_mut().unwrap();
    stdin.write_all(b"go\n").unwrap();
    stdin.flush().unwrap();
    until(&mut tahu, "rebirth asked");
    until(&mut tahu, "done");
    let all = &tahu.produced;
    wait_ingested(
        &d,
        all.readings.len() as u64 - first.0,
        all.rejected_total() - first.1,
    )
    .await;
    assert_eq!(d.stats.rejected(DecodeError::UnknownAlias), 5);
    d.stop().await.unwrap();
    let docs = StoreReader::open(&db)
        .unwrap()
        .buckets(None, i64::MIN, i64::MAX)
        .unwrap();
    assert_matches_truth(&docs, &truth(&all.readings, 3600));
}
on_every_broker!(sparkplug_b_from_eclipse_tahu_with_a_rebirth_after_restart);

/// A client watching `topic`: each message's retain flag and JSON payload, once subscribed.
async fn watch(
    broker: &Broker,
    topic: &str,
) -> tokio::sync::mpsc::UnboundedReceiver<(bool, serde_json::Value)> {
    use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};
    let o = MqttOptions::new(unique("watch"), &broker.host, broker.port(Protocol::V311));
    let (client, mut events) = AsyncClient::new(o, 10);
    client.subscribe(topic, QoS::AtLeastOnce).await.unwrap();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let (subscribed, acked) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let _client = client; // dropped with the task
        let mut subscribed = Some(subscribed);
        while let Ok(event) = events.poll().await {
            match event {
                Event::Incoming(Packet::SubAck(_)) => {
                    if let Some(s) = subscribed.take() {
                        let _ = s.send(());
                    }
                }
                Event::Incoming(Packet::Publish(p)) => {
                    let v = serde_json::from_slice(&p.payload).unwrap_or(serde_json::Value::Null);
                    if tx.send((p.retain, v)).is_err() {
                        return;
                    }
                }
                _ => {}
            }
        }
    });
    acked.await.unwrap();
    rx
}

async fn next_state(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<(bool, serde_json::Value)>,
) -> (bool, serde_json::Value) {
    tokio::time::timeout(WAIT, rx.recv())
        .await
        .expect("a STATE message in time")
        .expect("the watcher runs")
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// Sparkplug 3.0's host STATE (`mqtt.sparkplug_host_id`): a retained birth
/// `{"online":true,"timestamp":T}` after connecting, a late subscriber gets it retained, an
/// offline STATE delivered on its topic is answered with the birth again, a clean stop
/// publishes a death, and a kill leaves the Will, `{"online":false,"timestamp":T}` with the
/// birth's own T (tck-id-host-topic-phid-*).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_host_publishes_its_state_birth_will_and_death() {
    use rumqttc::{AsyncClient, MqttOptions, QoS};
    let broker = Broker::hermetic();
    let host_id = unique("host");
    let topic = format!("spBv1.0/STATE/{host_id}");
    let mut watcher = watch(&broker, &topic).await;
    let dir = tempfile::tempdir().unwrap();
    let topics = Topics::new();
    // The STATE connection speaks MQTT 3.1.1 on mqtt.port (rumqttd listens for each version
    // on a port of its own).
    let mut raw = raw_config(&broker, Protocol::V311, &dir.path().join("b.redb"), &topics);
    raw.mqtt.sparkplug_host_id = host_id.clone();
    let before = now_ms();
    let d = daemon::start(&config(&raw)).unwrap();
    let (_, birth) = next_state(&mut watcher).await;
    assert_eq!(birth["online"], true, "{birth}");
    let t = birth["timestamp"].as_u64().expect("a numeric timestamp");
    assert!(
        (before..=now_ms()).contains(&t),
        "{t} is the connect's time"
    );
    let mut late = watch(&broker, &topic).await;
    assert_eq!(
        next_state(&mut late).await,
        (true, birth.clone()),
        "retained"
    );

    // An offline STATE on its topic (a late Will, another host): the birth again.
    let o = MqttOptions::new(unique("other"), &broker.host, broker.port(Protocol::V311));
    let (other, mut events) = AsyncClient::new(o, 10);
    tokio::spawn(async move { while events.poll().await.is_ok() {} });
    let stale = format!("{{\"online\":false,\"timestamp\":{}}}", t - 1);
    other
        .publish(&topic, QoS::AtLeastOnce, true, stale)
        .await
        .unwrap();
    assert_eq!(next_state(&mut watcher).await.1["online"], false);
    assert_eq!(next_state(&mut watcher).await.1, birth, "published again");

    // A clean stop: the death, at the stop's time.
    d.stop().await.unwrap();
    let (_, death) = next_state(&mut watcher).await;
    assert_eq!(death["online"], false, "{death}");
    assert!(death["timestamp"].as_u64().unwrap() >= t);

    // Killed: the broker publishes the Will, the birth's own timestamp.
    let path = write_config(dir.path(), &raw);
    let child = Daemon::start(&path);
    let (_, birth) = next_state(&mut watcher).await;
    assert_eq!(birth["online"], true, "{birth}");
    child.kill();
    // (The retained death of the stop above, delivered to the new connection, has it publish
    // the birth once more: the specification's answer to an offline STATE of its own.)
    let will = loop {
        let (_, next) = next_state(&mut watcher).await;
        if next != birth {
            break next;
        }
    };
    assert_eq!(will["online"], false, "{will}");
    assert_eq!(will["timestamp"], birth["timestamp"]);
}

/// A Sparkplug payload of `metrics` (name, alias, Double value), at `ts_ms`.
fn spb(ts_ms: u64, metrics: &[(Option<String>, Option<u64>, f64)]) -> Vec<u8> {
    use bucketd::decode::sparkplug::{Metric, Payload, Value};
    use prost::Message;
    Payload {
        timestamp: Some(ts_ms),
        metrics: metrics
            .iter()
            .map(|(name, alias, v)| Metric {
                name: name.clone(),
                alias: *alias,
                datatype: Some(10),
                value: Some(Value::Double(*v)),
                ..Metric::default()
            })
            .collect(),
        seq: None,
        uuid: None,
    }
    .encode_to_vec()
}

/// An NBIRTH or NDEATH's `bdSeq` metric (`UInt64`).
fn bd_seq_metric(ts_ms: u64, bd_seq: u64, more: &[(Option<String>, Option<u64>, f64)]) -> Vec<u8> {
    use bucketd::decode::sparkplug::{Metric, Payload, Value};
    use prost::Message;
    let mut p = Payload::decode(&spb(ts_ms, more)[..]).unwrap();
    p.metrics.insert(
        0,
        Metric {
            name: Some("bdSeq".into()),
            datatype: Some(8),
            value: Some(Value::Long(bd_seq)),
            ..Metric::default()
        },
    );
    p.encode_to_vec()
}

/// A scripted hostile publisher on the plant's network, through the broker, against a real
/// node: 200 spoofed pairs of a stale NDEATH and an unknown-alias NDATA, four nodes whose
/// births of 3,000 aliased metrics each overrun their share, 1,500 invented nodes, and two
/// pairs of ids that joined with `:` would be one sensor. The real node is asked for a rebirth
/// once and loses nothing; a node born after the hogs has every reading; the invented nodes
/// get no more requests than the global bound; every refusal is counted by its reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_sparkplug_publisher_takes_no_node_s_place() {
    let broker = Broker::hermetic();
    let dir = tempfile::tempdir().unwrap();
    let topics = Topics::new();
    let group = format!("plant{}", topics.prefix.replace(['/', '-'], ""));
    let mut raw = raw_config(&broker, Protocol::V5, &dir.path().join("b.redb"), &topics);
    raw.subscriptions = vec![RawSubscription {
        rebirth_interval: Some(Duration::from_mins(1)),
        ..subscription(format!("spBv1.0/{group}/#"), None, Format::SparkplugB)
    }];
    for c9 in [format!("c9{group}"), format!("c9{group}:b")] {
        raw.subscriptions.push(subscription(
            format!("spBv1.0/{c9}/#"),
            None,
            Format::SparkplugB,
        ));
    }
    raw.limits.max_series = 100_000;
    raw.limits.max_series_per_sensor = 10_000;
    raw.limits.max_payload_bytes = bytesize::ByteSize::mib(1);
    raw.mqtt.max_packet_size = bytesize::ByteSize::mib(2);
    raw.mqtt.max_packet_size_to_drop = bytesize::ByteSize::mib(2);
    let mut ncmd = watch(&broker, &format!("spBv1.0/{group}/NCMD/#")).await;
    let mut to_real = watch(&broker, &format!("spBv1.0/{group}/NCMD/real")).await;
    let d = daemon::start(&config(&raw)).unwrap();
    wait_subscribed(&d).await;
    let started = std::time::Instant::now();
    let ms = now_ms() - 60_000;
    let t = |s: &str| format!("spBv1.0/{group}/{s}");
    let named = |n: u64, first: u64| -> Vec<(Option<String>, Option<u64>, f64)> {
        (0..n)
            .map(|i| (Some(format!("m{i}")), Some(first + i), i as f64))
            .collect()
    };
    let by_alias = |aliases: std::ops::RangeInclusive<u64>, v: f64| -> Vec<_> {
        aliases.map(|a| (None, Some(a), v)).collect()
    };
    let mut messages = vec![(t("NBIRTH/real"), bd_seq_metric(ms, 5, &named(20, 1)))];
    for i in 0..200 {
        messages.push((t("NDEATH/real"), bd_seq_metric(ms + i, 4, &[])));
        messages.push((t("NDATA/real"), spb(ms + i, &by_alias(99..=99, i as f64))));
    }
    messages.push((t("NDATA/real"), spb(ms + 500, &by_alias(1..=20, 1.0))));
    for hog in 0..4 {
        messages.push((
            t(&format!("NBIRTH/hog{hog}")),
            bd_seq_metric(ms, 0, &named(3000, 1)),
        ));
        messages.push((
            t(&format!("NDATA/hog{hog}")),
            spb(ms + 1, &by_alias(2999..=2999, 1.0)),
        ));
    }
    messages.push((t("NBIRTH/late"), bd_seq_metric(ms, 0, &named(20, 1))));
    messages.push((t("NDATA/late"), spb(ms + 1, &by_alias(1..=20, 2.0))));
    for n in 0..1500 {
        messages.push((t(&format!("NDATA/x{n}")), spb(ms, &by_alias(1..=1, 1.0))));
    }
    // Ids holding the separator: group c9:b node c, and group c9 node b:c.
    let c9 = format!("c9{group}");
    messages.push((
        format!("spBv1.0/{c9}:b/NBIRTH/c"),
        bd_seq_metric(ms, 0, &named(1, 1)),
    ));
    messages.push((
        format!("spBv1.0/{c9}/NBIRTH/b:c"),
        bd_seq_metric(ms, 0, &named(1, 1)),
    ));
    publish_all(&broker, &messages, 1).await;
    // Readings: real 21 + 20, hogs 4 x 3,001, late 21 + 20, the two c9 nodes 2 each.
    // Refused: 200 stale_death, 200 + 1,500 unknown_alias, 4 birth_store_full.
    let (readings, rejected) = (21 + 20 + 4 * 3001 + 21 + 20 + 2 + 2, 200 + 200 + 1500 + 4);
    wait_ingested(&d, readings, rejected).await;
    let by_reason = rejected_by_reason(&d.stats);
    assert_eq!(by_reason.get("stale_death"), Some(&200));
    assert_eq!(by_reason.get("unknown_alias"), Some(&1700));
    assert_eq!(by_reason.get("birth_store_full"), Some(&4));
    let elapsed = started.elapsed().as_secs();
    d.stop().await.unwrap();
    let docs = StoreReader::open(&dir.path().join("b.redb"))
        .unwrap()
        .buckets(None, i64::MIN, i64::MAX)
        .unwrap();
    let count = |series: &str| -> i64 {
        docs.iter()
            .filter(|d| d.series == series)
            .map(|d| d.count)
            .sum()
    };
    assert_eq!(
        count(&format!("{group}:real/m0")),
        2,
        "the live session's aliases kept"
    );
    assert_eq!(
        count(&format!("{group}:late/m19")),
        2,
        "a node born after the hogs: all of it"
    );
    assert_eq!(count(&format!("{c9}%3Ab:c/m0")), 1);
    assert_eq!(count(&format!("{c9}:b%3Ac/m0")), 1);
    // The requests that reached the broker: the real node once; all nodes within the bound.
    next_state(&mut to_real).await;
    let drain = |rx: &mut tokio::sync::mpsc::UnboundedReceiver<(bool, serde_json::Value)>| {
        let mut n = 0;
        while rx.try_recv().is_ok() {
            n += 1;
        }
        n
    };
    assert_eq!(
        drain(&mut to_real),
        0,
        "asked once, 200 deaths and births notwithstanding"
    );
    let all = drain(&mut ncmd);
    let bound = 100 + 10 * (elapsed + 1);
    assert!(
        (1..=bound).contains(&all),
        "{all} rebirth requests, bound {bound}"
    );
}
