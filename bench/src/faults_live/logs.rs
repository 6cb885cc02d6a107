//! What the campaign reads from a run's logs, as pure functions of their text: the step log
//! (LIVEB-2) and the recovery time (LIVEB-3).

use serde::Serialize;

/// The `unix_ms=` value of a line (agents' and workers' fault and recovery lines carry it).
pub fn unix_ms(line: &str) -> Option<u128> {
    let v = line.split("unix_ms=").nth(1)?;
    v.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
}

/// When a worker's own fault fired: its `fault injected: kill|stall` line.
pub fn injected_ms(output: &str) -> Option<u128> {
    output.lines().filter(|l| l.contains("shardline worker: fault injected: ")).find_map(unix_ms)
}

/// Whether a line is the job reacting to a failure: an agent's `fault:` or `restart N/M:`
/// line, or a worker's `live recovery:` line.
fn is_reaction(line: &str) -> bool {
    let agent = line.starts_with("shardline launch: [")
        && (line.contains("] fault: ") || line.contains("] restart "));
    let worker = line.starts_with("shardline worker: rank ") && line.contains(": live recovery: ");
    agent || worker
}

/// LIVEB-3: the first reaction to a fault at `fault_ms`, at or after it.
pub fn reaction_ms(output: &str, fault_ms: u128) -> Option<u128> {
    output.lines().filter(|l| is_reaction(l)).filter_map(unix_ms).filter(|&t| t >= fault_ms).min()
}

/// LIVEB-3: seconds from the fault to the first step-log line seen (`seen`: step and the
/// harness's Unix ms when it read the line) after the job's first reaction to it.
pub fn recovery_s(fault_ms: u128, reaction: Option<u128>, seen: &[(u64, u128)]) -> Option<f64> {
    let reaction = reaction?;
    let (_, back) = seen.iter().find(|(_, t)| *t > reaction)?;
    Some(back.saturating_sub(fault_ms) as f64 / 1000.0)
}

/// How the job came back: in place, from a checkpoint, both, or neither was needed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Recovered {
    None,
    InPlace,
    Checkpoint,
    Both,
}

/// Which recoveries the output shows: workers `resuming after step` in a new epoch, agents
/// starting a new generation (`restart N/M:`).
pub fn recovered(output: &str) -> Recovered {
    let live = output.lines().any(|l| l.contains(": live recovery: resuming after step "));
    let restart =
        output.lines().any(|l| l.starts_with("shardline launch: [") && l.contains("] restart "));
    match (live, restart) {
        (false, false) => Recovered::None,
        (true, false) => Recovered::InPlace,
        (false, true) => Recovered::Checkpoint,
        (true, true) => Recovered::Both,
    }
}

/// LIVEB-2: what a `--log-json` file says about the run's steps.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct StepLog {
    /// Lines that parse with a step.
    pub lines: u64,
    /// Lines that do not (torn or not JSON).
    pub unreadable: u64,
    /// Steps of `1..=steps` no line holds.
    pub missing: Vec<u64>,
    /// Steps completed more than once: the lines less the distinct steps.
    pub run_again: u64,
}

/// LIVEB-2 over the text of a step log of a `steps`-step run.
pub fn step_log(text: &str, steps: u64) -> StepLog {
    let mut seen = std::collections::BTreeSet::new();
    let mut out = StepLog::default();
    for l in text.lines().filter(|l| !l.trim().is_empty()) {
        match serde_json::from_str::<serde_json::Value>(l).ok().and_then(|v| v["step"].as_u64()) {
            Some(s) => {
                out.lines += 1;
                seen.insert(s);
            }
            None => out.unreadable += 1,
        }
    }
    out.missing = (1..=steps).filter(|s| !seen.contains(s)).collect();
    out.run_again = out.lines - seen.len() as u64;
    out
}

/// The steps of the complete lines of `text` (a step log being written), and the bytes
/// read up to the end of the last complete line. A line a live recovery wrote for a step
/// that committed unlogged (`"recovered": true`, DRIVE-8) is no step trained then: left out.
pub fn complete_steps(text: &str) -> (Vec<u64>, usize) {
    let end = text.rfind('\n').map_or(0, |i| i + 1);
    let steps = text[..end]
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["recovered"] != serde_json::Value::Bool(true))
        .filter_map(|v| v["step"].as_u64())
        .collect();
    (steps, end)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log(steps: &[u64]) -> String {
        steps.iter().map(|s| format!("{{\"loss\":1.0,\"step\":{s}}}\n")).collect()
    }

    #[test]
    fn every_step_once_is_no_loss_liveb_2() {
        let s = step_log(&log(&[1, 2, 3, 4]), 4);
        assert_eq!(s, StepLog { lines: 4, unreadable: 0, missing: vec![], run_again: 0 });
    }

    #[test]
    fn a_restart_runs_steps_again_and_a_gap_is_lost_liveb_2() {
        // Failed in step 6, resumed from the checkpoint of step 4: steps 5 run twice.
        let s = step_log(&log(&[1, 2, 3, 4, 5, 5, 6, 7]), 7);
        assert_eq!((s.run_again, s.missing.len()), (1, 0));
        // A lost tail (what a buffered log left after a SIGKILL) and a torn line.
        let mut text = log(&[1, 2]);
        text.push_str("{\"loss\":1.0,\"st");
        text.push_str(&log(&[6, 7]));
        let s = step_log(&text, 7);
        assert_eq!(s.missing, vec![3, 4, 5, 6], "the torn line swallowed step 6");
        assert_eq!((s.unreadable, s.lines), (1, 3));
    }

    #[test]
    fn recovery_runs_from_the_fault_to_the_first_step_after_the_reaction_liveb_3() {
        let out = "\
shardline worker: fault injected: kill rank 1 at step 10 (backward) unix_ms=1000
shardline launch: [node 1 t=0.1s unix_ms=1040] fault: rank 1 exited with signal 9 (SIGKILL) during step 10 (generation 0): replaced in place, epoch 1 (live recovery, 1/2)
shardline worker: rank 0: live recovery: step 10 failed: ...; joining epoch 1 with the state of step 9 (clean) unix_ms=1020
shardline worker: rank 0: live recovery: resuming after step 9 with rank 0's state (...) unix_ms=1090
";
        let fault = injected_ms(out).expect("fault line");
        assert_eq!(fault, 1000);
        assert_eq!(reaction_ms(out, fault), Some(1020));
        // Step 9's line read after the fault but before the reaction does not count.
        let seen = [(8, 990), (9, 1010), (10, 1100), (11, 1105)];
        assert_eq!(recovery_s(fault, reaction_ms(out, fault), &seen), Some(0.1));
        assert_eq!(recovered(out), Recovered::InPlace);
        // No reaction (nothing failed), or no step after it (the run never trained again).
        assert_eq!(recovery_s(fault, None, &seen), None);
        assert_eq!(recovery_s(fault, Some(2000), &seen), None);
        // A reaction before the fault is another failure's.
        assert_eq!(reaction_ms(out, 1030), Some(1040));
    }

    #[test]
    fn a_restart_is_told_from_a_replacement() {
        let out = "shardline launch: [node 0 t=1.0s unix_ms=5] restart 1/2: generation 1 on node(s) [0, 1, 2, 3] (world 4) resumes from the last checkpoint; the failure was at step 9\n";
        assert_eq!(recovered(out), Recovered::Checkpoint);
        assert_eq!(reaction_ms(out, 0), Some(5));
        assert_eq!(recovered("training\n"), Recovered::None);
    }

    #[test]
    fn only_complete_lines_are_read() {
        let mut text = log(&[1, 2]);
        let whole = text.len();
        text.push_str("{\"step\":3");
        assert_eq!(complete_steps(&text), (vec![1, 2], whole));
        assert_eq!(complete_steps(""), (vec![], 0));
        // A recovered step's line (DRIVE-8) is counted by `step_log`, not as training.
        let text = format!("{}{{\"step\":3,\"recovered\":true}}\n", log(&[1, 2]));
        assert_eq!(complete_steps(&text).0, vec![1, 2]);
        assert!(step_log(&text, 3).missing.is_empty());
    }
}
