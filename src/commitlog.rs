//! The commit log's record: one commit's per-bucket deltas, and the raw readings kept with them,
//! in a compact binary form. The store's `log` table holds one record per commit, under the
//! commit's sequence number, until a checkpoint folds it into the bucket documents. Pure.
//!
//! Record (version 3; versions 1 and 2 are read too): a version byte (3); the sketch settings
//! of its reading-form entries (`alpha` as f64 little-endian, varint `max_bins`); the record's
//! reading codes: a time unit byte (0: ns, 1: us, 2: ms, 3: s; the largest dividing every
//! reading's time since the base time below) and a decimals byte (`k` in 0..=6 when every
//! reading's value is exactly `n / 10^k` for an integer `n`, as pages code them; 255: none, the
//! values as f64); the record's base time (zigzag varint, in ns: its earliest reading's, or
//! 0); a varint entry count; then the entries in (series id, start) order. Entry: varint of
//! its series id minus the previous entry's (the first: minus 0); zigzag varint of its start
//! minus the previous entry's (the first: minus 0); a kind byte; then by kind:
//! - 0, readings: a varint body length and the body: the bucket's readings in arrival order,
//!   kept raw: varint count, then per reading its time and value (below), the time as the
//!   difference from the previous reading's (the first: from the record's base time). The delta is
//!   their summary, folded in arrival order with the record's sketch settings: exactly the
//!   summary the batcher built from them, so no summary is stored for it.
//! - 1, summary: a varint body length and the delta's summary, no raw readings (gateways'
//!   deltas at a central, buckets of several readings not kept raw).
//! - 2, summary and readings: a varint body length, the summary, then readings as in kind 0
//!   (a bucket whose raw readings are not all of its delta).
//! - 3, one reading kept raw, and 4, one reading not kept raw (no body length): its time (from
//!   the record's base time) and value; the delta is that reading's summary. The common entry
//!   of a gateway whose sensors report once a second or slower: ~7 bytes with a decimal value
//!   and a millisecond time, against ~20 (kind 0) or ~85 (kind 1) in version 1.
//!
//! A reading's time: zigzag varint, in the record's unit. Its value: zigzag varint of `n` with
//! decimals, else f64 little-endian.
//!
//! Version 1 (read still: the `log` table or a journal of an older release may hold it): no
//! unit, decimals or base; times in nanoseconds, a bucket's first from its start; values as
//! f64; series ids whole; kinds 0 to 2 only.
//!
//! Summary: varint count; `sum`, `sum_comp`, `min`, `max`, `mean`, `m2`, `first.value`,
//! `last.value` as f64 little-endian; zigzag varints of `first.ts` and `last.ts` minus the
//! bucket start in ns; varint sketch length; the sketch ([`Sketch::encode`]); from version 3,
//! the counter increase ([`Summary::inc`]): a byte 0 (unknown) or 1 and the f64. Version 2 is
//! version 3 without it (its summaries read with the increase unknown): a release before
//! version 3 cannot read a version 3 record (docs/STORAGE.md: stop cleanly before a downgrade).
//!
//! Every difference is taken with wrapping arithmetic, so any i64 round-trips.

use crate::sketch::{Sketch, SketchParams, get_varint, put_varint, unzigzag, zigzag};
use crate::summary::{Point, Summary};

/// Record format versions, the first byte of every record: 3 is written, all are read.
pub const RECORD_V1: u8 = 1;
pub const RECORD_V2: u8 = 2;
pub const RECORD_V3: u8 = 3;

const KIND_READINGS: u8 = 0;
const KIND_SUMMARY: u8 = 1;
const KIND_SUMMARY_RAW: u8 = 2;
const KIND_ONE_RAW: u8 = 3;
const KIND_ONE: u8 = 4;

/// No decimal code: values as f64.
const NO_DECIMALS: u8 = 255;

/// How a record codes its readings' times and values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Codes {
    /// Nanoseconds per stored time unit.
    unit: i64,
    /// `k` of the decimal code, or `None`: f64.
    decimals: Option<i32>,
    /// The base of a bucket's first reading time: the record's, in ns (version 2), or `None`:
    /// the bucket's start (version 1).
    base: Option<i64>,
    /// Series ids are stored as differences from the previous entry's (version 2).
    id_deltas: bool,
    /// Summaries end with the counter increase (version 3).
    inc: bool,
}

impl Codes {
    /// Version 1's: nanoseconds, f64, times from the bucket start, whole ids.
    const V1: Codes = Codes {
        unit: 1,
        decimals: None,
        base: None,
        id_deltas: false,
        inc: false,
    };

    /// Where a bucket's first reading time is counted from.
    fn first_base(self, start: i64) -> i64 {
        self.base.unwrap_or_else(|| base_ns(start))
    }

    fn put_ts(self, out: &mut Vec<u8>, delta_ns: i64) {
        put_varint(out, zigzag(delta_ns / self.unit));
    }

    fn get_ts(self, r: &mut &[u8]) -> Option<i64> {
        Some(unzigzag(get_varint(r)?).wrapping_mul(self.unit))
    }

    fn put_value(self, out: &mut Vec<u8>, v: f64) {
        match self.decimals {
            Some(k) => {
                let n = (v * 10f64.powi(k)).round() as i64;
                put_varint(out, zigzag(n));
            }
            None => put_f64(out, v),
        }
    }

    fn get_value(self, r: &mut &[u8]) -> Option<f64> {
        match self.decimals {
            Some(k) => Some(unzigzag(get_varint(r)?) as f64 / 10f64.powi(k)),
            None => get_f64(r),
        }
    }
}

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
    let kinds: Vec<u8> = entries.iter().map(|e| kind_of(e, params)).collect();
    let codes = codes_for(entries, &kinds);
    out.push(RECORD_V3);
    out.extend_from_slice(&params.alpha.to_le_bytes());
    put_varint(out, u64::from(params.max_bins));
    let unit_code = crate::page::UNITS
        .iter()
        .rev()
        .position(|u| *u == codes.unit)
        .expect("a unit of the list");
    out.push(u8::try_from(unit_code).expect("four units"));
    out.push(codes.decimals.map_or(NO_DECIMALS, |k| {
        u8::try_from(k).expect("at most 6 decimals")
    }));
    let base = codes.base.expect("version 2 has a base");
    put_varint(out, zigzag(base));
    put_varint(out, entries.len() as u64);
    let (mut prev_id, mut prev_start) = (0u64, 0i64);
    let mut body = Vec::new();
    for (e, &kind) in entries.iter().zip(&kinds) {
        put_varint(out, e.series_id.wrapping_sub(prev_id));
        put_varint(out, zigzag(e.start.wrapping_sub(prev_start)));
        (prev_id, prev_start) = (e.series_id, e.start);
        out.push(kind);
        match kind {
            KIND_ONE | KIND_ONE_RAW => {
                let first = e.summary.first;
                codes.put_ts(out, first.ts.wrapping_sub(base));
                codes.put_value(out, first.value);
                continue;
            }
            KIND_READINGS => {
                body.clear();
                put_readings(&mut body, e.start, e.raw.unwrap_or_default(), codes);
            }
            KIND_SUMMARY_RAW => {
                body.clear();
                put_summary(&mut body, e.start, e.summary, codes);
                put_readings(&mut body, e.start, e.raw.unwrap_or_default(), codes);
            }
            _ => {
                body.clear();
                put_summary(&mut body, e.start, e.summary, codes);
            }
        }
        put_varint(out, body.len() as u64);
        out.extend_from_slice(&body);
    }
}

/// How an entry is stored: its readings alone when they give its summary exactly, else its
/// summary (with any raw readings).
fn kind_of(e: &EntryIn<'_>, params: SketchParams) -> u8 {
    let own_sketch = e.summary.sketch.params() == params;
    match e.raw {
        Some(raw) if raw.len() as u64 == e.summary.count && own_sketch => {
            if raw.len() == 1 {
                KIND_ONE_RAW
            } else {
                KIND_READINGS
            }
        }
        Some(_) => KIND_SUMMARY_RAW,
        None if own_sketch && e.summary.count == 1 => {
            // One reading not kept raw: its summary is that reading's, bit for bit, or it is
            // stored as a summary.
            let first = e.summary.first;
            if Summary::with_params(first.ts, first.value, params) == *e.summary {
                KIND_ONE
            } else {
                KIND_SUMMARY
            }
        }
        None => KIND_SUMMARY,
    }
}

/// The record's reading codes: its base time (the earliest reading's), the largest time unit
/// that divides every reading's time since it, and the fewest decimals that give every value
/// back exactly.
fn codes_for(entries: &[EntryIn<'_>], kinds: &[u8]) -> Codes {
    let mut readings: Vec<(i64, f64)> = Vec::new();
    for (e, &kind) in entries.iter().zip(kinds) {
        match kind {
            KIND_ONE | KIND_ONE_RAW => readings.push((e.summary.first.ts, e.summary.first.value)),
            KIND_READINGS | KIND_SUMMARY_RAW => {
                readings.extend_from_slice(e.raw.unwrap_or_default());
            }
            _ => {}
        }
    }
    let base = readings.iter().map(|r| r.0).min().unwrap_or(0);
    let unit = crate::page::UNITS
        .into_iter()
        .find(|u| {
            readings
                .iter()
                .all(|(ts, _)| ts.wrapping_sub(base) % u == 0)
        })
        .expect("1 divides everything");
    Codes {
        unit,
        decimals: crate::page::decimal_scale(&readings),
        base: Some(base),
        id_deltas: true,
        inc: true,
    }
}

fn put_f64(out: &mut Vec<u8>, v: f64) {
    out.extend_from_slice(&v.to_le_bytes());
}

fn put_readings(out: &mut Vec<u8>, start: i64, raw: &[(i64, f64)], codes: Codes) {
    put_varint(out, raw.len() as u64);
    let mut prev = codes.first_base(start);
    for &(ts, v) in raw {
        codes.put_ts(out, ts.wrapping_sub(prev));
        codes.put_value(out, v);
        prev = ts;
    }
}

fn put_summary(out: &mut Vec<u8>, start: i64, s: &Summary, codes: Codes) {
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
    if codes.inc {
        match s.inc {
            Some(inc) => {
                out.push(1);
                put_f64(out, inc);
            }
            None => out.push(0),
        }
    }
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
    codes: Codes,
    /// Version 2's single-reading kinds may appear.
    v2: bool,
    count: u64,
    entries: &'a [u8],
}

impl<'a> Record<'a> {
    pub fn parse(bytes: &'a [u8]) -> Result<Record<'a>, Corrupt> {
        let (&version, mut r) = bytes.split_first().ok_or(Corrupt)?;
        if !(RECORD_V1..=RECORD_V3).contains(&version) {
            return Err(Corrupt);
        }
        let alpha = get_f64(&mut r).ok_or(Corrupt)?;
        let max_bins = get_varint(&mut r)
            .and_then(|b| u32::try_from(b).ok())
            .ok_or(Corrupt)?;
        if !(alpha > 0.0 && alpha < 1.0 && max_bins >= 2) {
            return Err(Corrupt);
        }
        let codes = if version == RECORD_V1 {
            Codes::V1
        } else {
            let (&unit, rest) = r.split_first().ok_or(Corrupt)?;
            let (&decimals, rest) = rest.split_first().ok_or(Corrupt)?;
            r = rest;
            let unit = *crate::page::UNITS
                .iter()
                .rev()
                .nth(usize::from(unit))
                .ok_or(Corrupt)?;
            let decimals = match decimals {
                NO_DECIMALS => None,
                k @ 0..=6 => Some(i32::from(k)),
                _ => return Err(Corrupt),
            };
            let base = unzigzag(get_varint(&mut r).ok_or(Corrupt)?);
            Codes {
                unit,
                decimals,
                base: Some(base),
                id_deltas: true,
                inc: version >= RECORD_V3,
            }
        };
        let count = get_varint(&mut r).ok_or(Corrupt)?;
        Ok(Record {
            params: SketchParams { alpha, max_bins },
            codes,
            v2: version >= RECORD_V2,
            count,
            entries: r,
        })
    }

    /// The entries, in (series id, start) order. An unreadable entry ends the iteration with
    /// `Err`.
    pub fn entries(&self) -> Entries<'a> {
        Entries {
            params: self.params,
            codes: self.codes,
            v2: self.v2,
            left: self.count,
            rest: self.entries,
            prev_id: 0,
            prev_start: 0,
            failed: false,
        }
    }
}

/// The entries of a [`Record`].
#[derive(Debug, Clone)]
pub struct Entries<'a> {
    params: SketchParams,
    codes: Codes,
    v2: bool,
    left: u64,
    rest: &'a [u8],
    prev_id: u64,
    prev_start: i64,
    failed: bool,
}

impl<'a> Entries<'a> {
    fn next_entry(&mut self) -> Option<Entry<'a>> {
        #[cfg(test)]
        decoded_for_tests::add();
        let r = &mut self.rest;
        let mut series_id = get_varint(r)?;
        if self.codes.id_deltas {
            series_id = self.prev_id.wrapping_add(series_id);
        }
        let start = self.prev_start.wrapping_add(unzigzag(get_varint(r)?));
        let (&kind, rest) = r.split_first()?;
        *r = rest;
        let body = match kind {
            KIND_ONE | KIND_ONE_RAW if self.v2 => {
                // Its time and value: read here to find where the next entry starts.
                let before = *r;
                self.codes.get_ts(r)?;
                self.codes.get_value(r)?;
                &before[..before.len() - r.len()]
            }
            KIND_READINGS | KIND_SUMMARY | KIND_SUMMARY_RAW => {
                let len = usize::try_from(get_varint(r)?).ok()?;
                if len > r.len() {
                    return None;
                }
                let (body, rest) = r.split_at(len);
                *r = rest;
                body
            }
            _ => return None,
        };
        self.prev_id = series_id;
        self.prev_start = start;
        Some(Entry {
            series_id,
            start,
            kind,
            body,
            params: self.params,
            codes: self.codes,
        })
    }
}

impl Entries<'_> {
    /// Passes over the entries of series below `id`, reading of each only what finding the
    /// next needs (a [`Record::entries_of`] lookup passes over up to a seek interval of them).
    fn skip_below(&mut self, id: u64) -> Result<(), Corrupt> {
        while self.left > 0 && !self.failed {
            let mut rest = self.rest;
            let r = &mut rest;
            let mut series_id = get_varint(r).ok_or(Corrupt)?;
            if self.codes.id_deltas {
                series_id = self.prev_id.wrapping_add(series_id);
            }
            if series_id >= id {
                return Ok(());
            }
            #[cfg(test)]
            decoded_for_tests::add();
            let start = self
                .prev_start
                .wrapping_add(unzigzag(get_varint(r).ok_or(Corrupt)?));
            let (&kind, rest) = r.split_first().ok_or(Corrupt)?;
            *r = rest;
            let len = match kind {
                KIND_ONE | KIND_ONE_RAW if self.v2 => {
                    get_varint(r).ok_or(Corrupt)?;
                    if self.codes.decimals.is_some() {
                        get_varint(r).ok_or(Corrupt)?;
                        0
                    } else {
                        8
                    }
                }
                KIND_READINGS | KIND_SUMMARY | KIND_SUMMARY_RAW => {
                    usize::try_from(get_varint(r).ok_or(Corrupt)?).map_err(|_| Corrupt)?
                }
                _ => return Err(Corrupt),
            };
            self.rest = r.get(len..).ok_or(Corrupt)?;
            self.left -= 1;
            self.prev_id = series_id;
            self.prev_start = start;
        }
        Ok(())
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
    codes: Codes,
}

impl Entry<'_> {
    /// Whether the entry carries raw readings.
    pub fn has_raw(&self) -> bool {
        self.kind != KIND_SUMMARY && self.kind != KIND_ONE
    }

    /// How many raw readings the entry carries, when that is known without decoding them:
    /// the readings forms (their count is the delta's).
    pub fn raw_count(&self) -> Option<u64> {
        match self.kind {
            KIND_ONE_RAW => Some(1),
            KIND_SUMMARY | KIND_ONE => Some(0),
            KIND_READINGS => get_varint(&mut &*self.body),
            _ => None,
        }
    }

    /// The single reading of a kind 3 or 4 entry.
    fn one(&self) -> Result<(i64, f64), Corrupt> {
        let mut r = self.body;
        let base = self.codes.first_base(self.start);
        let ts = base.wrapping_add(self.codes.get_ts(&mut r).ok_or(Corrupt)?);
        let v = self.codes.get_value(&mut r).ok_or(Corrupt)?;
        if !v.is_finite() {
            return Err(Corrupt);
        }
        Ok((ts, v))
    }

    /// The delta's summary.
    pub fn summary(&self) -> Result<Summary, Corrupt> {
        let mut r = self.body;
        if self.kind == KIND_ONE || self.kind == KIND_ONE_RAW {
            let (ts, v) = self.one()?;
            return Ok(Summary::with_params(ts, v, self.params));
        }
        if self.kind == KIND_READINGS {
            let mut out: Option<Summary> = None;
            self.visit_readings(&mut r, |ts, v| match &mut out {
                Some(s) => s.push(ts, v),
                None => out = Some(Summary::with_params(ts, v, self.params)),
            })?;
            return out.ok_or(Corrupt);
        }
        get_summary(&mut r, self.start, self.codes).ok_or(Corrupt)
    }

    /// Merges the delta into `s`: `s.merge(&self.summary()?)`, bit for bit, without building a
    /// summary (and its sketch) for a single reading of `s`'s sketch accuracy. Readers and the
    /// checkpoint both merge through here (issue 53: a read merged hundreds of such summaries).
    pub fn merge_into(&self, s: &mut Summary) -> Result<(), Corrupt> {
        if (self.kind == KIND_ONE || self.kind == KIND_ONE_RAW)
            && s.sketch.params().alpha == self.params.alpha
        {
            let (ts, v) = self.one()?;
            s.push(ts, v);
        } else {
            s.merge(&self.summary()?);
        }
        Ok(())
    }

    /// The delta merged onto `base` (a stored summary), or the delta alone.
    pub fn onto(&self, base: Option<Summary>) -> Result<Summary, Corrupt> {
        match base {
            Some(mut s) => {
                self.merge_into(&mut s)?;
                Ok(s)
            }
            None => self.summary(),
        }
    }

    /// Appends the entry's raw readings (none for a summary-only entry) to `out`.
    pub fn raw_into(&self, out: &mut Vec<(i64, f64)>) -> Result<(), Corrupt> {
        let mut r = self.body;
        match self.kind {
            KIND_SUMMARY | KIND_ONE => return Ok(()),
            KIND_ONE_RAW => {
                out.push(self.one()?);
                return Ok(());
            }
            KIND_SUMMARY_RAW => {
                get_summary(&mut r, self.start, self.codes).ok_or(Corrupt)?;
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
        // Each reading takes at least 2 bytes (9 with f64 values): a count above that is
        // damage, not a reason to loop (or allocate) for long.
        let least = if self.codes.decimals.is_some() { 2 } else { 9 };
        if n == 0 || n > (r.len() / least) as u64 {
            return Err(Corrupt);
        }
        let mut prev = self.codes.first_base(self.start);
        for _ in 0..n {
            let ts = prev.wrapping_add(self.codes.get_ts(r).ok_or(Corrupt)?);
            let v = self.codes.get_value(r).ok_or(Corrupt)?;
            if !v.is_finite() {
                return Err(Corrupt);
            }
            visit(ts, v);
            prev = ts;
        }
        Ok(())
    }
}

fn get_summary(r: &mut &[u8], start: i64, codes: Codes) -> Option<Summary> {
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
    let inc = if codes.inc {
        let (&known, rest) = r.split_first()?;
        *r = rest;
        match known {
            0 => None,
            1 => Some(get_f64(r)?).filter(|i| i.is_finite()),
            _ => return None,
        }
    } else {
        None
    };
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
        inc,
    })
}

mod index;
pub use index::{RecordIndex, SEEK_EVERY, SeriesEntries};

/// Test seam: the entries decoded on this thread, to tell what a read touches.
#[cfg(test)]
pub(crate) mod decoded_for_tests {
    use std::cell::Cell;

    thread_local! {
        static COUNT: Cell<u64> = const { Cell::new(0) };
    }

    pub(super) fn add() {
        COUNT.with(|c| c.set(c.get() + 1));
    }

    /// The entries decoded since the last call.
    pub(crate) fn take() -> u64 {
        COUNT.with(|c| c.replace(0))
    }
}

#[cfg(test)]
mod tests;
