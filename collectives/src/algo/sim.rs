//! In-memory simulation of schedules (no I/O): runs every rank's schedule step by step over
//! W virtual arrays, checking ALGO-1 (matching sends and receives) and ALGO-2 (disjoint
//! ranges) on the way. Also used by the property tests.

use super::{Action, LocalOp, Schedule};
use crate::reduce::Combine;

/// Runs `scheds[r]` over `bufs[r]` (each `buf_len` long; scratch is added here) and returns
/// the work buffers.
pub(crate) fn simulate(
    scheds: &[Schedule],
    bufs: Vec<Vec<f32>>,
    combine: Combine,
) -> Result<Vec<Vec<f32>>, String> {
    let inputs = vec![Vec::new(); bufs.len()];
    simulate_with_inputs(scheds, bufs, inputs, combine)
}

/// [`simulate`] with each rank's separate input (`input_len` long) after its scratch.
pub(crate) fn simulate_with_inputs(
    scheds: &[Schedule],
    bufs: Vec<Vec<f32>>,
    inputs: Vec<Vec<f32>>,
    combine: Combine,
) -> Result<Vec<Vec<f32>>, String> {
    simulate_io(scheds, bufs, inputs, combine).map(|(bufs, _)| bufs)
}

/// Every rank's work buffer and output region after a simulated op.
pub(crate) type Simulated = (Vec<Vec<f32>>, Vec<Vec<f32>>);

/// [`simulate_with_inputs`] that also returns each rank's output region (`output_len`
/// long, NaN before the op).
pub(crate) fn simulate_io(
    scheds: &[Schedule],
    bufs: Vec<Vec<f32>>,
    inputs: Vec<Vec<f32>>,
    combine: Combine,
) -> Result<Simulated, String> {
    let world = scheds.len();
    let steps = scheds.iter().map(|s| s.steps.len()).max().unwrap_or(0);
    if scheds.iter().any(|s| s.steps.len() != steps) {
        return Err("ranks disagree on the number of steps".into());
    }
    let mut mem: Vec<Vec<f32>> = Vec::with_capacity(world);
    for (r, ((s, mut b), input)) in scheds.iter().zip(bufs).zip(inputs).enumerate() {
        s.validate(r, world)?;
        if b.len() != s.buf_len || input.len() != s.input_len {
            return Err(format!("rank {r}: buffer or input does not match the schedule"));
        }
        b.resize(s.buf_len + s.scratch_len, f32::NAN);
        b.extend_from_slice(&input);
        b.resize(b.len() + s.output_len, f32::NAN);
        mem.push(b);
    }
    for i in 0..steps {
        let before = mem.clone();
        for r in 0..world {
            let step = &scheds[r].steps[i];
            for rv in &step.recvs {
                let p = rv.peer;
                let sends: Vec<_> =
                    scheds[p].steps[i].sends.iter().filter(|x| x.peer == r).collect();
                let [snd] = sends.as_slice() else {
                    return Err(format!(
                        "step {i}: rank {r} expects one message from {p}, got {}",
                        sends.len()
                    ));
                };
                if snd.range.len() != rv.range.len() {
                    return Err(format!("step {i}: length mismatch {p}->{r}"));
                }
                if snd.action != rv.action {
                    return Err(format!(
                        "step {i}: {p}->{r} sent for {:?}, received for {:?}",
                        snd.action, rv.action
                    ));
                }
                let src = &before[p][snd.range.clone()];
                match (rv.action, &rv.out) {
                    (Action::Copy, _) => mem[r][rv.range.clone()].copy_from_slice(src),
                    (Action::Reduce, None) => combine.apply(&mut mem[r][rv.range.clone()], src),
                    (Action::Reduce, Some(out)) => {
                        let acc = mem[r][rv.range.clone()].to_vec();
                        combine.apply_to(&mut mem[r][out.clone()], &acc, src);
                    }
                }
            }
            for snd in &step.sends {
                let n = scheds[snd.peer].steps[i].recvs.iter().filter(|x| x.peer == r).count();
                if n != 1 {
                    return Err(format!("step {i}: send {r}->{} received {n} times", snd.peer));
                }
            }
            for l in &step.local {
                match l {
                    LocalOp::Copy { src, dst } => {
                        let v = mem[r][src.clone()].to_vec();
                        mem[r][dst.clone()].copy_from_slice(&v);
                    }
                    LocalOp::Reduce { src, dst } => {
                        let v = mem[r][src.clone()].to_vec();
                        combine.apply(&mut mem[r][dst.clone()], &v);
                    }
                }
            }
        }
    }
    let mut outs = Vec::with_capacity(world);
    for (m, s) in mem.iter_mut().zip(scheds) {
        let (_, read_end, _) = s.regions();
        outs.push(m.split_off(read_end));
        m.truncate(s.buf_len);
    }
    Ok((mem, outs))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algo::*;
    use crate::reduce::Combine;
    use crate::reduce::ReduceOp;
    use crate::topology::Topology;
    use proptest::prelude::*;

    /// (rank, world, count, topology) -> schedule.
    type Builder = fn(usize, usize, usize, &Topology) -> Schedule;

    fn inputs(world: usize, len: usize, seed: u64) -> Vec<Vec<f32>> {
        (0..world)
            .map(|r| {
                (0..len)
                    .map(|i| {
                        let x = (seed ^ (r as u64 * 7919 + i as u64 * 104_729))
                            .wrapping_mul(0x9E37_79B9_7F4A_7C15);
                        ((x >> 40) % 2001) as f32 - 1000.0
                    })
                    .collect()
            })
            .collect()
    }

    /// Integer-valued inputs make f32 sums exact, so every schedule must equal the naive fold.
    fn naive(ins: &[Vec<f32>], op: ReduceOp) -> Vec<f32> {
        let mut acc = ins[0].clone();
        for x in &ins[1..] {
            crate::reduce::reduce_into(op, &mut acc, x);
        }
        acc
    }

    fn check_all_reduce(world: usize, count: usize, topo: &Topology, op: ReduceOp) {
        let ins = inputs(world, count, 17);
        let want = naive(&ins, op);
        let algos: [(&str, Builder); 4] = [
            ("ring", |r, w, c, _| ring_all_reduce(r, w, c)),
            ("ring+direct gather", |r, w, c, _| ring_all_reduce_direct_gather(r, w, c)),
            ("direct", |r, w, c, _| direct_all_reduce(r, w, c)),
            ("hier", |r, _, c, t| hier_all_reduce(r, t, c)),
        ];
        for (name, f) in algos {
            let scheds: Vec<_> = (0..world).map(|r| f(r, world, count, topo)).collect();
            let out = simulate(&scheds, ins.clone(), Combine::Op(op)).unwrap();
            for (r, o) in out.iter().enumerate() {
                assert_eq!(o, &want, "{name} all_reduce w={world} c={count} rank {r}");
            }
        }
    }

    fn check_rs_ag(world: usize, n: usize, topo: &Topology) {
        let ins = inputs(world, world * n, 5);
        let want = naive(&ins, ReduceOp::Sum);
        let rs: [Builder; 3] = [
            |r, w, n, _| ring_reduce_scatter(r, w, n),
            |r, w, n, _| direct_reduce_scatter(r, w, n),
            |r, _, n, t| hier_reduce_scatter(r, t, n),
        ];
        for f in rs {
            let scheds: Vec<_> = (0..world).map(|r| f(r, world, n, topo)).collect();
            let out = simulate(&scheds, ins.clone(), Combine::Op(ReduceOp::Sum)).unwrap();
            for (r, o) in out.iter().enumerate() {
                // ALGO-4: rank r holds slot r.
                assert_eq!(
                    &o[r * n..(r + 1) * n],
                    &want[r * n..(r + 1) * n],
                    "rs w={world} n={n} rank {r}"
                );
            }
        }
        // ALGO-5: every reduce-scatter into a separate output, alone and mixed across ranks
        // with the in-place form (the same wire traffic); non-associative records expose the
        // operand order, which must be the in-place form's.
        fn ordered(acc: &mut [f32], other: &[f32]) {
            acc[0] = acc[0] * 3.0 - other[0];
        }
        for f in rs {
            for combine in [Combine::Op(ReduceOp::Sum), Combine::Records { len: 1, f: ordered }] {
                let plain: Vec<_> = (0..world).map(|r| f(r, world, n, topo)).collect();
                let want = simulate(&plain, ins.clone(), combine).unwrap();
                for mix in 0..2 {
                    let into = |r: usize| mix == 0 || r.is_multiple_of(2);
                    let scheds: Vec<_> = (0..world)
                        .map(|r| {
                            let s = f(r, world, n, topo);
                            if into(r) {
                                reduce_scatter_into(s, r, n)
                            } else {
                                s
                            }
                        })
                        .collect();
                    let empty = vec![Vec::new(); world];
                    let (bufs, outs) = simulate_io(&scheds, ins.clone(), empty, combine).unwrap();
                    for r in 0..world {
                        let got = if into(r) { &outs[r][..] } else { &bufs[r][r * n..(r + 1) * n] };
                        let exp = &want[r][r * n..(r + 1) * n];
                        assert_eq!(got.len(), exp.len());
                        assert!(
                            got.iter().zip(exp).all(|(a, b)| a.to_bits() == b.to_bits()),
                            "rs into w={world} n={n} rank {r} mix {mix}"
                        );
                    }
                }
            }
        }
        let shards = inputs(world, n, 9);
        let full: Vec<f32> = shards.concat();
        let own_in_slot = |r: usize| {
            let mut b = vec![f32::NAN; world * n];
            b[r * n..(r + 1) * n].copy_from_slice(&shards[r]);
            b
        };
        // Direct in pieces (more pieces than elements included): from the input region (the
        // work buffer starts empty, NaN), in place, and the two forms mixed across ranks in
        // one op (the same wire traffic).
        for pieces in [1, 2, 3, n + 5] {
            for mix in 0..3 {
                let from_input = |r: usize| mix == 0 || (mix == 2 && r.is_multiple_of(2));
                let scheds: Vec<_> = (0..world)
                    .map(|r| {
                        if from_input(r) {
                            direct_all_gather_from_input(r, world, n, pieces)
                        } else {
                            direct_all_gather(r, world, n, pieces)
                        }
                    })
                    .collect();
                let bufs = (0..world)
                    .map(|r| if from_input(r) { vec![f32::NAN; world * n] } else { own_in_slot(r) })
                    .collect();
                let ins = (0..world)
                    .map(|r| if from_input(r) { shards[r].clone() } else { Vec::new() })
                    .collect();
                let out =
                    simulate_with_inputs(&scheds, bufs, ins, Combine::Op(ReduceOp::Sum)).unwrap();
                for o in &out {
                    assert_eq!(o, &full, "direct ag w={world} n={n} pieces={pieces} mix={mix}");
                }
            }
        }
        let ag: [Builder; 2] =
            [|r, w, n, _| ring_all_gather(r, w, n), |r, _, n, t| hier_all_gather(r, t, n)];
        for f in ag {
            let scheds: Vec<_> = (0..world).map(|r| f(r, world, n, topo)).collect();
            let bufs = (0..world).map(own_in_slot).collect();
            let out = simulate(&scheds, bufs, Combine::Op(ReduceOp::Sum)).unwrap();
            for o in &out {
                assert_eq!(o, &full, "ag w={world} n={n}");
            }
        }
    }

    fn check_broadcast(world: usize, count: usize, root: usize, pieces: usize) {
        let src = inputs(1, count, 3).remove(0);
        for direct in [false, true] {
            let scheds: Vec<_> = (0..world)
                .map(|r| {
                    if direct {
                        direct_broadcast(r, world, root, count)
                    } else {
                        chain_broadcast(r, world, root, count, pieces)
                    }
                })
                .collect();
            let bufs = (0..world)
                .map(|r| if r == root { src.clone() } else { vec![f32::NAN; count] })
                .collect();
            let out = simulate(&scheds, bufs, Combine::Op(ReduceOp::Sum)).unwrap();
            for o in &out {
                assert_eq!(o, &src);
            }
        }
    }

    #[test]
    fn split_is_even_and_covers() {
        let c = split(3..13, 4);
        assert_eq!(c, vec![3..6, 6..9, 9..11, 11..13]);
        assert_eq!(split(0..2, 4).iter().map(|r| r.len()).sum::<usize>(), 2);
    }

    #[test]
    fn schedules_match_naive_on_grid() {
        for world in [1usize, 2, 3, 4, 7, 8] {
            let topo = Topology::single_node(world);
            for count in [0usize, 1, world.saturating_sub(1), 997] {
                for op in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Min] {
                    check_all_reduce(world, count, &topo, op);
                }
                check_rs_ag(world, count, &topo);
                for root in [0, world - 1] {
                    check_broadcast(world, count, root, 5);
                }
            }
        }
    }

    #[test]
    fn hierarchical_on_multi_node_topologies() {
        for topo in [
            Topology::uniform(2, 2),
            Topology::uniform(2, 3),
            Topology::uniform(3, 2),
            Topology::from_nodes(vec![0, 1, 0, 1]),
            Topology::from_nodes(vec![0, 0, 1]),
        ] {
            let w = topo.world();
            for count in [0usize, 1, 5, 101] {
                check_all_reduce(w, count, &topo, ReduceOp::Sum);
                check_all_reduce(w, count, &topo, ReduceOp::Max);
                check_rs_ag(w, count, &topo);
            }
        }
    }

    #[test]
    fn direct_folds_in_rank_order_algo_3() {
        // Non-associative combine exposes the fold order: result = ((x0 c x1) c x2) c x3.
        fn combine(acc: &mut [f32], other: &[f32]) {
            acc[0] = acc[0] * 10.0 + other[0];
        }
        let world = 4;
        let scheds: Vec<_> = (0..world).map(|r| direct_all_reduce(r, world, 1)).collect();
        let bufs = (0..world).map(|r| vec![r as f32 + 1.0]).collect();
        let out = simulate(&scheds, bufs, Combine::Records { len: 1, f: combine }).unwrap();
        for o in out {
            assert_eq!(o, vec![1234.0]);
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
        #[test]
        fn prop_all_reduce(world in 1usize..9, count in 0usize..200, op in 0u32..4) {
            let op = ReduceOp::from_code(op).unwrap_or(ReduceOp::Sum);
            check_all_reduce(world, count, &Topology::single_node(world), op);
        }

        #[test]
        fn prop_rs_ag_hier(nodes in 1usize..4, per in 1usize..4, n in 0usize..20) {
            check_rs_ag(nodes * per, n, &Topology::uniform(nodes, per));
            check_all_reduce(nodes * per, n * 3 + 1, &Topology::uniform(nodes, per), ReduceOp::Sum);
        }

        #[test]
        fn prop_broadcast(world in 1usize..9, count in 0usize..100, root in 0usize..8, pieces in 1usize..9) {
            check_broadcast(world, count, root % world, pieces);
        }
    }
}
