//! What torchrun expects of a worker beyond its environment: a failing worker writes its
//! error to `TORCHELASTIC_ERROR_FILE`, which torchrun prints in its failure summary (instead
//! of "error_file: <N/A>") and uses to name the first failure of the group.

use std::path::PathBuf;

/// The JSON torch's `@record` writes (`ErrorHandler.record_exception`, torch 2.15): the
/// message and a timestamp in Unix seconds. torchrun prints `py_callstack` as the failure's
/// "traceback"; there is no Python stack, so it carries the message too.
pub fn error_file_json(message: &str, unix_s: u64) -> String {
    serde_json::json!({
        "message": {
            "message": message,
            "extraInfo": { "py_callstack": message, "timestamp": unix_s.to_string() },
        }
    })
    .to_string()
}

/// Writes `message` to the file `TORCHELASTIC_ERROR_FILE` names, when it is set; returns the
/// path written. A failure to write is not reported: the message also goes to stderr.
pub fn record_error(message: &str) -> Option<PathBuf> {
    let path = PathBuf::from(std::env::var_os("TORCHELASTIC_ERROR_FILE")?);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    std::fs::write(&path, error_file_json(message, now)).ok().map(|_| path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_error_file_has_the_fields_torchrun_reads() {
        // torchrun reads message.message, and message.extraInfo.timestamp as an integer.
        let v: serde_json::Value = serde_json::from_str(&error_file_json(
            "rank 1: timeout on lane 'grads'",
            1_700_000_000,
        ))
        .unwrap();
        assert_eq!(v["message"]["message"], "rank 1: timeout on lane 'grads'");
        assert_eq!(v["message"]["extraInfo"]["py_callstack"], "rank 1: timeout on lane 'grads'");
        let ts: i64 = v["message"]["extraInfo"]["timestamp"].as_str().unwrap().parse().unwrap();
        assert_eq!(ts, 1_700_000_000);
    }
}
