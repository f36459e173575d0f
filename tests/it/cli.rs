//! The `bucketd` binary. (Filled in below.)
