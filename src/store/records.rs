//! A commit log record's entries, visited: all of them, or those of some series found with the
//! record's index ([`crate::commitlog::RecordIndex`]). Used alike by the checkpoint
//! ([`super::log`]), the pending commits ([`super::pending`]) and the readers
//! ([`super::unfolded`]).

use crate::commitlog::{Entry, Record, RecordIndex};

pub(super) fn corrupt_record(seq: u64) -> impl Fn(crate::commitlog::Corrupt) -> redb::Error {
    move |_| redb::Error::Corrupted(format!("commit log record {seq} is unreadable"))
}

/// Calls `visit` with the entries of series `ids` (sorted; all when `None`) of commit `seq`'s
/// record: found with its `index` when there is one and `ids` are few beside its entries, else
/// by reading it whole.
pub(super) fn visit_indexed(
    seq: u64,
    bytes: &[u8],
    index: Option<&RecordIndex>,
    ids: Option<&[u64]>,
    mut visit: impl FnMut(u64, &Entry<'_>) -> Result<(), redb::Error>,
) -> Result<(), redb::Error> {
    let (Some(index), Some(ids)) = (index, ids) else {
        return visit_record(seq, bytes, visit);
    };
    // Looking a series up costs a few bit tests, and up to `SEEK_EVERY` entries of others
    // when the record may hold it: past an eighth of the entries, one pass is cheaper.
    if ids.len() > 1 && ids.len() as u64 * 8 > u64::from(index.entries()) {
        return visit_record(seq, bytes, visit);
    }
    let record = Record::parse(bytes).map_err(corrupt_record(seq))?;
    for &id in ids {
        for entry in record.entries_of(index, id) {
            visit(seq, &entry.map_err(corrupt_record(seq))?)?;
        }
    }
    Ok(())
}

/// Calls `visit` with every entry of the record of commit `seq`.
pub(super) fn visit_record(
    seq: u64,
    bytes: &[u8],
    mut visit: impl FnMut(u64, &Entry<'_>) -> Result<(), redb::Error>,
) -> Result<(), redb::Error> {
    let record = Record::parse(bytes).map_err(corrupt_record(seq))?;
    for entry in record.entries() {
        visit(seq, &entry.map_err(corrupt_record(seq))?)?;
    }
    Ok(())
}
