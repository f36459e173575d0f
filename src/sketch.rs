//! [`Sketch`]: a mergeable quantile sketch with relative-error guarantees (`DDSketch`, Masson et
//! al., VLDB 2019), the "approximate counter" of every bucket. Pure.
//!
//! A value `x != 0` falls in bin `i = ceil(ln|x| / ln γ)` with `γ = (1 + α) / (1 - α)`; the bin
//! stands for `2γ^i / (γ + 1)`, within a relative `α` of every value in it. Positive and negative
//! values have their own bins; zeros are counted apart. There is no floor: every normal and
//! subnormal f64 gets its own bin (indices stay within ±40,000 for α = 1%), so tiny values keep
//! the promise too.
//!
//! Size bound: at most `max_bins` bins. Past it, the bins closest to zero are collapsed into
//! their neighbour, so quantiles among the smallest magnitudes lose accuracy first; quantiles
//! at the far end (p90, p99 of a positive signal) keep it. The exact min and max of a bucket are
//! kept by [`crate::summary::Summary`], and quantiles are clamped to them.
//!
//! Merging adds bin counts. Sketches with the same `α` merge exactly: the sketch of a union is
//! the merge of the sketches (until a collapse). A sketch with another `α` (the setting changed)
//! is re-binned by value.

use std::collections::BTreeMap;

/// Sketch settings: relative accuracy and the bin bound.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SketchParams {
    pub alpha: f64,
    pub max_bins: u32,
}

impl SketchParams {
    pub const DEFAULT: SketchParams = SketchParams {
        alpha: 0.01,
        max_bins: 2048,
    };
}

#[derive(Debug, Clone, PartialEq)]
pub struct Sketch {
    alpha: f64,
    max_bins: u32,
    ln_gamma: f64,
    positive: BTreeMap<i32, u64>,
    negative: BTreeMap<i32, u64>,
    zeros: u64,
    count: u64,
}

/// Format tag of the encoded sketch.
const ENCODING_V1: u8 = 1;

impl Sketch {
    pub fn new(params: SketchParams) -> Sketch {
        debug_assert!(params.alpha > 0.0 && params.alpha < 1.0 && params.max_bins >= 2);
        let gamma = (1.0 + params.alpha) / (1.0 - params.alpha);
        Sketch {
            alpha: params.alpha,
            max_bins: params.max_bins,
            ln_gamma: gamma.ln(),
            positive: BTreeMap::new(),
            negative: BTreeMap::new(),
            zeros: 0,
            count: 0,
        }
    }

    pub fn params(&self) -> SketchParams {
        SketchParams {
            alpha: self.alpha,
            max_bins: self.max_bins,
        }
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    pub fn bins(&self) -> usize {
        self.positive.len() + self.negative.len()
    }

    fn index(&self, magnitude: f64) -> i32 {
        // ln of the smallest subnormal is about -744.4 and of f64::MAX about 709.8, so the
        // quotient fits an i32 for any alpha above 1e-6.
        (magnitude.ln() / self.ln_gamma).ceil() as i32
    }

    /// The value a bin stands for: `2γ^i / (γ + 1)`, computed in log space so neither end
    /// overflows or underflows early.
    fn value(&self, index: i32) -> f64 {
        let gamma = self.ln_gamma.exp();
        let v = (f64::from(index) * self.ln_gamma - f64::midpoint(gamma, 1.0).ln()).exp();
        v.min(f64::MAX)
    }

    /// Adds one finite value.
    pub fn add(&mut self, x: f64) {
        self.add_n(x, 1);
    }

    fn add_n(&mut self, x: f64, n: u64) {
        debug_assert!(x.is_finite(), "decode rejects non-finite values");
        // Counts saturate: a bucket merged from untrusted deltas must not panic or wrap.
        if x == 0.0 {
            self.zeros = self.zeros.saturating_add(n);
        } else {
            let i = self.index(x.abs());
            let store = if x > 0.0 {
                &mut self.positive
            } else {
                &mut self.negative
            };
            let bin = store.entry(i).or_insert(0);
            *bin = bin.saturating_add(n);
        }
        self.count = self.count.saturating_add(n);
        self.collapse();
    }

    /// Adds `other`'s counts into `self`.
    pub fn merge(&mut self, other: &Sketch) {
        if self.alpha == other.alpha {
            for (i, n) in &other.positive {
                let bin = self.positive.entry(*i).or_insert(0);
                *bin = bin.saturating_add(*n);
            }
            for (i, n) in &other.negative {
                let bin = self.negative.entry(*i).or_insert(0);
                *bin = bin.saturating_add(*n);
            }
            self.zeros = self.zeros.saturating_add(other.zeros);
            self.count = self.count.saturating_add(other.count);
            self.collapse();
        } else {
            // Another accuracy setting: re-bin each of its bins by the value it stands for.
            for (i, n) in &other.positive {
                self.add_n(other.value(*i), *n);
            }
            for (i, n) in &other.negative {
                self.add_n(-other.value(*i), *n);
            }
            self.zeros = self.zeros.saturating_add(other.zeros);
            self.count = self.count.saturating_add(other.zeros);
        }
    }

    /// Enforces `max_bins` by folding the bins closest to zero into their neighbours.
    fn collapse(&mut self) {
        while self.bins() > self.max_bins as usize {
            // max_bins >= 2, so with three or more bins one store has two or more.
            let lowest = |store: &BTreeMap<i32, u64>| store.first_key_value().map(|(i, _)| *i);
            let use_negative = match (self.positive.len() > 1, self.negative.len() > 1) {
                (true, true) => lowest(&self.negative) < lowest(&self.positive),
                (negative_only, _) => !negative_only,
            };
            let store = if use_negative {
                &mut self.negative
            } else {
                &mut self.positive
            };
            let (_, n) = store.pop_first().expect("a store with two or more bins");
            let (_, next) = store
                .iter_mut()
                .next()
                .expect("a store with two or more bins");
            *next = next.saturating_add(n);
        }
    }

    /// The value at quantile `q` (0..=1) by the interpolated rank of Prometheus's
    /// `quantile_over_time` (Hyndman-Fan type 7, numpy's default): with `h = q * (n - 1)`, the
    /// values of ranks `floor(h)` and `floor(h) + 1` (0-based, ascending) weighted by the
    /// fraction of `h`. Each is estimated within a relative `α` (for bins not collapsed), so the
    /// answer is within `α` of the exact one when both have the same sign (within `α` of the
    /// larger of the two otherwise). `None` when empty. [`crate::summary::Summary::quantile`]
    /// puts the exact min and max at the ends.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        self.quantile_with(q, |rank| self.value_at_rank(rank))
    }

    /// [`Sketch::quantile`] with the value of each rank from `at`.
    pub fn quantile_with(&self, q: f64, at: impl Fn(u64) -> Option<f64>) -> Option<f64> {
        if self.count == 0 {
            return None;
        }
        let h = q.clamp(0.0, 1.0) * (self.count - 1) as f64;
        let low = h.floor();
        let rank = low as u64;
        let below = at(rank)?;
        let fraction = h - low;
        if fraction == 0.0 || rank.saturating_add(1) >= self.count {
            return Some(below);
        }
        let above = at(rank + 1)?;
        Some(below + fraction * (above - below))
    }

    /// The estimated value of rank `rank` (0-based, ascending); `None` when empty.
    pub fn value_at_rank(&self, rank: u64) -> Option<f64> {
        let mut seen = 0u64;
        // Ascending values: the most negative first (largest index of the negative store).
        let negative = self
            .negative
            .iter()
            .rev()
            .map(|(i, n)| (-self.value(*i), *n));
        let positive = self.positive.iter().map(|(i, n)| (self.value(*i), *n));
        let mut largest = None;
        for (value, n) in negative.chain([(0.0, self.zeros)]).chain(positive) {
            // Saturating: counts merged from untrusted deltas can sum past u64 (each bin and
            // `count` saturate on their own), and then the largest value answers.
            seen = seen.saturating_add(n);
            if n > 0 {
                largest = Some(value);
            }
            if seen > rank {
                return Some(value);
            }
        }
        largest
    }

    /// Compact binary form: version, alpha, `max_bins`, zeros, then each store as a varint bin
    /// count and (zigzag delta index, count) varint pairs.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(16 + 4 * self.bins());
        out.push(ENCODING_V1);
        out.extend_from_slice(&self.alpha.to_le_bytes());
        put_varint(&mut out, u64::from(self.max_bins));
        put_varint(&mut out, self.zeros);
        for store in [&self.positive, &self.negative] {
            put_varint(&mut out, store.len() as u64);
            let mut prev = 0i64;
            for (i, n) in store {
                put_varint(&mut out, zigzag(i64::from(*i) - prev));
                put_varint(&mut out, *n);
                prev = i64::from(*i);
            }
        }
        out
    }

    /// Decodes what [`Sketch::encode`] wrote. bucketd never writes a sketch with more bins than
    /// its `max_bins`; one that has more (a document stored from a forged delta before issue
    /// 52) is collapsed to them as it is read, so that no decoded sketch outgrows its bound.
    /// Memory while decoding grows with `bytes` (two at least a bin), never with a count read
    /// from them.
    pub fn decode(bytes: &[u8]) -> Option<Sketch> {
        Sketch::decode_bounded(bytes, false)
    }

    /// [`Sketch::decode`] for bytes from outside (a delta, a fleet row): a sketch with more
    /// bins than its own `max_bins` could not have come from a bucketd and is refused, before
    /// its bins are read (issue 52: 2,000 deltas of 30,000 bins each grew a central to 0.9 GiB).
    pub fn decode_untrusted(bytes: &[u8]) -> Option<Sketch> {
        Sketch::decode_bounded(bytes, true)
    }

    fn decode_bounded(bytes: &[u8], refuse_oversized: bool) -> Option<Sketch> {
        let (&version, rest) = bytes.split_first()?;
        if version != ENCODING_V1 || rest.len() < 8 {
            return None;
        }
        let alpha = f64::from_le_bytes(rest[..8].try_into().ok()?);
        if !(alpha > 0.0 && alpha < 1.0) {
            return None;
        }
        let mut r = &rest[8..];
        let max_bins = u32::try_from(get_varint(&mut r)?).ok()?.max(2);
        let mut s = Sketch::new(SketchParams { alpha, max_bins });
        s.zeros = get_varint(&mut r)?;
        s.count = s.zeros;
        for negative in [false, true] {
            let bins = get_varint(&mut r)?;
            if refuse_oversized && (s.bins() as u64).saturating_add(bins) > u64::from(max_bins) {
                return None;
            }
            let mut prev = None;
            for _ in 0..bins {
                let step = unzigzag(get_varint(&mut r)?);
                // Indices ascend (`encode` writes a BTreeMap in order): a repeated or
                // descending index is a damaged or forged sketch, not one bin counted twice.
                let i = match prev {
                    None => step,
                    Some(prev) if step > 0 => i64::checked_add(prev, step)?,
                    Some(_) => return None,
                };
                let n = get_varint(&mut r)?;
                let store = if negative {
                    &mut s.negative
                } else {
                    &mut s.positive
                };
                store.insert(i32::try_from(i).ok()?, n);
                // Saturating, as `add` and `merge` count: a sketch merged past u64 (from
                // untrusted deltas) must read back as it was written.
                s.count = s.count.saturating_add(n);
                prev = Some(i);
            }
        }
        if !r.is_empty() {
            return None;
        }
        s.collapse();
        Some(s)
    }

    /// The most bytes [`Sketch::encode`] writes for a sketch of `max_bins` bins: the header
    /// (version, α, `max_bins`, zeros, two bin counts) and two varints of at most 10 bytes a
    /// bin. What a reader of outside bytes allows before it reads them.
    pub fn encoded_len_max(max_bins: u32) -> usize {
        1 + 8 + 4 * 10 + max_bins as usize * 20
    }
}

pub(crate) fn zigzag(v: i64) -> u64 {
    ((v << 1) ^ (v >> 63)) as u64
}

pub(crate) fn unzigzag(v: u64) -> i64 {
    ((v >> 1) as i64) ^ -((v & 1) as i64)
}

pub(crate) fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

pub(crate) fn get_varint(r: &mut &[u8]) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let (&b, rest) = r.split_first()?;
        *r = rest;
        v |= u64::from(b & 0x7f) << shift;
        if b < 0x80 {
            return Some(v);
        }
    }
    None
}

#[cfg(test)]
mod tests;
