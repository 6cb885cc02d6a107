//! The binary format of a checkpoint's data files, little endian throughout.
//!
//! - A shard file (`shard-NNNNN.bin`): the magic `SLSHARD1`, the format version, the rank
//!   and the number of units (u32 each); per unit the lengths of its params and of its
//!   optimizer state (u64 each); then per unit its params, then its optimizer state (f32).
//! - The buffers file (`buffers.bin`): the magic `SLBUFS01`, the number of units (u32), per
//!   unit the number of buffer values (u64), then the values (f32).
//!
//! Decoding checks the magic, the version and the rank, and refuses a file that ends early
//! or has trailing bytes, naming the file.

use std::path::Path;

use super::{RankShard, UnitShard, FORMAT_VERSION};
use crate::error::{Result, RuntimeError};

const SHARD_MAGIC: &[u8; 8] = b"SLSHARD1";
const BUFFERS_MAGIC: &[u8; 8] = b"SLBUFS01";

pub(super) fn push_f32s(out: &mut Vec<u8>, vals: &[f32]) {
    out.reserve(vals.len() * 4);
    for v in vals {
        out.extend_from_slice(&v.to_le_bytes());
    }
}

pub(super) fn encode_shard(rank: usize, shard: &RankShard) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(SHARD_MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(rank as u32).to_le_bytes());
    out.extend_from_slice(&(shard.units.len() as u32).to_le_bytes());
    for u in &shard.units {
        out.extend_from_slice(&(u.params.len() as u64).to_le_bytes());
        out.extend_from_slice(&(u.optim_state.len() as u64).to_le_bytes());
    }
    for u in &shard.units {
        push_f32s(&mut out, &u.params);
        push_f32s(&mut out, &u.optim_state);
    }
    out
}

/// Size of a shard file of `n_units` units holding `values` f32 values in all.
pub(super) fn shard_file_len(n_units: usize, values: usize) -> u64 {
    (8 + 4 + 4 + 4 + 16 * n_units + 4 * values) as u64
}

/// A little-endian reader that reports truncation against `path`.
struct Reader<'a> {
    path: &'a Path,
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len());
        match end {
            Some(end) => {
                let s = &self.bytes[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(RuntimeError::checkpoint(
                self.path,
                format!(
                    "truncated: needs {n} more bytes at offset {}, file has {}",
                    self.pos,
                    self.bytes.len()
                ),
            )),
        }
    }
    fn u32(&mut self) -> Result<u32> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self) -> Result<u64> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    fn len(&mut self) -> Result<usize> {
        let v = self.u64()?;
        usize::try_from(v).map_err(|_| RuntimeError::checkpoint(self.path, "length overflows"))
    }
    fn f32s(&mut self, n: usize) -> Result<Vec<f32>> {
        let bytes = n
            .checked_mul(4)
            .ok_or_else(|| RuntimeError::checkpoint(self.path, "length overflows"))?;
        let b = self.take(bytes)?;
        Ok(b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
    }
    fn magic(&mut self, want: &[u8; 8]) -> Result<()> {
        if self.take(8)? != want {
            return Err(RuntimeError::checkpoint(self.path, "bad magic: not a Shardline file"));
        }
        Ok(())
    }
    fn finish(&self) -> Result<()> {
        if self.pos != self.bytes.len() {
            return Err(RuntimeError::checkpoint(
                self.path,
                format!("{} trailing bytes", self.bytes.len() - self.pos),
            ));
        }
        Ok(())
    }
}

pub(super) fn decode_shard(path: &Path, bytes: &[u8], rank: usize) -> Result<RankShard> {
    let mut r = Reader { path, bytes, pos: 0 };
    r.magic(SHARD_MAGIC)?;
    let version = r.u32()?;
    if version != FORMAT_VERSION {
        return Err(RuntimeError::checkpoint(
            path,
            format!("format version {version}, this build reads {FORMAT_VERSION}"),
        ));
    }
    let file_rank = r.u32()? as usize;
    if file_rank != rank {
        return Err(RuntimeError::checkpoint(
            path,
            format!("holds rank {file_rank}, expected rank {rank}"),
        ));
    }
    let n_units = r.u32()? as usize;
    let mut lens = Vec::with_capacity(n_units.min(1 << 16));
    for _ in 0..n_units {
        lens.push((r.len()?, r.len()?));
    }
    let mut units = Vec::with_capacity(lens.len());
    for (np, ns) in lens {
        units.push(UnitShard { params: r.f32s(np)?, optim_state: r.f32s(ns)? });
    }
    r.finish()?;
    Ok(RankShard { units })
}

pub(super) fn encode_buffers(buffers: &[Vec<f32>]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(BUFFERS_MAGIC);
    out.extend_from_slice(&(buffers.len() as u32).to_le_bytes());
    for b in buffers {
        out.extend_from_slice(&(b.len() as u64).to_le_bytes());
    }
    for b in buffers {
        push_f32s(&mut out, b);
    }
    out
}

pub(super) fn decode_buffers(path: &Path, bytes: &[u8]) -> Result<Vec<Vec<f32>>> {
    let mut r = Reader { path, bytes, pos: 0 };
    r.magic(BUFFERS_MAGIC)?;
    let n = r.u32()? as usize;
    let mut lens = Vec::with_capacity(n.min(1 << 16));
    for _ in 0..n {
        lens.push(r.len()?);
    }
    let out = lens.into_iter().map(|l| r.f32s(l)).collect::<Result<Vec<_>>>()?;
    r.finish()?;
    Ok(out)
}
