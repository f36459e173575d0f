//! Reading a Prometheus text exposition, shared by the tests and the benchmarks through
//! `#[path]`.

/// The sum of every sample of metric `name` (all label sets) in the Prometheus text.
pub fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(name)?;
            let value = match rest.strip_prefix('{') {
                Some(labelled) => labelled.split_once("} ")?.1,
                None => rest.strip_prefix(' ')?,
            };
            value.parse::<f64>().ok()
        })
        .sum()
}
