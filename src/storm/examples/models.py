"""Small models used by the example and the tests: each exercises a different kind of saved tensor."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        # q, k, v are views into one qkv storage at different offsets: autograd saves such views
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        att = self.drop(att.masked_fill(mask, float("-inf")).softmax(-1))
        return self.drop(self.proj((att @ v).transpose(1, 2).reshape(b, t, d)))


class GPTBlock(nn.Module):
    def __init__(self, d_model: int, n_heads: int, dropout: float):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model),
                                 nn.Dropout(dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """A byte-level GPT: token + position embeddings, pre-norm blocks, a linear head."""

    def __init__(self, vocab: int = 256, seq_len: int = 128, d_model: int = 128, n_heads: int = 4,
                 n_layers: int = 4, dropout: float = 0.1):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(GPTBlock(d_model, n_heads, dropout) for _ in range(n_layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.drop(self.tok(idx) + self.pos(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.short = nn.Sequential() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += self.short(x)  # in place on bn2's output, as torchvision's ResNet does
        return self.relu(out)


class ResNet(nn.Module):
    """A small ResNet with BatchNorm and in-place ReLU."""

    def __init__(self, classes: int = 10, width: int = 16):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width),
                                  nn.ReLU(inplace=True))
        self.layers = nn.Sequential(BasicBlock(width, width, 1), BasicBlock(width, 2 * width, 2),
                                    BasicBlock(2 * width, 4 * width, 2))
        self.fc = nn.Linear(4 * width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.layers(self.stem(x)).mean((2, 3)))


class ViewNet(nn.Module):
    """Saves views with storage offsets, transposed strides, narrowed slices and other dtypes."""

    def __init__(self, d: int = 64):
        super().__init__()
        self.lin = nn.Linear(d, 2 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        a, b = y.chunk(2, dim=-1)                    # b starts at a storage offset
        z = a.sin() * b.transpose(0, 1).t()          # sin saves a view; mul saves a transposed-back view
        n = torch.narrow(y, 1, 3, y.shape[1] - 5)    # strided slice in the middle of the storage
        w = (n.pow(3).sum(-1, keepdim=True) * 1e-3).double().cos().float()  # a float64 saved tensor
        return self.out(z * w + a.t().contiguous().t().exp())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality: dtype, shape and every byte (NaN payloads and -0.0 included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.detach().contiguous().view(-1).view(torch.uint8),
                       b.detach().contiguous().view(-1).view(torch.uint8))
