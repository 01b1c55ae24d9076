"""EAGLE-3 verify step of a DeepSeek-V3 / Kimi-K2.5-shaped model: how much is all-reduce?

Per rank, the stack the target runs in one verify pass: 61 layers, hidden 7168, MLA attention in
its absorbed decode form over a KV cache, a dense MLP (first layers) or MoE (shared expert plus
the routed experts that ``bs x draft tokens`` rows touch), tensor-parallel GEMM shapes for tp N,
and two all-reduce + residual add + RMSNorm points per layer; the whole pass is one CUDA graph.
The same stack at ``bs`` rows is plain decoding; one Llama layer plus the draft LM head is an
EAGLE-3 draft step. No sglang needed.

Backends for the all-reduce points:

- ``compute only``: no communication (what tp 1 is, and the floor at any tp);
- ``nccl + norm``: ``torch.distributed`` all-reduce then add + RMSNorm, captured in the graph;
  real ranks only: ``torchrun --nproc-per-node N`` (NCCL needs one GPU per rank);
- ``sm120 fused`` / ``sm120 all-reduce + norm``: ``sgl_kernel_sm120`` when importable, ranks
  emulated in this process on one GPU (each on its own stream): kernel overhead with N ranks
  sharing one GPU, NOT interconnect time; its per-point cost replaces add + RMSNorm;
- ``modelled``: per-point latency from ``--allreduce-us`` or a bench_allreduce JSON
  (``--allreduce-json``), and at tp 8 the figures reported for 8x RTX PRO 6000 (UPSTREAM.md):
  NCCL on an untuned host, staged PCIe (FlashInfer PCIe-IPC). Labelled as modelled.

Break-even: EAGLE-3 emits ``accept length`` tokens per cycle of ``draft + verify`` time, plain
decoding one token per ``decode`` time, so speculation wins above
``accept* = (draft_ms + verify_ms) / decode_ms`` and runs at ``bs * accept / (draft + verify)``
tokens/s. Give measured numbers directly with ``--verify-ms/--decode-ms/--draft-ms``.

Examples::

    python benchmark/bench_verify_step.py --smoke                       # CPU, tiny, seconds
    python benchmark/bench_verify_step.py --tp 1,2,4,8 --allreduce-us 205
    torchrun --nproc-per-node 8 benchmark/bench_verify_step.py          # real NCCL
    python benchmark/bench_verify_step.py --verify-ms 30 --decode-ms 12.2 --draft-ms 0
"""

from __future__ import annotations

import os

# Emulated ranks share this process: a lazily loaded kernel would wait for the spinning ranks.
os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")

import argparse
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # the benchmark folder is not a package
    DEFAULT_OUT_DIR,
    LatencyPoint,
    LatencyTable,
    format_table,
    latency_us,
    load_allreduce_records,
    save_png,
    write_json,
)

RMS_EPS = 1e-6
ELEMENT_BYTES = 2  # bf16 activations


# ---------------------------------------------------------------- shapes


@dataclass(frozen=True)
class ModelShape:
    """Target and EAGLE-3 draft dimensions (whole model; per-rank shapes derive from tp)."""

    name: str
    layers: int
    hidden: int
    heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    dense_layers: int
    dense_intermediate: int
    routed_experts: int
    experts_per_token: int
    moe_intermediate: int
    shared_experts: int
    vocab: int
    draft_heads: int
    draft_kv_heads: int
    draft_head_dim: int
    draft_intermediate: int
    draft_vocab: int

    @property
    def allreduce_points(self) -> int:
        """After attention and after the MLP/MoE, in every layer."""
        return 2 * self.layers


PRESETS = {
    "deepseek-v3": ModelShape(
        name="deepseek-v3", layers=61, hidden=7168, heads=128,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, dense_layers=3, dense_intermediate=18432, routed_experts=256,
        experts_per_token=8, moe_intermediate=2048, shared_experts=1, vocab=129280,
        draft_heads=64, draft_kv_heads=8, draft_head_dim=128, draft_intermediate=18432,
        draft_vocab=32000,
    ),
    # Kimi-K2/K2.5 text model: DeepSeek-V3 architecture with 64 heads, 384 experts, 1 dense layer.
    "kimi-k2.5": ModelShape(
        name="kimi-k2.5", layers=61, hidden=7168, heads=64,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, dense_layers=1, dense_intermediate=18432, routed_experts=384,
        experts_per_token=8, moe_intermediate=2048, shared_experts=1, vocab=163840,
        draft_heads=64, draft_kv_heads=8, draft_head_dim=128, draft_intermediate=18432,
        draft_vocab=32000,
    ),
    # For --smoke: every dimension divides by tp 8.
    "tiny": ModelShape(
        name="tiny", layers=2, hidden=256, heads=8,
        q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, dense_layers=1, dense_intermediate=512, routed_experts=8,
        experts_per_token=2, moe_intermediate=64, shared_experts=1, vocab=1024,
        draft_heads=8, draft_kv_heads=8, draft_head_dim=32, draft_intermediate=512,
        draft_vocab=512,
    ),
}  # fmt: skip
# The draft shape (one Llama layer: 64 heads, 8 KV heads, intermediate 18432, 32k draft vocab)
# is an assumption for the public Kimi/DeepSeek EAGLE-3 drafts; override with --draft-ms.

# Per-point all-reduce latency reported for 8x RTX PRO 6000 over PCIe (UPSTREAM.md section 1).
KIB = 1024
REPORTED_8GPU = {
    "nccl, untuned host (reported)": [LatencyPoint(12 * KIB, 205.0), LatencyPoint(96 * KIB, 585.0)],
    "staged PCIe push (reported)": [
        LatencyPoint(12 * KIB, 5.3),
        LatencyPoint(96 * KIB, 15.3),
        LatencyPoint(384 * KIB, 34.6),
    ],
}


@dataclass(frozen=True)
class Workload:
    """Rows and context of one measurement."""

    bs: int
    draft_tokens: int
    steps: int
    topk: int
    ctx: int

    @property
    def verify_rows(self) -> int:
        return self.bs * self.draft_tokens

    @property
    def draft_rows(self) -> int:
        return self.bs * self.topk


def expected_active_experts(rows: int, experts: int, per_token: int) -> int:
    """Distinct experts that ``rows`` tokens touch with uniform random routing (expectation)."""
    untouched = (1.0 - per_token / experts) ** rows
    return max(per_token, min(experts, round(experts * (1.0 - untouched))))


def rank_dim(total: int, tp: int, what: str) -> int:
    if total % tp:
        raise ValueError(f"{what}={total} does not divide by tp={tp}")
    return total // tp


# ---------------------------------------------------------------- fused add + RMSNorm


def add_rmsnorm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor
) -> torch.Tensor:
    """residual += x; return RMSNorm(residual) * weight (SGLang's fused_add_rmsnorm contract)."""
    residual.add_(x)
    r = residual.float()
    normed = r * torch.rsqrt(r.pow(2).mean(dim=-1, keepdim=True) + RMS_EPS)
    return normed.to(x.dtype) * weight


def _make_triton_add_rmsnorm() -> Callable | None:
    """A one-kernel add + RMSNorm (what SGLang runs after NCCL); None without triton."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def _kernel(x_ptr, res_ptr, w_ptr, out_ptr, n_cols, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < n_cols
        base = row * n_cols
        x = tl.load(x_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(res_ptr + base + offs, mask=mask, other=0.0).to(tl.float32)
        s = x + r
        tl.store(res_ptr + base + offs, s.to(res_ptr.dtype.element_ty), mask=mask)
        var = tl.sum(s * s, axis=0) / n_cols
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = s * tl.rsqrt(var + eps) * w
        tl.store(out_ptr + base + offs, y.to(out_ptr.dtype.element_ty), mask=mask)

    def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        rows, cols = x.shape
        block = triton.next_power_of_2(cols)
        _kernel[(rows,)](x, residual, weight, out, cols, RMS_EPS, BLOCK=block, num_warps=8)
        return out

    return add_rmsnorm


def pick_add_rmsnorm(device: torch.device) -> tuple[Callable, str]:
    """The add + RMSNorm used at every point: Triton on CUDA (checked once), else torch ops."""
    if device.type != "cuda":
        return add_rmsnorm_torch, "torch ops (CPU)"
    kernel = _make_triton_add_rmsnorm()
    if kernel is None:
        return add_rmsnorm_torch, "torch ops (triton not importable)"
    try:
        x = torch.randn(3, 7168, device=device, dtype=torch.bfloat16)
        r1 = torch.randn_like(x)
        r2 = r1.clone()
        w = torch.rand(7168, device=device, dtype=torch.bfloat16)
        got, want = kernel(x, r1, w), add_rmsnorm_torch(x, r2, w)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(r1.float(), r2.float(), rtol=2e-2, atol=2e-2)
    except Exception as exc:  # a broken kernel must not cost the whole run
        return add_rmsnorm_torch, f"torch ops (triton kernel failed: {exc})"
    return kernel, "one triton kernel"


# ---------------------------------------------------------------- the stack


class Comm:
    """How an all-reduce + residual add + RMSNorm point runs inside the stack."""

    name = "compute only"

    def __init__(self, add_rmsnorm: Callable) -> None:
        self.add_rmsnorm = add_rmsnorm

    def all_reduce(self, x: torch.Tensor) -> None:
        """In place; nothing when there is no communication."""

    def point(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        self.all_reduce(x)
        return self.add_rmsnorm(x, residual, weight)


class DistComm(Comm):
    """torch.distributed all-reduce (NCCL on GPUs, gloo for the CPU smoke run) then the norm."""

    def __init__(self, add_rmsnorm: Callable, backend: str) -> None:
        super().__init__(add_rmsnorm)
        self.name = f"{backend} + norm"

    def all_reduce(self, x: torch.Tensor) -> None:
        torch.distributed.all_reduce(x)


@dataclass
class LayerSet:
    """Weights and KV cache of one layer (reused for several layers to bound memory)."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    moe: bool = False


class VerifyStack:
    """One rank's share of the target model at tp, for verify (bs x draft) or decode (bs) rows."""

    def __init__(
        self,
        shape: ModelShape,
        tp: int,
        work: Workload,
        device: torch.device,
        budget_bytes: float,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        self.shape, self.tp, self.work, self.device, self.dtype = shape, tp, work, device, dtype
        s = shape
        self.heads = rank_dim(s.heads, tp, "heads")
        self.dense_inter = rank_dim(s.dense_intermediate, tp, "dense_intermediate")
        self.moe_inter = rank_dim(s.moe_intermediate, tp, "moe_intermediate")
        self.vocab = math.ceil(s.vocab / tp)
        self.max_experts = expected_active_experts(
            work.verify_rows, s.routed_experts, s.experts_per_token
        )
        self.kv_dim = s.kv_lora_rank + s.qk_rope_head_dim
        dense_bytes = self._set_bytes(moe=False)
        moe_bytes = self._set_bytes(moe=True)
        n_moe = s.layers - s.dense_layers
        self.n_dense_sets = max(1, min(s.dense_layers, int(budget_bytes * 0.2 // dense_bytes)))
        self.n_moe_sets = max(1, min(n_moe, int(budget_bytes * 0.8 // moe_bytes))) if n_moe else 0
        self.dense_sets = [self._make_set(moe=False) for _ in range(self.n_dense_sets)]
        self.moe_sets = [self._make_set(moe=True) for _ in range(self.n_moe_sets)]
        self.set_bytes = {"dense": dense_bytes, "moe": moe_bytes}
        self.norm_w = torch.ones(s.hidden, device=device, dtype=dtype)
        self.lora_w = torch.ones(s.q_lora_rank, device=device, dtype=dtype)
        self.lm_head = self._rand(s.hidden, self.vocab)

    def _rand(self, *shape: int) -> torch.Tensor:
        return torch.empty(*shape, device=self.device, dtype=self.dtype).normal_(0.0, 0.02)

    def _set_bytes(self, moe: bool) -> int:
        s, h = self.shape, self.heads
        attn = (
            s.hidden * s.q_lora_rank
            + s.q_lora_rank * h * (s.qk_nope_head_dim + s.qk_rope_head_dim)
            + s.hidden * self.kv_dim
            + h * s.qk_nope_head_dim * s.kv_lora_rank
            + h * s.kv_lora_rank * s.v_head_dim
            + h * s.v_head_dim * s.hidden
            + self.work.bs * self.work.ctx * self.kv_dim
        )
        if moe:
            shared = s.shared_experts * self.moe_inter
            mlp = s.hidden * s.routed_experts + 3 * s.hidden * shared
            mlp += self.max_experts * 3 * s.hidden * self.moe_inter
        else:
            mlp = 3 * s.hidden * self.dense_inter
        return (attn + mlp) * ELEMENT_BYTES

    def _make_set(self, moe: bool) -> LayerSet:
        s, h = self.shape, self.heads
        t = {
            "w_qa": self._rand(s.hidden, s.q_lora_rank),
            "w_qb": self._rand(s.q_lora_rank, h * (s.qk_nope_head_dim + s.qk_rope_head_dim)),
            "w_kva": self._rand(s.hidden, self.kv_dim),
            "w_uk": self._rand(h, s.qk_nope_head_dim, s.kv_lora_rank),
            "w_uv": self._rand(h, s.kv_lora_rank, s.v_head_dim),
            "w_o": self._rand(h * s.v_head_dim, s.hidden),
            "cache": self._rand(self.work.bs, self.work.ctx, self.kv_dim),
        }
        if moe:
            shared = s.shared_experts * self.moe_inter
            t["w_router"] = self._rand(s.hidden, s.routed_experts)
            t["w13"] = self._rand(self.max_experts, s.hidden, 2 * self.moe_inter)
            t["w2"] = self._rand(self.max_experts, self.moe_inter, s.hidden)
            t["ws13"] = self._rand(s.hidden, 2 * shared)
            t["ws2"] = self._rand(shared, s.hidden)
        else:
            t["w13"] = self._rand(s.hidden, 2 * self.dense_inter)
            t["w2"] = self._rand(self.dense_inter, s.hidden)
        return LayerSet(t, moe)

    def total_bytes(self) -> int:
        return self.n_dense_sets * self.set_bytes["dense"] + self.n_moe_sets * self.set_bytes["moe"]

    def layer_set(self, i: int) -> LayerSet:
        if i < self.shape.dense_layers:
            return self.dense_sets[i % self.n_dense_sets]
        return self.moe_sets[(i - self.shape.dense_layers) % self.n_moe_sets]

    def routing(self, rows: int) -> tuple[int, torch.Tensor]:
        """Static routing (fixed shapes for the graph): active experts and their token rows."""
        s = self.shape
        active = expected_active_experts(rows, s.routed_experts, s.experts_per_token)
        slots = math.ceil(rows * s.experts_per_token / active)
        index = torch.arange(active * slots, device=self.device) % rows
        return active, index.view(active, slots)

    def attention(self, t: dict[str, torch.Tensor], x: torch.Tensor, per_seq: int) -> torch.Tensor:
        """MLA, absorbed form (how decode and verify run it): scores in the 576-d latent space."""
        s, h, bs = self.shape, self.heads, self.work.bs
        rows = x.shape[0]
        q_lat = add_rmsnorm_free(x @ t["w_qa"], self.lora_w)
        q = (q_lat @ t["w_qb"]).view(rows, h, s.qk_nope_head_dim + s.qk_rope_head_dim)
        q_nope, q_pe = q.split([s.qk_nope_head_dim, s.qk_rope_head_dim], dim=-1)
        kv = x @ t["w_kva"]
        t["cache"][:, -per_seq:, :].copy_(kv.view(bs, per_seq, self.kv_dim))
        q_abs = torch.bmm(q_nope.transpose(0, 1), t["w_uk"])  # [h, rows, kv_lora]
        q_full = torch.cat([q_abs, q_pe.transpose(0, 1)], dim=-1)
        q_seq = q_full.view(h, bs, per_seq, self.kv_dim).permute(1, 0, 2, 3)
        q_seq = q_seq.reshape(bs, h * per_seq, self.kv_dim)
        scores = torch.bmm(q_seq, t["cache"].transpose(1, 2)) * self.kv_dim**-0.5
        probs = torch.softmax(scores.float(), dim=-1).to(x.dtype)
        o_lat = torch.bmm(probs, t["cache"][..., : s.kv_lora_rank])  # [bs, h*per_seq, kv_lora]
        o_lat = o_lat.view(bs, h, per_seq, s.kv_lora_rank).permute(1, 0, 2, 3)
        o = torch.bmm(o_lat.reshape(h, rows, s.kv_lora_rank), t["w_uv"])  # [h, rows, v]
        return o.transpose(0, 1).reshape(rows, h * s.v_head_dim) @ t["w_o"]

    def mlp(
        self, layer: LayerSet, x: torch.Tensor, route: tuple[int, torch.Tensor]
    ) -> torch.Tensor:
        t = layer.tensors
        if not layer.moe:
            return silu_mul(x @ t["w13"]) @ t["w2"]
        active, index = route
        torch.topk(x @ t["w_router"], self.shape.experts_per_token, dim=-1)  # routing cost
        gathered = x[index]  # [active, slots, hidden]
        up = torch.bmm(gathered, t["w13"][:active])
        down = torch.bmm(silu_mul(up), t["w2"][:active])
        routed = torch.zeros_like(x).index_add_(0, index.flatten(), down.flatten(0, 1))
        return routed + silu_mul(x @ t["ws13"]) @ t["ws2"]

    def build_pass(self, comm: Comm, per_seq: int) -> tuple[Callable[[], torch.Tensor], int]:
        """A closure running one pass on static inputs; returns it and its row count."""
        rows = self.work.bs * per_seq
        x0 = self._rand(rows, self.shape.hidden)
        residual = torch.zeros_like(x0)
        route = self.routing(rows)

        def one_pass() -> torch.Tensor:
            residual.zero_()
            hidden = comm.add_rmsnorm(x0, residual, self.norm_w)
            for i in range(self.shape.layers):
                layer = self.layer_set(i)
                partial = self.attention(layer.tensors, hidden, per_seq)
                hidden = comm.point(partial, residual, self.norm_w)
                partial = self.mlp(layer, hidden, route)
                hidden = comm.point(partial, residual, self.norm_w)
            return hidden @ self.lm_head  # this rank's vocab shard (gather not modelled)

        return one_pass, rows


def add_rmsnorm_free(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """RMSNorm without residual (MLA's q_a and kv_a norms)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + RMS_EPS)).to(x.dtype) * weight


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


class DraftStep:
    """One EAGLE-3 draft forward per rank: fc, one Llama layer (input 2 x hidden), LM head."""

    def __init__(self, shape: ModelShape, tp: int, work: Workload, device: torch.device) -> None:
        s = shape
        self.shape, self.work, self.device = s, work, device
        self.heads = rank_dim(s.draft_heads, tp, "draft_heads")
        self.kv_heads = max(1, s.draft_kv_heads // tp)  # replicated when tp > KV heads
        self.inter = rank_dim(s.draft_intermediate, tp, "draft_intermediate")
        hd = s.draft_head_dim
        rand = lambda *d: torch.empty(*d, device=device, dtype=torch.bfloat16).normal_(0, 0.02)  # noqa: E731
        self.fc = rand(3 * s.hidden, s.hidden)
        self.qkv = rand(2 * s.hidden, (self.heads + 2 * self.kv_heads) * hd)
        self.o = rand(self.heads * hd, s.hidden)
        self.w13 = rand(s.hidden, 2 * self.inter)
        self.w2 = rand(self.inter, s.hidden)
        self.lm_head = rand(s.hidden, math.ceil(s.draft_vocab / tp))
        self.k_cache = rand(work.bs, self.kv_heads, work.ctx, hd)
        self.v_cache = rand(work.bs, self.kv_heads, work.ctx, hd)
        self.norm_w = torch.ones(s.hidden, device=device, dtype=torch.bfloat16)

    def build_pass(self, comm: Comm, rows: int) -> Callable[[], torch.Tensor]:
        s, bs, hd = self.shape, self.work.bs, self.shape.draft_head_dim
        per_seq = rows // bs
        aux = torch.empty(rows, 3 * s.hidden, device=self.device, dtype=torch.bfloat16).normal_()
        embeds = torch.empty(rows, s.hidden, device=self.device, dtype=torch.bfloat16).normal_()
        residual = torch.empty_like(embeds)
        group = self.heads // self.kv_heads

        def one_pass() -> torch.Tensor:
            hidden = aux @ self.fc
            residual.copy_(hidden)
            x = torch.cat(
                [add_rmsnorm_free(embeds, self.norm_w), add_rmsnorm_free(hidden, self.norm_w)],
                dim=-1,
            )
            qkv = x @ self.qkv
            q, k, v = qkv.split([self.heads * hd, self.kv_heads * hd, self.kv_heads * hd], -1)
            q = q.view(bs, per_seq, self.kv_heads, group, hd).permute(0, 2, 3, 1, 4)
            q = q.reshape(bs, self.kv_heads, group * per_seq, hd)
            self.k_cache[:, :, -per_seq:, :].copy_(
                k.view(bs, per_seq, self.kv_heads, hd).transpose(1, 2)
            )
            self.v_cache[:, :, -per_seq:, :].copy_(
                v.view(bs, per_seq, self.kv_heads, hd).transpose(1, 2)
            )
            scores = torch.matmul(q, self.k_cache.transpose(-1, -2)) * hd**-0.5
            attn = torch.matmul(torch.softmax(scores.float(), -1).to(q.dtype), self.v_cache)
            attn = attn.view(bs, self.kv_heads, group, per_seq, hd).permute(0, 3, 1, 2, 4)
            partial = attn.reshape(rows, self.heads * hd) @ self.o
            hidden = comm.point(partial, residual, self.norm_w)
            partial = silu_mul(hidden @ self.w13) @ self.w2
            hidden = comm.point(partial, residual, self.norm_w)
            logits = hidden @ self.lm_head
            return torch.topk(logits, self.work.topk, dim=-1).indices

        return one_pass


# ---------------------------------------------------------------- timing


@dataclass(frozen=True)
class Timer:
    """How passes are timed: CUDA graph replays (eager on CPU or when asked)."""

    device: torch.device
    iters: int
    warmup: int
    use_graph: bool

    def ms(self, fn: Callable[[], Any], label: str, notes: list[str]) -> float:
        if self.device.type != "cuda":
            for _ in range(self.warmup):
                fn()
            start = time.perf_counter()
            for _ in range(self.iters):
                fn()
            return (time.perf_counter() - start) * 1e3 / self.iters
        run = fn
        if self.use_graph:
            try:
                run = self._capture(fn)
            except Exception as exc:
                notes.append(f"{label}: CUDA graph capture failed ({exc}); timed eagerly")
                torch.cuda.synchronize(self.device)
        for _ in range(self.warmup):
            run()
        barrier()
        torch.cuda.synchronize(self.device)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(self.iters):
            run()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / self.iters

    def _capture(self, fn: Callable[[], Any]) -> Callable[[], None]:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # allocator and library warm-up outside the graph
                fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        barrier()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay


def barrier() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()


# ---------------------------------------------------------------- results


@dataclass
class Row:
    """One backend at one tp: pass times (ms) and what all-reduce costs in the verify pass."""

    tp: int
    backend: str
    source: str
    verify_ms: float
    decode_ms: float
    draft_ms: float
    allreduce_ms: float
    per_point_us: float | None

    @property
    def share(self) -> float:
        return self.allreduce_ms / self.verify_ms if self.verify_ms > 0 else 0.0


def break_even_accept(verify_ms: float, draft_ms: float, decode_ms: float) -> float:
    """Accept length above which EAGLE-3 (draft + verify per cycle) beats plain decoding."""
    if decode_ms <= 0:
        raise ValueError(f"decode time must be positive, got {decode_ms} ms")
    return (verify_ms + draft_ms) / decode_ms


def spec_tokens_per_s(accept: float, verify_ms: float, draft_ms: float, bs: int = 1) -> float:
    """Output tokens/s of EAGLE-3 at an accept length (tokens per verify, bonus included)."""
    cycle = verify_ms + draft_ms
    if cycle <= 0:
        raise ValueError(f"draft + verify time must be positive, got {cycle} ms")
    return 1e3 * bs * accept / cycle


def plain_tokens_per_s(decode_ms: float, bs: int = 1) -> float:
    return 1e3 * bs / decode_ms


@dataclass
class Measured:
    """Compute-only times at one tp and the per-point norm cost at each row count."""

    tp: int
    verify_ms: float
    decode_ms: float
    draft_step_ms: float
    extend_ms: float
    norm_us: dict[str, float]

    def draft_cycle_ms(self, steps: int) -> float:
        return steps * self.draft_step_ms + self.extend_ms


def rows_of(work: Workload) -> dict[str, int]:
    return {"verify": work.verify_rows, "decode": work.bs, "draft": work.draft_rows}


def modelled_row(
    m: Measured,
    shape: ModelShape,
    work: Workload,
    name: str,
    source: str,
    point_us: Callable[[int], float],
    replaces_norm: bool = False,
) -> Row:
    """Compute-only times plus ``points x point_us(message bytes)`` for each pass.

    ``replaces_norm``: the point cost includes the add + RMSNorm (a fused kernel), so the
    measured norm is taken out first.
    """
    rows = rows_of(work)
    extra = {}
    for kind, n in rows.items():
        cost = point_us(n * shape.hidden * ELEMENT_BYTES)
        extra[kind] = cost - (m.norm_us[kind] if replaces_norm else 0.0)
    p = shape.allreduce_points
    verify = m.verify_ms + p * extra["verify"] / 1e3
    decode = m.decode_ms + p * extra["decode"] / 1e3
    draft = m.draft_cycle_ms(work.steps) + 2 * (work.steps * extra["draft"] + extra["verify"]) / 1e3
    per_point = point_us(rows["verify"] * shape.hidden * ELEMENT_BYTES)
    allreduce = p * (per_point - (m.norm_us["verify"] if replaces_norm else 0.0)) / 1e3
    return Row(m.tp, name, source, verify, decode, draft, max(allreduce, 0.0), per_point)


# ---------------------------------------------------------------- sgl_kernel_sm120 (emulated)


def import_kernel_package() -> Any:
    """sgl_kernel_sm120, installed or from this checkout's sources (library found by the
    package itself, or via $SGLANG_SM120_KERNEL_LIBRARY); raises when its library cannot load."""
    try:
        import sgl_kernel_sm120 as sk
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "sgl-kernel-sm120" / "python"))
        import sgl_kernel_sm120 as sk
    from sgl_kernel_sm120 import _lib

    _lib.lib()  # the library loads lazily; fail here, with its reason, not mid-measurement
    return sk


def emulated_point_us(
    world: int,
    rows: int,
    hidden: int,
    points: int,
    timer: Timer,
    fused: bool,
    add_rmsnorm: Callable,
    notes: list[str],
) -> float:
    """Per-point cost of sgl_kernel_sm120 with ``world`` ranks emulated on this GPU.

    Each rank runs ``points`` back-to-back calls on its own stream (they wait for each other
    inside the kernel); one CUDA graph holds all ranks. Not fused: all-reduce then the norm.
    """
    sk = import_kernel_package()
    from sgl_kernel_sm120.testing import LocalRanks

    dev = timer.device
    wss = sk.CommWorkspace.create_local(world, max_tokens=rows, hidden=hidden, device=dev)
    ranks = LocalRanks(wss)
    try:
        xs = [torch.randn(rows, hidden, device=dev, dtype=torch.bfloat16) for _ in range(world)]
        res = [torch.randn_like(xs[0]) for _ in range(world)]
        weight = torch.ones(hidden, device=dev, dtype=torch.bfloat16)

        def per_rank(rank: int, ws: Any) -> torch.Tensor:
            residual = res[rank]
            out = xs[rank]
            for _ in range(points):
                if fused:
                    out, residual = sk.fused_allreduce_add_rmsnorm(
                        xs[rank], residual, weight, RMS_EPS, ws
                    )
                else:
                    reduced = sk.all_reduce(xs[rank], ws)
                    out = add_rmsnorm(reduced, residual, weight)
            return out

        ms = timer.ms(lambda: ranks.run(per_rank), f"sm120 x{world} at {rows} rows", notes)
        ranks.check_errors()
        return ms * 1e3 / points
    finally:
        ranks.close()


# ---------------------------------------------------------------- driver


def measure_tp(
    shape: ModelShape,
    tp: int,
    work: Workload,
    timer: Timer,
    budget: float,
    comm: Comm,
    notes: list[str],
) -> tuple[Measured, dict[str, Any]]:
    """Time verify, decode and draft passes with ``comm`` at tp's per-rank shapes."""
    stack = VerifyStack(shape, tp, work, timer.device, budget)
    info = {
        "layer_sets": {"dense": stack.n_dense_sets, "moe": stack.n_moe_sets},
        "layer_set_mb": {k: v / 2**20 for k, v in stack.set_bytes.items()},
        "weights_gb": stack.total_bytes() / 2**30,
        "active_experts": {
            "verify": expected_active_experts(
                work.verify_rows, shape.routed_experts, shape.experts_per_token
            ),
            "decode": expected_active_experts(
                work.bs, shape.routed_experts, shape.experts_per_token
            ),
        },
    }
    verify_fn, _ = stack.build_pass(comm, work.draft_tokens)
    verify = timer.ms(verify_fn, f"tp{tp} verify", notes)
    decode_fn, _ = stack.build_pass(comm, 1)
    decode = timer.ms(decode_fn, f"tp{tp} decode", notes)
    del stack, verify_fn, decode_fn
    draft = DraftStep(shape, tp, work, timer.device)
    step = timer.ms(draft.build_pass(comm, work.draft_rows), f"tp{tp} draft step", notes)
    extend = timer.ms(draft.build_pass(comm, work.verify_rows), f"tp{tp} draft extend", notes)
    del draft
    norm_us = {}
    for kind, rows in rows_of(work).items():
        norm_us[kind] = norm_point_us(shape.hidden, rows, timer, comm.add_rmsnorm, notes)
    if timer.device.type == "cuda":
        torch.cuda.empty_cache()
    return Measured(tp, verify, decode, step, extend, norm_us), info


def norm_point_us(hidden: int, rows: int, timer: Timer, add_rmsnorm, notes: list[str]) -> float:
    """Cost of one add + RMSNorm at ``rows`` (many in one graph, averaged)."""
    reps = 50
    x = torch.randn(rows, hidden, device=timer.device, dtype=torch.bfloat16)
    residual = torch.zeros_like(x)
    weight = torch.ones(hidden, device=timer.device, dtype=torch.bfloat16)

    def chain() -> torch.Tensor:
        out = x
        for _ in range(reps):
            out = add_rmsnorm(x, residual, weight)
        return out

    return timer.ms(chain, f"norm x{rows}", notes) * 1e3 / reps


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    shape = PRESETS[args.model]
    if args.layers:
        shape = replace(
            shape, layers=args.layers, dense_layers=min(shape.dense_layers, args.layers)
        )
    work = Workload(args.bs, args.draft_tokens, args.steps, args.topk, args.ctx)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        device = init_distributed(args)
        tps = [world]
    else:
        device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
        tps = args.tp
    timer = Timer(device, args.iters, args.warmup, use_graph=not args.eager)
    add_rmsnorm, norm_how = pick_add_rmsnorm(device)
    notes: list[str] = [f"add + RMSNorm at every point: {norm_how}"]
    if device.type == "cuda":
        notes.append(
            f"compute measured on {torch.cuda.get_device_name(device)} "
            f"({'CUDA graph' if timer.use_graph else 'eager'})"
        )
    else:
        notes.append("compute measured on the CPU, eager: shapes and arithmetic only")
    tables = load_tables(args, notes)
    rows: list[Row] = []
    infos = {}
    for tp in tps:
        log(f"tp={tp}: building per-rank stack and timing (rank {rank})")
        plain = Comm(add_rmsnorm)
        m, info = measure_tp(shape, tp, work, timer, args.weight_budget_gb * 2**30, plain, notes)
        infos[tp] = {**info, "compute": asdict(m)}
        draft = m.draft_cycle_ms(work.steps)
        rows.append(Row(tp, "compute only", "measured", m.verify_ms, m.decode_ms, draft, 0.0, None))
        if world > 1:
            comm = DistComm(add_rmsnorm, torch.distributed.get_backend())
            md, _ = measure_tp(shape, tp, work, timer, args.weight_budget_gb * 2**30, comm, notes)
            rows.append(
                Row(
                    tp,
                    comm.name,
                    f"measured, {world} ranks",
                    md.verify_ms,
                    md.decode_ms,
                    md.draft_cycle_ms(work.steps),
                    md.verify_ms - m.verify_ms,
                    (md.verify_ms - m.verify_ms) * 1e3 / shape.allreduce_points,
                )
            )
        if tp > 1:
            rows += modelled_rows(m, shape, work, tp, tables)
            if world == 1:
                rows += emulated_rows(m, shape, work, tp, timer, add_rmsnorm, notes)
    return {
        "shape": asdict(shape),
        "workload": asdict(work),
        "tp_info": infos,
        "rows": rows,
        "notes": notes,
        "rank": rank,
    }


def modelled_rows(m: Measured, shape: ModelShape, work: Workload, tp: int, tables) -> list[Row]:
    out = []
    for name, (source, point_us, replaces_norm) in tables(tp).items():
        out.append(modelled_row(m, shape, work, name, source, point_us, replaces_norm))
    return out


def emulated_rows(
    m: Measured,
    shape: ModelShape,
    work: Workload,
    tp: int,
    timer: Timer,
    add_rmsnorm,
    notes: list[str],
) -> list[Row]:
    if timer.device.type != "cuda":
        notes.append(f"tp={tp}: sgl_kernel_sm120 skipped: needs a CUDA GPU")
        return []
    try:
        import_kernel_package()
    except Exception as exc:
        notes.append(f"tp={tp}: sgl_kernel_sm120 skipped: not importable ({exc})")
        return []
    out = []
    source = f"kernel, {tp} ranks emulated on 1 GPU (no interconnect)"
    for fused, name in ((True, "sm120 fused"), (False, "sm120 all-reduce + norm")):
        try:
            cost = {
                n: emulated_point_us(tp, n, shape.hidden, 32, timer, fused, add_rmsnorm, notes)
                for n in sorted(set(rows_of(work).values()))
            }
        except Exception as exc:
            notes.append(f"tp={tp}: {name} skipped: {type(exc).__name__}: {exc}")
            continue
        by_bytes = {n * shape.hidden * ELEMENT_BYTES: us for n, us in cost.items()}
        notes.append(
            f"tp={tp}: {name} per point: "
            + ", ".join(f"{n} rows {us:.1f} us" for n, us in cost.items())
        )
        # Fused replaces the norm; the unfused chain timed the norm too, so both replace it.
        out.append(modelled_row(m, shape, work, name, source, by_bytes.__getitem__, True))
    return out


def load_tables(args: argparse.Namespace, notes: list[str]):
    """Per-tp modelled latency tables: name -> (source, nbytes -> us per point, replaces norm)."""
    from_json: dict[int, dict[str, LatencyTable]] = {}

    def for_tp(tp: int) -> dict[str, tuple[str, Callable[[int], float], bool]]:
        tables: dict[str, tuple[str, Callable[[int], float], bool]] = {}
        for us in args.allreduce_us:
            tables[f"all-reduce {us:g} us/point"] = (
                "modelled (--allreduce-us)",
                lambda _n, us=us: us,
                False,
            )
        if args.allreduce_json:
            if tp not in from_json:
                try:
                    from_json[tp] = load_allreduce_records(args.allreduce_json, tp)
                except (OSError, ValueError) as exc:
                    notes.append(f"tp={tp}: --allreduce-json not used: {exc}")
                    from_json[tp] = {}
            for backend, table in from_json[tp].items():
                tables[f"{backend} (table)"] = (
                    f"modelled ({table.source})",
                    table.us,
                    table.includes_norm,
                )
        if tp == 8 and not args.no_reported:
            for name, points in REPORTED_8GPU.items():
                tables[name] = (
                    "modelled (8x RTX PRO 6000, UPSTREAM.md)",
                    lambda n, p=points: latency_us(p, n),
                    False,
                )
        return tables

    return for_tp


def init_distributed(args: argparse.Namespace) -> torch.device:
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available() and not args.cpu:
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        torch.distributed.init_process_group("nccl", device_id=device)
        torch.distributed.all_reduce(torch.ones(1, device=device))  # NCCL up before capture
        return device
    torch.distributed.init_process_group("gloo")
    return torch.device("cpu")


def log(message: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- reporting


def report(result: dict[str, Any], args: argparse.Namespace) -> None:
    shape, work, rows = result["shape"], Workload(**result["workload"]), result["rows"]
    kib = work.verify_rows * shape["hidden"] * ELEMENT_BYTES / 1024
    print(
        f"EAGLE-3 verify step, {shape['name']}: {shape['layers']} layers, hidden "
        f"{shape['hidden']}, {2 * shape['layers']} all-reduce points per pass"
    )
    print(
        f"bs {work.bs} x {work.draft_tokens} draft tokens = {work.verify_rows} verify rows "
        f"({kib:.1f} KiB per all-reduce), decode {work.bs} rows, ctx {work.ctx}, "
        f"draft {work.steps} steps x topk {work.topk} + extend"
    )
    for tp, info in result["tp_info"].items():
        sets = info["layer_sets"]
        print(
            f"tp={tp}: weights {info['weights_gb']:.1f} GB in {sets['dense']} dense + "
            f"{sets['moe']} MoE layer sets cycled over the layers; active experts "
            f"verify {info['active_experts']['verify']}, decode {info['active_experts']['decode']}"
        )
    print()
    headers = ["tp", "backend", "source", "verify ms", "AR ms", "AR share", "us/point"]
    print(
        format_table(
            headers,
            [
                [
                    r.tp,
                    r.backend,
                    r.source,
                    r.verify_ms,
                    r.allreduce_ms,
                    f"{100 * r.share:.0f}%",
                    r.per_point_us,
                ]
                for r in rows
            ],
        )
    )
    print()
    headers = ["tp", "backend", "decode ms", "draft ms", "break-even accept", "plain tok/s"]
    headers += [f"tok/s @{a:g}" for a in args.accept_lengths]
    table = []
    for r in rows:
        cells = [
            r.tp,
            r.backend,
            r.decode_ms,
            r.draft_ms,
            break_even_accept(r.verify_ms, r.draft_ms, r.decode_ms),
            plain_tokens_per_s(r.decode_ms, work.bs),
        ]
        cells += [
            spec_tokens_per_s(a, r.verify_ms, r.draft_ms, work.bs) for a in args.accept_lengths
        ]
        table.append(cells)
    print(format_table(headers, table))
    print()
    for note in result["notes"]:
        print(f"note: {note}")
    print(
        "note: per rank, bf16 everywhere (DeepSeek-V3 ships fp8, Kimi-K2.5 int4 experts: their "
        "compute is lower); logits gather, rope and sampling not modelled"
    )


def arithmetic_only(args: argparse.Namespace) -> int:
    """Break-even and tok/s from times measured elsewhere."""
    draft = args.draft_ms or 0.0
    accept = break_even_accept(args.verify_ms, draft, args.decode_ms)
    print(
        f"verify {args.verify_ms} ms + draft {draft} ms per cycle, plain decode "
        f"{args.decode_ms} ms per token, bs {args.bs}"
    )
    print(f"break-even accept length: {accept:.3f}")
    print(f"plain decoding: {plain_tokens_per_s(args.decode_ms, args.bs):.1f} tok/s")
    print(
        format_table(
            ["accept length", "EAGLE-3 tok/s", "speed-up"],
            [
                [
                    a,
                    spec_tokens_per_s(a, args.verify_ms, draft, args.bs),
                    spec_tokens_per_s(a, args.verify_ms, draft, args.bs)
                    / plain_tokens_per_s(args.decode_ms, args.bs),
                ]
                for a in args.accept_lengths
            ],
        )
    )
    return 0


def draw(result: dict[str, Any], args: argparse.Namespace):
    rows: list[Row] = result["rows"]
    work = Workload(**result["workload"])
    tps = sorted({r.tp for r in rows})
    top = work.steps + 1  # a chain of `steps` drafts plus the bonus token

    def paint(plt) -> None:
        _, axes = plt.subplots(1, len(tps), figsize=(5 * len(tps), 4), squeeze=False)
        xs = [1 + i * (top - 1) / 50 for i in range(51)]
        for ax, tp in zip(axes[0], tps, strict=True):
            for i, r in enumerate(x for x in rows if x.tp == tp):
                color = f"C{i % 10}"
                ax.plot(
                    xs,
                    [spec_tokens_per_s(a, r.verify_ms, r.draft_ms, work.bs) for a in xs],
                    color=color,
                    label=r.backend,
                )
                ax.axhline(plain_tokens_per_s(r.decode_ms, work.bs), color=color, ls="--", lw=0.8)
            ax.set_title(f"tp={tp}: EAGLE-3 (solid) vs plain (dashed)")
            ax.set_xlabel("accept length (tokens per verify)")
            ax.set_ylabel("tokens/s per rank group")
            ax.legend(fontsize=7)

    return paint


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    floats = lambda s: [float(x) for x in s.split(",") if x]  # noqa: E731
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--model", choices=sorted(PRESETS), default="kimi-k2.5")
    p.add_argument("--layers", type=int, help="override the preset's layer count")
    p.add_argument(
        "--tp", type=ints, default=[1], help="comma list (one process); torchrun: world size"
    )
    p.add_argument("--bs", type=int, default=1)
    p.add_argument("--draft-tokens", type=int, default=4, help="verify rows per sequence")
    p.add_argument("--steps", type=int, default=3, help="draft steps per cycle")
    p.add_argument("--topk", type=int, default=1)
    p.add_argument("--ctx", type=int, default=2048, help="KV length attended to")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--cpu", action="store_true", help="run on the CPU even if CUDA is present")
    p.add_argument(
        "--weight-budget-gb",
        type=float,
        default=40.0,
        help="memory for distinct layer weights; layers cycle through what fits",
    )
    p.add_argument(
        "--allreduce-us", type=floats, default=[], help="modelled us per point, comma list"
    )
    p.add_argument("--allreduce-json", help="bench_allreduce JSON ({'allreduce': [records]})")
    p.add_argument(
        "--no-reported", action="store_true", help="omit UPSTREAM's 8-GPU figures at tp 8"
    )
    p.add_argument("--accept-lengths", type=floats, default=[1.5, 2.0, 2.5, 3.0])
    p.add_argument("--verify-ms", type=float, help="arithmetic only: measured verify time")
    p.add_argument("--decode-ms", type=float, help="arithmetic only: measured plain decode step")
    p.add_argument("--draft-ms", type=float, help="arithmetic only: measured draft time per cycle")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR / "bench_verify_step.json")
    p.add_argument("--png", type=Path, default=DEFAULT_OUT_DIR / "bench_verify_step.png")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shapes, eager, 2 iterations, tp 1,2 (CPU is fine): checks the script",
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.ctx, args.iters, args.warmup, args.eager = "tiny", 64, 2, 1, True
        args.weight_budget_gb = 0.05
        if "WORLD_SIZE" not in os.environ and args.tp == [1]:
            args.tp = [1, 2, 8]
    if (args.verify_ms is None) != (args.decode_ms is None):
        p.error("--verify-ms and --decode-ms go together (with optional --draft-ms)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.verify_ms is not None:
        return arithmetic_only(args)
    result = run_benchmark(args)
    if result["rank"] != 0:
        torch.distributed.destroy_process_group()
        return 0
    report(result, args)
    payload = {**result, "rows": [{**asdict(r), "share": r.share} for r in result["rows"]]}
    print(f"JSON written: {write_json(args.out, payload)}")
    print(save_png(args.png, draw(result, args)))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
