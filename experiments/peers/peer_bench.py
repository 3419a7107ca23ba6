#!/usr/bin/env python3
"""Time sparge's forward peers in PyTorch on the same shapes and the same block mask.

Peers: SDPA with the FlashAttention-2 backend, SDPA with the cuDNN backend (both dense)
and FlexAttention with the block mask that sparge predicted, exported by
`sparge bench ... --export-mask PREFIX` as PREFIX.json + PREFIX.u8 (dense uint8
[B,H,Nqb,Nkb]). The BlockMask is built with create_block_mask from a block-level
lookup M[b,h,q//bq,k//bk] (DESIGN.md section 4: BlockMask.from_kv_blocks gave wrong
outputs). Every peer's output is checked against an fp64 masked reference on sampled
query blocks before it is timed; a peer that fails the check is reported, not timed.

Timing: CUDA events, median of --reps runs after --warmup runs (DESIGN.md section 4). The "host ms" column is the
host's time per call while queuing those runs: where it nears the GPU time, the GPU waits for the host.
Dense-equivalent TFLOP/s = 4*B*H*Nq*Nk*D / t; effective = that times the kept density.

With --backward (added by cuda-bwd) each peer's backward is timed instead: dQ, dK, dV of its forward
through autograd (TFLOP/s ×2.5, DESIGN.md section 4), dQ checked against fp64 on sampled query blocks.
FlexAttention's backward is tried on the mask's own blocks first, then on the same tokens in finer and in
its default 128×128 blocks (flex_bwd_attempts); the row's mask name carries the granularity that ran.

With --sparge, sparge itself runs in the same process through its Python binding (python/sparge; the library from
SPARGE_BUILD_DIR or SPARGE_LIBRARY) on the identical mask, set from the file, with the same tensors, checks and
timing as the peers: its forward (or, with --backward, its backward through autograd), and its mask prediction on
these tensors (Top-k --topk ∪ Top-p --topp; a prediction costs about the same whatever it selects), so that
"mask prediction included" comparisons need no second process. The sparge+mask-prediction row times the two as
one operation, the prediction on these tensors then the forward on the file's mask, queued as a model runs them
(timed alone, the short prediction waits for its own host overhead; see the host ms column).

usage: peer_bench.py --mask PREFIX [--mask PREFIX ...] [--csv FILE] [--backward] [--sparge]
       peer_bench.py --B 1 --H 12 --N 32760 --D 128       (dense peers only)
"""
import argparse
import csv
import json
import math
import os
import sys
import time

import numpy as np
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 3e-3, torch.float32: 1e-5}  # DESIGN.md section 3


def load_mask(prefix):
    with open(prefix + ".json") as f:
        meta = json.load(f)
    shape = (meta["B"], meta["H"], meta["Nqb"], meta["Nkb"])
    dense = np.fromfile(prefix + ".u8", dtype=np.uint8)
    if dense.size != math.prod(shape):
        sys.exit(f"{prefix}.u8 holds {dense.size} bytes, {shape} needs {math.prod(shape)}")
    return meta, torch.from_numpy(dense.reshape(shape) != 0)


def time_ms(fn, warmup, reps):
    """(Median ms between CUDA events around each run, mean host ms per call.) The runs are queued back to back and
    synchronized once, so the host's launch overhead (large for a compiled FlexAttention call) overlaps the
    previous run; where the host takes longer per call than the GPU, the GPU waits and the events include that."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    t0 = time.perf_counter()
    for start, stop in events:
        start.record()
        fn()
        stop.record()
    host_ms = (time.perf_counter() - t0) * 1e3 / reps
    torch.cuda.synchronize()
    return float(np.median([start.elapsed_time(stop) for start, stop in events])), host_ms


def reference_rel_l2(out, q, k, v, scale, blocks, block_q, block_k, samples, seed=0):
    """fp64 masked attention on `samples` random query blocks; relative L2 of out there.
    blocks: bool [B,H,Nqb,Nkb] on the device, or None for dense."""
    B, H, Nq, _ = q.shape
    Nk = k.shape[2]
    gen = torch.Generator().manual_seed(seed)
    num = den = 0.0
    for _ in range(samples):
        b = int(torch.randint(B, (1,), generator=gen))
        h = int(torch.randint(H, (1,), generator=gen))
        i = int(torch.randint((Nq + block_q - 1) // block_q, (1,), generator=gen))
        rows = slice(i * block_q, min((i + 1) * block_q, Nq))
        s = (q[b, h, rows].double() @ k[b, h].double().T) * scale
        if blocks is not None:
            keep = blocks[b, h, i].repeat_interleave(block_k)[:Nk]
            s[:, ~keep] = -math.inf
        ref = torch.softmax(s, dim=-1) @ v[b, h].double()
        num += (out[b, h, rows].double() - ref).square().sum().item()
        den += ref.square().sum().item()
    return math.sqrt(num / den)


def reference_dq_rel_l2(dq, q, k, v, d_o, scale, blocks, block_q, block_k, samples, seed=0):
    """fp64 dQ of masked attention on `samples` random query blocks, exact from those rows alone
    (dQ = scale·(P∘(dP − rowsum(dO∘O)))·K); relative L2 of dq there."""
    B, H, Nq, _ = q.shape
    Nk = k.shape[2]
    gen = torch.Generator().manual_seed(seed)
    num = den = 0.0
    with torch.no_grad():
        for _ in range(samples):
            b = int(torch.randint(B, (1,), generator=gen))
            h = int(torch.randint(H, (1,), generator=gen))
            i = int(torch.randint((Nq + block_q - 1) // block_q, (1,), generator=gen))
            rows = slice(i * block_q, min((i + 1) * block_q, Nq))
            kk, vv, dob = k[b, h].double(), v[b, h].double(), d_o[b, h, rows].double()
            s = (q[b, h, rows].double() @ kk.T) * scale
            if blocks is not None:
                keep = blocks[b, h, i].repeat_interleave(block_k)[:Nk]
                s[:, ~keep] = -math.inf
            p = torch.softmax(s, dim=-1)
            ds = p * (dob @ vv.T - (dob * (p @ vv)).sum(-1, keepdim=True))
            ref = scale * ds @ kk
            num += (dq[b, h, rows].double() - ref).square().sum().item()
            den += ref.square().sum().item()
    return math.sqrt(num / den)


def flex_bwd_attempts(bq, bk):
    """(BlockMask granularity, kernel_options) for FlexAttention's backward, in the order tried. With its default
    tiles, torch 2.11 finds no backward kernel for 128×64 BlockMasks (NoValidChoicesError): tiles that divide the
    mask blocks are given explicitly (the bwd_/fwd_ prefixes address one pass; dK/dV needs BLOCK_N1 % BLOCK_M1 == 0
    and dQ BLOCK_M2 % BLOCK_N2 == 0), then the same token mask as 64×64 blocks, then as FlexAttention's default
    128×128 blocks."""
    def bwd(m1, n1, m2, n2, stages=None):
        o = {"bwd_BLOCK_M1": m1, "bwd_BLOCK_N1": n1, "bwd_BLOCK_M2": m2, "bwd_BLOCK_N2": n2}
        return o if stages is None else {**o, "bwd_num_stages": stages}
    own = (bq, bk)
    tries = [(own, None), (own, bwd(64, 64, 64, 64)), (own, bwd(32, 64, 64, 32)), (own, bwd(64, 64, 64, 64, 1))]
    if bq % 64 == 0 and bk % 64 == 0 and own != (64, 64):
        tries.append(((64, 64), {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, **bwd(32, 64, 64, 32, 1)}))
    if own != (128, 128):  # FlexAttention's default granularity; more work for it where a block is partly kept
        tries.append(((128, 128), None))
    return tries


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mask", action="append", default=[], help="PREFIX of an exported mask (repeatable)")
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=12)
    ap.add_argument("--N", type=int, default=32760)
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--samples", type=int, default=6, help="query blocks checked against fp64 per peer")
    ap.add_argument("--no-dense", action="store_true", help="skip the SDPA peers")
    ap.add_argument("--csv", help="write the rows here")
    ap.add_argument("--backward", action="store_true", help="time the peers' backward (dQ, dK, dV) instead")
    ap.add_argument("--sparge", action="store_true", help="also time sparge on each mask (Python binding)")
    ap.add_argument("--topk", type=float, default=0.03, help="--sparge: Top-k of the timed mask prediction")
    ap.add_argument("--topp", type=float, default=0.2, help="--sparge: Top-p of the timed mask prediction")
    args = ap.parse_args()
    if args.sparge:
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))
        import sparge

    masks = [load_mask(p) + (p,) for p in args.mask]
    if masks:  # the shape comes from the (first) mask
        meta = masks[0][0]
        B, H, Nq, Nk, D, dtype = meta["B"], meta["H"], meta["Nq"], meta["Nk"], meta["D"], DTYPES[meta["dtype"]]
        for m, _, p in masks[1:]:
            if (m["B"], m["H"], m["Nq"], m["Nk"], m["D"]) != (B, H, Nq, Nk, D):
                sys.exit(f"{p}: shape differs from {masks[0][2]}")
    else:
        B, H, Nq, Nk, D, dtype = args.B, args.H, args.N, args.N, args.D, DTYPES[args.dtype]
    dev = torch.device("cuda")
    torch.manual_seed(1)
    q = torch.randn(B, H, Nq, D, device=dev, dtype=dtype)
    k = torch.randn(B, H, Nk, D, device=dev, dtype=dtype)
    v = torch.randn(B, H, Nk, D, device=dev, dtype=dtype)
    scale = 1.0 / math.sqrt(D)
    flops = 4.0 * B * H * Nq * Nk * D
    if args.backward:
        for x in (q, k, v):
            x.requires_grad_()
        d_o = torch.randn(B, H, Nq, D, device=dev, dtype=dtype)
        flops *= 2.5
    tol = TOLERANCE[dtype]
    rows = []
    print(f"peers on {torch.cuda.get_device_name()} (torch {torch.__version__}), B={B} H={H} Nq={Nq} Nk={Nk} D={D} "
          f"{str(dtype).split('.')[-1]}, median of {args.reps} after {args.warmup} warm-up, CUDA events")
    print(f"{'peer':<22} {'mask':<28} {'sparsity':>8} {'ms':>9} {'TFLOP/s':>9} {'eff TF/s':>9} {'relL2':>9} {'host ms':>8}")

    def report(peer, mask_name, sparsity, fn):
        out = fn()
        timed = fn
        if args.backward:
            def timed():
                return torch.autograd.grad(out, (q, k, v), d_o, retain_graph=True)
            err = reference_dq_rel_l2(timed()[0], q, k, v, d_o, scale, blk, bq, bk, args.samples)
        else:
            err = reference_rel_l2(out, q, k, v, scale, blk, bq, bk, args.samples)
        ok = math.isfinite(err) and err <= tol
        ms, host_ms = time_ms(timed, args.warmup, args.reps) if ok else (float("nan"), float("nan"))
        row = {"peer": peer, "mask": mask_name, "B": B, "H": H, "Nq": Nq, "Nk": Nk, "D": D,
               "sparsity": sparsity, "ms": ms, "tflops": flops / (ms * 1e9),
               "eff_tflops": flops * (1 - sparsity) / (ms * 1e9), "rel_l2": err, "verified": ok, "host_ms": host_ms}
        rows.append(row)
        print(f"{peer:<22} {mask_name:<28} {100 * sparsity:7.2f}% {ms:9.3f} {row['tflops']:9.1f} "
              f"{row['eff_tflops']:9.1f} {err:9.2e} {host_ms:8.3f}{'' if ok else '  FAILED the reference check, not timed'}",
              flush=True)

    blk, bq, bk = None, 128, 64
    if not args.no_dense:
        for name, backend in (("sdpa-flash", SDPBackend.FLASH_ATTENTION), ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION)):
            def run(backend=backend):
                with sdpa_kernel(backend):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale)
            try:
                report(name, "dense", 0.0, run)
            except RuntimeError as e:  # backend not available for this shape or build
                print(f"{name:<22} unavailable: {str(e).splitlines()[0]}")

    flex = torch.compile(flex_attention, dynamic=False)
    flex_bwd_known = None  # the backward attempt that compiled for an earlier mask, tried first
    for meta, blocks, prefix in masks:
        bq, bk = meta["block_q"], meta["block_k"]
        blk = blocks.to(dev)
        Nqb, Nkb = meta["Nqb"], meta["Nkb"]

        def block_mask_at(flex_bq, flex_bk, blk=blk, bq=bq, bk=bk, Nqb=Nqb, Nkb=Nkb):
            """The mask's token pattern as a BlockMask of flex_bq × flex_bk blocks: the same tokens are kept whatever
            the granularity (FlexAttention applies the lookup per token inside blocks that are partly kept)."""
            def lookup(b, h, q_idx, kv_idx):
                return blk[b, h, torch.clamp(q_idx // bq, max=Nqb - 1), torch.clamp(kv_idx // bk, max=Nkb - 1)]
            # _compile=True evaluates the lookup block by block instead of materializing [B,H,Nq,Nk].
            return create_block_mask(lookup, B, H, Nq, Nk, device=dev, BLOCK_SIZE=(flex_bq, flex_bk), _compile=True)

        sparsity = 1.0 - blk.float().mean().item()
        name = prefix.split("/")[-1]
        attempts = [((bq, bk), None)]
        if args.backward:  # the first that compiles is timed
            tries = flex_bwd_attempts(bq, bk)
            attempts = [a for a in tries if a == flex_bwd_known] + [a for a in tries if a != flex_bwd_known]
        for (fq, fk), options in attempts:
            block_mask = block_mask_at(fq, fk)
            tag = name if (fq, fk) == (bq, bk) else f"{name}@{fq}x{fk}"
            try:
                report("flex", tag, sparsity,
                       lambda: flex(q, k, v, block_mask=block_mask, scale=scale, kernel_options=options))
                if args.backward:
                    print(f"{'':<22} (FlexAttention ran with {fq}x{fk} blocks, kernel_options {options})", flush=True)
                    flex_bwd_known = ((fq, fk), options)
                break
            except Exception as e:  # no kernel for these blocks and options: say why, try the next
                print(f"{'flex':<22} {tag:<28} failed with kernel_options {options}: {type(e).__name__}: "
                      f"{' '.join(str(e).split())[:300]}", flush=True)
                torch._dynamo.reset()
        if args.sparge:
            smask = sparge.Mask.from_dense(blk, Nq, Nk, bq, bk, device=dev)
            predicted = sparge.Mask(B, H, Nq, Nk, bq, bk, device=dev)

            def forward():
                return sparge.sparge_attention(q, k, v, mask=smask, block_q=bq, block_k=bk)

            def predict():
                return predicted.predict(q, k, topk=args.topk, topp=args.topp)

            report("sparge", name, sparsity, forward)
            ms, host_ms = time_ms(predict, args.warmup, args.reps)
            rows.append({**rows[-1], "peer": "sparge-mask-prediction", "mask": f"k={args.topk} p={args.topp}",
                         "sparsity": predicted.sparsity, "ms": ms, "tflops": float("nan"),
                         "eff_tflops": float("nan"), "rel_l2": float("nan"), "verified": True, "host_ms": host_ms})
            print(f"{'sparge-mask-prediction':<22} {'(these tensors)':<28} {100 * predicted.sparsity:7.2f}% "
                  f"{ms:9.3f} {'':9} {'':9} {'':9} {host_ms:8.3f}", flush=True)
            if not args.backward:  # both queued as one operation, as a model runs them (host time overlaps)
                def predict_then_forward():
                    predict()
                    return forward()
                report("sparge+mask-prediction", name, sparsity, predict_then_forward)

    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
            w.writeheader()
            w.writerows(rows)
        print(f"wrote {args.csv}")


if __name__ == "__main__":
    main()
