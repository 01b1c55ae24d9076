"""What sglang 0.5.23 itself decides that a plan must know, as data, so ``plan`` and a refused
flag answer without importing SGLang (seconds instead of tens of seconds).

Each table is a copy of the installed sglang's own; ``test/unit/test_contract.py`` proves each
equals it, so an sglang upgrade fails a test, not a user. Inside SGLang's processes the plugin
reads upstream's live tables (``server.runtime.fusion_archs``).
"""

from __future__ import annotations

# srt/arg_groups/overrides.py, _FLASHINFER_ALLREDUCE_FUSION_ARCHS: the architectures whose layers
# have a fused all-reduce + residual + RMSNorm point.
FUSION_ARCHS = frozenset(
    {
        "DeepseekV32ForCausalLM",
        "DeepseekV3ForCausalLM",
        "DeepseekV4ForCausalLM",
        "Glm4MoeForCausalLM",
        "Glm4MoeLiteForCausalLM",
        "GlmMoeDsaForCausalLM",
        "GptOssForCausalLM",
        "InternS2PreviewForConditionalGeneration",
        "KimiK25ForConditionalGeneration",
        "MistralLarge3ForCausalLM",
        "NemotronHForCausalLM",
        "NemotronHPuzzleForCausalLM",
        "NemotronH_Omni_Reasoning_V3",
        "Qwen3MoeForCausalLM",
        "Qwen3NextForCausalLM",
        "Qwen3VLMoeForConditionalGeneration",
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForConditionalGeneration",
        "Qwen4ExpForConditionalGeneration",
    }
)

# ServerArgs.add_cli_args: the choices of the SGLang flags that doctor and plan also take.
FLAG_CHOICES = {
    "--flashinfer-allreduce-fusion-backend": ("auto", "trtllm", "mnnvl", "cutedsl"),
    "--moe-a2a-backend": (
        "none",
        "deepep",
        "mooncake",
        "nixl",
        "mori",
        "ascend_fuseep",
        "flashinfer",
        "megamoe",
        "deepep_v2",
        "pplx",
        "ascend_tp",
        "flashinfer_megamoe",
    ),
    "--dtype": ("auto", "half", "float16", "bfloat16", "float", "float32"),
}
