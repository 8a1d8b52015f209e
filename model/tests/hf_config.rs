//! Hugging Face Llama `config.json` in both formats, `llama3` RoPE scaling, and the
//! refusal, by name, of everything the engine does not implement. (That the engine then
//! computes what transformers computes is `hf_parity.rs`.)

use kvd_model::model::{RopeScaling, Weights};
use kvd_model::ModelConfig;
use serde_json::{json, Value};

fn base() -> Value {
    json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
        "rms_norm_eps": 1e-6, "attention_bias": false, "mlp_bias": false,
        "tie_word_embeddings": false, "max_position_embeddings": 2048,
    })
}

fn with(mut v: Value, extra: Value) -> Value {
    for (k, x) in extra.as_object().unwrap() {
        v[k] = x.clone();
    }
    v
}

fn parse(v: &Value) -> anyhow::Result<ModelConfig> {
    ModelConfig::from_hf_value(v, "m")
}

const LLAMA31: RopeScaling = RopeScaling::Llama3 {
    factor: 8.0,
    low_freq_factor: 1.0,
    high_freq_factor: 4.0,
    original_max_position_embeddings: 8192.0,
};

#[test]
fn both_config_formats_read_the_same_model() {
    let scaling = json!({"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192});
    // transformers 4: rope_theta at the top, rope_scaling beside it
    let mut s4 = scaling.clone();
    s4["rope_type"] = json!("llama3");
    let v4 = with(base(), json!({"rope_theta": 500000.0, "rope_scaling": s4}));
    // transformers 5: everything in rope_parameters
    let mut s5 = scaling.clone();
    s5["rope_type"] = json!("llama3");
    s5["rope_theta"] = json!(500000.0);
    let v5 = with(base(), json!({"rope_parameters": s5}));
    // older transformers 4 wrote `type` instead of `rope_type`
    let mut s_old = scaling.clone();
    s_old["type"] = json!("llama3");
    let v_old = with(
        base(),
        json!({"rope_theta": 500000.0, "rope_scaling": s_old}),
    );
    let (a, b, c) = (
        parse(&v4).unwrap(),
        parse(&v5).unwrap(),
        parse(&v_old).unwrap(),
    );
    assert_eq!(a, b);
    assert_eq!(a, c);
    assert_eq!(a.rope_theta, 500000.0, "not the 10000 default");
    assert_eq!(a.rope_scaling, Some(LLAMA31));
    assert_eq!((a.heads, a.kv_heads, a.head_dim), (4, 2, 16));
    // plain RoPE, both ways, and no RoPE keys at all
    let p4 = parse(&with(
        base(),
        json!({"rope_theta": 1e6, "rope_scaling": null}),
    ))
    .unwrap();
    let p5 = parse(&with(
        base(),
        json!({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    ))
    .unwrap();
    assert_eq!(p4, p5);
    assert_eq!((p4.rope_theta, p4.rope_scaling.clone()), (1e6, None));
    assert_eq!(parse(&base()).unwrap().rope_theta, 10_000.0);
    let tied = parse(&with(base(), json!({"tie_word_embeddings": true}))).unwrap();
    assert!(tied.tied_embeddings && !p4.tied_embeddings);
}

#[test]
fn what_is_not_implemented_is_refused_by_name() {
    let cases = [
        (json!({"model_type": "mistral"}), "model_type \"mistral\""),
        (json!({"hidden_act": "gelu"}), "hidden_act \"gelu\""),
        (json!({"attention_bias": true}), "attention_bias"),
        (json!({"mlp_bias": true}), "mlp_bias"),
        (json!({"sliding_window": 4096}), "sliding_window"),
        (
            json!({"quantization_config": {"quant_method": "awq"}}),
            "quantization_config",
        ),
        (json!({"pretraining_tp": 2}), "pretraining_tp"),
        (
            json!({"rope_scaling": {"rope_type": "longrope", "factor": 4.0}}),
            "rope type \"longrope\"",
        ),
        (
            json!({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}),
            "original_max_position_embeddings",
        ),
        (
            json!({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}),
            "rope type \"linear\"",
        ),
        (
            json!({"rope_scaling": {"type": "dynamic", "factor": 2.0}}),
            "rope type \"dynamic\"",
        ),
        (
            json!({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}),
            "partial_rotary_factor",
        ),
        (
            json!({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}),
            "low_freq_factor",
        ),
        (json!({"num_key_value_heads": 3}), "not a multiple"),
    ];
    for (extra, says) in cases {
        let e = parse(&with(base(), extra.clone()))
            .err()
            .unwrap_or_else(|| panic!("{extra} was accepted"));
        let e = format!("{e:#}");
        assert!(e.contains(says), "{extra}: {e}");
    }
}

/// A gpt-oss config: what it implements is read, what it does not is refused by name
/// (the released checkpoints' MXFP4 weights, layer kinds other than sliding and full).
#[test]
fn gpt_oss_configs_are_read_and_their_gaps_refused() {
    let base = json!({
        "model_type": "gpt_oss", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 32,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 24,
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
            "beta_fast": 32.0, "beta_slow": 1.0, "truncate": false,
            "original_max_position_embeddings": 4096},
    });
    let c = parse(&base).unwrap();
    use kvd_model::model::LayerKind::{Full, Sliding};
    assert_eq!(c.layer_types, [Sliding, Full, Sliding, Full]); // GptOssConfig's default
    assert_eq!((c.window(0), c.window(1)), (24, 0));
    assert!(c.attention_bias && c.attention_sinks);
    let m = c.moe.unwrap();
    assert_eq!(
        (m.experts, m.top_k, m.ffn, m.act, m.router, m.shared),
        (
            4,
            2,
            32,
            kvd_model::ExpertAct::ClampedSwiglu {
                alpha: 1.702,
                limit: 7.0
            },
            kvd_model::Router::SoftmaxTopk,
            0
        )
    );
    // YaRN's attention factor: 0.1 ln(32) + 1.
    assert!((c.rope_attention_scale() - (0.1 * 32f32.ln() + 1.0)).abs() < 1e-6);
    for (extra, says) in [
        (
            json!({"quantization_config": {"quant_method": "mxfp4"}}),
            "`quantization_config` (mxfp4)",
        ),
        (
            json!({"layer_types": ["sliding_attention", "chunked_attention", "full_attention", "full_attention"]}),
            "layer type Some(\"chunked_attention\")",
        ),
        (
            json!({"layer_types": ["full_attention"]}),
            "1 layer_types for 4 layers",
        ),
        (json!({"num_experts_per_tok": 9}), "top_k 9"),
    ] {
        let e = parse(&with(base.clone(), extra.clone()))
            .err()
            .unwrap_or_else(|| panic!("{extra} was accepted"));
        let e = format!("{e:#}");
        assert!(e.contains(says), "{extra}: {e}");
    }
}

/// `llama3` keeps high frequencies, divides low ones by `factor`, blends between
/// (Llama 3.1 8B's parameters: head_dim 128, theta 500000).
#[test]
fn llama3_scaling_keeps_high_divides_low_and_blends_between() {
    let plain = ModelConfig {
        head_dim: 128,
        rope_theta: 500_000.0,
        ..Default::default()
    };
    let scaled = ModelConfig {
        rope_scaling: Some(LLAMA31),
        ..plain.clone()
    };
    let (p, s) = (plain.inv_freq(), scaled.inv_freq());
    assert_eq!(p.len(), 64);
    let (mut high, mut low, mut mid) = (0, 0, 0);
    for (i, (&p, &s)) in p.iter().zip(&s).enumerate() {
        let wavelen = 2.0 * std::f64::consts::PI / p as f64;
        if wavelen < 8192.0 / 4.0 {
            assert_eq!(s, p, "pair {i}: a high frequency is kept");
            high += 1;
        } else if wavelen > 8192.0 {
            assert!((s - p / 8.0).abs() <= p * 1e-6, "pair {i}: a low one is /8");
            low += 1;
        } else {
            assert!(s < p && s > p / 8.0, "pair {i}: a middle one is between");
            mid += 1;
        }
    }
    assert!(high > 0 && low > 0 && mid > 0, "{high} {low} {mid}");
}

#[test]
fn tied_and_untied_checkpoints() {
    let cfg = ModelConfig {
        vocab: 32,
        dim: 16,
        layers: 1,
        heads: 2,
        kv_heads: 1,
        head_dim: 8,
        ffn: 32,
        ..Default::default()
    };
    let dir = tempfile::tempdir().unwrap();
    let st = dir.path().join("model.safetensors");
    // A file without lm_head: fine when tied, refused (by name) when not.
    let w = Weights::seeded(&cfg);
    w.save_safetensors(&cfg, &st).unwrap();
    let bytes = std::fs::read(&st).unwrap();
    let t = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<(String, safetensors::tensor::TensorView<'_>)> = t
        .tensors()
        .into_iter()
        .filter(|(n, _)| n != "lm_head.weight")
        .collect();
    let no_head = dir.path().join("tied.safetensors");
    safetensors::serialize_to_file(kept, None, &no_head).unwrap();
    let tied = ModelConfig {
        tied_embeddings: true,
        ..cfg.clone()
    };
    assert!(Weights::from_safetensors(&no_head, &tied).is_ok());
    let e = Weights::from_safetensors(&no_head, &cfg).err().unwrap();
    assert!(format!("{e:#}").contains("tie_word_embeddings"), "{e:#}");
    assert!(Weights::from_safetensors(&st, &cfg).is_ok());
}
