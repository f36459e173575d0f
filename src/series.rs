//! [`SeriesSet`]: the series names the daemon knows, interned, and bounded by `limits.max_series`
//! so that a device inventing a new id per message meets a counted rejection, not unbounded growth;
//! and by `limits.max_series_per_sensor` per sensor, so that one device's thousands of metrics
//! cannot use up what every other device needs. Names the store no longer holds (retention
//! deleted a series' last bucket) are forgotten, which frees their place.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use crate::reject::DecodeError;

#[derive(Debug)]
pub struct SeriesSet {
    names: HashSet<Arc<str>>,
    max: usize,
    /// Series per sensor (a name's part before its first `/`); bounded by `names`.
    per_sensor: HashMap<Box<str>, usize>,
    max_per_sensor: usize,
}

/// The sensor part of a series name (`sensor/metric`; a central's `gateway:sensor/metric`).
fn sensor_of(series: &str) -> &str {
    series.split_once('/').map_or(series, |(sensor, _)| sensor)
}

impl SeriesSet {
    /// Starts from the series already stored; `max_per_sensor` bounds the series of one sensor
    /// that [`SeriesSet::intern_reading`] adds.
    pub fn new(
        max: usize,
        max_per_sensor: usize,
        existing: impl IntoIterator<Item = Arc<str>>,
    ) -> SeriesSet {
        let mut set = SeriesSet {
            names: HashSet::new(),
            max,
            per_sensor: HashMap::new(),
            max_per_sensor,
        };
        for name in existing {
            set.add(name);
        }
        set
    }

    fn add(&mut self, name: Arc<str>) {
        *self
            .per_sensor
            .entry(Box::from(sensor_of(&name)))
            .or_insert(0) += 1;
        self.names.insert(name);
    }

    /// The shared name of `series`, adding it if there is room in `limits.max_series`.
    pub fn intern(&mut self, series: &str) -> Result<Arc<str>, DecodeError> {
        if let Some(name) = self.names.get(series) {
            return Ok(name.clone());
        }
        if self.names.len() >= self.max {
            return Err(DecodeError::SeriesLimit);
        }
        let name: Arc<str> = Arc::from(series);
        self.add(name.clone());
        Ok(name)
    }

    /// [`SeriesSet::intern`] for a device's reading: a new series also needs room in its
    /// sensor's share.
    pub fn intern_reading(&mut self, series: &str) -> Result<Arc<str>, DecodeError> {
        if let Some(name) = self.names.get(series) {
            return Ok(name.clone());
        }
        if self.names.len() >= self.max {
            return Err(DecodeError::SeriesLimit);
        }
        let used = self.per_sensor.get(sensor_of(series)).copied();
        if used.unwrap_or(0) >= self.max_per_sensor {
            return Err(DecodeError::SensorLimit);
        }
        self.intern(series)
    }

    /// Forgets `series` (the store deleted it), freeing its place. Whether it was known.
    pub fn forget(&mut self, series: &str) -> bool {
        if !self.names.remove(series) {
            return false;
        }
        let sensor = sensor_of(series);
        if let Some(n) = self.per_sensor.get_mut(sensor) {
            *n -= 1;
            if *n == 0 {
                self.per_sensor.remove(sensor);
            }
        }
        true
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
        let mut set = SeriesSet::new(2, 100, [Arc::from("a/x")]);
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

    /// Issue 41: `limits.max_series` was shared by every device with no share each, so one
    /// device's two messages of 8,000 keys filled the default for all. A sensor's new series
    /// stop at its share (counting those stored at start), others' go on; a forgotten series
    /// frees its place in both bounds.
    #[test]
    fn one_sensor_cannot_use_up_every_series() {
        let mut set = SeriesSet::new(10, 3, [Arc::from("greedy/m0")]);
        set.intern_reading("greedy/m1").unwrap();
        set.intern_reading("greedy/m2").unwrap();
        assert_eq!(
            set.intern_reading("greedy/m3"),
            Err(DecodeError::SensorLimit)
        );
        assert!(set.intern_reading("greedy/m1").is_ok(), "known ones pass");
        for i in 0..7 {
            set.intern_reading(&format!("other{i}/t")).unwrap();
        }
        assert_eq!(set.intern_reading("late/t"), Err(DecodeError::SeriesLimit));
        assert!(set.forget("greedy/m0"));
        assert!(!set.forget("greedy/m0"), "forgotten once");
        set.intern_reading("greedy/m3").unwrap();
        assert_eq!(set.intern_reading("late/t"), Err(DecodeError::SeriesLimit));
        assert!(set.forget("other0/t"));
        set.intern_reading("late/t").unwrap();
        assert_eq!(set.len(), 10);
    }
}
