"""Peer benchmark on the GPU: sparge against SDPA (FlashAttention-2 and cuDNN backends) and FlexAttention,
on the same tensors and, for FlexAttention, the same predicted mask; forward and backward, per sparsity level.

    python3 python/examples/peer_bench.py                          # B=1 H=12 N=32768 D=128 bf16
    python3 python/examples/peer_bench.py --N 32760 --csv wan.csv  # Wan2.1-1.3B 480p
    python3 python/examples/peer_bench.py --N 4096 --iters 5       # a quick look

Per level, sparge's mask is predicted once (hybrid Top-k ∪ Top-p) and handed to FlexAttention as a BlockMask
built with create_block_mask from the lookup M[b,h,q//bq,k//bk] over sparge's dense mask. Before timing,
sparge's O is checked against FlexAttention's (rel. L2 ≤ 1e-2, bf16) and both against an fp32 masked
reference on one head; a level that fails is not timed and the script exits 1. Times are the median of
--iters CUDA-event-timed runs after --warmup runs; TFLOP/s are dense-equivalent (4·B·H·Nq·Nk·D / t forward,
×2.5 backward, DESIGN.md §4). Prints a table and writes a CSV.
"""
import argparse
import csv
import datetime
import math
import os
import statistics
import subprocess
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import sparge  # noqa: E402

FWD_TOL = 1e-2  # bf16, DESIGN.md §3
GRAD_TOL = 2e-2  # two bf16 implementations, each within 1e-2 of the exact gradient


# FlexAttention backward attempts in order: (BlockMask granularity, None = the mask's own; kernel_options). torch
# 2.11 finds no backward kernel for 128x64 BlockMasks, with its own or explicit tiles (NoValidChoicesError); the
# last attempt is the same token mask in FlexAttention's default 128x128 blocks, where it computes every partly
# kept block and masks it per token (about twice the token pairs of a random 95 % mask).
FLEX_BWD_ATTEMPTS = ((None, None),
                     (None, {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64}),
                     ((128, 128), None))


def rel_l2(a, b):
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm()) if torch.isfinite(a).all() else float("inf")


def cuda_time(fn, warmup, iters):
    """Median milliseconds of fn over iters runs, each between two CUDA events on the current stream."""
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, stop in events:
        start.record()
        fn()
        stop.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(stop) for start, stop in events)


def parse_levels(text):
    levels = []
    for item in text.split(","):
        topk, topp = item.split(":")
        levels.append((float(topk), float(topp)))
    return levels


def git_commit():
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


class Flex:
    """FlexAttention, compiled once. BlockMasks come from create_block_mask over the lookup
    keep[b, h, q // bq, k // bk]; keep is one persistent buffer refilled per level, so the compiled
    mask builder is reused instead of recompiled."""

    def __init__(self, keep_shape, device, bq, bk):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        self.create_block_mask = create_block_mask
        import torch._functorch.config

        # The backward is timed over one retained graph, which a compiled backward with donated buffers refuses.
        torch._functorch.config.donated_buffer = False
        self.attend = torch.compile(flex_attention, dynamic=False)
        self.keep = torch.zeros(keep_shape, dtype=torch.bool, device=device)
        self.bq, self.bk = bq, bk
        self.bwd_known = None  # (grain, kernel_options) of the backward that compiled for an earlier level

    def block_mask(self, dense, Nq, Nk, grain=None):
        """dense's token pattern as a BlockMask of grain (default: the mask's own bq × bk) blocks."""
        self.keep.copy_(dense.bool())
        keep, bq, bk = self.keep, self.bq, self.bk
        last_q, last_k = keep.shape[2] - 1, keep.shape[3] - 1

        def lookup(b, h, q_idx, kv_idx):
            # Clamped: the builder may pad the lengths past the last block; FlexAttention masks padding itself.
            return keep[b, h, torch.clamp(q_idx // bq, max=last_q), torch.clamp(kv_idx // bk, max=last_k)]

        B, H = keep.shape[:2]
        # _compile=True builds the mask block by block; uncompiled, it materializes [B,H,Nq,Nk].
        return self.create_block_mask(lookup, B, H, Nq, Nk, device=keep.device, BLOCK_SIZE=grain or (bq, bk),
                                      _compile=True)


def dense_peers():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def peer(backend):
        def run(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v)

        return run

    return {"sdpa-flash": peer(SDPBackend.FLASH_ATTENTION), "sdpa-cudnn": peer(SDPBackend.CUDNN_ATTENTION)}


def time_fwd_bwd(attend, q, k, v, d_o, args):
    """(forward ms, backward ms) of attend(q, k, v); the backward alone, on a retained graph."""
    with torch.no_grad():
        fwd = cuda_time(lambda: attend(q, k, v), args.warmup, args.iters)
    out = attend(q, k, v)
    bwd = cuda_time(lambda: torch.autograd.grad(out, (q, k, v), d_o, retain_graph=True), args.warmup, args.iters)
    return fwd, bwd


def one_head_reference(q, k, v, token_mask, scale):
    """fp32 masked attention of batch 0, head 0: [Nq, D]."""
    s = (q[0, 0].float() @ k[0, 0].float().T) * scale
    s.masked_fill_(~token_mask, float("-inf"))
    return torch.softmax(s, dim=-1) @ v[0, 0].float()


def first_line(e):
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def run_level(level, q, k, v, d_o, flex, scale, record, failed, args):
    """Predict sparge's mask for one (topk, topp), check sparge against FlexAttention and an fp32 head,
    then time both. Returns the table line."""
    topk, topp = level
    tag = f"k={topk:g} p={topp:g}"
    bq, bk = args.block_q, args.block_k
    N = q.shape[2]
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    mask = sparge.predict_mask(qd, kd, topk=topk, topp=topp, block_q=bq, block_k=bk)
    st = mask.stats()
    mask_ms = cuda_time(lambda: mask.predict(qd, kd, topk=topk, topp=topp), args.warmup, args.iters)
    keep = mask.dense.bool()

    # Correctness first: sparge vs FlexAttention on the same mask, and both vs an fp32 reference on one head.
    head_mask = keep[0, 0].repeat_interleave(bq, 0)[:N].repeat_interleave(bk, 1)[:, :N]
    with torch.no_grad():
        ref = one_head_reference(q, k, v, head_mask, scale)
        o_sparge, _ = sparge.attention_forward(qd, kd, vd, mask)
    del head_mask
    checks = [f"head0 vs fp32: sparge {rel_l2(o_sparge[0, 0], ref):.2e}"]
    ok = rel_l2(o_sparge[0, 0], ref) <= FWD_TOL
    flex_attend = None
    if flex is not None:
        try:
            block_mask = flex.block_mask(keep, N, N)
            flex_attend = lambda a, b, c: flex.attend(a, b, c, block_mask=block_mask, scale=scale)  # noqa: E731
            with torch.no_grad():
                o_flex = flex_attend(q, k, v)
            checks.append(f"flex {rel_l2(o_flex[0, 0], ref):.2e}")
            err = rel_l2(o_sparge, o_flex)
            checks.append(f"O sparge-flex {err:.2e}")
            ok = ok and err <= FWD_TOL and rel_l2(o_flex[0, 0], ref) <= FWD_TOL
            del o_flex
        except Exception as e:
            checks.append(f"flex forward failed ({first_line(e)})")
            flex_attend = None
    del ref, o_sparge

    # Flex's forward is timed now: its backward attempts below may take minutes to compile and fail.
    nan = float("nan")
    f_fwd = f_bwd = nan
    if flex_attend is not None:
        with torch.no_grad():
            f_fwd = cuda_time(lambda: flex_attend(q, k, v), args.warmup, args.iters)

    sparge_attend = lambda a, b, c: sparge.sparge_attention(a, b, c, mask=mask, block_q=bq, block_k=bk)  # noqa: E731
    grads_s = torch.autograd.grad(sparge_attend(q, k, v), (q, k, v), d_o)
    flex_bwd_ok = False
    flex_bwd_attend = None
    if flex_attend is not None and args.no_flex_backward:
        checks.append("flex backward not run (--no-flex-backward)")
    elif flex_attend is not None:
        failures = []
        # The attempt that worked for an earlier level first: failed compilations take long.
        known = flex.bwd_known
        attempts = [a for a in FLEX_BWD_ATTEMPTS if a == known] + [a for a in FLEX_BWD_ATTEMPTS if a != known]
        for grain, options in attempts:
            bwd_mask = block_mask if grain is None else flex.block_mask(keep, N, N, grain)
            attend = lambda a, b, c, m=bwd_mask, o=options: flex.attend(  # noqa: E731
                a, b, c, block_mask=m, scale=scale, kernel_options=o)
            try:
                grads_f = torch.autograd.grad(attend(q, k, v), (q, k, v), d_o)
            except Exception as e:
                failures.append(f"{grain or (bq, bk)} blocks, {options}: {first_line(e)[:80]}")
                continue
            flex.bwd_known = (grain, options)
            errs = [rel_l2(a, b) for a, b in zip(grads_s, grads_f)]
            checks.append(f"dQ/dK/dV sparge-flex (flex {grain or (bq, bk)} blocks, kernel_options {options}) " +
                          "/".join(f"{e:.2e}" for e in errs))
            ok = ok and all(e <= GRAD_TOL for e in errs)
            del grads_f
            flex_bwd_ok, flex_bwd_attend = True, attend
            break
        if not flex_bwd_ok:
            checks.append("flex backward failed (" + "; ".join(failures) + ")")
    del grads_s
    check = "; ".join(checks)
    if not ok:
        failed.append(f"{tag}: {check}")

    s_fwd, s_bwd = time_fwd_bwd(sparge_attend, q, k, v, d_o, args) if ok else (nan, nan)
    if flex_bwd_ok:
        out = flex_bwd_attend(q, k, v)
        f_bwd = cuda_time(lambda: torch.autograd.grad(out, (q, k, v), d_o, retain_graph=True), args.warmup,
                          args.iters)
    record(level, st.sparsity, st.token_density, "sparge-mask", "predict", mask_ms)
    record(level, st.sparsity, st.token_density, "sparge", "forward", s_fwd, check)
    record(level, st.sparsity, st.token_density, "sparge", "backward", s_bwd, check)
    record(level, st.sparsity, st.token_density, "flex", "forward", f_fwd)
    record(level, st.sparsity, st.token_density, "flex", "backward", f_bwd)
    return dict(level=tag, sparsity=st.sparsity, density=st.token_density, mask_ms=mask_ms, s_fwd=s_fwd,
                s_bwd=s_bwd, f_fwd=f_fwd, f_bwd=f_bwd, check=check)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--B", type=int, default=1)
    parser.add_argument("--H", type=int, default=12)
    parser.add_argument("--N", type=int, default=32768)
    parser.add_argument("--D", type=int, default=128)
    parser.add_argument("--levels", default="0.03:0.2,0.03:0,0.05:0,0.1:0,0.2:0",
                        help="comma-separated topk:topp pairs (topp 0: Top-k only, an exact kept fraction)")
    parser.add_argument("--block-q", type=int, default=128)
    parser.add_argument("--block-k", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--csv", default=os.path.join(os.environ.get("OUT", "."), "peer_bench.csv"))
    parser.add_argument("--commit", default=None, help="commit to record (default: git rev-parse, if any)")
    parser.add_argument("--no-flex-backward", action="store_true",
                        help="skip FlexAttention's backward (torch 2.11 cannot compile it for 128x64 blocks; each "
                             "failed attempt costs about a minute of compilation)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("peer_bench: needs a CUDA GPU")

    B, H, N, D, bq, bk = args.B, args.H, args.N, args.D, args.block_q, args.block_k
    scale = 1.0 / math.sqrt(D)
    flops_fwd = 4.0 * B * H * N * N * D
    device = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(B, H, N, D, device=device, dtype=torch.bfloat16, generator=g).requires_grad_()
               for _ in range(3))
    d_o = torch.randn(B, H, N, D, device=device, dtype=torch.bfloat16, generator=g)
    gpu = torch.cuda.get_device_name(device)
    commit = args.commit or git_commit()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"peer_bench {stamp}, {gpu}, torch {torch.__version__}, commit {commit}, libsparge {sparge.library_path}")
    print(f"shape B={B} H={H} Nq=Nk={N} D={D} bf16, blocks {bq}x{bk}, median of {args.iters} after {args.warmup}")

    rows = []  # CSV records
    failed = []

    def record(level, sparsity, density, impl, which, ms, check=""):
        flops = flops_fwd * (2.5 if which == "backward" else 1.0)
        tflops = flops / (ms * 1e-3) / 1e12 if ms == ms else float("nan")
        rows.append(dict(date=stamp, gpu=gpu, commit=commit, B=B, H=H, N=N, D=D, block_q=bq, block_k=bk,
                         topk=level[0], topp=level[1], sparsity=sparsity, token_density=density, impl=impl,
                         direction=which, median_ms=ms, dense_equiv_tflops=tflops, check=check))

    # Dense peers: one measurement, the same for every level.
    dense = {}
    for name, attend in dense_peers().items():
        try:
            dense[name] = time_fwd_bwd(attend, q, k, v, d_o, args)
        except Exception as e:  # a backend this build or GPU lacks: report it, go on
            print(f"  {name}: unavailable ({type(e).__name__}: {str(e).splitlines()[0][:160]})")
            dense[name] = (float("nan"), float("nan"))
        record(("", ""), 0.0, 1.0, name, "forward", dense[name][0])
        record(("", ""), 0.0, 1.0, name, "backward", dense[name][1])
    try:  # sparge with no mask: its dense kernel against the same SDPA output
        with torch.no_grad():
            sparge_dense = sparge.attention_forward(q, k, v)[0]
            check = f"relL2 vs sdpa {rel_l2(sparge_dense, F.scaled_dot_product_attention(q, k, v)):.2e}"
            del sparge_dense
            dense_fwd = cuda_time(lambda: sparge.attention_forward(q, k, v), args.warmup, args.iters)
    except Exception as e:
        dense_fwd, check = float("nan"), f"error: {first_line(e)}"
    record(("", ""), 0.0, 1.0, "sparge-dense", "forward", dense_fwd, check)
    best_fwd = min((t[0] for t in dense.values() if t[0] == t[0]), default=float("nan"))
    best_bwd = min((t[1] for t in dense.values() if t[1] == t[1]), default=float("nan"))
    for name, (f, b) in dense.items():
        print(f"  {name:12s} forward {f:8.3f} ms ({flops_fwd / f / 1e9:6.1f} TFLOP/s)   backward {b:8.3f} ms "
              f"({2.5 * flops_fwd / b / 1e9:6.1f} TFLOP/s)")
    print(f"  {'sparge-dense':12s} forward {dense_fwd:8.3f} ms ({flops_fwd / dense_fwd / 1e9:6.1f} TFLOP/s)  {check}")

    try:
        flex = Flex((B, H, -(-N // bq), -(-N // bk)), device, bq, bk)
    except Exception as e:
        print(f"  flex: unavailable ({type(e).__name__}: {e})")
        flex = None
    table = []
    for level in parse_levels(args.levels):
        try:
            table.append(run_level(level, q, k, v, d_o, flex, scale, record, failed, args))
        except Exception as e:  # e.g. a sparge kernel this build lacks: report it, go on with the next level
            print(f"  level k={level[0]:g} p={level[1]:g}: {type(e).__name__}: {e}")
            failed.append(f"k={level[0]:g} p={level[1]:g}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")

    print()
    header = (f"{'level':14s} {'sparsity':>8s} {'mask ms':>8s} {'sparge fwd':>10s} {'flex fwd':>9s} {'x flex':>7s} "
              f"{'x dense*':>8s} {'sparge bwd':>10s} {'flex bwd':>9s} {'x flex':>7s} {'x dense':>8s}")
    print(header)
    print("-" * len(header))
    for r in table:
        print(f"{r['level']:14s} {r['sparsity']:8.4f} {r['mask_ms']:8.3f} {r['s_fwd']:10.3f} {r['f_fwd']:9.3f} "
              f"{r['f_fwd'] / r['s_fwd']:7.2f} {best_fwd / (r['s_fwd'] + r['mask_ms']):8.2f} {r['s_bwd']:10.3f} "
              f"{r['f_bwd']:9.3f} {r['f_bwd'] / r['s_bwd']:7.2f} {best_bwd / r['s_bwd']:8.2f}")
    print(f"x flex: FlexAttention time / sparge time (same mask); x dense*: best dense SDPA forward "
          f"({best_fwd:.3f} ms) / (sparge mask prediction + forward); x dense: best dense SDPA backward "
          f"({best_bwd:.3f} ms) / sparge backward")
    for r in table:
        print(f"  {r['level']}: {r['check']}")

    with open(args.csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        writer.writeheader()
        for row in rows:
            writer.writerow(row)
    print(f"wrote {args.csv}")
    if failed:
        print("CHECK FAILED (not timed):\n  " + "\n  ".join(failed))
        sys.exit(1)


if __name__ == "__main__":
    main()
