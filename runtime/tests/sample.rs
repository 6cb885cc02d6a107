//! `shardline sample`: text from a `gpt` checkpoint that `shardline train` wrote, and its
//! usage errors (exit 2).

mod common;
use common::*;
use shardline_runtime::sample::{load_decoder, Pick, SampleOptions};
use std::path::Path;

/// Trains a tiny byte-level gpt for a few steps with `ranks` ranks at stage 3, checkpointing
/// into `dir`.
fn train_tiny_gpt(dir: &Path) {
    let d = dir.to_str().expect("utf-8 path");
    let o = shardline(&[
        "train",
        "--model",
        "gpt",
        "--dataset",
        "text",
        "--world",
        "2",
        "--stage",
        "3",
        "--n-layer",
        "1",
        "--n-head",
        "2",
        "--n-embd",
        "16",
        "--block-size",
        "8",
        "--batch-size",
        "4",
        "--optimizer",
        "adamw",
        "--lr",
        "1e-2",
        "--steps",
        "3",
        "--checkpoint-dir",
        d,
        "--no-progress",
    ]);
    assert_eq!(o.code, Some(0), "train: {}", o.stderr);
}

#[test]
fn sample_continues_the_prompt_with_the_requested_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    train_tiny_gpt(tmp.path());
    let root = tmp.path().to_str().unwrap();
    let prompt = "The licensor ";
    let args = ["sample", root, "--prompt", prompt, "--tokens", "40", "--seed", "7"];
    let o = shardline(&args);
    assert_eq!(o.code, Some(0), "{}", o.stderr);
    assert!(o.stdout.starts_with(prompt), "{:?}", o.stdout);

    // The same decoder in the library: the recorded configuration (n_head among it), the
    // requested number of bytes, and the very text the command printed.
    let d = load_decoder(tmp.path(), None).unwrap();
    assert_eq!((d.config.n_head, d.config.n_embd, d.config.block_size), (2, 16, 8));
    assert_eq!(d.step, 3);
    let opts = SampleOptions { tokens: 40, pick: Pick { temperature: 1.0, top_k: None }, seed: 7 };
    let bytes = d.generate(prompt.as_bytes(), &opts).unwrap();
    assert_eq!(bytes.len(), 40);
    let mut all = prompt.as_bytes().to_vec();
    all.extend(&bytes);
    assert_eq!(o.stdout, format!("{}\n", String::from_utf8_lossy(&all)));

    // The step directory works as well as the root; the seed fixes the text; greedy
    // decoding of an empty prompt is fine.
    let step = tmp.path().join("step-00000003");
    let o2 = shardline(&[
        "sample",
        step.to_str().unwrap(),
        "--prompt",
        prompt,
        "--tokens",
        "40",
        "--seed",
        "7",
    ]);
    assert_eq!((o2.code, &o2.stdout), (Some(0), &o.stdout), "{}", o2.stderr);
    // The prompt read from a file: the same bytes, the same text.
    let file = tmp.path().join("prompt.txt");
    std::fs::write(&file, prompt).unwrap();
    let f = file.to_str().unwrap();
    let o4 = shardline(&["sample", root, "--prompt-file", f, "--tokens", "40", "--seed", "7"]);
    assert_eq!((o4.code, &o4.stdout), (Some(0), &o.stdout), "{}", o4.stderr);
    let o3 = shardline(&[
        "sample",
        root,
        "--prompt",
        "",
        "--tokens",
        "5",
        "--top-k",
        "1",
        "--temperature",
        "0.5",
    ]);
    assert_eq!(o3.code, Some(0), "{}", o3.stderr);
}

/// A long generation prints each byte as it is drawn: the prompt and the first bytes arrive
/// long before the last would be drawn (ten million at a forward pass each).
#[test]
fn a_long_generation_shows_its_bytes_as_they_are_drawn() {
    use std::io::Read;
    use std::process::{Command, Stdio};
    let tmp = tempfile::tempdir().unwrap();
    train_tiny_gpt(tmp.path());
    let mut child = Command::new(env!("CARGO_BIN_EXE_shardline"))
        .args(["sample", tmp.path().to_str().unwrap(), "--prompt", "The ", "--tokens", "10000000"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start shardline");
    let mut so = child.stdout.take().expect("stdout pipe");
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut buf = [0u8; 64];
        while let Ok(n) = so.read(&mut buf) {
            if n == 0 || tx.send(buf[..n].to_vec()).is_err() {
                break;
            }
        }
    });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let mut got = Vec::new();
    while got.len() < "The ".len() + 20 {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok(b) => got.extend(b),
            Err(_) => break,
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(got.starts_with(b"The "), "{got:?}");
    assert!(got.len() >= 24, "only {} bytes within 60 s: {got:?}", got.len());
}

#[test]
fn bad_input_exits_2_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    train_tiny_gpt(&tmp.path().join("gpt"));
    let gpt = tmp.path().join("gpt");
    let gpt = gpt.to_str().unwrap();
    let missing = tmp.path().join("missing");
    let missing_file = tmp.path().join("no-prompt.txt");
    let missing_file = missing_file.to_str().unwrap();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["sample", missing.to_str().unwrap(), "--prompt", "a", "--tokens", "3"], "missing"),
        (vec!["sample", gpt, "--prompt", "a", "--tokens", "0"], "--tokens"),
        (
            vec!["sample", gpt, "--prompt", "a", "--tokens", "3", "--temperature", "0"],
            "--temperature",
        ),
        (
            vec!["sample", gpt, "--prompt", "a", "--tokens", "3", "--temperature", "-1"],
            "--temperature",
        ),
        (vec!["sample", gpt, "--prompt", "a", "--tokens", "3", "--top-k", "0"], "--top-k"),
        (vec!["sample", gpt, "--prompt", "a", "--tokens", "3", "--n-head", "4"], "--n-head"),
        (vec!["sample", gpt, "--prompt-file", missing_file, "--tokens", "3"], missing_file),
        (vec!["sample", gpt, "--tokens", "3"], "--prompt-file"),
        (
            vec!["sample", gpt, "--prompt", "a", "--prompt-file", missing_file, "--tokens", "3"],
            "cannot be used with",
        ),
    ];
    for (args, names) in cases {
        let o = shardline(&args);
        assert_eq!(o.code, Some(2), "{args:?}: {}", o.stderr);
        assert!(o.stderr.contains(names), "{args:?}: {}", o.stderr);
    }

    // A checkpoint of another model.
    let mlp = tmp.path().join("mlp");
    let o = shardline(&[
        "train",
        "--hidden",
        "16",
        "--depth",
        "1",
        "--batch-size",
        "60",
        "--steps",
        "1",
        "--no-progress",
        "--checkpoint-dir",
        mlp.to_str().unwrap(),
    ]);
    assert_eq!(o.code, Some(0), "{}", o.stderr);
    let o = shardline(&["sample", mlp.to_str().unwrap(), "--prompt", "a", "--tokens", "3"]);
    assert_eq!(o.code, Some(2), "{}", o.stderr);
    assert!(o.stderr.contains("mlp-bn") && o.stderr.contains("gpt"), "{}", o.stderr);
}
