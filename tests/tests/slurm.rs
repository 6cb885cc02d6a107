//! `srun` starts a Shardline job with no rendezvous variable: each task of the step is one
//! rank, rank 0 hosts the store on the step's first node at the port derived from the job id
//! (SLURM-1), and the job trains exactly as `shardline train --world 2` does in one process.
//!
//! Needs `srun` and a running Slurm cluster (`.ci/slurm-cluster.sh` starts one on this
//! machine, as root); without them the test says so and records a skip
//! (`shardline_tests::skip`), which `.ci/run` counts.

use shardline_tests::launch::{job_figures, shardline, small_train_args, JOB_FIGURES};
use shardline_tests::process::Child;
use shardline_tests::skip::skip;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// How long the `srun` job may take before it is cancelled and the test fails.
const SRUN_DEADLINE: Duration = Duration::from_secs(120);

/// Launch variables of every convention: neither run may see one from the caller, so that
/// the in-process run stays in-process and the Slurm workers find the store by SLURM-1.
const LAUNCH_VARS: [&str; 12] = [
    "SHARDLINE_RDZV",
    "SHARDLINE_RANK",
    "SHARDLINE_WORLD_SIZE",
    "SHARDLINE_JOB",
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
];

/// Runs `cmd` to completion within `limit`; `None` when it cannot be started or does not
/// finish in time.
fn output_within(mut cmd: Command, what: &str, limit: Duration) -> Option<Output> {
    for v in LAUNCH_VARS {
        cmd.env_remove(v);
    }
    let child = Child::spawn(cmd, what).ok()?;
    child.wait_output(Instant::now() + limit).ok()
}

/// This machine's short host name: Slurm's name for it in a cluster of this machine.
fn this_host() -> String {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    name.trim().split('.').next().unwrap_or_default().to_owned()
}

/// Why no Slurm job can run on this machine, if none can: `srun` missing, or no node of
/// this name taking jobs. A cluster elsewhere (a login node's) does not count: the test
/// must not queue a job on other machines.
fn no_cluster(host: &str) -> Option<String> {
    const START: &str = "as root, .ci/slurm-cluster.sh starts a one-node cluster on this machine";
    let mut sinfo = Command::new("sinfo");
    sinfo.args(["-h", "-N", "-o", "%N %a %T"]);
    let Some(out) = output_within(sinfo, "sinfo", Duration::from_secs(20)) else {
        return Some(format!("no Slurm here: `sinfo` cannot run or does not answer; {START}"));
    };
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let ready = text.lines().any(|l| {
        let w: Vec<&str> = l.split_whitespace().collect();
        w.len() == 3
            && w[0] == host
            && w[1] == "up"
            && ["idle", "mixed", "allocated"].iter().any(|k| w[2].starts_with(k))
    });
    if !out.status.success() || !ready {
        return Some(format!(
            "no Slurm node {host} (this machine) takes jobs (`sinfo`: {} {}); {START}",
            text.trim(),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    let mut version = Command::new("srun");
    version.arg("--version");
    match output_within(version, "srun --version", Duration::from_secs(20)) {
        Some(o) if o.status.success() => None,
        _ => Some(format!("`srun` is missing or does not run; {START}")),
    }
}

fn show(o: &Output) -> String {
    format!(
        "{}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// SLURM-1: `srun -n 2 shardline train` with only `SHARDLINE_TOKEN` set runs the same steps
/// as the in-process run, bitwise.
#[test]
fn srun_job_without_rendezvous_variables_matches_in_process() {
    const TEST: &str = "slurm::srun_job_without_rendezvous_variables_matches_in_process";
    let host = this_host();
    if let Some(why) = no_cluster(&host) {
        skip(TEST, &why);
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let train = small_train_args(4);
    let local = dir.path().join("local.jsonl");
    let slurm = dir.path().join("slurm.jsonl");

    let mut one = Command::new(shardline());
    one.args(&train).args(["--world", "2", "--log-json"]).arg(&local);
    let o = output_within(one, "shardline train --world 2", Duration::from_secs(120))
        .expect("the in-process run finishes within 120 s");
    assert!(o.status.success(), "in-process run failed: {}", show(&o));

    // A name of its own, to cancel the job should srun outlive the deadline.
    let name = format!("shardline-slurm-test-{}", std::process::id());
    let mut srun = Command::new("srun");
    srun.args(["-N1", "-n2", "--overcommit", "--mpi=none", "--kill-on-bad-exit=1", "--time=3"])
        .args(["--nodelist", &host, "--job-name", &name, "--chdir"])
        .arg(dir.path())
        .arg(shardline())
        .args(&train)
        .arg("--log-json")
        .arg(&slurm)
        .env("SHARDLINE_TOKEN", "slurm-test-token");
    for v in LAUNCH_VARS {
        srun.env_remove(v);
    }
    let started = Instant::now();
    let child = Child::spawn(srun, "srun shardline train").expect("srun starts");
    let out = match child.wait_output(started + SRUN_DEADLINE) {
        Ok(o) => o,
        Err(e) => {
            let _ = Command::new("scancel").args(["--name", &name]).status();
            panic!("srun did not finish within {SRUN_DEADLINE:?} (job cancelled): {e}");
        }
    };
    assert!(out.status.success(), "srun job failed: {}", show(&out));

    let (la, lb) = (job_figures(&local), job_figures(&slurm));
    assert_eq!(la.len(), 4, "one line per step in one process");
    assert_eq!(lb.len(), 4, "one line per step under srun (rank 0 writes the log)");
    for (i, (x, y)) in la.iter().zip(&lb).enumerate() {
        assert_eq!(
            x,
            y,
            "step {}: {JOB_FIGURES:?} in one process, under srun\n{}",
            i + 1,
            show(&out)
        );
    }
}
