"""What the example scripts share: the backend (podsim under `podsim run`, gloo under
torchrun), a small transformer, its data, and saving the final parameters for comparison.
Nothing here is podsim-specific beyond `backend()` and the optional step marks."""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

UNDER_PODSIM = "PODSIM_SOCKET" in os.environ
if UNDER_PODSIM:
    import podsim.torch  # registers the "podsim" backend


def backend():
    return "podsim" if UNDER_PODSIM else "gloo"


def mark_step():
    """Ends a training step in podsim's report (nothing under torchrun)."""
    if UNDER_PODSIM:
        podsim.torch.step()


def args(extra=None):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", default=None, help="save rank 0's final parameters here")
    if extra:
        extra(p)
    return p.parse_args()


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(d, dim=-1)
        shape = (b, s, self.heads, d // self.heads)
        q, k, v = (t.reshape(shape).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyTransformer(nn.Module):
    def __init__(self, vocab=64, d=32, heads=2, layers=2, seq=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def batch(step, rank, per_rank=4, seq=16, vocab=64):
    """Rank `rank`'s tokens for `step` (the same on every backend)."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    tokens = torch.randint(0, vocab, (per_rank, seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model, inputs, targets):
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def train(model, steps, rank, seq_after=None):
    """`steps` steps of SGD with momentum on this rank's batches; returns steps/s (wall).
    `seq_after` (`(step, seq)`): from that step on the batches are `seq` tokens long, as from
    a loader of texts of varying length."""
    import time

    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start = time.perf_counter()
    for step in range(steps):
        seq = seq_after[1] if seq_after and step >= seq_after[0] else 16
        inputs, targets = batch(step, rank, seq=seq)
        loss = loss_of(model, inputs, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        mark_step()
        if rank == 0 and step % 5 == 0:
            print(f"step {step} loss {loss.item():.4f}")
    return steps / (time.perf_counter() - start)


def save(params, path):
    """Rank 0 writes `{name: tensor}` (full tensors) to `path`."""
    if path and dist.get_rank() == 0:
        torch.save({k: v.detach().clone() for k, v in params.items()}, path)
