//! torch loads Shardline's exports strictly (CKPT-7, and CKPT-9 for `--dtype bf16`):
//! `shardline train` then `shardline checkpoint export` of `resnet-bn` and `gpt`, in f32 and
//! in bf16, then `bench/torch_manifest.py --load-strict`,
//! which builds the torch module (`bench/resnet_bn.py`; nanoGPT's decoder from
//! `../shared/peers/torch_gpt_train.py`) and runs
//! `model.load_state_dict(safetensors.torch.load_file(f), strict=True)`. Skips visibly where
//! torch (or the peers' folder, for gpt) is absent; `runtime/tests/torch_names.rs` checks
//! the same names, dtypes and shapes against a committed manifest without torch.
//!
//! Run `cargo build -p shardline-runtime` first: this test starts `target/<profile>/shardline`.

use shardline_tests::launch::{shardline, spawn, wait_output};
use shardline_tests::skip::skip_optional;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// Every process this test starts ends well within this (a training run of 2 steps, or
/// importing torch).
const DEADLINE: Duration = Duration::from_secs(120);

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Runs `cmd` to its end within [`DEADLINE`]; (success, stdout + stderr).
fn run(mut cmd: Command, what: &str) -> (bool, String) {
    cmd.current_dir(repo());
    let out = wait_output(spawn(cmd), Instant::now() + DEADLINE, what);
    let text =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

#[test]
fn torch_loads_the_exports_strictly() {
    let test = "torch_loads_the_exports_strictly";
    let mut probe = Command::new("python3");
    probe.args(["-c", "import torch, safetensors.torch"]);
    if !Command::new("python3").arg("--version").output().is_ok_and(|o| o.status.success())
        || !run(probe, "import torch").0
    {
        skip_optional(test, "python3 with torch and safetensors is not installed (pip install torch==2.15.0 safetensors)");
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let models: [(&str, &[&str]); 2] = [
        ("resnet-bn", &["--model", "resnet-bn", "--width", "4", "--batch-size", "16"]),
        (
            "gpt",
            &[
                "--model",
                "gpt",
                "--dataset",
                "text",
                "--n-layer",
                "2",
                "--n-head",
                "2",
                "--n-embd",
                "16",
                "--block-size",
                "16",
                "--batch-size",
                "4",
            ],
        ),
    ];
    let peers = repo().join("../shared/peers/torch_gpt_train.py");
    for (model, flags) in models {
        if model == "gpt" && !peers.exists() {
            skip_optional(
                &format!("{test} (gpt)"),
                &format!("nanoGPT's module ({}) is not here", peers.display()),
            );
            continue;
        }
        let ck = tmp.path().join(model);
        let mut train = Command::new(shardline());
        train.args(["train", "--world", "2", "--steps", "2", "--no-progress", "--checkpoint-dir"]);
        train.arg(&ck).args(flags);
        let (ok, text) = run(train, "shardline train");
        assert!(ok, "{model}: train failed:\n{text}");
        // CKPT-7 in f32; CKPT-9 in bf16, into the module after `.bfloat16()`, bitwise.
        for dtype in ["f32", "bf16"] {
            let file = tmp.path().join(format!("{model}-{dtype}.safetensors"));
            let mut export = Command::new(shardline());
            export.args(["checkpoint", "export"]).arg(&ck).arg("--out").arg(&file);
            export.args(["--dtype", dtype]);
            let (ok, text) = run(export, "shardline checkpoint export");
            assert!(ok, "{model} {dtype}: export failed:\n{text}");
            let mut load = Command::new("python3");
            load.args(["bench/torch_manifest.py", "--load-strict", model]).arg(&file);
            let (ok, text) = run(load, "torch_manifest.py --load-strict");
            let bitwise = dtype == "f32" || text.contains("bitwise equal after loading");
            assert!(
                ok && text.contains("strict load ok") && bitwise,
                "{model} {dtype}: torch refused the export:\n{text}"
            );
            eprintln!(
                "{model} {dtype}: {}",
                text.lines()
                    .filter(|l| l.contains("strict load ok") || l.contains("matched"))
                    .collect::<Vec<_>>()
                    .join("; ")
            );
        }
    }
}
