//! What a range function's windows read: a series' stored buckets ([`Stored`]), merged a window
//! at a time as the windows slide forward ([`Sliding`]), and its raw readings where every
//! bucket still holds them ([`Exact`]).

use super::bucket_of;
use crate::summary::Summary;

/// The buckets of one stored series, in time order: their starts (ms) and summaries.
#[derive(Default)]
pub(super) struct Stored {
    pub(super) starts: Vec<i64>,
    pub(super) summaries: Vec<Summary>,
}

impl Stored {
    /// The summaries of the buckets starting in `[from, to)` (ms).
    pub(super) fn between(&self, from: i64, to: i64) -> &[Summary] {
        let (a, b) = self.span(from, to);
        &self.summaries[a..b]
    }

    /// The index range (into `summaries`) of the buckets starting in `[from, to)` (ms).
    pub(super) fn span(&self, from: i64, to: i64) -> (usize, usize) {
        let a = self.starts.partition_point(|&s| s < from);
        let b = self.starts.partition_point(|&s| s < to);
        (a, b.max(a))
    }

    pub(super) fn merged(&self, from: i64, to: i64) -> Option<Summary> {
        let mut found = self.between(from, to).iter();
        let mut acc = found.next()?.clone();
        for s in found {
            acc.merge(s);
        }
        Some(acc)
    }
}

/// The merge of a window of `items` that only moves forward (two stacks: the front holds the
/// merges of its items to its end, the back one running merge), so that each item is merged a
/// bounded number of times however many windows are asked for: `O(items + windows)` merges,
/// against `O(items x windows)` merging each window afresh. Summaries merge associatively
/// (counts and sketch bins add, extremes and first/last compare), so the answer is the
/// window's merge.
pub(super) struct Sliding<'a> {
    pub(super) items: &'a [Summary],
    /// The window is `[lo, hi)`; the front covers `[lo, mid)`, the back `[mid, hi)`.
    pub(super) lo: usize,
    pub(super) mid: usize,
    pub(super) hi: usize,
    /// `front[k]` merges `items[lo + (len - 1 - k) .. mid]`: its top merges the whole front.
    pub(super) front: Vec<Summary>,
    pub(super) back: Option<Summary>,
}

impl<'a> Sliding<'a> {
    pub(super) fn new(items: &'a [Summary]) -> Sliding<'a> {
        Sliding {
            items,
            lo: 0,
            mid: 0,
            hi: 0,
            front: Vec::new(),
            back: None,
        }
    }

    /// The merge of `items[a..b]`, for windows given in order (`a` and `b` never smaller than
    /// the last call's); `None` for an empty window.
    pub(super) fn over(&mut self, (a, b): (usize, usize)) -> Option<Summary> {
        let (a, b) = (a.max(self.lo), b.max(self.hi));
        if a >= self.hi {
            // Past everything held: start again at `a`.
            self.lo = a;
            self.mid = a;
            self.hi = a;
            self.front.clear();
            self.back = None;
        }
        for item in &self.items[self.hi..b] {
            match &mut self.back {
                Some(m) => m.merge(item),
                None => self.back = Some(item.clone()),
            }
        }
        self.hi = b;
        while self.lo < a {
            if self.lo == self.mid {
                // The front is used up: the back becomes it, merged from its end.
                self.front.clear();
                let mut acc: Option<Summary> = None;
                for item in self.items[self.mid..self.hi].iter().rev() {
                    let mut m = item.clone();
                    if let Some(after) = &acc {
                        m.merge(after);
                    }
                    self.front.push(m.clone());
                    acc = Some(m);
                }
                self.mid = self.hi;
                self.back = None;
            }
            self.front.pop();
            self.lo += 1;
        }
        match (self.front.last(), &self.back) {
            (Some(f), Some(b)) => {
                let mut m = f.clone();
                m.merge(b);
                Some(m)
            }
            (Some(f), None) => Some(f.clone()),
            (None, Some(b)) => Some(b.clone()),
            (None, None) => None,
        }
    }
}

/// One series' raw readings for exact windows: the readings (ms, value) of whole buckets, in
/// time order, and which of those buckets hold every reading their bucket counts (a bucket
/// past `store.raw_retention` has lost its raw pages; a central's buckets, merged from deltas,
/// never had any).
pub(super) struct Exact {
    pub(super) readings: Vec<(i64, f64)>,
    /// The start (ms) of the first bucket read, and the bucket width (ms).
    pub(super) first: i64,
    pub(super) width: i64,
    /// `incomplete[k]`: how many of the buckets before bucket `k` (from `first`) miss readings.
    pub(super) incomplete: Vec<u32>,
}

impl Exact {
    /// The readings of `[from, to]` (ms, both included: Prometheus 2.x's range), if every
    /// bucket the window touches holds all its readings.
    pub(super) fn window(&self, from: i64, to: i64) -> Option<&[(i64, f64)]> {
        let index = |t: i64| {
            usize::try_from(bucket_of(t, self.width).checked_sub(self.first)? / self.width).ok()
        };
        let (a, b) = (index(from)?, index(to)?.checked_add(1)?);
        if b >= self.incomplete.len() || self.incomplete[b] != self.incomplete[a] {
            return None;
        }
        let lo = self.readings.partition_point(|r| r.0 < from);
        let hi = self.readings.partition_point(|r| r.0 <= to);
        Some(&self.readings[lo..hi.max(lo)])
    }
}

#[cfg(test)]
mod sliding_tests {
    use super::*;

    /// The sliding window's merge is the window's merge, for windows that move forward by
    /// any steps, grow, shrink, empty and jump (issue 53), compared with merging each window
    /// afresh: counts and extremes exactly, totals to rounding, quantiles exactly (the
    /// sketches' bins add in any order).
    #[test]
    fn a_sliding_window_merges_what_each_window_holds() {
        let mut next = crate::test_rng::below(0x9E37_79B9_7F4A_7C15);
        for round in 0..200 {
            let items: Vec<Summary> = (0..=next(60))
                .map(|i| {
                    let mut s = Summary::of(i as i64, next(1000) as f64 / 7.0);
                    for k in 0..next(5) {
                        s.merge(&Summary::of(i as i64 + k as i64, next(1000) as f64 - 500.0));
                    }
                    s
                })
                .collect();
            let n = items.len();
            let mut window = Sliding::new(&items);
            let (mut a, mut b) = (0usize, 0usize);
            for _ in 0..40 {
                b = (b + next(6) as usize).min(n);
                a = (a + next(5) as usize).min(b);
                let got = window.over((a, b));
                let want = items[a..b].iter().cloned().reduce(|mut m, s| {
                    m.merge(&s);
                    m
                });
                match (got, want) {
                    (None, None) => {}
                    (Some(g), Some(w)) => {
                        let case = format!("round {round}, window {a}..{b}");
                        assert_eq!((g.count, g.min, g.max), (w.count, w.min, w.max), "{case}");
                        assert!(
                            (g.total() - w.total()).abs() <= 1e-9 * w.total().abs().max(1.0),
                            "{case}"
                        );
                        for q in [0.0, 0.5, 0.99] {
                            assert_eq!(g.quantile(q), w.quantile(q), "{case} q {q}");
                        }
                    }
                    (g, w) => panic!("round {round}, window {a}..{b}: {g:?} against {w:?}"),
                }
            }
        }
    }
}
