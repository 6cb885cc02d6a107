//! `shardline checkpoint export --dtype bf16` (CKPT-9): the floats rounded to bf16 beside the
//! f32 export, the flag's bad values, and `--init-from` of a bf16 file, which widens it
//! exactly (CKPT-8). That torch loads the bf16 export strictly is `tests/tests/torch_load.rs`.

mod common;
use common::*;
use safetensors::{Dtype, SafeTensors};
use shardline_runtime::train::{self, RunOptions, TrainConfig};
use std::collections::BTreeMap;
use std::path::Path;

/// name -> (dtype, shape, values as f32) of a safetensors file.
fn read(path: &Path) -> BTreeMap<String, (Dtype, Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(path).expect("read the export");
    let st = SafeTensors::deserialize(&bytes).expect("a safetensors file");
    st.tensors()
        .into_iter()
        .map(|(n, v)| {
            let vals: Vec<f32> = match v.dtype() {
                Dtype::F32 => v
                    .data()
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                    .collect(),
                Dtype::BF16 => v
                    .data()
                    .chunks_exact(2)
                    .map(|c| half::bf16::from_le_bytes(c.try_into().unwrap()).to_f32())
                    .collect(),
                Dtype::I64 => v
                    .data()
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as f32)
                    .collect(),
                d => panic!("{n}: unexpected dtype {d:?}"),
            };
            (n, (v.dtype(), v.shape().to_vec(), vals))
        })
        .collect()
}

/// A convnet-bn (convolutions, BatchNorm buffers and counters) of two steps at world 2.
fn cfg() -> TrainConfig {
    TrainConfig { model: "convnet-bn".into(), hidden: Some(4), ..small_cfg(2, 3, 2, 16) }
}

/// CKPT-9: the bf16 export has the f32 export's names and shapes; every float is BF16,
/// the f32 value rounded to the nearest bf16 (the representable value next to it on the
/// other side is no nearer, and both are within 2^-8 relative); counters are I64 and equal.
/// A bad `--dtype` exits 2 naming the flag and its choices.
#[test]
fn bf16_export_is_the_f32_export_rounded_ckpt_9() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = tmp.path().join("ck");
    run_ok(cfg(), RunOptions { checkpoint_dir: Some(ck.clone()), ..quiet() });
    let export = |dtype: Option<&str>, file: &str| {
        let out = tmp.path().join(file);
        let (c, o) = (ck.display().to_string(), out.display().to_string());
        let mut args = vec!["checkpoint", "export", c.as_str(), "--out", o.as_str()];
        args.extend(dtype.iter().flat_map(|d| ["--dtype", *d]));
        let r = shardline(&args);
        assert_eq!(r.code, Some(0), "export {dtype:?}: {}", r.stderr);
        out
    };
    let (plain, f32_file, bf16_file) =
        (export(None, "plain.st"), export(Some("f32"), "f32.st"), export(Some("bf16"), "bf16.st"));
    let (f, h) = (read(&f32_file), read(&bf16_file));
    // Equal tensors (the header's metadata map need not list its keys in the same order).
    assert!(read(&plain) == f, "f32 is the default");
    assert_eq!(f.keys().collect::<Vec<_>>(), h.keys().collect::<Vec<_>>(), "the same names");
    let (mut floats, mut rounded, mut worst) = (0, 0, 0.0f32);
    for (name, (fd, fshape, fv)) in &f {
        let (hd, hshape, hv) = &h[name];
        assert_eq!(hshape, fshape, "{name}");
        if *fd == Dtype::I64 {
            assert_eq!((hd, hv), (fd, fv), "{name}: the counter is unchanged");
            continue;
        }
        assert_eq!((*fd, *hd), (Dtype::F32, Dtype::BF16), "{name}");
        assert_eq!(format!("{hd:?}"), "BF16", "the dtype field");
        floats += 1;
        for (&x, &y) in fv.iter().zip(hv) {
            assert!(x.is_finite() && y.is_finite(), "{name}: {x} -> {y}");
            if x != y {
                // The bf16 neighbour of y on x's side (one unit in the last place further
                // from zero where |x| > |y|) is no nearer.
                let bits = half::bf16::from_f32(y).to_bits();
                let other = if x.abs() > y.abs() { bits + 1 } else { bits - 1 };
                let other = half::bf16::from_bits(other).to_f32();
                assert!(
                    (x - y).abs() <= (x - other).abs(),
                    "{name}: {x} -> {y}, but {other} is nearer"
                );
            }
            let rel = (x - y).abs() / x.abs().max(f32::MIN_POSITIVE);
            assert!(rel <= 2f32.powi(-8), "{name}: {x} -> {y}");
            worst = worst.max(rel);
            rounded += usize::from(x != y);
        }
    }
    assert!(floats > 0 && rounded > 0, "{floats} float tensors, {rounded} values rounded");
    let sizes =
        (std::fs::metadata(&f32_file).unwrap().len(), std::fs::metadata(&bf16_file).unwrap().len());
    eprintln!(
        "bf16 export: {floats} float tensors, worst relative rounding {worst:e}, {} -> {} bytes",
        sizes.0, sizes.1
    );

    for bad in ["fp8", "float16", ""] {
        let (c, o) = (ck.display().to_string(), tmp.path().join("bad.st").display().to_string());
        let r = shardline(&["checkpoint", "export", &c, "--out", &o, "--dtype", bad]);
        assert_eq!(r.code, Some(2), "--dtype {bad:?}: {}", r.stderr);
        for want in ["--dtype", "f32 or bf16"] {
            assert!(r.stderr.contains(want), "--dtype {bad:?}: no {want:?} in {}", r.stderr);
        }
        assert!(!r.stderr.contains("panicked"), "{}", r.stderr);
        assert!(!tmp.path().join("bad.st").exists(), "nothing written");
    }
}

/// CKPT-8 with CKPT-9: `--init-from` of a bf16 export starts from its values widened to
/// f32 exactly, at another world and stage, and trains on from them.
#[test]
fn init_from_a_bf16_export_widens_it_exactly_ckpt_8() {
    let tmp = tempfile::tempdir().unwrap();
    let ck = tmp.path().join("ck");
    run_ok(cfg(), RunOptions { checkpoint_dir: Some(ck.clone()), ..quiet() });
    let file = tmp.path().join("bf16.st");
    let dtype = shardline_runtime::engine::PrecisionDtype::Bf16;
    shardline_runtime::checkpoint::export_safetensors_as(&ck, &file, dtype).expect("export");
    let t = read(&file);
    let start = TrainConfig { init_from: Some(file.clone()), world: 3, ..cfg() };
    let spec = train::plan(&start).expect("plan").model.spec();
    let s = run_ok(start.clone(), RunOptions { stop_after: Some(0), ..quiet() });
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    for (u, unit) in spec.units.iter().enumerate() {
        let want: Vec<f32> = unit.params.iter().flat_map(|p| t[&p.name].2.clone()).collect();
        assert_eq!(bits(&s.final_params[u]), bits(&want), "unit {} parameters", unit.name);
        let want: Vec<f32> = unit.buffers.iter().flat_map(|b| t[&b.name].2.clone()).collect();
        assert_eq!(bits(&s.final_buffers[u]), bits(&want), "unit {} buffers", unit.name);
    }
    let on = run_ok(start, quiet());
    assert_eq!(on.steps, 2);
    assert!(on.losses.iter().all(|l| l.is_finite()), "losses {:?}", on.losses);
}
