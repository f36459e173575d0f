//! Test support: a small deterministic random source (xorshift64), for the randomised tests
//! that must replay the same run from a seed.

/// Draws below `n` (`n > 0`) from a xorshift64 sequence started at `seed` (not 0).
pub fn below(seed: u64) -> impl FnMut(u64) -> u64 {
    let mut rng = seed;
    move |n| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    }
}
