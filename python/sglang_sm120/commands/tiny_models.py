"""Tiny random-weight EAGLE-3 model pairs for ``selftest`` and the e2e suite: no hub access, a
few seconds on a CPU.

Two targets, each with a matching EAGLE-3 draft (``LlamaForCausalLMEagle3``), all bf16
safetensors plus a byte-level BPE tokenizer trained here with the ``tokenizers`` library:

- ``llama``: ``LlamaForCausalLM``, hidden 512, 5 layers, 8 heads of 64.
- ``deepseek_v3``: ``DeepseekV3ForCausalLM`` (the Kimi-K2.5 family): MLA with the real
  DeepSeek-V3 head dims (kv_lora_rank 512, rope 64, nope 128, v 128), 1 dense layer then MoE
  layers with 8 routed experts (top-2, sigmoid scoring, ``noaux_tc``) and 1 shared expert.

Sizes divide by tp 1/2/4/8 (heads, KV heads, intermediate sizes), so SGLang can shard them.

Why the weights are not plain noise: a random model's greedy token is decided by logit gaps
close to bf16 rounding, so "speculative output == plain output" would be a coin toss between
two correct implementations. Here every layer is random, but the LM head is built so that the
greedy next token is ``successor[current token]`` (a fixed derangement, written to
``tiny_fixture.json``) with a margin of ~20 logits: the residual stream keeps the token's own
embedding (the random layers add ~30% of its norm on top) and the head row of ``successor[t]`` is
``t``'s embedding. The draft's head is built the same way one step further ahead
(``successor[successor[t]]`` from the target's aux hidden states), and its token map ``d2t`` is a
non-trivial permutation, so with any tree the first draft token is right and the second is
wrong: the designed accept length is 2.0 (1 draft + the bonus token). A broken verify or a
corrupted hidden state shows up as accept length ~1.0 or as a different output.

What this cannot catch: small numeric errors (a margin this large hides them). Kernel tests
compare against float32 references, and the e2e suite's real model pair checks accept length.

Usage::

    python -m sglang_sm120.commands.tiny_models /tmp/tiny       # prints the paths as JSON
    from sglang_sm120.commands.tiny_models import build_all; pairs = build_all(Path("/tmp/tiny"))
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

VOCAB_SIZE = 1024
SPECIAL_TOKENS = ("<s>", "</s>", "<pad>")  # ids 0, 1, 2
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
HIDDEN = 512
NUM_LAYERS = 5
NUM_HEADS = 8
HEAD_DIM = 64
DENSE_INTERMEDIATE = 1024
MAX_POSITIONS = 2048
RMS_EPS = 1e-6
# Aux hidden states for the draft. Both SGLang loaders turn ids [1, 2, 3] into captures at
# layers 2, 3, 4 (the Llama loader adds 1; the DeepSeek one adds 1 when the first id is 1).
AUX_LAYER_IDS = (1, 2, 3)
EMBED_STD = 1.0
WEIGHT_STD = 0.02
# Logit of the designed next token, in nats above zero; others stay within a few units.
DESIGNED_LOGIT = 30.0
FIXTURE_FILE = "tiny_fixture.json"
DESIGNED_ACCEPT_LENGTH = 2.0
# What a run must reach: the designed 2.0 less a margin for requests cut short by their token
# limit (a broken verify or corrupted draft hidden states give ~1.0).
MIN_ACCEPT_LENGTH = 1.8
# Prompts made of the tokenizer's training words, so every token is an ordinary one.
PROMPTS = (
    "The graph verify draft token",
    "Kernel rank norm tensor and the draft",
    "Bou kai ten!",
    "Sailuvaiten murus, 42.",
    "The",
    "Verify the graph; 7 and 9.",
)

DEEPSEEK_MLA = {
    "q_lora_rank": 256,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
}
DEEPSEEK_MOE = {
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 256,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
}


@dataclass(frozen=True)
class TinyPair:
    """A generated target directory and its EAGLE-3 draft directory."""

    arch: str
    target: Path
    draft: Path


# ---------------------------------------------------------------- tokenizer


def _corpus(seed: int) -> list[str]:
    """Deterministic text with enough distinct sub-words for 1024 BPE merges."""
    rng = random.Random(seed)
    onsets = ["b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ou"]
    codas = ["", "n", "r", "s", "t", "l"]
    words = [
        "".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(n))
        for n in (1, 2, 2, 3, 3, 4)
        for _ in range(120)
    ]
    words += ["the", "graph", "verify", "draft", "token", "tensor", "rank", "kernel", "norm"]
    lines = []
    for _ in range(3000):
        sentence = " ".join(rng.choice(words) for _ in range(rng.randint(4, 14)))
        lines.append(sentence.capitalize() + rng.choice([".", "!", "?", ", 42.", "; 7 and 9."]))
    return lines


def train_tokenizer(out_dir: Path, seed: int = 0) -> int:
    """Train a byte-level BPE tokenizer of exactly VOCAB_SIZE ids and save HF files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(
            f"tokenizer has {tok.get_vocab_size()} ids, the fixtures need exactly {VOCAB_SIZE}: "
            "the training corpus is too small"
        )
    for expected_id, token in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(token) != expected_id:
            raise RuntimeError(f"special token {token} is not id {expected_id}")
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "pad_token": SPECIAL_TOKENS[PAD_ID],
        "model_max_length": MAX_POSITIONS,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    specials = {k: config[k] for k in ("bos_token", "eos_token", "pad_token")}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
    return VOCAB_SIZE


# ---------------------------------------------------------------- weights


def _successor(gen: torch.Generator) -> list[int | None]:
    """Designed next token per token id; None for special tokens (never predicted)."""
    ordinary = list(range(len(SPECIAL_TOKENS), VOCAB_SIZE))
    while True:
        perm = torch.randperm(len(ordinary), generator=gen).tolist()
        succ = {ordinary[i]: ordinary[p] for i, p in enumerate(perm)}
        # No fixed points and no 2-cycles: then successor(t) != t and successor^2(t) != t,
        # which keeps the designed draft's second token wrong (accept length exactly 2).
        if all(succ[t] != t and succ[succ[t]] != t for t in ordinary):
            break
    return [None] * len(SPECIAL_TOKENS) + [succ[t] for t in ordinary]


def _predecessor(successor: list[int | None]) -> list[int | None]:
    """Inverse of the successor map; None for special tokens."""
    pred: list[int | None] = [None] * len(successor)
    for src, dst in enumerate(successor):
        if dst is not None:
            pred[dst] = src
    return pred


class _Init:
    """Seeded bf16 tensors; float32 math first so the values do not depend on the dtype."""

    def __init__(self, gen: torch.Generator) -> None:
        self.gen = gen

    def normal(self, *shape: int, std: float = WEIGHT_STD) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.gen) * std).to(torch.bfloat16)

    @staticmethod
    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)


def _designed_head(embed: torch.Tensor, source_of: list[int | None]) -> torch.Tensor:
    """LM head whose row ``r`` is the embedding of ``source_of[r]``, scaled to DESIGNED_LOGIT.

    A final RMSNorm makes the hidden state ~ embedding / rms(embedding), so the dot product
    with its own embedding is ~hidden * EMBED_STD; the scale turns that into DESIGNED_LOGIT.
    Rows with no source (special tokens) are zero, so those tokens are never the argmax.
    """
    scale = DESIGNED_LOGIT / (HIDDEN * EMBED_STD)
    index = torch.tensor([-1 if s is None else s for s in source_of])
    rows = embed.float()[index.clamp(min=0)] * scale
    rows[index < 0] = 0.0
    return rows.to(torch.bfloat16)


def _llama_mlp(init: _Init, prefix: str, hidden: int, inter: int) -> dict[str, torch.Tensor]:
    return {
        f"{prefix}.gate_proj.weight": init.normal(inter, hidden),
        f"{prefix}.up_proj.weight": init.normal(inter, hidden),
        f"{prefix}.down_proj.weight": init.normal(hidden, inter),
    }


def _common_config(vocab: int) -> dict:
    return {
        "vocab_size": vocab,
        "hidden_size": HIDDEN,
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": RMS_EPS,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "initializer_range": WEIGHT_STD,
        "attention_bias": False,
        "use_cache": True,
    }


def llama_target(init: _Init, successor: list[int | None]) -> tuple[dict, dict[str, torch.Tensor]]:
    """Config and weights of the tiny LlamaForCausalLM target."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **_common_config(VOCAB_SIZE),
        "intermediate_size": DENSE_INTERMEDIATE,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_HEADS,
        "head_dim": HEAD_DIM,
        "mlp_bias": False,
    }
    embed = init.normal(VOCAB_SIZE, HIDDEN, std=EMBED_STD)
    weights = {"model.embed_tokens.weight": embed}
    qkv = NUM_HEADS * HEAD_DIM
    for i in range(NUM_LAYERS):
        p = f"model.layers.{i}"
        weights.update(
            {
                f"{p}.self_attn.q_proj.weight": init.normal(qkv, HIDDEN),
                f"{p}.self_attn.k_proj.weight": init.normal(qkv, HIDDEN),
                f"{p}.self_attn.v_proj.weight": init.normal(qkv, HIDDEN),
                f"{p}.self_attn.o_proj.weight": init.normal(HIDDEN, qkv),
                f"{p}.input_layernorm.weight": init.ones(HIDDEN),
                f"{p}.post_attention_layernorm.weight": init.ones(HIDDEN),
                **_llama_mlp(init, f"{p}.mlp", HIDDEN, DENSE_INTERMEDIATE),
            }
        )
    weights["model.norm.weight"] = init.ones(HIDDEN)
    weights["lm_head.weight"] = _designed_head(embed, _predecessor(successor))
    return config, weights


def deepseek_v3_target(
    init: _Init, successor: list[int | None]
) -> tuple[dict, dict[str, torch.Tensor]]:
    """Config and weights of the tiny DeepseekV3ForCausalLM target (MLA + MoE)."""
    mla, moe = DEEPSEEK_MLA, DEEPSEEK_MOE
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        **_common_config(VOCAB_SIZE),
        "intermediate_size": DENSE_INTERMEDIATE,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_HEADS,
        **mla,
        **moe,
        "moe_layer_freq": 1,
        "n_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 1.0,
        "num_nextn_predict_layers": 0,
        "num_mtp_layers": 0,
        "ep_size": 1,
        "rope_interleave": True,
    }
    embed = init.normal(VOCAB_SIZE, HIDDEN, std=EMBED_STD)
    weights = {"model.embed_tokens.weight": embed}
    qk_head = mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"]
    kv_b_out = NUM_HEADS * (mla["qk_nope_head_dim"] + mla["v_head_dim"])
    for i in range(NUM_LAYERS):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        weights.update(
            {
                f"{a}.q_a_proj.weight": init.normal(mla["q_lora_rank"], HIDDEN),
                f"{a}.q_a_layernorm.weight": init.ones(mla["q_lora_rank"]),
                f"{a}.q_b_proj.weight": init.normal(NUM_HEADS * qk_head, mla["q_lora_rank"]),
                f"{a}.kv_a_proj_with_mqa.weight": init.normal(
                    mla["kv_lora_rank"] + mla["qk_rope_head_dim"], HIDDEN
                ),
                f"{a}.kv_a_layernorm.weight": init.ones(mla["kv_lora_rank"]),
                f"{a}.kv_b_proj.weight": init.normal(kv_b_out, mla["kv_lora_rank"]),
                f"{a}.o_proj.weight": init.normal(HIDDEN, NUM_HEADS * mla["v_head_dim"]),
                f"{p}.input_layernorm.weight": init.ones(HIDDEN),
                f"{p}.post_attention_layernorm.weight": init.ones(HIDDEN),
            }
        )
        if i < moe["first_k_dense_replace"]:
            weights.update(_llama_mlp(init, f"{p}.mlp", HIDDEN, DENSE_INTERMEDIATE))
            continue
        inter = moe["moe_intermediate_size"]
        weights[f"{p}.mlp.gate.weight"] = init.normal(moe["n_routed_experts"], HIDDEN)
        # DeepSeek-V3 checkpoints keep the routing bias in float32.
        weights[f"{p}.mlp.gate.e_score_correction_bias"] = torch.zeros(
            moe["n_routed_experts"], dtype=torch.float32
        )
        for e in range(moe["n_routed_experts"]):
            weights.update(_llama_mlp(init, f"{p}.mlp.experts.{e}", HIDDEN, inter))
        shared = inter * moe["n_shared_experts"]
        weights.update(_llama_mlp(init, f"{p}.mlp.shared_experts", HIDDEN, shared))
    weights["model.norm.weight"] = init.ones(HIDDEN)
    weights["lm_head.weight"] = _designed_head(embed, _predecessor(successor))
    return config, weights


def eagle3_draft(
    init: _Init, target_embed: torch.Tensor, successor: list[int | None]
) -> tuple[dict, dict[str, torch.Tensor]]:
    """An EAGLE-3 draft (one Llama layer) whose first proposal is the target's next token.

    The draft's residual stream starts as ``fc(aux hidden states)``; ``fc`` averages the three
    aux states, which carry the embedding of the token at that position, t. Its input token is
    successor[t], so the right proposal is successor[successor[t]]: the head row of that token
    is t's embedding. The embedding itself is shared with the target at load time (SGLang's
    ``set_embed``), so the draft stores none.
    """
    vocab = VOCAB_SIZE
    qkv = NUM_HEADS * HEAD_DIM
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        **_common_config(vocab),
        "draft_vocab_size": vocab,
        "intermediate_size": DENSE_INTERMEDIATE,
        "num_hidden_layers": 1,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_HEADS,
        "head_dim": HEAD_DIM,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(AUX_LAYER_IDS),
            "use_aux_hidden_state": True,
        },
    }
    n_aux = len(AUX_LAYER_IDS)
    fc = torch.cat([torch.eye(HIDDEN) / n_aux] * n_aux, dim=1).to(torch.bfloat16)
    weights = {
        "fc.weight": fc,
        "midlayer.hidden_norm.weight": init.ones(HIDDEN),
        "midlayer.input_layernorm.weight": init.ones(HIDDEN),
        "midlayer.post_attention_layernorm.weight": init.ones(HIDDEN),
        "midlayer.self_attn.q_proj.weight": init.normal(qkv, 2 * HIDDEN),
        "midlayer.self_attn.k_proj.weight": init.normal(qkv, 2 * HIDDEN),
        "midlayer.self_attn.v_proj.weight": init.normal(qkv, 2 * HIDDEN),
        "midlayer.self_attn.o_proj.weight": init.normal(HIDDEN, qkv),
        **_llama_mlp(init, "midlayer.mlp", HIDDEN, DENSE_INTERMEDIATE),
        "norm.weight": init.ones(HIDDEN),
    }
    # Draft id d stands for target id hot[d] = d + d2t[d]; a shuffled map exercises it.
    hot = torch.randperm(vocab, generator=init.gen)
    pred = _predecessor(successor)
    two_back = [None if p is None else pred[p] for p in pred]
    weights["lm_head.weight"] = _designed_head(target_embed, [two_back[t] for t in hot.tolist()])
    weights["d2t"] = hot - torch.arange(vocab)
    weights["t2d"] = torch.ones(vocab, dtype=torch.bool)
    return config, weights


# ---------------------------------------------------------------- writing


def _write_model(
    out: Path, config: dict, weights: dict[str, torch.Tensor], tokenizer_dir: Path
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(
        {k: v.contiguous() for k, v in weights.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    generation = {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def build_all(out: Path, seed: int = 0) -> dict[str, TinyPair]:
    """Generate both tiny pairs under ``out``; returns arch name -> TinyPair."""
    out = Path(out)
    tokenizer_dir = out / "tokenizer"
    train_tokenizer(tokenizer_dir, seed)
    pairs = {}
    builders = {"llama": llama_target, "deepseek_v3": deepseek_v3_target}
    for offset, (arch, build_target) in enumerate(builders.items()):
        gen = torch.Generator().manual_seed(seed * 1000 + offset)
        init = _Init(gen)
        successor = _successor(gen)
        config, weights = build_target(init, successor)
        target_dir = out / f"{arch}-target"
        _write_model(target_dir, config, weights, tokenizer_dir)
        manifest = {
            "successor": successor,
            "designed_accept_length": DESIGNED_ACCEPT_LENGTH,
            "min_accept_length": MIN_ACCEPT_LENGTH,
            "aux_layer_ids": list(AUX_LAYER_IDS),
            "note": "greedy next token of the target is successor[current token]",
        }
        (target_dir / FIXTURE_FILE).write_text(json.dumps(manifest) + "\n")
        d_config, d_weights = eagle3_draft(init, weights["model.embed_tokens.weight"], successor)
        draft_dir = out / f"{arch}-eagle3"
        _write_model(draft_dir, d_config, d_weights, tokenizer_dir)
        pairs[arch] = TinyPair(arch, target_dir, draft_dir)
    return pairs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="folder to write the models into")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    pairs = build_all(args.out, args.seed)
    paths = {a: {"target": str(p.target), "draft": str(p.draft)} for a, p in pairs.items()}
    print(json.dumps(paths, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
