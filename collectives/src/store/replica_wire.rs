//! The wire format of the replicated store: frames of a little-endian `u32` length and a
//! payload whose first byte is its kind. Replicas send each other the log's messages
//! (`raft.rs`); clients send operations and reads, and get results, values or the leader's
//! index. Every connection opens with a hello carrying the job token (STORE-1).

use super::raft::{Command, Entry, KvMachine, Message, Op, OpResult};
use super::{MAX_KEY_BYTES, MAX_VALUE_BYTES};
use std::io::{Read, Write};

/// Longest frame accepted: a full batch of entries of the longest keys and values. The
/// length is checked before anything is allocated (STORE-2).
const MAX_FRAME: usize = 256 * (MAX_KEY_BYTES + MAX_VALUE_BYTES + 64) + 1024;

/// The `who` of a client's hello (a replica sends its index).
pub(super) const CLIENT: u64 = u64::MAX;

/// A frame of the replicated store's protocol.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Frame {
    Hello {
        token: Vec<u8>,
        who: u64,
    },
    Welcome,
    Refused(String),
    Raft(Message),
    /// An operation of client `cmd.client`, committed within `wait_ms`.
    Propose {
        cmd: Command,
        wait_ms: u64,
    },
    /// The committed value of `key`, waiting up to `wait_ms` for it to be set.
    Get {
        key: String,
        wait_ms: u64,
    },
    Result(OpResult),
    Value(Vec<u8>),
    Unset,
    /// This replica does not lead; the index of the one it follows, if it knows.
    NotLeader(Option<u64>),
    /// This replica leads but cannot answer now (no majority reached within the wait).
    Unavailable(String),
}

struct Enc(Vec<u8>);

impl Enc {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn bytes(&mut self, b: &[u8]) {
        self.0.extend_from_slice(&(b.len() as u32).to_le_bytes());
        self.0.extend_from_slice(b);
    }
    fn opt(&mut self, b: &Option<Vec<u8>>) {
        self.u8(u8::from(b.is_some()));
        self.bytes(b.as_deref().unwrap_or_default());
    }
    fn op(&mut self, op: &Op) {
        match op {
            Op::Set { key, value } => {
                self.u8(0);
                self.bytes(key.as_bytes());
                self.bytes(value);
            }
            Op::Add { key, delta } => {
                self.u8(1);
                self.bytes(key.as_bytes());
                self.u64(*delta as u64);
            }
            Op::CompareSet { key, expected, value } => {
                self.u8(2);
                self.bytes(key.as_bytes());
                self.opt(expected);
                self.bytes(value);
            }
            Op::Delete { key } => {
                self.u8(3);
                self.bytes(key.as_bytes());
            }
            Op::Noop => self.u8(4),
        }
    }
    fn cmd(&mut self, c: &Command) {
        self.u64(c.client);
        self.u64(c.seq);
        self.op(&c.op);
    }
    fn result(&mut self, r: &OpResult) {
        match r {
            OpResult::Done => self.u8(0),
            OpResult::Added(v) => {
                self.u8(1);
                self.u64(*v as u64);
            }
            OpResult::Swapped { ok, current } => {
                self.u8(2);
                self.u8(u8::from(*ok));
                self.opt(current);
            }
            OpResult::Failed(why) => {
                self.u8(3);
                self.bytes(why.as_bytes());
            }
        }
    }
    fn machine(&mut self, m: &KvMachine) {
        self.u64(m.map.len() as u64);
        for (k, v) in &m.map {
            self.bytes(k.as_bytes());
            self.bytes(v);
        }
        self.u64(m.sessions.len() as u64);
        for (client, (seq, r)) in &m.sessions {
            self.u64(*client);
            self.u64(*seq);
            self.result(r);
        }
    }
}

struct Dec<'a>(&'a [u8]);

type Res<T> = Result<T, String>;

impl Dec<'_> {
    fn take(&mut self, n: usize) -> Res<&[u8]> {
        if self.0.len() < n {
            return Err("truncated frame".into());
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Res<u8> {
        Ok(self.take(1)?[0])
    }
    fn u64(&mut self) -> Res<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().map_err(|_| "truncated frame")?))
    }
    fn bytes(&mut self) -> Res<Vec<u8>> {
        let n = u32::from_le_bytes(self.take(4)?.try_into().map_err(|_| "truncated frame")?);
        Ok(self.take(n as usize)?.to_vec())
    }
    fn string(&mut self) -> Res<String> {
        String::from_utf8(self.bytes()?).map_err(|_| "a key is not utf-8".into())
    }
    fn opt(&mut self) -> Res<Option<Vec<u8>>> {
        let some = self.u8()? != 0;
        let b = self.bytes()?;
        Ok(some.then_some(b))
    }
    fn op(&mut self) -> Res<Op> {
        Ok(match self.u8()? {
            0 => Op::Set { key: self.string()?, value: self.bytes()? },
            1 => Op::Add { key: self.string()?, delta: self.u64()? as i64 },
            2 => {
                Op::CompareSet { key: self.string()?, expected: self.opt()?, value: self.bytes()? }
            }
            3 => Op::Delete { key: self.string()? },
            4 => Op::Noop,
            k => return Err(format!("unknown operation {k}")),
        })
    }
    fn cmd(&mut self) -> Res<Command> {
        Ok(Command { client: self.u64()?, seq: self.u64()?, op: self.op()? })
    }
    fn result(&mut self) -> Res<OpResult> {
        Ok(match self.u8()? {
            0 => OpResult::Done,
            1 => OpResult::Added(self.u64()? as i64),
            2 => OpResult::Swapped { ok: self.u8()? != 0, current: self.opt()? },
            3 => OpResult::Failed(String::from_utf8_lossy(&self.bytes()?).into()),
            k => return Err(format!("unknown result {k}")),
        })
    }
    fn machine(&mut self) -> Res<KvMachine> {
        let mut m = KvMachine::new();
        // Counts come from the peer: nothing is reserved for them, each item is read.
        for _ in 0..self.u64()? {
            let k = self.string()?;
            m.map.insert(k, self.bytes()?);
        }
        for _ in 0..self.u64()? {
            let client = self.u64()?;
            let seq = self.u64()?;
            m.sessions.insert(client, (seq, self.result()?));
        }
        Ok(m)
    }
}

/// The payload of a frame.
pub(super) fn encode(f: &Frame) -> Vec<u8> {
    let mut e = Enc(Vec::with_capacity(64));
    match f {
        Frame::Hello { token, who } => {
            e.u8(1);
            e.bytes(token);
            e.u64(*who);
        }
        Frame::Welcome => e.u8(2),
        Frame::Refused(why) => {
            e.u8(3);
            e.bytes(why.as_bytes());
        }
        Frame::Raft(m) => {
            e.u8(4);
            match m {
                Message::Vote { term, last_index, last_term } => {
                    e.u8(0);
                    [*term, *last_index, *last_term].iter().for_each(|&v| e.u64(v));
                }
                Message::VoteReply { term, granted } => {
                    e.u8(1);
                    e.u64(*term);
                    e.u8(u8::from(*granted));
                }
                Message::Append { term, prev_index, prev_term, entries, commit, sent } => {
                    e.u8(2);
                    [*term, *prev_index, *prev_term, *commit, *sent].iter().for_each(|&v| e.u64(v));
                    e.u64(entries.len() as u64);
                    for x in entries {
                        e.u64(x.term);
                        e.cmd(&x.cmd);
                    }
                }
                Message::Snapshot { term, index, last_term, machine, sent } => {
                    e.u8(4);
                    [*term, *index, *last_term, *sent].iter().for_each(|&v| e.u64(v));
                    e.machine(machine);
                }
                Message::AppendReply { term, ok, match_index, sent } => {
                    e.u8(3);
                    e.u64(*term);
                    e.u8(u8::from(*ok));
                    e.u64(*match_index);
                    e.u64(*sent);
                }
            }
        }
        Frame::Propose { cmd, wait_ms } => {
            e.u8(5);
            e.cmd(cmd);
            e.u64(*wait_ms);
        }
        Frame::Get { key, wait_ms } => {
            e.u8(6);
            e.bytes(key.as_bytes());
            e.u64(*wait_ms);
        }
        Frame::Result(r) => {
            e.u8(7);
            e.result(r);
        }
        Frame::Value(v) => {
            e.u8(8);
            e.bytes(v);
        }
        Frame::Unset => e.u8(9),
        Frame::NotLeader(h) => {
            e.u8(10);
            e.u8(u8::from(h.is_some()));
            e.u64(h.unwrap_or(0));
        }
        Frame::Unavailable(why) => {
            e.u8(11);
            e.bytes(why.as_bytes());
        }
    }
    e.0
}

/// A frame from its payload; an error says what is wrong with it.
pub(super) fn decode(b: &[u8]) -> Res<Frame> {
    let mut d = Dec(b);
    let text = |d: &mut Dec<'_>| -> Res<String> { Ok(String::from_utf8_lossy(&d.bytes()?).into()) };
    let f = match d.u8()? {
        1 => Frame::Hello { token: d.bytes()?, who: d.u64()? },
        2 => Frame::Welcome,
        3 => Frame::Refused(text(&mut d)?),
        4 => Frame::Raft(match d.u8()? {
            0 => Message::Vote { term: d.u64()?, last_index: d.u64()?, last_term: d.u64()? },
            1 => Message::VoteReply { term: d.u64()?, granted: d.u8()? != 0 },
            2 => {
                let (term, prev_index, prev_term, commit, sent) =
                    (d.u64()?, d.u64()?, d.u64()?, d.u64()?, d.u64()?);
                let n = d.u64()?;
                if n > 256 {
                    return Err(format!("{n} entries in one message"));
                }
                let mut entries = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    entries.push(Entry { term: d.u64()?, cmd: d.cmd()? });
                }
                Message::Append { term, prev_index, prev_term, entries, commit, sent }
            }
            3 => Message::AppendReply {
                term: d.u64()?,
                ok: d.u8()? != 0,
                match_index: d.u64()?,
                sent: d.u64()?,
            },
            4 => Message::Snapshot {
                term: d.u64()?,
                index: d.u64()?,
                last_term: d.u64()?,
                sent: d.u64()?,
                machine: d.machine()?,
            },
            k => return Err(format!("unknown message {k}")),
        }),
        5 => Frame::Propose { cmd: d.cmd()?, wait_ms: d.u64()? },
        6 => Frame::Get { key: d.string()?, wait_ms: d.u64()? },
        7 => Frame::Result(d.result()?),
        8 => Frame::Value(d.bytes()?),
        9 => Frame::Unset,
        10 => {
            let some = d.u8()? != 0;
            let h = d.u64()?;
            Frame::NotLeader(some.then_some(h))
        }
        11 => Frame::Unavailable(text(&mut d)?),
        k => return Err(format!("unknown frame kind {k}")),
    };
    if !d.0.is_empty() {
        return Err("trailing bytes in a frame".into());
    }
    Ok(f)
}

/// Writes one frame.
pub(super) fn write(s: &mut impl Write, f: &Frame) -> std::io::Result<()> {
    let body = encode(f);
    let mut b = Vec::with_capacity(4 + body.len());
    b.extend_from_slice(&(body.len() as u32).to_le_bytes());
    b.extend_from_slice(&body);
    s.write_all(&b)
}

/// Why reading a frame failed.
#[derive(Debug)]
pub(super) enum ReadError {
    Io(std::io::Error),
    Bad(String),
}

impl std::fmt::Display for ReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadError::Io(e) => write!(f, "{e}"),
            ReadError::Bad(why) => write!(f, "bad frame: {why}"),
        }
    }
}

/// Reads one frame; the length is checked before the payload is allocated (STORE-2).
pub(super) fn read(s: &mut impl Read) -> Result<Frame, ReadError> {
    let mut h = [0u8; 4];
    s.read_exact(&mut h).map_err(ReadError::Io)?;
    let n = u32::from_le_bytes(h) as usize;
    if n == 0 || n > MAX_FRAME {
        return Err(ReadError::Bad(format!("a frame of {n} bytes")));
    }
    let mut body = vec![0u8; n];
    s.read_exact(&mut body).map_err(ReadError::Io)?;
    decode(&body).map_err(ReadError::Bad)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_frame_round_trips_and_garbage_is_refused() {
        let cmd = |op| Command { client: 3, seq: 9, op };
        let frames = vec![
            Frame::Hello { token: b"tok".to_vec(), who: CLIENT },
            Frame::Welcome,
            Frame::Refused("bad job token".into()),
            Frame::Raft(Message::Vote { term: 4, last_index: 7, last_term: 3 }),
            Frame::Raft(Message::VoteReply { term: 4, granted: true }),
            Frame::Raft(Message::Append {
                term: 5,
                prev_index: 1,
                prev_term: 1,
                entries: vec![
                    Entry { term: 5, cmd: cmd(Op::Set { key: "k".into(), value: vec![1, 2] }) },
                    Entry { term: 5, cmd: cmd(Op::Add { key: "n".into(), delta: -4 }) },
                    Entry {
                        term: 5,
                        cmd: cmd(Op::CompareSet {
                            key: "g".into(),
                            expected: None,
                            value: b"x".to_vec(),
                        }),
                    },
                    Entry { term: 5, cmd: cmd(Op::Delete { key: "k".into() }) },
                    Entry { term: 5, cmd: cmd(Op::Noop) },
                ],
                commit: 2,
                sent: 99,
            }),
            Frame::Raft(Message::AppendReply { term: 5, ok: false, match_index: 3, sent: 99 }),
            Frame::Raft(Message::Snapshot {
                term: 6,
                index: 40,
                last_term: 5,
                machine: {
                    let mut m = KvMachine::new();
                    m.apply(&cmd(Op::Set { key: "k".into(), value: vec![7] }));
                    m.apply(&Command {
                        client: 4,
                        seq: 2,
                        op: Op::Add { key: "n".into(), delta: 3 },
                    });
                    m
                },
                sent: 7,
            }),
            Frame::Propose { cmd: cmd(Op::Noop), wait_ms: 10 },
            Frame::Get { key: "k".into(), wait_ms: 5 },
            Frame::Result(OpResult::Swapped { ok: false, current: Some(b"y".to_vec()) }),
            Frame::Result(OpResult::Added(-3)),
            Frame::Result(OpResult::Failed("no".into())),
            Frame::Value(vec![0; 3]),
            Frame::Unset,
            Frame::NotLeader(Some(2)),
            Frame::NotLeader(None),
            Frame::Unavailable("no majority".into()),
        ];
        for f in frames {
            let mut b = Vec::new();
            write(&mut b, &f).unwrap();
            assert_eq!(read(&mut &b[..]).unwrap(), f);
            // Every proper prefix of the payload is refused, none panics.
            for cut in 1..b.len() - 4 {
                assert!(decode(&b[4..4 + cut]).is_err(), "{f:?} cut at {cut}");
            }
        }
        let huge = (u32::MAX).to_le_bytes();
        assert!(matches!(read(&mut &huge[..]), Err(ReadError::Bad(_))));
    }
}
