"""Reference outputs of Hugging Face transformers' own LlamaForCausalLM, for the engine's
parity tests (model/tests/hf_parity.rs, engine/tests/hf_parity.rs).

Writes, per variant, a tiny random checkpoint exactly as transformers saves it
(`save_pretrained`: config.json in the installed transformers' format, model.safetensors
in the variant's dtype), the same config rewritten in the other format (config_v4.json:
top-level rope_theta / rope_scaling), and expected.json: the prompt's token ids, the
logits at its last position and the greedy continuation, computed in float32 from the
weights as saved (rounded to the variant's dtype), so the engine, which computes in f32
from those weights, is compared like for like.

Usage: python hf_parity.py OUT_DIR   (prints the variants as JSON)
"""

import json
import os
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

NEW_TOKENS = 12

VARIANTS = [
    # name, kv heads, dtype, tied, rope parameters, prompt length
    ("gqa_f32_untied", 2, torch.float32, False, {"rope_type": "default", "rope_theta": 10000.0}, 40),
    ("mha_bf16_tied", 4, torch.bfloat16, True, {"rope_type": "default", "rope_theta": 1e6}, 40),
    # Llama 3.x scaling, with a prompt well past original_max_position_embeddings.
    (
        "mqa_f16_llama3_long",
        1,
        torch.float16,
        False,
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
        150,
    ),
]


def prompt_ids(n, seed):
    g = torch.Generator().manual_seed(seed)
    # printable ASCII: the engine's byte tokenizer maps each byte to its value
    return torch.randint(32, 127, (n,), generator=g).tolist()


def v4_form(cfg):
    """The same config as transformers 4 wrote it."""
    c = dict(cfg)
    rp = dict(c.pop("rope_parameters"))
    c["rope_theta"] = rp.pop("rope_theta")
    c["rope_scaling"] = None if rp.get("rope_type") == "default" else rp
    return c


def main(out):
    torch.manual_seed(0)
    listed = []
    for i, (name, kv, dtype, tied, rope, plen) in enumerate(VARIANTS):
        d = os.path.join(out, name)
        os.makedirs(d, exist_ok=True)
        cfg = LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=kv,
            head_dim=16,
            max_position_embeddings=1024,
            rms_norm_eps=1e-6,
            tie_word_embeddings=tied,
            rope_parameters=rope,
            initializer_range=0.2,
        )
        torch.manual_seed(100 + i)
        model = LlamaForCausalLM(cfg).eval()
        model.to(dtype).save_pretrained(d, safe_serialization=True)
        saved = json.load(open(os.path.join(d, "config.json")))
        assert "rope_parameters" in saved, "this transformers writes the transformers 5 format"
        json.dump(v4_form(saved), open(os.path.join(d, "config_v4.json"), "w"), indent=2)
        # The reference, in f32 over the rounded weights.
        ref = LlamaForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        ids = prompt_ids(plen, i)
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
                "tied": tied,
                "kv_heads": kv,
                "rope": rope,
            },
            open(os.path.join(d, "expected.json"), "w"),
        )
        listed.append(name)
    print(json.dumps({"variants": listed, "transformers": __import__("transformers").__version__}))


if __name__ == "__main__":
    main(sys.argv[1])
