//! The commit log's record: one commit's per-bucket deltas, and the raw readings kept with them,
//! in a compact binary form. The store's `log` table holds one record per commit, under the
//! commit's sequence number, until a checkpoint folds it into the bucket documents. Pure.
//!
//! Record: a version byte (1); the sketch settings of its readings-form entries (`alpha` as f64
//! little-endian, varint `max_bins`); a varint entry count; then the entries in (series id,
//! start) order. Entry: varint series id; zigzag varint of its start minus the previous entry's
//! (the first: minus 0); a kind byte; a varint body length; the body:
//! - kind 0, readings: the bucket's readings in arrival order, kept raw: varint count, then per
//!   reading the zigzag varint of its timestamp minus the previous one's (the first: minus the
//!   bucket start in ns) and the value as f64 little-endian. The delta is their summary, folded
//!   in arrival order with the record's sketch settings: exactly the summary the batcher built
//!   from them, so a reading costs ~10-16 bytes and no summary is stored for it.
//! - kind 1, summary: the delta's summary, no raw readings (subscriptions without `store_raw`,
//!   gateways' deltas at a central).
//! - kind 2, summary and readings: the summary, then readings as in kind 0 (a bucket whose raw
//!   readings are not all of its delta).
//!
//! Summary: varint count; `sum`, `sum_comp`, `min`, `max`, `mean`, `m2`, `first.value`,
//! `last.value` as f64 little-endian; zigzag varints of `first.ts` and `last.ts` minus the
//! bucket start in ns; varint sketch length; the sketch ([`Sketch::encode`]).
//!
//! Every difference is taken with wrapping arithmetic, so any i64 round-trips.

use crate::sketch::{Sketch, SketchParams, get_varint, put_varint, unzigzag, zigzag};
use crate::summary::{Point, Summary};

/// Record format version, the first byte of every record.
pub const RECORD_V1: u8 = 1;

const KIND_READINGS: u8 = 0;
const KIND_SUMMARY: u8 = 1;
const KIND_SUMMARY_RAW: u8 = 2;

/// One bucket's delta, for [`encode`].
#[derive(Debug, Clone, Copy)]
pub struct EntryIn<'a> {
    pub series_id: u64,
    pub start: i64,
    pub summary: &'a Summary,
    /// The raw readings kept for the bucket, in arrival order.
    pub raw: Option<&'a [(i64, f64)]>,
}

/// A stored record that cannot be read: the file is damaged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("commit log record is unreadable")]
pub struct Corrupt;

/// The nanosecond timestamp of a bucket start (wrapping: only used as a base for differences).
fn base_ns(start: i64) -> i64 {
    start.wrapping_mul(1_000_000_000)
}

/// Encodes `entries` (sorted by series id, then start) into `out` as one record. `params` are the
/// sketch settings the batcher used; an entry whose summary has others is stored as a summary.
pub fn encode(entries: &[EntryIn<'_>], params: SketchParams, out: &mut Vec<u8>) {
    out.push(RECORD_V1);
    out.extend_from_slice(&params.alpha.to_le_bytes());
    put_varint(out, u64::from(params.max_bins));
    put_varint(out, entries.len() as u64);
    let mut prev_start = 0i64;
    let mut body = Vec::new();
    for e in entries {
        put_varint(out, e.series_id);
        put_varint(out, zigzag(e.start.wrapping_sub(prev_start)));
        prev_start = e.start;
        body.clear();
        let kind = match e.raw {
            Some(raw)
                if raw.len() as u64 == e.summary.count && e.summary.sketch.params() == params =>
            {
                put_readings(&mut body, e.start, raw);
                KIND_READINGS
            }
            Some(raw) => {
                put_summary(&mut body, e.start, e.summary);
                put_readings(&mut body, e.start, raw);
                KIND_SUMMARY_RAW
            }
            None => {
                put_summary(&mut body, e.start, e.summary);
                KIND_SUMMARY
            }
        };
        out.push(kind);
        put_varint(out, body.len() as u64);
        out.extend_from_slice(&body);
    }
}

fn put_f64(out: &mut Vec<u8>, v: f64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_readings(out: &mut Vec<u8>, start: i64, raw: &[(i64, f64)]) {
    put_varint(out, raw.len() as u64);
    let mut prev = base_ns(start);
    for &(ts, v) in raw {
        put_varint(out, zigzag(ts.wrapping_sub(prev)));
        put_f64(out, v);
        prev = ts;
    }
}

fn put_summary(out: &mut Vec<u8>, start: i64, s: &Summary) {
    put_varint(out, s.count);
    for v in [
        s.sum,
        s.sum_comp,
        s.min,
        s.max,
        s.mean,
        s.m2,
        s.first.value,
        s.last.value,
    ] {
        put_f64(out, v);
    }
    put_varint(out, zigzag(s.first.ts.wrapping_sub(base_ns(start))));
    put_varint(out, zigzag(s.last.ts.wrapping_sub(base_ns(start))));
    let sketch = s.sketch.encode();
    put_varint(out, sketch.len() as u64);
    out.extend_from_slice(&sketch);
}

fn get_f64(r: &mut &[u8]) -> Option<f64> {
    let (head, rest) = r.split_first_chunk::<8>()?;
    *r = rest;
    Some(f64::from_le_bytes(*head))
}

/// A parsed record: its entries are read lazily, each on its own.
#[derive(Debug, Clone, Copy)]
pub struct Record<'a> {
    params: SketchParams,
    count: u64,
    entries: &'a [u8],
}

impl<'a> Record<'a> {
    pub fn parse(bytes: &'a [u8]) -> Result<Record<'a>, Corrupt> {
        let (&version, mut r) = bytes.split_first().ok_or(Corrupt)?;
        if version != RECORD_V1 {
            return Err(Corrupt);
        }
        let alpha = get_f64(&mut r).ok_or(Corrupt)?;
        let max_bins = get_varint(&mut r)
            .and_then(|b| u32::try_from(b).ok())
            .ok_or(Corrupt)?;
        if !(alpha > 0.0 && alpha < 1.0 && max_bins >= 2) {
            return Err(Corrupt);
        }
        let count = get_varint(&mut r).ok_or(Corrupt)?;
        Ok(Record {
            params: SketchParams { alpha, max_bins },
            count,
            entries: r,
        })
    }

    /// The entries, in (series id, start) order. An unreadable entry ends the iteration with
    /// `Err`.
    pub fn entries(&self) -> Entries<'a> {
        Entries {
            params: self.params,
            left: self.count,
            rest: self.entries,
            prev_start: 0,
            failed: false,
        }
    }
}

/// The entries of a [`Record`].
#[derive(Debug, Clone)]
pub struct Entries<'a> {
    params: SketchParams,
    left: u64,
    rest: &'a [u8],
    prev_start: i64,
    failed: bool,
}

impl<'a> Entries<'a> {
    fn next_entry(&mut self) -> Option<Entry<'a>> {
        let r = &mut self.rest;
        let series_id = get_varint(r)?;
        let start = self.prev_start.wrapping_add(unzigzag(get_varint(r)?));
        let (&kind, rest) = r.split_first()?;
        *r = rest;
        let len = usize::try_from(get_varint(r)?).ok()?;
        if len > r.len() || kind > KIND_SUMMARY_RAW {
            return None;
        }
        let (body, rest) = r.split_at(len);
        *r = rest;
        self.prev_start = start;
        Some(Entry {
            series_id,
            start,
            kind,
            body,
            params: self.params,
        })
    }
}

impl<'a> Iterator for Entries<'a> {
    type Item = Result<Entry<'a>, Corrupt>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed {
            return None;
        }
        if self.left == 0 {
            if self.rest.is_empty() {
                return None;
            }
            self.failed = true;
            return Some(Err(Corrupt));
        }
        self.left -= 1;
        let entry = self.next_entry();
        self.failed = entry.is_none();
        Some(entry.ok_or(Corrupt))
    }
}

/// One bucket's delta in a record; its body is decoded on demand.
#[derive(Debug, Clone, Copy)]
pub struct Entry<'a> {
    pub series_id: u64,
    pub start: i64,
    kind: u8,
    body: &'a [u8],
    params: SketchParams,
}

impl Entry<'_> {
    /// Whether the entry carries raw readings.
    pub fn has_raw(&self) -> bool {
        self.kind != KIND_SUMMARY
    }

    /// The delta's summary.
    pub fn summary(&self) -> Result<Summary, Corrupt> {
        let mut r = self.body;
        if self.kind == KIND_READINGS {
            let mut out: Option<Summary> = None;
            self.visit_readings(&mut r, |ts, v| match &mut out {
                Some(s) => s.push(ts, v),
                None => out = Some(Summary::with_params(ts, v, self.params)),
            })?;
            return out.ok_or(Corrupt);
        }
        get_summary(&mut r, self.start).ok_or(Corrupt)
    }

    /// Appends the entry's raw readings (none for a summary-only entry) to `out`.
    pub fn raw_into(&self, out: &mut Vec<(i64, f64)>) -> Result<(), Corrupt> {
        let mut r = self.body;
        match self.kind {
            KIND_SUMMARY => return Ok(()),
            KIND_SUMMARY_RAW => {
                get_summary(&mut r, self.start).ok_or(Corrupt)?;
            }
            _ => {}
        }
        self.visit_readings(&mut r, |ts, v| out.push((ts, v)))
    }

    fn visit_readings(
        &self,
        r: &mut &[u8],
        mut visit: impl FnMut(i64, f64),
    ) -> Result<(), Corrupt> {
        let n = get_varint(r).ok_or(Corrupt)?;
        // Each reading takes at least 9 bytes: a count above that is damage, not a reason to
        // loop (or allocate) for long.
        if n == 0 || n > (r.len() / 9) as u64 {
            return Err(Corrupt);
        }
        let mut prev = base_ns(self.start);
        for _ in 0..n {
            let ts = prev.wrapping_add(unzigzag(get_varint(r).ok_or(Corrupt)?));
            let v = get_f64(r).ok_or(Corrupt)?;
            if !v.is_finite() {
                return Err(Corrupt);
            }
            visit(ts, v);
            prev = ts;
        }
        Ok(())
    }
}

fn get_summary(r: &mut &[u8], start: i64) -> Option<Summary> {
    let count = get_varint(r)?;
    let mut f = [0f64; 8];
    for v in &mut f {
        *v = get_f64(r)?;
    }
    let [sum, sum_comp, min, max, mean, m2, first_value, last_value] = f;
    let first_ts = base_ns(start).wrapping_add(unzigzag(get_varint(r)?));
    let last_ts = base_ns(start).wrapping_add(unzigzag(get_varint(r)?));
    let len = usize::try_from(get_varint(r)?).ok()?;
    if len > r.len() {
        return None;
    }
    let (sketch, rest) = r.split_at(len);
    *r = rest;
    let sketch = Sketch::decode(sketch)?;
    // What `Summary::merge` relies on; anything else is damage. (A sum may be infinite: the
    // sum of finite readings near f64::MAX is.)
    let sane = count > 0 && min <= max && first_value.is_finite() && last_value.is_finite();
    sane.then_some(Summary {
        count,
        sum,
        sum_comp,
        min,
        max,
        first: Point {
            ts: first_ts,
            value: first_value,
        },
        last: Point {
            ts: last_ts,
            value: last_value,
        },
        mean,
        m2,
        sketch,
    })
}

#[cfg(test)]
mod tests;
