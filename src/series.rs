//! [`SeriesSet`]: the series names the daemon knows, interned, and bounded by `limits.max_series`
//! so that a device inventing a new id per message meets a counted rejection, not unbounded growth.

use std::collections::HashSet;
use std::sync::Arc;

use crate::reject::DecodeError;

#[derive(Debug)]
pub struct SeriesSet {
    names: HashSet<Arc<str>>,
    max: usize,
}

impl SeriesSet {
    /// Starts from the series already stored.
    pub fn new(max: usize, existing: impl IntoIterator<Item = Arc<str>>) -> SeriesSet {
        SeriesSet {
            names: existing.into_iter().collect(),
            max,
        }
    }

    /// The shared name of `series`, adding it if there is room.
    pub fn intern(&mut self, series: &str) -> Result<Arc<str>, DecodeError> {
        if let Some(name) = self.names.get(series) {
            return Ok(name.clone());
        }
        if self.names.len() >= self.max {
            return Err(DecodeError::SeriesLimit);
        }
        let name: Arc<str> = Arc::from(series);
        self.names.insert(name.clone());
        Ok(name)
    }

    pub fn contains(&self, series: &str) -> bool {
        self.names.contains(series)
    }

    pub fn names(&self) -> impl Iterator<Item = &Arc<str>> {
        self.names.iter()
    }

    pub fn len(&self) -> usize {
        self.names.len()
    }

    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_series_pass_and_new_ones_stop_at_the_limit() {
        let mut set = SeriesSet::new(2, [Arc::from("a/x")]);
        let a = set.intern("a/x").unwrap();
        assert!(
            Arc::ptr_eq(&a, &set.intern("a/x").unwrap()),
            "names are interned"
        );
        set.intern("b/x").unwrap();
        assert_eq!(set.intern("c/x"), Err(DecodeError::SeriesLimit));
        assert_eq!(set.len(), 2);
        assert!(
            set.intern("b/x").is_ok(),
            "known series still pass at the limit"
        );
    }
}
