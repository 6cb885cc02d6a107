//! A device that fails under the engine (FAILDEV-1, FAILDEV-2): a two-step stage-3 job at
//! world 2 on simulated devices, one rank's device made to fail at its n-th call, for calls
//! every one of the job's calls in turn, the failure shown at the call or when its work runs. Every
//! run returns an error naming the injected failure, within its deadline: no panic, no hang,
//! no failure swallowed.

mod common;

use common::small_cfg;
use shardline_collectives::device::{FailWhen, SimOptions};
use shardline_runtime::engine::on_device::{run_on_devices, DeviceKind, DeviceOptions, FaultSpec};
use shardline_runtime::train::SyncBnMode;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn spec(rank: usize, at: u64, when: FailWhen) -> FaultSpec {
    FaultSpec {
        sim: SimOptions {
            max_delay_us: 50,
            timeout: Duration::from_secs(10),
            ..SimOptions::default()
        },
        rank,
        at,
        when,
        calls: Arc::new(AtomicU64::new(0)),
    }
}

#[test]
fn every_device_failure_comes_back_as_an_error_faildev_1_faildev_2() {
    let mut cfg = small_cfg(2, 3, 2, 24);
    cfg.sync_bn = SyncBnMode::On;
    cfg.timeout_s = 5;
    // The clean job, counting the failing rank's calls.
    let clean = spec(1, 0, FailWhen::AtCall);
    run_on_devices(&cfg, DeviceKind::Failing(clean.clone()), DeviceOptions::default())
        .expect("the job without a failure");
    let calls = clean.calls.load(Ordering::Relaxed);
    assert!(calls > 50, "a two-step job makes more calls than {calls}");
    let at: Vec<u64> = (1..=calls).collect();
    let mut checked = 0;
    for when in [FailWhen::AtCall, FailWhen::WhenRun] {
        for &n in &at {
            let t = Instant::now();
            let r = run_on_devices(
                &cfg,
                DeviceKind::Failing(spec(1, n, when)),
                DeviceOptions::default(),
            );
            let e = match r {
                Err(e) => e.to_string(),
                Ok(_) => panic!("call {n} of {calls} failed ({when:?}) and the job succeeded"),
            };
            assert!(e.contains("injected device failure"), "call {n} ({when:?}): {e}");
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "call {n} ({when:?}) took {:?}",
                t.elapsed()
            );
            checked += 1;
        }
    }
    println!("{checked} injected failures over {calls} calls: each an error naming it");
}
