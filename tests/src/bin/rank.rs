//! A rank process for multi-process tests (in progress).
fn main() {}
