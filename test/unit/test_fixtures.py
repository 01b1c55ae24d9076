"""The tiny EAGLE-3 fixture models: generated here, loadable by transformers and SGLang.

CPU only. The generator runs once per module (a few seconds); the e2e suite and ``selftest`` rely
on every property checked here (see ``sglang_sm120/tiny_models.py`` for why the weights are built
this way).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from sglang_sm120.commands import tiny_models as tiny

ARCHS = ("llama", "deepseek_v3")
PROMPT = "The graph verify draft token, 42. Kernel rank norm"


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> dict:
    return tiny.build_all(tmp_path_factory.mktemp("tiny"))


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _successor(pair) -> list:
    return json.loads((pair.target / tiny.FIXTURE_FILE).read_text())["successor"]


def _load_target(pair):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        pair.target, dtype=torch.bfloat16, output_loading_info=True
    )
    return model.eval(), info


def _prompt_ids(pair) -> torch.Tensor:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(pair.target)(PROMPT, return_tensors="pt").input_ids


def test_tokenizer_has_the_fixed_vocabulary_and_special_ids(pairs) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pairs["llama"].target)
    assert len(tokenizer) == tiny.VOCAB_SIZE
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (tiny.BOS_ID, tiny.EOS_ID)
    ids = tokenizer(PROMPT).input_ids
    assert tokenizer.decode(ids) == PROMPT


@pytest.mark.parametrize("arch", ARCHS)
def test_target_loads_in_transformers_with_every_weight_used(pairs, arch) -> None:
    model, info = _load_target(pairs[arch])
    assert type(model).__name__ == _config(pairs[arch].target)["architectures"][0]
    assert model.dtype == torch.bfloat16
    leftovers = {k: v for k, v in info.items() if v}
    assert not leftovers, f"weights not matched by transformers: {leftovers}"


@pytest.mark.parametrize("arch", ARCHS)
def test_target_greedy_token_is_the_designed_successor_with_a_wide_margin(pairs, arch) -> None:
    model, _ = _load_target(pairs[arch])
    ids = _prompt_ids(pairs[arch])
    successor = _successor(pairs[arch])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    top2 = logits.topk(2, dim=-1)
    assert top2.indices[:, 0].tolist() == [successor[t] for t in ids[0].tolist()]
    # bf16 rounding moves logits by far less than this; the e2e equality relies on it.
    assert (top2.values[:, 0] - top2.values[:, 1]).min() > 10.0


@pytest.mark.parametrize("arch", ARCHS)
def test_draft_head_proposes_two_tokens_ahead_from_target_aux_states(pairs, arch) -> None:
    """fc(aux) -> norm -> lm_head -> d2t gives successor(successor(t)), as the draft's first
    proposal must (its one decoder layer only adds a small residual on top)."""
    from safetensors.torch import load_file

    model, _ = _load_target(pairs[arch])
    ids = _prompt_ids(pairs[arch])
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
    # SGLang captures the input of layers id + 1 for the draft's aux ids.
    aux = torch.cat([hidden[i + 1][0].float() for i in tiny.AUX_LAYER_IDS], dim=-1)
    draft = load_file(str(pairs[arch].draft / "model.safetensors"))
    x = aux @ draft["fc.weight"].float().T
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + tiny.RMS_EPS)
    draft_ids = (x @ draft["lm_head.weight"].float().T).argmax(-1)
    proposed = (draft_ids + draft["d2t"][draft_ids]).tolist()
    successor = _successor(pairs[arch])
    assert proposed == [successor[successor[t]] for t in ids[0].tolist()]


@pytest.mark.parametrize("arch", ARCHS)
def test_draft_token_map_is_a_permutation_of_the_target_vocabulary(pairs, arch) -> None:
    from safetensors.torch import load_file

    draft = load_file(str(pairs[arch].draft / "model.safetensors"))
    hot = draft["d2t"] + torch.arange(draft["d2t"].numel())
    assert sorted(hot.tolist()) == list(range(tiny.VOCAB_SIZE))
    assert (draft["d2t"] != 0).any(), "an identity map would not exercise d2t"
    assert draft["t2d"].dtype == torch.bool and bool(draft["t2d"].all())


@pytest.mark.parametrize("arch", ARCHS)
def test_draft_config_is_an_eagle3_llama_with_the_target_hidden_size(pairs, arch) -> None:
    draft, target = _config(pairs[arch].draft), _config(pairs[arch].target)
    assert draft["architectures"] == ["LlamaForCausalLMEagle3"]
    assert draft["hidden_size"] == target["hidden_size"]  # SGLang then shares the embedding
    ids = draft["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    # Both SGLang loaders capture at layer ids + 1 here: those layers must exist.
    assert max(ids) + 1 < target["num_hidden_layers"]
    assert draft["draft_vocab_size"] == target["vocab_size"]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_sizes_shard_evenly_at_every_tp(pairs, arch, tp) -> None:
    target = _config(pairs[arch].target)
    assert target["hidden_size"] >= 256
    assert target["num_attention_heads"] % tp == 0
    assert target["num_key_value_heads"] % tp == 0
    assert target["intermediate_size"] % tp == 0
    if arch == "deepseek_v3":
        assert target["moe_intermediate_size"] % tp == 0


def test_deepseek_target_has_mla_and_moe_fields_sglang_reads(pairs) -> None:
    config = _config(pairs["deepseek_v3"].target)
    for key in (
        "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
        "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "moe_intermediate_size",
        "first_k_dense_replace", "topk_method", "scoring_func", "n_group", "topk_group",
    ):  # fmt: skip
        assert key in config, key
    assert config["first_k_dense_replace"] < config["num_hidden_layers"]  # some layers are MoE


def test_generation_is_reproducible(tmp_path) -> None:
    a = tiny.build_all(tmp_path / "a")
    b = tiny.build_all(tmp_path / "b")

    def digest(path: Path) -> str:
        return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()

    for arch in ARCHS:
        assert digest(a[arch].target) == digest(b[arch].target)
        assert digest(a[arch].draft) == digest(b[arch].draft)
    assert (a["llama"].target / "tokenizer.json").read_text() == (
        b["llama"].target / "tokenizer.json"
    ).read_text()


def test_sglang_model_config_reads_the_fixtures(pairs) -> None:
    pytest.importorskip("sglang", reason="sglang is not installed")
    from sglang.srt.configs.model_config import AttentionArch, ModelConfig

    llama = ModelConfig(str(pairs["llama"].target))
    deepseek = ModelConfig(str(pairs["deepseek_v3"].target))
    draft = ModelConfig(
        str(pairs["deepseek_v3"].draft), is_draft_model=True, speculative_algorithm="EAGLE3"
    )
    assert llama.hf_config.architectures == ["LlamaForCausalLM"]
    assert deepseek.attention_arch == AttentionArch.MLA
    assert deepseek.hf_config.topk_method == "noaux_tc"
    assert draft.hf_config.architectures == ["LlamaForCausalLMEagle3"]
    assert draft.hf_config.draft_vocab_size == tiny.VOCAB_SIZE
    assert {llama.dtype, deepseek.dtype, draft.dtype} == {torch.bfloat16}
