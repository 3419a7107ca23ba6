"""Sequence-parallel sparge on GPUs over NCCL: Ulysses and context parallelism against the single-device call.

    python3 python/examples/parallel_check.py                                   # one GPU: P = 1
    python3 python/examples/parallel_check.py --H 40 --N 75600 --reps 3         # Wan2.1-14B shape
    torchrun --nproc-per-node 8 python/examples/parallel_check.py --H 40 --N 75600

Every rank builds the same whole-sequence q, k, v and output gradient (seeded, on its GPU), runs the
single-device call (mask prediction, forward, backward) and each scheme on its shard, and checks that its part
of the mask equals the single-device mask bit for bit and that its output and gradients are within bf16
tolerance of the single-device ones (rel. L2 ≤ 1e-2 and 2e-2; the max abs difference is printed too). It then
times each scheme (CUDA events, median of --reps after --warmup): the forward and the forward + backward as
they run, and once more with the device synchronized around each part to split a forward + backward into
communication, mask and attention. Rank 0 prints one row per scheme (the slowest rank's times) and the bytes
each rank sent and received per forward + backward beside a dense ring's. Exits 1 if a check fails.

Default shape: Wan2.1-1.3B (B=1 H=12 N=32760 D=128, bf16), Top-k 5 % (95 % sparse). --inputs banded adds a
positional signal to q and k so that blocks keep their neighbourhood, as video attention does; on random
inputs the key blocks kept by a rank's query blocks together cover nearly every shard. --kv-heads gives k and v
fewer heads (grouped K/V heads, dividing --H) and --causal makes the attention causal.
"""
import argparse
import datetime
import os
import socket
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import sparge  # noqa: E402
from sparge import parallel  # noqa: E402

OUT_TOL, GRAD_TOL = 1e-2, 2e-2


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--H", type=int, default=12)
    p.add_argument("--N", type=int, default=32760)
    p.add_argument("--D", type=int, default=128)
    p.add_argument("--kv-heads", type=int, default=None, help="K/V heads (dividing --H; default: --H)")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    p.add_argument("--layout", choices=("bhnd", "bnhd"), default="bhnd")
    p.add_argument("--topk", type=float, default=0.05)
    p.add_argument("--topp", type=float, default=0.0)
    p.add_argument("--block-q", type=int, default=128)
    p.add_argument("--block-k", type=int, default=64)
    p.add_argument("--inputs", choices=("random", "banded"), default="random")
    p.add_argument("--schemes", default="ulysses,context")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def init():
    """NCCL over the ranks torchrun started, or a group of one."""
    if not torch.cuda.is_available():
        sys.exit("parallel_check.py: no CUDA device: this check runs over NCCL on GPUs (on the CPU, "
                 "python/tests/test_parallel.py checks both schemes over gloo)")
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=10))
    return torch.device("cuda", local)


def inputs(args, device, dtype):
    g = torch.Generator(device=device)
    g.manual_seed(args.seed)
    q, k, v, d_out = (torch.randn((args.B, h, args.N, args.D), generator=g, device=device)
                      for h in (args.H, args.kv_heads or args.H, args.kv_heads or args.H, args.H))
    if args.inputs == "banded":
        pos = torch.arange(args.N, device=device, dtype=torch.float32)[:, None]
        freq = torch.linspace(2e-4, 5e-3, args.D, device=device)[None, :] * 6.283
        pe = 2.0 * torch.sin(pos * freq + torch.arange(args.D, device=device)[None, :])
        q, k = q + pe, k + pe
    ts = [t.to(dtype) for t in (q, k, v, d_out)]
    return [t.transpose(1, 2).contiguous() for t in ts] if args.layout == "bnhd" else ts


def cuda_ms(fn, warmup, reps):
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, stop in events:
        start.record()
        fn()
        stop.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in events)


def rel_l2(a, b):
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm()) if torch.isfinite(a).all() else float("inf")


def main():
    args = parse()
    device = init()
    P, rank = dist.get_world_size(), dist.get_rank()
    dtype = getattr(torch, args.dtype)
    dim = 2 if args.layout == "bhnd" else 1
    kw = dict(topk=args.topk, topp=args.topp, block_q=args.block_q, block_k=args.block_k, layout=args.layout)
    single = dict(kw, is_causal=args.causal, enable_gqa=True)
    q, k, v, d_out = inputs(args, device, dtype)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref, ref_mask = sparge.sparge_attention(*leaves, return_mask=True, **single)
    ref.backward(d_out)
    ref_grads, ref_dense, sparsity = [t.grad for t in leaves], ref_mask.dense, ref_mask.sparsity
    del leaves
    kw["causal"] = args.causal

    def single_step():
        ls = [t.detach().requires_grad_() for t in (q, k, v)]
        sparge.sparge_attention(*ls, **single).backward(d_out)

    with torch.no_grad():
        single_fwd = cuda_ms(lambda: sparge.sparge_attention(q, k, v, **single), args.warmup, args.reps)
    single_step_ms = cuda_ms(single_step, args.warmup, args.reps)

    rows, failed = [], False
    for scheme in args.schemes.split(","):
        fn = {"ulysses": parallel.ulysses_attention, "context": parallel.context_parallel_attention}[scheme]
        try:
            if scheme == "ulysses" and args.H % P:
                raise ValueError(f"P = {P} does not divide H = {args.H}")
            lengths = parallel.shard_lengths(args.N, P, scheme=scheme, block_q=args.block_q, block_k=args.block_k)
        except ValueError as e:
            rows.append(dict(scheme=scheme, skipped=str(e)))
            continue
        local = lambda t: parallel.local_shard(t, lengths, rank, dim).contiguous()  # noqa: E731
        shard = [local(t).requires_grad_() for t in (q, k, v)]
        g_local = local(d_out)
        stats = parallel.CommStats()
        out, mask = fn(*shard, return_mask=True, stats=stats, **kw)
        out.backward(g_local)
        if scheme == "ulysses":
            want = ref_dense[:, rank * args.H // P:(rank + 1) * args.H // P]
        else:
            first = sum(lengths[:rank]) // args.block_q
            want = ref_dense[:, :, first:first + mask.Nqb]
        check = dict(mask_equal=bool(torch.equal(mask.dense, want)), out=rel_l2(out, local(ref)))
        check["max_abs"] = float((out.float() - local(ref).float()).abs().max())
        for name, g_, r in zip(("dq", "dk", "dv"), (t.grad for t in shard), ref_grads):
            check[name] = rel_l2(g_, local(r))
            check["max_abs"] = max(check["max_abs"], float((g_.float() - local(r).float()).abs().max()))
        ok = check["mask_equal"] and check["out"] <= OUT_TOL and max(check[x] for x in ("dq", "dk", "dv")) <= GRAD_TOL
        failed |= not ok

        detached = [t.detach() for t in shard]

        def step():
            ls = [t.detach().requires_grad_() for t in detached]
            fn(*ls, **kw).backward(g_local)

        with torch.no_grad():
            fwd_ms = cuda_ms(lambda: fn(*detached, **kw), args.warmup, args.reps)
        step_ms = cuda_ms(step, args.warmup, args.reps)
        timed = parallel.CommStats(timing=True)
        for _ in range(args.reps):
            ls = [t.detach().requires_grad_() for t in detached]
            fn(*ls, stats=timed, **kw).backward(g_local)
        parts = {name: 1e3 * timed.seconds.get(name, 0.0) / args.reps for name in ("comm", "mask", "attention")}
        rows.append(dict(scheme=scheme, ok=ok, check=check, fwd=fwd_ms, step=step_ms, parts=parts,
                         sent=stats.sent, received=stats.received, ring=stats.totals()["dense_ring_received"],
                         lengths=lengths))
        del out, shard, mask

    everyone = [None] * P
    dist.all_gather_object(everyone, rows)
    if rank == 0:
        report(args, P, sparsity, single_fwd, single_step_ms, everyone)
    failed = any(not r.get("ok", True) for rank_rows in everyone for r in rank_rows)
    dist.destroy_process_group()
    sys.exit(1 if failed else 0)


def report(args, P, sparsity, single_fwd, single_step_ms, everyone):
    print(f"{torch.cuda.get_device_name()} x {P}, NCCL; B={args.B} H={args.H} Hkv={args.kv_heads or args.H} "
          f"N={args.N} D={args.D} {args.dtype}{' causal' if args.causal else ''} "
          f"{args.layout}, blocks {args.block_q}x{args.block_k}, topk={args.topk} topp={args.topp}, {args.inputs} "
          f"inputs: {100 * sparsity:.2f} % sparse; sparge {sparge.library_path}")
    print(f"single device: forward {single_fwd:.3f} ms, forward + backward {single_step_ms:.3f} ms\n")
    print("| scheme | check (worst rank) | forward ms | fwd + bwd ms | comm / mask / attention ms (fwd + bwd, "
          "synchronized) |")
    print("|---|---|---|---|---|")
    for i, first in enumerate(everyone[0]):
        if "skipped" in first:
            print(f"| {first['scheme']} | skipped: {first['skipped']} | | | |")
            continue
        rs = [rank_rows[i] for rank_rows in everyone]
        worst = {key: max(r["check"][key] for r in rs) for key in ("out", "dq", "dk", "dv", "max_abs")}
        masks = all(r["check"]["mask_equal"] for r in rs)
        verdict = "ok" if all(r["ok"] for r in rs) else "FAILED"
        check = (f"{verdict}: masks {'identical' if masks else 'DIFFER'}, rel. L2 O {worst['out']:.1e} dQ "
                 f"{worst['dq']:.1e} dK {worst['dk']:.1e} dV {worst['dv']:.1e}, max abs {worst['max_abs']:.1e}")
        parts = " / ".join(f"{max(r['parts'][n] for r in rs):.3f}" for n in ("comm", "mask", "attention"))
        print(f"| {first['scheme']} | {check} | {max(r['fwd'] for r in rs):.3f} | {max(r['step'] for r in rs):.3f} "
              f"| {parts} |")
    print("\nBytes per forward + backward, per rank (MB = 1e6 bytes):\n")
    print("| scheme | rank | tokens | sent MB | received MB | by phase (received MB) | dense ring received MB |")
    print("|---|---|---|---|---|---|---|")
    for i, first in enumerate(everyone[0]):
        if "skipped" in first:
            continue
        for rank, rank_rows in enumerate(everyone):
            r = rank_rows[i]
            phases = ", ".join(f"{k} {v / 1e6:.2f}" for k, v in r["received"].items())
            print(f"| {r['scheme']} | {rank} | {r['lengths'][rank]} | {sum(r['sent'].values()) / 1e6:.2f} | "
                  f"{sum(r['received'].values()) / 1e6:.2f} | {phases} | {r['ring'] / 1e6:.2f} |")


if __name__ == "__main__":
    main()
