//! Which transport a multi-process job uses, and why.
//!
//! `auto` composes the hierarchy: shared memory between the ranks of a node and, across
//! nodes, RDMA when the binary has the `rdma` feature and a device opens on every rank, else
//! TCP, said once in a note: `no RDMA device (...): using tcp across nodes`. An explicit
//! `tcp`, `rdma` or `shm` carries every pair of ranks over that one transport. Device
//! buffers inside a node go over NCCL when the `cuda` feature is on and a GPU is present;
//! otherwise the note says why not (the engine trains on host buffers either way).
//!
//! Invariants (cited by the tests):
//! - SEL-1: every rank of a job selects the same carriers: the RDMA probe result is agreed
//!   through the store, and one rank without a device sends every rank to TCP across nodes.
//! - SEL-2: `auto` never fails for want of RDMA (it falls back, with one note naming the
//!   cause); an explicit `rdma` does fail, with that cause, and `shm` across nodes is refused.
//! - SEL-3: NCCL is chosen for device buffers inside a node only when the cuda feature is on
//!   and a GPU answers; otherwise the reason is given.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use super::hybrid::HybridTransport;
use super::shm::ShmTransport;
use super::tcp::{TcpOptions, TcpTransport};
use super::{Transport, TransportError};
use crate::store::Store;
use crate::topology::Topology;

/// What the user asked for (`--transport`, `SHARDLINE_TRANSPORT`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TransportChoice {
    /// Shared memory inside a node, RDMA or TCP across nodes.
    #[default]
    Auto,
    /// TCP between every pair of ranks.
    Tcp,
    /// RDMA between every pair of ranks (fails without a device).
    Rdma,
    /// Shared memory between every pair of ranks (one node only).
    Shm,
}

impl FromStr for TransportChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => Ok(TransportChoice::Auto),
            "tcp" => Ok(TransportChoice::Tcp),
            "rdma" => Ok(TransportChoice::Rdma),
            "shm" => Ok(TransportChoice::Shm),
            other => Err(format!("unknown transport {other:?} (auto, tcp, rdma, shm)")),
        }
    }
}

impl fmt::Display for TransportChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TransportChoice::Auto => "auto",
            TransportChoice::Tcp => "tcp",
            TransportChoice::Rdma => "rdma",
            TransportChoice::Shm => "shm",
        })
    }
}

impl TransportChoice {
    /// `SHARDLINE_TRANSPORT` (what `shardline launch --transport` passes to its workers);
    /// `auto` when unset.
    pub fn from_env() -> Result<Self, String> {
        match std::env::var("SHARDLINE_TRANSPORT") {
            Ok(v) => v.parse(),
            Err(_) => Ok(TransportChoice::Auto),
        }
    }
}

/// A transport carrying some pairs of ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Carrier {
    /// Shared memory.
    Shm,
    /// TCP sockets.
    Tcp,
    /// RDMA over verbs.
    Rdma,
}

/// Whether NCCL could carry device (GPU) buffers inside a node. Training does not use it
/// yet: its buffers live in host memory, so [`Selection::describe`] says so.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceLanes {
    /// NCCL and a GPU are present.
    Nccl,
    /// Staged through host memory over the host carriers; the reason NCCL is not used.
    Host(String),
}

/// The outcome of the selection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Selection {
    /// Carrier between ranks of one node (`None`: no node has two ranks).
    pub intra: Option<Carrier>,
    /// Carrier between ranks of different nodes (`None`: one node).
    pub inter: Option<Carrier>,
    /// Device buffers inside a node.
    pub device: DeviceLanes,
    /// Lines to print once (rank 0): fallbacks and their causes.
    pub notes: Vec<String>,
}

impl Selection {
    /// One line describing the selection: `shm inside nodes, tcp across; device buffers: ...`.
    pub fn describe(&self) -> String {
        let name = |c: Option<Carrier>| match c {
            Some(Carrier::Shm) => "shm",
            Some(Carrier::Tcp) => "tcp",
            Some(Carrier::Rdma) => "rdma",
            None => "-",
        };
        let device = match &self.device {
            // NCCL carries nothing in training yet: say so rather than imply it does.
            DeviceLanes::Nccl => {
                "nccl available but unused (training buffers live in host memory)".to_string()
            }
            DeviceLanes::Host(why) => format!("host ({why})"),
        };
        format!(
            "{} inside nodes, {} across; device buffers: {device}",
            name(self.intra),
            name(self.inter)
        )
    }
}

/// The cause inside a `DeviceUnavailable: no RDMA device (CAUSE)` message, or the message.
pub fn rdma_cause(msg: &str) -> String {
    const HEAD: &str = "no RDMA device (";
    match (msg.find(HEAD), msg.rfind(')')) {
        (Some(i), Some(j)) if j > i + HEAD.len() => msg[i + HEAD.len()..j].to_string(),
        _ => msg.to_string(),
    }
}

/// Decides the carriers (pure: the probes' answers are inputs). `rdma` is whether RDMA
/// opened on every rank (`Err(cause)` else), asked only when needed; `gpu` whether a GPU
/// and NCCL answer on this host.
pub fn select(
    choice: TransportChoice,
    topology: &Topology,
    rdma: &mut dyn FnMut() -> Result<(), String>,
    gpu: &dyn Fn() -> Result<(), String>,
) -> Result<Selection, String> {
    let multi_node = topology.nodes() > 1;
    let shared_node = (0..topology.nodes()).any(|n| topology.ranks_on_node(n).len() > 1);
    let mut notes = Vec::new();
    let (intra, inter) = match choice {
        TransportChoice::Auto => {
            let inter = if multi_node {
                match rdma() {
                    Ok(()) => Some(Carrier::Rdma),
                    Err(cause) => {
                        notes.push(format!("no RDMA device ({cause}): using tcp across nodes"));
                        Some(Carrier::Tcp)
                    }
                }
            } else {
                None
            };
            (shared_node.then_some(Carrier::Shm), inter)
        }
        TransportChoice::Tcp => {
            (shared_node.then_some(Carrier::Tcp), multi_node.then_some(Carrier::Tcp))
        }
        TransportChoice::Rdma => {
            rdma().map_err(|cause| format!("--transport rdma: no RDMA device ({cause})"))?;
            (shared_node.then_some(Carrier::Rdma), multi_node.then_some(Carrier::Rdma))
        }
        TransportChoice::Shm => {
            if multi_node {
                return Err(format!(
                    "--transport shm: shared memory cannot reach across {} nodes (use auto or tcp)",
                    topology.nodes()
                ));
            }
            (shared_node.then_some(Carrier::Shm), None)
        }
    };
    let device = match gpu() {
        Ok(()) => DeviceLanes::Nccl,
        Err(why) => DeviceLanes::Host(why),
    };
    Ok(Selection { intra, inter, device, notes })
}

/// Whether NCCL could carry device buffers on this host: the cuda feature, the libraries
/// and at least one GPU (SEL-3).
pub fn probe_gpu() -> Result<(), String> {
    #[cfg(feature = "cuda")]
    {
        crate::nccl::check_libraries().map_err(|e| e.to_string())?;
        match cudarc::driver::CudaContext::device_count() {
            Ok(n) if n > 0 => Ok(()),
            Ok(_) => Err("no GPU (0 CUDA devices)".into()),
            Err(e) => Err(format!("no GPU ({e:?})")),
        }
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err("built without the cuda feature".into())
    }
}

/// Opens this rank's RDMA transport over the whole world, or says why not.
fn open_rdma(
    rank: usize,
    world: usize,
    store: &Arc<dyn Store>,
    job: &str,
) -> Result<Arc<dyn Transport>, String> {
    #[cfg(feature = "rdma")]
    {
        let opts = super::rdma::verbs::RdmaOptions { job: job.to_string(), ..Default::default() };
        super::rdma::verbs::RdmaTransport::with_options(rank, world, Arc::clone(store), opts)
            .map(|t| Arc::new(t) as Arc<dyn Transport>)
            .map_err(|e| rdma_cause(&e.to_string()))
    }
    #[cfg(not(feature = "rdma"))]
    {
        let _ = (rank, world, store, job);
        Err("built without the rdma feature".into())
    }
}

/// Publishes this rank's RDMA probe and reads every rank's (SEL-1): `Ok` only when every
/// rank opened a device, else the first failing rank's cause.
fn agree(
    store: &Arc<dyn Store>,
    job: &str,
    rank: usize,
    world: usize,
    mine: &Result<Arc<dyn Transport>, String>,
    timeout: Duration,
) -> Result<(), String> {
    let key = |r: usize| format!("select/{job}/rdma/{r}");
    let value = match mine {
        Ok(_) => "ok".to_string(),
        Err(cause) => format!("no {cause}"),
    };
    store.set(&key(rank), value.as_bytes()).map_err(|e| format!("store: {e}"))?;
    for r in 0..world {
        let v = store.get(&key(r), timeout).map_err(|e| format!("store: {e}"))?;
        let v = String::from_utf8_lossy(&v);
        if let Some(cause) = v.strip_prefix("no ") {
            return Err(if r == rank { cause.to_string() } else { format!("rank {r}: {cause}") });
        }
    }
    Ok(())
}

/// Selects (as [`select`], with the probes run for real and agreed through the store) and
/// builds this rank's transport. `tcp` is used for every TCP part (its job is set to `job`);
/// shm segments and store keys are namespaced by `job`.
pub fn open_for_job(
    choice: TransportChoice,
    rank: usize,
    topology: &Topology,
    store: Arc<dyn Store>,
    job: &str,
    mut tcp: TcpOptions,
    timeout: Duration,
) -> Result<(Arc<dyn Transport>, Selection), TransportError> {
    let world = topology.world();
    if rank >= world {
        return Err(TransportError::Setup(format!("rank {rank} out of world {world}")));
    }
    let mut rdma_part: Option<Arc<dyn Transport>> = None;
    let mut probe = || {
        let mine = open_rdma(rank, world, &store, job);
        let agreed = agree(&store, job, rank, world, &mine, timeout);
        if agreed.is_ok() {
            rdma_part = mine.ok();
        }
        agreed
    };
    let sel = select(choice, topology, &mut probe, &probe_gpu).map_err(TransportError::Setup)?;
    tcp.job(job);
    let whole = |c: Carrier| -> Result<Arc<dyn Transport>, TransportError> {
        Ok(match c {
            Carrier::Tcp => {
                Arc::new(TcpTransport::new(rank, world, Arc::clone(&store), tcp.clone())?)
            }
            Carrier::Shm => Arc::new(ShmTransport::new(rank, world, Arc::clone(&store), job)?),
            Carrier::Rdma => rdma_part
                .clone()
                .ok_or_else(|| TransportError::Setup("rdma transport missing".into()))?,
        })
    };
    let transport: Arc<dyn Transport> = match (choice, sel.intra, sel.inter) {
        (TransportChoice::Auto, intra, inter) => {
            let node = topology.node_of(rank);
            let intra_part: Option<Arc<dyn Transport>> = match (intra, topology.local_world(rank)) {
                (Some(_), lw) if lw > 1 => Some(Arc::new(ShmTransport::new(
                    topology.local_rank(rank),
                    lw,
                    Arc::clone(&store),
                    &format!("{job}-n{node}"),
                )?)),
                _ => None,
            };
            let inter_part = match inter {
                Some(c) => Some(whole(c)?),
                None => None,
            };
            Arc::new(HybridTransport::from_parts(rank, topology, intra_part, inter_part)?)
        }
        (TransportChoice::Tcp, ..) => whole(Carrier::Tcp)?,
        (TransportChoice::Rdma, ..) => whole(Carrier::Rdma)?,
        (TransportChoice::Shm, ..) => whole(Carrier::Shm)?,
    };
    Ok((transport, sel))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::Sink;
    use crate::transport::{RecvOp, SendOp, Tag};
    use crate::MemStore;
    use std::sync::atomic::AtomicBool;
    use std::time::Instant;

    const NO_DEVICE: &str = "ibv_get_device_list: Function not implemented (os error 38)";

    fn no_gpu() -> Result<(), String> {
        Err("built without the cuda feature".into())
    }

    #[test]
    fn auto_falls_back_to_tcp_across_nodes_saying_why_once() {
        // SEL-2 with a fake probe that finds no device.
        let topo = Topology::uniform(2, 2);
        let mut asked = 0;
        let mut probe = || {
            asked += 1;
            Err(NO_DEVICE.to_string())
        };
        let sel = select(TransportChoice::Auto, &topo, &mut probe, &no_gpu).unwrap();
        assert_eq!(asked, 1);
        assert_eq!(sel.intra, Some(Carrier::Shm));
        assert_eq!(sel.inter, Some(Carrier::Tcp));
        assert_eq!(
            sel.notes,
            vec![format!("no RDMA device ({NO_DEVICE}): using tcp across nodes")]
        );
        assert_eq!(sel.device, DeviceLanes::Host("built without the cuda feature".into()));
    }

    #[test]
    fn auto_takes_rdma_and_nccl_when_present() {
        // SEL-3 and the hierarchy: shm/NCCL inside, RDMA across, nothing to say.
        let topo = Topology::uniform(2, 4);
        let sel = select(TransportChoice::Auto, &topo, &mut || Ok(()), &|| Ok(())).unwrap();
        assert_eq!((sel.intra, sel.inter), (Some(Carrier::Shm), Some(Carrier::Rdma)));
        assert_eq!(sel.device, DeviceLanes::Nccl);
        assert!(sel.notes.is_empty());
        assert!(sel.describe().starts_with("shm inside nodes, rdma across"), "{}", sel.describe());
        // NCCL carries no training buffer yet, and the line must not claim it does.
        assert!(
            sel.describe().ends_with(
                "device buffers: nccl available but unused (training buffers live in host memory)"
            ),
            "{}",
            sel.describe()
        );
    }

    #[test]
    fn one_node_never_probes_rdma() {
        let topo = Topology::single_node(4);
        let mut probe = || -> Result<(), String> { panic!("probed RDMA for one node") };
        let sel = select(TransportChoice::Auto, &topo, &mut probe, &no_gpu).unwrap();
        assert_eq!((sel.intra, sel.inter), (Some(Carrier::Shm), None));
        assert!(sel.notes.is_empty());
    }

    #[test]
    fn explicit_choices_override_and_refuse_the_impossible() {
        // SEL-2
        let topo = Topology::uniform(2, 2);
        let fail = || Err(NO_DEVICE.to_string());
        let sel = select(TransportChoice::Tcp, &topo, &mut fail.clone(), &no_gpu).unwrap();
        assert_eq!((sel.intra, sel.inter), (Some(Carrier::Tcp), Some(Carrier::Tcp)));
        let e = select(TransportChoice::Rdma, &topo, &mut fail.clone(), &no_gpu).unwrap_err();
        assert!(e.contains(NO_DEVICE), "{e}");
        let sel = select(TransportChoice::Rdma, &topo, &mut || Ok(()), &no_gpu).unwrap();
        assert_eq!((sel.intra, sel.inter), (Some(Carrier::Rdma), Some(Carrier::Rdma)));
        assert!(select(TransportChoice::Shm, &topo, &mut fail.clone(), &no_gpu).is_err());
        let one = Topology::single_node(2);
        let sel = select(TransportChoice::Shm, &one, &mut fail.clone(), &no_gpu).unwrap();
        assert_eq!((sel.intra, sel.inter), (Some(Carrier::Shm), None));
    }

    #[test]
    fn choices_parse_and_print() {
        for c in [
            TransportChoice::Auto,
            TransportChoice::Tcp,
            TransportChoice::Rdma,
            TransportChoice::Shm,
        ] {
            assert_eq!(c.to_string().parse::<TransportChoice>(), Ok(c));
        }
        assert_eq!(" TCP ".parse::<TransportChoice>(), Ok(TransportChoice::Tcp));
        assert!("ib".parse::<TransportChoice>().is_err());
        assert_eq!(
            rdma_cause("DeviceUnavailable: no RDMA device (ibv_get_device_list: ENOSYS)"),
            "ibv_get_device_list: ENOSYS"
        );
        assert_eq!(rdma_cause("other"), "other");
    }

    #[test]
    fn auto_on_this_host_reaches_across_two_nodes_over_tcp() {
        // SEL-1 and SEL-2 for real: two ranks on two "nodes" of this machine; without an
        // RDMA device (or the feature) both agree on tcp, say so, and exchange data.
        let store: Arc<dyn Store> = Arc::new(MemStore::new());
        let topo = Topology::uniform(2, 1);
        let job = format!("sel{}", std::process::id());
        let (tx, rx) = std::sync::mpsc::channel();
        for rank in 0..2 {
            let (store, topo, job, tx) =
                (Arc::clone(&store), topo.clone(), job.clone(), tx.clone());
            std::thread::spawn(move || {
                let r = (|| -> Result<(Selection, Vec<u8>), TransportError> {
                    let (t, sel) = open_for_job(
                        TransportChoice::Auto,
                        rank,
                        &topo,
                        store,
                        &job,
                        TcpOptions::default(),
                        Duration::from_secs(20),
                    )?;
                    let deadline = Instant::now() + Duration::from_secs(20);
                    let mut links = t.open_lane("sel", deadline)?;
                    let data = vec![rank as u8 + 1; 64];
                    let mut got = vec![0u8; 64];
                    let mut sink = |off: usize, piece: &[u8]| {
                        got[off..off + piece.len()].copy_from_slice(piece)
                    };
                    let tag = Tag { lane: 1, seq: 0, kind: 0, count: 16, root: u32::MAX, step: 0 };
                    links.exchange(
                        tag,
                        &[SendOp { peer: 1 - rank, data: &data, copied: false }],
                        &mut [RecvOp { peer: 1 - rank, len: 64, sink: Sink::Fn(&mut sink) }],
                        deadline,
                        &AtomicBool::new(false),
                    )?;
                    Ok((sel, got))
                })();
                let _ = tx.send((rank, r));
            });
        }
        drop(tx);
        for _ in 0..2 {
            let (rank, r) = rx.recv_timeout(Duration::from_secs(60)).expect("rank hung");
            let (sel, got) = r.unwrap_or_else(|e| panic!("rank {rank}: {e}"));
            if sel.inter == Some(Carrier::Rdma) {
                println!("RDMA device present: {}", sel.describe());
            } else {
                assert_eq!(sel.inter, Some(Carrier::Tcp));
                assert_eq!(sel.notes.len(), 1, "{:?}", sel.notes);
                assert!(sel.notes[0].starts_with("no RDMA device ("), "{}", sel.notes[0]);
                assert!(sel.notes[0].ends_with("): using tcp across nodes"), "{}", sel.notes[0]);
                println!("rank {rank}: {}", sel.notes[0]);
            }
            assert_eq!(got, vec![(1 - rank) as u8 + 1; 64]);
        }
    }
}
