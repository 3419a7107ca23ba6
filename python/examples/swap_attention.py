"""Swap sparge's block-sparse attention into a small attention module in place of SDPA.

    python3 python/examples/swap_attention.py            # CUDA (bf16) if available, else CPU (f32)
    python3 python/examples/swap_attention.py --device cpu

Set SPARGE_LIBRARY (path to libsparge.so) or SPARGE_BUILD_DIR (a build directory) if libsparge is not
installed. The module computes q, k, v with one projection and hands [B,H,N,D] views of it (BNHD memory,
transposed) to its attention function; sparge reads those views in place, like SDPA does.
"""
import argparse
import functools
import math
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import sparge  # noqa: E402


def dense_sdpa(q, k, v):
    """F.scaled_dot_product_attention where torch has it (2.0+), else the same computation spelled out."""
    if hasattr(torch.nn.functional, "scaled_dot_product_attention"):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v)
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v


class SelfAttention(torch.nn.Module):
    def __init__(self, dim, heads, attention=dense_sdpa):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)
        self.attention = attention

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).view(B, N, 3, self.heads, C // self.heads).unbind(2)  # each [B,N,H,D]
        o = self.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))  # [B,H,N,D] views
        return self.out(o.transpose(1, 2).reshape(B, N, C))


def tokens(B, N, C, device, dtype, seed=0):
    """Video-like tokens: a smooth function of position plus noise, so attention has local structure."""
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(N, dtype=torch.float32)[:, None]
    freqs = torch.exp(-math.log(1e4) * torch.arange(0, C, 2, dtype=torch.float32) / C)
    pe = torch.cat([torch.sin(pos * freqs), torch.cos(pos * freqs)], dim=1)
    x = 2.0 * pe + 0.3 * torch.randn(B, N, C, generator=g)
    return x.to(device=device, dtype=dtype)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=None, help="sequence length (default 8190 CUDA, 2046 CPU)")
    parser.add_argument("--topk", type=float, default=0.03)
    parser.add_argument("--topp", type=float, default=0.2)
    args = parser.parse_args()
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    N = args.tokens or (8190 if on_gpu else 2046)  # not a multiple of the blocks: partial last blocks
    B, C, H = 1, (1536 if on_gpu else 256), (12 if on_gpu else 4)

    torch.manual_seed(0)
    module = SelfAttention(C, H)
    with torch.no_grad():  # trained-like weights: queries and keys share a rotation, so attention is peaked
        rotation = torch.linalg.qr(torch.randn(C, C))[0]
        module.qkv.weight[: 2 * C] = torch.cat([rotation, rotation])
        module.qkv.bias.zero_()
    module = module.to(device=device, dtype=dtype)
    x = tokens(B, N, C, device, dtype)

    print(f"sparge {sparge.__version__} from {sparge.library_path}; backends {sparge.backends()}")
    print(f"module: B={B} N={N} C={C} H={H} D={C // H} {dtype} on {device}")
    with torch.no_grad():
        dense_out = module(x)

    seen = {}

    def sparse_attention(q, k, v):
        out, seen["mask"] = sparge.sparge_attention(q, k, v, topk=args.topk, topp=args.topp, return_mask=True)
        return out

    module.attention = sparse_attention  # the swap: same call, same shapes, same conventions as SDPA
    x.requires_grad_(True)
    sparse_out = module(x)
    mask = seen["mask"]
    st = mask.stats()
    print(f"mask: {mask}")
    print(f"  sparsity {st.sparsity:.4f} (kept {st.kept_blocks} of {st.total_blocks} blocks), token density "
          f"{st.token_density:.4f}, kept pooled mass per row {st.mean_row_mass:.3f}, blocks per row "
          f"{st.min_row_blocks}..{st.max_row_blocks}, per-head sparsity {float(st.head_sparsity.min()):.3f}.."
          f"{float(st.head_sparsity.max()):.3f}")
    rel = float((sparse_out.detach().float() - dense_out.float()).norm() / dense_out.float().norm())
    print(f"module output vs dense SDPA: rel L2 {rel:.4e} (what skipping {100 * st.sparsity:.1f}% of the blocks "
          "changes)")

    # The same mask as a dense masked attention: the part of the difference that is not the sparsity.
    module.attention = functools.partial(masked_reference, token_mask=mask.token_mask())
    with torch.no_grad():
        masked_out = module(x)
    rel_masked = float((sparse_out.detach().float() - masked_out.float()).norm() / masked_out.float().norm())
    print(f"module output vs dense attention with sparge's mask: rel L2 {rel_masked:.4e}")

    sparse_out.float().square().mean().backward()  # gradients flow through sparge's backward
    grad = x.grad.float()
    print(f"backward: |dL/dx| = {float(grad.norm()):.4e}, finite: {bool(torch.isfinite(grad).all())}, "
          f"|dL/dW_qkv| = {float(module.qkv.weight.grad.float().norm()):.4e}")


def masked_reference(q, k, v, token_mask):
    s = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~token_mask, float("-inf"))
    return (torch.softmax(s, dim=-1) @ v.float()).to(q.dtype)


if __name__ == "__main__":
    main()
