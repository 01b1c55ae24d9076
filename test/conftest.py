"""Shared setup and fixtures.

- The repository's sources stand in for packages that are not installed (GPU boxes without
  sglang get neither the plugin nor, before a build, sgl-kernel-sm120); installed ones win.
- CUDA modules load eagerly: tests that emulate ranks as streams of one process have them spin
  on each other, and a lazily loaded kernel would wait for them.
- Config-only model directories, enough for ServerArgs resolution on CPU.
- ``kernel_library.py`` beside this file: whether sgl-kernel-sm120 is here, for the tests that
  need it (they skip with the reason without it, or fail where SGLANG_SM120_KERNEL_REQUIRED=1).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")
ROOT = Path(__file__).resolve().parents[1]
for source in (ROOT / "python", ROOT / "sgl-kernel-sm120" / "python"):
    if str(source) not in sys.path:
        sys.path.append(str(source))

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


def write_model_config(root: Path, arch: str) -> Path:
    path = root / arch
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(MODEL_CONFIGS[arch]))
    return path


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {arch: write_model_config(root, arch) for arch in MODEL_CONFIGS}
