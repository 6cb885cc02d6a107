//! Secondary shards (ZeRO++'s hpZ, `--reshard-after-forward node|N`): at stage 3 a rank
//! keeps, after a unit's forward, its piece of a copy of the unit sharded over a small group
//! of ranks (the ranks of its node), so that the unit's backward gathers it from that group
//! alone rather than over the shard group again.
//!
//! The pure core: [`ReshardAfterForward`] is the flag, [`Secondary`] maps a world rank to its
//! secondary group and its piece of a unit, [`after_use`] decides what a use leaves behind.
//! The shell: [`Pieces`] holds a rank's pieces, counted by the memory tracker as
//! [`Category::SecondaryShards`].
//!
//! Invariants:
//! - HPZ-1: with shard groups of `g` ranks and secondary groups of `s` ranks (`s` divides
//!   `g`, `s < g`), world rank `r` is index `(r % g) % s` of the secondary group of the `s`
//!   consecutive ranks that holds it, inside its shard group; the secondary groups partition
//!   every shard group. `node` takes `s` as the node size where nodes are consecutive blocks
//!   of equal size, so a secondary group never spans two nodes. A unit padded to `p` values
//!   (a multiple of `g`, hence of `s`) is cut into `s` pieces of `p / s` values, index `j`
//!   holding `j * p / s ..` `(j + 1) * p / s`: the pieces of a group tile the unit.
//! - HPZ-2 (stage 3): a unit's first gather of a step goes over the shard group; a use that
//!   frees the gathered unit while the unit is used again later in the step first copies the
//!   rank's piece out of it, and every later gather of that unit in the step (its backward's,
//!   a tied root's second call, the next microbatches') all-gathers the pieces over the
//!   secondary group only (its own lane, `hpz:gather`), so it never crosses nodes. A piece
//!   goes after the unit's last use of the step, or when the unit's parameters change (its
//!   update, a checkpoint load): no piece outlives a step, and checkpoints are unchanged.
//! - HPZ-3: the results are bitwise those of `world`: a piece is a copy of gathered values,
//!   the parameters do not change between two uses in a step, and a gather moves values
//!   without computing, so every use computes with the same parameters.
//! - HPZ-4: stages 0-2 keep the full parameters and gather nothing before use: the flag
//!   changes nothing there.
//! - HPZ-5: under packed gathers (bf16, int8, fp8) the pieces are f32 copies of the unit as
//!   decoded for its first use, and the gathers from them carry f32: every use computes
//!   with the values the packed gather of the master shard gives (decoding is a pure
//!   function of the shard), so HPZ-3 holds; only the first gather of a step is packed.

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

use shardline_collectives::Topology;

use crate::error::{Result, RuntimeError};
use crate::memory::{Allocation, Category, MemoryTracker};

/// `--reshard-after-forward`: what a rank keeps of a stage-3 unit after its forward.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReshardAfterForward {
    /// Its shard of the shard group (the default): backward gathers over the shard group.
    #[default]
    World,
    /// Its piece of a secondary shard over the ranks of its node (HPZ-1).
    Node,
    /// Its piece of a secondary shard over groups of this many consecutive ranks.
    Ranks(usize),
}

impl ReshardAfterForward {
    /// The default: back to the shard group's shard.
    pub fn is_world(&self) -> bool {
        *self == ReshardAfterForward::World
    }

    /// The secondary group's size for shard groups of `shard` ranks on `topology` (HPZ-1):
    /// `None` for `world`; an error naming the flag where the groups would not divide the
    /// shard group or would be the whole shard group (nothing left to save).
    pub fn size(&self, shard: usize, topology: &Topology) -> Result<Option<usize>> {
        let s = match *self {
            ReshardAfterForward::World => return Ok(None),
            ReshardAfterForward::Ranks(n) => n,
            ReshardAfterForward::Node => {
                let per = topology.local_world(0);
                let consecutive = (0..topology.nodes())
                    .all(|n| topology.ranks_on_node(n).iter().copied().eq(n * per..(n + 1) * per));
                if !consecutive {
                    return Err(RuntimeError::config(
                        "--reshard-after-forward node needs nodes of equal size holding \
                         consecutive ranks",
                    ));
                }
                per
            }
        };
        if s == 0 || !shard.is_multiple_of(s) {
            return Err(RuntimeError::config(format!(
                "--reshard-after-forward {self}: a secondary group of {s} ranks must divide the \
                 shard group's {shard} ranks (--shard-group, default the world)"
            )));
        }
        if s == shard {
            return Err(RuntimeError::config(format!(
                "--reshard-after-forward {self}: the secondary group would be the whole shard \
                 group of {shard} ranks (--shard-group, default the world), whose gathers it \
                 would repeat: it needs a shard group spanning several of its groups (nodes)"
            )));
        }
        Ok(Some(s))
    }
}

impl FromStr for ReshardAfterForward {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "world" => Ok(ReshardAfterForward::World),
            "node" => Ok(ReshardAfterForward::Node),
            n => match n.parse::<usize>() {
                Ok(0) => Err("a secondary group needs at least one rank".into()),
                Ok(n) => Ok(ReshardAfterForward::Ranks(n)),
                Err(_) => Err(format!("'{s}' is not a number of ranks, node or world")),
            },
        }
    }
}

impl fmt::Display for ReshardAfterForward {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReshardAfterForward::World => f.write_str("world"),
            ReshardAfterForward::Node => f.write_str("node"),
            ReshardAfterForward::Ranks(n) => write!(f, "{n}"),
        }
    }
}

/// A world rank's secondary group inside its shard group (HPZ-1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Secondary {
    /// Shard group size.
    pub shard: usize,
    /// Secondary group size (divides `shard`).
    pub size: usize,
    /// The world rank.
    pub rank: usize,
}

impl Secondary {
    /// Rank `rank`'s secondary group of `size` in shard groups of `shard`.
    pub fn new(shard: usize, size: usize, rank: usize) -> Self {
        debug_assert!(size > 0 && shard.is_multiple_of(size));
        Secondary { shard, size, rank }
    }

    /// The index in the secondary group: the piece this rank keeps.
    pub fn index(&self) -> usize {
        self.rank % self.shard % self.size
    }

    /// The world ranks of the secondary group, in piece order.
    pub fn members(&self) -> Vec<usize> {
        let first = self.rank - self.index();
        (first..first + self.size).collect()
    }

    /// Piece `index`'s range of a unit padded to `padded` values (a multiple of the shard
    /// group's size, as the layout pads it).
    pub fn piece(&self, padded: usize, index: usize) -> Range<usize> {
        let len = padded / self.size;
        index * len..(index + 1) * len
    }

    /// This rank's piece of a unit padded to `padded` values.
    pub fn own_piece(&self, padded: usize) -> Range<usize> {
        self.piece(padded, self.index())
    }
}

/// What a use of a gathered unit leaves of its piece (HPZ-2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PieceAction {
    /// Copy the piece out of the gathered unit before it goes.
    Keep,
    /// The unit is not used again this step: its piece goes.
    Drop,
    /// Nothing to do: the gathered unit is kept whole, or the piece is already held.
    None,
}

/// After a use: `again`, the unit is used later in the step; `kept`, the plan keeps the
/// gathered unit whole for that use; `held`, the rank already holds the unit's piece.
pub fn after_use(again: bool, kept: bool, held: bool) -> PieceAction {
    match (again, kept, held) {
        (false, _, _) => PieceAction::Drop,
        (true, false, false) => PieceAction::Keep,
        _ => PieceAction::None,
    }
}

/// A rank's secondary pieces, per unit, counted until dropped (ENG-3).
pub(crate) struct Pieces {
    pieces: Vec<Option<(Vec<f32>, Allocation)>>,
}

impl Pieces {
    /// No piece of `units` units.
    pub(crate) fn new(units: usize) -> Self {
        Pieces { pieces: (0..units).map(|_| None).collect() }
    }

    /// Unit `unit`'s piece, if held.
    pub(crate) fn get(&self, unit: usize) -> Option<&[f32]> {
        self.pieces[unit].as_ref().map(|(p, _)| &p[..])
    }

    /// Keeps a copy of `values` as unit `unit`'s piece, registered as `label`'s.
    pub(crate) fn keep(
        &mut self,
        unit: usize,
        values: &[f32],
        mem: &MemoryTracker,
        label: &str,
    ) -> Result<()> {
        let what = format!("{label} (secondary shard)");
        let alloc = mem.alloc_f32(Category::SecondaryShards, values.len(), &what)?;
        self.pieces[unit] = Some((values.to_vec(), alloc));
        Ok(())
    }

    /// Drops unit `unit`'s piece, if held.
    pub(crate) fn drop_unit(&mut self, unit: usize) {
        self.pieces[unit] = None;
    }

    /// Drops every piece.
    pub(crate) fn clear(&mut self) {
        self.pieces.iter_mut().for_each(|p| *p = None);
    }
}

impl super::RankEngine {
    /// HPZ-2: after use `i` of a gathered unit (`full`), before the plan keeps or frees it:
    /// copies the rank's piece out when the unit is freed and used again in the step, drops
    /// the piece after the unit's last use.
    pub(super) fn piece_after_use(&mut self, i: usize, full: &[f32]) -> Result<()> {
        let Some(sec) = self.hpz.as_ref().map(|h| h.0) else {
            return Ok(());
        };
        let u = self.plan.unit_at(i);
        let held = self.pieces.get(u).is_some();
        match after_use(self.plan.used_again(i), self.plan.keeps(i), held) {
            PieceAction::Keep => {
                let r = sec.own_piece(self.layout.unit(u).padded_numel());
                self.pieces.keep(u, &full[r], &self.mem, &self.labels[u])
            }
            PieceAction::Drop => {
                self.pieces.drop_unit(u);
                Ok(())
            }
            PieceAction::None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// HPZ-1: the secondary groups partition every shard group, a rank sits at its index,
    /// and the pieces of a group tile the unit.
    #[test]
    fn secondary_groups_partition_the_shard_group_and_pieces_tile_the_unit_hpz_1() {
        for (world, shard, size) in [(4, 4, 2), (8, 4, 2), (8, 8, 4), (6, 6, 3), (3, 3, 1)] {
            let mut seen = vec![0; world];
            for r in 0..world {
                let s = Secondary::new(shard, size, r);
                let m = s.members();
                assert_eq!(m.len(), size);
                assert_eq!(m[s.index()], r, "{world}/{shard}/{size} rank {r}");
                // Inside the rank's shard group (consecutive ranks of `shard`).
                assert!(m.iter().all(|&x| x / shard == r / shard), "{m:?}");
                for &x in &m {
                    assert_eq!(Secondary::new(shard, size, x).members(), m);
                }
                if s.index() == 0 {
                    m.iter().for_each(|&x| seen[x] += 1);
                }
                for padded in [0, shard, 5 * shard] {
                    let mut covered = vec![0u8; padded];
                    for j in 0..size {
                        s.piece(padded, j).for_each(|k| covered[k] += 1);
                    }
                    assert!(covered.iter().all(|&c| c == 1), "{padded}: {covered:?}");
                    assert_eq!(s.own_piece(padded).len(), padded / size);
                }
            }
            assert!(seen.iter().all(|&c| c == 1), "{world}/{shard}/{size}: {seen:?}");
        }
        assert_eq!(Secondary::new(4, 2, 3).members(), vec![2, 3]);
        assert_eq!(Secondary::new(4, 2, 6).members(), vec![6, 7]);
        assert_eq!(Secondary::new(4, 2, 6).own_piece(8), 0..4);
    }

    /// HPZ-1: `node` follows the topology, and only secondary groups that divide the shard
    /// group and are smaller than it are accepted, naming the flag otherwise.
    #[test]
    fn sizes_are_checked_against_the_shard_group_hpz_1() {
        let two_by_two = Topology::uniform(2, 2);
        assert_eq!(ReshardAfterForward::Node.size(4, &two_by_two).unwrap(), Some(2));
        assert_eq!(ReshardAfterForward::World.size(4, &two_by_two).unwrap(), None);
        assert_eq!(
            ReshardAfterForward::Ranks(1).size(3, &Topology::single_node(3)).unwrap(),
            Some(1)
        );
        let one = Topology::single_node(4);
        for (bad, shard, topo) in [
            (ReshardAfterForward::Node, 4, &one),
            (ReshardAfterForward::Ranks(3), 4, &one),
            (ReshardAfterForward::Ranks(4), 4, &one),
            (ReshardAfterForward::Ranks(0), 4, &one),
            (ReshardAfterForward::Node, 2, &two_by_two),
        ] {
            let e = bad.size(shard, topo).unwrap_err().to_string();
            assert!(e.contains("--reshard-after-forward"), "{bad} over {shard}: {e}");
        }
        let interleaved = Topology::from_nodes(vec![0, 1, 0, 1]);
        assert!(ReshardAfterForward::Node.size(4, &interleaved).is_err());
        assert_eq!("node".parse::<ReshardAfterForward>(), Ok(ReshardAfterForward::Node));
        assert_eq!("world".parse::<ReshardAfterForward>(), Ok(ReshardAfterForward::World));
        assert_eq!("2".parse::<ReshardAfterForward>(), Ok(ReshardAfterForward::Ranks(2)));
        assert!("0".parse::<ReshardAfterForward>().is_err());
        assert!("x".parse::<ReshardAfterForward>().is_err());
    }

    /// HPZ-2 over the gather plan the engine runs (random sizes, budgets, depths, a tied
    /// unit called twice, microbatches): each unit's first gather of the step goes over the
    /// shard group, every later one finds the rank's piece, and no piece outlives the step.
    #[test]
    fn later_gathers_read_only_pieces_and_none_outlive_the_step_hpz_2() {
        use super::super::prefetch::{GatherIo, GatherPlan};
        use std::collections::HashSet;
        #[derive(Default)]
        struct Io {
            pieces: HashSet<usize>,
            over_shard: Vec<usize>,
            from_piece: usize,
        }
        impl GatherIo for Io {
            type Pending = usize;
            type Full = usize;
            type Error = ();
            fn issue(&mut self, unit: usize) -> std::result::Result<usize, ()> {
                if self.pieces.contains(&unit) {
                    self.from_piece += 1;
                } else {
                    self.over_shard.push(unit);
                }
                Ok(unit)
            }
            fn wait(&mut self, _: usize, p: usize) -> std::result::Result<usize, ()> {
                Ok(p)
            }
            fn release(&mut self, _: usize) {}
        }
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = |m: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % m
        };
        let mut later = 0;
        for case in 0..300 {
            let n = 1 + next(5) as usize;
            // Every other case calls unit 0 again last, as gpt's tied root.
            let mut calls: Vec<usize> = (0..n).collect();
            if case % 2 == 0 {
                calls.push(0);
            }
            let sizes: Vec<u64> = (0..n).map(|_| 1 + next(9)).collect();
            let (budget, depth, micro) = (next(30), next(3) as usize, 1 + next(3) as usize);
            let mut plan: GatherPlan<usize, usize> = GatherPlan::new(sizes, budget, depth);
            let mut io = Io::default();
            plan.begin_step(&calls, micro);
            for i in 0..2 * calls.len() * micro {
                let u = plan.acquire(i, &mut io).unwrap();
                let held = io.pieces.contains(&u);
                match after_use(plan.used_again(i), plan.keeps(i), held) {
                    PieceAction::Keep => assert!(io.pieces.insert(u)),
                    PieceAction::Drop => {
                        io.pieces.remove(&u);
                    }
                    PieceAction::None => {}
                }
                plan.done_with(i, u, &mut io);
            }
            plan.end_pass(&mut io);
            let what = format!("calls {calls:?} budget {budget} depth {depth} micro {micro}");
            let mut first = io.over_shard.clone();
            first.sort_unstable();
            assert_eq!(first, (0..n).collect::<Vec<_>>(), "{what}: {:?}", io.over_shard);
            assert!(io.pieces.is_empty(), "{what}: pieces left {:?}", io.pieces);
            later += io.from_piece;
        }
        assert!(later > 300, "the later gathers were exercised: {later}");
    }

    /// HPZ-2: a freed unit used again keeps its piece once; its last use drops it; a unit
    /// kept whole needs none.
    #[test]
    fn a_piece_is_kept_until_the_units_last_use_hpz_2() {
        assert_eq!(after_use(true, false, false), PieceAction::Keep);
        assert_eq!(after_use(true, false, true), PieceAction::None);
        assert_eq!(after_use(true, true, false), PieceAction::None);
        assert_eq!(after_use(false, false, true), PieceAction::Drop);
        assert_eq!(after_use(false, true, false), PieceAction::Drop);
    }
}
