//! Ranks as separate processes over shm and tcp: the reduced conformance grid, and peers that
//! are killed, exit or hang in the middle of a collective (TR-4 end to end).

use std::time::{Duration, Instant};

use shardline_collectives::TcpStoreServer;
use shardline_tests::{env, Group, Outcome};

const EXE: &str = env!("CARGO_BIN_EXE_shardline-test-rank");
/// Deadline of every wait on the children (MP-1).
const DEADLINE: Duration = Duration::from_secs(180);

fn token() -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("tok-{}-{t}", std::process::id())
}

/// Spawns `world` ranks on a fresh store; returns the store (keep it alive) and the group.
fn launch(
    transport: &str,
    world: usize,
    scenario: &str,
    extra: &[(&str, String)],
) -> (TcpStoreServer, Group) {
    let tok = token();
    let server = TcpStoreServer::bind("127.0.0.1:0", &tok).expect("store server");
    let mut vars = vec![
        (env::TRANSPORT, transport.to_owned()),
        (env::STORE, server.addr().to_string()),
        (env::TOKEN, tok.clone()),
        (env::JOB, format!("mp-{scenario}-{world}-{tok}")),
        (env::SCENARIO, scenario.to_owned()),
    ];
    vars.extend(extra.iter().cloned());
    let group = Group::spawn(EXE, world, &vars).expect("spawning ranks");
    (server, group)
}

fn grid(transport: &str) {
    grid_worlds(transport, &[1, 2, 3, 4]);
}

fn grid_worlds(transport: &str, worlds: &[usize]) {
    for &world in worlds {
        let (_server, mut g) = launch(transport, world, "grid", &[]);
        let ranks: Vec<usize> = (0..world).collect();
        let out = g.wait_for(&ranks, DEADLINE, |o| o.done).unwrap_or_else(|e| panic!("{e}"));
        for r in &ranks {
            let o = &out[r];
            assert!(o.ok, "{transport} world {world} rank {r}: {:?}", o.error);
            assert!(o.cases > 0);
            // All-reduce, all-gather and broadcast results are bitwise equal on every rank.
            assert_eq!(o.checksum, out[&0].checksum, "{transport} world {world}: ranks differ");
        }
    }
}

/// MP-2
#[test]
fn shm_grid_multiprocess() {
    grid("shm");
}

/// MP-2
#[test]
fn tcp_grid_multiprocess() {
    grid("tcp");
}

/// MP-2 with 7 and 8 processes (up to 4 per core here).
#[test]
fn grid_multiprocess_w7_w8() {
    grid_worlds("shm", &[7, 8]);
    grid_worlds("tcp", &[7, 8]);
}

/// Every rank but `victim` ends with `PeerLost`, well inside the op timeout (a `Timeout`
/// would mean the loss went unnoticed), naming the victim, or naming a survivor that itself
/// failed for the victim and exited: over tcp a poison that cannot be written at a frame
/// boundary becomes a shutdown, so a neighbour may see that survivor's exit first. At least
/// one survivor names the victim.
fn assert_lost(out: &std::collections::HashMap<usize, Outcome>, victim: usize, what: &str) {
    for (r, o) in out {
        assert_eq!(o.error_kind.as_deref(), Some("PeerLost"), "{what}: rank {r}: {o:?}");
        let named = o.error_rank == Some(victim)
            || o.error_rank
                .and_then(|s| out.get(&s))
                .is_some_and(|so| so.error_rank == Some(victim));
        assert!(
            named,
            "{what}: rank {r} names neither rank {victim} nor a survivor that lost it: {o:?}"
        );
    }
    assert!(
        out.values().any(|o| o.error_rank == Some(victim)),
        "{what}: no survivor names rank {victim}: {out:?}"
    );
}

/// TR-4: SIGKILL one rank while all are looping over all-reduces.
fn killed_peer(transport: &str, world: usize, victim: usize) {
    // A long op timeout: only loss detection can end the survivors' ops in time.
    let extra = [(env::TIMEOUT_MS, "60000".to_owned())];
    let (_server, mut g) = launch(transport, world, "loop", &extra);
    let all: Vec<usize> = (0..world).collect();
    g.wait_for(&all, DEADLINE, |o| o.ready).unwrap_or_else(|e| panic!("{e}"));
    let killed_at = Instant::now();
    g.kill(victim);
    let others: Vec<usize> = all.into_iter().filter(|&r| r != victim).collect();
    let out = g
        .wait_for(&others, Duration::from_secs(50), |o| o.done)
        .unwrap_or_else(|e| panic!("{transport}: survivors did not report: {e}"));
    eprintln!("{transport} W={world}: loss reported {:?} after the kill", killed_at.elapsed());
    assert_lost(&out, victim, &format!("{transport} killed"));
}

#[test]
fn shm_killed_peer_is_reported_lost() {
    killed_peer("shm", 3, 1);
    killed_peer("shm", 2, 0);
}

#[test]
fn tcp_killed_peer_is_reported_lost() {
    killed_peer("tcp", 3, 1);
    killed_peer("tcp", 2, 0);
}

/// TR-4: a rank exits by itself in the middle of an op.
fn exiting_peer(transport: &str) {
    let victim = 2;
    let extra = [
        (env::TIMEOUT_MS, "60000".to_owned()),
        (env::VICTIM, victim.to_string()),
        (env::DIE_AFTER_MS, "30".to_owned()),
    ];
    let (_server, mut g) = launch(transport, 4, "loop", &extra);
    let out = g
        .wait_for(&[0, 1, 3], Duration::from_secs(50), |o| o.done)
        .unwrap_or_else(|e| panic!("{transport}: survivors did not report: {e}"));
    assert_lost(&out, victim, &format!("{transport} exited"));
}

#[test]
fn shm_exiting_peer_is_reported_lost() {
    exiting_peer("shm");
}

#[test]
fn tcp_exiting_peer_is_reported_lost() {
    exiting_peer("tcp");
}

/// TR-3 end to end: a rank that never joins makes the others time out naming a late peer
/// instead of hanging; the neighbour that waits on it directly names it.
fn hung_peer(transport: &str) {
    let victim = 1;
    let extra = [(env::TIMEOUT_MS, "1500".to_owned()), (env::VICTIM, victim.to_string())];
    let (_server, mut g) = launch(transport, 2, "hang", &extra);
    let out = g
        .wait_for(&[0], Duration::from_secs(60), |o| o.done)
        .unwrap_or_else(|e| panic!("{transport}: {e}"));
    let o = &out[&0];
    assert_eq!(o.error_kind.as_deref(), Some("Timeout"), "{o:?}");
    assert_eq!(o.error_rank, Some(victim), "{o:?}");
}

#[test]
fn shm_hung_peer_times_out() {
    hung_peer("shm");
}

#[test]
fn tcp_hung_peer_times_out() {
    hung_peer("tcp");
}

/// STORE-1 end to end: a rank with the wrong token never joins.
#[test]
fn rank_with_a_wrong_token_is_refused() {
    let server = TcpStoreServer::bind("127.0.0.1:0", "right").expect("store server");
    let vars = [
        (env::TRANSPORT, "tcp".to_owned()),
        (env::STORE, server.addr().to_string()),
        (env::TOKEN, "wrong".to_owned()),
        (env::JOB, "refused".to_owned()),
        (env::SCENARIO, "grid".to_owned()),
    ];
    let mut g = Group::spawn(EXE, 1, &vars).expect("spawn");
    let out =
        g.wait_for(&[0], Duration::from_secs(60), |o| o.done).unwrap_or_else(|e| panic!("{e}"));
    let o = &out[&0];
    assert!(!o.ok);
    assert!(o.error.as_deref().unwrap_or("").contains("refused"), "{o:?}");
}

/// A quick performance probe (not a test of timing): `cargo test -p shardline-tests --test
/// multiprocess probe -- --ignored --nocapture`.
#[test]
#[ignore]
fn probe_all_reduce_busbw() {
    for transport in ["shm", "tcp"] {
        for (bytes, iters) in [(4096usize, 2000usize), (1 << 20, 50), (64 << 20, 5)] {
            let world = 2;
            let extra =
                [(env::BENCH_BYTES, bytes.to_string()), (env::BENCH_ITERS, iters.to_string())];
            let (_server, mut g) = launch(transport, world, "bench", &extra);
            let out = g.wait_for(&[0, 1], DEADLINE, |o| o.done).unwrap_or_else(|e| panic!("{e}"));
            let o = &out[&0];
            assert!(o.ok, "{o:?}");
            let busbw = bytes as f64 * 2.0 * (world - 1) as f64 / world as f64 / o.time_us / 1e3;
            eprintln!(
                "{transport} W={world} {bytes:>9} B: {:>10.1} us  busbw {busbw:.2} GB/s",
                o.time_us
            );
        }
    }
}
