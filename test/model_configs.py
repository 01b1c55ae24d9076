"""Config-only model directories: the real architectures' shapes, enough for SGLang's
ServerArgs resolution and our planning on CPU (no weights). A plain module, not a conftest, so
a test can import it by name wherever pytest collected it from."""

from __future__ import annotations

DEEPSEEK_V3_TEXT = {
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "vocab_size": 163840,
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16",
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.827,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "rope_theta": 50000.0,
    "tie_word_embeddings": False,
}

MODEL_CONFIGS = {
    "DeepseekV3ForCausalLM": {"architectures": ["DeepseekV3ForCausalLM"], **DEEPSEEK_V3_TEXT},
    "KimiK25ForConditionalGeneration": {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": {"architectures": ["DeepseekV3ForCausalLM"], **DEEPSEEK_V3_TEXT},
        "vision_config": {},
        "torch_dtype": "bfloat16",
    },
}
