//! Child processes in process groups of their own, with a deadline on every wait: the
//! process-group side of the namespace harness's NETNS-1, NETNS-3 and NETNS-5 (listed in
//! [`crate::netns`]), used for `shardline launch` agents inside or outside namespaces.
//!
//! A [`Child`] is the leader of a new process group (an agent and the workers it starts go
//! together), its output pipes are drained while it runs, and dropping it before it was
//! waited for kills the whole group.

use std::io::Read;
use std::process::{Command, ExitStatus, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::error::{HarnessError, Result};

/// How much of a failed child's stderr its error carries.
const STDERR_TAIL: usize = 4000;

/// The process groups of this process's [`Child`]ren not yet waited for, which a signal must
/// not leave behind (NETNS-5).
static LIVE_GROUPS: Mutex<Vec<u32>> = Mutex::new(Vec::new());

fn live_groups() -> std::sync::MutexGuard<'static, Vec<u32>> {
    LIVE_GROUPS.lock().unwrap_or_else(|e| e.into_inner())
}

/// SIGKILL to every [`Child`] group not yet waited for (NETNS-5); returns how many there were.
pub(crate) fn kill_live_groups() -> usize {
    let groups = live_groups().clone();
    for g in &groups {
        kill_group(*g);
    }
    groups.len()
}

/// A child process in a process group of its own, killed with its whole group when dropped
/// before it was waited for (NETNS-1); waits have deadlines (NETNS-3).
pub struct Child {
    child: Option<std::process::Child>,
    what: String,
}

impl Child {
    /// Spawns `cmd` with stdin closed and stdout and stderr piped, as the leader of a new
    /// process group; `what` names it in errors.
    pub fn spawn(mut cmd: Command, what: &str) -> Result<Child> {
        use std::os::unix::process::CommandExt;
        cmd.stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).process_group(0);
        let child = cmd
            .spawn()
            .map_err(|e| HarnessError::process(format!("spawning {what}"), e.to_string()))?;
        live_groups().push(child.id());
        Ok(Child { child: Some(child), what: what.to_string() })
    }

    /// The process id (also the process group's id), while it was not waited for.
    pub fn id(&self) -> Option<u32> {
        self.child.as_ref().map(std::process::Child::id)
    }

    /// SIGKILL to the child's whole process group, e.g. a node's agent with its workers.
    pub fn kill_group(&self) {
        if let Some(c) = &self.child {
            kill_group(c.id());
        }
    }

    /// Waits until `deadline` and returns the output, whatever the exit status; past the
    /// deadline kills the group and fails with the tail of stderr (NETNS-3).
    pub fn wait_output(mut self, deadline: Instant) -> Result<Output> {
        let what = std::mem::take(&mut self.what);
        let Some(mut child) = self.child.take() else {
            return Err(HarnessError::process(what, "already waited for"));
        };
        let _unregister = Unregister(child.id());
        let out_t = drain(child.stdout.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
        let err_t = drain(child.stderr.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
        let status = loop {
            match child.try_wait() {
                Ok(Some(s)) => break s,
                Ok(None) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                waited => {
                    kill_group(child.id());
                    let _ = child.kill();
                    let _ = child.wait();
                    let err = err_t.join().unwrap_or_default();
                    let why = match waited {
                        Err(e) => format!("waiting failed: {e}"),
                        _ => "did not finish in time".to_string(),
                    };
                    return Err(HarnessError::process(
                        what,
                        format!("{why}; stderr tail:\n{}", tail(&String::from_utf8_lossy(&err))),
                    ));
                }
            }
        };
        let stdout = out_t.join().unwrap_or_default();
        let stderr = err_t.join().unwrap_or_default();
        Ok(Output { status, stdout, stderr })
    }

    /// [`Child::wait_output`], and a non-zero exit is an error too, with the tail of stderr.
    pub fn wait(self, deadline: Instant) -> Result<Output> {
        let what = self.what.clone();
        let out = self.wait_output(deadline)?;
        if !out.status.success() {
            return Err(exit_error(&what, out.status, &out.stderr));
        }
        Ok(out)
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            kill_group(c.id());
            let _ = c.kill();
            let _ = c.wait();
            live_groups().retain(|g| *g != c.id());
        }
    }
}

/// Takes a child's group off the live list once it was waited for (NETNS-5).
struct Unregister(u32);

impl Drop for Unregister {
    fn drop(&mut self) {
        live_groups().retain(|g| *g != self.0);
    }
}

fn exit_error(what: &str, status: ExitStatus, stderr: &[u8]) -> HarnessError {
    HarnessError::process(
        what,
        format!("exited with {status}; stderr tail:\n{}", tail(&String::from_utf8_lossy(stderr))),
    )
}

/// Reads `pipe` to its end on a thread of its own.
fn drain(pipe: Option<Box<dyn Read + Send>>) -> std::thread::JoinHandle<Vec<u8>> {
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(mut p) = pipe {
            let _ = p.read_to_end(&mut buf);
        }
        buf
    })
}

/// SIGKILL to the process group `pid` leads (a [`Child`]'s [`Child::id`]), for a caller
/// whose `Child` waits on another thread.
pub fn kill_group(pid: u32) {
    use nix::sys::signal::{killpg, Signal};
    if let Ok(pid) = i32::try_from(pid) {
        let _ = killpg(nix::unistd::Pid::from_raw(pid), Signal::SIGKILL);
    }
}

/// The last [`STDERR_TAIL`] bytes of `s`, cut at a character boundary.
fn tail(s: &str) -> &str {
    tail_n(s, STDERR_TAIL)
}

fn tail_n(s: &str, n: usize) -> &str {
    let mut start = s.len().saturating_sub(n);
    while !s.is_char_boundary(start) {
        start += 1;
    }
    &s[start..]
}

/// Waits for every child until `deadline` ([`Child::wait`]); the first failure is returned
/// after the others were killed (dropping them), so one dead node never leaves the rest
/// waiting.
pub fn wait_all(children: Vec<Child>, deadline: Instant) -> Result<Vec<Output>> {
    let mut outs = Vec::new();
    for c in children {
        outs.push(c.wait(deadline)?);
    }
    Ok(outs)
}

/// Whether `pid` is a process that has not exited (a zombie counts as exited).
#[cfg(test)]
pub(crate) fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| !s.rsplit(')').next().unwrap_or("").trim_start().starts_with('Z'))
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tail_respects_char_boundaries() {
        assert_eq!(tail_n("abcdef", 3), "def");
        assert_eq!(tail_n("aé", 1), "");
        assert_eq!(tail_n("ab", 10), "ab");
    }

    /// NETNS-3: past the deadline the whole group goes (the grandchild too) and the error
    /// carries stderr.
    #[test]
    fn a_child_past_its_deadline_is_killed_with_its_group() {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "sleep 30 & echo $! ; echo waiting >&2 ; wait"]);
        let child = Child::spawn(cmd, "sleeper").expect("spawn sh");
        // The grandchild's pid is on stdout; read it through /proc instead of the pipe,
        // which the wait owns.
        let pid = child.id().expect("pid");
        let start = Instant::now();
        let grandchild = loop {
            let kids = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
                .unwrap_or_default();
            if let Some(p) = kids.split_whitespace().find_map(|s| s.parse::<u32>().ok()) {
                break p;
            }
            assert!(start.elapsed() < Duration::from_secs(10), "sh started no child");
            std::thread::sleep(Duration::from_millis(10));
        };
        let err = child.wait_output(Instant::now() + Duration::from_millis(300)).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("sleeper") && text.contains("did not finish in time"), "{text}");
        assert!(text.contains("waiting"), "stderr tail missing: {text}");
        let gone = Instant::now() + Duration::from_secs(10);
        while alive(grandchild) {
            assert!(Instant::now() < gone, "grandchild {grandchild} survived the group kill");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// NETNS-3: output larger than a pipe's buffer does not block the child; a non-zero exit
    /// is an error for `wait` but not for `wait_output`.
    #[test]
    fn large_output_is_drained_and_exit_status_reported() {
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "head -c 1000000 /dev/zero; echo bad >&2; exit 3"]);
        let out = Child::spawn(cmd, "big").expect("spawn").wait_output(deadline).expect("output");
        assert_eq!(out.stdout.len(), 1_000_000);
        assert_eq!(out.status.code(), Some(3));
        let mut cmd = Command::new("sh");
        cmd.args(["-c", "echo bad >&2; exit 3"]);
        let err = Child::spawn(cmd, "failing").expect("spawn").wait(deadline).unwrap_err();
        assert!(err.to_string().contains("exit status: 3") && err.to_string().contains("bad"));
    }
}
