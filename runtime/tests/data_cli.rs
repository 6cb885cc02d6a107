//! `shardline train` on data read from files (`idx:DIR`, `csv:PATH`, `npy:X,Y`,
//! `fashion-mnist`) and `shardline eval`: runs that work, and bad input that exits 2 naming
//! the file and what is wrong.

mod common;
use common::*;
use shardline_models::data::{fashion, idx, npy};
use std::path::Path;

/// `shardline train` with small-run flags and `extra`.
fn train(extra: &[&str]) -> Out {
    let mut args = vec!["train", "--hidden", "16", "--depth", "1", "--batch-size", "16"];
    args.extend_from_slice(&["--steps", "2", "--world", "2", "--no-progress"]);
    args.extend_from_slice(extra);
    shardline(&args)
}

fn expect_exit_2(o: &Out, needles: &[&str], what: &str) {
    assert_eq!(o.code, Some(2), "{what}: exit code; stderr: {}", o.stderr);
    for n in needles {
        assert!(o.stderr.contains(n), "{what}: stderr lacks '{n}': {}", o.stderr);
    }
    assert!(!o.stderr.contains("panicked"), "{what}: {}", o.stderr);
}

#[test]
fn train_on_an_idx_directory_then_eval_its_checkpoint() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("idx");
    idx::write_dir(&data, (64, 20), (6, 6), 3, true).expect("write idx");
    let ds = format!("idx:{}", data.display());
    let ck = dir.path().join("ck");
    let ck_s = ck.display().to_string();
    let o = train(&["--dataset", &ds, "--sync-bn", "on", "--checkpoint-dir", &ck_s]);
    assert_eq!(o.code, Some(0), "stderr: {}", o.stderr);
    assert!(
        o.stdout.contains("(64 train / 20 test), world 2, stage 3, global batch 16, 2 steps"),
        "{}",
        o.stdout
    );
    assert!(
        o.stdout.contains(&format!("data: {} with its t10k split", data.display())),
        "{}",
        o.stdout
    );
    let loss = |out: &str, key: &str| -> f64 {
        let l = out.lines().find(|l| l.trim_start().starts_with(key)).expect(key);
        l.split_whitespace().nth(2).and_then(|v| v.parse().ok()).expect("a number")
    };
    let e = shardline(&["eval", &ck_s]);
    assert_eq!(e.code, Some(0), "stderr: {}", e.stderr);
    assert!(
        e.stdout.contains("(step 2, written by world 2 at stage 3)")
            && e.stdout.contains("20 test samples"),
        "{}",
        e.stdout
    );
    // EVAL-1: the summary's 4 decimals of the same loss.
    let (trained, evaluated) = (loss(&o.stdout, "test loss"), loss(&e.stdout, "test loss"));
    assert!((trained - evaluated).abs() <= 5e-5, "train {trained}, eval {evaluated}");
    // Without t10k files a stratified fifth is held out.
    for f in ["t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"] {
        std::fs::remove_file(data.join(f)).expect("remove");
    }
    let o = train(&["--dataset", &ds]);
    assert_eq!(o.code, Some(0), "stderr: {}", o.stderr);
    assert!(
        o.stdout.contains("(52 train / 12 test)") && o.stdout.contains("20% held out"),
        "{}",
        o.stdout
    );
}

#[test]
fn csv_and_npy_files_train_with_a_scale() {
    let dir = tempfile::tempdir().expect("tempdir");
    let csv = dir.path().join("d.csv");
    let rows: String =
        (0..40).map(|i| format!("{},{},{},{},{}\n", i % 2, i, 255 - i, i % 7, 3)).collect();
    std::fs::write(&csv, format!("label,a,b,c,d\n{rows}")).expect("write csv");
    let ds = format!("csv:{}", csv.display());
    let o = train(&["--dataset", &ds, "--data-scale", "255"]);
    assert_eq!(o.code, Some(0), "stderr: {}", o.stderr);
    assert!(o.stdout.contains("(32 train / 8 test)"), "{}", o.stdout);
    // 4 values per row are a 2x2 image for convnet-bn.
    let o = train(&["--dataset", &ds, "--model", "convnet-bn"]);
    assert_eq!(o.code, Some(0), "stderr: {}", o.stderr);
    let (x, y) = (dir.path().join("x.npy"), dir.path().join("y.npy"));
    let xs: Vec<u8> = (0..30 * 9).map(|i| (i * 7 % 256) as u8).collect();
    std::fs::write(&x, npy::encode("|u1", &[30, 3, 3], &xs, false)).expect("write x");
    let ys: Vec<u8> = (0..30u8).flat_map(|i| i64::from(i % 3).to_le_bytes()).collect();
    std::fs::write(&y, npy::encode("<i8", &[30], &ys, false)).expect("write y");
    let ds = format!("npy:{},{}", x.display(), y.display());
    let o = train(&["--dataset", &ds, "--model", "convnet-bn", "--data-scale", "255"]);
    assert_eq!(o.code, Some(0), "stderr: {}", o.stderr);
    assert!(o.stdout.contains("(24 train / 6 test)"), "{}", o.stdout);
}

#[test]
fn fashion_mnist_header_says_which_set() {
    let o = train(&["--dataset", "fashion-mnist"]);
    assert_eq!(o.code, Some(0), "stderr: {}", o.stderr);
    let installed = Path::new(fashion::INSTALLED_DIR).is_dir();
    let want = if installed { "(60000 train / 10000 test)" } else { "(4000 train / 1000 test)" };
    let origin =
        if installed { "data: the full set installed in" } else { "data: the bundled subset" };
    assert!(o.stdout.contains(want) && o.stdout.contains(origin), "{}", o.stdout);
}

#[test]
fn bad_data_files_exit_2_naming_the_file() {
    let dir = tempfile::tempdir().expect("tempdir");
    let p = |name: &str| dir.path().join(name);
    let s = |name: &str| p(name).display().to_string();
    // A truncated IDX images file.
    let data = p("idx");
    idx::write_dir(&data, (10, 0), (4, 4), 2, false).expect("write idx");
    let images = data.join("train-images-idx3-ubyte");
    let bytes = std::fs::read(&images).expect("read");
    std::fs::write(&images, &bytes[..bytes.len() - 10]).expect("truncate");
    let ds = format!("idx:{}", data.display());
    let o = train(&["--dataset", &ds]);
    let name = images.display().to_string();
    expect_exit_2(
        &o,
        &[&name, "10 x 4 x 4 = 160 bytes of data, the file has 150"],
        "truncated idx",
    );
    // A labels file given as the images (wrong magic), and an empty one.
    std::fs::copy(data.join("train-labels-idx1-ubyte"), &images).expect("copy");
    expect_exit_2(&train(&["--dataset", &ds]), &[&name, "wrong magic 0x00000801"], "magic");
    std::fs::write(&images, b"").expect("empty");
    expect_exit_2(&train(&["--dataset", &ds]), &[&name, "empty file"], "empty idx");
    std::fs::remove_file(&images).expect("remove");
    expect_exit_2(&train(&["--dataset", &ds]), &[&name, "missing file"], "missing idx");
    // npy: x and y lengths disagree; a negative label.
    std::fs::write(p("x.npy"), npy::encode("|u1", &[4, 2], &[0; 8], false)).expect("x");
    std::fs::write(p("y.npy"), npy::encode("|u1", &[3], &[0, 1, 0], false)).expect("y");
    std::fs::write(p("yneg.npy"), npy::encode("|i1", &[4], &[0, 1, 0xff, 0], false)).expect("y");
    let ds = format!("npy:{},{}", s("x.npy"), s("y.npy"));
    expect_exit_2(
        &train(&["--dataset", &ds]),
        &[&s("y.npy"), "3 labels for the 4 samples"],
        "npy lengths",
    );
    let ds = format!("npy:{},{}", s("x.npy"), s("yneg.npy"));
    expect_exit_2(
        &train(&["--dataset", &ds]),
        &[&s("yneg.npy"), "label -1 at index 2 is negative"],
        "npy label",
    );
    let ds = format!("npy:{},{}", s("x.npy"), s("absent.npy"));
    expect_exit_2(&train(&["--dataset", &ds]), &[&s("absent.npy"), "cannot read"], "npy missing");
    // CSV rows of different lengths; an empty file; a scale where none applies.
    std::fs::write(p("bad.csv"), "0,1,2\n1,3\n").expect("csv");
    let ds = format!("csv:{}", s("bad.csv"));
    expect_exit_2(
        &train(&["--dataset", &ds]),
        &[&s("bad.csv"), "line 2: 1 values, expected 2"],
        "csv",
    );
    std::fs::write(p("empty.csv"), "").expect("csv");
    let ds = format!("csv:{}", s("empty.csv"));
    expect_exit_2(&train(&["--dataset", &ds]), &[&s("empty.csv"), "no samples"], "empty csv");
    expect_exit_2(
        &train(&["--data-scale", "255"]),
        &["--data-scale applies to csv:PATH and npy:X,Y"],
        "scale",
    );
    // 3 values per row are no image for convnet-bn.
    std::fs::write(p("three.csv"), "0,1,2,3\n1,3,4,5\n").expect("csv");
    let ds = format!("csv:{}", s("three.csv"));
    expect_exit_2(
        &train(&["--dataset", &ds, "--model", "convnet-bn"]),
        &["[3] are no image"],
        "csv image",
    );
}

#[test]
fn eval_of_a_missing_checkpoint_or_unfit_data_exits_2() {
    let dir = tempfile::tempdir().expect("tempdir");
    let none = dir.path().join("none").display().to_string();
    expect_exit_2(&shardline(&["eval", &none]), &[&none], "missing checkpoint");
    let ck = dir.path().join("ck").display().to_string();
    let o = train(&["--checkpoint-dir", &ck]);
    assert_eq!(o.code, Some(0), "stderr: {}", o.stderr);
    let o = shardline(&["eval", &ck, "--dataset", "synthetic"]);
    expect_exit_2(
        &o,
        &["--dataset synthetic: samples of shape [784]", "do not fit the checkpoint's mlp-bn"],
        "shape",
    );
    expect_exit_2(&shardline(&["eval", &ck, "--world", "0"]), &["--world 0"], "world");
    // 8x8 images like the digits', but labels past the model's ten classes.
    let data = dir.path().join("idx");
    idx::write_dir(&data, (30, 24), (8, 8), 12, false).expect("write idx");
    let ds = format!("idx:{}", data.display());
    let o = shardline(&["eval", &ck, "--dataset", &ds]);
    expect_exit_2(
        &o,
        &[&ds, "in 12 classes do not fit", "[10, 16] in the checkpoint, [12, 16]"],
        "classes",
    );
}
