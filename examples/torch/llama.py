"""A Llama trained as torchtitan trains one: RMSNorm, rotary embeddings, grouped-query
attention through SDPA, SwiGLU; FSDP2 per block with bf16 parameters and f32 gradient
reduction, per-block activation checkpointing, AdamW, loss logged with `.item()`.

It knows nothing of podsim: it asks for NCCL and CUDA when there is a GPU, gloo and the CPU
otherwise. Under `podsim run` it runs on the emulated pod as it is:

    podsim run --topology 2x2x2 -- python llama.py --model debug            # real tensors
    podsim run --mode meta --topology 16x16x16 -- python llama.py --model 7b  # shapes only
    torchrun --nproc-per-node 8 llama.py --model debug                        # the reference
"""

import argparse
import math
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.checkpoint import checkpoint


@dataclass
class Args:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab: int
    ffn: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0


MODELS = {
    "debug": Args(dim=256, n_layers=2, n_heads=8, n_kv_heads=4, vocab=2048, ffn=688),
    "7b": Args(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, vocab=32000, ffn=11008),
    "13b": Args(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, vocab=32000, ffn=13824),
    "70b": Args(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab=32000, ffn=28672),
    # Llama 3: grouped-query attention at every size, a 128k vocabulary.
    "llama3-8b": Args(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab=128256, ffn=14336),
    "llama3-70b": Args(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab=128256, ffn=28672),
}


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.type_as(x) * self.weight

    def reset_parameters(self):
        nn.init.ones_(self.weight)


def rotary(seq, head_dim, theta, device):
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    angles = torch.outer(torch.arange(seq, device=device).float(), freqs)
    return angles.cos(), angles.sin()


def apply_rotary(x, cos, sin):
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    out = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.heads, self.kv_heads = a.n_heads, a.n_kv_heads
        self.head_dim = a.dim // a.n_heads
        self.wq = nn.Linear(a.dim, a.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(a.dim, a.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(a.dim, a.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(a.n_heads * self.head_dim, a.dim, bias=False)

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        # Heads by -1: under tensor parallelism a rank holds its share of them.
        q = self.wq(x).view(b, t, -1, self.head_dim)
        k = self.wk(x).view(b, t, -1, self.head_dim)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        q, k, v = (y.transpose(1, 2) for y in (q, k, v))
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.kv_heads != self.heads
        )
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.w1 = nn.Linear(a.dim, a.ffn, bias=False)
        self.w2 = nn.Linear(a.ffn, a.dim, bias=False)
        self.w3 = nn.Linear(a.dim, a.ffn, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.attention_norm = RMSNorm(a.dim, a.norm_eps)
        self.attention = Attention(a)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps)
        self.feed_forward = FeedForward(a)

    def forward(self, x, cos, sin):
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.args = a
        self.tok_embeddings = nn.Embedding(a.vocab, a.dim)
        self.layers = nn.ModuleList(Block(a) for _ in range(a.n_layers))
        self.norm = RMSNorm(a.dim, a.norm_eps)
        self.output = nn.Linear(a.dim, a.vocab, bias=False)

    def forward(self, tokens):
        a = self.args
        cos, sin = rotary(tokens.shape[1], a.dim // a.n_heads, a.rope_theta, tokens.device)
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = checkpoint(layer, h, cos, sin, use_reentrant=False)
        return self.output(self.norm(h)).float()

    def init_weights(self):
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() == 1:
                nn.init.ones_(p)
            else:
                depth_scaled = name.endswith(("wo.weight", "w2.weight"))
                nn.init.trunc_normal_(
                    p, std=std / math.sqrt(2 * self.args.n_layers) if depth_scaled else std
                )


def setup(tp=1):
    """The process group and a (data-parallel, tensor-parallel) mesh: NCCL and CUDA when
    there is a GPU, gloo and the CPU otherwise."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    mesh = init_device_mesh(device.type, (dist.get_world_size() // tp, tp),
                            mesh_dim_names=("dp", "tp"))
    return device, mesh


def sharded_model(margs, mesh, device):
    """The model built on the meta device; with a tensor-parallel mesh dimension of more than
    one rank, attention's and SwiGLU's projections split Megatron-style (column then row);
    FSDP2 per block then the root over the data-parallel dimension (bf16 parameters, f32
    gradient reduction); materialised on `device` and initialised."""
    with torch.device("meta"):
        model = Transformer(margs)
    if mesh["tp"].size() > 1:
        plan = {f"{part}.{name}": ColwiseParallel() for part, names in
                (("attention", ("wq", "wk", "wv")), ("feed_forward", ("w1", "w3")))
                for name in names}
        plan.update({"attention.wo": RowwiseParallel(), "feed_forward.w2": RowwiseParallel()})
        for layer in model.layers:
            parallelize_module(layer, mesh["tp"], plan)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"], mp_policy=policy)
    fully_shard(model, mesh=mesh["dp"], mp_policy=policy)
    model.to_empty(device=device)
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights()
    return model


def clip_grad_norm(model, max_norm):
    """torch's `clip_grad_norm_`, for gradients on meshes of different shapes too (tensor
    parallel blocks beside data-parallel-only embeddings), as torchtitan clips them: the norm
    of each mesh's gradients made whole, then one total."""
    by_mesh = {}
    for p in model.parameters():
        if p.grad is not None:
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in params])
             for params in by_mesh.values()]
    norms = [n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms]
    total = norms[0] if len(norms) == 1 else torch.stack(norms).norm()
    # Scaled mesh by mesh: one foreach multiply cannot take DTensors of two meshes.
    for params in by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(MODELS), default="debug")
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per group")
    parser.add_argument("--out", default=None, help="save the final parameters here (rank 0)")
    args = parser.parse_args()

    margs = MODELS[args.model]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.tp < 1 or world % args.tp or margs.n_heads % args.tp or margs.n_kv_heads % args.tp:
        parser.error(f"--tp {args.tp} must divide the world size ({world}) and the model's "
                     f"heads ({margs.n_heads}) and key/value heads ({margs.n_kv_heads})")
    device, mesh = setup(args.tp)
    rank = dist.get_rank()
    # The ranks of a tensor-parallel group see the same batch.
    data_rank = mesh["dp"].get_local_rank()
    model = sharded_model(margs, mesh, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, fused=False)

    generator = torch.Generator().manual_seed(1234 + data_rank)
    for step in range(1, args.steps + 1):
        tokens = torch.randint(0, margs.vocab, (args.batch, args.seq + 1), generator=generator)
        tokens = tokens.to(device)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        # As torchtitan does: the logits are freed before backward, not held through it.
        del logits
        loss.backward()
        norm = clip_grad_norm(model, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f} grad norm {norm.item():.4f}", flush=True)
    if args.out:
        full = {name: p.full_tensor().float() for name, p in model.named_parameters()}
        if rank == 0:
            torch.save(full, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
