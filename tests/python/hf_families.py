"""Reference outputs of Hugging Face transformers' own models of the attention families the
reference engine runs beside Llama (model/tests/hf_families.rs, engine/tests/hf_families.rs):

- ``gpt_oss``: sliding-window and full layers interleaved, attention sinks, biased
  projections, a top-k mixture of experts with the clamped SwiGLU, YaRN RoPE.
- ``deepseek_v3``: multi-head latent attention (a compressed latent and a decoupled RoPE
  key per token, low-rank queries or not, interleaved RoPE or not, YaRN with its mscale),
  dense layers first, then DeepSeek's mixture of experts (sigmoid scores with a
  correction bias, group-limited top-k, a shared expert, a routed scaling factor).
- ``qwen3_5``: a recurrent hybrid — Gated DeltaNet layers (a short causal convolution,
  a per-head state updated by the gated delta rule, a gated RMSNorm) beside gated full
  attention with per-head q/k norms and partial RoPE; zero-centered RMSNorms.

Writes, per variant, a tiny random checkpoint exactly as transformers saves it
(``save_pretrained``: config.json and model.safetensors in the variant's dtype) and
expected.json: the prompt's token ids, the logits at its last position and the greedy
continuation, computed in float32 (eager attention) from the weights as saved. Weights
transformers initialises to zero (biases) or near zero (sinks) are drawn at random here,
so a model that ignored them would be caught.

Usage: python hf_families.py OUT_DIR   (prints the variants as JSON)
"""

import json
import os
import sys

import torch

NEW_TOKENS = 12


def prompt_ids(n, seed):
    g = torch.Generator().manual_seed(seed)
    # printable ASCII: the engine's byte tokenizer maps each byte to its value
    return torch.randint(32, 127, (n,), generator=g).tolist()


def gpt_oss(dtype, rope):
    from transformers import GptOssConfig, GptOssForCausalLM

    cfg = GptOssConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=24,
        max_position_embeddings=128,
        initializer_range=0.2,
        rms_norm_eps=1e-5,
        rope_parameters=rope,
    )
    model = GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            a, e = layer.self_attn, layer.mlp.experts
            for p in (a.q_proj.bias, a.k_proj.bias, a.v_proj.bias, a.o_proj.bias, e.gate_up_proj_bias, e.down_proj_bias):
                p.normal_(0.0, 0.2)
            a.sinks.normal_(0.0, 1.5)
            layer.mlp.router.bias.normal_(0.0, 0.5)
    return model, GptOssForCausalLM


def deepseek_v3(dtype, rope, q_lora_rank=32, rope_interleave=True):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        kv_lora_rank=32,
        q_lora_rank=q_lora_rank,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        rope_interleave=rope_interleave,
        max_position_embeddings=512,
        initializer_range=0.2,
        rms_norm_eps=1e-6,
        rope_parameters=rope,
    )
    model = DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers[cfg.first_k_dense_replace:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.5)
        for layer in model.model.layers:
            a = layer.self_attn
            for norm in (a.kv_a_layernorm, a.q_a_layernorm):
                if norm is not None:
                    norm.weight.normal_(1.0, 0.3)
    return model, DeepseekV3ForCausalLM


def qwen3_5(dtype, rope, layer_types):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=len(layer_types),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        layer_types=layer_types,
        max_position_embeddings=512,
        initializer_range=0.2,
        rope_parameters=rope,
    )
    model = Qwen3_5ForCausalLM(cfg).eval()
    with torch.no_grad():
        # Zero-centered norms start at 0 (a weight of 1): draw them, so a model that
        # read them as plain RMSNorm weights would be caught.
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("_norm.weight") or name == "model.norm.weight":
                p.normal_(0.0, 0.3)
        for layer in model.model.layers:
            if hasattr(layer, "linear_attn"):
                la = layer.linear_attn
                la.A_log.copy_(torch.empty_like(la.A_log).uniform_(0.0, 1.5).log())
                la.dt_bias.normal_(0.0, 0.5)
                la.norm.weight.normal_(1.0, 0.3)
    return model, Qwen3_5ForCausalLM


YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 32,
}

# DeepSeek-V3's own YaRN: mscale and mscale_all_dim, which also scale the softmax.
DEEPSEEK_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 128,
}

VARIANTS = [
    # name, builder, dtype, rope parameters, prompt length
    ("gpt_oss_f32_yarn", gpt_oss, torch.float32, YARN, 70),
    ("gpt_oss_bf16_default", gpt_oss, torch.bfloat16, {"rope_type": "default", "rope_theta": 150000.0}, 53),
    ("deepseek_v3_f32_yarn", deepseek_v3, torch.float32, DEEPSEEK_YARN, 70),
    (
        "deepseek_v3_bf16_plain",
        lambda dtype, rope: deepseek_v3(dtype, rope, q_lora_rank=None, rope_interleave=False),
        torch.bfloat16,
        {"rope_type": "default", "rope_theta": 10000.0},
        45,
    ),
    (
        "qwen3_5_f32",
        lambda dtype, rope: qwen3_5(dtype, rope, ["linear_attention", "full_attention"] * 2),
        torch.float32,
        {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        70,
    ),
    (
        "qwen3_5_bf16",
        lambda dtype, rope: qwen3_5(dtype, rope, ["linear_attention"] * 3 + ["full_attention"]),
        torch.bfloat16,
        {"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.25},
        61,
    ),
]


def main(out):
    listed = []
    for i, (name, build, dtype, rope, plen) in enumerate(VARIANTS):
        d = os.path.join(out, name)
        os.makedirs(d, exist_ok=True)
        torch.manual_seed(300 + i)
        model, cls = build(dtype, rope)
        model.to(dtype).save_pretrained(d, safe_serialization=True)
        ref = cls.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
        ids = prompt_ids(plen, 50 + i)
        seq = list(ids)
        gaps = []
        with torch.no_grad():
            last = None
            for step in range(NEW_TOKENS):
                logits = ref(torch.tensor([seq])).logits[0, -1].float()
                if step == 0:
                    last = logits.tolist()
                top = torch.topk(logits, 2).values
                gaps.append(float(top[0] - top[1]))
                seq.append(int(torch.argmax(logits)))
        json.dump(
            {
                "prompt": ids,
                "logits": last,
                "greedy": seq[len(ids):],
                "min_gap": min(gaps),
                "dtype": str(dtype).removeprefix("torch."),
            },
            open(os.path.join(d, "expected.json"), "w"),
        )
        listed.append(name)
    print(json.dumps({"variants": listed, "transformers": __import__("transformers").__version__}))


if __name__ == "__main__":
    main(sys.argv[1])
