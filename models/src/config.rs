//! Tunables of the models crate, each with its default and environment variable.

/// Threads per matrix multiply of the CPU backend. Default 1: in data-parallel training the
/// ranks are the parallelism. Environment: `SHARDLINE_CPU_THREADS`.
pub const CPU_THREADS_ENV: &str = "SHARDLINE_CPU_THREADS";

/// Threads per matrix multiply: `SHARDLINE_CPU_THREADS` when it holds a positive integer,
/// else 1.
pub fn cpu_threads() -> usize {
    parse_threads(std::env::var(CPU_THREADS_ENV).ok().as_deref())
}

fn parse_threads(v: Option<&str>) -> usize {
    v.and_then(|s| s.trim().parse::<usize>().ok()).filter(|&n| n > 0).unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thread_setting_defaults_to_one() {
        assert_eq!(parse_threads(None), 1);
        assert_eq!(parse_threads(Some("0")), 1);
        assert_eq!(parse_threads(Some("x")), 1);
        assert_eq!(parse_threads(Some(" 4 ")), 4);
    }
}
