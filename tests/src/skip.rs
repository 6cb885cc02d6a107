//! A test that cannot run here says so where the output shows it, and where CI counts it.
//!
//! libtest captures what a test prints with `print!`/`eprint!` and shows it only when the
//! test fails, so a passing test's `println!("SKIPPED ...")` never reaches the output. A
//! write to the stderr handle itself is not captured: [`skip`] writes there, and appends
//! the same line to the file [`SKIP_LOG_ENV`] names, if any (`.ci/run` sets it, prints
//! the skips after the tests and fails a run as root that skipped a namespace test).
//!
//! A test that needs an optional peer tool that CI does not install (torch's `torchrun`,
//! about 4 GB) skips through [`skip_optional`]: its line starts with [`OPTIONAL`], which
//! `.ci/run` prints and does not count against a run as root.

use std::io::Write;

/// Names a file to which every [`skip`] appends one line, `<test>: <reason>`.
pub const SKIP_LOG_ENV: &str = "SHARDLINE_SKIP_LOG";

/// The prefix of an optional tool's skip in the log.
pub const OPTIONAL: &str = "optional: ";

/// Reports that `test` is skipped because an optional tool is missing: `SKIPPED (optional)
/// <test>: <reason>` on stderr, and `optional: <test>: <reason>` in the log.
pub fn skip_optional(test: &str, reason: &str) {
    log_skip(test, reason, OPTIONAL, "SKIPPED (optional) ");
}

/// Reports that `test` is skipped because of `reason`: `SKIPPED <test>: <reason>` on
/// stderr (not captured by libtest, so shown for a passing test too), and the same line
/// less the prefix appended to the [`SKIP_LOG_ENV`] file when that variable is set.
///
/// Panics when the log cannot be written: a skip that CI would not count must not pass.
pub fn skip(test: &str, reason: &str) {
    log_skip(test, reason, "", "SKIPPED ");
}

fn log_skip(test: &str, reason: &str, tag: &str, shown: &str) {
    // One line each, so that the log has one line per skip.
    let reason = reason.split_whitespace().collect::<Vec<_>>().join(" ");
    let line = format!("{tag}{test}: {reason}\n");
    let _ = std::io::stderr().write_all(format!("{shown}{test}: {reason}\n").as_bytes());
    let Some(path) = std::env::var_os(SKIP_LOG_ENV).filter(|p| !p.is_empty()) else {
        return;
    };
    // One `write` to a file opened for appending: lines of concurrent tests and processes
    // do not interleave.
    let logged = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut f| f.write_all(line.as_bytes()));
    if let Err(e) = logged {
        panic!("{test} is skipped ({reason}) but {SKIP_LOG_ENV}={path:?} cannot take it: {e}");
    }
}
