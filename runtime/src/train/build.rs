//! The model, optimizer and ZeRO stage a [`TrainConfig`] names.

use super::*;

/// Builds the model named in the config.
pub fn build_model(cfg: &TrainConfig, input_shape: &[usize], classes: usize) -> Result<Model> {
    let model = match cfg.model.as_str() {
        "mlp-bn" => {
            let mut m = zoo::MlpBn::digits();
            m.input_dim = input_shape.iter().product();
            m.classes = classes;
            if let Some(h) = cfg.hidden {
                m.hidden = h;
            }
            if let Some(d) = cfg.depth {
                m.depth = d;
            }
            m.build()
        }
        "convnet-bn" => {
            let mut m = zoo::ConvNetBn::digits();
            // DATA-6: the data set's [C, H, W]; the convolutions take any H and W.
            m.input = match input_shape {
                [c, h, w] => [*c, *h, *w],
                other => {
                    return Err(RuntimeError::config(format!(
                        "convnet-bn needs image samples [C, H, W], not {other:?}"
                    )))
                }
            };
            if let Some(h) = cfg.hidden {
                m.widths = vec![h, 2 * h];
            }
            m.classes = classes;
            m.build().map_err(RuntimeError::from_model)?
        }
        "wide-mlp" => {
            // Sized by --params, but fed by the data set: its input width and classes.
            let mut m = zoo::WideMlp::with_params(cfg.params);
            m.input_dim = input_shape.iter().product();
            m.classes = classes;
            m.build()
        }
        other => {
            return Err(RuntimeError::config(format!(
                "unknown model '{other}' (choose mlp-bn, convnet-bn, wide-mlp, resnet-bn or gpt)"
            )))
        }
    };
    Ok(if cfg.wrap_params > 0 { model.wrap(WrapPolicy::ByParams(cfg.wrap_params)) } else { model })
}

/// The `resnet-bn` of `cfg` for images of `input_shape` (`[C, H, W]`) and `classes`
/// (MRES-1): `--width` channels in `layer1` (default [`RESNET_WIDTH`]), units per block
/// unless `--wrap-params` groups them.
pub fn build_resnet(
    cfg: &TrainConfig,
    input_shape: &[usize],
    classes: usize,
) -> Result<shardline_models::ModuleNet> {
    let &[c, _, _] = input_shape else {
        return Err(RuntimeError::config(format!(
            "--model resnet-bn needs images [C, H, W]; --dataset {} gives samples of shape {input_shape:?}",
            cfg.dataset
        )));
    };
    let width = cfg.width.unwrap_or(RESNET_WIDTH);
    if width == 0 {
        return Err(RuntimeError::config("--width must be at least 1"));
    }
    let rc = resnet::ResNetConfig::resnet18(c, classes, width);
    let net = resnet::resnet_bn(&rc).map_err(|e| RuntimeError::config(e.to_string()))?;
    Ok(if cfg.wrap_params > 0 { net.wrap(WrapPolicy::ByParams(cfg.wrap_params)) } else { net })
}

/// The `gpt` configuration of `cfg` for a vocabulary of `vocab`, checked (GPT-6); errors
/// name the flag.
pub fn gpt_config(cfg: &TrainConfig, vocab: usize) -> Result<GptConfig> {
    let (l, h, e, b) = GPT_DEFAULTS;
    if let Some(v) = cfg.vocab_size.filter(|&v| v < vocab) {
        return Err(RuntimeError::config(format!(
            "--vocab-size {v} is below the data set's {vocab} tokens"
        )));
    }
    let g = GptConfig {
        vocab_size: cfg.vocab_size.unwrap_or(vocab),
        block_size: cfg.block_size.unwrap_or(b),
        n_layer: cfg.n_layer.unwrap_or(l),
        n_head: cfg.n_head.unwrap_or(h),
        n_embd: cfg.n_embd.unwrap_or(e),
        bias: true,
        layernorm_eps: 1e-5,
        dropout: cfg.dropout.unwrap_or(0.0),
    };
    for (flag, v) in [
        ("--n-layer", g.n_layer),
        ("--n-head", g.n_head),
        ("--n-embd", g.n_embd),
        ("--block-size", g.block_size),
    ] {
        if v == 0 {
            return Err(RuntimeError::config(format!("{flag} must be at least 1")));
        }
    }
    if !(0.0..1.0).contains(&g.dropout) {
        return Err(RuntimeError::config(format!("--dropout {} must be in [0, 1)", g.dropout)));
    }
    if !g.n_embd.is_multiple_of(g.n_head) {
        return Err(RuntimeError::config(format!(
            "--n-embd {} is not divisible by --n-head {}",
            g.n_embd, g.n_head
        )));
    }
    g.validate().map_err(|e| RuntimeError::config(format!("gpt: {e}")))?;
    Ok(g)
}

/// The default bound on unreduced gradients in flight (stages 2 and 3): two of the largest
/// unit, so that one reduction overlaps the next unit's backward (ENG-7).
pub fn reduce_budget(layout: &ShardedModelLayout) -> u64 {
    layout.max_unit_padded_numel() as u64 * 4 * 2
}

pub(crate) fn optimizer_of(cfg: &TrainConfig) -> Optimizer {
    match cfg.optimizer.as_str() {
        "adamw" => Optimizer::AdamW(AdamWConfig {
            weight_decay: cfg.weight_decay,
            ..AdamWConfig::default()
        }),
        _ => Optimizer::Sgd(SgdConfig {
            momentum: cfg.momentum,
            weight_decay: cfg.weight_decay,
            ..SgdConfig::default()
        }),
    }
}

/// Per-stage per-rank memory estimate: model state plus gathered units (stage 3) or the full
/// unsharded working copy, and at stages 2 and 3 with `--grad-accum` and `--accum-reduce
/// last` the full gradients held until the last microbatch (ACC-3).
pub fn stage_estimates(model: &dyn Network, cfg: &TrainConfig) -> Result<Vec<(Stage, u64)>> {
    let layout = ShardedModelLayout::new(&model.spec(), cfg.world)?;
    let opt = optimizer_of(cfg);
    let unit = layout.max_unit_padded_numel() as u64 * 4;
    Ok([Stage::Zero0, Stage::Zero1, Stage::Zero2, Stage::Zero3]
        .into_iter()
        .map(|s| {
            let state = layout.model_state_bytes(s, &opt);
            // Transient: the unreduced gradients in flight where gradients are sharded (the
            // reduce budget, and the unit whose backward runs while it is full, ENG-7) and,
            // at stage 3, the gathered units (current + prefetch).
            let unreduced = if s.grads_sharded() { reduce_budget(&layout) + unit } else { 0 };
            let gathered = if s == Stage::Zero3 { unit * (2 + cfg.prefetch as u64) } else { 0 };
            let transient = unreduced + gathered;
            // ACC-3: `--accum-reduce last` keeps every unit's full gradient until the last
            // microbatch.
            let held = cfg.grad_accum > 1
                && s.grads_sharded()
                && cfg.accum_reduce == Some(AccumReduce::Last);
            let full_grads = if held { layout.padded_numel() as u64 * 4 } else { 0 };
            (s, state + transient + full_grads)
        })
        .collect())
}

/// Resolves `--stage auto`; returns the stage and the explanation lines.
///
/// Each stage's estimate is its model state ([`stage_estimates`]) plus the activations and
/// kernel scratch of one microbatch, measured by running it once
/// ([`crate::activations::activation_peak`]), with the job's recompute choice.
pub fn choose_stage(
    model: &dyn Network,
    cfg: &TrainConfig,
    train: &Dataset,
) -> Result<(Stage, Vec<String>)> {
    match cfg.stage {
        StageChoice::Fixed(s) => Ok((s, vec![])),
        StageChoice::Auto => {
            let act = crate::activations::activation_peak(model, train, cfg)?;
            let est = stage_estimates(model, cfg)?;
            let mut lines = vec![format!(
                "  activations and scratch: ~{} per rank (one microbatch of {} samples run once, --recompute {})",
                format_bytes(act),
                crate::activations::microbatch(cfg),
                cfg.recompute.name()
            )];
            let est: Vec<(Stage, u64)> = est.into_iter().map(|(s, b)| (s, b + act)).collect();
            lines.extend(est.iter().map(|(s, b)| {
                format!(
                    "  stage {}: ~{} per rank (model state + activations)",
                    s.index(),
                    format_bytes(*b)
                )
            }));
            let pick = match cfg.device_memory {
                None => Some(Stage::Zero0),
                Some(cap) => est.iter().find(|(_, b)| *b <= cap).map(|(s, _)| *s),
            };
            match pick {
                Some(s) => {
                    lines.push(format!(
                        "  chose stage {} (the lowest that fits{}; if the model fits, plain data parallel is simplest)",
                        s.index(),
                        cfg.device_memory.map(|c| format!(" {}", format_bytes(c))).unwrap_or_default()
                    ));
                    Ok((s, lines))
                }
                None => Err(RuntimeError::config(format!(
                    "no ZeRO stage fits --device-memory {}:\n{}",
                    format_bytes(cfg.device_memory.unwrap_or(0)),
                    lines.join("\n")
                ))),
            }
        }
    }
}
