//! Hang and desync diagnosis: every rank's recent collectives, gathered by the coordinator at
//! the job's first failure, turned into one readable report (which rank is behind, on which op
//! of which lane, what every other rank was waiting for), and saved as a JSON dump that
//! `shardline doctor DUMP` reads back.
//!
//! - DOC-1: the report from a saved dump is the report printed at the failure (the dump holds
//!   everything the report reads; times are relative to the capture).
//! - DOC-2: a rank is *behind* on a lane when another rank has started a later op on that
//!   lane than any this rank has started; the report names the first op it has not entered.

use crate::error::{Result, RuntimeError};
use serde::{Deserialize, Serialize};
use shardline_collectives::Communicator;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;
use std::time::Instant;

/// One op of one rank, as saved.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OpView {
    /// Lane name.
    pub lane: String,
    /// Sequence number on the lane.
    pub seq: u64,
    /// Op name.
    pub op: String,
    /// Buffer bytes.
    pub bytes: usize,
    /// Seconds before the capture that it started.
    pub started_s_ago: f64,
    /// Seconds before the capture that it ended (`None`: still running).
    pub ended_s_ago: Option<f64>,
    /// Whether it ended with an error.
    pub failed: bool,
}

/// The dump: each rank's recent collectives and the failure that triggered the capture.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Diagnosis {
    /// Format version of the dump.
    pub version: u32,
    /// Rank that reported the first failure.
    pub failed_rank: usize,
    /// Its error.
    pub error: String,
    /// Per rank (index = rank), recent ops, oldest first.
    pub ranks: Vec<Vec<OpView>>,
}

impl Diagnosis {
    /// Dump format version.
    pub const VERSION: u32 = 1;

    /// Captures every rank's ring now.
    pub fn capture(comms: &[Communicator], failed_rank: usize, error: &str) -> Diagnosis {
        let now = Instant::now();
        let ago = |t: Instant| now.saturating_duration_since(t).as_secs_f64();
        let ranks = comms
            .iter()
            .map(|c| {
                c.recent_ops()
                    .into_iter()
                    .map(|o| OpView {
                        lane: o.lane,
                        seq: o.seq,
                        op: o.op.to_string(),
                        bytes: o.bytes,
                        started_s_ago: ago(o.start),
                        ended_s_ago: o.end.map(ago),
                        failed: o.failed,
                    })
                    .collect()
            })
            .collect();
        Diagnosis { version: Self::VERSION, failed_rank, error: error.to_string(), ranks }
    }

    /// Whether the failure was a timeout (the case the report is for).
    pub fn is_timeout(&self) -> bool {
        let e = self.error.to_ascii_lowercase();
        e.contains("timed out") || e.contains("timeout")
    }

    /// Per lane: the highest seq each rank has started (`None`: none in the ring).
    fn lane_heads(&self) -> BTreeMap<String, Vec<Option<&OpView>>> {
        let mut lanes: BTreeMap<String, Vec<Option<&OpView>>> = BTreeMap::new();
        for (r, ops) in self.ranks.iter().enumerate() {
            for o in ops {
                let v = lanes.entry(o.lane.clone()).or_insert_with(|| vec![None; self.ranks.len()]);
                if v[r].is_none_or(|cur| o.seq >= cur.seq) {
                    v[r] = Some(o);
                }
            }
        }
        lanes
    }

    /// Ranks behind, with the lane and the first op they have not entered (DOC-2).
    pub fn behind(&self) -> Vec<(usize, String, u64, String)> {
        let mut out = Vec::new();
        for (lane, heads) in self.lane_heads() {
            let Some(lead) = heads.iter().flatten().max_by_key(|o| o.seq) else { continue };
            for (r, h) in heads.iter().enumerate() {
                let last = h.map(|o| o.seq);
                if last.is_none_or(|s| s < lead.seq) {
                    let next = last.map_or(0, |s| s + 1);
                    // The op it has not entered: as the leading ranks saw it, if in their ring.
                    let name = self
                        .ranks
                        .iter()
                        .flatten()
                        .find(|o| o.lane == lane && o.seq == next)
                        .map_or_else(|| lead.op.clone(), |o| o.op.clone());
                    out.push((r, lane.clone(), next, name));
                }
            }
        }
        out
    }

    /// The readable report.
    pub fn report(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "collective state at the failure (rank {} first: {})",
            self.failed_rank, self.error
        );
        let behind = self.behind();
        for (lane, heads) in self.lane_heads() {
            let _ = writeln!(s, "  lane {lane}:");
            for (r, h) in heads.iter().enumerate() {
                let line = match h {
                    None => "no op in its recent ring".to_string(),
                    Some(o) => match o.ended_s_ago {
                        None => format!(
                            "waiting in {} #{} ({} bytes) for {:.3} s",
                            o.op, o.seq, o.bytes, o.started_s_ago
                        ),
                        Some(e) => format!(
                            "idle after {} #{} ({} bytes), {} {:.3} s ago",
                            o.op,
                            o.seq,
                            o.bytes,
                            if o.failed { "failed" } else { "done" },
                            e
                        ),
                    },
                };
                let _ = writeln!(s, "    rank {r}: {line}");
            }
        }
        if behind.is_empty() {
            let _ =
                writeln!(s, "  no rank is behind: every rank started the same ops on every lane");
        }
        for (r, lane, seq, op) in &behind {
            let waiting: Vec<String> = self
                .ranks
                .iter()
                .enumerate()
                .filter(|(q, ops)| *q != *r && ops.iter().any(|o| o.lane == *lane && o.seq == *seq))
                .map(|(q, _)| q.to_string())
                .collect();
            let _ = writeln!(
                s,
                "  rank {r} is behind: it has not entered {op} #{seq} on lane {lane}{}",
                if waiting.is_empty() {
                    String::new()
                } else {
                    format!(", which rank(s) {} entered", waiting.join(", "))
                }
            );
        }
        s
    }

    /// Writes the dump as JSON.
    pub fn write(&self, path: &Path) -> Result<()> {
        let text = serde_json::to_vec_pretty(self)
            .map_err(|e| RuntimeError::config(format!("encoding the dump: {e}")))?;
        std::fs::write(path, text).map_err(|e| {
            RuntimeError::config(format!("writing the failure dump {}: {e}", path.display()))
        })
    }

    /// Reads a dump written by [`Diagnosis::write`].
    pub fn load(path: &Path) -> Result<Diagnosis> {
        let bytes = std::fs::read(path).map_err(|e| {
            RuntimeError::config(format!("cannot read dump {}: {e}", path.display()))
        })?;
        let d: Diagnosis = serde_json::from_slice(&bytes).map_err(|e| {
            RuntimeError::config(format!("{} is not a shardline failure dump: {e}", path.display()))
        })?;
        if d.version != Self::VERSION {
            return Err(RuntimeError::config(format!(
                "{}: dump version {} (this shardline reads version {})",
                path.display(),
                d.version,
                Self::VERSION
            )));
        }
        Ok(d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(lane: &str, seq: u64, running: bool) -> OpView {
        OpView {
            lane: lane.into(),
            seq,
            op: "reduce_scatter".into(),
            bytes: 64,
            started_s_ago: 1.0,
            ended_s_ago: if running { None } else { Some(0.9) },
            failed: false,
        }
    }

    #[test]
    fn names_the_rank_behind_and_who_waits() {
        // DOC-2: ranks 0 and 2 wait in reduce #5; rank 1 finished #4 only.
        let d = Diagnosis {
            version: Diagnosis::VERSION,
            failed_rank: 0,
            error: "timed out waiting for rank 1".into(),
            ranks: vec![
                vec![op("reduce", 4, false), op("reduce", 5, true), op("gather", 9, false)],
                vec![op("reduce", 4, false), op("gather", 9, false)],
                vec![op("reduce", 5, true), op("gather", 9, false)],
            ],
        };
        assert_eq!(d.behind(), vec![(1, "reduce".to_string(), 5, "reduce_scatter".to_string())]);
        let r = d.report();
        assert!(r.contains("rank 1 is behind: it has not entered reduce_scatter #5 on lane reduce, which rank(s) 0, 2 entered"), "{r}");
        assert!(r.contains("rank 0: waiting in reduce_scatter #5"), "{r}");
        assert!(!r.contains("rank 2 is behind"));
    }

    #[test]
    fn dump_round_trips_to_the_same_report() {
        // DOC-1
        let d = Diagnosis {
            version: Diagnosis::VERSION,
            failed_rank: 2,
            error: "x".into(),
            ranks: vec![vec![op("a", 1, true)], vec![]],
        };
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("dump.json");
        d.write(&p).unwrap();
        let back = Diagnosis::load(&p).unwrap();
        assert_eq!(back.report(), d.report());
        std::fs::write(&p, b"{not json").unwrap();
        assert!(Diagnosis::load(&p).unwrap_err().to_string().contains("dump.json"));
    }
}
