//! The shm transport reading messages in place from the sender's shared arena (SHM-6): this
//! test binary allocates through `arena::SharedArena`, so its large buffers are in the arena
//! and ranks (threads here; processes in `tests/tests/multiprocess.rs`) map it.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use shardline_collectives::arena::{self, SharedArena};
use shardline_collectives::testing::{conformance_grid, group_over, GridConfig};
use shardline_collectives::transport::shm::{ShmTransport, ARENA_READS};
use shardline_collectives::Algorithm;

#[global_allocator]
static ALLOC: SharedArena = SharedArena;

/// Whether this process's large buffers come from the arena (else the test says why it
/// skips).
fn arena_serves_large_buffers() -> bool {
    let big: Vec<f32> = vec![0.0; 1 << 20];
    let ok = arena::contains(big.as_ptr().cast(), big.len() * 4);
    if !ok {
        println!("skipped: the arena could not be set up here");
    }
    ok
}

fn group(w: usize) -> Vec<shardline_collectives::Communicator> {
    group_over(w, &|r, store| {
        Arc::new(ShmTransport::new(r, w, store, "arena-grid").expect("shm transport"))
    })
}

/// SHM-6 with every op, ReduceOp and algorithm against the naive reference (the grid's large
/// count, 4 MiB per buffer, goes through the arena path), and the path is really taken.
/// ARENA-3: this binary's global allocator is the arena, so an allocation inside it would
/// re-enter it and deadlock the grid.
#[test]
fn arena_path_passes_the_conformance_grid_shm_6() {
    if !arena_serves_large_buffers() {
        return;
    }
    let before = ARENA_READS.load(Ordering::Relaxed);
    let cfg = GridConfig {
        worlds: vec![2, 3, 4],
        algorithms: vec![Algorithm::Ring, Algorithm::Direct, Algorithm::Auto],
        large_worlds: vec![2, 3, 4],
        deadline: Duration::from_secs(120),
        ..Default::default()
    };
    conformance_grid(&group, &cfg);
    let reads = ARENA_READS.load(Ordering::Relaxed) - before;
    assert!(reads > 0, "no message was read in place");
    println!("{reads} messages read in place from a peer's arena");
}

/// SHM-5 on the in-place path: a sender that gives up on a message lying in its arena (its
/// deadline passes before the receiver comes) withdraws it and reuses the memory; the
/// receiver fails instead of delivering what the block holds by then.
#[test]
fn withdrawn_arena_message_is_never_delivered_shm_5() {
    use shardline_collectives::transport::{RecvOp, SendOp, Sink, Tag, Transport, TransportError};
    use shardline_collectives::MemStore;
    use std::sync::atomic::AtomicBool;
    use std::time::Instant;

    if !arena_serves_large_buffers() {
        return;
    }
    let store: Arc<dyn shardline_collectives::Store> = Arc::new(MemStore::new());
    let tag = Tag { lane: 1, seq: 1, kind: 1, count: 1, root: u32::MAX, step: 0 };
    let len = 1 << 20;
    let s2 = store.clone();
    let sender = std::thread::spawn(move || {
        let t = ShmTransport::new(0, 2, s2, "withdraw").expect("transport");
        let mut links = t.open_lane("l", Instant::now() + Duration::from_secs(20)).expect("lane");
        // Let the receiver finish opening (it marks the arena readable) first.
        std::thread::sleep(Duration::from_millis(100));
        let data = vec![7u8; len];
        let r = links.exchange(
            tag,
            &[SendOp { peer: 1, data: &data, copied: false }],
            &mut [],
            Instant::now() + Duration::from_millis(200),
            &AtomicBool::new(false),
        );
        // The block is freed and handed out again with other bytes, as a caller may.
        drop(data);
        let reused = vec![0xEEu8; len];
        std::thread::sleep(Duration::from_millis(800));
        drop(reused);
        drop(links);
        r.is_err()
    });
    let t = ShmTransport::new(1, 2, store, "withdraw").expect("transport");
    let mut links = t.open_lane("l", Instant::now() + Duration::from_secs(20)).expect("lane");
    std::thread::sleep(Duration::from_millis(600));
    let mut got = Vec::new();
    let mut sink = |_: usize, piece: &[u8]| got.extend_from_slice(piece);
    let before = ARENA_READS.load(Ordering::Relaxed);
    let r = links.exchange(
        tag,
        &[],
        &mut [RecvOp { peer: 0, len, sink: Sink::Fn(&mut sink) }],
        Instant::now() + Duration::from_secs(5),
        &AtomicBool::new(false),
    );
    let sender_failed = sender.join().expect("sender thread");
    assert!(sender_failed, "the sender's exchange should have timed out");
    assert!(ARENA_READS.load(Ordering::Relaxed) > before, "the message was not read in place");
    assert!(
        matches!(r, Err(TransportError::PeerLost { peer: 0, .. })),
        "a withdrawn message must fail the receive: {r:?}"
    );
}
