//! The transport test suite that every multi-rank transport runs (shm and tcp; ranks as
//! threads over a [`MemStore`]): TR-1 to TR-6 over all-to-all exchanges around the slot and
//! chunk sizes, tag and length mismatches, deadlines, cancel, poison and lost peers, and a
//! latency and bandwidth probe. Each transport's tests call these with a [`Factory`] of its
//! own.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use super::{LaneLinks, Poison, RecvOp, SendOp, Sink, Tag, Transport, TransportError};
use crate::store::{MemStore, Store};

/// The deadline of every exchange and rank of the suite.
pub(crate) const T: Duration = Duration::from_secs(20);

/// Makes the transport of `rank` of `world` over a shared store.
pub(crate) type Factory = dyn Fn(usize, usize, Arc<dyn Store>) -> Box<dyn Transport> + Sync;

/// Runs `f(rank, links)` on `world` threads, each with the lane "l" open; returns the
/// results in rank order. Fails (instead of hanging) after `T`.
pub(crate) fn run<R: Send + 'static>(
    make: &'static Factory,
    world: usize,
    f: impl Fn(usize, &mut dyn LaneLinks) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let store: Arc<dyn Store> = Arc::new(MemStore::new());
    let f = Arc::new(f);
    let (tx, rx) = mpsc::channel();
    for rank in 0..world {
        let (store, f, tx) = (store.clone(), f.clone(), tx.clone());
        std::thread::spawn(move || {
            let t = make(rank, world, store);
            let mut links = t.open_lane("l", Instant::now() + T).unwrap();
            let r = f(rank, links.as_mut());
            let _ = tx.send((rank, r));
            // Keep the endpoint open until every rank finished with it.
            std::thread::sleep(Duration::from_millis(200));
            drop(links);
        });
    }
    let mut out: Vec<Option<R>> = (0..world).map(|_| None).collect();
    for _ in 0..world {
        let (rank, r) = rx.recv_timeout(T * 2).expect("a rank hung or panicked");
        out[rank] = Some(r);
    }
    out.into_iter().map(|r| r.unwrap()).collect()
}

pub(crate) fn tag(step: u32) -> Tag {
    Tag { lane: 7, seq: 3, kind: 1, count: 10, root: u32::MAX, step }
}

fn payload(src: usize, step: usize, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i.wrapping_mul(31) ^ (src * 7 + step * 13)) as u8).collect()
}

/// One exchange of step `step` that must succeed within `T`.
fn exchange_now(
    links: &mut dyn LaneLinks,
    step: usize,
    sends: &[SendOp<'_>],
    recvs: &mut [RecvOp<'_>],
) {
    links
        .exchange(tag(step as u32), sends, recvs, Instant::now() + T, &AtomicBool::new(false))
        .unwrap();
}

/// TR-1, TR-2, TR-5: every rank sends to every other rank at once, for sizes around the
/// slot/chunk boundaries; bytes arrive complete, in order, in aligned pieces.
pub(crate) fn all_to_all(make: &'static Factory, world: usize) {
    let sizes = [0usize, 4, 1000, 256 << 10, (1 << 20) + 12, (3 << 20) + 4];
    let res = run(make, world, move |rank, links| {
        for (step, &len) in sizes.iter().enumerate() {
            let data: Vec<Vec<u8>> = (0..world).map(|_| payload(rank, step, len)).collect();
            let sends: Vec<SendOp<'_>> = (0..world)
                .filter(|&p| p != rank)
                .map(|p| SendOp { peer: p, data: &data[p], copied: false })
                .collect();
            let mut got: Vec<Vec<u8>> = vec![Vec::new(); world];
            let bad_piece = std::cell::Cell::new(false);
            {
                let mut sinks: Vec<_> = got
                    .iter_mut()
                    .map(|g| {
                        let bad = &bad_piece;
                        move |off: usize, piece: &[u8]| {
                            // TR-2
                            if off != g.len()
                                || !off.is_multiple_of(4)
                                || !piece.len().is_multiple_of(4)
                                || !(piece.as_ptr() as usize).is_multiple_of(4)
                            {
                                bad.set(true);
                            }
                            g.extend_from_slice(piece);
                        }
                    })
                    .collect();
                let mut recvs: Vec<RecvOp<'_>> = sinks
                    .iter_mut()
                    .enumerate()
                    .filter(|(p, _)| *p != rank)
                    .map(|(p, s)| RecvOp { peer: p, len, sink: Sink::Fn(s) })
                    .collect();
                exchange_now(links, step, &sends, &mut recvs);
            }
            assert!(!bad_piece.get(), "TR-2 violated at len {len}");
            for (p, g) in got.iter().enumerate() {
                if p != rank {
                    assert!(*g == payload(p, step, len), "rank {rank} from {p}, len {len}");
                }
            }
        }
        // TR-6: copied messages into copy sinks (a transport may place them itself).
        for (i, &len) in sizes.iter().enumerate() {
            let step = sizes.len() + i;
            let data: Vec<Vec<u8>> = (0..world).map(|_| payload(rank, step, len)).collect();
            let sends: Vec<SendOp<'_>> = (0..world)
                .filter(|&p| p != rank)
                .map(|p| SendOp { peer: p, data: &data[p], copied: true })
                .collect();
            let mut got: Vec<Vec<u8>> = vec![vec![0xAA; len]; world];
            let mut recvs: Vec<RecvOp<'_>> = got
                .iter_mut()
                .enumerate()
                .filter(|(p, _)| *p != rank)
                .map(|(p, g)| RecvOp { peer: p, len, sink: Sink::Copy(g) })
                .collect();
            exchange_now(links, step, &sends, &mut recvs);
            drop(recvs);
            for (p, g) in got.iter().enumerate() {
                if p != rank {
                    assert!(*g == payload(p, step, len), "copy: rank {rank} from {p}, len {len}");
                }
            }
        }
        true
    });
    assert!(res.into_iter().all(|x| x));
}

fn one(
    links: &mut dyn LaneLinks,
    t: Tag,
    to: Option<(usize, &[u8])>,
    from: Option<(usize, usize)>,
    deadline: Duration,
    cancel: &AtomicBool,
) -> Result<Vec<u8>, TransportError> {
    let mut got = Vec::new();
    let mut sink = |_: usize, p: &[u8]| got.extend_from_slice(p);
    let sends: Vec<SendOp<'_>> =
        to.map(|(peer, data)| SendOp { peer, data, copied: false }).into_iter().collect();
    let mut recvs: Vec<RecvOp<'_>> = from
        .map(|(peer, len)| RecvOp { peer, len, sink: Sink::Fn(&mut sink) })
        .into_iter()
        .collect();
    links.exchange(t, &sends, &mut recvs, Instant::now() + deadline, cancel)?;
    drop(recvs);
    Ok(got)
}

/// Times symmetric exchanges between two ranks (sizes 4 KiB and 32 MiB) and prints them.
pub(crate) fn probe(make: &'static Factory, name: &'static str) {
    for (bytes, iters) in [(4096usize, 20_000usize), (32 << 20, 10)] {
        let res = run(make, 2, move |rank, links| {
            let data = vec![1u8; bytes];
            let mut sum = 0u64;
            let mut go = || {
                let mut sink = |_: usize, p: &[u8]| sum += p.len() as u64;
                let sends = [SendOp { peer: 1 - rank, data: &data, copied: false }];
                let mut recvs = [RecvOp { peer: 1 - rank, len: bytes, sink: Sink::Fn(&mut sink) }];
                links
                    .exchange(
                        tag(0),
                        &sends,
                        &mut recvs,
                        Instant::now() + T,
                        &AtomicBool::new(false),
                    )
                    .unwrap();
            };
            for _ in 0..3 {
                go();
            }
            let t = Instant::now();
            for _ in 0..iters {
                go();
            }
            t.elapsed().as_secs_f64() / iters as f64
        });
        let s = res[0];
        eprintln!(
            "{name}: exchange of {bytes} B: {:.2} us, {:.2} GB/s each way",
            s * 1e6,
            bytes as f64 / s / 1e9
        );
    }
}

/// Tag and length mismatches are reported, not consumed as data.
pub(crate) fn mismatches(make: &'static Factory) {
    let res = run(make, 2, |rank, links| {
        let c = AtomicBool::new(false);
        if rank == 0 {
            let _ = one(links, tag(1), Some((1, &[0u8; 8])), None, T, &c);
            let _ = one(links, tag(2), Some((1, &[0u8; 8])), None, T, &c);
            None
        } else {
            let a = one(links, tag(9), None, Some((0, 8)), T, &c).err();
            Some(a)
        }
    });
    match &res[1] {
        Some(Some(TransportError::TagMismatch { peer: 0, expected, got })) => {
            assert_eq!(expected.step, 9);
            assert_eq!(got.step, 1);
        }
        other => panic!("expected TagMismatch, got {other:?}"),
    }
    let res = run(make, 2, |rank, links| {
        let c = AtomicBool::new(false);
        if rank == 0 {
            one(links, tag(1), Some((1, &[0u8; 8])), None, T, &c).err()
        } else {
            one(links, tag(1), None, Some((0, 12)), T, &c).err()
        }
    });
    assert!(
        matches!(res[1], Some(TransportError::LengthMismatch { peer: 0, expected: 12, got: 8 })),
        "{res:?}"
    );
}

/// TR-3 (deadline and cancel) and TR-4 (a dropped endpoint), plus poison.
pub(crate) fn failures(make: &'static Factory) {
    // TR-3: nobody sends; the deadline fires and names the peer.
    let res = run(make, 2, |rank, links| {
        let c = AtomicBool::new(false);
        (rank == 1)
            .then(|| one(links, tag(0), None, Some((0, 4)), Duration::from_millis(100), &c).err())
    });
    assert!(matches!(res[1], Some(Some(TransportError::Timeout { peer: 0 }))), "{res:?}");
    // TR-3: cancel set from another thread.
    let res = run(make, 2, |rank, links| {
        let c = Arc::new(AtomicBool::new(false));
        let c2 = c.clone();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            c2.store(true, Ordering::Relaxed);
        });
        (rank == 1).then(|| one(links, tag(0), None, Some((0, 4)), T, &c).err())
    });
    assert!(matches!(res[1], Some(Some(TransportError::Cancelled))), "{res:?}");
    // Poison: rank 0 fails and tells rank 1, which waits on it.
    let res = run(make, 2, |rank, links| {
        let c = AtomicBool::new(false);
        if rank == 0 {
            std::thread::sleep(Duration::from_millis(30));
            links.poison(&Poison { origin: 0, reason: "disk on fire".into() });
            None
        } else {
            one(links, tag(0), None, Some((0, 4)), T, &c).err()
        }
    });
    match &res[1] {
        Some(TransportError::Poisoned(p)) => {
            assert_eq!((p.origin, p.reason.as_str()), (0, "disk on fire"))
        }
        other => panic!("expected Poisoned, got {other:?}"),
    }
    // Poison from a rank this one is not waiting on still ends the wait.
    let res = run(make, 3, |rank, links| {
        let c = AtomicBool::new(false);
        match rank {
            0 => {
                std::thread::sleep(Duration::from_millis(30));
                links.poison(&Poison { origin: 0, reason: "bystander".into() });
                None
            }
            1 => one(links, tag(0), None, Some((2, 4)), T, &c).err(),
            _ => {
                std::thread::sleep(Duration::from_secs(2));
                None
            }
        }
    });
    match &res[1] {
        Some(TransportError::Poisoned(p)) => assert_eq!(p.origin, 0),
        other => panic!("expected Poisoned from rank 0, got {other:?}"),
    }
    // TR-4: rank 0 drops its endpoint without sending.
    let store: Arc<dyn Store> = Arc::new(MemStore::new());
    let s2 = store.clone();
    let h = std::thread::spawn(move || {
        let t = make(0, 2, s2);
        let links = t.open_lane("l", Instant::now() + T).unwrap();
        std::thread::sleep(Duration::from_millis(50));
        drop(links);
        drop(t);
    });
    let t = make(1, 2, store);
    let mut links = t.open_lane("l", Instant::now() + T).unwrap();
    let err = one(links.as_mut(), tag(0), None, Some((0, 4)), T, &AtomicBool::new(false)).err();
    h.join().unwrap();
    assert!(matches!(err, Some(TransportError::PeerLost { peer: 0, .. })), "{err:?}");
}
