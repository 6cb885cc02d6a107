//! What a Slurm job step tells a worker without any Shardline variable: where rank 0 hosts
//! the store and how many tasks run on this node. Pure functions of the variables.
//!
//! Invariants:
//! - SLURM-1: the store address of a Slurm worker is `SHARDLINE_RDZV` when set, else
//!   `MASTER_ADDR:MASTER_PORT` when both are set, else derived from the job: the first host
//!   of `SLURM_STEP_NODELIST` (else `SLURM_JOB_NODELIST`, else `SLURM_NODELIST`) and the port
//!   15000 + the last four digits of `SLURM_JOB_ID` (the rule of PyTorch Lightning's
//!   `SLURMEnvironment`); every rank of a step reads the same variables, so all derive the
//!   same address, and rank 0 (on the step's first node) hosts the store there.
//! - SLURM-2: [`first_host`] is the first host name the Slurm host list expands to:
//!   comma- or space-separated entries, each literal text with bracket groups of
//!   comma-separated numbers or `lo-hi` ranges (zero padding kept as written); a list that
//!   does not follow this grammar, or a job id that is not a number, is a configuration
//!   error that names the variable.
//! - SLURM-3: the local world is this node's entry (`SLURM_NODEID`) of
//!   `SLURM_STEP_TASKS_PER_NODE` (else `SLURM_TASKS_PER_NODE`; `2(x3),1` is 2, 2, 2, 1), else
//!   `SLURM_NTASKS_PER_NODE`, else unknown (0).
//!
//! The step's node list comes first: the ranks (`SLURM_PROCID`) and nodes (`SLURM_NODEID`)
//! of `srun` are numbered within the step, whose first node holds task 0 (block and cyclic
//! distributions), while a step inside a larger allocation need not run on the job's first
//! node.

use crate::error::{Result, RuntimeError};

/// Node list variables, most specific first (SLURM-1).
pub const NODELIST_VARS: [&str; 3] =
    ["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"];

/// Tasks-per-node variables, most specific first (SLURM-3).
const TASKS_PER_NODE_VARS: [&str; 2] = ["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"];

/// The lowest port [`store_port`] derives.
pub const PORT_BASE: u16 = 15000;

/// The store address of a Slurm worker (SLURM-1), `HOST:PORT`. Empty variables count as
/// unset.
pub fn store_address(get: &dyn Fn(&str) -> Option<String>) -> Result<String> {
    let set = |name: &str| get(name).filter(|v| !v.trim().is_empty());
    if let Some(rdzv) = set("SHARDLINE_RDZV") {
        return Ok(rdzv.trim().to_owned());
    }
    if let (Some(addr), Some(port)) = (set("MASTER_ADDR"), set("MASTER_PORT")) {
        return Ok(format!("{}:{}", addr.trim(), port.trim()));
    }
    let own = "; or set SHARDLINE_RDZV=HOST:PORT (or MASTER_ADDR and MASTER_PORT) for the store";
    let (var, list) =
        NODELIST_VARS.iter().find_map(|&v| set(v).map(|l| (v, l))).ok_or_else(|| {
            RuntimeError::config(format!(
                "Slurm environment without {}: cannot derive the store's host{own}",
                NODELIST_VARS.join(", ")
            ))
        })?;
    let host = first_host(&list).map_err(|why| {
        RuntimeError::config(format!("{var}={list:?} is not a Slurm host list: {why}{own}"))
    })?;
    let job = set("SLURM_JOB_ID").ok_or_else(|| {
        RuntimeError::config(format!(
            "Slurm environment without SLURM_JOB_ID: cannot derive the store's port{own}"
        ))
    })?;
    let port = store_port(&job)
        .map_err(|why| RuntimeError::config(format!("SLURM_JOB_ID={job:?}: {why}{own}")))?;
    Ok(format!("{host}:{port}"))
}

/// The local world of a Slurm worker (SLURM-3); `None` when no variable gives it.
pub fn local_world(get: &dyn Fn(&str) -> Option<String>) -> Result<Option<usize>> {
    let set = |name: &str| get(name).filter(|v| !v.trim().is_empty());
    if let Some((var, v)) = TASKS_PER_NODE_VARS.iter().find_map(|&n| set(n).map(|v| (n, v))) {
        let node = match set("SLURM_NODEID") {
            None => 0,
            Some(id) => id.trim().parse::<usize>().map_err(|_| {
                RuntimeError::config(format!("SLURM_NODEID={id:?} is not a non-negative integer"))
            })?,
        };
        return tasks_on_node(&v, node)
            .map(Some)
            .map_err(|why| RuntimeError::config(format!("{var}={v:?}: {why}")));
    }
    match set("SLURM_NTASKS_PER_NODE") {
        None => Ok(None),
        Some(v) => v.trim().parse::<usize>().map(Some).map_err(|_| {
            RuntimeError::config(format!(
                "SLURM_NTASKS_PER_NODE={v:?} is not a non-negative integer"
            ))
        }),
    }
}

/// The store port of Slurm job `job_id` (SLURM-1): 15000 + its last four digits, as PyTorch
/// Lightning derives `MASTER_PORT` (`1234567` -> 19567, `42` -> 15042).
pub fn store_port(job_id: &str) -> std::result::Result<u16, String> {
    let id = job_id.trim();
    if id.is_empty() || !id.bytes().all(|b| b.is_ascii_digit()) {
        return Err("not a job number (decimal digits)".into());
    }
    let last4 = &id[id.len().saturating_sub(4)..];
    let n: u16 = last4.parse().map_err(|_| "not a job number".to_string())?;
    Ok(PORT_BASE + n)
}

/// Splits `list` at the commas and white space outside brackets; an unbalanced bracket is an
/// error.
fn entries(list: &str) -> std::result::Result<Vec<&str>, String> {
    let mut out = Vec::new();
    let (mut start, mut open) = (0, false);
    for (i, c) in list.char_indices() {
        match c {
            '[' if open => return Err(format!("'[' inside brackets at byte {i}")),
            '[' => open = true,
            ']' if !open => return Err(format!("']' without '[' at byte {i}")),
            ']' => open = false,
            c if !open && (c == ',' || c.is_whitespace()) => {
                if i > start {
                    out.push(&list[start..i]);
                }
                start = i + c.len_utf8();
            }
            _ => {}
        }
    }
    if open {
        return Err("'[' without ']'".into());
    }
    if list.len() > start {
        out.push(&list[start..]);
    }
    Ok(out)
}

/// The first host of one entry (`gpu-[007-010,12]` -> `gpu-007`), after checking every bracket
/// group of it.
fn first_of_entry(entry: &str) -> std::result::Result<String, String> {
    let mut host = String::new();
    let mut rest = entry;
    while let Some(open) = rest.find('[') {
        host.push_str(&rest[..open]);
        let close = rest[open..].find(']').map(|c| open + c).ok_or("'[' without ']'")?;
        let group = &rest[open + 1..close];
        let mut first = None;
        for range in group.split(',') {
            let (lo, hi) = range.split_once('-').unwrap_or((range, range));
            let number = |s: &str| -> std::result::Result<u64, String> {
                if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
                    return Err(format!("[{group}]: {range:?} is not a number or a range lo-hi"));
                }
                s.parse().map_err(|_| format!("[{group}]: {s} is too large"))
            };
            if number(lo)? > number(hi)? {
                return Err(format!("[{group}]: the range {range} decreases"));
            }
            first.get_or_insert(lo);
        }
        host.push_str(first.unwrap_or_default());
        rest = &rest[close + 1..];
    }
    if rest.contains(']') {
        return Err("']' without '['".into());
    }
    host.push_str(rest);
    Ok(host)
}

/// The first host of Slurm host list `list` (SLURM-2): `gpu-[007-010,12],cpu3` -> `gpu-007`,
/// `node1` -> `node1`, `rack[2-3]-n[1-4]` -> `rack2-n1`. Every entry is checked.
pub fn first_host(list: &str) -> std::result::Result<String, String> {
    let mut hosts = entries(list)?.into_iter().map(first_of_entry);
    let first = hosts.next().ok_or("no host")??;
    for h in hosts {
        h?;
    }
    Ok(first)
}

/// The tasks on node `node` (0-based, the step's order) from a Slurm tasks-per-node value
/// (SLURM-3): comma-separated counts, `N(xM)` standing for M nodes with N tasks each.
pub fn tasks_on_node(value: &str, node: usize) -> std::result::Result<usize, String> {
    let mut seen = 0usize;
    for item in value.trim().split(',') {
        let bad = || format!("{item:?} is neither N nor N(xM)");
        let (n, times) = match item.split_once("(x") {
            None => (item, "1"),
            Some((n, t)) => (n, t.strip_suffix(')').ok_or_else(bad)?),
        };
        let n: usize = n.parse().map_err(|_| bad())?;
        let times: usize = times.parse().map_err(|_| bad())?;
        seen = seen.saturating_add(times);
        if node < seen {
            return Ok(n);
        }
    }
    Err(format!("no entry for node {node} (SLURM_NODEID): it lists {seen} node(s)"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    fn vars(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    fn address(pairs: &[(&str, &str)]) -> Result<String> {
        let m = vars(pairs);
        store_address(&|k| m.get(k).cloned())
    }

    /// SLURM-2
    #[test]
    fn first_host_of_hostlists() {
        for (list, first) in [
            ("node1", "node1"),
            ("gpu-[007-010,12],cpu3", "gpu-007"),
            ("gpu-[12,007-010]", "gpu-12"),
            ("cpu3,gpu-[007-010,12]", "cpu3"),
            ("n[0]", "n0"),
            ("n[00-15]", "n00"),
            ("rack[2-3]-n[1-4]", "rack2-n1"),
            ("n[1-2]-ib", "n1-ib"),
            ("  a1 a2 ", "a1"),
            ("a1,,a2", "a1"),
            ("host.example.org", "host.example.org"),
            ("[3-4]", "3"),
        ] {
            assert_eq!(first_host(list).as_deref(), Ok(first), "{list}");
        }
    }

    /// SLURM-2
    #[test]
    fn malformed_hostlists_are_refused() {
        for list in [
            "",
            " , ",
            "gpu-[1-2",
            "gpu-1]",
            "gpu-[]",
            "gpu-[a-b]",
            "gpu-[3-1]",
            "gpu-[1-]",
            "gpu-[-1]",
            "a[1-2],b[1",
            "a[[1]]",
            "a[1,,2]",
            "n[99999999999999999999]",
        ] {
            assert!(first_host(list).is_err(), "{list:?} accepted as {:?}", first_host(list));
        }
    }

    /// SLURM-1
    #[test]
    fn store_port_is_lightnings() {
        assert_eq!(store_port("1"), Ok(15001));
        assert_eq!(store_port("42"), Ok(15042));
        assert_eq!(store_port("9999"), Ok(24999));
        assert_eq!(store_port("10000"), Ok(15000));
        assert_eq!(store_port("1234567"), Ok(19567));
        assert_eq!(store_port("0042"), Ok(15042));
        assert_eq!(store_port(" 12345\n"), Ok(17345));
        for bad in ["", "12a", "-5", "1_000", "12345_1", "+5"] {
            assert!(store_port(bad).is_err(), "{bad:?}");
        }
    }

    /// SLURM-1
    #[test]
    fn store_address_precedence() {
        let job = [("SLURM_JOB_NODELIST", "gpu-[007-010,12],cpu3"), ("SLURM_JOB_ID", "123456")];
        assert_eq!(address(&job).unwrap(), "gpu-007:18456");
        let mut step = job.to_vec();
        step.push(("SLURM_STEP_NODELIST", "gpu-[009-010]"));
        assert_eq!(address(&step).unwrap(), "gpu-009:18456", "the step's nodes come first");
        assert_eq!(
            address(&[("SLURM_NODELIST", "n1"), ("SLURM_JOB_ID", "7")]).unwrap(),
            "n1:15007"
        );
        let mut m = job.to_vec();
        m.push(("MASTER_ADDR", "10.0.0.1"));
        assert_eq!(address(&m).unwrap(), "gpu-007:18456", "MASTER_ADDR alone is not used");
        m.push(("MASTER_PORT", "29500"));
        assert_eq!(address(&m).unwrap(), "10.0.0.1:29500");
        m.push(("SHARDLINE_RDZV", "store:1234"));
        assert_eq!(address(&m).unwrap(), "store:1234");
        m.push(("SLURM_JOB_ID", "not-a-number"));
        assert_eq!(address(&m).unwrap(), "store:1234", "nothing derived when not needed");
        let mut empty = job.to_vec();
        empty.extend([("SHARDLINE_RDZV", ""), ("MASTER_ADDR", " "), ("MASTER_PORT", "1")]);
        assert_eq!(address(&empty).unwrap(), "gpu-007:18456", "empty counts as unset");
    }

    /// SLURM-1, SLURM-2
    #[test]
    fn store_address_errors_name_the_variable() {
        let err = |pairs: &[(&str, &str)]| address(pairs).unwrap_err().to_string();
        let e = err(&[("SLURM_JOB_NODELIST", "gpu-[1-"), ("SLURM_JOB_ID", "5")]);
        assert!(
            e.contains("SLURM_JOB_NODELIST=\"gpu-[1-\"") && e.contains("SHARDLINE_RDZV"),
            "{e}"
        );
        let e = err(&[("SLURM_JOB_NODELIST", "gpu1"), ("SLURM_JOB_ID", "5x")]);
        assert!(e.contains("SLURM_JOB_ID=\"5x\"") && e.contains("SHARDLINE_RDZV"), "{e}");
        let e = err(&[("SLURM_JOB_NODELIST", "gpu1")]);
        assert!(e.contains("without SLURM_JOB_ID"), "{e}");
        let e = err(&[("SLURM_JOB_ID", "5")]);
        assert!(e.contains("SLURM_STEP_NODELIST") && e.contains("SLURM_JOB_NODELIST"), "{e}");
        let e = err(&[
            ("SLURM_STEP_NODELIST", "a]"),
            ("SLURM_JOB_NODELIST", "b"),
            ("SLURM_JOB_ID", "5"),
        ]);
        assert!(e.contains("SLURM_STEP_NODELIST=\"a]\""), "{e}");
    }

    /// SLURM-3
    #[test]
    fn local_world_from_tasks_per_node() {
        assert_eq!(tasks_on_node("2", 0), Ok(2));
        assert_eq!(tasks_on_node("2(x3),1", 2), Ok(2));
        assert_eq!(tasks_on_node("2(x3),1", 3), Ok(1));
        assert_eq!(tasks_on_node("4,3(x2)", 0), Ok(4));
        assert_eq!(tasks_on_node("4,3(x2)", 2), Ok(3));
        assert!(tasks_on_node("2(x3),1", 4).is_err());
        for bad in ["", "x", "2(x)", "2(x3", "2(3)", "-1"] {
            assert!(tasks_on_node(bad, 0).is_err(), "{bad:?}");
        }
        let lw = |pairs: &[(&str, &str)]| {
            let m = vars(pairs);
            local_world(&|k| m.get(k).cloned())
        };
        assert_eq!(lw(&[]).unwrap(), None);
        assert_eq!(lw(&[("SLURM_NTASKS_PER_NODE", "4")]).unwrap(), Some(4));
        assert_eq!(
            lw(&[("SLURM_TASKS_PER_NODE", "4(x2),1"), ("SLURM_NODEID", "2")]).unwrap(),
            Some(1)
        );
        assert_eq!(
            lw(&[
                ("SLURM_STEP_TASKS_PER_NODE", "2,1"),
                ("SLURM_TASKS_PER_NODE", "4(x2)"),
                ("SLURM_NTASKS_PER_NODE", "4"),
                ("SLURM_NODEID", "1"),
            ])
            .unwrap(),
            Some(1),
            "the step's layout comes first"
        );
        let e = lw(&[("SLURM_TASKS_PER_NODE", "2(x"), ("SLURM_NODEID", "0")]).unwrap_err();
        assert!(e.to_string().contains("SLURM_TASKS_PER_NODE"), "{e}");
    }

    /// SLURM-1, SLURM-3: what `srun -n 2` gives a task (Slurm 22.05), with `SHARDLINE_TOKEN`,
    /// is a whole launch environment; the token stays required.
    #[test]
    fn worker_env_from_srun_variables_alone() {
        let mut pairs = vec![
            ("SLURM_JOB_ID", "1"),
            ("SLURM_JOB_NODELIST", "vm"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NNODES", "1"),
            ("SLURM_NODEID", "0"),
            ("SLURM_NODELIST", "vm"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_PROCID", "1"),
            ("SLURM_STEP_NODELIST", "vm"),
            ("SLURM_STEP_TASKS_PER_NODE", "2"),
            ("SLURM_TASKS_PER_NODE", "2"),
        ];
        let env = |p: &[(&str, &str)]| {
            let m = vars(p);
            crate::launch::WorkerEnv::from_vars(&|k| m.get(k).cloned())
        };
        let e = env(&pairs).unwrap_err().to_string();
        assert!(e.contains("SHARDLINE_TOKEN"), "{e}");
        pairs.push(("SHARDLINE_TOKEN", "t"));
        let w = env(&pairs).unwrap().expect("a launch environment");
        assert_eq!(
            (w.rank, w.world, w.local_rank, w.local_world, w.node.as_str()),
            (1, 2, 1, 2, "0")
        );
        assert_eq!(
            (w.rdzv.as_str(), w.store, w.source),
            ("vm:15001", super::super::StoreAt::Connect, "slurm")
        );
        pairs[7] = ("SLURM_PROCID", "0");
        let rank0 = env(&pairs).unwrap().expect("a launch environment");
        assert_eq!(rank0.store, super::super::StoreAt::Host, "rank 0 hosts");
    }

    /// One host list entry as Slurm writes it: a prefix, then ranges of zero-padded numbers.
    fn entry() -> impl Strategy<Value = (String, Vec<(u32, u32)>, usize)> {
        ("[a-z][a-z0-9-]{0,6}", proptest::collection::vec((0u32..200, 0u32..20), 0..4), 0usize..4)
    }

    proptest! {
        /// SLURM-2: a list built from hosts expands to those hosts, the first one first.
        #[test]
        fn first_host_is_the_first_written(entries in proptest::collection::vec(entry(), 1..5)) {
            let pad = |n: u32, w: usize| format!("{n:0w$}");
            let mut text = Vec::new();
            let mut expect = None;
            for (prefix, ranges, width) in &entries {
                if ranges.is_empty() {
                    text.push(prefix.clone());
                    expect.get_or_insert(prefix.clone());
                    continue;
                }
                let parts: Vec<String> = ranges
                    .iter()
                    .map(|&(lo, len)| match len {
                        0 => pad(lo, *width),
                        _ => format!("{}-{}", pad(lo, *width), pad(lo + len, *width)),
                    })
                    .collect();
                text.push(format!("{prefix}[{}]", parts.join(",")));
                expect.get_or_insert(format!("{prefix}{}", pad(ranges[0].0, *width)));
            }
            let list = text.join(",");
            prop_assert_eq!(first_host(&list), Ok(expect.unwrap_or_default()));
        }

        /// SLURM-1: any job number gives a port in 15000..=24999 that depends on its last
        /// four digits alone.
        #[test]
        fn store_port_range(id in 0u64..u64::MAX) {
            let port = store_port(&id.to_string()).unwrap();
            prop_assert_eq!(u64::from(port), 15000 + id % 10000);
        }
    }
}
