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
    /// NDEATH, DDEATH, NCMD, DCMD, STATE: no readings.
    Control {
        node_death: bool,
    },
}

/// What the BIRTH messages said, per edge node: each alias's name and each name's datatype.
/// Bounded: at most `limits::SPARKPLUG_NODES_MAX` edge nodes and `limits::SPARKPLUG_NAMES_MAX`
/// names and as many aliases in all, each name at most `reading::NAME_BYTES_MAX` bytes (a
/// longer one could name no series). Past a bound a birth's metrics are still read; what
/// they would have taught is not kept, and its DATA by alias is counted as unknown.
#[derive(Debug, Default)]
pub struct Births {
    nodes: HashMap<(Box<str>, Box<str>), Node>,
    /// Names and aliases kept, all nodes together.
    kept: usize,
}

#[derive(Debug, Default)]
struct Node {
    aliases: HashMap<u64, Arc<str>>,
    datatypes: HashMap<Arc<str>, u32>,
    /// When bucketd last asked this node for a rebirth.
    asked: Option<Timestamp>,
}

impl Births {
    fn key(group: &str, node: &str) -> (Box<str>, Box<str>) {
        (Box::from(group), Box::from(node))
    }

    /// Forgets what a node's births said (its death, or a new NBIRTH).
    fn forget(&mut self, group: &str, node: &str) {
        if let Some(gone) = self.nodes.remove(&Births::key(group, node)) {
            self.kept -= gone.aliases.len() + gone.datatypes.len();
        }
    }

    /// Records that `node`'s metric `name` has `alias` and `datatype`, within the bounds.
    fn learn(
        &mut self,
        group: &str,
        node: &str,
        name: &str,
        alias: Option<u64>,
        datatype: Option<u32>,
    ) {
        if name.len() > crate::reading::NAME_BYTES_MAX {
            return;
        }
        let key = Births::key(group, node);
        if !self.nodes.contains_key(&key) && self.nodes.len() >= limits::SPARKPLUG_NODES_MAX {
            return;
        }
        let room = limits::SPARKPLUG_NAMES_MAX.saturating_sub(self.kept);
        let n = self.nodes.entry(key).or_default();
        let new_name = !n.datatypes.contains_key(name);
        let new_alias = alias.is_some_and(|a| !n.aliases.contains_key(&a));
        if usize::from(new_name) + usize::from(new_alias) > room {
            return;
        }
        let name: Arc<str> = match n.datatypes.get_key_value(name) {
            Some((k, _)) => k.clone(),
            None => Arc::from(name),
        };
        let datatype = datatype
            .or_else(|| n.datatypes.get(&name).copied())
            .unwrap_or(0);
        n.datatypes.insert(name.clone(), datatype);
        if let Some(alias) = alias {
            n.aliases.insert(alias, name);
        }
        self.kept += usize::from(new_name) + usize::from(new_alias);
    }

    /// The rebirth request for a node that sent an alias no birth named: at most once per
    /// `interval` (`None`: never). The node is kept, empty if need be, to remember when it was
    /// asked.
    fn ask_rebirth(
        &mut self,
        group: &str,
        node: &str,
        now: Timestamp,
        interval: Option<std::time::Duration>,
    ) -> Option<(String, Vec<u8>)> {
        let interval = i64::try_from(interval?.as_nanos()).unwrap_or(i64::MAX);
        let key = Births::key(group, node);
        if !self.nodes.contains_key(&key) && self.nodes.len() >= limits::SPARKPLUG_NODES_MAX {
            return None;
        }
        let state = self.nodes.entry(key).or_default();
        let due = state
            .asked
            .is_none_or(|at| now.as_nanos().saturating_sub(at.as_nanos()) >= interval);
        due.then(|| {
            state.asked = Some(now);
            rebirth_request(group, node, now)
        })
    }

    /// The edge nodes whose births are kept, and the names and aliases kept in all.
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
        return levels.next().is_none().then_some((
            group,
            Kind::Control { node_death: false },
            host,
            None,
        ));
    }
    let kind = levels.next()?;
    let node = levels.next()?;
    let device = levels.next();
    if levels.next().is_some() || group.is_empty() || node.is_empty() {
        return None;
    }
    let kind = match (kind, device) {
        ("NBIRTH", None) => Kind::NodeBirth,
        ("NDATA", None) => Kind::NodeData,
        ("DBIRTH", Some(_)) => Kind::DeviceBirth,
        ("DDATA", Some(_)) => Kind::DeviceData,
        ("NDEATH", None) => Kind::Control { node_death: true },
        ("DDEATH" | "DCMD", Some(_)) | ("NCMD", None) => Kind::Control { node_death: false },
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
    if let Kind::Control { node_death } = kind {
        // A DEATH or command may carry a payload (bdSeq); it is read for what it means only.
        if node_death {
            births.forget(group, node);
        }
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
    let mut sensor = format!("{group}:{node}");
    if let Some(device) = device {
        sensor.push(':');
        sensor.push_str(device);
    }
    let birth = matches!(kind, Kind::NodeBirth | Kind::DeviceBirth);
    if kind == Kind::NodeBirth {
        // A new session of the edge node: its aliases may all have changed.
        births.forget(group, node);
    }
    if birth {
        for m in &payload.metrics {
            if let Some(name) = &m.name {
                births.learn(group, node, name, m.alias, m.datatype);
            }
        }
    }
    // The node's births, looked up once: nothing below changes them.
    let known = births.nodes.get(&Births::key(group, node));
    let mut name_buf = String::new();
    let mut unknown = false;
    for m in &payload.metrics {
        let name: &str = match (&m.name, m.alias) {
            (Some(name), _) => name,
            (None, Some(alias)) => {
                let Some(name) = known.and_then(|s| s.aliases.get(&alias)) else {
                    unknown = true;
                    out.rejected.push(DecodeError::UnknownAlias);
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
            .or_else(|| known.and_then(|s| s.datatypes.get(name).copied()))
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
                let ns = i64::try_from(ms)
                    .ok()
                    .and_then(|ms| ms.checked_mul(1_000_000));
                let Some(ns) = ns else {
                    out.rejected.push(DecodeError::InvalidTimestamp);
                    continue;
                };
                Timestamp::from_nanos(ns)
            }
        };
        super::slashes_to_dots(name, &mut name_buf);
        out.push(ctx, &sensor, &name_buf, ts, value);
    }
    if unknown {
        out.rebirth = births.ask_rebirth(group, node, ctx.received, rebirth_interval);
    }
    if out.readings.is_empty() && out.rejected.is_empty() {
        // A BIRTH of only strings and protocol metrics, or a DATA with no metrics: what it
        // meant (names, aliases) is kept; it carries no readings.
        out.control = true;
    }
    Ok(())
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
