//! Admission: what one MQTT message becomes before it joins the open batch. [`Admitter::admit`]
//! finds the message's subscription, decodes it, recognises a redelivery of a message already
//! counted, folds a gateway's narrower delta buckets into this store's width, and interns the
//! series names; the ingest task only routes what it returns (readings to the batcher,
//! rejections to the counters). Pure: the caller supplies the receive time; no I/O, no Tokio.
//!
//! Redelivery is told by [`crate::dedup`] fingerprints for device messages (and, for a
//! reconnect's resends, by their order: [`crate::resend`]; a resend waits as
//! [`Verdict::Held`] until its burst ends), and for delta messages by their position in the
//! gateway's stream, which a central keeps in a [`DeltaLedger`] (the fleet tier's, attached
//! here: this module does not know it).

use std::collections::HashMap;
use std::sync::Arc;

use crate::config::{GatewayLimits, Limits};
use crate::decode::{self, DecodeContext, Decoded, Format, Subscription};
use crate::dedup::{self, Fingerprint, Fingerprinter, Ident, Tag, Window};
use crate::delta::Position;
use crate::reading::Timestamp;
use crate::reject::DecodeError;
use crate::resend::{BurstPart, Resends};
use crate::series::SeriesSet;
use crate::sketch::{Sketch, SketchParams};
use crate::summary::Summary;

/// What a central knows of each gateway's delta stream: the last position applied. The fleet
/// tier implements it (`fleet::applied`); an edge build has none.
pub trait DeltaLedger: Send {
    /// The last position applied from `gateway`'s database `origin` (its current one, or one
    /// it used before), if any.
    fn last(&self, gateway: &str, origin: &str) -> Option<&Position>;
    /// Whether any position of `gateway` is recorded.
    fn knows(&self, gateway: &str) -> bool;
    /// Records `at` as the last position applied from `gateway`; returns the positions to
    /// store with the batch, under their keys (the gateway's own, and those of databases it
    /// used before when `at` changes its database).
    fn insert(&mut self, gateway: &str, at: Position) -> Vec<(String, Position)>;

    /// Whether `at` is at or before the last position applied from its gateway's database (a
    /// copy).
    fn contains(&self, gateway: &str, at: &Position) -> bool {
        self.last(gateway, &at.origin)
            .is_some_and(|last| at.not_after(last))
    }
}

/// One received PUBLISH, as admission sees it.
#[derive(Debug, Clone, Copy)]
pub struct Message<'a> {
    pub topic: &'a [u8],
    pub payload: &'a [u8],
    pub pkid: u16,
    pub qos: u8,
    /// The broker marks it as a redelivery (MQTT DUP).
    pub dup: bool,
    /// The session it came on (`mqtt.sessions`, 0-based): packet ids are per session.
    pub session: u16,
    pub received: Timestamp,
    /// Where it stands in its session's reconnect burst of resends; `None`: no burst is open.
    pub burst: Option<InBurst>,
    /// QoS 1/2: the arrival number of its ack token (`crate::ack::AckToken::arrival`).
    pub arrival: u64,
}

/// A message of a session whose reconnect burst is open ([`crate::resend`]). The session owns
/// the burst; admission is told where the message stands in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InBurst {
    /// The burst is open and has room: a resend (DUP) that counts is [`Verdict::Held`].
    Open,
    /// A held resend admitted again once its burst ended: what [`Resends::end_burst`] made of
    /// it.
    Told(BurstPart),
}

/// What becomes of a message as a whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Verdict {
    /// Its readings (if any) join the batch.
    #[default]
    New,
    /// A copy of a message already counted: acknowledged, not counted again.
    Copy,
    /// Rejected as a whole, for this reason: acknowledged and counted.
    Rejected(DecodeError),
    /// A resend in a reconnect's burst, with its fingerprint: the caller holds it in the burst
    /// and admits it again, [`InBurst::Told`] what it is, when the burst ends
    /// ([`Resends::end_burst`]).
    Held(Fingerprint),
}

/// The outcome of [`Admitter::admit`]; its buffers are reused from message to message.
#[derive(Debug, Default)]
pub struct Admitted {
    pub verdict: Verdict,
    /// Readings to batch: series, time, value.
    pub readings: Vec<(Arc<str>, Timestamp, f64)>,
    /// Bucket summaries to batch (delta messages): series, bucket start (s), summary.
    pub summaries: Vec<(Arc<str>, i64, Summary)>,
    /// Readings or buckets rejected on their own; the message's others are kept.
    pub rejected: Vec<DecodeError>,
    /// Kept for the subscription's raw pages.
    pub store_raw: bool,
    /// Recorded with the batch, for recognising a redelivery after a crash: the fingerprint and
    /// its resend sequence.
    pub fingerprint: Option<(Fingerprint, Tag)>,
    /// The batch now repeats the messages committed before it ([`Resends::counted`]): commit it
    /// at once.
    pub replay: bool,
    /// A delta message's gateway and position, recorded with the batch.
    pub applied: Option<(String, Position)>,
    /// When the message changed its gateway's database: the positions of the databases it
    /// used before, under their keys (`fleet::applied`), recorded with the batch too.
    pub retired: Vec<(String, Position)>,
    /// The message came on a delta subscription: the gateway its topic names (for the log).
    pub gateway: Option<String>,
    /// The message carries no readings by design (a Sparkplug DEATH, command or STATE).
    pub control: bool,
    /// A Sparkplug rebirth request to publish (topic, payload).
    pub rebirth: Option<(String, Vec<u8>)>,
}

impl Admitted {
    fn clear(&mut self) {
        self.verdict = Verdict::New;
        self.readings.clear();
        self.summaries.clear();
        self.rejected.clear();
        self.store_raw = false;
        self.fingerprint = None;
        self.replay = false;
        self.applied = None;
        self.retired.clear();
        self.gateway = None;
        self.control = false;
        self.rebirth = None;
    }
}

/// The admission state: subscriptions, limits, the known series, the recent fingerprints and
/// (at a central) the delta ledger and what each gateway uses.
pub struct Admitter {
    subscriptions: Vec<Subscription>,
    limits: Limits,
    gateway_limits: GatewayLimits,
    /// Series per gateway (the `<gateway>:` prefix of their names), bounded by the series.
    gateway_series: HashMap<String, usize>,
    /// This store's sketch settings, into which a delta's sketch is re-binned.
    sketch: SketchParams,
    bucket_width_secs: i64,
    series: SeriesSet,
    dedup: Window,
    /// The database's fingerprints (keyed, issue 52).
    fingerprinter: Fingerprinter,
    resends: Resends,
    ledger: Option<Box<dyn DeltaLedger>>,
    /// A subscription takes delta messages (this is a central): device sensors may not hold `:`.
    takes_deltas: bool,
    decoded: Decoded,
    /// What Sparkplug edge nodes' BIRTH messages said (names, aliases, datatypes).
    births: decode::Births,
    out: Admitted,
}

impl Admitter {
    pub fn new(
        subscriptions: Vec<Subscription>,
        limits: Limits,
        bucket_width_secs: i64,
        series: SeriesSet,
        dedup: Window,
        resends: Resends,
        ledger: Option<Box<dyn DeltaLedger>>,
    ) -> Admitter {
        let mut gateway_series = HashMap::new();
        for name in series.names() {
            if let Some((gateway, _)) = name.split_once(':') {
                *gateway_series.entry(gateway.to_owned()).or_insert(0) += 1;
            }
        }
        let takes_deltas = subscriptions.iter().any(|s| s.format == Format::Delta);
        Admitter {
            takes_deltas,
            subscriptions,
            limits,
            gateway_limits: GatewayLimits::default(),
            gateway_series,
            sketch: SketchParams::DEFAULT,
            bucket_width_secs,
            series,
            dedup,
            fingerprinter: Fingerprinter::default(),
            resends,
            ledger,
            decoded: Decoded::default(),
            births: decode::Births::default(),
            out: Admitted::default(),
        }
    }

    /// At a central: what one gateway may use, and the sketch settings of this store.
    #[must_use]
    pub fn with_gateway_limits(mut self, limits: GatewayLimits, sketch: SketchParams) -> Admitter {
        self.gateway_limits = limits;
        self.sketch = sketch;
        self
    }

    /// The database's fingerprints (its key; unkeyed by default).
    #[must_use]
    pub fn with_fingerprinter(mut self, fingerprinter: Fingerprinter) -> Admitter {
        self.fingerprinter = fingerprinter;
        self
    }

    /// A decoded delta message's position, against the last one applied from its gateway's
    /// database ([`Position::plausible_after`]). A central sees a gateway's whole stream (the
    /// configuration refuses delta subscriptions shared with other instances).
    fn check_position(&self) -> Result<(), DecodeError> {
        let (Some((gateway, at)), Some(ledger)) = (&self.decoded.delta_from, &self.ledger) else {
            return Ok(());
        };
        // A database not seen before starts its own stream (logged when recorded).
        let Some(last) = ledger.last(gateway, &at.origin) else {
            return Ok(());
        };
        let max_jump = self.gateway_limits.max_position_jump;
        if at.plausible_after(last, max_jump) {
            Ok(())
        } else {
            // The refusal is logged at the rate limit with the others (`ingest::core`'s
            // `warn_gateway`; issue 52: one warning per message flooded the log); the
            // positions go to the debug log.
            tracing::debug!(
                gateway = %gateway,
                last_origin = %last.origin,
                last_seq = last.seq,
                origin = %at.origin,
                seq = at.seq,
                max_jump,
                "Refused a delta message whose position no gateway's outbox could have sent \
                 after the last one applied."
            );
            Err(DecodeError::PositionJump)
        }
    }

    fn decode_context(&self, received: Timestamp) -> DecodeContext {
        DecodeContext {
            received,
            oldest: received.saturating_sub(self.limits.max_age),
            newest: received.saturating_add(self.limits.max_future),
            max_payload_bytes: self.limits.max_payload_bytes,
        }
    }

    /// Decides what `m` becomes. See the module doc.
    pub fn admit(&mut self, m: &Message) -> &mut Admitted {
        self.out.clear();
        let ctx = self.decode_context(m.received);
        let decoded = match subscription(&self.subscriptions, m.topic) {
            Ok(sub) => {
                self.out.store_raw = sub.store_raw;
                if sub.format == Format::Delta {
                    self.out.gateway = std::str::from_utf8(m.topic)
                        .ok()
                        .and_then(|t| sub.template.capture(t))
                        .and_then(|c| c.gateway)
                        .map(str::to_owned);
                }
                let decoded = decode::decode_with(
                    sub,
                    m.topic,
                    m.payload,
                    &ctx,
                    &mut self.births,
                    &mut self.decoded,
                );
                decoded.and_then(|()| {
                    let buckets = self.decoded.deltas.len() + self.decoded.rejected.len();
                    let too_many = sub.format == Format::Delta
                        && buckets > self.gateway_limits.max_buckets_per_message;
                    if too_many {
                        Err(DecodeError::GatewayLimit)
                    } else {
                        Ok(())
                    }
                })
            }
            Err(e) => Err(e),
        };
        if let Err(e) = decoded.and_then(|()| self.check_position()) {
            self.out.verdict = Verdict::Rejected(e);
            self.decoded.clear();
            return &mut self.out;
        }
        // A Sparkplug message's meaning beyond readings: asked for whatever becomes of it.
        self.out.control = self.decoded.control;
        self.out.rebirth = self.decoded.rebirth.take();
        // See `crate::dedup` for what identifies a message and when a copy is dropped.
        let receive_time = self.decoded.receive_time;
        let ident = match (receive_time, m.qos) {
            _ if self.decoded.delta_from.is_some() => None, // told apart by position instead
            (false, _) => Some(self.fingerprinter.ident(m.topic, m.payload, None)),
            (true, 0) => None, // never redelivered, and identical copies are distinct
            (true, _) => Some(self.fingerprinter.ident(
                m.topic,
                m.payload,
                Some(dedup::PacketId {
                    session: m.session,
                    pkid: m.pkid,
                }),
            )),
        };
        let fingerprint = ident.map(|i| i.keyed);
        // A resend in a reconnect's burst waits for the burst's end (`crate::resend`), if it
        // counts: one whose readings are all refused is in no sequence, and goes on now.
        if let Some(fp) = fingerprint.filter(|_| m.qos > 0)
            && m.dup
            && m.burst == Some(InBurst::Open)
        {
            self.collect();
            if self.counts() {
                self.out.clear();
                self.out.verdict = Verdict::Held(fp);
                return &mut self.out;
            }
            return self.record(m, ident, receive_time);
        }
        let copy = match (&self.decoded.delta_from, ident) {
            (Some((gateway, at)), _) => self
                .ledger
                .as_ref()
                .is_some_and(|l| l.contains(gateway, at)),
            (None, None) => false,
            (None, Some(fp)) => match m.burst {
                Some(InBurst::Told(BurstPart::Copy)) => true,
                // A packet id given again: new, unless its content says it is the same
                // readings (device timestamps).
                Some(InBurst::Told(BurstPart::New)) if receive_time => false,
                Some(InBurst::Told(BurstPart::New | BurstPart::Unknown)) => self.dedup.holds(fp),
                None | Some(InBurst::Open) => (m.dup || !receive_time) && self.dedup.holds(fp),
            },
        };
        if copy {
            self.out.verdict = Verdict::Copy;
            self.decoded.clear();
            return &mut self.out;
        }
        self.collect();
        self.record(m, ident, receive_time)
    }

    /// Takes the decoded readings and delta buckets into `out`: series interned, a gateway's
    /// narrower buckets folded into this store's width, refusals alongside.
    fn collect(&mut self) {
        for reading in self.decoded.readings() {
            // At a central, `<gateway>:<sensor>/<metric>` names a gateway's series: a device's
            // sensor with a `:` could pass for (and add to) a gateway's (issue 41).
            if self.takes_deltas && crate::reading::split_series(reading.series).0.contains(':') {
                self.out.rejected.push(DecodeError::InvalidName);
                continue;
            }
            match self.series.intern_reading(reading.series) {
                Ok(series) => self.out.readings.push((series, reading.ts, reading.value)),
                Err(e) => self.out.rejected.push(e),
            }
        }
        let gateway = self.decoded.delta_from.as_ref().map(|(g, _)| g.as_str());
        for mut delta in self.decoded.deltas.drain(..) {
            // A gateway's narrower bucket folds into this store's (15 min into an hour:
            // summaries merge); a wider one cannot be split.
            let width = self.bucket_width_secs;
            if width % delta.width_secs != 0 || delta.start.rem_euclid(delta.width_secs) != 0 {
                self.out.rejected.push(DecodeError::BucketWidthMismatch);
                continue;
            }
            let start = delta.start.div_euclid(width) * width;
            // A new series counts against its gateway's share first, then against all.
            let used = gateway.and_then(|g| self.gateway_series.get(g)).copied();
            let new = !self.series.contains(&delta.series);
            if new && used.unwrap_or(0) >= self.gateway_limits.max_series {
                self.out.rejected.push(DecodeError::GatewayLimit);
                continue;
            }
            // Into this store's sketch settings: a gateway's own (or a forged `max_bins`)
            // must not decide how large a central's documents grow.
            if delta.summary.sketch.params() != self.sketch {
                let mut sketch = Sketch::new(self.sketch);
                sketch.merge(&delta.summary.sketch);
                delta.summary.sketch = sketch;
            }
            match self.series.intern(&delta.series) {
                Ok(series) => {
                    if let (true, Some(g)) = (new, gateway) {
                        *self.gateway_series.entry(g.to_owned()).or_insert(0) += 1;
                    }
                    self.out.summaries.push((series, start, delta.summary));
                }
                Err(e) => self.out.rejected.push(e),
            }
        }
        self.out.rejected.append(&mut self.decoded.rejected);
    }

    /// Whether what [`Admitter::collect`] took counts anything.
    fn counts(&self) -> bool {
        !self.out.readings.is_empty() || !self.out.summaries.is_empty()
    }

    /// A new message that counts leaves its fingerprint (in the window, in its session's
    /// sequence, and with the batch) or its gateway position.
    fn record(&mut self, m: &Message, ident: Option<Ident>, receive_time: bool) -> &mut Admitted {
        let counted = self.counts();
        if let Some(id) = ident.filter(|_| counted) {
            let fp = id.keyed;
            // A receive-time fingerprint seen again: its packet id was given again.
            let seen = receive_time && self.dedup.holds(id);
            self.dedup.insert(fp);
            let tag = if m.qos > 0 {
                self.out.replay = self.resends.counted(m.session, fp, m.pkid, m.arrival, seen);
                Some(dedup::PacketId {
                    session: m.session,
                    pkid: m.pkid,
                })
            } else {
                // A QoS 0 device message: recognised by content, never resent.
                debug_assert!(!receive_time);
                None
            };
            self.out.fingerprint = Some((fp, tag));
        }
        // A delta message's position is recorded whether or not any of its buckets counted
        // (each may have been refused alone): positions then step one by one, as the gateway
        // numbers them, and a jump means a forgery. A gateway's first position needs a bucket
        // that counted: the positions stay bounded by the series (`limits.max_series`), not by
        // the gateway ids a publisher can invent.
        let known = |ledger: &Option<Box<dyn DeltaLedger>>, gateway: &str| {
            ledger.as_ref().is_some_and(|l| l.knows(gateway))
        };
        if let Some((gateway, at)) = self
            .decoded
            .delta_from
            .take()
            .filter(|(gateway, _)| counted || known(&self.ledger, gateway))
        {
            if let Some(ledger) = self.ledger.as_mut() {
                let mut store = ledger.insert(&gateway, at.clone());
                store.retain(|(key, _)| *key != gateway);
                self.out.retired = store;
            }
            self.out.applied = Some((gateway, at));
        }
        &mut self.out
    }

    /// The sessions' sequences of counted messages ([`crate::resend`]): bursts told apart,
    /// acks confirmed, batches taken.
    pub fn resends(&mut self) -> &mut Resends {
        &mut self.resends
    }

    pub fn series_count(&self) -> usize {
        self.series.len()
    }

    /// Forgets a series the store deleted (retention took its last bucket): its place in
    /// `limits.max_series` (and its sensor's or gateway's share) is free again. The caller keeps
    /// one the open batch holds: that batch's commit stores it anew.
    pub fn forget_series(&mut self, series: &str) {
        if !self.series.forget(series) {
            return;
        }
        if let Some((gateway, _)) = series.split_once(':')
            && let Some(n) = self.gateway_series.get_mut(gateway)
        {
            *n -= 1;
            if *n == 0 {
                self.gateway_series.remove(gateway);
            }
        }
    }
}

/// The first subscription whose filter matches `topic`.
fn subscription<'s>(
    subscriptions: &'s [Subscription],
    topic: &[u8],
) -> Result<&'s Subscription, DecodeError> {
    let topic = std::str::from_utf8(topic).map_err(|_| DecodeError::InvalidUtf8)?;
    subscriptions
        .iter()
        .find(|s| decode::topic_matches(&s.filter, topic))
        .ok_or(DecodeError::TopicMismatch)
}

#[cfg(test)]
mod tests;
