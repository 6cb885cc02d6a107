//! shardline-bench (in progress)
fn main() {}
