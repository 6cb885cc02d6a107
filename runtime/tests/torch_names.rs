//! Weights out and in with torch's names: `checkpoint export` writes the state_dict torch's
//! modules have (CKPT-7), checked against the manifest `bench/torch_manifest.py` made with
//! torch (`tests/fixtures/torch_state_dicts.json`; no torch needed here), and
//! `train --init-from` starts from such a file bitwise or refuses it naming every mismatch
//! (CKPT-8). That torch itself loads the exports strictly is `tests/tests/torch_load.rs`.

mod common;
use common::*;
use safetensors::{Dtype, SafeTensors};
use shardline_runtime::checkpoint::export_safetensors;
use shardline_runtime::train::{self, RunOptions, SyncBnMode, TrainConfig};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The manifest's entry for `model`.
fn manifest(model: &str) -> serde_json::Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/torch_state_dicts.json");
    let text = std::fs::read_to_string(&path).expect("read the torch manifest");
    let v: serde_json::Value = serde_json::from_str(&text).expect("parse the torch manifest");
    v[model].clone()
}

/// `resnet-bn` at the manifest's configuration (digits: 1x8x8 images, 10 classes).
fn resnet_cfg(world: usize, stage: u8) -> TrainConfig {
    TrainConfig {
        model: "resnet-bn".into(),
        width: Some(4),
        sync_bn: SyncBnMode::On,
        ..small_cfg(world, stage, 2, 16)
    }
}

/// `gpt` at the manifest's configuration (the bundled text: 256 byte values), 2 steps.
fn gpt_names_cfg(world: usize, stage: u8) -> TrainConfig {
    TrainConfig { steps: Some(2), ..gpt_cfg(world, stage, 4) }
}

/// Trains `cfg` with a checkpoint at the end and exports it into `dir`.
fn exported(cfg: TrainConfig, dir: &Path) -> PathBuf {
    let ck = dir.join("ck");
    run_ok(cfg, RunOptions { checkpoint_dir: Some(ck.clone()), ..quiet() });
    let out = dir.join("model.safetensors");
    export_safetensors(&ck, &out).expect("export");
    out
}

/// name -> (dtype, shape, data) of a safetensors file.
type Tensors = BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)>;

fn read(path: &Path) -> Tensors {
    let bytes = std::fs::read(path).expect("read the export");
    let st = SafeTensors::deserialize(&bytes).expect("a safetensors file");
    st.tensors()
        .into_iter()
        .map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec())))
        .collect()
}

fn write(path: &Path, t: &Tensors) {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = t
        .iter()
        .map(|(n, (d, s, b))| {
            (n.clone(), safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap())
        })
        .collect();
    safetensors::serialize_to_file(views, None, path).expect("write safetensors");
}

/// CKPT-7, MRES-1: the exports of `resnet-bn` and `gpt` have exactly the names, dtypes and
/// shapes of the torch modules' state_dicts, at the configuration the manifest records.
#[test]
fn exports_are_the_torch_state_dicts_of_the_manifest_ckpt_7() {
    for (model, cfg) in [("resnet-bn", resnet_cfg(2, 3)), ("gpt", gpt_names_cfg(2, 3))] {
        let m = manifest(model);
        // The manifest was made at the configuration trained here.
        let c = &m["config"];
        if model == "resnet-bn" {
            assert_eq!((c["width"].as_u64(), c["in_channels"].as_u64()), (Some(4), Some(1)));
        } else {
            let want = [("layers", 2), ("heads", 2), ("embd", 16), ("block", 16), ("vocab", 256)];
            for (k, v) in want {
                assert_eq!(c[k].as_u64(), Some(v), "gpt manifest {k}");
            }
        }
        let want: BTreeMap<String, (String, Vec<usize>)> = m["state_dict"]
            .as_array()
            .expect("a state_dict list")
            .iter()
            .map(|t| {
                let shape = t[2].as_array().unwrap().iter().map(|d| d.as_u64().unwrap() as usize);
                (
                    t[0].as_str().unwrap().to_string(),
                    (t[1].as_str().unwrap().to_string(), shape.collect()),
                )
            })
            .collect();
        let tmp = tempfile::tempdir().unwrap();
        let got: BTreeMap<String, (String, Vec<usize>)> = read(&exported(cfg, tmp.path()))
            .into_iter()
            .map(|(n, (d, s, _))| (n, (format!("{d:?}"), s)))
            .collect();
        let missing: Vec<_> = want.keys().filter(|k| !got.contains_key(*k)).collect();
        let extra: Vec<_> = got.keys().filter(|k| !want.contains_key(*k)).collect();
        assert!(
            missing.is_empty() && extra.is_empty(),
            "{model}: missing {missing:?}, extra {extra:?}"
        );
        for (name, w) in &want {
            assert_eq!(&got[name], w, "{model}: {name} (dtype, shape)");
        }
        eprintln!("{model}: export = torch state_dict, {} tensors", want.len());
    }
}

/// Starts `cfg` from `file` at world 3 (another world than the export's: the values reshard)
/// and stops before the first step; returns (spec, final params, final buffers).
fn started_from(
    mut cfg: TrainConfig,
    file: &Path,
) -> (shardline_models::ModelSpec, Vec<Vec<f32>>, Vec<Vec<f32>>) {
    cfg.init_from = Some(file.to_path_buf());
    let spec = train::plan(&cfg).expect("plan").model.spec();
    let s = run_ok(cfg, RunOptions { stop_after: Some(0), ..quiet() });
    assert_eq!(s.steps, 0);
    (spec, s.final_params, s.final_buffers)
}

/// The f32 values of a tensor as the engine holds them (a counter's int64 as f32).
fn values(t: &(Dtype, Vec<usize>, Vec<u8>)) -> Vec<f32> {
    match t.0 {
        Dtype::F32 => {
            t.2.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect()
        }
        Dtype::I64 => {
            t.2.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap()) as f32).collect()
        }
        d => panic!("unexpected dtype {d:?}"),
    }
}

/// CKPT-8: `--init-from` of an export starts from exactly its values, every parameter and
/// buffer, bitwise; for `gpt` with and without the duplicated `lm_head.weight`.
#[test]
fn init_from_an_export_starts_from_it_bitwise_ckpt_8() {
    let tmp = tempfile::tempdir().unwrap();
    let r = exported(resnet_cfg(2, 3), &tmp.path().join("r"));
    let g = exported(gpt_names_cfg(2, 1), &tmp.path().join("g"));
    let mut untied = read(&g);
    assert!(untied.remove("lm_head.weight").is_some(), "the export has lm_head.weight");
    let g2 = tmp.path().join("g-untied.safetensors");
    write(&g2, &untied);
    for (cfg, file) in
        [(resnet_cfg(3, 3), &r), (gpt_names_cfg(3, 2), &g), (gpt_names_cfg(3, 3), &g2)]
    {
        let t = read(file);
        let (spec, params, buffers) = started_from(cfg, file);
        let mut n = 0;
        for (u, unit) in spec.units.iter().enumerate() {
            let want: Vec<f32> = unit.params.iter().flat_map(|p| values(&t[&p.name])).collect();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(
                bits(&params[u]),
                bits(&want),
                "{}: unit {} parameters",
                file.display(),
                unit.name
            );
            let want: Vec<f32> = unit.buffers.iter().flat_map(|p| values(&t[&p.name])).collect();
            assert_eq!(
                bits(&buffers[u]),
                bits(&want),
                "{}: unit {} buffers",
                file.display(),
                unit.name
            );
            n += unit.params.len() + unit.buffers.len();
        }
        // Every tensor of the model, and nothing else but the tied alias, is in the file.
        let alias = usize::from(t.contains_key("lm_head.weight"));
        assert_eq!(n + alias, t.len(), "{}", file.display());
    }
    // The run trains on from there: the counters went on from the export's.
    let s = run_ok(
        TrainConfig { init_from: Some(r.clone()), ..resnet_cfg(2, 0) },
        RunOptions { checkpoint_dir: Some(tmp.path().join("again")), ..quiet() },
    );
    assert_eq!(s.total_steps, 2);
    let again = tmp.path().join("again.safetensors");
    export_safetensors(tmp.path().join("again"), &again).unwrap();
    assert_eq!(values(&read(&again)["bn1.num_batches_tracked"]), vec![4.0], "2 + 2 batches");
}

/// CKPT-8: a file that does not match exits 2 before training, listing every missing,
/// unexpected, wrongly shaped and wrongly typed tensor; an unreadable file exits 2 naming it.
#[test]
fn a_file_that_does_not_match_exits_2_listing_every_name_ckpt_8() {
    let tmp = tempfile::tempdir().unwrap();
    let mut t = read(&exported(resnet_cfg(1, 0), tmp.path()));
    t.remove("fc.bias");
    t.insert("fc.extra".into(), (Dtype::F32, vec![1], vec![0; 4]));
    t.insert("conv1.weight".into(), (Dtype::F32, vec![4, 1, 1, 1], vec![0; 16]));
    t.insert("bn1.running_mean".into(), (Dtype::I64, vec![4], vec![0; 32]));
    let bad = tmp.path().join("bad.safetensors");
    write(&bad, &t);
    let args = |f: &Path| -> Vec<String> {
        [
            "train",
            "--model",
            "resnet-bn",
            "--width",
            "4",
            "--steps",
            "1",
            "--world",
            "2",
            "--no-progress",
            "--init-from",
        ]
        .iter()
        .map(|s| s.to_string())
        .chain([f.display().to_string()])
        .collect()
    };
    let run = |f: &Path| {
        let a = args(f);
        shardline(&a.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let out = run(&bad);
    assert_eq!(out.code, Some(2), "stderr: {}", out.stderr);
    eprint!("a mismatched --init-from says:\n{}", out.stderr);
    for want in [
        "does not match the model resnet-bn",
        "missing (1): fc.bias",
        "unexpected (1): fc.extra",
        "conv1.weight [4, 1, 1, 1] (model [4, 1, 3, 3])",
        "bn1.running_mean I64",
        "bad.safetensors",
    ] {
        assert!(out.stderr.contains(want), "{want:?} not in: {}", out.stderr);
    }
    assert!(!out.stdout.contains("summary"), "no training: {}", out.stdout);
    let junk = tmp.path().join("junk.safetensors");
    std::fs::write(&junk, b"not a safetensors file").unwrap();
    for f in [junk, tmp.path().join("absent.safetensors")] {
        let out = run(&f);
        assert_eq!(out.code, Some(2), "stderr: {}", out.stderr);
        assert!(out.stderr.contains(&f.display().to_string()), "{}", out.stderr);
    }
}

/// MRES-1 beyond the names: with torch's weights and running statistics
/// (`bench/torch_manifest.py --reference`, a width-2 resnet-bn), Shardline's `resnet-bn`
/// computes torch's logits in eval mode, and in training mode (batch statistics) its logits
/// and the running statistics and counters that forward leaves.
#[test]
fn resnet_bn_computes_what_torch_computes() {
    use shardline_models::module::resnet::{resnet_bn, ResNetConfig};
    use shardline_models::{Cpu, Ctx, Network, Tensor};
    use shardline_runtime::checkpoint::match_torch_weights;
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/resnet_bn_reference.safetensors");
    let t = read(&path);
    let net = resnet_bn(&ResNetConfig::resnet18(1, 10, 2)).unwrap();
    let spec = net.spec();
    let state: Vec<_> = t
        .iter()
        .filter(|(n, _)| !n.starts_with("ref."))
        .map(|(n, (d, s, b))| (n.clone(), *d, s.clone(), b.as_slice()))
        .collect();
    let w = match_torch_weights(&spec, &state).expect("torch's state_dict loads strictly");
    let tensor = |name: &str| {
        let v = &t[name];
        Tensor::new(v.1.clone(), values(v)).unwrap()
    };
    let be = Cpu::new();
    for training in [false, true] {
        let mut bufs = w.buffers.clone();
        let ctx = Ctx::new(&be, training, 4);
        let mut x = tensor("ref.input");
        for (c, &u) in net.calls().iter().enumerate() {
            x = net.forward_call(c, &w.params[u], &mut bufs[u], x, &ctx).unwrap().0;
        }
        let want = tensor(if training { "ref.logits_train" } else { "ref.logits_eval" });
        assert_eq!(x.shape(), want.shape());
        let err = x
            .as_f32()
            .unwrap()
            .iter()
            .zip(want.as_f32().unwrap())
            .map(|(a, b)| (a - b).abs() / b.abs().max(1.0))
            .fold(0.0f32, f32::max);
        eprintln!("resnet-bn vs torch, training {training}: logits differ by {err:e} at most");
        assert!(err < 1e-5, "training {training}: logits differ from torch's by {err:e}");
        if training {
            for (u, unit) in spec.units.iter().enumerate() {
                let mut off = 0;
                for b in &unit.buffers {
                    let want = values(&t[&format!("ref.after_train.{}", b.name)]);
                    let got = &bufs[u][off..off + b.numel()];
                    for (g, w) in got.iter().zip(&want) {
                        assert!((g - w).abs() <= 1e-5 * w.abs().max(1.0), "{}: {g} vs {w}", b.name);
                    }
                    off += b.numel();
                }
            }
        }
    }
}
