//! Mixed precision with FSDP2's `MixedPrecisionPolicy` semantics, and quantized parameter
//! gathers (ZeRO++'s qwZ): `--param-dtype` is the
//! type parameters travel and compute in, `--reduce-dtype` the type gradients are reduced
//! in; the masters stay `f32`.
//!
//! With `bf16` a unit's parameters are all-gathered as bf16 (packed two to a 32-bit word,
//! `shardline_collectives::bf16`): each rank rounds its `f32` shard once per gather and
//! upcasts the gathered unit once, when it arrives, into the `f32` buffer the kernels read.
//! The CPU backend has no bf16 matrix product, so compute stays `f32` over bf16-valued
//! parameters (the upcast's cost is `StepStats::cast_time`). Stages that keep full
//! parameters (0-2) round a unit's resident copy once per use, so every stage computes with
//! the same values. Gradients come out of backward in `f32`, are rounded and packed for a
//! `SumBf16` reduction (each addition in `f32`, rounded per hop), and the reduced values are
//! upcast into the `f32` gradients the optimizer reads.
//!
//! Defaults: both `f32` (nothing changes); `--reduce-dtype` defaults to `--param-dtype`, as
//! FSDP1 and FSDP2 before torch 2.15 do with `reduce_dtype=None`. torch 2.15's FSDP2 changed
//! that default: `reduce_dtype=None` now reduces in the gradient's own dtype (`f32` for `f32`
//! parameters under `param_dtype=bfloat16`), so torch 2.15's default policy is
//! `--param-dtype bf16 --reduce-dtype f32` here.
//!
//! FSDP2's other two fields, `output_dtype` and `cast_forward_inputs`, are not offered.
//! torch 2.15 defines them as: `output_dtype`, "the dtype for casting floating-point forward
//! outputs" of a wrapped module (default `None`: no cast), "to help implement cases where
//! different modules have different mixed precision policies"; `cast_forward_inputs`
//! (default `True`), whether FSDP casts "the forward's floating-point input tensors to
//! `param_dtype`" before each module's forward, so that a bf16 module computes in bf16 from
//! its first op. Both are casts at module boundaries that exist because torch's modules
//! compute in `param_dtype`. Here they would change nothing but rounding:
//! - compute is `f32` whatever the policy (the CPU backend's `gemm` 0.19 has no bf16
//!   kernel; the gathered unit is upcast once), and a `Tensor` holds `f32` or `u32` only, so
//!   an activation rounded to bf16 values still takes four bytes: no activation memory saved
//!   (saved activations, recomputation checkpoints), no faster kernel;
//! - activations never travel: data parallelism sends parameters and gradients, never a
//!   unit's input or output, so no wire bytes change either;
//! - the policy is one for every unit (no per-unit policies for `output_dtype` to join), and
//!   every unit already hands its successor and the loss `f32`, which `output_dtype=f32`
//!   would ask for; rounding inputs or outputs to bf16 would round the values at unit
//!   boundaries only, which matches neither torch's bf16 numerics (every op's result
//!   rounded) nor `f32`'s.
//!
//! They become worth offering with a backend that computes in bf16 (a CUDA bf16 GEMM, or a
//! CPU bf16 kernel) and bf16 tensors: then `cast_forward_inputs` would round each unit's
//! input once for its kernels, and `output_dtype` would let an `f32` unit (a loss head)
//! follow bf16 ones.
//!
//! Invariants:
//! - PREC-1: parameter masters, gradients as the optimizer reads them, optimizer state,
//!   BatchNorm buffers and statistics, the loss and its all-reduce, checkpoints and exports
//!   are `f32` under every policy (an export is bf16 only where `checkpoint export --dtype
//!   bf16` asks, CKPT-9).
//! - PREC-2: with param dtype bf16 every forward and backward (training and evaluation) sees
//!   each parameter as its master rounded to bf16 (round to nearest even, BFLOAT-1), at every
//!   stage and on every rank.
//! - PREC-3: with param dtype bf16 every parameter all-gather (stage 3's per use, stages 1
//!   and 2's after the update) carries `ceil(shard / 2)` words per rank: half the bytes of
//!   the `f32` gather when shards are even.
//! - PREC-4: with reduce dtype bf16 every gradient reduction (all-reduce at stage 0,
//!   reduce-scatter at 1-3) carries packed bf16, half the bytes of the `f32` one when shards
//!   are even; the reduced values are upcast into `f32` gradients.
//! - PREC-5: the reduce dtype defaults to the param dtype.
//! - QGATHER-1: with `--gather-dtype int8|fp8` every parameter all-gather carries each
//!   rank's shard block-quantized (`quant::words(shard, block)` words, QUANT-1), and every
//!   forward and backward at every stage sees each rank's range as that gather decodes it
//!   from the rank's master (QUANT-4 where a range holds decoded values); masters, gradients
//!   and their reductions are as the rest of the policy says.
//! - QGATHER-2: a rank packs (quantizes, or rounds to bf16) each unit's own shard once per
//!   version of it ([`OwnPacked`]): stage 3 gathers a unit in forward and again in backward
//!   from the same packed slot, packed again only after the unit's update or a load changed
//!   the master.

use std::time::Instant;

use serde::{Deserialize, Serialize};
use shardline_collectives::quant::{self, Code};
use shardline_collectives::{bf16, ReduceOp, Work};

use super::clock::CommClock;
use super::prefetch::Gathered;
use super::reduction::{ReduceWork, Reductions};
use super::stage::GradReduce;
use super::RankEngine;
use crate::error::{Result, RuntimeError};
use crate::memory::{Allocation, Category, MemoryTracker};
use crate::shard::FlatLayout;
use crate::telemetry::Row;

/// A floating-point type of the policy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PrecisionDtype {
    /// 32-bit IEEE float.
    #[default]
    F32,
    /// bfloat16: `f32`'s exponent, 8 bits of significand.
    Bf16,
}

impl PrecisionDtype {
    /// The name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            PrecisionDtype::F32 => "f32",
            PrecisionDtype::Bf16 => "bf16",
        }
    }

    /// Parses `s` as given to `flag`; the error names the flag and the choices.
    pub fn parse(flag: &str, s: &str) -> std::result::Result<Self, String> {
        match s {
            "f32" | "float32" => Ok(PrecisionDtype::F32),
            "bf16" | "bfloat16" => Ok(PrecisionDtype::Bf16),
            other => Err(format!("{flag} must be f32 or bf16, not '{other}'")),
        }
    }
}

/// The 8-bit type of quantized parameter gathers (`--gather-dtype`, QGATHER-1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum GatherDtype {
    /// Symmetric int8 with one scale per block (ZeRO++'s qwZ).
    Int8,
    /// fp8 e4m3 with one scale per block (torchao's float8 all-gather).
    Fp8,
}

impl GatherDtype {
    /// The name on the command line.
    pub fn name(self) -> &'static str {
        self.code().name()
    }

    /// Parses `s` as given to `flag`; the error names the flag and the choices.
    pub fn parse(flag: &str, s: &str) -> std::result::Result<Self, String> {
        match s {
            "int8" => Ok(GatherDtype::Int8),
            "fp8" | "e4m3" => Ok(GatherDtype::Fp8),
            other => Err(format!("{flag} must be int8 or fp8, not '{other}'")),
        }
    }

    pub(crate) fn code(self) -> Code {
        match self {
            GatherDtype::Int8 => Code::Int8,
            GatherDtype::Fp8 => Code::Fp8,
        }
    }
}

/// Quantized parameter gathers: the 8-bit type and the values per scale.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuantGather {
    /// The code.
    pub dtype: GatherDtype,
    /// Values per block (one `f32` scale each).
    pub block: usize,
}

/// The run's policy: the param dtype and the reduce dtype.
///
/// ```
/// use shardline_runtime::engine::{MixedPrecision, PrecisionDtype};
/// let p = MixedPrecision::new(PrecisionDtype::Bf16, None);
/// assert_eq!(p.reduce_dtype, PrecisionDtype::Bf16); // PREC-5
/// assert!(MixedPrecision::default().is_f32());
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MixedPrecision {
    /// What parameters are gathered and computed in.
    pub param_dtype: PrecisionDtype,
    /// What gradients are reduced in.
    pub reduce_dtype: PrecisionDtype,
    /// Parameters gathered block-quantized (`--gather-dtype`), dequantized to `f32` for
    /// compute; `None`: gathered in the param dtype.
    #[serde(default)]
    pub gather_quant: Option<QuantGather>,
}

impl MixedPrecision {
    /// The policy of `param`, reducing in `reduce` or, unset, in `param` (PREC-5).
    pub fn new(param: PrecisionDtype, reduce: Option<PrecisionDtype>) -> Self {
        MixedPrecision {
            param_dtype: param,
            reduce_dtype: reduce.unwrap_or(param),
            gather_quant: None,
        }
    }

    /// The same policy with parameters gathered as `q` (QGATHER-1).
    pub fn with_gather(self, q: Option<QuantGather>) -> Self {
        MixedPrecision { gather_quant: q, ..self }
    }

    /// How parameters travel in gathers: packed bf16, block-quantized, or `f32` (`None`).
    pub(crate) fn param_wire(&self) -> Option<Wire> {
        match (self.gather_quant, self.param_dtype) {
            (Some(q), _) => Some(Wire::Quant(q.dtype.code(), q.block)),
            (None, PrecisionDtype::Bf16) => Some(Wire::Bf16),
            (None, PrecisionDtype::F32) => None,
        }
    }

    /// Everything in `f32`.
    pub fn is_f32(&self) -> bool {
        *self == MixedPrecision::default()
    }

    fn packed_params(&self) -> bool {
        self.param_wire().is_some()
    }

    pub(crate) fn bf16_grads(&self) -> bool {
        self.reduce_dtype == PrecisionDtype::Bf16
    }
}

/// What a packed slot holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Wire {
    /// bf16 values, two to a word (BFLOAT-2).
    Bf16,
    /// 8-bit codes in blocks of the given size, each with an `f32` scale (QUANT-1).
    Quant(Code, usize),
}

/// A unit's flat buffer as `world` packed slots, one per rank's shard: the layout of every
/// bf16 or quantized gather and bf16 reduction (a shard of odd length pads its slot's last
/// word). A quantized slot's blocks start at its shard's start and at every tensor's start
/// within it (`quant::pack_cut`), so each rank's values depend on its own shard alone and
/// a small tensor (a norm's bias) never shares a scale with a large one; every slot takes
/// the most words any rank's needs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Slots {
    world: usize,
    shard: usize,
    wire: Wire,
    /// Quantized: per rank, the lengths of the tensors (and padding) its shard cuts.
    cuts: Vec<Vec<usize>>,
}

/// The lengths of the pieces of `unit`'s tensors (and its padding) in rank `r`'s shard.
fn cuts_of(unit: &FlatLayout, r: usize) -> Vec<usize> {
    let range = unit.shard_range(r);
    let mut at: Vec<usize> = unit
        .params()
        .iter()
        .flat_map(|p| [p.offset, p.offset + p.numel])
        .chain([unit.numel(), range.start, range.end])
        .filter(|x| range.contains(x) || *x == range.end)
        .collect();
    at.sort_unstable();
    at.dedup();
    at.windows(2).map(|w| w[1] - w[0]).collect()
}

impl Slots {
    /// The bf16 slots of `unit` over `world` ranks.
    pub(crate) fn of(unit: &FlatLayout, world: usize) -> Self {
        Slots::on(unit, world, Wire::Bf16)
    }

    /// The slots of `unit` over `world` ranks as `wire` packs them.
    pub(crate) fn on(unit: &FlatLayout, world: usize, wire: Wire) -> Self {
        let cuts = match wire {
            Wire::Bf16 => Vec::new(),
            Wire::Quant(..) => (0..world).map(|r| cuts_of(unit, r)).collect(),
        };
        Slots { world, shard: unit.shard_len(), wire, cuts }
    }

    /// Words per slot.
    pub(crate) fn words(&self) -> usize {
        match self.wire {
            Wire::Bf16 => bf16::words(self.shard),
            Wire::Quant(_, block) => {
                self.cuts.iter().map(|c| quant::words_cut(c, block)).max().unwrap_or(0)
            }
        }
    }

    /// Words of the whole packed buffer.
    pub(crate) fn len(&self) -> usize {
        self.world * self.words()
    }

    pub(crate) fn slot(&self, r: usize) -> std::ops::Range<usize> {
        r * self.words()..(r + 1) * self.words()
    }

    /// Packs rank `r`'s shard into its slot of `packed`; a quantized slot refuses a
    /// non-finite value (QUANT-3), naming `what` and the element.
    pub(crate) fn pack_slot(
        &self,
        r: usize,
        shard: &[f32],
        packed: &mut [f32],
        what: &str,
    ) -> Result<()> {
        let slot = &mut packed[self.slot(r)];
        match self.wire {
            Wire::Bf16 => bf16::pack(shard, slot),
            Wire::Quant(code, block) => {
                let (used, rest) = slot.split_at_mut(quant::words_cut(&self.cuts[r], block));
                rest.fill(0.0);
                quant::pack_cut(code, block, &self.cuts[r], shard, used)
                    .map_err(|i| self.not_finite(what, r, i, shard[i], code))?
            }
        }
        Ok(())
    }

    /// QUANT-3's refusal, naming the unit and the element.
    fn not_finite(&self, what: &str, r: usize, i: usize, v: f32, code: Code) -> RuntimeError {
        RuntimeError::Failed(format!(
            "{what}: element {} is {v}, which a {} gather cannot carry (the run diverged)",
            r * self.shard + i,
            code.name()
        ))
    }

    /// Packs a whole padded buffer, each rank's range into its slot.
    pub(crate) fn pack_all(&self, full: &[f32], packed: &mut [f32], what: &str) -> Result<()> {
        for r in 0..self.world {
            self.pack_slot(r, &full[r * self.shard..(r + 1) * self.shard], packed, what)?;
        }
        Ok(())
    }

    /// Upcasts (or dequantizes) slot `r` into `shard`.
    pub(crate) fn unpack_slot(&self, r: usize, packed: &[f32], shard: &mut [f32]) {
        match self.wire {
            Wire::Bf16 => bf16::unpack(&packed[self.slot(r)], shard),
            Wire::Quant(code, block) => {
                let used = quant::words_cut(&self.cuts[r], block);
                let slot = &packed[self.slot(r)][..used];
                quant::unpack_cut(code, block, &self.cuts[r], slot, shard)
            }
        }
    }

    /// QGATHER-1: the values `r`'s slot decodes to, written over that range of `full` (the
    /// masters there), as every rank that gathers them sees them.
    pub(crate) fn round_trip_slot(&self, r: usize, full: &mut [f32], what: &str) -> Result<()> {
        let values = &mut full[r * self.shard..(r + 1) * self.shard];
        match self.wire {
            Wire::Bf16 => values.iter_mut().for_each(|v| *v = bf16::widen(bf16::round(*v))),
            Wire::Quant(code, block) => {
                let cuts = &self.cuts[r];
                let mut one = vec![0.0; quant::words_cut(cuts, block)];
                quant::pack_cut(code, block, cuts, values, &mut one)
                    .map_err(|i| self.not_finite(what, r, i, values[i], code))?;
                quant::unpack_cut(code, block, cuts, &one, values);
            }
        }
        Ok(())
    }

    /// [`Slots::round_trip_slot`] for every rank's range: the values the ranks compute with.
    pub(crate) fn round_trip_all(&self, full: &mut [f32], what: &str) -> Result<()> {
        (0..self.world).try_for_each(|r| self.round_trip_slot(r, full, what))
    }

    /// Upcasts every slot into its rank's range of the padded buffer `full`, except `skip`.
    pub(crate) fn unpack_all(&self, packed: &[f32], full: &mut [f32], skip: Option<usize>) {
        for r in (0..self.world).filter(|&r| Some(r) != skip) {
            self.unpack_slot(r, packed, &mut full[r * self.shard..(r + 1) * self.shard]);
        }
    }
}

/// QGATHER-1's compute values of a unit: `full` (padded, masters) as the gathers of `world`
/// ranks under `q` decode it, written over it. What a run computes with, for measuring the
/// quantization's error outside a run.
pub fn gather_round_trip(
    unit: &FlatLayout,
    world: usize,
    q: QuantGather,
    full: &mut [f32],
) -> Result<()> {
    Slots::on(unit, world, Wire::Quant(q.dtype.code(), q.block)).round_trip_all(full, unit.name())
}

/// `dst[i] = src[i]` rounded to bf16 and back (PREC-2's compute values).
pub(crate) fn round_trip(src: &[f32], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = bf16::widen(bf16::round(*s));
    }
}

/// A unit's bf16 gradient reduction in flight.
pub(crate) struct PackedReduction {
    work: PackedWork,
    /// Stages 0 and 1: the persistent full `f32` gradient, filled from the result.
    full: Option<Vec<f32>>,
    /// The packed buffers' bytes (ENG-3).
    _alloc: Allocation,
    /// Stages 2 and 3: add the result to the shard an earlier microbatch left (ACC-3).
    add: bool,
}

enum PackedWork {
    /// Stage 0's all-reduce and stage 1's in-place reduce-scatter.
    InPlace(Work<Vec<f32>>),
    /// Stages 2 and 3: packed input, packed own slot.
    Scatter(Work<(Vec<f32>, Vec<f32>)>),
}

impl PackedReduction {
    pub(crate) fn is_done(&self) -> bool {
        match &self.work {
            PackedWork::InPlace(w) => w.is_done(),
            PackedWork::Scatter(w) => w.is_done(),
        }
    }
}

impl RankEngine {
    /// Whether gathers and compute use packed parameters (bf16 or block-quantized).
    pub(super) fn packed_params(&self) -> bool {
        self.cfg.precision.packed_params()
    }

    /// How parameters travel in gathers (`None`: `f32`).
    pub(super) fn param_wire(&self) -> Option<Wire> {
        self.cfg.precision.param_wire()
    }

    /// Whether gradients are reduced in bf16.
    pub(super) fn bf16_grads(&self) -> bool {
        self.cfg.precision.bf16_grads()
    }

    /// Adds `t0`'s elapsed time to the step's conversions.
    fn cast_since(&self, t0: Instant) {
        self.cast.set(self.cast.get() + t0.elapsed());
    }

    /// Stages 0-2 with packed parameters: unit `u`'s resident parameters rounded to bf16
    /// (PREC-2), or each rank's range decoded as its gather would (QGATHER-1), for one use,
    /// counted with the gathered units; `None` in `f32`.
    pub(super) fn rounded_resident(&self, u: usize) -> Result<Option<Gathered>> {
        let Some(wire) = self.param_wire() else {
            return Ok(None);
        };
        let l = self.layout.unit(u);
        let padded = l.padded_numel();
        let what = format!("{} (compute copy)", self.labels[u]);
        let alloc = self.mem.alloc_f32(Category::GatheredUnits, padded, &what)?;
        let t0 = Instant::now();
        let mut full = self.comm.pool().take(padded);
        match wire {
            Wire::Bf16 => round_trip(&self.state.params[u], &mut full),
            Wire::Quant(..) => {
                // QUANT-4: a range that holds decoded values (stages 1, 2) decodes to them.
                full.copy_from_slice(&self.state.params[u]);
                Slots::on(l, self.layout.world(), wire)
                    .round_trip_all(&mut full, &self.labels[u])?;
            }
        }
        self.cast_since(t0);
        Ok(Some(Gathered::new(full, alloc)))
    }

    /// Stages 1 and 2 with packed parameters: all-gathers the updated own ranges as bf16
    /// (PREC-3) or quantized (QGATHER-1); the own range keeps its `f32` master, the others
    /// take the decoded values.
    pub(super) fn gather_updated_packed(&mut self, clock: &mut CommClock) -> Result<()> {
        let n = self.layout.units().len();
        let mut works = Vec::with_capacity(n);
        for u in 0..n {
            let l = self.layout.unit(u);
            let wire = self.param_wire().unwrap_or(Wire::Bf16);
            let slots = Slots::on(l, self.layout.world(), wire);
            let what = format!("{} (packed gather)", self.labels[u]);
            let alloc = self.mem.alloc_f32(Category::CommBuffers, slots.len(), &what)?;
            let t0 = Instant::now();
            let mut packed = self.comm.pool().take(slots.len());
            let own = l.shard_range(self.shard_rank);
            let params = &self.state.params[u][own];
            slots.pack_slot(self.shard_rank, params, &mut packed, &self.labels[u])?;
            self.cast_since(t0);
            works.push((u, slots, alloc, self.gather.all_gather_in_place(packed)));
        }
        for (u, slots, alloc, work) in works {
            let what = format!("all-gather {}", self.labels[u]);
            let packed = clock.wait(&self.trace, self.rank, work, Row::Gather, &what)?;
            let t0 = Instant::now();
            slots.unpack_all(&packed, &mut self.state.params[u], Some(self.shard_rank));
            self.cast_since(t0);
            self.comm.pool().give(packed);
            drop(alloc);
        }
        Ok(())
    }

    /// Issues unit `u`'s gradient reduction in bf16 (PREC-4): `gfull` is rounded and packed
    /// by rank slot; a transient full gradient is freed at once, so only the packed bytes
    /// are in flight (ENG-7 counts them).
    pub(super) fn issue_packed_reduction(
        &self,
        reds: &mut Reductions<ReduceWork>,
        u: usize,
        (gfull, galloc): (Vec<f32>, Option<Allocation>),
        add: bool,
    ) -> Result<()> {
        let slots = Slots::of(self.layout.unit(u), self.layout.world());
        let what = format!("{} (bf16 reduction)", self.labels[u]);
        let out_words =
            if self.rules.reduce == GradReduce::ReduceScatter { slots.words() } else { 0 };
        let alloc = self.mem.alloc_f32(Category::CommBuffers, slots.len() + out_words, &what)?;
        let t0 = Instant::now();
        let mut packed = self.comm.pool().take(slots.len());
        slots.pack_all(&gfull, &mut packed, &what)?;
        self.cast_since(t0);
        let (work, full, unreduced) = match self.rules.reduce {
            GradReduce::AllReduce => {
                let w = self.reduce.all_reduce(packed, ReduceOp::SumBf16);
                (PackedWork::InPlace(w), Some(gfull), 0)
            }
            GradReduce::ReduceScatterInPlace => {
                let w = self.reduce.reduce_scatter_in_place(packed, ReduceOp::SumBf16);
                (PackedWork::InPlace(w), Some(gfull), 0)
            }
            GradReduce::ReduceScatter => {
                self.comm.pool().give(gfull);
                drop(galloc);
                let mut out = self.comm.pool().take(out_words);
                out.resize(out_words, 0.0);
                let w = self.reduce.reduce_scatter(packed, out, ReduceOp::SumBf16);
                (PackedWork::Scatter(w), None, alloc.bytes())
            }
        };
        let p = PackedReduction { work, full, _alloc: alloc, add };
        reds.issue(u, unreduced, ReduceWork::Packed(p));
        Ok(())
    }

    /// Waits for unit `u`'s bf16 reduction and upcasts the result where the optimizer
    /// reads it (PREC-4): the whole buffer (stage 0), the own range of the persistent
    /// buffer (stage 1), or the `f32` shard (stages 2 and 3).
    pub(super) fn finish_packed_reduction(
        &mut self,
        u: usize,
        p: PackedReduction,
        clock: &mut CommClock,
    ) -> Result<()> {
        let l = self.layout.unit(u);
        let slots = Slots::of(l, self.layout.world());
        let (trace, rank, shard) = (&self.trace, self.rank, self.shard_rank);
        match (p.work, p.full) {
            (PackedWork::InPlace(work), Some(mut full)) => {
                let kind = match self.rules.reduce {
                    GradReduce::AllReduce => "all-reduce",
                    _ => "reduce-scatter",
                };
                let what = format!("{kind} {}", self.labels[u]);
                let packed = clock.wait(trace, rank, work, Row::Reduce, &what)?;
                let t0 = Instant::now();
                if self.rules.reduce == GradReduce::AllReduce {
                    slots.unpack_all(&packed, &mut full, None);
                } else {
                    slots.unpack_slot(shard, &packed, &mut full[l.shard_range(shard)]);
                }
                self.cast_since(t0);
                self.comm.pool().give(packed);
                self.state.grads[u] = full;
            }
            (PackedWork::Scatter(work), _) => {
                let what = format!("reduce-scatter {}", self.labels[u]);
                let (packed, out) = clock.wait(trace, rank, work, Row::Reduce, &what)?;
                let t0 = Instant::now();
                if p.add {
                    // ACC-3: the microbatches' reduced gradients sum in the f32 shard.
                    let mut part = vec![0.0; l.shard_len()];
                    bf16::unpack(&out, &mut part);
                    let acc = &mut self.state.grads[u];
                    acc.iter_mut().zip(&part).for_each(|(a, s)| *a += s);
                } else {
                    let mut shard = std::mem::take(&mut self.state.grads[u]);
                    shard.resize(l.shard_len(), 0.0);
                    bf16::unpack(&out, &mut shard);
                    self.state.grads[u] = shard;
                }
                self.cast_since(t0);
                self.comm.pool().give(packed);
                self.comm.pool().give(out);
            }
            (PackedWork::InPlace(_), None) => {
                unreachable!("an in-place bf16 reduction always holds its full gradient")
            }
        }
        Ok(())
    }
}

/// Each unit's own shard as it goes on the wire, kept until the master changes (QGATHER-2):
/// the packed slot and its charge (a communication buffer of the rank).
#[derive(Default)]
pub(crate) struct OwnPacked {
    slots: Vec<Option<(Vec<f32>, Allocation)>>,
    /// Packs done so far (what the tests count).
    #[cfg(test)]
    packs: u64,
}

impl OwnPacked {
    /// Room for `units` units, none packed.
    pub(crate) fn new(units: usize) -> Self {
        OwnPacked {
            slots: (0..units).map(|_| None).collect(),
            #[cfg(test)]
            packs: 0,
        }
    }

    /// Unit `u`'s master changed (its update, a load): its packed slot is stale.
    pub(crate) fn invalidate(&mut self, u: usize) {
        if let Some(s) = self.slots.get_mut(u) {
            *s = None;
        }
    }

    /// Every master changed.
    pub(crate) fn clear(&mut self) {
        self.slots.iter_mut().for_each(|s| *s = None);
    }

    /// How many times a shard was packed.
    #[cfg(test)]
    pub(crate) fn packs(&self) -> u64 {
        self.packs
    }

    /// Writes unit `u`'s own slot of `packed` (rank `rank`'s, as `slots` lay it out) from
    /// `shard`, packing it only when no packed copy of this version is kept.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn fill(
        &mut self,
        u: usize,
        slots: &Slots,
        rank: usize,
        shard: &[f32],
        packed: &mut [f32],
        (what, mem): (&str, &MemoryTracker),
    ) -> Result<()> {
        let range = slots.slot(rank);
        if let Some(Some((kept, _))) = self.slots.get(u) {
            packed[range].copy_from_slice(kept);
            return Ok(());
        }
        slots.pack_slot(rank, shard, packed, what)?;
        #[cfg(test)]
        {
            self.packs += 1;
        }
        let label = format!("{what} (own packed shard, until its update)");
        let charge = mem.alloc_f32(Category::CommBuffers, range.len(), &label)?;
        if let Some(s) = self.slots.get_mut(u) {
            *s = Some((packed[range].to_vec(), charge));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use shardline_models::ParamSpec;

    /// PREC-5 and the flag's parsing: the reduce dtype follows the param dtype unless set;
    /// an unknown type names the flag.
    #[test]
    fn prec5_reduce_dtype_defaults_to_the_param_dtype() {
        use PrecisionDtype::*;
        assert_eq!(MixedPrecision::new(Bf16, None).reduce_dtype, Bf16);
        assert_eq!(MixedPrecision::new(F32, None).reduce_dtype, F32);
        assert_eq!(MixedPrecision::new(Bf16, Some(F32)).reduce_dtype, F32);
        assert_eq!(PrecisionDtype::parse("--param-dtype", "bf16"), Ok(Bf16));
        let e = PrecisionDtype::parse("--param-dtype", "f16").unwrap_err();
        assert!(e.contains("--param-dtype") && e.contains("f16"), "{e}");
    }

    /// PREC-3's layout: every rank's range of a padded buffer goes to its own slot of
    /// `ceil(shard / 2)` words and comes back rounded to bf16 (BFLOAT-2), odd shards included;
    /// a skipped slot is left as it was.
    #[test]
    fn prec3_slots_round_trip_each_ranks_range() {
        for (numel, world) in [(10usize, 2usize), (9, 3), (7, 4)] {
            let spec = [ParamSpec { name: "w".into(), shape: vec![numel] }];
            let unit = FlatLayout::from_params("u", &spec, world).unwrap();
            let slots = Slots::of(&unit, world);
            let padded = unit.padded_numel();
            assert_eq!(slots.len(), world * unit.shard_len().div_ceil(2));
            let full: Vec<f32> = (0..padded).map(|i| (i as f32 * 1.37).sin() * 100.0).collect();
            let mut packed = vec![0.0; slots.len()];
            slots.pack_all(&full, &mut packed, "u").unwrap();
            let mut back = vec![f32::NAN; padded];
            slots.unpack_all(&packed, &mut back, Some(1));
            for (i, (&x, &y)) in full.iter().zip(&back).enumerate() {
                if unit.shard_range(1).contains(&i) {
                    assert!(y.is_nan(), "the skipped slot is untouched");
                } else {
                    assert_eq!(y.to_bits(), half::bf16::from_f32(x).to_f32().to_bits(), "{i}");
                }
            }
            let mut own = vec![0.0; unit.shard_len()];
            let mut one = vec![0.0; slots.len()];
            slots.pack_slot(1, &full[unit.shard_range(1)], &mut one, "u").unwrap();
            slots.unpack_slot(1, &one, &mut own);
            assert_eq!(own, back_of(&full[unit.shard_range(1)]));
        }
    }

    fn back_of(x: &[f32]) -> Vec<f32> {
        let mut out = vec![0.0; x.len()];
        round_trip(x, &mut out);
        out
    }

    /// PREC-2's compute values are `half`'s round to nearest even, upcast exactly.
    #[test]
    fn prec2_compute_values_are_the_masters_rounded_to_bf16() {
        let x: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.731).tan()).collect();
        for (a, b) in x.iter().zip(back_of(&x)) {
            assert_eq!(b.to_bits(), half::bf16::from_f32(*a).to_f32().to_bits());
        }
    }
}
