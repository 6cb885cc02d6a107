//! The verbs shim of the RDMA transport (feature `rdma`), on `sideway` (rdma-core loaded at
//! run time). What is here: device discovery with a clear `DeviceUnavailable` setup error
//! where no RDMA device exists, and the connection data each rank publishes through the
//! store (QP number, LID, GID, PSN, slot ring address and key).
//!
//! Not here yet: queue-pair bring-up (INIT -> RTR -> RTS), buffer registration and the
//! completion loop that drives [`super::proto::LinkProto`]; `open_lane` says so with a setup
//! error instead of pretending. The protocol those will carry is complete and tested in
//! [`super::proto`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use sideway::ibverbs::device::{DeviceInfo, DeviceList};

use crate::store::Store;
use crate::transport::{LaneLinks, Transport, TransportError};

/// The setup error of a host without an RDMA device, with the cause reported by verbs.
pub fn device_unavailable(cause: &str) -> TransportError {
    TransportError::Setup(format!(
        "DeviceUnavailable: no RDMA device (ibv_get_device_list: {cause})"
    ))
}

/// Names of the RDMA devices on this host; `DeviceUnavailable` (as a setup error) when
/// there are none or rdma-core cannot list them (ENOSYS in a container without it).
pub fn devices() -> Result<Vec<String>, TransportError> {
    let list = DeviceList::new().map_err(|e| {
        let cause = match std::error::Error::source(&e) {
            Some(s) => s.to_string(),
            None => e.to_string(),
        };
        device_unavailable(&cause)
    })?;
    let names: Vec<String> = list.iter().map(|d| d.name()).collect();
    if names.is_empty() {
        return Err(device_unavailable("0 devices"));
    }
    Ok(names)
}

/// What one side of a link publishes in the store for its peer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnInfo {
    /// Queue pair number.
    pub qpn: u32,
    /// Port LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// Port GID (RoCE and routed InfiniBand).
    pub gid: [u8; 16],
    /// Initial packet sequence number (24 bits).
    pub psn: u32,
    /// Virtual address of the receive slot ring.
    pub addr: u64,
    /// Remote key of the slot ring's memory region.
    pub rkey: u32,
}

impl ConnInfo {
    /// Bytes on the store.
    pub const WIRE_BYTES: usize = 4 + 2 + 16 + 4 + 8 + 4;

    /// Little-endian encoding for the store.
    pub fn encode(&self) -> Vec<u8> {
        let mut v = Vec::with_capacity(Self::WIRE_BYTES);
        v.extend_from_slice(&self.qpn.to_le_bytes());
        v.extend_from_slice(&self.lid.to_le_bytes());
        v.extend_from_slice(&self.gid);
        v.extend_from_slice(&self.psn.to_le_bytes());
        v.extend_from_slice(&self.addr.to_le_bytes());
        v.extend_from_slice(&self.rkey.to_le_bytes());
        v
    }

    /// Decodes [`ConnInfo::encode`]'s bytes; a wrong length is a setup error.
    pub fn decode(b: &[u8]) -> Result<Self, TransportError> {
        if b.len() != Self::WIRE_BYTES {
            return Err(TransportError::Setup(format!(
                "rdma connection data of {} bytes, want {}",
                b.len(),
                Self::WIRE_BYTES
            )));
        }
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[6..22]);
        let mut a = [0u8; 8];
        a.copy_from_slice(&b[26..34]);
        Ok(ConnInfo {
            qpn: u32_at(0),
            lid: u16::from_le_bytes([b[4], b[5]]),
            gid,
            psn: u32_at(22),
            addr: u64::from_le_bytes(a),
            rkey: u32_at(34),
        })
    }
}

/// The RDMA transport of one rank.
pub struct RdmaTransport {
    rank: usize,
    world: usize,
    device: String,
    #[allow(dead_code)]
    store: Arc<dyn Store>,
    #[allow(dead_code)]
    timeout: Duration,
}

impl RdmaTransport {
    /// Opens the first RDMA device (or `device` by name). On a host without one this is
    /// `Setup("DeviceUnavailable: no RDMA device (...)")`, and the launcher falls back to tcp.
    pub fn open(
        rank: usize,
        world: usize,
        store: Arc<dyn Store>,
        device: Option<&str>,
        timeout: Duration,
    ) -> Result<Self, TransportError> {
        let names = devices()?;
        let device = match device {
            Some(want) => names.iter().find(|n| n.as_str() == want).cloned().ok_or_else(|| {
                device_unavailable(&format!("no device named {want} in {names:?}"))
            })?,
            None => names[0].clone(),
        };
        Ok(RdmaTransport { rank, world, device, store, timeout })
    }

    /// The device in use.
    pub fn device(&self) -> &str {
        &self.device
    }
}

impl Transport for RdmaTransport {
    fn name(&self) -> &'static str {
        "rdma"
    }

    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn open_lane(
        &self,
        lane: &str,
        _deadline: Instant,
    ) -> Result<Box<dyn LaneLinks>, TransportError> {
        Err(TransportError::Setup(format!(
            "rdma lane '{lane}' on {}: queue-pair bring-up is not implemented yet (use tcp)",
            self.device
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemStore;

    #[test]
    fn connection_data_round_trips_and_rejects_a_wrong_length() {
        let c = ConnInfo {
            qpn: 0x12_3456,
            lid: 7,
            gid: [9; 16],
            psn: 0xAB_CDEF,
            addr: 1 << 40,
            rkey: 42,
        };
        let b = c.encode();
        assert_eq!(b.len(), ConnInfo::WIRE_BYTES);
        assert_eq!(ConnInfo::decode(&b), Ok(c));
        assert!(ConnInfo::decode(&b[1..]).is_err());
    }

    #[test]
    fn without_a_device_opening_is_device_unavailable() {
        let store: Arc<dyn Store> = Arc::new(MemStore::new());
        match RdmaTransport::open(0, 1, store, None, Duration::from_secs(1)) {
            Ok(t) => println!("RDMA device present: {}", t.device()),
            Err(TransportError::Setup(msg)) => {
                println!("{msg}");
                assert!(msg.starts_with("DeviceUnavailable: no RDMA device"), "{msg}");
            }
            Err(e) => panic!("expected a DeviceUnavailable setup error, got {e}"),
        }
    }
}
