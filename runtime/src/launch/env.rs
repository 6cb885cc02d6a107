//! Where a worker stands in its job, read from the launch environment (`shardline launch`,
//! torchrun, Slurm).

use crate::error::{Result, RuntimeError};

/// Where one worker process stands in its job.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorkerEnv {
    /// Global rank.
    pub rank: usize,
    /// Number of ranks.
    pub world: usize,
    /// Rank among the processes of this node (as the launcher numbered them).
    pub local_rank: usize,
    /// Processes on this node (as the launcher numbered them).
    pub local_world: usize,
    /// This node's id: ranks with equal ids share memory (LAUNCH-2).
    pub node: String,
    /// Rendezvous store address, `HOST:PORT`.
    pub rdzv: String,
    /// Job token presented to the store.
    pub token: String,
    /// Job name (store keys, shm segment names).
    pub job: String,
    /// Which store the job meets in, and whether this process serves it.
    pub store: StoreAt,
    /// Which convention the variables followed: `shardline`, `torchrun` or `slurm`.
    pub source: &'static str,
    /// Restart generation of the worker group (`SHARDLINE_GENERATION`, 0 for the first
    /// start; LAUNCH-7).
    pub generation: u64,
    /// `shardline launch --live-recovery` (`SHARDLINE_LIVE=1`): a failed peer is replaced in
    /// place and the survivors go on without restarting (LIVE-4).
    pub live: bool,
    /// A replacement's communicator generation to join (`SHARDLINE_LIVE_EPOCH`, set by the
    /// agent that started it in place of a failed worker); `None` for a worker started with
    /// its group.
    pub live_epoch: Option<u64>,
    /// The communicator epoch this worker is in (LIVE-4): 0 unless live recovery moved on.
    pub epoch: u64,
}

impl WorkerEnv {
    /// The name the ranks meet under in this epoch: store keys of the rendezvous and the
    /// checkpoints, links and shm segments (LIVE-4).
    pub fn meeting(&self) -> String {
        super::live::epoch_job(&self.job, self.epoch)
    }
}

/// Where a job's rendezvous store is, as seen from one worker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreAt {
    /// Shardline's own store, hosted by this process at `rdzv`'s port (rank 0 under Slurm or
    /// a torchrun-style environment without an agent store).
    Host,
    /// Shardline's own store, hosted by another process (`shardline launch`'s agent of node
    /// 0, or rank 0).
    Connect,
    /// The torch `TCPStore` that torchrun's agent serves at `MASTER_ADDR:MASTER_PORT`
    /// (`TORCHELASTIC_USE_AGENT_STORE=True`); nobody binds a second store on its port.
    TorchAgent,
}

/// Makes `s` safe inside store keys and shm segment names.
fn job_label(s: &str) -> String {
    s.chars().map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '_' }).collect()
}

fn parse_var(get: &dyn Fn(&str) -> Option<String>, name: &str) -> Result<Option<usize>> {
    match get(name) {
        None => Ok(None),
        Some(v) => v.trim().parse::<usize>().map(Some).map_err(|_| {
            RuntimeError::config(format!("{name}={v:?} is not a non-negative integer"))
        }),
    }
}

fn need(get: &dyn Fn(&str) -> Option<String>, name: &str) -> Result<usize> {
    parse_var(get, name)?
        .ok_or_else(|| RuntimeError::config(format!("launch environment without {name}")))
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "localhost".into())
}

impl WorkerEnv {
    /// Reads a launch environment through `get` (the process environment in
    /// [`WorkerEnv::from_env`]); `Ok(None)` when none is present.
    pub fn from_vars(get: &dyn Fn(&str) -> Option<String>) -> Result<Option<Self>> {
        let token = || {
            get("SHARDLINE_TOKEN").filter(|t| !t.is_empty()).ok_or_else(|| {
                RuntimeError::config(
                    "SHARDLINE_TOKEN must be set: the store refuses peers without the job token",
                )
            })
        };
        let master = || -> Option<String> {
            Some(format!("{}:{}", get("MASTER_ADDR")?, get("MASTER_PORT")?))
        };
        let (rank, world, local_rank, local_world, node, rdzv, store, source);
        let (mut job, mut generation) = (get("SHARDLINE_JOB"), None);
        if get("SHARDLINE_RANK").is_some() {
            rank = need(get, "SHARDLINE_RANK")?;
            world = need(get, "SHARDLINE_WORLD_SIZE")?;
            local_rank = need(get, "SHARDLINE_LOCAL_RANK")?;
            local_world = need(get, "SHARDLINE_LOCAL_WORLD_SIZE")?;
            node = need(get, "SHARDLINE_NODE_RANK")?.to_string();
            rdzv = get("SHARDLINE_RDZV")
                .ok_or_else(|| RuntimeError::config("launch environment without SHARDLINE_RDZV"))?;
            store = StoreAt::Connect;
            source = "shardline";
        } else if get("RANK").is_some() && get("WORLD_SIZE").is_some() {
            rank = need(get, "RANK")?;
            world = need(get, "WORLD_SIZE")?;
            local_rank = parse_var(get, "LOCAL_RANK")?.unwrap_or(rank);
            local_world = parse_var(get, "LOCAL_WORLD_SIZE")?.unwrap_or(world);
            node = get("GROUP_RANK").or_else(|| get("NODE_RANK")).unwrap_or_else(host_name);
            rdzv = master().ok_or_else(|| {
                RuntimeError::config("torchrun-style environment without MASTER_ADDR/MASTER_PORT")
            })?;
            let agent_store = get("TORCHELASTIC_USE_AGENT_STORE")
                .is_some_and(|v| v.eq_ignore_ascii_case("true") || v == "1");
            store = match (agent_store, rank) {
                (true, _) => StoreAt::TorchAgent,
                (false, 0) => StoreAt::Host,
                (false, _) => StoreAt::Connect,
            };
            // LAUNCH-11: torchrun's run id and restart count name the job, so that two jobs
            // on one host, or two attempts of one job, share no keys or segments.
            let restart = parse_var(get, "TORCHELASTIC_RESTART_COUNT")?;
            if let Some(r) = restart {
                let base =
                    job.take().or_else(|| get("TORCHELASTIC_RUN_ID").map(|id| job_label(&id)));
                job = Some(format!("{}g{r}", base.unwrap_or_else(|| "job".into())));
                generation = Some(r as u64);
            }
            source = "torchrun";
        } else if get("SLURM_PROCID").is_some() && get("SLURM_NTASKS").is_some() {
            rank = need(get, "SLURM_PROCID")?;
            world = need(get, "SLURM_NTASKS")?;
            local_rank = parse_var(get, "SLURM_LOCALID")?.unwrap_or(0);
            local_world = super::slurm::local_world(get)?.unwrap_or(0);
            node = get("SLURM_NODEID").unwrap_or_else(host_name);
            rdzv = super::slurm::store_address(get)?;
            store = if rank == 0 { StoreAt::Host } else { StoreAt::Connect };
            source = "slurm";
        } else {
            return Ok(None);
        }
        if world == 0 || rank >= world {
            return Err(RuntimeError::config(format!("rank {rank} out of world size {world}")));
        }
        let job = job.unwrap_or_else(|| "job".into());
        let generation = match generation {
            Some(g) => g,
            None => parse_var(get, "SHARDLINE_GENERATION")?.unwrap_or(0) as u64,
        };
        let live = source == "shardline" && get("SHARDLINE_LIVE").is_some_and(|v| v == "1");
        let live_epoch = match live {
            true => parse_var(get, "SHARDLINE_LIVE_EPOCH")?.map(|e| e as u64),
            false => None,
        };
        Ok(Some(WorkerEnv {
            live,
            live_epoch,
            epoch: 0,
            generation,
            rank,
            world,
            local_rank,
            local_world,
            node,
            rdzv,
            token: token()?,
            job,
            store,
            source,
        }))
    }

    /// [`WorkerEnv::from_vars`] over the process environment.
    pub fn from_env() -> Result<Option<Self>> {
        Self::from_vars(&|k| std::env::var(k).ok())
    }
}
