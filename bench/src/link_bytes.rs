//! Bytes that crossed between namespace nodes, read at the nodes' network interfaces, and the
//! final loss of a launched job's log: what `overlap --nodes` adds to a row so that
//! `bench/scale-table.sh` compares sharding modes by measured traffic, not formulas.
//!
//! Every byte a node sends to another leaves through its veth (the only interface besides
//! `lo`; ranks of one node talk over shared memory, which no interface sees), so the sum of
//! the veth transmit counters over the nodes, before and after a job, is the job's traffic
//! across nodes: payload with its TCP/IP headers, and the rendezvous store's and the agents'
//! heartbeats, which are small beside a step's collectives.
//!
//! Invariant:
//! - LINKB-1: a node's count is the sum of the transmit byte counters of its interfaces
//!   other than `lo`, as `ip -s -j link show` reports them.

use anyhow::Context;
use std::path::Path;

/// Transmit bytes of the interfaces in `json` (`ip -s -j link show`) other than `lo`
/// (LINKB-1).
pub fn tx_bytes(json: &str) -> anyhow::Result<u64> {
    let links: Vec<serde_json::Value> =
        serde_json::from_str(json).context("parsing `ip -s -j link show`")?;
    let mut sum = 0;
    for l in links.iter().filter(|l| l["ifname"].as_str() != Some("lo")) {
        sum += l["stats64"]["tx"]["bytes"]
            .as_u64()
            .with_context(|| format!("no stats64.tx.bytes for {}", l["ifname"]))?;
    }
    Ok(sum)
}

/// The transmit bytes of every node's interfaces but `lo`, summed (LINKB-1).
pub fn nodes_tx_bytes(net: &shardline_tests::netns::Net) -> anyhow::Result<u64> {
    let mut sum = 0;
    for k in 0..net.nodes() {
        let out = std::process::Command::new("ip")
            .args(["-n", net.namespace(k), "-s", "-j", "link", "show"])
            .output()
            .context("running ip -s -j link show")?;
        anyhow::ensure!(out.status.success(), "ip -n {} link show failed", net.namespace(k));
        sum += tx_bytes(&String::from_utf8_lossy(&out.stdout))?;
    }
    Ok(sum)
}

/// The loss of the last line of a `--log-json` file.
pub fn final_loss(path: &Path) -> anyhow::Result<f64> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let last = text.lines().rfind(|l| !l.trim().is_empty()).context("an empty log")?;
    let v: serde_json::Value = serde_json::from_str(last)?;
    v["loss"].as_f64().with_context(|| format!("log line without loss: {v}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// LINKB-1: `lo` is left out; every other interface's transmit bytes count.
    #[test]
    fn veth_bytes_leave_out_loopback_linkb_1() {
        let json = r#"[{"ifname":"lo","stats64":{"tx":{"bytes":500}}},
            {"ifname":"slbi1-0","stats64":{"tx":{"bytes":1200}}},
            {"ifname":"eth1","stats64":{"tx":{"bytes":34}}}]"#;
        assert_eq!(tx_bytes(json).unwrap(), 1234);
        assert!(tx_bytes(r#"[{"ifname":"x","stats64":{}}]"#).is_err());
    }
}
