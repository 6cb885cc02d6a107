//! Lowering: one call of a module tree as a program of device ops ([`Op`]), so that a device
//! that runs no host code (a GPU) runs the model's forward and backward, not only the
//! engine's reductions and updates.
//!
//! A module lowers itself ([`crate::module::Module::lower`]) by emitting its forward ops
//! into a [`Lowering`] over symbolic buffers ([`Buf`]: the call's input, slices of the
//! unit's parameters and gradients, values the forward or the backward makes, constants)
//! and by pushing what its backward emits onto the lowering's tape, which runs in reverse
//! once the forward is complete (as autograd replays its graph). The result is a
//! [`Program`]: plain data the engine interprets, allocating each value when it is first
//! written and freeing it after its last read; what the backward reads of the forward is
//! what the call saves ([`Program::saved`]).
//!
//! Every op's host reference is the code the module's own forward and backward run (OPS-2),
//! so a lowered call computes, on a host or simulated device, bitwise what the module
//! computes on the host (LOWER-2).
//!
//! Invariants:
//! - LOWER-1: a program writes each value once, in the phase that owns it, before any op
//!   reads it; parameters are only read and gradients only added to ([`Program::check`]).
//! - LOWER-2: a lowered call's output, input gradient and parameter gradients equal the
//!   module's host forward and backward bit for bit (`lower::tests`: the gpt model's calls,
//!   an MLP of modules with a residual, the zoo's wide-mlp, whose linear and ReLU blocks
//!   lower as those modules do).
//! - LOWER-3: a module that cannot be lowered (BatchNorm, dropout while training, a
//!   module of another crate that does not lower itself) makes the call's lowering an
//!   error naming it; the engine then runs the call as host code, where the device allows.

use std::collections::HashSet;

use crate::error::ModelError;
use crate::ops::Op;

pub(crate) mod layers;
#[cfg(test)]
mod tests;

/// A buffer of a lowered call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Buf {
    /// The call's input activation.
    Input,
    /// Constant `i` of the program ([`Program::consts`]), uploaded by the engine.
    Const(usize),
    /// Elements `at..at + len` of the unit's parameters.
    Params {
        /// First element.
        at: usize,
        /// Elements.
        len: usize,
    },
    /// Elements `at..at + len` of the unit's buffers (BatchNorm's running statistics,
    /// updated by a training forward).
    Buffers {
        /// First element.
        at: usize,
        /// Elements.
        len: usize,
    },
    /// Elements `at..at + len` of the unit's gradients (added to).
    Grads {
        /// First element.
        at: usize,
        /// Elements.
        len: usize,
    },
    /// Forward value `i`.
    Fwd(usize),
    /// The gradient of the call's output.
    GradOut,
    /// Backward value `i`.
    Bwd(usize),
}

/// A value while lowering: a buffer and its shape.
#[derive(Clone, Debug, PartialEq)]
pub struct Val {
    /// Where it is.
    pub buf: Buf,
    /// Its shape.
    pub shape: Vec<usize>,
}

impl Val {
    /// Elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// What a step runs: an op, or a collective over the ranks' statistics communicator
/// (SyncBatchNorm's).
#[derive(Clone, Debug, PartialEq)]
pub enum Exec {
    /// A kernel.
    Op(Op),
    /// Reads `x`; writes every rank's `x`, in rank order (`world` times as long).
    AllGather {
        /// Ranks.
        world: usize,
    },
    /// Reads `x`; writes the sum of every rank's `x`, added in rank order.
    AllReduce,
}

impl Exec {
    /// A short name.
    pub fn label(&self) -> &'static str {
        match self {
            Exec::Op(op) => op.label(),
            Exec::AllGather { .. } => "statistics all-gather",
            Exec::AllReduce => "statistics all-reduce",
        }
    }

    /// OPS-1 for the step's buffers.
    pub fn check_lens(&self, r: &[usize], w: &[usize]) -> Result<(), String> {
        match (self, r, w) {
            (Exec::Op(op), _, _) => op.check_lens(r, w),
            (Exec::AllGather { world }, [x], [y]) if x * world == *y => Ok(()),
            (Exec::AllReduce, [x], [y]) if x == y => Ok(()),
            _ => Err(format!("{}: buffers {r:?} -> {w:?}", self.label())),
        }
    }
}

/// How a call is lowered: its mode and the ranks SyncBatchNorm reduces over.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LowerCtx {
    /// Training (a backward follows) or evaluation (forward only).
    pub training: bool,
    /// Every BatchNorm is a SyncBatchNorm (the runtime's `sync_bn`), besides those that are.
    pub sync_bn: bool,
    /// Ranks the statistics of a SyncBatchNorm are reduced over (1: none).
    pub world: usize,
}

impl LowerCtx {
    /// Training on one rank.
    pub fn training() -> Self {
        LowerCtx { training: true, sync_bn: false, world: 1 }
    }
}

/// One step of a program over its buffers (reads, then writes, as the op lists them).
#[derive(Clone, Debug, PartialEq)]
pub struct Step {
    /// What runs.
    pub exec: Exec,
    /// What it reads.
    pub reads: Vec<Buf>,
    /// What it writes.
    pub writes: Vec<Buf>,
}

/// One call of a model as device ops; see the [module docs](self).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Program {
    /// Constants (as device elements: ids travel as their `u32` bits).
    pub consts: Vec<Vec<f32>>,
    /// Elements of each forward value.
    pub fwd_lens: Vec<usize>,
    /// Elements of each backward value.
    pub bwd_lens: Vec<usize>,
    /// The forward's ops, in order.
    pub forward: Vec<Step>,
    /// The backward's ops, in order.
    pub backward: Vec<Step>,
    /// The forward value that is the call's output, and its shape.
    pub output: (usize, Vec<usize>),
    /// The backward value that is the input's gradient (`None`: the input is data, ids).
    pub input_grad: Option<usize>,
}

impl Program {
    /// Elements of `b` (`None` for the input, the parameters and the gradients, whose
    /// lengths are the engine's).
    pub fn len_of(&self, b: Buf) -> Option<usize> {
        match b {
            Buf::Const(i) => self.consts.get(i).map(Vec::len),
            Buf::Fwd(i) => self.fwd_lens.get(i).copied(),
            Buf::Bwd(i) => self.bwd_lens.get(i).copied(),
            Buf::Params { len, .. } | Buf::Grads { len, .. } | Buf::Buffers { len, .. } => {
                Some(len)
            }
            Buf::Input | Buf::GradOut => None,
        }
    }

    /// What the backward reads of the forward: the forward values, the input and the
    /// constants the call keeps for its backward, in first-read order.
    pub fn saved(&self) -> Vec<Buf> {
        let mut seen = HashSet::new();
        self.backward
            .iter()
            .flat_map(|s| s.reads.iter().copied())
            .filter(|b| matches!(b, Buf::Input | Buf::Fwd(_) | Buf::Const(_)))
            .filter(|b| seen.insert(*b))
            .collect()
    }

    /// For each op of `steps`, the buffers of kinds `kept` reads or writes for the last
    /// time there: what can be freed after it.
    pub fn last_uses(steps: &[Step], keep: &dyn Fn(Buf) -> bool) -> Vec<Vec<Buf>> {
        let mut seen = HashSet::new();
        let mut out = vec![Vec::new(); steps.len()];
        for (i, s) in steps.iter().enumerate().rev() {
            for b in s.reads.iter().chain(&s.writes) {
                if !keep(*b) && seen.insert(*b) {
                    out[i].push(*b);
                }
            }
        }
        out
    }

    /// LOWER-1: every value written once in its own phase before it is read, parameters
    /// only read, gradients only written, each op's lengths accepted by the op (OPS-1);
    /// `params` is the unit's parameter count, `buffers` its buffers', `input` the input's
    /// elements.
    pub fn check(&self, (params, buffers): (usize, usize), input: usize) -> Result<(), ModelError> {
        let bad = |m: String| ModelError::Config(format!("lowered call: {m}"));
        let mut written: HashSet<Buf> = [Buf::Input].into_iter().collect();
        written.extend((0..self.consts.len()).map(Buf::Const));
        for (phase, steps) in [("forward", &self.forward), ("backward", &self.backward)] {
            if phase == "backward" {
                written.insert(Buf::GradOut);
            }
            for s in steps {
                let len = |b: Buf| match b {
                    Buf::Input => Ok(input),
                    Buf::GradOut => Ok(self.output.1.iter().product()),
                    Buf::Params { at, len } | Buf::Grads { at, len } if at + len > params => {
                        Err(bad(format!("{b:?} past the unit's {params} parameters")))
                    }
                    Buf::Buffers { at, len } if at + len > buffers => {
                        Err(bad(format!("{b:?} past the unit's {buffers} buffers")))
                    }
                    _ => self.len_of(b).ok_or_else(|| bad(format!("{b:?} is not a value"))),
                };
                for r in &s.reads {
                    if matches!(r, Buf::Grads { .. }) || !written.contains(r) && !is_state(*r) {
                        return Err(bad(format!("{} reads {r:?} before it is written", phase)));
                    }
                }
                for w in &s.writes {
                    let own = match phase {
                        "forward" => matches!(w, Buf::Fwd(_) | Buf::Buffers { .. }),
                        _ => matches!(w, Buf::Bwd(_) | Buf::Grads { .. }),
                    };
                    let again = matches!(w, Buf::Fwd(_) | Buf::Bwd(_)) && !written.insert(*w);
                    if !own || again {
                        return Err(bad(format!("the {phase} writes {w:?}")));
                    }
                }
                let r: Vec<usize> = s.reads.iter().map(|b| len(*b)).collect::<Result<_, _>>()?;
                let w: Vec<usize> = s.writes.iter().map(|b| len(*b)).collect::<Result<_, _>>()?;
                s.exec.check_lens(&r, &w).map_err(|e| bad(format!("{}: {e}", s.exec.label())))?;
            }
        }
        if !written.contains(&Buf::Fwd(self.output.0)) {
            return Err(bad("the output is never written".into()));
        }
        match self.input_grad {
            Some(g) if !written.contains(&Buf::Bwd(g)) => {
                Err(bad("the input gradient is never written".into()))
            }
            _ => Ok(()),
        }
    }
}

/// The unit's parameters and buffers, there before the call.
fn is_state(b: Buf) -> bool {
    matches!(b, Buf::Params { .. } | Buf::Buffers { .. })
}

/// What a module's backward emits, pushed while its forward is lowered: it gets the
/// gradient of the module's output and returns its input's (`None`: the input is data).
pub type BackwardFn = Box<dyn FnOnce(&mut Lowering, Val) -> Result<Option<Val>, ModelError>>;

/// The builder of a [`Program`]; see the [module docs](self).
pub struct Lowering {
    prog: Program,
    tape: Vec<BackwardFn>,
    backward: bool,
    ctx: LowerCtx,
    buffers_at: usize,
}

impl Lowering {
    /// A lowering of a call in `ctx`.
    pub fn new(ctx: LowerCtx) -> Self {
        Lowering { prog: Program::default(), tape: Vec::new(), backward: false, ctx, buffers_at: 0 }
    }

    /// Whether the call is lowered for training.
    pub fn training(&self) -> bool {
        self.ctx.training
    }

    /// The call's context.
    pub fn ctx(&self) -> LowerCtx {
        self.ctx
    }

    /// Where the module being lowered finds its buffers in the unit's (a composite sets it
    /// for each child, as it gives each child its parameters' offset).
    pub fn buffers_at(&self) -> usize {
        self.buffers_at
    }

    /// Sets [`Lowering::buffers_at`] for the next child.
    pub fn set_buffers_at(&mut self, at: usize) {
        self.buffers_at = at;
    }

    /// The call's input, of `shape`.
    pub fn input(&self, shape: &[usize]) -> Val {
        Val { buf: Buf::Input, shape: shape.to_vec() }
    }

    /// A new value of `shape` in the current phase.
    pub fn value(&mut self, shape: &[usize]) -> Val {
        let n = shape.iter().product();
        let buf = if self.backward {
            self.prog.bwd_lens.push(n);
            Buf::Bwd(self.prog.bwd_lens.len() - 1)
        } else {
            self.prog.fwd_lens.push(n);
            Buf::Fwd(self.prog.fwd_lens.len() - 1)
        };
        Val { buf, shape: shape.to_vec() }
    }

    /// A constant of `shape` (device elements).
    pub fn constant(&mut self, values: Vec<f32>, shape: &[usize]) -> Val {
        self.prog.consts.push(values);
        Val { buf: Buf::Const(self.prog.consts.len() - 1), shape: shape.to_vec() }
    }

    /// Enqueues `op` in the current phase.
    pub fn op(&mut self, op: Op, reads: &[Buf], writes: &[Buf]) {
        self.exec(Exec::Op(op), reads, writes)
    }

    /// Enqueues `exec` (an op or a collective) in the current phase.
    pub fn exec(&mut self, exec: Exec, reads: &[Buf], writes: &[Buf]) {
        let step = Step { exec, reads: reads.to_vec(), writes: writes.to_vec() };
        if self.backward {
            self.prog.backward.push(step);
        } else {
            self.prog.forward.push(step);
        }
    }

    /// Pushes what a module's backward emits (run in reverse order of pushing).
    pub fn on_backward(
        &mut self,
        f: impl FnOnce(&mut Lowering, Val) -> Result<Option<Val>, ModelError> + 'static,
    ) {
        self.tape.push(Box::new(f));
    }

    /// The error of a module that cannot be lowered (LOWER-3).
    pub fn unlowered(what: &str) -> ModelError {
        ModelError::Config(format!("{what} cannot be lowered to device ops"))
    }

    /// The program whose forward ends in `out`: runs the tape, then makes the output and the
    /// input gradient buffers of their own where they would be shared (an output the
    /// backward also reads, a gradient that is the output's).
    /// An evaluation call has no backward.
    pub fn finish(mut self, out: Val, input_grad: bool) -> Result<Program, ModelError> {
        if !self.ctx.training {
            self.tape.clear();
        }
        let input_grad = input_grad && self.ctx.training;
        self.backward = true;
        let mut g = Some(Val { buf: Buf::GradOut, shape: out.shape.clone() });
        if !self.ctx.training {
            g = None;
        }
        while let Some(f) = self.tape.pop() {
            let dy = g.take().ok_or_else(|| {
                ModelError::Config("lowered call: no gradient flows past a module's input".into())
            })?;
            g = f(&mut self, dy)?;
        }
        let input_grad = match (g, input_grad) {
            (Some(g), true) => Some(match g.buf {
                Buf::Bwd(i) => i,
                _ => {
                    let c = self.value(&g.shape);
                    self.op(Op::Copy, &[g.buf], &[c.buf]);
                    index(c.buf)
                }
            }),
            (None, true) => {
                return Err(ModelError::Config(
                    "lowered call: its input gets no gradient, yet one is due".into(),
                ))
            }
            (_, false) => None,
        };
        self.backward = false;
        let read_back = self.prog.saved().contains(&out.buf);
        let out = match out.buf {
            Buf::Fwd(_) if !read_back => out,
            _ => {
                let c = self.value(&out.shape);
                self.op(Op::Copy, &[out.buf], &[c.buf]);
                c
            }
        };
        self.prog.output = (index(out.buf), out.shape);
        self.prog.input_grad = input_grad;
        Ok(self.prog)
    }
}

fn index(b: Buf) -> usize {
    match b {
        Buf::Fwd(i) | Buf::Bwd(i) | Buf::Const(i) => i,
        _ => usize::MAX,
    }
}
