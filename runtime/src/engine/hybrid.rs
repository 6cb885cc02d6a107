//! Hybrid sharding (HSDP, FSDP2's 2-D mesh `(Replicate, Shard)`): the world cut into shard
//! groups of consecutive ranks, each sharding the model as a world of its own would, and
//! replica groups across them (`--shard-group N|node`).
//!
//! The pure core ([`Groups`]) maps a world rank to its groups; [`ShardGroup`] is the flag;
//! [`Groups::open`] makes the communicators of a rank's groups.
//!
//! Invariants:
//! - HSDP-1: with group size `g` dividing the world `w`, world rank `r` is index `r % g` of
//!   shard group `r / g` (ranks `g * (r / g) ..` `g * (r / g) + g`) and index `r / g` of
//!   replica group `r % g` (ranks `r % g, r % g + g, ...`); the shard groups partition the
//!   world, and so do the replica groups. `g = w` is plain sharding over the world (one
//!   replica group per rank, of one rank), `g = 1` plain replication.
//! - HSDP-2: a rank's layout, parameter, gradient and optimizer-state shards are those of
//!   its shard index in a world of `g`: the ranks of one replica group hold the same
//!   shards, and a checkpoint needs the shards of one replica group only (the first,
//!   shard group 0, writes them).
//! - HSDP-3: gradient path at stages 1-3: a unit's gradients are reduce-scattered over the
//!   shard group, then its reduced shard is all-reduced (sum) over the replica group on the
//!   replica lane, chained behind the reduce-scatter off the compute thread; the sum is
//!   then over every rank of the world, as the loss is a mean over the whole global batch
//!   (the scale divides by the world). Gathers stay inside the shard group; the loss,
//!   norm and stop all-reduce and SyncBN statistics go over the world, the squared norms
//!   of the first replica group alone (every replica holds the same shards: each element
//!   counts once, ENG-2).
//! - HSDP-4: stage 0 ignores the group (every rank holds everything: plain replication over
//!   the world).

use std::fmt;
use std::str::FromStr;

use shardline_collectives::{Communicator, Topology};

use crate::error::{Result, RuntimeError};

/// `--shard-group`: how many consecutive ranks shard the model together.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ShardGroup {
    /// The whole world (plain FSDP, the default).
    #[default]
    World,
    /// The ranks of a node, as the topology places them.
    Node,
    /// Groups of this many consecutive ranks.
    Ranks(usize),
    /// Chosen by `--stage auto --profile` before any rank starts (AUTO-3).
    Auto,
}

impl ShardGroup {
    /// The default: the whole world.
    pub fn is_world(&self) -> bool {
        *self == ShardGroup::World
    }

    /// The group size on `topology`, checked (HSDP-1): N must divide the world; `node`
    /// needs nodes of equal size whose ranks are consecutive.
    pub fn size(&self, topology: &Topology) -> Result<usize> {
        let w = topology.world();
        match *self {
            ShardGroup::World => Ok(w),
            ShardGroup::Ranks(0) => {
                Err(RuntimeError::config("--shard-group 0: a group needs at least one rank"))
            }
            ShardGroup::Ranks(n) if !w.is_multiple_of(n) => Err(RuntimeError::config(format!(
                "--shard-group {n} does not divide the world of {w} ranks"
            ))),
            ShardGroup::Ranks(n) => Ok(n),
            ShardGroup::Auto => Err(RuntimeError::config(
                "--shard-group auto is resolved by --stage auto before the ranks start",
            )),
            ShardGroup::Node => {
                let per = topology.local_world(0);
                let consecutive = (0..topology.nodes())
                    .all(|n| topology.ranks_on_node(n).iter().copied().eq(n * per..(n + 1) * per));
                if consecutive {
                    Ok(per)
                } else {
                    Err(RuntimeError::config(
                        "--shard-group node needs nodes of equal size holding consecutive ranks",
                    ))
                }
            }
        }
    }
}

/// The shards of a checkpoint of a job at `stage` with `group` on `topology`: the shard
/// group's size, or the world at stage 0 (HSDP-2, HSDP-4). The ranks `0..` that number, the
/// first replica group, write them.
pub fn checkpoint_shards(
    group: ShardGroup,
    stage: crate::shard::Stage,
    topology: &Topology,
) -> Result<usize> {
    let size = group.size(topology)?;
    Ok(if stage == crate::shard::Stage::Zero0 { topology.world() } else { size })
}

impl FromStr for ShardGroup {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "world" => Ok(ShardGroup::World),
            "node" => Ok(ShardGroup::Node),
            "auto" => Ok(ShardGroup::Auto),
            n => match n.parse::<usize>() {
                Ok(0) => Err("a group needs at least one rank".into()),
                Ok(n) => Ok(ShardGroup::Ranks(n)),
                Err(_) => Err(format!("'{s}' is not a number of ranks, node, world or auto")),
            },
        }
    }
}

impl fmt::Display for ShardGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ShardGroup::World => f.write_str("world"),
            ShardGroup::Node => f.write_str("node"),
            ShardGroup::Auto => f.write_str("auto"),
            ShardGroup::Ranks(n) => write!(f, "{n}"),
        }
    }
}

/// The groups of one world rank (HSDP-1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Groups {
    /// World size.
    pub world: usize,
    /// Shard group size (divides `world`).
    pub size: usize,
    /// The world rank.
    pub rank: usize,
}

impl Groups {
    /// Rank `rank`'s groups of `size` in `world`; `size` must divide `world`.
    pub fn new(world: usize, size: usize, rank: usize) -> Self {
        debug_assert!(size > 0 && world.is_multiple_of(size) && rank < world);
        Groups { world, size, rank }
    }

    /// The index in the shard group: the shard this rank holds (HSDP-2).
    pub fn shard_index(&self) -> usize {
        self.rank % self.size
    }

    /// The shard group's number, this rank's index in its replica group.
    pub fn replica_index(&self) -> usize {
        self.rank / self.size
    }

    /// Number of shard groups (the size of a replica group).
    pub fn replicas(&self) -> usize {
        self.world / self.size
    }

    /// The world ranks of this rank's shard group, in shard order.
    pub fn shard_members(&self) -> Vec<usize> {
        let first = self.replica_index() * self.size;
        (first..first + self.size).collect()
    }

    /// The world ranks of this rank's replica group, in shard-group order.
    pub fn replica_members(&self) -> Vec<usize> {
        (self.shard_index()..self.world).step_by(self.size).collect()
    }

    /// Whether this rank writes its shard into a checkpoint: the first replica of each
    /// shard (HSDP-2).
    pub fn writes_checkpoint(&self) -> bool {
        self.replica_index() == 0
    }

    /// The communicators of the shard group and, with more than one shard group, of the
    /// replica group (HSDP-1). Every rank of `world` calls it with the same size, so that
    /// every rank makes the groups of the same kinds (COMM-3). With one group the shard
    /// communicator is `world` itself.
    pub fn open(&self, world: &Communicator) -> Result<(Communicator, Option<Communicator>)> {
        if self.size == self.world {
            return Ok((world.clone(), None));
        }
        let shard = world.subgroup("shard", &self.shard_members())?;
        let replica = world.subgroup("replica", &self.replica_members())?;
        Ok((shard, Some(replica)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// HSDP-1: the shard groups and the replica groups each partition the world, and a
    /// rank's two groups meet in it alone.
    #[test]
    fn groups_partition_the_world_hsdp_1() {
        for (world, size) in [(4, 2), (3, 1), (6, 3), (6, 2), (4, 4), (1, 1)] {
            let mut shard_seen = vec![0; world];
            let mut replica_seen = vec![0; world];
            for r in 0..world {
                let g = Groups::new(world, size, r);
                let (s, p) = (g.shard_members(), g.replica_members());
                assert_eq!(s[g.shard_index()], r, "{world}/{size} rank {r}");
                assert_eq!(p[g.replica_index()], r, "{world}/{size} rank {r}");
                assert_eq!(s.iter().filter(|m| p.contains(m)).count(), 1);
                assert_eq!((s.len(), p.len()), (size, world / size));
                if g.shard_index() == 0 {
                    s.iter().for_each(|&m| shard_seen[m] += 1);
                }
                if g.replica_index() == 0 {
                    p.iter().for_each(|&m| replica_seen[m] += 1);
                }
                // Every member of a shard group agrees on it.
                for &m in &s {
                    assert_eq!(Groups::new(world, size, m).shard_members(), s);
                }
            }
            assert!(shard_seen.iter().all(|&c| c == 1), "{world}/{size}: {shard_seen:?}");
            assert!(replica_seen.iter().all(|&c| c == 1), "{world}/{size}: {replica_seen:?}");
        }
        assert_eq!(Groups::new(4, 2, 3).replica_members(), vec![1, 3]);
        assert_eq!(Groups::new(4, 2, 3).shard_members(), vec![2, 3]);
    }

    /// HSDP-2: one replica group writes, one rank per shard.
    #[test]
    fn the_first_replica_group_writes_each_shard_once_hsdp_2() {
        let writers: Vec<usize> =
            (0..6).filter(|&r| Groups::new(6, 3, r).writes_checkpoint()).collect();
        assert_eq!(writers, vec![0, 1, 2]);
        let shards: Vec<usize> =
            writers.iter().map(|&r| Groups::new(6, 3, r).shard_index()).collect();
        assert_eq!(shards, vec![0, 1, 2]);
    }

    /// Bad sizes name the flag; `node` follows the topology.
    #[test]
    fn sizes_are_checked_against_the_world() {
        let t = Topology::single_node(6);
        assert_eq!(ShardGroup::World.size(&t).unwrap(), 6);
        assert_eq!(ShardGroup::Ranks(3).size(&t).unwrap(), 3);
        for bad in [ShardGroup::Ranks(4), ShardGroup::Ranks(0)] {
            let e = bad.size(&t).unwrap_err().to_string();
            assert!(e.contains("--shard-group"), "{e}");
        }
        assert_eq!(ShardGroup::Node.size(&Topology::uniform(3, 2)).unwrap(), 2);
        assert!(ShardGroup::Node.size(&Topology::from_nodes(vec![0, 1, 0, 1])).is_err());
        assert_eq!("node".parse::<ShardGroup>(), Ok(ShardGroup::Node));
        assert_eq!("4".parse::<ShardGroup>(), Ok(ShardGroup::Ranks(4)));
        assert!("0".parse::<ShardGroup>().is_err());
        assert!("x".parse::<ShardGroup>().is_err());
    }
}
