//! [`RecordIndex`]: where each series' entries are in a record, so that a read of one series
//! decodes that series' entries and not the whole record (without it, every query read every
//! waiting commit whole, whatever series it asked for). Pure.
//!
//! Two parts, both small beside the record: a Bloom filter of the record's series ids (about 2
//! bytes a series; a record without the series is passed over with three bit tests), and a seek
//! point every [`SEEK_EVERY`] entries (the decoder's state before that entry, 32 bytes), from
//! which the entries of a series are read after at most [`SEEK_EVERY`] others.

use super::{Corrupt, Entries, Entry, Record};

/// Entries between two seek points.
pub const SEEK_EVERY: u32 = 32;

/// Bloom filter bits per distinct series (rounded up to whole words), and its hashes: about 3%
/// of the records without a series are read for it all the same.
const BITS_PER_SERIES: usize = 8;
const HASHES: u32 = 3;

/// The decoder's state before an entry: where it starts, how many entries are left with it,
/// and the previous entry's id and start (entries are coded as differences from them).
#[derive(Debug, Clone, Copy)]
struct SeekPoint {
    /// The series id of the entry here.
    id: u64,
    offset: u32,
    left: u32,
    prev_id: u64,
    prev_start: i64,
}

/// A record's index, built by [`RecordIndex::of`].
#[derive(Debug, Clone, Default)]
pub struct RecordIndex {
    points: Vec<SeekPoint>,
    bloom: Vec<u64>,
    entries: u32,
}

impl RecordIndex {
    /// Indexes the record `bytes`. Fails when it is unreadable or its entries are not in
    /// strictly increasing (series id, start) order, as every record is written: an index of
    /// such a record would hide entries, so its reader reads it whole instead.
    pub fn of(bytes: &[u8]) -> Result<RecordIndex, Corrupt> {
        let record = Record::parse(bytes)?;
        let entries = u32::try_from(record.count).map_err(|_| Corrupt)?;
        let total = record.entries.len();
        let mut it = record.entries();
        let mut points = Vec::new();
        let mut ids = Vec::new();
        let mut last: Option<(u64, i64)> = None;
        for n in 0..entries {
            let (prev_id, prev_start, offset) = (it.prev_id, it.prev_start, total - it.rest.len());
            let entry = it.next().ok_or(Corrupt)??;
            let key = (entry.series_id, entry.start);
            if last.is_some_and(|l| l >= key) {
                return Err(Corrupt);
            }
            if n % SEEK_EVERY == 0 {
                points.push(SeekPoint {
                    id: entry.series_id,
                    offset: u32::try_from(offset).map_err(|_| Corrupt)?,
                    left: entries - n,
                    prev_id,
                    prev_start,
                });
            }
            if last.is_none_or(|l| l.0 != key.0) {
                ids.push(key.0);
            }
            last = Some(key);
        }
        if it.next().is_some() {
            return Err(Corrupt);
        }
        // Grown as the entries were read (a damaged count must not size an allocation); kept
        // at what it holds.
        points.shrink_to_fit();
        let size = (ids.len() * BITS_PER_SERIES).max(64).div_ceil(64) * 64;
        let mut index = RecordIndex {
            points,
            bloom: vec![0; size / 64],
            entries,
        };
        for id in ids {
            for bit in bits(id, index.bloom.len()) {
                index.bloom[bit / 64] |= 1 << (bit % 64);
            }
        }
        Ok(index)
    }

    /// Entries in the record.
    pub fn entries(&self) -> u32 {
        self.entries
    }

    /// Bytes the index takes in memory (not counted in `store.checkpoint_bytes`; about 30% of
    /// the record's).
    pub fn heap_bytes(&self) -> usize {
        self.points.len() * std::mem::size_of::<SeekPoint>() + self.bloom.len() * 8
    }

    /// Whether the record may hold entries of series `id` (false: it holds none).
    pub fn may_hold(&self, id: u64) -> bool {
        bits(id, self.bloom.len()).all(|bit| self.bloom[bit / 64] & (1 << (bit % 64)) != 0)
    }
}

/// The filter's bit positions for `id` in a filter of `words` 64-bit words: double hashing of
/// one 64-bit mix, each 32-bit hash mapped onto the bits by multiplying (no power of two needed).
fn bits(id: u64, words: usize) -> impl Iterator<Item = usize> {
    let h = mix(id);
    let (h1, h2) = (h as u32, (h >> 32) as u32 | 1);
    let size = (words * 64) as u64;
    (0..HASHES).map(move |i| {
        let hash = u64::from(h1.wrapping_add(i.wrapping_mul(h2)));
        ((hash * size) >> 32) as usize
    })
}

/// splitmix64's finaliser: series ids are small consecutive numbers, their bits need mixing.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

impl<'a> Record<'a> {
    /// The entries of series `id`, in start order, read with `index` (built from this record
    /// by [`RecordIndex::of`]): none without decoding anything when the index says the record
    /// does not hold the series, else from the seek point before them.
    pub fn entries_of(&self, index: &RecordIndex, id: u64) -> SeriesEntries<'a> {
        let mut entries = self.entries();
        if index.may_hold(id) {
            // The last point before any entry of `id`: points at or after the first point whose
            // entry is `id` or later may have passed some of its entries.
            let after = index.points.partition_point(|p| p.id < id);
            if let Some(p) = after.checked_sub(1).and_then(|i| index.points.get(i)) {
                // An index of another record (or a damaged one) must not panic the slice.
                if let Some(rest) = self.entries.get(p.offset as usize..) {
                    entries.rest = rest;
                    entries.left = u64::from(p.left);
                    entries.prev_id = p.prev_id;
                    entries.prev_start = p.prev_start;
                }
            }
        } else {
            entries.left = 0;
            entries.rest = &[];
        }
        SeriesEntries {
            entries,
            id,
            skipped: false,
        }
    }
}

/// The entries of one series in a record ([`Record::entries_of`]).
pub struct SeriesEntries<'a> {
    entries: Entries<'a>,
    id: u64,
    /// The entries of series below `id` are passed over.
    skipped: bool,
}

impl<'a> Iterator for SeriesEntries<'a> {
    type Item = Result<Entry<'a>, Corrupt>;

    fn next(&mut self) -> Option<Self::Item> {
        if !self.skipped {
            self.skipped = true;
            if let Err(e) = self.entries.skip_below(self.id) {
                self.entries.failed = true;
                return Some(Err(e));
            }
        }
        loop {
            match self.entries.next()? {
                Ok(e) if e.series_id < self.id => {}
                Ok(e) if e.series_id == self.id => return Some(Ok(e)),
                Ok(_) => {
                    self.entries.left = 0;
                    self.entries.rest = &[];
                    return None;
                }
                Err(e) => return Some(Err(e)),
            }
        }
    }
}
