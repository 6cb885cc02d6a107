//! A small server of torch's `TCPStore` protocol (`torch.rs`), for tests on machines without
//! torch: it plays a torchrun agent's store. The replay test checks that its answers to the
//! recorded requests are the bytes torch 2.15's own server gave.

use super::torch::{Query, VALIDATION_MAGIC};
use super::{MemInner, StoreError, MAX_KEY_BYTES, MAX_VALUE_BYTES};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How often a blocked server thread looks at the shutdown flag and for a cancelled wait.
const TICK: Duration = Duration::from_millis(20);

/// A torch-protocol store server on background threads; stops when dropped.
pub struct TorchStoreServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
}

impl TorchStoreServer {
    /// Binds `addr` (port 0 picks a free port) and serves.
    pub fn bind(addr: impl ToSocketAddrs) -> Result<Self, StoreError> {
        let listener = TcpListener::bind(addr).map_err(|e| StoreError::Io(format!("bind: {e}")))?;
        let addr = listener.local_addr().map_err(|e| StoreError::Io(e.to_string()))?;
        listener.set_nonblocking(true).map_err(|e| StoreError::Io(e.to_string()))?;
        let stop = Arc::new(AtomicBool::new(false));
        let state = Arc::new(MemInner::default());
        let flag = stop.clone();
        std::thread::spawn(move || {
            while !flag.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((s, _)) => {
                        let (state, flag) = (state.clone(), flag.clone());
                        std::thread::spawn(move || {
                            let _ = serve(s, &state, &flag);
                        });
                    }
                    Err(_) => std::thread::sleep(TICK),
                }
            }
        });
        Ok(TorchStoreServer { addr, stop })
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for TorchStoreServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

type Res<T> = std::io::Result<T>;

fn bad(why: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, why.to_owned())
}

/// Reads exactly `buf.len()` bytes, looking at `stop` on every read timeout.
fn fill(s: &mut TcpStream, buf: &mut [u8], stop: &AtomicBool) -> Res<()> {
    let mut done = 0;
    while done < buf.len() {
        match s.read(&mut buf[done..]) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => done += n,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock
                        | std::io::ErrorKind::TimedOut
                        | std::io::ErrorKind::Interrupted
                ) =>
            {
                if stop.load(Ordering::Relaxed) {
                    return Err(std::io::ErrorKind::ConnectionAborted.into());
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn u64_of(s: &mut TcpStream, stop: &AtomicBool) -> Res<u64> {
    let mut b = [0u8; 8];
    fill(s, &mut b, stop)?;
    Ok(u64::from_le_bytes(b))
}

fn bytes_of(s: &mut TcpStream, stop: &AtomicBool, cap: usize) -> Res<Vec<u8>> {
    let n = u64_of(s, stop)?;
    if n > cap as u64 {
        return Err(bad("oversize string"));
    }
    let mut v = vec![0u8; n as usize];
    fill(s, &mut v, stop)?;
    Ok(v)
}

fn key_of(s: &mut TcpStream, stop: &AtomicBool) -> Res<String> {
    String::from_utf8(bytes_of(s, stop, MAX_KEY_BYTES + 1)?).map_err(|_| bad("key not UTF-8"))
}

fn keys_of(s: &mut TcpStream, stop: &AtomicBool) -> Res<Vec<String>> {
    let n = u64_of(s, stop)?;
    if n > 4096 {
        return Err(bad("too many keys"));
    }
    (0..n).map(|_| key_of(s, stop)).collect()
}

fn value_reply(v: &[u8]) -> Vec<u8> {
    let mut out = (v.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(v);
    out
}

fn serve(mut s: TcpStream, state: &MemInner, stop: &AtomicBool) -> Res<()> {
    s.set_read_timeout(Some(TICK))?;
    s.set_nodelay(true)?;
    let present = |k: &str| state.lock().contains_key(k);
    loop {
        let mut q = [0u8; 1];
        fill(&mut s, &mut q, stop)?;
        let reply: Vec<u8> = match q[0] {
            x if x == Query::Validate as u8 => {
                let mut m = [0u8; 4];
                fill(&mut s, &mut m, stop)?;
                if u32::from_le_bytes(m) != VALIDATION_MAGIC {
                    return Err(bad("bad magic"));
                }
                Vec::new()
            }
            x if x == Query::Ping as u8 => {
                let mut n = [0u8; 4];
                fill(&mut s, &mut n, stop)?;
                n.to_vec()
            }
            x if x == Query::Set as u8 => {
                let k = key_of(&mut s, stop)?;
                let v = bytes_of(&mut s, stop, MAX_VALUE_BYTES)?;
                state.set(&k, &v);
                Vec::new()
            }
            x if x == Query::Get as u8 => {
                let k = key_of(&mut s, stop)?;
                value_reply(&state.lock().get(&k).cloned().unwrap_or_default())
            }
            x if x == Query::Add as u8 => {
                let k = key_of(&mut s, stop)?;
                let mut d = [0u8; 8];
                fill(&mut s, &mut d, stop)?;
                let sum =
                    state.add(&k, i64::from_le_bytes(d)).map_err(|e| bad(&format!("add: {e}")))?;
                sum.to_le_bytes().to_vec()
            }
            x if x == Query::CompareSet as u8 => {
                let k = key_of(&mut s, stop)?;
                let expected = bytes_of(&mut s, stop, MAX_VALUE_BYTES)?;
                let desired = bytes_of(&mut s, stop, MAX_VALUE_BYTES)?;
                let mut map = state.lock();
                let now = match map.get(&k) {
                    None if expected.is_empty() => {
                        map.insert(k, desired.clone());
                        desired
                    }
                    None => expected,
                    Some(cur) if *cur == expected => {
                        map.insert(k, desired.clone());
                        desired
                    }
                    Some(cur) => cur.clone(),
                };
                drop(map);
                state.changed.notify_all();
                value_reply(&now)
            }
            x if x == Query::Check as u8 => {
                let keys = keys_of(&mut s, stop)?;
                vec![if keys.iter().all(|k| present(k)) { 0 } else { 1 }]
            }
            x if x == Query::Wait as u8 => {
                let keys = keys_of(&mut s, stop)?;
                wait(&mut s, state, &keys, stop)?
            }
            _ => return Err(bad("unknown query")),
        };
        if !reply.is_empty() {
            s.write_all(&reply)?;
        }
    }
}

/// Answers a WAIT: STOP_WAITING (0) once every key is set, or WAIT_CANCELED (1) when the
/// client sends CANCEL_WAIT first.
fn wait(s: &mut TcpStream, state: &MemInner, keys: &[String], stop: &AtomicBool) -> Res<Vec<u8>> {
    loop {
        let missing = keys.iter().find(|k| !state.lock().contains_key(k.as_str()));
        let Some(k) = missing else { return Ok(vec![0]) };
        // Sleeps on the store's condvar up to a tick for the key.
        let _ = state.get(k, TICK);
        if stop.load(Ordering::Relaxed) {
            return Err(std::io::ErrorKind::ConnectionAborted.into());
        }
        s.set_nonblocking(true)?;
        let mut b = [0u8; 1];
        let got = s.read(&mut b);
        s.set_nonblocking(false)?;
        match got {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(_) if b[0] == Query::CancelWait as u8 => return Ok(vec![1]),
            Ok(_) => return Err(bad("a request during a wait")),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
}
