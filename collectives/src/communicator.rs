//! The communicator: a rank's view of a group, owning its transport, its lanes and its
//! buffer pool.
//!
//! - COMM-1: `abort` fails every pending and later op on every lane of this communicator
//!   with `Aborted` carrying the first reason given, and poisons peers (best effort).
//! - COMM-2: `lane(name)` returns the same lane for the same name; all ranks must open the
//!   same lanes.
//! - COMM-3: a sub-group communicator ([`Communicator::subgroup`]) is its members renumbered
//!   in the order given, over the parent's links (GROUP-1); its topology is the members' part
//!   of the parent's, its bytes are counted apart from the parent's, and aborting the parent
//!   aborts it.

use crate::config;
use crate::error::CollectiveError;
use crate::lane::Lane;
use crate::pool::BufferPool;
use crate::topology::Topology;
use crate::transport::group::GroupTransport;
use crate::transport::local::{LocalFabric, LocalTransport};
use crate::transport::Transport;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Per-communicator options. Fields are private; setters state their defaults.
#[derive(Clone, Debug)]
pub struct CommOptions {
    timeout: Duration,
    spin: Duration,
    small_bytes: usize,
    pipeline_bytes: usize,
    link_rate: Option<u64>,
}

impl Default for CommOptions {
    fn default() -> Self {
        CommOptions {
            timeout: Duration::from_millis(config::TIMEOUT_MS.get()),
            spin: Duration::from_micros(config::SPIN_US.get()),
            small_bytes: config::SMALL_BYTES.get() as usize,
            pipeline_bytes: config::PIPELINE_BYTES.get() as usize,
            link_rate: config::link_rate_from_env(),
        }
    }
}

impl CommOptions {
    /// Options from the defaults and environment (see [`crate::config`]).
    pub fn new() -> Self {
        Self::default()
    }

    /// Default deadline of every op, from issue. Default 60 s (env `SHARDLINE_TIMEOUT_MS`).
    ///
    /// ```
    /// use shardline_collectives::CommOptions;
    /// let mut o = CommOptions::new();
    /// o.timeout(std::time::Duration::from_secs(5)).spin_us(20);
    /// assert_eq!(o.get_timeout(), std::time::Duration::from_secs(5));
    /// ```
    pub fn timeout(&mut self, d: Duration) -> &mut Self {
        self.timeout = d;
        self
    }

    /// How long a waiter busy-spins before yielding and then sleeping, in microseconds.
    /// Default 0 (env `SHARDLINE_SPIN_US`; [`crate::config::SPIN_US`] has the measurement).
    /// Used by the local transport built by [`local_group`].
    pub fn spin_us(&mut self, us: u64) -> &mut Self {
        self.spin = Duration::from_micros(us);
        self
    }

    /// `Algorithm::Auto` takes Direct at or below this many bytes. Default 64 KiB (env
    /// `SHARDLINE_SMALL_BYTES`).
    pub fn small_bytes(&mut self, b: usize) -> &mut Self {
        self.small_bytes = b;
        self
    }

    /// Piece size of the pipelined broadcast chain and of all-gathers sent in pieces (tcp).
    /// Default 1 MiB (env `SHARDLINE_PIPELINE_BYTES`).
    pub fn pipeline_bytes(&mut self, b: usize) -> &mut Self {
        self.pipeline_bytes = b;
        self
    }

    /// Caps each directed link of the local transport built by [`local_group`] at this many
    /// bytes per second (`None` or 0: unlimited, the default; env `SHARDLINE_LINK_RATE`,
    /// see [`crate::config::LINK_RATE`]). Lanes share a link's bandwidth, as they would a
    /// wire. Other transports ignore it.
    pub fn link_rate(&mut self, bytes_per_s: Option<u64>) -> &mut Self {
        self.link_rate = bytes_per_s.filter(|r| *r > 0);
        self
    }

    /// Current per-link rate limit of the local transport (`None`: unlimited).
    pub fn get_link_rate(&self) -> Option<u64> {
        self.link_rate
    }

    /// Current default timeout.
    pub fn get_timeout(&self) -> Duration {
        self.timeout
    }

    /// Current spin time.
    pub fn get_spin(&self) -> Duration {
        self.spin
    }

    /// Current Auto threshold in bytes.
    pub fn get_small_bytes(&self) -> usize {
        self.small_bytes
    }

    /// Current piece size in bytes (broadcast chain, pieced all-gathers).
    pub fn get_pipeline_bytes(&self) -> usize {
        self.pipeline_bytes
    }
}

/// State shared by a communicator and its lanes' threads.
pub(crate) struct Shared {
    pub(crate) rank: usize,
    pub(crate) world: usize,
    pub(crate) topology: Topology,
    pub(crate) opts: CommOptions,
    pub(crate) cancel: AtomicBool,
    reason: Mutex<Option<String>>,
    /// Recent ops of every lane, for hang and desync reports.
    pub(crate) recent: crate::recent::RecentOps,
    /// Payload bytes sent on every lane (LANE-8).
    pub(crate) sent: AtomicU64,
}

impl Shared {
    pub(crate) fn abort_reason(&self) -> String {
        self.reason
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .unwrap_or_else(|| "aborted".into())
    }
}

type LaneCell = Arc<Mutex<Option<Lane>>>;

struct CommInner {
    transport: Arc<dyn Transport>,
    shared: Arc<Shared>,
    /// One cell per lane name: opening a lane may wait for peers, so it holds only its own
    /// cell, and ranks may open different lanes from several threads in any order.
    lanes: Mutex<HashMap<String, LaneCell>>,
    pool: BufferPool,
    /// A sub-group's kind: its lanes are named `"{kind}:{name}"`, as the parent's lanes that
    /// carry them (GROUP-1).
    kind: Option<String>,
    /// Sub-groups made from this communicator, aborted with it (COMM-3).
    children: Mutex<Vec<Communicator>>,
}

/// A rank's communicator. Cheap to clone; `Send + Sync`.
///
/// ```
/// use shardline_collectives::{local_group, ReduceOp};
/// let comms = local_group(2).unwrap();
/// let handles: Vec<_> = comms
///     .into_iter()
///     .map(|comm| {
///         std::thread::spawn(move || {
///             let lane = comm.lane("grads").unwrap();
///             let buf = vec![comm.rank() as f32 + 1.0; 4];
///             lane.all_reduce(buf, ReduceOp::Sum).wait_timeout(std::time::Duration::from_secs(30)).unwrap()
///         })
///     })
///     .collect();
/// for h in handles {
///     assert_eq!(h.join().unwrap(), vec![3.0; 4]);
/// }
/// ```
#[derive(Clone)]
pub struct Communicator {
    inner: Arc<CommInner>,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.rank())
            .field("world", &self.world())
            .field("transport", &self.inner.transport.name())
            .finish()
    }
}

impl Communicator {
    /// A communicator over `transport`; `topology` must have the transport's world size.
    pub fn new(
        transport: Arc<dyn Transport>,
        topology: Topology,
        opts: CommOptions,
    ) -> Result<Self, CollectiveError> {
        Self::build(transport, topology, opts, None)
    }

    fn build(
        transport: Arc<dyn Transport>,
        topology: Topology,
        opts: CommOptions,
        kind: Option<String>,
    ) -> Result<Self, CollectiveError> {
        let (rank, world) = (transport.rank(), transport.world());
        if topology.world() != world || rank >= world {
            return Err(CollectiveError::InvalidArgument(format!(
                "topology has {} ranks, transport has world {world} (rank {rank})",
                topology.world()
            )));
        }
        let shared = Arc::new(Shared {
            rank,
            world,
            topology,
            opts,
            cancel: AtomicBool::new(false),
            reason: Mutex::new(None),
            recent: crate::recent::RecentOps::default(),
            sent: AtomicU64::new(0),
        });
        Ok(Communicator {
            inner: Arc::new(CommInner {
                transport,
                shared,
                lanes: Mutex::new(HashMap::new()),
                pool: BufferPool::default(),
                kind,
                children: Mutex::new(Vec::new()),
            }),
        })
    }

    /// The communicator of the group `members` (this communicator's ranks, in the group's
    /// order; they must include this rank) of kind `kind` (COMM-3). Every rank makes the
    /// groups of the same kinds (their lanes are the parent's lanes `"{kind}:{name}"`, which
    /// every rank opens), the groups of one kind having disjoint members (GROUP-2). Cheap:
    /// the lanes open as they are used.
    ///
    /// ```
    /// use shardline_collectives::{local_group, ReduceOp};
    /// let comms = local_group(4).unwrap();
    /// let handles: Vec<_> = comms
    ///     .into_iter()
    ///     .map(|comm| {
    ///         std::thread::spawn(move || {
    ///             // Ranks {0, 1} and {2, 3}.
    ///             let first = comm.rank() / 2 * 2;
    ///             let pair = comm.subgroup("pair", &[first, first + 1]).unwrap();
    ///             let lane = pair.lane("sum").unwrap();
    ///             let buf = vec![comm.rank() as f32; 2];
    ///             let t = std::time::Duration::from_secs(30);
    ///             lane.all_reduce(buf, ReduceOp::Sum).wait_timeout(t).unwrap()
    ///         })
    ///     })
    ///     .collect();
    /// let sums: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()[0]).collect();
    /// assert_eq!(sums, vec![1.0, 1.0, 5.0, 5.0]);
    /// ```
    pub fn subgroup(&self, kind: &str, members: &[usize]) -> Result<Self, CollectiveError> {
        let t = GroupTransport::new(Arc::clone(&self.inner.transport), kind, members)
            .map_err(|e| CollectiveError::InvalidArgument(e.to_string()))?;
        let topology =
            Topology::from_nodes(members.iter().map(|&r| self.topology().node_of(r)).collect());
        let opts = self.options().clone();
        let sub = Self::build(Arc::new(t), topology, opts, Some(kind.to_string()))?;
        self.inner.children.lock().unwrap_or_else(|e| e.into_inner()).push(sub.clone());
        if self.is_aborted() {
            sub.abort(&self.inner.shared.abort_reason());
        }
        Ok(sub)
    }

    /// A sub-group's kind ([`Communicator::subgroup`]); `None` for a communicator of its own.
    pub fn kind(&self) -> Option<&str> {
        self.inner.kind.as_deref()
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.inner.shared.rank
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.inner.shared.world
    }

    /// Placement of ranks on nodes.
    pub fn topology(&self) -> &Topology {
        &self.inner.shared.topology
    }

    /// The options this communicator was built with.
    pub fn options(&self) -> &CommOptions {
        &self.inner.shared.opts
    }

    /// Name of the transport ("local", "shm", "tcp").
    pub fn transport_name(&self) -> &'static str {
        self.inner.transport.name()
    }

    /// Opens (or returns the already open) lane `name`, with its own progress thread
    /// (COMM-2). All ranks must open the same lanes.
    pub fn lane(&self, name: &str) -> Result<Lane, CollectiveError> {
        let cell = {
            let mut lanes = self.inner.lanes.lock().unwrap_or_else(|e| e.into_inner());
            lanes.entry(name.to_string()).or_default().clone()
        };
        let mut slot = cell.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(l) = &*slot {
            return Ok(l.clone());
        }
        let deadline = config::deadline_after(self.inner.shared.opts.get_timeout());
        let links = self
            .inner
            .transport
            .open_lane(name, deadline)
            .map_err(|source| CollectiveError::Transport { lane: name.to_string(), source })?;
        // A sub-group's lane goes by its parent lane's name, in traces and reports.
        let full = match &self.inner.kind {
            Some(kind) => GroupTransport::parent_lane(kind, name),
            None => name.to_string(),
        };
        let lane = Lane::start(&full, self.inner.shared.clone(), links)?;
        *slot = Some(lane.clone());
        Ok(lane)
    }

    /// Fails every pending and later op on every lane with `Aborted { reason }` and poisons
    /// the peers, best effort (COMM-1). The first reason wins.
    pub fn abort(&self, reason: &str) {
        {
            let mut r = self.inner.shared.reason.lock().unwrap_or_else(|e| e.into_inner());
            if r.is_none() {
                *r = Some(reason.to_string());
            }
        }
        self.inner.shared.cancel.store(true, Ordering::Release);
        let cells: Vec<LaneCell> = {
            let lanes = self.inner.lanes.lock().unwrap_or_else(|e| e.into_inner());
            lanes.values().cloned().collect()
        };
        for cell in cells {
            // A lane still being opened is skipped: its ops see the cancel flag at issue.
            if let Ok(slot) = cell.try_lock() {
                if let Some(l) = &*slot {
                    l.poke_abort();
                }
            }
        }
        // COMM-3: the sub-groups run over the same links and stop with it.
        let children = self.inner.children.lock().unwrap_or_else(|e| e.into_inner()).clone();
        for c in children {
            c.abort(reason);
        }
    }

    /// True once [`Communicator::abort`] was called.
    pub fn is_aborted(&self) -> bool {
        self.inner.shared.cancel.load(Ordering::Acquire)
    }

    /// This rank's recent collectives over all lanes, oldest first (see [`crate::recent`]).
    pub fn recent_ops(&self) -> Vec<crate::recent::OpRecord> {
        self.inner.shared.recent.snapshot()
    }

    /// Over this communicator's lanes and its sub-groups' (COMM-3): whether any collective
    /// has ended without error, and how long the oldest one still running has run (`None`
    /// when none runs). What a watcher outside the rank reads to tell a rank waiting on its
    /// peers from one that computes.
    pub fn waits(&self) -> (bool, Option<std::time::Duration>) {
        let ops = self.recent_ops();
        let mut ended = ops.iter().any(|o| o.end.is_some() && !o.failed);
        let mut longest = ops.iter().filter(|o| o.end.is_none()).map(|o| o.start.elapsed()).max();
        let children = self.inner.children.lock().unwrap_or_else(|e| e.into_inner()).clone();
        for c in children {
            let (e, l) = c.waits();
            ended |= e;
            longest = longest.max(l);
        }
        (ended, longest)
    }

    /// Payload bytes this rank has sent on all of its lanes so far (LANE-8); a sub-group's
    /// lanes count in the sub-group's, not here (COMM-3).
    pub fn bytes_sent(&self) -> u64 {
        self.inner.shared.sent.load(Ordering::Acquire)
    }

    /// The communicator's buffer pool.
    pub fn pool(&self) -> &BufferPool {
        &self.inner.pool
    }
}

/// `world` communicators over one in-process fabric (ranks as threads), one node, default
/// options.
pub fn local_group(world: usize) -> Result<Vec<Communicator>, CollectiveError> {
    local_group_with_topology(Topology::single_node(world), CommOptions::default())
}

/// Like [`local_group`] with an explicit (possibly simulated multi-node) topology and options.
pub fn local_group_with_topology(
    topology: Topology,
    opts: CommOptions,
) -> Result<Vec<Communicator>, CollectiveError> {
    let world = topology.world();
    if world == 0 {
        return Err(CollectiveError::InvalidArgument("a group needs at least one rank".into()));
    }
    let fabric = LocalFabric::with_link_rate(world, opts.get_link_rate());
    (0..world)
        .map(|r| {
            let t: Arc<dyn Transport> =
                Arc::new(LocalTransport::new(fabric.clone(), r, opts.get_spin()));
            Communicator::new(t, topology.clone(), opts.clone())
        })
        .collect()
}
