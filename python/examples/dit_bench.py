"""One denoising step of a Wan2.1-shaped video DiT with dense attention and with sparge.

    python3 python/examples/dit_bench.py                    # Wan2.1-1.3B and 14B shapes, bf16 on CUDA
    python3 python/examples/dit_bench.py --model 1.3B --csv dit.csv
    python3 python/examples/dit_bench.py --model 14B --blocks 2   # time 2 of the 40 blocks, scale to 40
    python3 python/examples/dit_bench.py --tiny             # a CPU smoke run of the same code (float32)

The model is Wan2.1's block in plain PyTorch with random weights: adaLN modulation from the time embedding,
self-attention with RMS-normed q and k and 3-D RoPE over (frames, height, width), dense cross-attention to
512 text tokens, and a GELU FFN. Wan2.1-1.3B: 30 blocks, dim 1536, 12 heads, FFN 8960, 21x30x52 = 32,760
video tokens (480p); 14B: 40 blocks, dim 5120, 40 heads, FFN 13824, 21x45x80 = 75,600 tokens (720p).

A step is one forward of every block (no grad). Self-attention runs as SDPA on the cuDNN backend (dense), or
as sparge at Top-k 5 % (95 % sparsity) or at the paper's hybrid k = 0.03, p = 0.2; cross-attention is dense
SDPA throughout. Each method's self-attention is also timed alone on block 0's q, k, v, which gives the
attention share of the dense step. With --blocks N only N blocks exist and are timed, and times are scaled to
the full depth. Sparsities are measured on each timed block's own q and k (random weights give flatter attention
than a trained model, so the hybrid keeps more blocks than it would there). Prints a Markdown table and writes
a CSV (--csv). Times are medians of --iters runs after --warmup runs (CUDA events on the GPU).
"""
import argparse
import csv
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import sparge  # noqa: E402

MODELS = {  # blocks, dim, heads, ffn, (frames, height, width) of the latent video in patches, text tokens
    "1.3B": dict(blocks=30, dim=1536, heads=12, ffn=8960, grid=(21, 30, 52), text=512),
    "14B": dict(blocks=40, dim=5120, heads=40, ffn=13824, grid=(21, 45, 80), text=512),
    "tiny": dict(blocks=2, dim=64, heads=4, ffn=128, grid=(3, 6, 10), text=16),
}
DEFAULT_BLOCKS = {"1.3B": None, "14B": 4, "tiny": None}  # None: all; 14B's full step takes ~10 s per run
METHODS = (("dense", None, None), ("sparge topk 95%", 0.05, 0.0), ("sparge hybrid k=0.03 p=0.2", 0.03, 0.2))


class RMSNorm(torch.nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_tables(grid, head_dim, device):
    """cos, sin [N, head_dim/2] of Wan's 3-D RoPE: the pair dimensions split over frames, height and width."""
    pairs = head_dim // 2
    split = (pairs - 2 * (pairs // 3), pairs // 3, pairs // 3)
    angles = []
    for axis, (n, width) in enumerate(zip(grid, split)):
        inv = 1.0 / (10000 ** (torch.arange(width, dtype=torch.float64) * 2 / (2 * width)))
        pos = torch.arange(n, dtype=torch.float64)
        a = torch.outer(pos, inv)  # [n, width]
        shape = [1, 1, 1, width]
        shape[axis] = n
        angles.append(a.view(shape).expand(*grid, width))
    angles = torch.cat(angles, dim=-1).reshape(-1, pairs)
    return angles.cos().float().to(device), angles.sin().float().to(device)


def rope(x, cos, sin):
    """x [B,N,H,D] rotated pairwise (adjacent elements form a pair)."""
    B, N, H, D = x.shape
    pairs = x.float().view(B, N, H, D // 2, 2)
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2).type_as(x)


class WanBlock(torch.nn.Module):
    """Wan2.1's DiT block; self_attention(q, k, v) takes and returns [B,N,H,D]."""

    def __init__(self, dim, heads, ffn, self_attention, cross_attention):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.norm1 = torch.nn.LayerNorm(dim, eps=1e-6, elementwise_affine=False)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(dim, dim) for _ in range(4))
        self.norm_q, self.norm_k = RMSNorm(dim), RMSNorm(dim)
        self.norm3 = torch.nn.LayerNorm(dim, eps=1e-6)
        self.cq, self.ck, self.cv, self.co = (torch.nn.Linear(dim, dim) for _ in range(4))
        self.norm_cq, self.norm_ck = RMSNorm(dim), RMSNorm(dim)
        self.norm2 = torch.nn.LayerNorm(dim, eps=1e-6, elementwise_affine=False)
        self.ffn = torch.nn.Sequential(torch.nn.Linear(dim, ffn), torch.nn.GELU(approximate="tanh"),
                                       torch.nn.Linear(ffn, dim))
        self.modulation = torch.nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)
        self.self_attention, self.cross_attention = self_attention, cross_attention

    def heads_of(self, x):
        return x.view(x.shape[0], x.shape[1], self.heads, self.head_dim)

    def qkv(self, x, e, cos, sin):
        """The self-attention's q, k, v [B,N,H,D] (what the attention alone is timed on)."""
        h = self.norm1(x) * (1 + e[1]) + e[0]
        q = rope(self.heads_of(self.norm_q(self.q(h))), cos, sin)
        k = rope(self.heads_of(self.norm_k(self.k(h))), cos, sin)
        return q, k, self.heads_of(self.v(h))

    def forward(self, x, context, t_emb, cos, sin):
        e = (self.modulation + t_emb).chunk(6, dim=1)
        B, N, C = x.shape
        y = self.self_attention(*self.qkv(x, e, cos, sin))
        x = x + self.o(y.reshape(B, N, C)) * e[2]
        h = self.norm3(x)
        q = self.heads_of(self.norm_cq(self.cq(h)))
        k, v = self.heads_of(self.norm_ck(self.ck(context))), self.heads_of(self.cv(context))
        x = x + self.co(self.cross_attention(q, k, v).reshape(B, N, C))
        return x + self.ffn(self.norm2(x) * (1 + e[4]) + e[3]) * e[5]


def dense_attention(sdpa_context):
    """SDPA on [B,N,H,D] tensors (transposed views, no copies); the spelled-out form on torch without SDPA."""
    def attend(q, k, v):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if hasattr(F, "scaled_dot_product_attention"):
            with sdpa_context():
                out = F.scaled_dot_product_attention(q, k, v)
        else:
            s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
            out = torch.softmax(s.float(), dim=-1).to(q.dtype) @ v
        return out.transpose(1, 2)

    return attend


def sparge_attention(topk, topp):
    def attend(q, k, v):
        return sparge.sparge_attention(q, k, v, layout="bnhd", topk=topk, topp=topp)

    return attend


def cudnn_context(device):
    """(context manager factory, name) for SDPA's cuDNN backend; the default choice where it is missing."""
    import contextlib

    if device.type == "cuda":
        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            probe = torch.randn(1, 2, 256, 64, device=device, dtype=torch.bfloat16).transpose(1, 2)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                F.scaled_dot_product_attention(probe, probe, probe)
            return (lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION)), "SDPA cuDNN"
        except (ImportError, AttributeError, RuntimeError) as e:
            print(f"note: SDPA's cuDNN backend is unavailable ({str(e).splitlines()[0]}); dense uses SDPA's "
                  "default choice")
    name = "SDPA" if hasattr(F, "scaled_dot_product_attention") else "softmax(QKᵀ)V"
    return contextlib.nullcontext, name


class Timer:
    def __init__(self, device, warmup, iters):
        self.device, self.warmup, self.iters = device, warmup, iters

    def __call__(self, fn):
        """Median milliseconds of fn()."""
        for _ in range(self.warmup):
            fn()
        if self.device.type == "cuda":
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(self.iters)]
            for start, stop in events:
                start.record()
                fn()
                stop.record()
            torch.cuda.synchronize(self.device)
            return statistics.median(start.elapsed_time(stop) for start, stop in events)
        times = []
        for _ in range(self.iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)


def bench_model(name, args, device, dtype, timer, sdpa_context, dense_name):
    cfg = MODELS[name]
    depth = cfg["blocks"]
    timed = min(depth, args.blocks or DEFAULT_BLOCKS[name] or depth)
    scale = depth / timed
    N = math.prod(cfg["grid"])
    torch.manual_seed(args.seed)
    dense = dense_attention(sdpa_context)
    blocks = [WanBlock(cfg["dim"], cfg["heads"], cfg["ffn"], dense, dense).to(device=device, dtype=dtype)
              for _ in range(timed)]
    x = torch.randn(1, N, cfg["dim"], device=device, dtype=dtype)
    context = torch.randn(1, cfg["text"], cfg["dim"], device=device, dtype=dtype)
    t_emb = torch.randn(1, 6, cfg["dim"], device=device, dtype=dtype) * 0.1
    cos, sin = rope_tables(cfg["grid"], cfg["dim"] // cfg["heads"], device)

    def step():
        h = x
        for block in blocks:
            h = block(h, context, t_emb, cos, sin)
        return h

    with torch.no_grad():
        e0 = (blocks[0].modulation + t_emb).chunk(6, dim=1)
        qkv0 = blocks[0].qkv(x, e0, cos, sin)
        sparsities = {method: [] for method, topk, _ in METHODS if topk is not None}
        h = x
        for block in blocks:  # the dense step, with each block's mask sparsities on its own q and k
            q, k, _ = block.qkv(h, (block.modulation + t_emb).chunk(6, dim=1), cos, sin)
            for method, topk, topp in METHODS:
                if topk is not None:
                    mask = sparge.predict_mask(q, k, topk=topk, topp=topp, layout="bnhd")
                    sparsities[method].append(mask.sparsity)
            h = block(h, context, t_emb, cos, sin)
        reference = h.float()
        del q, k, h
        rows = []
        for method, topk, topp in METHODS:
            attend = dense if topk is None else sparge_attention(topk, topp)
            for block in blocks:
                block.self_attention = attend
            step_ms = timer(step) * scale
            attn_ms = timer(lambda: attend(*qkv0)) * depth
            out = step().float()
            rel = float((out - reference).norm() / reference.norm())
            rows.append(dict(model=name, method=method if topk is not None else f"dense ({dense_name})",
                             tokens=N, blocks=depth, blocks_timed=timed,
                             sparsity=statistics.mean(sparsities[method]) if topk is not None else 0.0,
                             step_ms=step_ms, attention_ms=attn_ms, rel_l2_vs_dense=rel))
    dense_row = rows[0]
    for row in rows:
        row["step_speedup"] = dense_row["step_ms"] / row["step_ms"]
        row["attention_speedup"] = dense_row["attention_ms"] / row["attention_ms"]
        row["attention_share"] = row["attention_ms"] / row["step_ms"]
    del blocks
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("1.3B", "14B", "all"), default="all")
    parser.add_argument("--blocks", type=int, default=None, help="blocks to build and time (scaled to the depth)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU in float32 (smoke run)")
    parser.add_argument("--device", default=None, help="default: cuda, or cpu with --tiny")
    parser.add_argument("--warmup", type=int, default=None, help="default 1 (the first run also loads the library)")
    parser.add_argument("--iters", type=int, default=None, help="default 3 (1 with --tiny)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--csv", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    if args.blocks is not None and args.blocks < 1:
        parser.error("--blocks must be >= 1")
    device = torch.device(args.device or ("cpu" if args.tiny else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: use --tiny (CPU) or --device cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    names = ["tiny"] if args.tiny else (["1.3B", "14B"] if args.model == "all" else [args.model])
    timer = Timer(device, args.warmup if args.warmup is not None else 1,
                  args.iters if args.iters is not None else (1 if args.tiny else 3))
    sdpa_context, dense_name = cudnn_context(device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"dit_bench: {gpu}, torch {torch.__version__}, sparge {sparge.__version__} ({sparge.library_path}), "
          f"{dtype}")
    rows = []
    for name in names:
        rows += bench_model(name, args, device, dtype, timer, sdpa_context, dense_name)
    header = ("| model | self-attention | sparsity | step ms | step speedup | attention ms / step | attention speedup "
              "| attention share | rel. L2 vs dense |")
    print(header)
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        scaled = f" ({r['blocks_timed']}/{r['blocks']} blocks timed)" if r["blocks_timed"] != r["blocks"] else ""
        print(f"| {r['model']}{scaled} | {r['method']} | {100 * r['sparsity']:.1f} % | {r['step_ms']:.1f} | "
              f"{r['step_speedup']:.2f}x | {r['attention_ms']:.1f} | {r['attention_speedup']:.2f}x | "
              f"{100 * r['attention_share']:.0f} % | {r['rel_l2_vs_dense']:.3f} |")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            fields = ["model", "method", "tokens", "blocks", "blocks_timed", "sparsity", "step_ms", "step_speedup",
                      "attention_ms", "attention_speedup", "attention_share", "rel_l2_vs_dense"]
            writer = csv.DictWriter(f, fieldnames=fields + ["device", "dtype", "torch"])
            writer.writeheader()
            for r in rows:
                writer.writerow({**{key: r[key] for key in fields}, "device": gpu, "dtype": str(dtype),
                                 "torch": torch.__version__})
        print(f"wrote {args.csv}")
    return rows


if __name__ == "__main__":
    main()
