//! The data path of the TCP transport: one rank's links on one lane, the exchange loop
//! over non-blocking sockets (`sendmsg` of header and payload, `recv` straight into a copy
//! sink or through a scratch), poison frames (TCP-3) and the small exchanges' spin (TCP-4).
//! The frames' format is [`super::wire`]'s; opening the sockets is [`super::TcpTransport`]'s.

use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::wire::{
    self, chunk_range, chunks_of, decode_header, encode_header, HEADER_BYTES, KIND_DATA,
    KIND_POISON, MAX_POISON_REASON,
};
use super::{setup, SPIN_MAX_BYTES};
use crate::transport::{LaneLinks, Poison, RecvOp, SendOp, Sink, Tag, TransportError};

/// Receive scratch per lane.
const SCRATCH_BYTES: usize = 256 << 10;
/// Bytes one receive reads before the exchange loop turns to the sends again.
const PULL_BUDGET_BYTES: usize = 1 << 20;
/// How long `poison` tries to finish a half-written frame and write its own (TCP-3).
const POISON_BUDGET: Duration = Duration::from_millis(100);
/// How often idle sockets are checked for a poison frame.
const PEEK_PERIOD: Duration = Duration::from_millis(5);

/// One socket of a link, with the state of the frame it is writing.
pub(super) struct Sock {
    pub(super) stream: TcpStream,
    fd: RawFd,
    /// Header of the frame being written (for completing it on poison, TCP-3).
    tx_hdr: [u8; HEADER_BYTES],
    /// Bytes of the current frame written so far, and its total size (0: at a boundary).
    tx_written: usize,
    tx_total: usize,
}

pub(super) struct PeerConn {
    pub(super) socks: Vec<Sock>,
}

impl PeerConn {
    /// The link to one peer over its `sockets_per_peer` connected sockets.
    pub(super) fn new(streams: Vec<TcpStream>) -> Self {
        PeerConn {
            socks: streams
                .into_iter()
                .map(|stream| Sock {
                    fd: stream.as_raw_fd(),
                    stream,
                    tx_hdr: [0; HEADER_BYTES],
                    tx_written: 0,
                    tx_total: 0,
                })
                .collect(),
        }
    }
}

/// One rank's TCP links on one lane.
pub(super) struct TcpLinks {
    rank: usize,
    peers: Vec<Option<PeerConn>>,
    /// Receive buffer; u32-backed so that pieces handed to sinks are 4-byte aligned (TR-2).
    scratch: Vec<u32>,
    /// When idle sockets were last checked for a poison frame (at most every PEEK_PERIOD,
    /// so that small exchanges do not pay a syscall per idle peer).
    last_peek: Instant,
    /// How long a small exchange polls without sleeping (TCP-4).
    spin: Duration,
}

fn is_lost(e: &std::io::Error) -> bool {
    use std::io::ErrorKind::*;
    matches!(
        e.kind(),
        ConnectionReset | ConnectionAborted | BrokenPipe | UnexpectedEof | NotConnected
    )
}

fn link_err(peer: usize, e: std::io::Error) -> TransportError {
    if is_lost(&e) {
        TransportError::PeerLost { peer, detail: e.to_string() }
    } else {
        TransportError::Io { peer, detail: e.to_string() }
    }
}

/// `sendmsg` of up to two buffers, non-blocking and without SIGPIPE.
fn send2(fd: RawFd, a: &[u8], b: &[u8]) -> std::io::Result<usize> {
    let mut iov = [
        libc::iovec { iov_base: a.as_ptr() as *mut libc::c_void, iov_len: a.len() },
        libc::iovec { iov_base: b.as_ptr() as *mut libc::c_void, iov_len: b.len() },
    ];
    let n_iov = if b.is_empty() { 1 } else { 2 };
    // SAFETY: an all-zero msghdr is valid (no name, no control data).
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = n_iov as _;
    loop {
        // SAFETY: msg points at iovecs describing live buffers that outlive the call; the
        // kernel only reads them.
        let r = unsafe { libc::sendmsg(fd, &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
        if r >= 0 {
            return Ok(r as usize);
        }
        let e = std::io::Error::last_os_error();
        if e.kind() != std::io::ErrorKind::Interrupted {
            return Err(e);
        }
    }
}

/// Non-blocking read; `Ok(None)` when nothing is available.
fn recv_some(fd: RawFd, buf: &mut [u8], flags: libc::c_int) -> std::io::Result<Option<usize>> {
    loop {
        // SAFETY: buf is a live, writable buffer of buf.len() bytes.
        let r = unsafe {
            libc::recv(
                fd,
                buf.as_mut_ptr() as *mut libc::c_void,
                buf.len(),
                flags | libc::MSG_DONTWAIT,
            )
        };
        if r >= 0 {
            return Ok(Some(r as usize));
        }
        let e = std::io::Error::last_os_error();
        match e.kind() {
            std::io::ErrorKind::Interrupted => continue,
            std::io::ErrorKind::WouldBlock => return Ok(None),
            _ => return Err(e),
        }
    }
}

/// Progress of one send: per socket, the next chunk it carries.
struct SendState {
    next_chunk: Vec<usize>,
    done: bool,
}

/// Progress of one receive.
struct RecvState {
    chunk: usize,
    hdr: [u8; HEADER_BYTES],
    hdr_got: usize,
    /// Payload bytes of the current chunk received (delivered or carried).
    got: usize,
    /// Bytes received but not delivered yet (fewer than 4).
    carry: [u8; 4],
    carry_len: usize,
    /// Poison reason being read after a poison header.
    poison: Option<(usize, Vec<u8>)>,
    done: bool,
}

impl TcpLinks {
    /// The links of `rank` over `peers` (`None` for itself), small exchanges spinning for
    /// `spin` (TCP-4).
    pub(super) fn new(rank: usize, peers: Vec<Option<PeerConn>>, spin: Duration) -> TcpLinks {
        TcpLinks {
            rank,
            peers,
            scratch: vec![0u32; SCRATCH_BYTES / 4],
            last_peek: Instant::now(),
            spin,
        }
    }

    fn conn(&self, p: usize) -> Result<&PeerConn, TransportError> {
        self.peers
            .get(p)
            .and_then(|c| c.as_ref())
            .ok_or_else(|| setup(format!("rank {} has no link to rank {p}", self.rank)))
    }

    fn push(
        conn: &mut PeerConn,
        peer: usize,
        tag: &Tag,
        data: &[u8],
        st: &mut SendState,
    ) -> Result<bool, TransportError> {
        let n_chunks = chunks_of(data.len());
        let spp = conn.socks.len();
        let mut moved = false;
        let mut all_done = true;
        for (s, sock) in conn.socks.iter_mut().enumerate() {
            loop {
                let j = st.next_chunk[s];
                if j >= n_chunks {
                    break;
                }
                let (off, n) = chunk_range(data.len(), j);
                if sock.tx_total == 0 {
                    sock.tx_hdr =
                        encode_header(KIND_DATA, tag, data.len() as u64, off as u64, n as u32);
                    sock.tx_total = HEADER_BYTES + n;
                    sock.tx_written = 0;
                }
                let w = sock.tx_written;
                let payload = &data[off..off + n];
                let r = if w < HEADER_BYTES {
                    send2(sock.fd, &sock.tx_hdr[w..], payload)
                } else {
                    send2(sock.fd, &payload[w - HEADER_BYTES..], &[])
                };
                match r {
                    Ok(k) => {
                        moved |= k > 0;
                        sock.tx_written += k;
                        if sock.tx_written == sock.tx_total {
                            sock.tx_total = 0;
                            sock.tx_written = 0;
                            st.next_chunk[s] += spp;
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                    Err(e) => return Err(link_err(peer, e)),
                }
            }
            all_done &= st.next_chunk[s] >= n_chunks;
        }
        st.done = all_done;
        Ok(moved)
    }

    fn pull(
        conn: &mut PeerConn,
        peer: usize,
        tag: &Tag,
        op: &mut RecvOp<'_>,
        st: &mut RecvState,
        scratch: &mut [u32],
    ) -> Result<bool, TransportError> {
        let n_chunks = chunks_of(op.len);
        let spp = conn.socks.len();
        let mut moved = false;
        let mut budget = PULL_BUDGET_BYTES;
        while !st.done {
            let fd = conn.socks[st.chunk % spp].fd;
            if let Some((want, reason)) = &mut st.poison {
                let have = reason.len();
                let mut buf = vec![0u8; *want - have];
                match recv_some(fd, &mut buf, 0).map_err(|e| link_err(peer, e))? {
                    None => return Ok(moved),
                    Some(0) => return Err(lost_eof(peer)),
                    Some(k) => reason.extend_from_slice(&buf[..k]),
                }
                if reason.len() == *want {
                    return Err(wire::poisoned(reason));
                }
                continue;
            }
            if st.hdr_got < HEADER_BYTES {
                match recv_some(fd, &mut st.hdr[st.hdr_got..], 0).map_err(|e| link_err(peer, e))? {
                    None => return Ok(moved),
                    Some(0) => return Err(lost_eof(peer)),
                    Some(k) => {
                        st.hdr_got += k;
                        moved = true;
                    }
                }
                if st.hdr_got < HEADER_BYTES {
                    continue;
                }
                // TCP-2
                let h = decode_header(&st.hdr, peer)?;
                if h.kind == KIND_POISON {
                    let n = h.n as usize;
                    if !(4..=MAX_POISON_REASON + 4).contains(&n) {
                        return Err(TransportError::Corrupt {
                            peer,
                            detail: format!("poison frame of {n} B"),
                        });
                    }
                    st.poison = Some((n, Vec::with_capacity(n)));
                    continue;
                }
                if h.kind != KIND_DATA {
                    return Err(TransportError::Corrupt {
                        peer,
                        detail: format!("unknown frame kind {}", h.kind),
                    });
                }
                if h.tag != *tag {
                    return Err(TransportError::TagMismatch { peer, expected: *tag, got: h.tag });
                }
                if h.msg_len != op.len as u64 {
                    return Err(TransportError::LengthMismatch {
                        peer,
                        expected: op.len,
                        got: h.msg_len as usize,
                    });
                }
                let (off, n) = chunk_range(op.len, st.chunk);
                if h.offset != off as u64 || h.n as usize != n {
                    return Err(TransportError::Corrupt {
                        peer,
                        detail: format!(
                            "chunk at {} of {} B, expected {off} of {n} B",
                            h.offset, h.n
                        ),
                    });
                }
                st.got = 0;
            }
            let (off, n) = chunk_range(op.len, st.chunk);
            if st.got < n {
                // TR-6: a plain copy is read from the socket straight into its destination;
                // anything else through the scratch, handed on in whole f32s.
                let c = st.carry_len;
                let read = match &mut op.sink {
                    Sink::Copy(dst) => recv_some(fd, &mut dst[off + st.got..off + n], 0),
                    Sink::Fn(_) => {
                        let bytes: &mut [u8] = bytemuck::cast_slice_mut(scratch);
                        bytes[..c].copy_from_slice(&st.carry[..c]);
                        let room = (n - st.got).min(bytes.len() - c);
                        recv_some(fd, &mut bytes[c..c + room], 0)
                    }
                };
                let k = match read.map_err(|e| link_err(peer, e))? {
                    None => return Ok(moved),
                    Some(0) => return Err(lost_eof(peer)),
                    Some(k) => k,
                };
                moved = true;
                if let Sink::Fn(_) = op.sink {
                    let bytes: &[u8] = bytemuck::cast_slice(scratch);
                    let have = c + k;
                    let whole = have & !3;
                    if whole > 0 {
                        op.sink.put(off + st.got - c, &bytes[..whole]);
                    }
                    st.carry_len = have - whole;
                    st.carry[..st.carry_len].copy_from_slice(&bytes[whole..have]);
                }
                st.got += k;
                budget = budget.saturating_sub(k);
            }
            if st.got == n {
                st.chunk += 1;
                st.hdr_got = 0;
                st.got = 0;
                st.done = st.chunk >= n_chunks;
            }
            if budget == 0 {
                // Back to the exchange loop, so that this rank's own sends keep flowing.
                return Ok(moved);
            }
        }
        Ok(moved)
    }

    /// TCP-5: a lost peer is reported only after the other peers' sockets were peeked for a
    /// poison frame. A rank that fails first poisons before it stops, and the losses that
    /// follow (a rank stopped on that poison, its sockets reset) would otherwise hide the
    /// reason it carries.
    fn poison_before_loss(&mut self, e: TransportError) -> TransportError {
        let TransportError::PeerLost { peer, .. } = &e else { return e };
        let skip: Vec<bool> = (0..self.peers.len()).map(|p| p == *peer).collect();
        match self.peek_poison(&skip) {
            Err(poisoned) => poisoned,
            Ok(()) => e,
        }
    }

    /// Reads a poison frame waiting at the head of an idle socket, if any.
    fn peek_poison(&mut self, active: &[bool]) -> Result<(), TransportError> {
        for (p, conn) in self.peers.iter().enumerate() {
            let Some(conn) = conn else { continue };
            if active[p] {
                continue;
            }
            for s in &conn.socks {
                let mut h = [0u8; HEADER_BYTES];
                if let Ok(Some(HEADER_BYTES)) = recv_some(s.fd, &mut h, libc::MSG_PEEK) {
                    let Ok(hd) = decode_header(&h, p) else { continue };
                    if hd.kind != KIND_POISON || hd.n as usize > MAX_POISON_REASON + 4 {
                        continue;
                    }
                    let mut buf = vec![0u8; HEADER_BYTES + hd.n as usize];
                    if let Ok(Some(k)) = recv_some(s.fd, &mut buf, libc::MSG_PEEK) {
                        if k == buf.len() {
                            return Err(wire::poisoned(&buf[HEADER_BYTES..]));
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

fn lost_eof(peer: usize) -> TransportError {
    TransportError::PeerLost { peer, detail: "connection closed (EOF)".into() }
}

impl LaneLinks for TcpLinks {
    fn staging_bytes(&self) -> usize {
        self.scratch.capacity() * 4
    }

    /// Every byte sent is read by this rank's CPU (the kernel copies it into the socket), so
    /// a shard read once per piece from memory and sent from the cache to every peer costs
    /// less than one read per peer; the own copy of an out-of-place gather reads it from the
    /// cache too. W=2, 64 MiB, 2 cores: 2.98-3.27 GB/s busbw against 2.30-2.48 for the ring
    /// with the own copy first; W=4: 1.46 against 1.31-1.38 (RESULTS.md, "TCP all-gather in
    /// pieces").
    fn prefers_pieced_gather(&self) -> bool {
        true
    }

    fn exchange(
        &mut self,
        tag: Tag,
        sends: &[SendOp<'_>],
        recvs: &mut [RecvOp<'_>],
        deadline: Instant,
        cancel: &AtomicBool,
    ) -> Result<(), TransportError> {
        let world = self.peers.len();
        let mut active = vec![false; world];
        for p in sends.iter().map(|s| s.peer).chain(recvs.iter().map(|r| r.peer)) {
            self.conn(p)?;
            active[p] = true;
        }
        let mut send_st: Vec<SendState> = sends
            .iter()
            .map(|s| SendState {
                next_chunk: (0..self.peers[s.peer].as_ref().map_or(1, |c| c.socks.len())).collect(),
                done: false,
            })
            .collect();
        let mut recv_st: Vec<RecvState> = recvs
            .iter()
            .map(|_| RecvState {
                chunk: 0,
                hdr: [0; HEADER_BYTES],
                hdr_got: 0,
                got: 0,
                carry: [0; 4],
                carry_len: 0,
                poison: None,
                done: false,
            })
            .collect();
        if self.last_peek.elapsed() >= PEEK_PERIOD {
            self.last_peek = Instant::now();
            self.peek_poison(&active)?;
        }
        let mut busy = vec![false; world];
        let mut pfds: Vec<libc::pollfd> = Vec::new();
        let mut waiting: Vec<usize> = Vec::new();
        let bytes: usize = sends.iter().map(|s| s.data.len()).sum::<usize>()
            + recvs.iter().map(|r| r.len).sum::<usize>();
        let spin_until =
            (bytes <= SPIN_MAX_BYTES && !self.spin.is_zero()).then(|| Instant::now() + self.spin);
        loop {
            let mut moved = false;
            pfds.clear();
            waiting.clear();
            busy.iter_mut().for_each(|b| *b = false);
            // Several messages to one peer in one step go in list order (TR-1).
            for (op, st) in sends.iter().zip(send_st.iter_mut()) {
                if st.done || busy[op.peer] {
                    continue;
                }
                busy[op.peer] = true;
                let conn = self.peers[op.peer].as_mut().ok_or_else(|| setup("no link"))?;
                match Self::push(conn, op.peer, &tag, op.data, st) {
                    Ok(m) => moved |= m,
                    Err(e) => return Err(self.poison_before_loss(e)),
                }
                if !st.done {
                    waiting.push(op.peer);
                    for (s, sock) in conn.socks.iter().enumerate() {
                        if st.next_chunk[s] < chunks_of(op.data.len()) {
                            pfds.push(libc::pollfd {
                                fd: sock.fd,
                                events: libc::POLLOUT,
                                revents: 0,
                            });
                        }
                    }
                }
            }
            busy.iter_mut().for_each(|b| *b = false);
            for (op, st) in recvs.iter_mut().zip(recv_st.iter_mut()) {
                if st.done || busy[op.peer] {
                    continue;
                }
                busy[op.peer] = true;
                let p = op.peer;
                let conn = self.peers[p].as_mut().ok_or_else(|| setup("no link"))?;
                match Self::pull(conn, p, &tag, op, st, &mut self.scratch) {
                    Ok(m) => moved |= m,
                    Err(e) => return Err(self.poison_before_loss(e)),
                }
                if !st.done {
                    waiting.insert(0, p);
                    pfds.push(libc::pollfd {
                        fd: conn.socks[st.chunk % conn.socks.len()].fd,
                        events: libc::POLLIN,
                        revents: 0,
                    });
                }
            }
            let pending = send_st.iter().any(|s| !s.done) || recv_st.iter().any(|r| !r.done);
            if !pending {
                return Ok(());
            }
            if moved {
                continue;
            }
            if cancel.load(Ordering::Relaxed) {
                return Err(TransportError::Cancelled);
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(TransportError::Timeout {
                    peer: waiting.first().copied().unwrap_or(self.rank),
                });
            }
            if now.duration_since(self.last_peek) >= PEEK_PERIOD {
                self.last_peek = now;
                self.peek_poison(&active)?;
            }
            // Short waits keep the cancel flag and idle sockets (poison) observed; a small
            // exchange does not sleep within its spin (TCP-4).
            let ms = if spin_until.is_some_and(|t| now < t) {
                0
            } else {
                deadline.saturating_duration_since(now).as_millis().clamp(1, 2) as libc::c_int
            };
            // SAFETY: pfds is a live array of pfds.len() pollfds.
            let r = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, ms) };
            if r < 0 {
                let e = std::io::Error::last_os_error();
                if e.kind() != std::io::ErrorKind::Interrupted {
                    return Err(TransportError::Io {
                        peer: waiting.first().copied().unwrap_or(self.rank),
                        detail: format!("poll: {e}"),
                    });
                }
            }
        }
    }

    fn poison(&mut self, poison: &Poison) {
        let body = wire::encode_poison(poison);
        let hdr = encode_header(KIND_POISON, &Tag::default(), 0, 0, body.len() as u32);
        let end = Instant::now() + POISON_BUDGET;
        for sock in self.peers.iter_mut().flatten().flat_map(|c| c.socks.iter_mut()) {
            // TCP-3: finish a half-written frame first.
            let zeros = vec![0u8; 64 << 10];
            let mut ok = true;
            while ok && sock.tx_total > 0 {
                let w = sock.tx_written;
                let r = if w < HEADER_BYTES {
                    send2(sock.fd, &sock.tx_hdr[w..], &[])
                } else {
                    let left = (sock.tx_total - w).min(zeros.len());
                    send2(sock.fd, &zeros[..left], &[])
                };
                match r {
                    Ok(k) => {
                        sock.tx_written += k;
                        if sock.tx_written == sock.tx_total {
                            sock.tx_total = 0;
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        ok = Instant::now() < end;
                        std::thread::sleep(Duration::from_micros(200));
                    }
                    Err(_) => ok = false,
                }
            }
            let mut frame = hdr.to_vec();
            frame.extend_from_slice(&body);
            let mut sent = 0;
            while ok && sent < frame.len() {
                match send2(sock.fd, &frame[sent..], &[]) {
                    Ok(k) => sent += k,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        ok = Instant::now() < end;
                        std::thread::sleep(Duration::from_micros(200));
                    }
                    Err(_) => ok = false,
                }
            }
            if !ok {
                // The peer sees EOF instead of a torn frame.
                let _ = sock.stream.shutdown(Shutdown::Both);
            }
        }
    }
}
