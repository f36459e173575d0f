//! Raw reading pages: the compact encoding of up to `page_capacity` `(timestamp, value)` pairs,
//! in the style of Facebook's Gorilla (Pelkonen et al., VLDB 2015). Pure.
//!
//! - Timestamps are divided by the largest unit that divides all of them (1 s, 1 ms, 1 us or
//!   1 ns, recorded in the page), then stored as the first value and delta-of-deltas in
//!   variable-width bit fields. Readings keep their arrival order, so out-of-order and equal
//!   timestamps cost a few bits more but round-trip exactly (wrapping arithmetic is invertible).
//! - Values, when every value of the page is a decimal with at most 6 fractional digits (what
//!   sensors send: `21.3`), are stored as the integers `value * 10^k` and their deltas in
//!   variable-width fields (a noisy temperature: about one byte per reading). The check
//!   `n / 10^k == value` is exact on encode, so this is lossless. Otherwise, Gorilla's XOR
//!   scheme: the first value's 64 bits, then each value `XORed` with the previous one (a repeated
//!   value costs one bit, a similar one its meaningful middle bits). Either way every f64
//!   round-trips bit for bit (subnormals, -0.0, extremes).

/// Timestamp units tried, largest first (nanoseconds per unit).
pub(crate) const UNITS: [i64; 4] = [1_000_000_000, 1_000_000, 1_000, 1];

/// An encoded page: the readings' count, time range, unit and bit stream, and where the
/// encoder stopped, so that later readings can be appended without decoding the page.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncodedPage {
    pub count: u32,
    pub min_ts: i64,
    pub max_ts: i64,
    /// Nanoseconds per stored timestamp unit.
    pub unit: i64,
    /// `k` when values are stored as decimal integers `value * 10^k`; `-1` for XOR-encoded bits.
    pub decimals: i32,
    pub data: Vec<u8>,
    pub tail: Tail,
}

/// The encoder's state after the last reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Tail {
    /// Last timestamp (in units) and last delta.
    pub ts: i64,
    pub delta: i64,
    /// Last value: its f64 bits (XOR) or its integer (decimal).
    pub value: u64,
    /// XOR window of meaningful bits; `lead = 64` before the first window.
    pub lead: u32,
    pub trail: u32,
    /// Bits used in the last byte of `data` (0: the last byte is full).
    pub bits: u32,
}

/// Most fractional digits tried for the decimal value encoding.
const DECIMALS_MAX: i32 = 6;

/// The smallest `k` such that every value is exactly `n / 10^k` for an integer `|n| < 2^52`.
pub(crate) fn decimal_scale(readings: &[(i64, f64)]) -> Option<i32> {
    (0..=DECIMALS_MAX).find(|&k| readings.iter().all(|&(_, v)| is_decimal(v, k)))
}

/// Whether `v` is exactly `n / 10^k` for an integer `|n| < 2^52` (through the integer, as
/// decode does: -0.0 must not come back as 0.0).
pub(crate) fn is_decimal(v: f64, k: i32) -> bool {
    let scale = 10f64.powi(k);
    let n = (v * scale).round();
    n.abs() < (1u64 << 52) as f64 && ((n as i64) as f64 / scale).to_bits() == v.to_bits()
}

/// Encodes readings (in arrival order). `readings` must not be empty.
pub fn encode(readings: &[(i64, f64)]) -> EncodedPage {
    assert!(!readings.is_empty(), "a page holds at least one reading");
    let unit = UNITS
        .into_iter()
        .find(|u| readings.iter().all(|(ts, _)| ts % u == 0))
        .expect("1 divides everything");
    let decimals = decimal_scale(readings).unwrap_or(-1);
    let mut e = Encoder::start(readings[0], unit, decimals);
    for &(ts, value) in &readings[1..] {
        e.push(ts, value);
    }
    e.finish()
}

/// `page` followed by `readings`. Appends to the bit stream when the new readings fit the
/// page's timestamp unit and value form (the usual case: O(new readings)); otherwise re-encodes
/// everything, which also yields `None` if the page is damaged.
pub fn append(page: &EncodedPage, readings: &[(i64, f64)]) -> Option<EncodedPage> {
    let fits = readings
        .iter()
        .all(|&(ts, v)| ts % page.unit == 0 && (page.decimals < 0 || is_decimal(v, page.decimals)));
    if fits {
        let mut e = Encoder::resume(page);
        for &(ts, value) in readings {
            e.push(ts, value);
        }
        return Some(e.finish());
    }
    let mut all = decode(page)?;
    all.extend_from_slice(readings);
    Some(encode(&all))
}

/// The streaming encoder behind [`encode`] and [`append`].
struct Encoder {
    w: BitWriter,
    unit: i64,
    decimals: i32,
    scale: f64,
    tail: Tail,
    count: u32,
    min_ts: i64,
    max_ts: i64,
}

impl Encoder {
    fn start((ts, value): (i64, f64), unit: i64, decimals: i32) -> Encoder {
        let scale = 10f64.powi(decimals.max(0));
        let first = if decimals >= 0 {
            (value * scale).round() as i64 as u64
        } else {
            value.to_bits()
        };
        let mut w = BitWriter::default();
        w.put((ts / unit) as u64, 64);
        w.put(first, 64);
        Encoder {
            w,
            unit,
            decimals,
            scale,
            tail: Tail {
                ts: ts / unit,
                delta: 0,
                value: first,
                lead: 64,
                trail: 0,
                bits: 0,
            },
            count: 1,
            min_ts: ts,
            max_ts: ts,
        }
    }

    fn resume(page: &EncodedPage) -> Encoder {
        Encoder {
            w: BitWriter::resume(page.data.clone(), page.tail.bits),
            unit: page.unit,
            decimals: page.decimals,
            scale: 10f64.powi(page.decimals.max(0)),
            tail: page.tail,
            count: page.count,
            min_ts: page.min_ts,
            max_ts: page.max_ts,
        }
    }

    fn push(&mut self, ts: i64, value: f64) {
        let t = &mut self.tail;
        let w = &mut self.w;
        let units = ts / self.unit;
        let delta = units.wrapping_sub(t.ts);
        put_field(w, &TS_FIELDS, zigzag(delta.wrapping_sub(t.delta)));
        (t.ts, t.delta) = (units, delta);
        (self.min_ts, self.max_ts) = (self.min_ts.min(ts), self.max_ts.max(ts));
        self.count += 1;

        if self.decimals >= 0 {
            let n = (value * self.scale).round() as i64;
            put_field(w, &VALUE_FIELDS, zigzag(n.wrapping_sub(t.value as i64)));
            t.value = n as u64;
            return;
        }
        let bits = value.to_bits();
        let xor = bits ^ t.value;
        t.value = bits;
        if xor == 0 {
            w.put(0, 1);
            return;
        }
        let (lead, trail) = (xor.leading_zeros().min(31), xor.trailing_zeros());
        if t.lead != 64 && lead >= t.lead && trail >= t.trail {
            // Fits the previous window of meaningful bits.
            w.put(0b10, 2);
            w.put(xor >> t.trail, 64 - t.lead - t.trail);
        } else {
            let len = 64 - lead - trail;
            w.put(0b11, 2);
            w.put(u64::from(lead), 5);
            w.put(u64::from(len - 1), 6);
            w.put(xor >> trail, len);
            (t.lead, t.trail) = (lead, trail);
        }
    }

    fn finish(self) -> EncodedPage {
        let (data, bits) = self.w.finish();
        EncodedPage {
            count: self.count,
            min_ts: self.min_ts,
            max_ts: self.max_ts,
            unit: self.unit,
            decimals: self.decimals,
            data,
            tail: Tail { bits, ..self.tail },
        }
    }
}

/// Decodes `count` readings; `None` if the data is shorter than it claims.
pub fn decode(page: &EncodedPage) -> Option<Vec<(i64, f64)>> {
    if page.count == 0 || !UNITS.contains(&page.unit) || page.decimals > DECIMALS_MAX {
        return None;
    }
    let mut r = BitReader::new(&page.data);
    let mut out = Vec::with_capacity(page.count as usize);
    let (mut ts, mut delta) = (r.get(64)? as i64, 0i64);
    let mut bits = r.get(64)?;
    let scale = 10f64.powi(page.decimals.max(0));
    let mut n = bits as i64;
    let value = |bits: u64, n: i64| {
        if page.decimals >= 0 {
            n as f64 / scale
        } else {
            f64::from_bits(bits)
        }
    };
    let (mut lead, mut trail) = (0u32, 0u32);
    out.push((ts.wrapping_mul(page.unit), value(bits, n)));
    for _ in 1..page.count {
        delta = delta.wrapping_add(unzigzag(get_field(&mut r, &TS_FIELDS)?));
        ts = ts.wrapping_add(delta);
        if page.decimals >= 0 {
            n = n.wrapping_add(unzigzag(get_field(&mut r, &VALUE_FIELDS)?));
            out.push((ts.wrapping_mul(page.unit), value(bits, n)));
            continue;
        }
        if r.get(1)? == 1 {
            if r.get(1)? == 1 {
                lead = r.get(5)? as u32;
                let len = r.get(6)? as u32 + 1;
                trail = 64u32.checked_sub(lead + len)?;
            }
            bits ^= r.get(64 - lead - trail)? << trail;
        }
        out.push((ts.wrapping_mul(page.unit), value(bits, n)));
    }
    Some(out)
}

/// Widths of the variable fields, after a unary prefix of 0..=5 ones: a zero (prefix `0`,
/// no bits), then growing widths; the last width is always 64.
type Fields = [u32; 6];
/// Timestamp delta-of-deltas: mostly zero for a regular sensor.
const TS_FIELDS: Fields = [0, 7, 12, 20, 32, 64];
/// Decimal value deltas: small steps of a noisy signal.
const VALUE_FIELDS: Fields = [0, 4, 8, 16, 32, 64];

/// Writes zigzagged `zz` in the narrowest field that holds it.
fn put_field(w: &mut BitWriter, fields: &Fields, zz: u64) {
    let ones = fields
        .iter()
        .position(|&width| width == 64 || zz < 1u64 << width)
        .expect("the last field is 64 bits wide");
    let ones = if zz == 0 { 0 } else { ones.max(1) };
    w.put((1u64 << ones) - 1, ones as u32); // `ones` ones
    if ones < 5 {
        w.put(0, 1); // the terminating zero
    }
    w.put(zz, fields[ones]);
}

fn get_field(r: &mut BitReader, fields: &Fields) -> Option<u64> {
    let mut ones = 0;
    while ones < 5 && r.get(1)? == 1 {
        ones += 1;
    }
    r.get(fields[ones])
}

fn zigzag(v: i64) -> u64 {
    ((v << 1) ^ (v >> 63)) as u64
}

fn unzigzag(v: u64) -> i64 {
    ((v >> 1) as i64) ^ -((v & 1) as i64)
}

/// The low `n` bits set (n <= 64).
fn mask(n: u32) -> u64 {
    if n >= 64 { u64::MAX } else { (1u64 << n) - 1 }
}

/// Writes bit fields most significant bit first, a byte at a time.
#[derive(Default)]
struct BitWriter {
    bytes: Vec<u8>,
    /// Pending bits, in the low `pending` bits (fewer than 8 between calls).
    acc: u64,
    pending: u32,
}

impl BitWriter {
    /// Appends the low `n` bits of `v` (n <= 64).
    fn put(&mut self, v: u64, n: u32) {
        let mut left = n;
        while left > 0 {
            // `pending` < 8, so at least 57 bits fit.
            let take = left.min(56);
            let chunk = (v >> (left - take)) & mask(take);
            self.acc = (self.acc << take) | chunk;
            self.pending += take;
            left -= take;
            while self.pending >= 8 {
                self.pending -= 8;
                self.bytes.push((self.acc >> self.pending) as u8);
            }
            self.acc &= mask(self.pending);
        }
    }

    /// Continues a stream whose last byte holds `bits` used bits (0: the last byte is full).
    fn resume(mut bytes: Vec<u8>, bits: u32) -> BitWriter {
        let partial = if bits > 0 { bytes.pop() } else { None };
        match partial {
            Some(last) => BitWriter {
                bytes,
                acc: u64::from(last >> (8 - bits)),
                pending: bits,
            },
            None => BitWriter {
                bytes,
                acc: 0,
                pending: 0,
            },
        }
    }

    /// The bytes, and how many bits of the last byte are used (0: all eight).
    fn finish(mut self) -> (Vec<u8>, u32) {
        let bits = self.pending;
        if self.pending > 0 {
            self.bytes.push((self.acc << (8 - self.pending)) as u8);
        }
        (self.bytes, bits)
    }
}

/// Reads bit fields most significant bit first, a byte at a time.
struct BitReader<'a> {
    bytes: &'a [u8],
    next: usize,
    acc: u64,
    available: u32,
}

impl<'a> BitReader<'a> {
    fn new(bytes: &'a [u8]) -> BitReader<'a> {
        BitReader {
            bytes,
            next: 0,
            acc: 0,
            available: 0,
        }
    }

    fn get(&mut self, n: u32) -> Option<u64> {
        let mut v = 0u64;
        let mut left = n;
        while left > 0 {
            if self.available == 0 {
                self.acc = u64::from(*self.bytes.get(self.next)?);
                self.next += 1;
                self.available = 8;
            }
            let take = left.min(self.available);
            let chunk = (self.acc >> (self.available - take)) & mask(take);
            v = (v << take) | chunk; // take <= 8: never a 64-bit shift
            self.available -= take;
            left -= take;
        }
        Some(v)
    }
}

#[cfg(test)]
mod tests;
