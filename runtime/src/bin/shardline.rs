//! `shardline`: the command-line entry point (train, launch, checkpoint).
fn main() {}
