//! A rank whose backend fails in the middle of a run (ENG-11): the run ends with the failed
//! call's error, on one rank or two, at any stage, before the deadline and without a panic.

mod common;
use common::*;
use shardline_models::failing_backend::FailingBackend;
use shardline_models::{Backend, Cpu};
use shardline_runtime::engine::BackendOverride;
use shardline_runtime::train::RunOptions;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Rank `rank` computes on a backend that fails its `nth` multiply, the others on the CPU.
fn failing_on(rank: usize, nth: u64) -> RunOptions {
    let open = move |r: usize| -> Box<dyn Backend> {
        if r == rank {
            Box::new(FailingBackend::new(nth))
        } else {
            Box::new(Cpu::new())
        }
    };
    RunOptions { backend: Some(BackendOverride(Arc::new(open))), ..quiet() }
}

/// Multiplies rank 0 makes in a run of `small_cfg(world, stage, steps, 60)`.
fn gemms_per_run(world: usize, stage: u8, steps: u64) -> u64 {
    let counter = Arc::new(FailingBackend::new(0));
    let c = Arc::clone(&counter);
    let open = move |r: usize| -> Box<dyn Backend> {
        if r == 0 {
            Box::new(Shared(Arc::clone(&c)))
        } else {
            Box::new(Cpu::new())
        }
    };
    let opts = RunOptions { backend: Some(BackendOverride(Arc::new(open))), ..quiet() };
    run_ok(small_cfg(world, stage, steps, 60), opts);
    counter.gemms()
}

/// A backend shared with the test, which reads its count after the run.
#[derive(Debug)]
struct Shared(Arc<FailingBackend>);

impl Backend for Shared {
    fn name(&self) -> &'static str {
        self.0.name()
    }

    fn gemm(
        &self,
        shape: shardline_models::GemmShape,
        a: &[f32],
        b: &[f32],
        c: &mut [f32],
        accumulate: bool,
    ) -> Result<(), shardline_models::ModelError> {
        self.0.gemm(shape, a, b, c, accumulate)
    }
}

#[test]
fn a_failed_gemm_ends_the_run_with_its_error_on_one_rank_or_two_eng_11() {
    // Any panic, on any thread (a rank's, a lane's), fails the test, even one caught there.
    static PANICS: AtomicUsize = AtomicUsize::new(0);
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICS.fetch_add(1, Ordering::SeqCst);
        default(info)
    }));
    for (world, stage) in [(1, 0), (1, 3), (2, 0), (2, 2), (2, 3)] {
        // A run ends with an evaluation, which multiplies too: a step's share is the
        // difference between runs of 3 and 2 steps.
        let run = gemms_per_run(world, stage, 3);
        let one_step = run - gemms_per_run(world, stage, 2);
        assert!(one_step >= 3, "world {world} stage {stage}: {one_step} multiplies a step");
        // The first multiply (forward), the last of the first step (backward), one in the
        // second step, after a whole step's collectives, and the evaluation's last; on the
        // first and the last rank.
        for nth in [1, one_step, one_step + 2, run] {
            let when = match nth {
                n if n <= one_step => "step 1 failed",
                n if n <= 2 * one_step => "step 2 failed",
                _ => "evaluation failed",
            };
            for rank in (0..world).filter(|&r| r == 0 || r == world - 1) {
                let what = format!("world {world} stage {stage}: rank {rank}, gemm #{nth}");
                match run_with_deadline(small_cfg(world, stage, 3, 60), failing_on(rank, nth)) {
                    Ok(_) => panic!("{what}: the run must fail"),
                    Err(e) => {
                        let text = e.to_string();
                        println!("{what}: {text}");
                        assert!(
                            text.contains(&FailingBackend::error_text(nth)),
                            "{what}: the error must name the failed call: {text}"
                        );
                        assert!(text.contains(when), "{what}: {text}");
                    }
                }
            }
        }
    }
    assert_eq!(PANICS.load(Ordering::SeqCst), 0, "no thread may panic");
}
