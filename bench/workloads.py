"""W1 and W2 from ../shared/reference/anchors_w1_w2.py, so STORM's figures sit beside the anchors."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class Block(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, h, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln1(x)
        a, _ = self.attn(y, y, y, need_weights=False)
        x = x + a
        return x + self.mlp(self.ln2(x))


class Net(nn.Module):
    def __init__(self, layers: int, d: int, h: int, ckpt: bool = False):
        super().__init__()
        self.blocks = nn.ModuleList([Block(d, h) for _ in range(layers)])
        self.ckpt = ckpt

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False) if self.ckpt else b(x)
        return x


@dataclass(frozen=True)
class Workload:
    name: str
    layers: int
    d: int
    heads: int
    batch: int
    seq: int

    def build(self, device: torch.device, ckpt: bool = False, seed: int = 0) -> tuple[Net, torch.Tensor]:
        torch.manual_seed(seed)
        model = Net(self.layers, self.d, self.heads, ckpt).to(device, torch.bfloat16)
        x = torch.randn(self.batch, self.seq, self.d, device=device, dtype=torch.bfloat16)
        return model, x


W1 = Workload("W1", 12, 1024, 16, 8, 1024)
W2 = Workload("W2", 24, 4096, 32, 2, 2048)
TINY = Workload("tiny", layers=2, d=64, heads=2, batch=2, seq=32)  # smoke runs of the bench scripts on CPU
