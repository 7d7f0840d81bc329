"""The reference decoder: a GPT/Llama-family Transformer in plain single-device PyTorch.

It knows nothing about parallelism. Tensor parallelism is applied from outside by a plan
(:mod:`ops_transformer.parallelize`) that swaps its linears for parallel ones. Two habits make that
possible without touching this file: head counts are read from the projected tensors (a rank that
holds 2 of 8 heads sees 2 heads), and the LM head owns its loss (a parallel head can swap in the
vocab-parallel cross-entropy).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .documents import check_document_ids, document_mask, document_positions, document_targets
from .config import PRESETS, GPTConfig, preset  # noqa: F401 (their name here too)
from .moe import MoE, init_routers, moe_aux_loss


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x_f = x.float()
        return (x_f * torch.rsqrt(x_f.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def make_norm(cfg: GPTConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)


def rope_tables(head_dim: int, seq: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of rotary embeddings (Su et al. 2021), rotate-half convention."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim)
    angles = torch.outer(torch.arange(seq, device=device).float(), inv_freq)  # (T, hd/2)
    angles = torch.cat([angles, angles], -1)  # (T, hd)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat([-x2, x1], -1) * sin).type_as(x)


class Attention(nn.Module):
    """Causal self-attention with MHA/GQA/MQA. Head counts come from the projections' outputs."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim, self.dropout = cfg.head_dim, cfg.dropout
        kv_dim = cfg.n_kv_heads * cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        # No key bias even with bias=True: q·(k + b) shifts every score of a query by the same
        # q·b, which softmax ignores, so its gradient is zero in exact arithmetic and pure rounding
        # noise in practice (which Adam would amplify into arbitrary updates).
        self.wk = nn.Linear(cfg.d_model, kv_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, kv_dim, bias=cfg.bias)
        self.wo = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)

    def forward(self, x, rope=None, document_ids=None):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hd)
        k = self.wk(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nkv, T, hd)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        y = self.core(q, k, v) if document_ids is None else self.core(q, k, v, document_ids)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, nh·hd)

    def core(self, q, k, v, document_ids=None):
        """The attention core: scores, softmax, dropout, weighted sum (what selective recompute
        replays). ``(B, nh, T, hd)`` queries, ``(B, nkv, T, hd)`` keys and values; with
        ``document_ids`` ``(B, T)`` a query sees the earlier keys of its own document only."""
        if k.shape[1] != q.shape[1]:  # GQA: each KV head serves a group of query heads
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        mask = None if document_ids is None else document_mask(document_ids)  # (B, 1, T, T)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                              dropout_p=self.dropout if self.training else 0.0)


class MLP(nn.Module):
    """GELU: ``w_out(gelu(w_in x))``. SwiGLU: ``w_out(silu(gate) * up)`` with ``w_in`` = [gate; up]
    fused into one matrix of ``2·d_ff`` outputs."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.swiglu = cfg.mlp == "swiglu"
        width = 2 * cfg.d_ff if self.swiglu else cfg.d_ff
        self.w_in = nn.Linear(cfg.d_model, width, bias=cfg.bias)
        self.w_out = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)

    def forward(self, x):
        h = self.w_in(x)  # (B, T, d_ff or 2·d_ff), per rank: its slice
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            return self.w_out(F.silu(gate) * up)
        return self.w_out(F.gelu(h))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int = 0):
        super().__init__()
        self.norm1, self.attn = make_norm(cfg), Attention(cfg)
        self.norm2 = make_norm(cfg)
        self.mlp = MoE(cfg, MLP) if cfg.is_moe_layer(layer) else MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, rope=None, document_ids=None):
        h = self.norm1(x)
        h = self.attn(h, rope) if document_ids is None else self.attn(h, rope, document_ids)
        x = x + self.drop(h)
        return x + self.drop(self.mlp(self.norm2(x)))


class LMHead(nn.Module):
    """Logits and the next-token loss. ``forward(x, targets)`` returns ``(logits, loss)``."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x, targets=None):
        logits = F.linear(x, self.weight)  # (B, T, V)
        if targets is None:
            return logits, None
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class GPT(nn.Module):
    """``model(idx, targets=None) -> (logits, loss)``; ``loss`` is ``None`` without targets."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.pos == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layers))
        self.norm = make_norm(cfg)
        self.lm_head = LMHead(cfg)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2's scaled init of residual projections
            if name.endswith(("attn.wo.weight", "w_out.weight")):  # dense FFN or expert
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layers))
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        init_routers(self)  # last: with one expert, the same weights as the dense model

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx, targets=None, *, positions=None, document_ids=None):
        """``idx`` ``(B, T)`` tokens; ``positions`` ``(T,)`` or ``(B, T)``: where they sit in
        their sequence (default ``0..T−1``, or each token's place in its document); with
        ``document_ids`` ``(B, T)`` (packed documents, :mod:`.documents`) attention never crosses
        a document, and a document's last token has no target. (A context-parallel rank passes the positions of its two chunks and the whole
        sequences' ``document_ids``, which its attention cores read.)"""
        B, T = idx.shape
        if document_ids is not None and positions is None:
            check_document_ids(document_ids, idx)
            positions = document_positions(document_ids)
            if targets is not None:  # a document's last token does not predict the next one's
                targets = document_targets(targets, document_ids)
        given = positions is not None
        if not given:
            if T > self.cfg.max_seq_len:
                raise ValueError(f"sequence length {T} exceeds max_seq_len "
                                 f"({self.cfg.max_seq_len})")
            positions, table_len = torch.arange(T, device=idx.device), T
        else:
            table_len = self.cfg.max_seq_len  # the same values at every position, any length
        x = self.tok_emb(idx)  # (B, T, d)
        rope = None
        if self.pos_emb is not None:
            x = x + self.pos_emb(positions)
        else:
            cos, sin = rope_tables(self.cfg.head_dim, table_len, self.cfg.rope_theta, idx.device)
            rope = (cos[positions], sin[positions]) if given else (cos, sin)
            if positions.dim() == 2:  # per row: (B, 1, T, hd) against (B, nh, T, hd)
                rope = (rope[0].unsqueeze(1), rope[1].unsqueeze(1))
        x = self.drop(x)
        for block in self.layers:
            x = block(x, rope) if document_ids is None else block(x, rope, document_ids)
        logits, loss = self.lm_head(self.norm(x), targets)
        return logits, self.add_aux_loss(loss)

    def add_aux_loss(self, loss):
        """``loss`` plus ``moe_aux_loss_coef`` × each MoE layer's load-balancing loss of this
        forward (nothing without experts or targets)."""
        if loss is None or not self.cfg.n_experts:
            return loss
        return loss + self.cfg.moe_aux_loss_coef * moe_aux_loss(self)

    @torch.no_grad()
    def generate(self, idx, max_new_tokens: int, *, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None):
        """Sample ``max_new_tokens`` tokens (greedy when ``temperature == 0``)."""
        for _ in range(max_new_tokens):
            context = idx[:, -self.cfg.max_seq_len:]
            logits, _ = self(context)
            logits = logits[:, -1, :]  # (B, V)
            if temperature == 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = torch.multinomial(F.softmax(logits, -1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx
