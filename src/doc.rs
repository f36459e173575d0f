//! The stored documents: [`BucketDoc`] (one bucket's summary), [`PageDoc`] (a page of raw
//! readings) and [`PointDoc`], with their schema versions and BSON encoding. Pure values: no
//! redb, no I/O; the store ([`crate::store`]) keeps them, the delta wire format
//! ([`crate::delta`]) and the exports ([`crate::export`]) carry them.

use serde::{Deserialize, Serialize};

use crate::sketch::Sketch;
use crate::summary::{Point, Summary};

/// Version of the bucket document, in every document's `schema_version`. Version 1 had no
/// `sketch`; such documents read with an empty sketch, and their quantiles are unknown.
/// Version 2 had no `inc` (a counter's increase); such documents read with it
/// unknown. A release before version 3 reads a version 3 document, ignoring `inc`.
pub const SCHEMA_VERSION: i32 = 3;

/// The stored page document (schema version 1): a [`crate::page::EncodedPage`] plus its time
/// range, so that a reader can skip pages without decoding them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PageDoc {
    pub schema_version: i32,
    pub count: i32,
    pub min_ts: i64,
    pub max_ts: i64,
    /// Nanoseconds per stored timestamp unit.
    pub unit: i64,
    /// Decimal digits of the value encoding, or -1 for XOR-encoded values.
    pub decimals: i32,
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
    /// Where the encoder stopped ([`crate::page::Tail`]), so appends need no decoding.
    pub tail_ts: i64,
    pub tail_delta: i64,
    pub tail_value: i64,
    pub tail_lead: i32,
    pub tail_trail: i32,
    pub tail_bits: i32,
}

/// Version of the page document.
pub const PAGE_SCHEMA_VERSION: i32 = 1;

impl PageDoc {
    pub fn of(readings: &[(i64, f64)]) -> PageDoc {
        PageDoc::from_encoded(crate::page::encode(readings))
    }

    /// This page with `readings` appended; `None` if the page is damaged.
    pub fn append(&self, readings: &[(i64, f64)]) -> Option<PageDoc> {
        crate::page::append(&self.encoded()?, readings).map(PageDoc::from_encoded)
    }

    /// The readings in arrival order; `None` if the document is damaged.
    pub fn readings(&self) -> Option<Vec<(i64, f64)>> {
        crate::page::decode(&self.encoded()?)
    }

    fn from_encoded(p: crate::page::EncodedPage) -> PageDoc {
        let small = |v: u32| i32::try_from(v).expect("tail fields are below 64");
        PageDoc {
            schema_version: PAGE_SCHEMA_VERSION,
            count: i32::try_from(p.count).expect("page_capacity is validated below 2^31"),
            min_ts: p.min_ts,
            max_ts: p.max_ts,
            unit: p.unit,
            decimals: p.decimals,
            data: p.data,
            tail_ts: p.tail.ts,
            tail_delta: p.tail.delta,
            tail_value: p.tail.value as i64, // BSON has no u64: the bits, reinterpreted
            tail_lead: small(p.tail.lead),
            tail_trail: small(p.tail.trail),
            tail_bits: small(p.tail.bits),
        }
    }

    fn encoded(&self) -> Option<crate::page::EncodedPage> {
        let small = |v: i32| u32::try_from(v).ok().filter(|v| *v <= 64);
        Some(crate::page::EncodedPage {
            count: u32::try_from(self.count).ok()?,
            min_ts: self.min_ts,
            max_ts: self.max_ts,
            unit: self.unit,
            decimals: self.decimals,
            data: self.data.clone(),
            tail: crate::page::Tail {
                ts: self.tail_ts,
                delta: self.tail_delta,
                value: self.tail_value as u64,
                lead: small(self.tail_lead)?,
                trail: small(self.tail_trail)?,
                bits: small(self.tail_bits).filter(|b| *b < 8)?,
            },
        })
    }

    pub fn from_bytes(bytes: &[u8]) -> Option<PageDoc> {
        bson::deserialize_from_slice(bytes).ok()
    }

    /// The readings a stored page holds, read without decoding the page.
    pub fn count_in(bytes: &[u8]) -> Option<i32> {
        bson::RawDocument::from_bytes(bytes)
            .ok()?
            .get_i32("count")
            .ok()
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        bson::serialize_to_vec(self).expect("a PageDoc has only BSON-representable fields")
    }
}

/// `first` / `last` in a stored document.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PointDoc {
    /// Nanoseconds since the Unix epoch.
    pub ts: i64,
    pub value: f64,
}

/// The stored bucket document (schema version 1). Field names follow the MongoDB bucket pattern
/// so exported documents load into a collection as they are.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BucketDoc {
    pub schema_version: i32,
    pub series: String,
    pub sensor: String,
    pub metric: String,
    /// Bucket start and end, seconds since the Unix epoch; `end` is exclusive.
    pub start: i64,
    pub end: i64,
    pub count: i64,
    /// Compensated sum: the sum is `sum + sum_comp`.
    pub sum: f64,
    pub sum_comp: f64,
    pub min: f64,
    pub max: f64,
    pub first: PointDoc,
    pub last: PointDoc,
    pub mean: f64,
    pub m2: f64,
    /// Raw reading pages of this bucket (none until raw storage exists).
    pub pages: i32,
    /// The quantile sketch ([`Sketch::encode`]), as BSON binary. Absent in version 1.
    #[serde(default, with = "serde_bytes")]
    pub sketch: Vec<u8>,
    /// The readings' increase as a counter's ([`Summary::inc`]); absent where unknown (and in
    /// versions 1 and 2).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inc: Option<f64>,
}

impl BucketDoc {
    pub fn new(series: &str, start: i64, width_secs: i64, s: &Summary) -> BucketDoc {
        let (sensor, metric) = crate::reading::split_series(series);
        BucketDoc {
            schema_version: SCHEMA_VERSION,
            series: series.to_owned(),
            sensor: sensor.to_owned(),
            metric: metric.to_owned(),
            start,
            end: start.saturating_add(width_secs),
            // A count merged past 2^63 (deltas can carry anything) is stored saturated.
            count: i64::try_from(s.count).unwrap_or(i64::MAX),
            sum: s.sum,
            sum_comp: s.sum_comp,
            min: s.min,
            max: s.max,
            first: PointDoc {
                ts: s.first.ts,
                value: s.first.value,
            },
            last: PointDoc {
                ts: s.last.ts,
                value: s.last.value,
            },
            mean: s.mean,
            m2: s.m2,
            pages: 0,
            sketch: s.sketch.encode(),
            inc: s.inc,
        }
    }

    /// The aggregates. A missing (version 1) or unreadable sketch reads as empty, so that the
    /// bucket's quantiles are unknown rather than wrong.
    pub fn summary(&self) -> Summary {
        let sketch = Sketch::decode(&self.sketch)
            .unwrap_or_else(|| Sketch::new(crate::sketch::SketchParams::DEFAULT));
        self.summary_with(sketch)
    }

    /// The aggregates, with `sketch` (decoded from this document by the caller).
    pub fn summary_with(&self, sketch: Sketch) -> Summary {
        Summary {
            count: u64::try_from(self.count).unwrap_or(0),
            sum: self.sum,
            sum_comp: self.sum_comp,
            min: self.min,
            max: self.max,
            first: Point {
                ts: self.first.ts,
                value: self.first.value,
            },
            last: Point {
                ts: self.last.ts,
                value: self.last.value,
            },
            mean: self.mean,
            m2: self.m2,
            sketch,
            inc: self.inc.filter(|i| i.is_finite()),
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        bson::serialize_to_vec(self).expect("a BucketDoc has only BSON-representable fields")
    }

    pub fn decode(bytes: &[u8]) -> Result<BucketDoc, bson::error::Error> {
        bson::deserialize_from_slice(bytes)
    }
}

impl BucketDoc {
    /// This document with its aggregates replaced by `s` (names, start, pages kept).
    #[must_use]
    pub fn with_summary(self, s: &Summary) -> BucketDoc {
        BucketDoc {
            pages: self.pages,
            ..BucketDoc::new(
                &self.series,
                self.start,
                self.end.saturating_sub(self.start),
                s,
            )
        }
    }
}
