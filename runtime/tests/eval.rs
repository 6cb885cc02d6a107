//! `shardline eval` in process: a checkpoint written at world 2, stage 3 evaluates to the
//! figures its training job reported (EVAL-1), at that world and others; `convnet-bn` takes
//! its input shape from the data set (28x28 IDX images, 8x8 digits); `gpt` gets a perplexity;
//! data that does not fit the model is refused.

mod common;
use common::*;
use shardline_models::data::idx;
use shardline_runtime::eval::{evaluate, EvalOptions, EvalReport};
use shardline_runtime::train::{RunOptions, Summary, SyncBnMode, TrainConfig};
use std::path::Path;
use std::sync::mpsc;

/// `evaluate` on its own thread with a deadline (it runs collectives between rank threads).
fn eval_with_deadline(o: EvalOptions) -> shardline_runtime::Result<EvalReport> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(evaluate(&o));
    });
    rx.recv_timeout(RUN_DEADLINE).expect("evaluation did not finish within the deadline")
}

fn eval_ok(ck: &Path, dataset: Option<&str>, world: Option<usize>) -> EvalReport {
    let o = EvalOptions {
        checkpoint: ck.to_path_buf(),
        dataset: dataset.map(str::to_string),
        world,
        ..EvalOptions::default()
    };
    eval_with_deadline(o).unwrap_or_else(|e| panic!("eval of {} failed: {e}", ck.display()))
}

/// Trains `cfg` with a checkpoint at its end under `dir`.
fn train_with_checkpoint(cfg: TrainConfig, dir: &Path) -> Summary {
    run_ok(cfg, RunOptions { checkpoint_dir: Some(dir.to_path_buf()), ..quiet() })
}

/// EVAL-1 at the job's world: bitwise its reported loss, and its accuracy.
fn assert_reproduces(s: &Summary, r: &EvalReport) {
    assert!(s.test_count > 0, "the job scored nothing");
    assert_eq!(
        r.loss.to_bits(),
        s.test_loss.to_bits(),
        "EVAL-1: loss {} vs {}",
        r.loss,
        s.test_loss
    );
    assert_eq!(r.count, s.test_count, "EVAL-1: predictions scored");
    assert_eq!(r.accuracy(), s.test_accuracy, "EVAL-1: accuracy");
}

#[test]
fn eval_reproduces_the_jobs_figures_at_any_world_eval_1() {
    let dir = tempfile::tempdir().expect("tempdir");
    let s = train_with_checkpoint(small_cfg(2, 3, 4, 60), dir.path());
    let r = eval_ok(dir.path(), None, None);
    assert_eq!((r.step, r.written_by, r.world), (4, (2, 3), 2));
    assert!(r.perplexity.is_none());
    assert_reproduces(&s, &r);
    // Other worlds reshard the checkpoint; only the order of the loss's partial sums changes.
    for world in [1, 3] {
        let o = eval_ok(dir.path(), Some("digits"), Some(world));
        assert_eq!(o.world, world);
        assert_eq!(o.count, s.test_count);
        let rel = ((o.loss - s.test_loss) / s.test_loss).abs();
        assert!(
            rel < 1e-6,
            "EVAL-1: world {world}: loss {} vs {} (rel {rel:e})",
            o.loss,
            s.test_loss
        );
        assert!(
            (o.accuracy() - s.test_accuracy).abs() <= 1.0 / s.test_count as f64,
            "world {world}"
        );
    }
}

#[test]
fn convnet_bn_takes_its_input_shape_from_the_data() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("idx");
    idx::write_dir(&data, (96, 40), (28, 28), 4, true).expect("write idx");
    let dataset = format!("idx:{}", data.display());
    for (name, ds, shape) in [("fashion-like", dataset.as_str(), 28), ("digits", "digits", 8)] {
        let ck = dir.path().join(name);
        let cfg = TrainConfig {
            model: "convnet-bn".into(),
            dataset: ds.into(),
            hidden: Some(4),
            ..small_cfg(2, 3, 2, 16)
        };
        let p = shardline_runtime::train::plan(&cfg).expect("plan");
        assert_eq!(p.train.sample_shape, vec![1, shape, shape], "{name}: DATA-6");
        let s = train_with_checkpoint(cfg, &ck);
        let r = eval_ok(&ck, None, None);
        assert_reproduces(&s, &r);
    }
    // 28x28 samples into the 8x8 digits' convnet: the convolutions would take them, but the
    // classes (4 against 10) do not fit.
    let o = EvalOptions {
        checkpoint: dir.path().join("digits"),
        dataset: Some(dataset.clone()),
        ..EvalOptions::default()
    };
    let e = eval_with_deadline(o).unwrap_err().to_string();
    assert!(e.contains(&format!("--dataset {dataset}")) && e.contains("4 classes"), "{e}");
}

#[test]
fn gpt_checkpoints_report_perplexity() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = TrainConfig {
        model: "gpt".into(),
        dataset: "text".into(),
        n_layer: Some(1),
        n_head: Some(2),
        n_embd: Some(16),
        block_size: Some(16),
        sync_bn: SyncBnMode::Auto,
        ..small_cfg(2, 3, 2, 8)
    };
    let s = train_with_checkpoint(cfg, dir.path());
    let r = eval_ok(dir.path(), None, None);
    assert_reproduces(&s, &r);
    let p = r.perplexity.expect("a gpt checkpoint's perplexity");
    assert_eq!(p, f64::from(r.loss).exp());
    let lines = r.lines().join("\n");
    assert!(lines.contains("held-out tokens") && lines.contains("perplexity"), "{lines}");
    // Samples for gpt: named as --dataset's mistake (eval takes no --model).
    let o = EvalOptions {
        checkpoint: dir.path().to_path_buf(),
        dataset: Some("digits".into()),
        ..EvalOptions::default()
    };
    let e = eval_with_deadline(o).unwrap_err().to_string();
    assert!(e.contains("--dataset digits: the checkpoint's model gpt takes text"), "{e}");
}

#[test]
fn missing_checkpoints_and_mismatched_data_are_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let o = |ck: &Path, ds: Option<&str>| EvalOptions {
        checkpoint: ck.to_path_buf(),
        dataset: ds.map(str::to_string),
        ..EvalOptions::default()
    };
    let e = eval_with_deadline(o(&dir.path().join("nothing"), None)).unwrap_err().to_string();
    assert!(e.contains("nothing"), "{e}");
    let ck = dir.path().join("ck");
    train_with_checkpoint(small_cfg(2, 1, 1, 60), &ck);
    // mlp-bn trained on 8x8 digits: 28x28 images give another first layer.
    let data = dir.path().join("idx");
    idx::write_dir(&data, (30, 10), (28, 28), 10, false).expect("write idx");
    let ds = format!("idx:{}", data.display());
    let e = eval_with_deadline(o(&ck, Some(&ds))).unwrap_err().to_string();
    assert!(e.contains("shape [784]") && e.contains("[32, 64] in the checkpoint"), "{e}");
    let e = eval_with_deadline(o(&ck, Some("idx:/no/such/dir"))).unwrap_err().to_string();
    assert!(e.contains("/no/such/dir") && e.contains("not a directory"), "{e}");
    // Tokens for a model of samples: named as --dataset's mistake (eval takes no --model).
    let e = eval_with_deadline(o(&ck, Some("text"))).unwrap_err().to_string();
    assert!(e.contains("--dataset text: the checkpoint's model mlp-bn takes samples"), "{e}");
}
