//! The TCP transport's wire format, without I/O: the hello that opens a socket (TCP-1), the
//! frame header (TCP-2), how a message is cut into chunks, and the poison frame's body.
//!
//! A hello is [`HELLO_FIXED`] bytes (magic, version, lane name length, the listener's nonce,
//! lane generation, rank, socket index; little-endian) followed by the lane name. A frame is
//! a [`HEADER_BYTES`] header (magic, kind, [`Tag`], message length, offset, chunk length,
//! crc32 of the header) and its payload: a chunk of the message, or for a poison frame the
//! origin rank (`u32`) and the reason.

use crate::transport::{Poison, Tag, TransportError};

/// Largest chunk (frame payload) of a message; also the striping unit.
pub const CHUNK_BYTES: usize = 1 << 20;
/// Longest poison reason sent or accepted.
pub const MAX_POISON_REASON: usize = 1024;
/// Bytes of a frame header.
pub(super) const HEADER_BYTES: usize = 64;
/// Bytes of a hello before the lane name.
pub(super) const HELLO_FIXED: usize = 4 + 2 + 2 + 16 + 8 + 4 + 4;
/// Longest lane name a hello carries.
pub(super) const MAX_LANE_NAME: usize = 256;
/// Frame kind: a chunk of a message.
pub(super) const KIND_DATA: u32 = 1;
/// Frame kind: a poison record.
pub(super) const KIND_POISON: u32 = 2;
const HELLO_MAGIC: u32 = u32::from_le_bytes(*b"SLTH");
const FRAME_MAGIC: u32 = u32::from_le_bytes(*b"SLTF");
const VERSION: u16 = 1;

/// Number of chunks (frames) of a message of `len` bytes; an empty message takes one.
#[inline]
pub(super) fn chunks_of(len: usize) -> usize {
    len.div_ceil(CHUNK_BYTES).max(1)
}

/// Offset and length of chunk `j` of a message of `len` bytes.
#[inline]
pub(super) fn chunk_range(len: usize, j: usize) -> (usize, usize) {
    let off = j * CHUNK_BYTES;
    (off, (len - off).min(CHUNK_BYTES))
}

/// The header of a frame of `kind` carrying `n` bytes at `offset` of a `msg_len`-byte
/// message tagged `tag`.
pub(super) fn encode_header(
    kind: u32,
    tag: &Tag,
    msg_len: u64,
    offset: u64,
    n: u32,
) -> [u8; HEADER_BYTES] {
    let mut h = [0u8; HEADER_BYTES];
    h[0..4].copy_from_slice(&FRAME_MAGIC.to_le_bytes());
    h[4..8].copy_from_slice(&kind.to_le_bytes());
    h[8..40].copy_from_slice(&tag.encode());
    h[40..48].copy_from_slice(&msg_len.to_le_bytes());
    h[48..56].copy_from_slice(&offset.to_le_bytes());
    h[56..60].copy_from_slice(&n.to_le_bytes());
    let crc = crc32fast::hash(&h[0..60]);
    h[60..64].copy_from_slice(&crc.to_le_bytes());
    h
}

/// A decoded frame header.
pub(super) struct Header {
    pub(super) kind: u32,
    pub(super) tag: Tag,
    pub(super) msg_len: u64,
    pub(super) offset: u64,
    pub(super) n: u32,
}

/// TCP-2: decodes a header from `peer`, checking its magic and crc (`Corrupt` otherwise);
/// the caller checks kind, tag and lengths against what it expects.
pub(super) fn decode_header(h: &[u8; HEADER_BYTES], peer: usize) -> Result<Header, TransportError> {
    let corrupt = |detail: &str| TransportError::Corrupt { peer, detail: detail.to_owned() };
    let u32_at = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
    let u64_at = |i: usize| {
        let mut a = [0u8; 8];
        a.copy_from_slice(&h[i..i + 8]);
        u64::from_le_bytes(a)
    };
    if u32_at(0) != FRAME_MAGIC {
        return Err(corrupt("bad frame magic"));
    }
    if u32_at(60) != crc32fast::hash(&h[0..60]) {
        return Err(corrupt("header crc mismatch"));
    }
    let mut tb = [0u8; Tag::WIRE_BYTES];
    tb.copy_from_slice(&h[8..40]);
    Ok(Header {
        kind: u32_at(4),
        tag: Tag::decode(&tb),
        msg_len: u64_at(40),
        offset: u64_at(48),
        n: u32_at(56),
    })
}

/// The body of a poison frame: the origin rank and the reason, cut to
/// [`MAX_POISON_REASON`] bytes at a character boundary.
pub(super) fn encode_poison(poison: &Poison) -> Vec<u8> {
    let mut n = poison.reason.len().min(MAX_POISON_REASON);
    while !poison.reason.is_char_boundary(n) {
        n -= 1;
    }
    let mut body = (poison.origin as u32).to_le_bytes().to_vec();
    body.extend_from_slice(&poison.reason.as_bytes()[..n]);
    body
}

/// The error a poison frame's `body` (at least 4 bytes) reports.
pub(super) fn poisoned(body: &[u8]) -> TransportError {
    let origin = u32::from_le_bytes([body[0], body[1], body[2], body[3]]) as usize;
    TransportError::Poisoned(Poison {
        origin,
        reason: String::from_utf8_lossy(&body[4..]).into_owned(),
    })
}

/// The hello of socket `idx` from `rank` for the `generation`-th opening of `lane`, to a
/// listener that published `nonce`.
pub(super) fn encode_hello(
    nonce: &[u8; 16],
    generation: u64,
    rank: usize,
    idx: usize,
    lane: &str,
) -> Vec<u8> {
    let mut hello = Vec::with_capacity(HELLO_FIXED + lane.len());
    hello.extend_from_slice(&HELLO_MAGIC.to_le_bytes());
    hello.extend_from_slice(&VERSION.to_le_bytes());
    hello.extend_from_slice(&(lane.len() as u16).to_le_bytes());
    hello.extend_from_slice(nonce);
    hello.extend_from_slice(&generation.to_le_bytes());
    hello.extend_from_slice(&(rank as u32).to_le_bytes());
    hello.extend_from_slice(&(idx as u32).to_le_bytes());
    hello.extend_from_slice(lane.as_bytes());
    hello
}

/// The fixed part of a hello that passed TCP-1's checks.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Hello {
    /// Bytes of the lane name that follows.
    pub(super) lane_len: usize,
    pub(super) generation: u64,
    pub(super) rank: usize,
    pub(super) idx: usize,
}

/// TCP-1: checks the fixed part of a hello against this listener's `nonce`, the `world` and
/// the sockets per peer; the error says what is wrong.
pub(super) fn decode_hello(
    h: &[u8; HELLO_FIXED],
    nonce: &[u8; 16],
    world: usize,
    sockets_per_peer: usize,
) -> Result<Hello, String> {
    let u32_at = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]);
    if u32_at(0) != HELLO_MAGIC {
        return Err("bad magic".into());
    }
    if u16::from_le_bytes([h[4], h[5]]) != VERSION {
        return Err("unsupported version".into());
    }
    let lane_len = u16::from_le_bytes([h[6], h[7]]) as usize;
    if !ct_eq(&h[8..24], nonce) {
        return Err("bad nonce".into());
    }
    let mut g = [0u8; 8];
    g.copy_from_slice(&h[24..32]);
    let generation = u64::from_le_bytes(g);
    let rank = u32_at(32) as usize;
    let idx = u32_at(36) as usize;
    if lane_len > MAX_LANE_NAME || rank >= world || idx >= sockets_per_peer {
        return Err(format!("bad hello (lane name {lane_len} B, rank {rank}, socket {idx})"));
    }
    Ok(Hello { lane_len, generation, rank, idx })
}

/// A nonce as the store carries it.
pub(super) fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A nonce from the store, if it is one.
pub(super) fn unhex(s: &str) -> Option<[u8; 16]> {
    let mut out = [0u8; 16];
    if s.len() != 32 {
        return None;
    }
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// Compares in a time that does not depend on where the bytes differ.
fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len()
        && std::hint::black_box(a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y))) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// TCP-2: a header round-trips; a flipped bit is `Corrupt`.
    #[test]
    fn header_roundtrip_and_crc() {
        let t = Tag { lane: 7, seq: 3, kind: 1, count: 10, root: u32::MAX, step: 5 };
        let h = encode_header(KIND_DATA, &t, 100, 8, 92);
        let d = decode_header(&h, 1).unwrap();
        assert_eq!((d.kind, d.tag, d.msg_len, d.offset, d.n), (KIND_DATA, t, 100, 8, 92));
        let mut bad = h;
        bad[50] ^= 1;
        assert!(matches!(decode_header(&bad, 1), Err(TransportError::Corrupt { peer: 1, .. })));
    }

    /// TCP-1: a hello round-trips for its listener; another nonce, rank or socket is refused.
    #[test]
    fn hello_checks_nonce_rank_and_socket() {
        let nonce = [5u8; 16];
        let hello = encode_hello(&nonce, 3, 1, 2, "grads");
        let fixed: &[u8; HELLO_FIXED] = hello[..HELLO_FIXED].try_into().unwrap();
        assert_eq!(&hello[HELLO_FIXED..], b"grads");
        let want = Hello { lane_len: 5, generation: 3, rank: 1, idx: 2 };
        assert_eq!(decode_hello(fixed, &nonce, 2, 3), Ok(want));
        assert_eq!(decode_hello(fixed, &[6u8; 16], 2, 3), Err("bad nonce".to_string()));
        assert!(decode_hello(fixed, &nonce, 1, 3).is_err(), "rank 1 of world 1");
        assert!(decode_hello(fixed, &nonce, 2, 2).is_err(), "socket 2 of 2");
        assert_eq!(unhex(&hex(&nonce)), Some(nonce));
    }

    /// A poison body carries its origin and at most MAX_POISON_REASON bytes of reason, cut
    /// at a character boundary.
    #[test]
    fn poison_body_roundtrip() {
        let long = "é".repeat(MAX_POISON_REASON);
        let body = encode_poison(&Poison { origin: 3, reason: long });
        assert!(body.len() <= 4 + MAX_POISON_REASON);
        match poisoned(&body) {
            TransportError::Poisoned(p) => {
                assert_eq!(p.origin, 3);
                assert_eq!(p.reason, "é".repeat(MAX_POISON_REASON / 2));
            }
            other => panic!("{other:?}"),
        }
    }
}
