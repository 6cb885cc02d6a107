//! torch's TCPStore protocol without torch: the exchange recorded between torch 2.15's own
//! client and server (`fixtures/torch_store/transcript.json`, made by `record.py` there) is
//! replayed against our client (STORE-3, STORE-4) and our test server; the exchange between a
//! real torchrun job's Shardline workers and its agent's store (`torchrun_job.json`, made by
//! `record_torchrun.py`) is replayed against our test server.

use serde_json::Value;
use shardline_collectives::store::TorchStoreServer;
use shardline_collectives::{Store, StoreError, TorchStoreClient};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

const T: Duration = Duration::from_secs(10);

struct Op {
    args: Value,
    /// (from the client?, bytes), in the order they crossed.
    messages: Vec<(bool, Vec<u8>)>,
    result: Value,
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

fn transcript() -> (String, Vec<Op>) {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/torch_store/transcript.json");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let ops = v["ops"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| Op {
            args: o["args"].clone(),
            messages: o["messages"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| (m["from"] == "client", hex(m["hex"].as_str().unwrap())))
                .collect(),
            result: o["result"].clone(),
        })
        .collect();
    (v["torch"].as_str().unwrap().to_owned(), ops)
}

fn read_n(s: &mut TcpStream, n: usize, what: &str) -> Vec<u8> {
    let mut b = vec![0u8; n];
    if let Err(e) = s.read_exact(&mut b) {
        panic!("{what}: reading {n} bytes: {e}");
    }
    b
}

/// Plays torch's server from the transcript: reads each recorded client message, checks it
/// byte for byte, and answers the recorded server message that followed. The connection's
/// ping nonce is the client's pid, so there the recorded reply is checked to echo the
/// recorded nonce, and ours is echoed.
fn replay_server(ops: Vec<Op>) -> (std::net::SocketAddr, std::thread::JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let h = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        s.set_read_timeout(Some(T)).unwrap();
        for (i, op) in ops.iter().enumerate() {
            let what = format!("op {i} {}", op.args);
            if op.args["op"] == "connect" {
                let [(true, hello), (false, echo)] = &op.messages[..] else {
                    panic!("{what}: a request and its reply expected")
                };
                let n = hello.len();
                let got = read_n(&mut s, n, &what);
                assert_eq!(got[..n - 4], hello[..n - 4], "{what}: request");
                assert_eq!(echo[..], hello[n - 4..], "the recorded ping echoes its nonce");
                s.write_all(&got[n - 4..]).unwrap();
                continue;
            }
            for (from_client, bytes) in &op.messages {
                if *from_client {
                    let got = read_n(&mut s, bytes.len(), &what);
                    assert_eq!(got, *bytes, "{what}: request bytes differ");
                } else {
                    s.write_all(bytes).unwrap();
                }
            }
        }
    });
    (addr, h)
}

fn text(v: &Value) -> &str {
    v.as_str().unwrap()
}

fn expect_bytes(result: &Value, got: Vec<u8>) {
    assert_eq!(String::from_utf8(got).unwrap(), text(&result["bytes"]));
}

#[test]
fn our_client_sends_and_reads_the_bytes_torch_recorded() {
    // STORE-3, and STORE-4: the timed-out wait is cancelled and the get after it reads
    // its own reply.
    let (version, ops) = transcript();
    assert!(version.starts_with("2.15"), "transcript of torch {version}");
    let calls: Vec<(Value, Value)> =
        ops.iter().map(|o| (o.args.clone(), o.result.clone())).collect();
    let (addr, server) = replay_server(ops);
    let mut client = None;
    for (args, result) in calls {
        let c = || client.as_ref().unwrap() as &TorchStoreClient;
        match text(&args["op"]) {
            "connect" => client = Some(TorchStoreClient::connect(addr, T).unwrap()),
            "set" => c().set(text(&args["key"]), text(&args["value"]).as_bytes()).unwrap(),
            "get" => expect_bytes(&result, c().get(text(&args["key"]), T).unwrap()),
            "add" => {
                let sum = c().add(text(&args["key"]), args["delta"].as_i64().unwrap()).unwrap();
                assert_eq!(sum, result.as_i64().unwrap());
            }
            "compare_set" => {
                let (e, d) = (text(&args["expected"]), text(&args["desired"]));
                let now = c().compare_set(text(&args["key"]), e.as_bytes(), d.as_bytes()).unwrap();
                expect_bytes(&result, now);
            }
            "check" => {
                let keys: Vec<&str> = args["keys"].as_array().unwrap().iter().map(text).collect();
                assert_eq!(c().check(&keys).unwrap(), result.as_bool().unwrap());
            }
            "wait" => {
                let keys: Vec<&str> = args["keys"].as_array().unwrap().iter().map(text).collect();
                let ms = args["timeout_ms"].as_u64().unwrap();
                let r = c().wait(&keys, Duration::from_millis(ms));
                if result.is_null() {
                    r.unwrap();
                } else {
                    assert!(matches!(r, Err(StoreError::Timeout { .. })), "{r:?}");
                }
            }
            other => panic!("unknown op {other}"),
        }
    }
    drop(client);
    server.join().unwrap();
}

#[test]
fn the_test_server_answers_as_torchs_server_did() {
    let (_, ops) = transcript();
    let server = TorchStoreServer::bind("127.0.0.1:0").unwrap();
    let mut s = TcpStream::connect(server.addr()).unwrap();
    s.set_read_timeout(Some(T)).unwrap();
    for (i, op) in ops.iter().enumerate() {
        let what = format!("op {i} {}", op.args);
        for (from_client, bytes) in &op.messages {
            if *from_client {
                s.write_all(bytes).unwrap();
            } else {
                assert_eq!(read_n(&mut s, bytes.len(), &what), *bytes, "{what}: reply");
            }
        }
    }
}

#[test]
fn our_client_and_the_test_server_rendezvous_across_threads() {
    let server = TorchStoreServer::bind("127.0.0.1:0").unwrap();
    let addr = server.addr();
    let hs: Vec<_> = (0..4)
        .map(|r: usize| {
            std::thread::spawn(move || {
                let c = TorchStoreClient::connect(addr, T).unwrap();
                c.set(&format!("hello/{r}"), &[r as u8]).unwrap();
                for p in 0..4 {
                    assert_eq!(c.get(&format!("hello/{p}"), T).unwrap(), vec![p as u8]);
                }
                c.add("count", 1).unwrap()
            })
        })
        .collect();
    let mut sums: Vec<i64> = hs.into_iter().map(|h| h.join().unwrap()).collect();
    sums.sort();
    assert_eq!(sums, vec![1, 2, 3, 4]);
    let c = TorchStoreClient::connect(addr, T).unwrap();
    assert_eq!(c.get("count", T).unwrap(), b"4".to_vec());
}

#[test]
fn a_peer_that_is_not_a_torch_store_is_named() {
    // A server that accepts and never answers the ping.
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let _h = std::thread::spawn(move || {
        let (s, _) = l.accept().unwrap();
        std::thread::sleep(Duration::from_secs(3));
        drop(s);
    });
    let e = TorchStoreClient::connect(addr, Duration::from_millis(300)).err().unwrap();
    assert!(e.to_string().contains("torch TCPStore"), "{e}");
}

#[test]
fn an_oversize_reply_fails_the_request_and_closes_the_connection() {
    // STORE-5, and STORE-4: nothing later is read from a stream left half-way.
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let h = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        s.set_read_timeout(Some(T)).unwrap();
        let hello = read_n(&mut s, 10, "validate and ping");
        s.write_all(&hello[6..]).unwrap();
        // add("n", 1): answer a length, not an i64, then a huge value length for a get.
        read_n(&mut s, 1 + 8 + 2 + 8, "add");
        s.write_all(&7i64.to_le_bytes()).unwrap();
        read_n(&mut s, 1 + 8 + 8 + 2, "wait");
        s.write_all(&[0]).unwrap();
        read_n(&mut s, 1 + 8 + 2, "get");
        s.write_all(&u64::MAX.to_le_bytes()).unwrap();
        // The client closes its side: the next read ends.
        let mut rest = Vec::new();
        let _ = s.read_to_end(&mut rest);
        rest
    });
    let c = TorchStoreClient::connect(addr, T).unwrap();
    assert_eq!(c.add("n", 1).unwrap(), 7);
    let e = c.get("k", T).unwrap_err();
    assert!(e.to_string().contains("more than"), "{e}");
    let again = c.add("n", 1).unwrap_err();
    assert!(again.to_string().contains("connection closed"), "{again}");
    assert!(h.join().unwrap().is_empty(), "nothing was sent after the failed request");
}

#[test]
fn the_test_server_answers_our_workers_as_torchruns_agent_store_did() {
    // Every worker connection's messages are replayed in the order they crossed: a request
    // goes to our server on that connection, and where the agent answered, our server must
    // answer the same bytes (waits included: a wait answered after another rank's set is
    // read only after that set was sent).
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/torch_store/torchrun_job.json");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    assert!(text(&v["torch"]).starts_with("2.15"), "recorded with torch {}", v["torch"]);
    let server = TorchStoreServer::bind("127.0.0.1:0").unwrap();
    let mut conns: std::collections::HashMap<(u64, u64), TcpStream> = Default::default();
    let messages = v["messages"].as_array().unwrap();
    let mut answered = 0;
    for (i, m) in messages.iter().enumerate() {
        let id = (m["rank"].as_u64().unwrap(), m["conn"].as_u64().unwrap());
        let s = conns.entry(id).or_insert_with(|| {
            let s = TcpStream::connect(server.addr()).unwrap();
            s.set_read_timeout(Some(T)).unwrap();
            s
        });
        let bytes = hex(text(&m["hex"]));
        if m["from"] == "client" {
            s.write_all(&bytes).unwrap();
        } else {
            let what = format!("message {i} (rank {}, connection {})", id.0, id.1);
            assert_eq!(read_n(s, bytes.len(), &what), bytes, "{what}: our answer differs");
            answered += 1;
        }
    }
    assert!(conns.len() >= 2 && answered >= 20, "{} connections, {answered} answers", conns.len());
}
