"""What sglang 0.5.23 itself decides that a plan must know, as data, so ``plan`` and a refused
flag answer without importing SGLang (seconds instead of tens of seconds).

Each table is a copy of the installed sglang's own; ``server.upstream_tables`` compares each
with upstream's, run by ``test/unit/test_contract.py`` against the installed sglang and by the
bump report (``server.bump_report``) against another release, so an sglang upgrade fails a test,
not a user. Inside SGLang's processes the plugin reads upstream's live tables
(``server.runtime.fusion_archs``).
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

# The all-reduce communicators of srt/distributed/device_communicators/ and the conditions each
# checks before it builds (``planning.levers`` turns them into doctor's "all-reduce options").

# custom_all_reduce.py, CustomAllreduce._SUPPORTED_WORLD_SIZES and _MAX_CAR_SIZE (CUDA).
CUSTOM_ALL_REDUCE_WORLD_SIZES = (2, 4, 6, 8)
CUSTOM_ALL_REDUCE_MAX_BYTES = 8192 * 1024
# custom_all_reduce_utils.py, can_use_custom_all_reduce_with_nvlink: "world_size > 2 and not
# full_nvlink" disables it (more than two PCIe-only GPUs); CustomAllreduce.should_custom_ar
# then serves a world of 2 or full NVLink. (v2, the CUDA default, needs full NVLink at every
# size and otherwise falls back to this v1 kernel: custom_all_reduce.dispatch_custom_allreduce.)
CUSTOM_ALL_REDUCE_PCIE_MAX_WORLD = 2

# pymscclpp.py: PyMscclppCommunicator imports these modules (a failed import disables it) and
# takes the world sizes in _SUPPORTED_WORLD_SIZES.
MSCCLPP_MODULES = ("mscclpp", "mscclpp.ext", "mscclpp.default_algos")
MSCCLPP_WORLD_SIZES = (4, 8, 16, 32, 64)

# all_reduce_utils.py, TORCH_SYMM_MEM_ALL_REDUCE_MAX_SIZES: compute-capability major -> world
# size -> the largest all-reduce in bytes. TorchSymmMemCommunicator stays disabled for a
# capability or world size not in it, and when the rendezvoused buffer has no multicast
# address (``handle.multicast_ptr == 0``). It serves bf16 only.
TORCH_SYMM_MEM_MAX_BYTES = {
    9: {2: 64 << 20, 4: 64 << 20, 6: 128 << 20, 8: 128 << 20},
    10: {2: 64 << 20, 4: 64 << 20, 6: 128 << 20, 8: 128 << 20},
}

# pcie_ipc_ar.py: _SUPPORTED_WORLD_SIZES and _ELIGIBLE_GROUP_NAMES (policy.PCIE_IPC_WORLD_SIZES
# is the same tuple, proven by the same test).
PCIE_IPC_GROUPS = frozenset({"tp"})

# parallel_state.py, GroupCoordinator._resolve_outplace_all_reduce_method: the order in which a
# plain all-reduce is offered to the communicators (the first that takes it serves it; MSCCL++,
# where it has a tuned configuration for the size, is checked before custom all-reduce and
# PCIe-IPC), after GroupCoordinator.all_reduce sent it to NCCL with symmetric memory
# (--enable-symm-mem) or to FlashInfer's tagged all-reduce.
OUTPLACE_ALLREDUCE_ORDER = ("ca", "pcie_ipc", "qr", "pymscclpp", "torch_symm_mem", "pynccl")
