//! Sparkplug B 3.0 (`format = "sparkplug_b"`): Eclipse Tahu's protobuf payloads on
//! `spBv1.0/<group>/<type>/<edge node>[/<device>]`.
//!
//! Sensor = `<group>:<edge node>` or `<group>:<edge node>:<device>`, metric = the metric's name
//! with `/` turned into `.`. NBIRTH and DBIRTH name the metrics and give their aliases and
//! datatypes ([`Births`], kept per edge node); NDATA and DDATA name them by name or alias.
//! Every numeric datatype and Boolean (1/0) is a reading, at the metric's own timestamp, else
//! the payload's, else the receive time (historical metrics too: their readings go to the
//! bucket of their time). Null, string, bytes, date, dataset and template metrics are skipped
//! and counted (`not_numeric`); so is a metric whose alias no BIRTH named (`unknown_alias`),
//! and bucketd then asks the edge node for a rebirth ([`Decoded::rebirth`]), as a Sparkplug
//! host application does. The protocol's own metrics (`bdSeq`, `Node Control/...`) are not
//! readings. DEATH, command and STATE messages carry no readings: they are counted as control
//! messages.
//!
//! Nothing from the network is trusted: the metrics of a payload are counted on the wire
//! before any is decoded ([`crate::limits::SPARKPLUG_METRICS_MAX`]); strings, bytes, datasets
//! and templates are skipped unread; the edge nodes and the aliases kept are bounded.

use std::collections::HashMap;
use std::sync::Arc;

use prost::Message;

use super::{DecodeContext, DecodeError, Decoded};
use crate::limits;
use crate::reading::Timestamp;

/// Tahu's `Payload`, the fields bucketd reads (prost skips the others unread). No `Debug`
/// (`skip_debug`): nothing prints one, and the gateway build's size budget is tight.
#[derive(Clone, PartialEq, prost::Message)]
#[prost(skip_debug)]
pub struct Payload {
    #[prost(uint64, optional, tag = "1")]
    pub timestamp: Option<u64>,
    #[prost(message, repeated, tag = "2")]
    pub metrics: Vec<Metric>,
    #[prost(uint64, optional, tag = "3")]
    pub seq: Option<u64>,
    #[prost(string, optional, tag = "4")]
    pub uuid: Option<String>,
}

/// Tahu's `Payload.Metric`: the value kinds that can be readings; string, bytes, dataset,
/// template and extension values are skipped by the decoder without being read.
#[derive(Clone, PartialEq, prost::Message)]
#[prost(skip_debug)]
pub struct Metric {
    #[prost(string, optional, tag = "1")]
    pub name: Option<String>,
    #[prost(uint64, optional, tag = "2")]
    pub alias: Option<u64>,
    #[prost(uint64, optional, tag = "3")]
    pub timestamp: Option<u64>,
    #[prost(uint32, optional, tag = "4")]
    pub datatype: Option<u32>,
    #[prost(bool, optional, tag = "5")]
    pub is_historical: Option<bool>,
    #[prost(bool, optional, tag = "7")]
    pub is_null: Option<bool>,
    #[prost(oneof = "Value", tags = "10, 11, 12, 13, 14")]
    pub value: Option<Value>,
}

#[derive(Clone, Copy, PartialEq, prost::Oneof)]
pub enum Value {
    #[prost(uint32, tag = "10")]
    Int(u32),
    #[prost(uint64, tag = "11")]
    Long(u64),
    #[prost(float, tag = "12")]
    Float(f32),
    #[prost(double, tag = "13")]
    Double(f64),
    #[prost(bool, tag = "14")]
    Boolean(bool),
}

/// Sparkplug datatypes (Tahu's `DataType`) that are readings.
mod datatype {
    pub const INT8: u32 = 1;
    pub const INT16: u32 = 2;
    pub const INT32: u32 = 3;
    pub const INT64: u32 = 4;
    pub const UINT8: u32 = 5;
    pub const UINT16: u32 = 6;
    pub const UINT32: u32 = 7;
    pub const UINT64: u32 = 8;
    pub const FLOAT: u32 = 9;
    pub const DOUBLE: u32 = 10;
    pub const BOOLEAN: u32 = 11;
}

/// The message types of a Sparkplug topic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    NodeBirth,
    DeviceBirth,
    NodeData,
    DeviceData,
    NodeDeath,
    DeviceDeath,
    /// NCMD, DCMD, STATE: no readings.
    Control,
}

/// What the BIRTH messages said, per edge node, and what bucketd asked of each. Bounded, and
/// fair to every node: at most `limits::SPARKPLUG_NODES_MAX` nodes (an entry that holds no
/// births, left by a death or by a DATA that named no birth, gives its place to a new node,
/// least recently used first) and `limits::SPARKPLUG_NAMES_MAX` names and aliases in all, at
/// most `limits::SPARKPLUG_NODE_NAMES_MAX` of them one node's; a node past its share keeps
/// what fit and its DATA by the rest is refused (`birth_store_full`), no other node's births
/// touched. Rebirth requests are limited per node (the time asked survives its deaths and
/// births) and in all (`limits::SPARKPLUG_REBIRTHS_BURST`, refilled at
/// `limits::SPARKPLUG_REBIRTHS_PER_SEC`).
#[derive(Debug, Default)]
pub struct Births {
    nodes: HashMap<(Box<str>, Box<str>), Node>,
    /// Names and aliases kept, all nodes together.
    kept: usize,
    /// A counter for least-recently-used order.
    clock: u64,
    /// Rebirth requests that may be sent now, all nodes together, and when it was refilled.
    tokens: u32,
    refilled: Option<Timestamp>,
}

#[derive(Debug, Default)]
struct Node {
    /// The metrics its births named: alias -> (device, name), and per device (`""`: the node
    /// itself) name -> datatype.
    aliases: HashMap<u64, (Arc<str>, Arc<str>)>,
    names: HashMap<Arc<str>, HashMap<Arc<str>, u32>>,
    /// Aliases and names kept.
    entries: usize,
    /// The session an NBIRTH began: its `bdSeq` (a death of another session is stale), and
    /// the `seq` of the session's last message.
    session: Option<Session>,
    /// A birth of this node did not fit its share: DATA by an alias it lacks is refused.
    overfull: bool,
    /// When bucketd last asked this node for a rebirth.
    asked: Option<Timestamp>,
    used: u64,
}

#[derive(Debug, Clone, Copy)]
struct Session {
    bd_seq: Option<u64>,
    seq: Option<u64>,
}

impl Node {
    fn entries(&self) -> usize {
        self.entries
    }

    /// The devices its births named.
    fn devices(&self) -> Vec<Arc<str>> {
        let mut out: Vec<Arc<str>> = self
            .names
            .keys()
            .filter(|d| !d.is_empty())
            .cloned()
            .collect();
        out.sort_unstable();
        out
    }

    /// The datatype its births gave the device's (`""`: the node's) metric `name`.
    fn datatype(&self, device: &str, name: &str) -> Option<u32> {
        self.names.get(device)?.get(name).copied()
    }
}

/// What a birth metric could not be kept as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refused {
    /// The node's share or the store is full.
    Full,
    /// Its alias names another metric of the node (aliases are unique across an edge node and
    /// its devices: Sparkplug 3.0, tck-id-payloads-alias-uniqueness).
    Conflict,
}

impl Births {
    fn key(group: &str, node: &str) -> (Box<str>, Box<str>) {
        (Box::from(group), Box::from(node))
    }

    /// The node's entry, made if there is a place (taking that of the least recently used
    /// entry that holds no births when all are used); `None` when every place holds births.
    fn node(&mut self, group: &str, node: &str) -> Option<&mut Node> {
        self.clock += 1;
        let key = Births::key(group, node);
        if !self.nodes.contains_key(&key) && self.nodes.len() >= limits::SPARKPLUG_NODES_MAX {
            let idle = self
                .nodes
                .iter()
                .filter(|(_, n)| n.entries() == 0 && n.session.is_none())
                .min_by_key(|(_, n)| n.used)
                .map(|(k, _)| k.clone())?;
            self.nodes.remove(&idle);
        }
        let clock = self.clock;
        let n = self.nodes.entry(key).or_default();
        n.used = clock;
        Some(n)
    }

    /// Forgets what the node's births said (keeping when it was asked for a rebirth).
    fn clear(&mut self, group: &str, node: &str) {
        if let Some(n) = self.nodes.get_mut(&Births::key(group, node)) {
            self.kept -= n.entries;
            n.entries = 0;
            n.aliases = HashMap::new();
            n.names = HashMap::new();
            n.overfull = false;
        }
    }

    /// An NBIRTH: a new session of the node, whose births replace the old ones.
    fn node_birth(&mut self, group: &str, node: &str, bd_seq: Option<u64>, seq: Option<u64>) {
        self.clear(group, node);
        if let Some(n) = self.node(group, node) {
            n.session = Some(Session { bd_seq, seq });
        }
    }

    /// An NDEATH: honoured (the node's births forgotten, its devices returned) only when its
    /// `bdSeq` is its current session's, as Sparkplug 3.0 has a host do (a broker may deliver
    /// an old session's Will after the node came back).
    fn node_death(
        &mut self,
        group: &str,
        node: &str,
        bd_seq: Option<u64>,
    ) -> Option<Vec<Arc<str>>> {
        let n = self.nodes.get_mut(&Births::key(group, node))?;
        if n.session?.bd_seq != bd_seq {
            return None;
        }
        n.session = None;
        let devices = n.devices();
        self.clear(group, node);
        Some(devices)
    }

    /// Whether a DBIRTH's aliases conflict with the node's other metrics'.
    fn conflicts(&self, group: &str, node: &str, device: &str, metrics: &[Metric]) -> bool {
        let Some(n) = self.nodes.get(&Births::key(group, node)) else {
            return false;
        };
        metrics.iter().any(|m| {
            m.alias
                .is_some_and(|a| n.aliases.get(&a).is_some_and(|(d, _)| &**d != device))
        })
    }

    /// Forgets a device's aliases and names (its new DBIRTH replaces them).
    fn forget_device(&mut self, group: &str, node: &str, device: &str) {
        let Some(n) = self.nodes.get_mut(&Births::key(group, node)) else {
            return;
        };
        let before = n.aliases.len();
        n.aliases.retain(|_, (d, _)| &**d != device);
        let gone = before - n.aliases.len() + n.names.remove(device).map_or(0, |m| m.len());
        n.entries -= gone;
        self.kept -= gone;
    }

    /// Records that the node's (or its `device`'s) metric `name` has `alias` and `datatype`,
    /// within the bounds.
    fn learn(
        &mut self,
        group: &str,
        node: &str,
        device: Option<&str>,
        m: &Metric,
    ) -> Result<(), Refused> {
        let Some(name) = m.name.as_deref() else {
            return Ok(());
        };
        if name.len() > crate::reading::NAME_BYTES_MAX {
            return Ok(()); // no series could have it
        }
        let room = limits::SPARKPLUG_NAMES_MAX.saturating_sub(self.kept);
        let Some(n) = self.node(group, node) else {
            return Err(Refused::Full);
        };
        let device = device.unwrap_or("");
        if let Some(alias) = m.alias
            && n.aliases
                .get(&alias)
                .is_some_and(|(d, was)| &**d != device || &**was != name)
        {
            return Err(Refused::Conflict);
        }
        let new_name = n.datatype(device, name).is_none();
        let new_alias = m.alias.is_some_and(|a| !n.aliases.contains_key(&a));
        let adds = usize::from(new_name) + usize::from(new_alias);
        let share = limits::SPARKPLUG_NODE_NAMES_MAX.saturating_sub(n.entries);
        if adds > room.min(share) {
            n.overfull = true;
            return Err(Refused::Full);
        }
        let device: Arc<str> = match n.names.get_key_value(device) {
            Some((d, _)) => d.clone(),
            None => Arc::from(device),
        };
        let names = n.names.entry(device.clone()).or_default();
        let name: Arc<str> = match names.get_key_value(name) {
            Some((k, _)) => k.clone(),
            None => Arc::from(name),
        };
        let datatype = m
            .datatype
            .or_else(|| names.get(&name).copied())
            .unwrap_or(0);
        names.insert(name.clone(), datatype);
        if let Some(alias) = m.alias {
            n.aliases.insert(alias, (device, name));
        }
        n.entries += adds;
        self.kept += adds;
        Ok(())
    }

    /// Notes a message's `seq` in the node's session; whether one was missed (the node's
    /// messages are numbered 0..=255 in turn from its NBIRTH's, Sparkplug 3.0
    /// tck-id-payloads-ndata-seq-inc). A node without a session has nothing to miss.
    fn next_seq(&mut self, group: &str, node: &str, seq: Option<u64>) -> bool {
        let Some(n) = self.nodes.get_mut(&Births::key(group, node)) else {
            return false;
        };
        let Some(session) = &mut n.session else {
            return false;
        };
        let missed = matches!((session.seq, seq), (Some(was), Some(now)) if now != (was + 1) % 256);
        session.seq = seq.or(session.seq);
        missed
    }

    /// The rebirth request for a node whose DATA bucketd cannot read (an alias no birth named,
    /// a missed message): at most once per `interval` per node (`None`: never), and within the
    /// requests all nodes together may have.
    fn ask_rebirth(
        &mut self,
        group: &str,
        node: &str,
        now: Timestamp,
        interval: Option<std::time::Duration>,
    ) -> Option<(String, Vec<u8>)> {
        let interval = i64::try_from(interval?.as_nanos()).unwrap_or(i64::MAX);
        let since = |at: Timestamp| now.as_nanos().saturating_sub(at.as_nanos());
        // Refill the requests all nodes may have.
        let refill = match self.refilled {
            None => u64::from(limits::SPARKPLUG_REBIRTHS_BURST),
            Some(at) => {
                u64::try_from(since(at) / 1_000_000_000).unwrap_or(0)
                    * u64::from(limits::SPARKPLUG_REBIRTHS_PER_SEC)
            }
        };
        if refill > 0 {
            let tokens =
                (u64::from(self.tokens) + refill).min(u64::from(limits::SPARKPLUG_REBIRTHS_BURST));
            self.tokens = u32::try_from(tokens).unwrap_or(0);
            self.refilled = Some(now);
        }
        if self.tokens == 0 {
            return None;
        }
        let state = self.node(group, node)?;
        if state.asked.is_some_and(|at| since(at) < interval) {
            return None;
        }
        state.asked = Some(now);
        self.tokens -= 1;
        Some(rebirth_request(group, node, now))
    }

    /// Whether DATA by an alias the node's births lack is refused for want of room (the node
    /// past its share, or no place for it), not asked for again.
    fn no_room_for(&self, group: &str, node: &str) -> bool {
        match self.nodes.get(&Births::key(group, node)) {
            Some(n) => n.overfull,
            None => {
                self.nodes.len() >= limits::SPARKPLUG_NODES_MAX
                    && !self
                        .nodes
                        .values()
                        .any(|n| n.entries() == 0 && n.session.is_none())
            }
        }
    }

    /// The edge nodes held, and the names and aliases kept in all.
    pub fn held(&self) -> (usize, usize) {
        (self.nodes.len(), self.kept)
    }
}

/// The topic's group, type, edge node and device.
fn parse_topic(topic: &str) -> Option<(&str, Kind, &str, Option<&str>)> {
    let mut levels = topic.split('/');
    if levels.next()? != "spBv1.0" {
        return None;
    }
    let group = levels.next()?;
    if group == "STATE" {
        // spBv1.0/STATE/<host id>: a host application's state.
        let host = levels.next()?;
        return levels
            .next()
            .is_none()
            .then_some((group, Kind::Control, host, None));
    }
    let kind = levels.next()?;
    let node = levels.next()?;
    let device = levels.next();
    if levels.next().is_some() || group.is_empty() || node.is_empty() || device == Some("") {
        return None;
    }
    let kind = match (kind, device) {
        ("NBIRTH", None) => Kind::NodeBirth,
        ("NDATA", None) => Kind::NodeData,
        ("DBIRTH", Some(_)) => Kind::DeviceBirth,
        ("DDATA", Some(_)) => Kind::DeviceData,
        ("NDEATH", None) => Kind::NodeDeath,
        ("DDEATH", Some(_)) => Kind::DeviceDeath,
        ("DCMD", Some(_)) | ("NCMD", None) => Kind::Control,
        _ => return None,
    };
    Some((group, kind, node, device))
}

/// How many metrics a payload holds, read from the wire without decoding any; `None` when it
/// is not a well-formed protobuf message.
fn count_metrics(mut buf: &[u8]) -> Option<usize> {
    let mut metrics = 0usize;
    while !buf.is_empty() {
        let key = prost::encoding::decode_varint(&mut buf).ok()?;
        let (field, wire) = (key >> 3, key & 7);
        match wire {
            0 => {
                prost::encoding::decode_varint(&mut buf).ok()?;
            }
            1 => buf = buf.get(8..)?,
            2 => {
                let len = usize::try_from(prost::encoding::decode_varint(&mut buf).ok()?).ok()?;
                buf = buf.get(len..)?;
                if field == 2 {
                    metrics += 1;
                }
            }
            5 => buf = buf.get(4..)?,
            _ => return None, // groups (3, 4) are not in Tahu's schema
        }
    }
    Some(metrics)
}

/// A metric's value as a reading, by its datatype (from the metric, else from its BIRTH, else
/// from the value's own kind); `None` for a value that is no number.
///
/// Integers are read from either integer field: the specification puts 8 to 32-bit types in
/// `int_value`, but Tahu's own JavaScript encoder sends `UInt32` in `long_value`. Signed types
/// travel as two's complement in 32 or 64 bits depending on the encoder: their low bits are the
/// value either way.
fn number(kind: u32, value: Value) -> Option<f64> {
    use datatype as t;
    let int = match value {
        Value::Int(v) => Some(u64::from(v)),
        Value::Long(v) => Some(v),
        _ => None,
    };
    Some(match (kind, int, value) {
        (t::INT8, Some(v), _) => f64::from(v as u8 as i8),
        (t::INT16, Some(v), _) => f64::from(v as u16 as i16),
        (t::INT32, Some(v), _) => f64::from(v as u32 as i32),
        (t::INT64, Some(v), _) => v as i64 as f64,
        (t::UINT8, Some(v), _) => f64::from(v as u8),
        (t::UINT16, Some(v), _) => f64::from(v as u16),
        (t::UINT32, Some(v), _) => f64::from(v as u32),
        (t::UINT64 | 0, Some(v), _) => v as f64,
        (t::FLOAT | 0, _, Value::Float(f)) => f64::from(f),
        (t::DOUBLE | 0, _, Value::Double(d)) => d,
        (t::BOOLEAN | 0, _, Value::Boolean(b)) => f64::from(u8::from(b)),
        _ => return None,
    })
}

/// The protocol's own metrics, not the device's readings.
fn protocol_metric(name: &str) -> bool {
    name == "bdSeq" || name.starts_with("Node Control/")
}

/// The metric that records a node's or device's births and deaths: 1 from a birth, 0 from a
/// death (Sparkplug 3.0: a host marks them online and offline, their metrics stale).
pub const ONLINE: &str = "sparkplug.online";

/// An id in a sensor name: `:` (the separator) and `%` written as `%3A` and `%25`, so that
/// group `a:b` node `c` and group `a` node `b:c` stay two sensors. An id without either is
/// written as it is (the names of earlier releases).
fn push_id(id: &str, sensor: &mut String) {
    for c in id.chars() {
        match c {
            ':' => sensor.push_str("%3A"),
            '%' => sensor.push_str("%25"),
            c => sensor.push(c),
        }
    }
}

/// The sensor of a node (`<group>:<edge node>`) or of its device (`...:<device>`).
fn sensor_of(group: &str, node: &str, device: Option<&str>) -> String {
    let mut sensor = String::with_capacity(group.len() + node.len() + 2);
    push_id(group, &mut sensor);
    sensor.push(':');
    push_id(node, &mut sensor);
    if let Some(device) = device {
        sensor.push(':');
        push_id(device, &mut sensor);
    }
    sensor
}

/// The `bdSeq` metric of an NBIRTH or NDEATH.
fn bd_seq(payload: &Payload) -> Option<u64> {
    payload
        .metrics
        .iter()
        .find(|m| m.name.as_deref() == Some("bdSeq"))
        .and_then(|m| match m.value {
            Some(Value::Long(v)) => Some(v),
            Some(Value::Int(v)) => Some(u64::from(v)),
            _ => None,
        })
}

/// A time in milliseconds as a timestamp; `None` past what one holds.
fn from_ms(ms: u64) -> Option<Timestamp> {
    i64::try_from(ms)
        .ok()
        .and_then(|ms| ms.checked_mul(1_000_000))
        .map(Timestamp::from_nanos)
}

/// Decodes a Sparkplug B message; `births` is what earlier BIRTH messages said.
pub(super) fn decode(
    topic: &str,
    payload: &[u8],
    ctx: &DecodeContext,
    rebirth_interval: Option<std::time::Duration>,
    births: &mut Births,
    out: &mut Decoded,
) -> Result<(), DecodeError> {
    let (group, kind, node, device) = parse_topic(topic).ok_or(DecodeError::TopicMismatch)?;
    if kind == Kind::Control {
        out.control = true;
        return Ok(());
    }
    let metrics = count_metrics(payload).ok_or(DecodeError::InvalidSparkplug)?;
    if metrics > limits::SPARKPLUG_METRICS_MAX {
        return Err(DecodeError::InvalidSparkplug);
    }
    let payload = Payload::decode(payload).map_err(|_| DecodeError::InvalidSparkplug)?;
    if payload.uuid.as_deref() == Some("SPBV1.0_COMPRESSED") {
        return Err(DecodeError::InvalidSparkplug); // compressed payloads are not read (README)
    }
    let sensor = sensor_of(group, node, device);
    let sent = payload.timestamp.and_then(from_ms).unwrap_or(ctx.received);
    let mut missed = false;
    match kind {
        Kind::NodeDeath => {
            // Offline at the host's time (tck-id-operational-behavior-edge-node-termination-
            // host-action-ndeath-node-offline), the node's devices with it.
            match births.node_death(group, node, bd_seq(&payload)) {
                Some(devices) => {
                    out.push(ctx, &sensor, ONLINE, ctx.received, 0.0);
                    for d in devices {
                        out.push(
                            ctx,
                            &sensor_of(group, node, Some(&d)),
                            ONLINE,
                            ctx.received,
                            0.0,
                        );
                    }
                }
                None => out.rejected.push(DecodeError::StaleDeath),
            }
            return Ok(());
        }
        Kind::DeviceDeath => {
            // Offline at the DDEATH's own time (...-ddeath-devices-offline).
            missed = births.next_seq(group, node, payload.seq);
            out.push(ctx, &sensor, ONLINE, sent, 0.0);
        }
        Kind::NodeBirth => {
            births.node_birth(group, node, bd_seq(&payload), payload.seq);
            out.push(ctx, &sensor, ONLINE, sent, 1.0);
        }
        Kind::DeviceBirth => {
            let device = device.unwrap_or("");
            if births.conflicts(group, node, device, &payload.metrics) {
                // Refused whole: its aliases would re-map another metric of the node.
                out.rejected
                    .extend(payload.metrics.iter().map(|_| DecodeError::AliasConflict));
                return Ok(());
            }
            missed = births.next_seq(group, node, payload.seq);
            births.forget_device(group, node, device);
            out.push(ctx, &sensor, ONLINE, sent, 1.0);
        }
        Kind::NodeData | Kind::DeviceData => missed = births.next_seq(group, node, payload.seq),
        Kind::Control => {}
    }
    let birth = matches!(kind, Kind::NodeBirth | Kind::DeviceBirth);
    let mut conflicting: Vec<usize> = Vec::new();
    if birth {
        for (i, m) in payload.metrics.iter().enumerate() {
            if births.learn(group, node, device, m) == Err(Refused::Conflict) {
                conflicting.push(i);
            }
        }
    }
    let unknown = readings(
        &payload,
        &sensor,
        (births, group, node, device.unwrap_or("")),
        &conflicting,
        ctx,
        out,
    );
    if unknown || missed {
        out.rebirth = births.ask_rebirth(group, node, ctx.received, rebirth_interval);
    }
    if out.readings.is_empty() && out.rejected.is_empty() {
        // A BIRTH of only strings and protocol metrics, or a DATA with no metrics: what it
        // meant (names, aliases) is kept; it carries no readings.
        out.control = true;
    }
    Ok(())
}

/// The payload's metrics as readings of `sensor`; whether one named an alias that no birth
/// the node's births hold names (not one refused for want of room).
fn readings(
    payload: &Payload,
    sensor: &str,
    (births, group, node, device): (&Births, &str, &str, &str),
    conflicting: &[usize],
    ctx: &DecodeContext,
    out: &mut Decoded,
) -> bool {
    // The node's births, looked up once: nothing below changes them.
    let known = births.nodes.get(&Births::key(group, node));
    let mut name_buf = String::new();
    let mut unknown = false;
    for (i, m) in payload.metrics.iter().enumerate() {
        if conflicting.contains(&i) {
            out.rejected.push(DecodeError::AliasConflict);
            continue;
        }
        let name: &str = match (&m.name, m.alias) {
            (Some(name), _) => name,
            (None, Some(alias)) => {
                let found = known
                    .and_then(|s| s.aliases.get(&alias))
                    .filter(|(d, _)| &**d == device);
                let Some((_, name)) = found else {
                    if births.no_room_for(group, node) {
                        out.rejected.push(DecodeError::BirthStoreFull);
                    } else {
                        unknown = true;
                        out.rejected.push(DecodeError::UnknownAlias);
                    }
                    continue;
                };
                name
            }
            (None, None) => {
                out.rejected.push(DecodeError::InvalidName);
                continue;
            }
        };
        if protocol_metric(name) {
            continue;
        }
        let datatype = m
            .datatype
            .or_else(|| known.and_then(|s| s.datatype(device, name)))
            .unwrap_or(0);
        let value = match (m.is_null, m.value) {
            (Some(true), _) | (_, None) => None,
            (_, Some(v)) => number(datatype, v),
        };
        let Some(value) = value else {
            out.rejected.push(DecodeError::NotNumeric);
            continue;
        };
        let ts = match m.timestamp.or(payload.timestamp) {
            None => {
                out.receive_time = true;
                ctx.received
            }
            Some(ms) => {
                let Some(ts) = from_ms(ms) else {
                    out.rejected.push(DecodeError::InvalidTimestamp);
                    continue;
                };
                ts
            }
        };
        super::slashes_to_dots(name, &mut name_buf);
        out.push(ctx, sensor, &name_buf, ts, value);
    }
    unknown
}

/// The NCMD a host application sends to ask an edge node for its births again: topic and
/// payload (a `Payload` of one metric, `Node Control/Rebirth` = true, written field by field:
/// the one message bucketd encodes, so the derived encoder is left out of the build).
fn rebirth_request(group: &str, node: &str, now: Timestamp) -> (String, Vec<u8>) {
    use prost::encoding::{WireType, encode_key, encode_varint};
    const NAME: &[u8] = b"Node Control/Rebirth";
    let mut metric = Vec::with_capacity(32);
    encode_key(1, WireType::LengthDelimited, &mut metric);
    encode_varint(NAME.len() as u64, &mut metric);
    metric.extend_from_slice(NAME);
    encode_key(4, WireType::Varint, &mut metric);
    encode_varint(u64::from(datatype::BOOLEAN), &mut metric);
    encode_key(14, WireType::Varint, &mut metric);
    encode_varint(1, &mut metric);
    let mut payload = Vec::with_capacity(48);
    encode_key(1, WireType::Varint, &mut payload);
    encode_varint(
        u64::try_from(now.as_nanos() / 1_000_000).unwrap_or(0),
        &mut payload,
    );
    encode_key(2, WireType::LengthDelimited, &mut payload);
    encode_varint(metric.len() as u64, &mut payload);
    payload.extend_from_slice(&metric);
    (format!("spBv1.0/{group}/NCMD/{node}"), payload)
}
