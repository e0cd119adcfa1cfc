use super::*;

/// nanoGPT's configuration for a CPU: 4 layers, 4 heads, width 128, context 64.
fn nano_cpu() -> GptSpec {
    GptSpec {
        layers: 4,
        heads: 4,
        width: 128,
        context: 64,
        vocab: 256,
    }
}

#[test]
fn a_spec_needs_every_size_and_heads_that_divide_the_width() {
    assert!(nano_cpu().validate().is_ok());
    let err = GptSpec {
        heads: 3,
        ..nano_cpu()
    }
    .validate()
    .unwrap_err();
    assert!(err.to_string().contains("multiple of `heads` (3)"), "{err}");
    let err = GptSpec {
        layers: 0,
        ..nano_cpu()
    }
    .validate()
    .unwrap_err();
    assert!(
        err.to_string().contains("`layers` must be at least 1"),
        "{err}"
    );
}

#[test]
fn the_layout_has_nanogpts_names_and_sizes() {
    let layout = nano_cpu().layout();
    // Embeddings 32,768 + 8,192; each block 198,272; the final LayerNorm 256.
    assert_eq!(layout.len(), 834_304);
    let shape = |name: &str| layout.get(name).unwrap().shape.clone();
    assert_eq!(shape("transformer.wte.weight"), [256, 128]);
    assert_eq!(shape("transformer.h.3.attn.c_attn.weight"), [384, 128]);
    assert_eq!(shape("transformer.h.0.mlp.c_proj.weight"), [128, 512]);
    assert_eq!(
        layout.entries().last().unwrap().name,
        "transformer.ln_f.bias"
    );
    // A LayerNorm's gain and shift lie side by side (the backward pass writes both at once).
    let (gain, shift) = (
        layout.get("transformer.h.1.ln_2.weight").unwrap(),
        layout.get("transformer.h.1.ln_2.bias").unwrap(),
    );
    assert_eq!(gain.range().end, shift.offset);
}

#[test]
fn initial_parameters_follow_gpt2_and_the_seed() {
    let spec = nano_cpu();
    let layout = spec.layout();
    let params = spec.init_params(3);
    assert_eq!(params, spec.init_params(3));
    assert_ne!(params, spec.init_params(4));
    let values = |name: &str| &params[layout.get(name).unwrap().range()];
    let std = |v: &[f32]| (v.iter().map(|x| x * x).sum::<f32>() / v.len() as f32).sqrt();
    assert!((std(values("transformer.wte.weight")) - 0.02).abs() < 0.001);
    assert!((std(values("transformer.h.0.attn.c_attn.weight")) - 0.02).abs() < 0.001);
    // Projections into the residual stream: 0.02 / sqrt(2 * 4).
    let residual = std(values("transformer.h.2.mlp.c_proj.weight"));
    assert!((residual - 0.02 / 8f32.sqrt()).abs() < 0.0005, "{residual}");
    assert!(
        values("transformer.h.1.ln_1.weight")
            .iter()
            .all(|&v| v == 1.0)
    );
    assert!(
        values("transformer.h.1.ln_1.bias")
            .iter()
            .all(|&v| v == 0.0)
    );
    assert!(
        values("transformer.h.0.mlp.c_fc.bias")
            .iter()
            .all(|&v| v == 0.0)
    );
}

#[test]
fn weight_decay_applies_to_matrices_only() {
    assert!(GptSpec::decays("transformer.wte.weight"));
    assert!(GptSpec::decays("transformer.h.0.attn.c_attn.weight"));
    assert!(!GptSpec::decays("transformer.h.0.attn.c_attn.bias"));
    assert!(!GptSpec::decays("transformer.h.0.ln_1.weight"));
    assert!(!GptSpec::decays("transformer.ln_f.weight"));
}

#[test]
fn a_training_step_costs_six_flops_per_parameter_and_token_plus_attention() {
    let spec = nano_cpu();
    let flops = spec.train_step_flops(12);
    // The GEMM weights (all but the position embedding and the LayerNorms) times 6 per token,
    // and attention's two [64 x 64] products per head and sequence.
    let weights =
        (spec.layout().len() - 64 * 128 - (2 * 4 + 1) * 2 * 128 - 4 * (3 * 128 + 128 + 512 + 128))
            as u64;
    let tokens = 12 * 64;
    let attention = 6 * 4 * 2 * 12 * 64 * 64 * 128;
    assert_eq!(flops, 6 * weights * tokens + attention);
    assert_eq!(flops, 4_076_863_488);
}

#[test]
fn three_cpu_threads_give_the_loss_and_gradients_of_one_bit_for_bit() {
    use crate::backend::CpuBackend;

    // Large enough that every per-token and per-head kernel splits between the threads.
    let spec = GptSpec {
        layers: 1,
        heads: 4,
        width: 64,
        context: 32,
        vocab: 256,
    };
    let sequences = 17;
    let tokens: Vec<u32> = (0..sequences * spec.context)
        .map(|i| ((i * 7_919) % 256) as u32)
        .collect();
    let targets: Vec<u32> = tokens.iter().map(|&t| (t * 3 + 1) % 256).collect();
    let run = |backend: CpuBackend| {
        let mut pass = GptPass::new(&backend, spec, sequences).unwrap();
        let params = spec.init_params(9);
        let mut grads = vec![0.0; params.len()];
        pass.forward(&backend, &params, &tokens, spec.context)
            .unwrap();
        let loss = pass
            .backward(&backend, &params, &mut grads, &targets)
            .unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        (loss.to_bits(), bits(&grads), bits(pass.logits()))
    };
    assert!(run(CpuBackend::new()) == run(CpuBackend::with_threads(3).unwrap()));
}

/// Generation continues past the context (reading the last `context` tokens), is fixed by its
/// seed, and with `top_k = 1` always takes the likeliest byte: the argmax of the logits of a
/// forward pass over the same text.
#[test]
fn generation_is_seeded_and_top_1_is_the_argmax() {
    use rand::SeedableRng;
    use rand::rngs::ChaCha8Rng;

    use crate::backend::{Backend, CpuBackend};

    let spec = GptSpec {
        layers: 1,
        heads: 2,
        width: 16,
        context: 8,
        vocab: 256,
    };
    let backend = CpuBackend::new();
    let mut model = GptReplica::new(&backend, spec, 1, &spec.init_params(4)).unwrap();
    let draw = |model: &mut GptReplica<CpuBackend>, seed: u64, top_k: Option<usize>| {
        let sampling = Sampling {
            temperature: 1.0,
            top_k,
        };
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        model
            .generate(&backend, b"To be", 20, sampling, &mut rng)
            .unwrap()
    };
    let first = draw(&mut model, 1, None);
    assert_eq!(first.len(), 20);
    assert_eq!(draw(&mut model, 1, None), first);
    assert_ne!(draw(&mut model, 2, None), first);

    let greedy = draw(&mut model, 1, Some(1));
    assert_eq!(
        draw(&mut model, 9, Some(1)),
        greedy,
        "top-1 ignores the seed"
    );
    // Each greedy byte is the argmax after the text before it (its last 8 bytes).
    let mut text = b"To be".to_vec();
    let mut pass = GptPass::new(&backend, spec, 1).unwrap();
    let mut params = backend.zeros(spec.layout().len()).unwrap();
    backend
        .upload(
            &spec.init_params(4),
            crate::backend::whole_mut::<CpuBackend>(&mut params),
        )
        .unwrap();
    for &byte in &greedy {
        let window = &text[text.len().saturating_sub(8)..];
        let tokens: Vec<u32> = window.iter().map(|&t| u32::from(t)).collect();
        pass.forward(&backend, &params, &tokens, tokens.len())
            .unwrap();
        let mut logits = vec![0.0f32; tokens.len() * 256];
        let view = CpuBackend::view(pass.logits(), 0..logits.len());
        backend.download(view, &mut logits).unwrap();
        let last = &logits[(tokens.len() - 1) * 256..];
        let best = (0..256)
            .max_by(|&a, &b| last[a].total_cmp(&last[b]))
            .unwrap();
        assert_eq!(usize::from(byte), best);
        text.push(byte);
    }
}
