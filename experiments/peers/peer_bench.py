#!/usr/bin/env python3
"""Peer benchmark: sparge against PyTorch's attention, in one process, on the same tensors and block masks.

Implementations (the `impl` column):
  sdpa-flash, sdpa-cudnn    dense SDPA with the FlashAttention-2 and with the cuDNN backend
  sparge-dense              sparge without a mask (Python binding; the backward called directly)    --sparge
  flex                      FlexAttention, the mask's token pattern as a BlockMask
  sparge                    sparge on the identical mask (Python binding, through autograd)          --sparge
  sparge-mask-prediction    sparge's mask prediction (pooling, pooled map, selection) alone          --sparge
  sparge+mask-prediction    the prediction, then the forward, queued as one operation as a model
                            runs them (timed alone, the short prediction waits for its own host
                            overhead; see the host_ms column)                                        --sparge
A peer that refuses the shape (a head dim, grouped heads, causal) is reported unavailable with its reason;
SDPA's reasons are the warnings torch gives when a forced backend does not run.

Attention:
  --kv-heads HKV   K and V get HKV heads (dividing H; default H): query head h reads K/V head h // (H/HKV).
                   SDPA and FlexAttention run with enable_gqa=True, sparge with its grouped heads. Where this
                   torch's SDPA has no enable_gqa (before 2.5), or a backend refuses it, K and V are
                   repeat_interleave'd to H heads inside the timed call, and the row's note says so.
  --causal         causal attention, aligned bottom-right as flash-attn aligns it (query t attends keys
                   u <= t + Nk - Nq; here Nq = Nk, so this is SDPA's is_causal). SDPA runs is_causal=True;
                   sparge-dense runs dense causal; --levels masks are predicted causal (each row selects among
                   the blocks on or below its diagonal and always keeps its diagonal blocks); FlexAttention gets
                   the same block mask with the causal rule inside the blocks (mask_mod = kept block & k <= q).
                   An exported --mask must then keep every diagonal block and none above the diagonal.
  --D              any head dim (sparge: multiples of 8 up to 128, and 256, on its tensor cores).
The kv_heads and causal columns of the CSV and the Markdown make every row self-describing.

Masks:
  --mask PREFIX    a mask exported by `sparge bench --export-mask PREFIX` or `exp_speed --export-masks`:
                   PREFIX.json + PREFIX.u8 (dense uint8 [B,H,Nqb,Nkb]); repeatable, the shape comes from the
                   first. sparge's prediction rows then run on this script's random tensors with --topk and
                   --topp (a prediction costs about the same whatever it keeps).
  --levels K:P,..  masks that sparge predicts on this script's tensors, hybrid Top-k K ∪ Top-p P (P = 0:
                   Top-k only, an exact kept fraction); implies --sparge; the shape from --B --H --N --D.
  neither          the dense implementations only.
The BlockMask is built by create_block_mask over the lookup M[b, h, q // block_q, k // block_k] (with
_compile=True, so that [B,H,Nq,Nk] is never materialized); BlockMask.from_kv_blocks gave wrong outputs. On
small shapes (B·H·Nq·Nk <= 2^24, the smoke test's) that lookup is also compared, token by token, with the pairs
sparge's mask attends (Mask.token_mask), on any device.

Checks: before it is timed, each implementation's result is compared on --check-heads whole heads (drawn with
a fixed seed) with fp64 attention under the same mask and, with --causal, the same causal rule: O in the
forward; dQ, dK and dV in the backward. With grouped heads the reference reads K/V head h // (H/HKV), and dK,
dV of a checked head's K/V head are the sums over all the query heads of its group. An implementation above
the dtype's tolerance (rel. L2: bf16 1e-2, f16 3e-3, f32 1e-5) is reported and not timed, and the script exits
with status 1. An implementation that this torch, GPU or build lacks is reported as unavailable, with the
reason.

Timing: --reps runs after --warmup runs, each between two CUDA events, queued back to back and synchronized
once; the median is reported. host_ms is the host's time per call while queuing: where it nears the GPU time,
the GPU waits for the host. The backward is torch.autograd.grad on one retained forward graph, so it is
timed alone. Dense-equivalent TFLOP/s = 4·B·H·P·D / t (×2.5 for the backward), P the token pairs a query may
attend: Nq·Nk, or with --causal Nq·(Nk − Nq) + Nq·(Nq + 1)/2 (about half; FlashAttention's count). Grouped
K/V heads change no FLOPs (every query head attends). effective = that × the kept fraction of the block pairs
a query may attend (with --causal those on or below the diagonal), which is 1 − the sparsity column.

FlexAttention's backward: torch 2.11 finds no backward kernel for 128×64 BlockMasks (NoValidChoicesError),
with its own tiles or with explicit ones. It is tried on the mask's own blocks (default, then explicit tiles),
then on the same tokens as 64×64 blocks, then as its default 128×128 blocks; the first that compiles is timed
and the `kernel_blocks` column names it. At a coarser granularity it computes more token pairs than the mask
keeps (up to about 2× for a 95 % Top-k mask), so that ratio favours sparge.

With --device cpu everything that runs on the CPU runs, timed by the wall clock: a smoke test of the script.

examples:
  peer_bench.py --sparge --mask m13-k0.03-p0.2 --mask m13-s95.12 --reps 20 --csv fwd.csv --md fwd.md
  peer_bench.py --sparge --mask m13-k0.03-p0.2 --mask m13-s95.12 --pass backward --reps 10 --csv bwd.csv
  peer_bench.py --levels 0.03:0.2,0.05:0 --pass both --csv levels.csv       # masks predicted here
  peer_bench.py --B 1 --H 12 --N 32760 --D 128                              # dense peers only
  peer_bench.py --causal --levels 0.05:0 --pass both --csv causal.csv       # causal, vs Flex's causal mask
  peer_bench.py --H 32 --kv-heads 8 --levels 0.03:0.2 --csv gqa.csv         # grouped K/V heads
sparge is found through SPARGE_LIBRARY or SPARGE_BUILD_DIR (python/README.md).
"""
import argparse
import csv
import datetime
import importlib
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
import warnings

# torch is imported by main() once the options are read, so that --help works where it is missing
torch = None
DTYPE_NAMES = ("bf16", "f16", "f32")
DTYPES = TOLERANCE = None  # by dtype name, and by torch dtype: set with torch
HERE = os.path.dirname(os.path.abspath(__file__))


def import_torch():
    global torch, DTYPES, TOLERANCE
    try:
        torch = importlib.import_module("torch")
    except ImportError as e:
        sys.exit(f"peer_bench: PyTorch is needed ({e}); pip install torch, or apt-get install python3-torch")
    DTYPES = dict(zip(DTYPE_NAMES, (torch.bfloat16, torch.float16, torch.float32)))
    TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 3e-3, torch.float32: 1e-5}


def load_mask(prefix):
    """(meta, bool [B,H,Nqb,Nkb]) of an exported mask."""
    with open(prefix + ".json") as f:
        meta = json.load(f)
    if meta.get("varlen"):
        sys.exit(f"peer_bench: {prefix}.json is a mask of packed sequences (varlen: its B counts sequences, Nq and Nk "
                 "are the longest); the peers here take fixed-length batches: export a mask without --varlen")
    shape = (meta["B"], meta["H"], meta["Nqb"], meta["Nkb"])
    raw = open(prefix + ".u8", "rb").read()
    if len(raw) != math.prod(shape):
        sys.exit(f"{prefix}.u8 holds {len(raw)} bytes, {list(shape)} needs {math.prod(shape)}")
    return meta, torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(shape) != 0


def parse_levels(text):
    levels = []
    for item in text.split(","):
        try:
            topk, topp = (float(x) for x in item.split(":"))
        except ValueError:
            sys.exit(f"peer_bench: --levels wants K:P pairs, not '{item}'")
        levels.append((topk, topp))
    return levels


def git_commit():
    """This checkout's commit, or in an unpacked dist tarball the one `make dist` wrote into its COMMIT file."""
    try:
        return subprocess.run(["git", "-C", HERE, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        try:
            with open(os.path.join(HERE, "..", "..", "COMMIT")) as f:
                return f.read().strip() or "unknown"
        except OSError:
            return "unknown"


def first_line(e, limit=240):
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:limit]}"


def attendable_pairs(Nq, Nk, causal):
    """Token pairs the queries may attend: Nq·Nk, or causal (bottom-right, Nq <= Nk) the sum of t + Nk − Nq + 1."""
    return Nq * (Nk - Nq) + Nq * (Nq + 1) // 2 if causal else Nq * Nk


def causal_blocks(Nq, Nk, bq, bk):
    """(attendable, diagonal), bool [Nqb, Nkb]: the block pairs holding a pair u <= t + Nk − Nq, and those holding
    key t + Nk − Nq of one of their queries t (the diagonal blocks a causal sparge mask always keeps)."""
    off = Nk - Nq
    first = torch.arange(-(-Nq // bq)) * bq
    last = torch.clamp(first + bq, max=Nq) - 1
    j = torch.arange(-(-Nk // bk))[None, :]
    attendable = j * bk <= (last + off)[:, None]
    diagonal = (j >= ((first + off) // bk)[:, None]) & (j <= ((last + off) // bk)[:, None])
    return attendable, diagonal


def block_sparsity(blocks, Nq, Nk, bq, bk, causal):
    """1 − kept / attendable block pairs of blocks (bool [B,H,Nqb,Nkb]), as sparge's MaskStats counts them."""
    if not causal:
        return 1.0 - blocks.float().mean().item()
    attendable = causal_blocks(Nq, Nk, bq, bk)[0].to(blocks.device)
    kept = (blocks & attendable).sum().item()
    return 1.0 - kept / (blocks.shape[0] * blocks.shape[1] * attendable.sum().item())


def mask_lookup(blocks, bq, bk, causal_offset=None):
    """FlexAttention's mask_mod for blocks (bool [B,H,Nqb,Nkb] of bq × bk): the kept block of (q, k), and with a
    causal offset (Nk − Nq) the bottom-right causal rule k <= q + offset inside it."""
    last_q, last_k = blocks.shape[2] - 1, blocks.shape[3] - 1

    def lookup(b, h, q_idx, kv_idx):
        # clamped: the builder may pad the lengths past the last block; FlexAttention masks padding itself
        kept = blocks[b, h, torch.clamp(q_idx // bq, max=last_q), torch.clamp(kv_idx // bk, max=last_k)]
        return kept if causal_offset is None else kept & (kv_idx <= q_idx + causal_offset)
    return lookup


def time_ms(fn, warmup, reps, cuda):
    """(median ms per run, host ms per call). On CUDA the runs are queued back to back between event pairs and
    synchronized once, so the host's launch overhead (large for a compiled FlexAttention call) overlaps the
    previous run; where the host takes longer per call than the GPU, the GPU waits and the events include it."""
    for _ in range(warmup):
        fn()
    if not cuda:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times), statistics.fmean(times)
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    t0 = time.perf_counter()
    for start, stop in events:
        start.record()
        fn()
        stop.record()
    host_ms = (time.perf_counter() - t0) * 1e3 / reps
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(stop) for start, stop in events), host_ms


def reference_head(q, k, v, d_o, b, h, scale, blocks, block_q, block_k, causal, chunk_rows=512):
    """fp64 attention of query head (b, h) under blocks (bool [Nqb, Nkb] of that head; None: dense) and, with
    causal, the bottom-right causal rule (query t attends keys u <= t + Nk − Nq): (O,) or, with d_o, (O, dQ, dK,
    dV), dK and dV this query head's share. The head reads K/V head h // (H/Hkv) (grouped heads). Computed over
    chunks of whole query blocks, since every row's softmax is its own; a row that keeps no key gives 0."""
    hk = h // (q.shape[1] // k.shape[1])
    qh, kh, vh = q[b, h].detach().double(), k[b, hk].detach().double(), v[b, hk].detach().double()
    Nq, Nk = qh.shape[0], kh.shape[0]
    o = torch.empty_like(qh)
    if d_o is not None:
        doh = d_o[b, h].double()
        dq, dk, dv = torch.empty_like(qh), torch.zeros_like(kh), torch.zeros_like(vh)
    step = block_q * max(1, chunk_rows // block_q)
    for r0 in range(0, Nq, step):
        r1 = min(r0 + step, Nq)
        s = (qh[r0:r1] @ kh.T) * scale
        if blocks is not None:
            keep = blocks[r0 // block_q:(r1 - 1) // block_q + 1].repeat_interleave(block_k, dim=1)[:, :Nk]
            s.masked_fill_(~keep.repeat_interleave(block_q, dim=0)[:r1 - r0], -math.inf)
        if causal:
            t = torch.arange(r0, r1, device=s.device)[:, None]
            s.masked_fill_(torch.arange(Nk, device=s.device)[None, :] > t + (Nk - Nq), -math.inf)
        p = torch.softmax(s, dim=-1).nan_to_num_(0.0)
        o[r0:r1] = p @ vh
        if d_o is not None:
            do = doh[r0:r1]
            ds = p * (do @ vh.T - (do * o[r0:r1]).sum(-1, keepdim=True))
            dq[r0:r1] = scale * (ds @ kh)
            dk += scale * (ds.T @ qh[r0:r1])
            dv += p.T @ do
    return (o,) if d_o is None else (o, dq, dk, dv)


def rel_l2(x, ref):
    diff = (x.double() - ref).norm().item()
    return diff / ref.norm().item() if math.isfinite(diff) else math.inf


def flex_bwd_attempts(bq, bk):
    """(BlockMask granularity, kernel_options) for FlexAttention's backward, in the order tried. Explicit tiles
    divide the mask blocks (the bwd_/fwd_ prefixes address one pass; dK/dV needs BLOCK_N1 % BLOCK_M1 == 0 and
    dQ BLOCK_M2 % BLOCK_N2 == 0); then the same tokens as 64×64 blocks, then as the default 128×128 blocks."""
    def bwd(m1, n1, m2, n2, stages=None):
        o = {"bwd_BLOCK_M1": m1, "bwd_BLOCK_N1": n1, "bwd_BLOCK_M2": m2, "bwd_BLOCK_N2": n2}
        return o if stages is None else {**o, "bwd_num_stages": stages}
    own = (bq, bk)
    tries = [(own, None), (own, bwd(64, 64, 64, 64)), (own, bwd(32, 64, 64, 32)), (own, bwd(64, 64, 64, 64, 1))]
    if bq % 64 == 0 and bk % 64 == 0 and own != (64, 64):
        tries.append(((64, 64), {"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 64, **bwd(32, 64, 64, 32, 1)}))
    if own != (128, 128):
        tries.append(((128, 128), None))
    return tries


class Flex:
    """FlexAttention, compiled once; BlockMasks of a block mask's token pattern at any granularity."""

    def __init__(self):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        try:  # the backward is timed on one retained graph, which a compiled backward with donated buffers refuses
            importlib.import_module("torch._functorch.config").donated_buffer = False
        except (ImportError, AttributeError):
            pass
        self.create_block_mask = create_block_mask
        self.attend = torch.compile(flex_attention, dynamic=False)
        self.bwd_known = None  # the backward attempt that compiled for an earlier mask, tried first

    def block_mask(self, blocks, Nq, Nk, bq, bk, grain, causal):
        """blocks' token pattern (blocks: bool [B,H,Nqb,Nkb] of bq × bk), with causal cut by the bottom-right
        causal rule, as a BlockMask of grain blocks; the same tokens are kept at any granularity (FlexAttention
        applies the lookup per token in partly kept blocks, the diagonal ones among them)."""
        B, H = blocks.shape[:2]
        lookup = mask_lookup(blocks, bq, bk, Nk - Nq if causal else None)
        return self.create_block_mask(lookup, B, H, Nq, Nk, device=blocks.device, BLOCK_SIZE=grain, _compile=True)


class Bench:
    def __init__(self, args, q, k, v, d_o, dtype, device, commit):
        self.args, self.q, self.k, self.v, self.d_o = args, q, k, v, d_o
        self.cuda = device.type == "cuda"
        self.B, self.H, self.Nq, self.D = q.shape
        self.Hkv, self.Nk = k.shape[1], k.shape[2]
        self.group = self.H // self.Hkv
        self.causal = args.causal
        self.dtype, self.tol = dtype, TOLERANCE[dtype]
        self.scale = 1.0 / math.sqrt(self.D)
        self.flops = 4.0 * self.B * self.H * attendable_pairs(self.Nq, self.Nk, self.causal) * self.D
        self.rows, self.failed = [], []
        self.refs = {}
        gen = torch.Generator().manual_seed(args.seed)
        pairs = torch.randperm(self.B * self.H, generator=gen)[:max(1, args.check_heads)].tolist()
        self.heads = [divmod(i, self.H) for i in pairs]
        self.stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        self.device_name = torch.cuda.get_device_name(device) if self.cuda else "cpu"
        self.commit = commit

    def reference(self, mask_name, blocks, bq, bk, backward):
        """Per checked head (b, h): (O,) or (O, dQ, dK, dV), dK and dV those of its K/V head (b, h // group): the
        sums over the group's query heads."""
        key = (mask_name, backward)
        if key not in self.refs:
            done = {}

            def head(b, h):
                if (b, h) not in done:
                    done[(b, h)] = reference_head(self.q, self.k, self.v, self.d_o if backward else None, b, h,
                                                  self.scale, None if blocks is None else blocks[b, h], bq, bk,
                                                  self.causal)
                return done[(b, h)]
            refs = []
            for b, h in self.heads:
                ref = head(b, h)
                if backward and self.group > 1:
                    first = h // self.group * self.group
                    group = [head(b, g) for g in range(first, first + self.group)]
                    ref = ref[:2] + (sum(r[2] for r in group), sum(r[3] for r in group))
                refs.append(ref)
            self.refs[key] = refs
        return self.refs[key]

    def check(self, results, mask_name, blocks, bq, bk, backward):
        """Largest rel. L2 over the checked heads of results (O, or dQ, dK, dV with K's heads) against fp64, and
        its text."""
        refs = self.reference(mask_name, blocks, bq, bk, backward)
        names = ("dQ", "dK", "dV") if backward else ("O",)
        errs = []
        for i, name in enumerate(names):
            kv = name in ("dK", "dV")
            pairs = [(results[i][b, h // self.group if kv else h], ref[i + 1 if backward else 0])
                     for (b, h), ref in zip(self.heads, refs)]
            errs.append(max(rel_l2(x, r) for x, r in pairs))
        return max(errs), "/".join(names) + " " + "/".join(f"{e:.2e}" for e in errs)

    def record(self, impl, which, mask_name, sparsity, status, ms=math.nan, host_ms=math.nan, err=math.nan,
               note="", kernel_blocks="", bq="", bk="", flops=True):
        f = self.flops * (2.5 if which == "backward" else 1.0) if flops else math.nan
        row = dict(date=self.stamp, device=self.device_name, torch=torch.__version__, commit=self.commit, impl=impl,
                   direction=which, mask=mask_name, B=self.B, H=self.H, kv_heads=self.Hkv, Nq=self.Nq, Nk=self.Nk,
                   D=self.D, causal=self.causal, dtype=str(self.dtype).split(".")[-1], block_q=bq, block_k=bk,
                   kernel_blocks=kernel_blocks, sparsity=sparsity, ms=ms, host_ms=host_ms, tflops=f / (ms * 1e9),
                   eff_tflops=f * (1.0 - sparsity) / (ms * 1e9), rel_l2=err, status=status, note=note)
        self.rows.append(row)
        shown = mask_name + (f"@{kernel_blocks}" if kernel_blocks and kernel_blocks != f"{bq}x{bk}" else "")
        tail = {"ok": "", "unavailable": f"  unavailable: {note}"}.get(status, f"  {status.upper()}: {note}")
        print(f"{impl:<23} {which:<8} {shown:<26} {100 * sparsity:7.2f}% {ms:9.3f} {row['tflops']:9.1f} "
              f"{row['eff_tflops']:9.1f} {err:9.2e} {host_ms:8.3f}{tail}", flush=True)
        if status not in ("ok", "unavailable"):
            self.failed.append(f"{impl} {which} {mask_name}: {note}")

    def measure(self, impl, which, mask_name, sparsity, blocks, bq, bk, make, peer=True, kernel_blocks="", note=""):
        """Check, then time, one implementation. make() returns (results, timed): results (O,) or (dQ, dK, dV)
        for the check, timed the operation to time. An exception in make() is 'unavailable' for a peer and an
        error for sparge. note goes before the check's text in the row's note."""
        grad = torch.enable_grad() if which == "backward" else torch.no_grad()
        extra = dict(kernel_blocks=kernel_blocks, bq=bq if blocks is not None else "",
                     bk=bk if blocks is not None else "")
        with grad:
            try:
                results, timed = make()
            except Exception as e:  # noqa: BLE001 (any failure of a peer's stack is reported, not fatal)
                self.record(impl, which, mask_name, sparsity, "unavailable" if peer else "error", note=first_line(e),
                            **extra)
                return
            err, text = self.check(results, mask_name, blocks, bq, bk, which == "backward")
            del results
            if not err <= self.tol:
                self.record(impl, which, mask_name, sparsity, "failed-check", err=err,
                            note=f"{note}{text} above {self.tol:g}, not timed", **extra)
                return
            ms, host_ms = time_ms(timed, self.args.warmup, self.args.reps, self.cuda)
        self.record(impl, which, mask_name, sparsity, "ok", ms, host_ms, err, note=note + text, **extra)

    def autograd_pair(self, forward, which):
        """(results, timed) of forward() for measure(): O and the forward, or the gradients and the backward
        alone on one retained graph."""
        q, k, v, d_o = self.q, self.k, self.v, self.d_o
        if which == "forward":
            return (forward(),), forward
        out = forward()
        return torch.autograd.grad(out, (q, k, v), d_o, retain_graph=True), \
            lambda: torch.autograd.grad(out, (q, k, v), d_o, retain_graph=True)


def sdpa_impls(scale, causal, grouped):
    """{name: [(forward, note), ...]} of the dense SDPA backends: forwards tried in order until one runs (a forward
    raises where its backend does not run). With grouped K/V heads SDPA's own enable_gqa comes first, then K and V
    repeat_interleave'd to H heads inside the timed call, which its note says."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    native_gqa = True
    if grouped:  # enable_gqa is torch >= 2.5
        try:
            F.scaled_dot_product_attention(*(torch.zeros(1, h, 1, 8) for h in (2, 1, 1)), enable_gqa=True)
        except TypeError:
            native_gqa = False

    def impl(backend, repeat):
        gqa = {"enable_gqa": True} if grouped and not repeat else {}

        def run(q, k, v):
            if repeat:
                group = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, scale=scale, is_causal=causal, **gqa)
        return run

    def variants(backend):
        if not grouped:
            return [(impl(backend, False), "")]
        repeated = (impl(backend, True), "K/V repeat_interleave'd to H heads in the timed call"
                    + ("" if native_gqa else f" (torch {torch.__version__}'s SDPA has no enable_gqa)"))
        return ([(impl(backend, False), "enable_gqa")] if native_gqa else []) + [repeated]
    return {"sdpa-flash": variants(SDPBackend.FLASH_ATTENTION), "sdpa-cudnn": variants(SDPBackend.CUDNN_ATTENTION)}


def sdpa_reasons(make):
    """make(), with the reasons that torch warns about when a forced SDPA backend does not run (a head dim, grouped
    heads, ...) added to the error it raises. Other warnings are shown as usual."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            made = make()
        except RuntimeError as e:
            reasons = [re.sub(r"\s*\(Triggered internally at .*$", "", " ".join(str(w.message).split()))
                       for w in caught]
            reasons = [r for r in dict.fromkeys(reasons) if r]
            if not reasons:
                raise
            raise RuntimeError("; ".join(reasons) + f" [{first_line(e, 80)}]") from e
    for w in caught:
        warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    return made


def fmt(x, spec):
    return format(x, spec) if isinstance(x, float) and math.isfinite(x) else "—"


def times(a, b):
    return fmt(a / b, ".2f") + "×" if math.isfinite(a / b) else "—"


def rows_table(rows):
    """Markdown lines: one per row."""
    out = ["| impl | direction | heads q/kv | causal | mask | sparsity | ms | TFLOP/s (dense-eq.) | eff. TFLOP/s "
           "| host ms | check |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        own = f"{r['block_q']}x{r['block_k']}"
        mask = r["mask"] + (f" ({r['kernel_blocks']} blocks)" if r["kernel_blocks"] not in ("", own) else "")
        check = r["note"] if r["status"] == "ok" else f"{r['status']}: {r['note']}"
        out.append(f"| {r['impl']} | {r['direction']} | {r['H']}/{r['kv_heads']} | {'yes' if r['causal'] else 'no'} "
                   f"| {mask} | {100 * r['sparsity']:.2f} % | {fmt(r['ms'], '.3f')} "
                   f"| {fmt(r['tflops'], '.1f')} | {fmt(r['eff_tflops'], '.1f')} | {fmt(r['host_ms'], '.3f')} "
                   f"| {check.replace('|', '/')} |")
    return out


def ratio_table(rows, passes, masks):
    """Markdown lines: sparge against FlexAttention on each mask and against the faster dense SDPA backend."""
    def ms(impl, which, mask):
        found = [r["ms"] for r in rows
                 if (r["impl"], r["direction"], r["mask"], r["status"]) == (impl, which, mask, "ok")]
        return found[0] if found else math.nan
    out = ["| mask | direction | FlexAttention ms | sparge ms | sparge + prediction ms | Flex / sparge "
           "| Flex / (sparge + prediction) | best dense ms | best dense / (sparge + prediction), backward: / sparge |",
           "|---|---|---|---|---|---|---|---|---|"]
    for which in passes:
        dense = [t for t in (ms("sdpa-flash", which, "dense"), ms("sdpa-cudnn", which, "dense")) if math.isfinite(t)]
        best = min(dense) if dense else math.nan
        for mask in masks:
            f, s, sp = ms("flex", which, mask), ms("sparge", which, mask), ms("sparge+mask-prediction", which, mask)
            out.append(f"| {mask} | {which} | {fmt(f, '.3f')} | {fmt(s, '.3f')} | {fmt(sp, '.3f')} "
                       f"| {times(f, s)} | {times(f, sp)} | {fmt(best, '.3f')} "
                       f"| {times(best, sp if which == 'forward' else s)} |")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mask", action="append", default=[], metavar="PREFIX", help="an exported mask (repeatable)")
    ap.add_argument("--levels", help="K:P,... masks predicted by sparge on these tensors (implies --sparge)")
    ap.add_argument("--sparge", action="store_true", help="also run sparge (its Python binding) on every mask")
    ap.add_argument("--pass", dest="passes", default="forward", choices=("forward", "backward", "both"))
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=12)
    ap.add_argument("--N", type=int, default=32760, help="tokens, Nq = Nk (default: Wan2.1-1.3B at 480p)")
    ap.add_argument("--kv-heads", type=int, metavar="HKV",
                    help="K/V heads, dividing H (default H): grouped-query attention, enable_gqa=True in the peers")
    ap.add_argument("--causal", action="store_true",
                    help="causal attention, aligned bottom-right (query t attends keys u <= t + Nk - Nq, as flash-attn "
                         "aligns it; Nq = Nk here, so SDPA's is_causal); masks predicted causal")
    ap.add_argument("--D", type=int, default=128, help="head dim (default 128)")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPE_NAMES))
    ap.add_argument("--block-q", type=int, default=128, help="--levels: mask blocks (default 128 x 64)")
    ap.add_argument("--block-k", type=int, default=64)
    ap.add_argument("--topk", type=float, default=0.03, help="--mask with --sparge: Top-k of the timed prediction")
    ap.add_argument("--topp", type=float, default=0.2, help="--mask with --sparge: Top-p of the timed prediction")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--check-heads", type=int, default=2, help="whole heads checked against fp64 (default 2)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--no-dense", action="store_true", help="skip the dense implementations")
    ap.add_argument("--no-flex-backward", action="store_true",
                    help="skip FlexAttention's backward (each failed compilation attempt costs about a minute)")
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu for a smoke test")
    ap.add_argument("--commit", help="commit to record (default: git rev-parse of this checkout)")
    ap.add_argument("--csv", help="write every row here")
    ap.add_argument("--md", help="write a Markdown summary here")
    args = ap.parse_args()
    if args.reps < 1 or args.warmup < 0:
        sys.exit("peer_bench: --reps must be >= 1 and --warmup >= 0")
    import_torch()
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit("peer_bench: no CUDA device (--device cpu runs a smoke test on the CPU)")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    levels = parse_levels(args.levels) if args.levels else []
    use_sparge = args.sparge or bool(levels)
    if levels and args.mask:
        sys.exit("peer_bench: give --mask or --levels, not both")
    if use_sparge:
        sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
        import sparge
    passes = ("forward", "backward") if args.passes == "both" else (args.passes,)

    files = [load_mask(p) + (p,) for p in args.mask]
    if files:
        meta = files[0][0]
        B, H, Nq, Nk, D, dtype = meta["B"], meta["H"], meta["Nq"], meta["Nk"], meta["D"], DTYPES[meta["dtype"]]
        for m, _, p in files[1:]:
            if (m["B"], m["H"], m["Nq"], m["Nk"], m["D"], m["dtype"]) != (B, H, Nq, Nk, D, meta["dtype"]):
                sys.exit(f"peer_bench: {p} has another shape or dtype than {files[0][2]}")
        for m, _, p in files:
            if "causal" in m and bool(m["causal"]) != args.causal:
                sys.exit(f"peer_bench: {p}.json says causal={m['causal']}, give --causal exactly for causal masks")
    else:
        B, H, Nq, Nk, D, dtype = args.B, args.H, args.N, args.N, args.D, DTYPES[args.dtype]
    Hkv = H if args.kv_heads is None else args.kv_heads
    if Hkv < 1 or H % Hkv:
        sys.exit(f"peer_bench: --kv-heads {Hkv} must divide H = {H}")
    if min(B, H, Nq, Nk, D) < 1:
        sys.exit(f"peer_bench: B, H, N and D must be >= 1 (B={B} H={H} Nq={Nq} Nk={Nk} D={D})")
    if args.causal and Nq > Nk:
        sys.exit(f"peer_bench: --causal needs Nq <= Nk (the diagonal aligned bottom-right), not Nq={Nq} Nk={Nk}")
    for meta, blocks, prefix in (files if args.causal else ()):
        attendable, diagonal = causal_blocks(Nq, Nk, meta["block_q"], meta["block_k"])
        if bool((blocks & ~attendable).any()) or bool((diagonal & ~blocks).any()):
            sys.exit(f"peer_bench: {prefix} is no causal mask: with --causal a mask keeps every diagonal block and "
                     "none above the diagonal (as sparge's causal masks do)")
    gen = torch.Generator(device=device).manual_seed(args.seed)
    need_grad = "backward" in passes
    q, k, v = (torch.randn(B, h, n, D, device=device, dtype=dtype, generator=gen).requires_grad_(need_grad)
               for h, n in ((H, Nq), (Hkv, Nk), (Hkv, Nk)))
    d_o = torch.randn(B, H, Nq, D, device=device, dtype=dtype, generator=gen) if need_grad else None
    grouped = Hkv != H
    bench = Bench(args, q, k, v, d_o, dtype, device, args.commit or git_commit())
    print(f"peer_bench {bench.stamp}, {bench.device_name}, torch {torch.__version__}, commit {bench.commit}"
          + (f", libsparge {sparge.library_path}" if use_sparge else ""))
    shape = (f"B={B} H={H} kv_heads={Hkv} Nq={Nq} Nk={Nk} D={D} {str(dtype).split('.')[-1]}"
             + (", causal (bottom-right)" if args.causal else ""))
    print(f"{shape}, median of {args.reps} after {args.warmup} warm-up"
          f"{', CUDA events' if bench.cuda else ', wall clock'}; checked against fp64 on heads {bench.heads}"
          + (f" (dK, dV: their K/V heads, summed over the {H // Hkv} query heads of each)" if grouped else ""))
    print(f"{'impl':<23} {'pass':<8} {'mask':<26} {'sparsity':>8} {'ms':>9} {'TFLOP/s':>9} {'eff TF/s':>9} "
          f"{'relL2':>9} {'host ms':>8}")

    if not args.no_dense:
        try:
            dense = sdpa_impls(bench.scale, args.causal, grouped)
        except ImportError as e:
            dense = dict.fromkeys(("sdpa-flash", "sdpa-cudnn"), first_line(e))
        if args.causal and Nq != Nk:
            dense = dict.fromkeys(dense, f"SDPA's is_causal aligns the diagonal top-left for Nq={Nq} < Nk={Nk}, "
                                         "sparge and this script bottom-right")
        for name, variants in dense.items():
            for which in passes:
                if isinstance(variants, str):
                    bench.record(name, which, "dense", 0.0, "unavailable", note=variants)
                    continue
                failures = []
                for attend, note in variants:  # the first that runs is checked and timed
                    try:
                        with torch.enable_grad() if which == "backward" else torch.no_grad():
                            made = sdpa_reasons(lambda attend=attend: bench.autograd_pair(lambda: attend(q, k, v),
                                                                                          which))
                    except Exception as e:  # noqa: BLE001 (this backend does not run this shape: try the next)
                        failures.append(first_line(e, 600))
                        continue
                    if note:
                        note += (f" (enable_gqa refused: {failures[0][:300]})" if failures else "") + "; "
                    bench.measure(name, which, "dense", 0.0, None, 128, 64, lambda made=made: made, note=note)
                    break
                else:
                    bench.record(name, which, "dense", 0.0, "unavailable", note=" / ".join(dict.fromkeys(failures)))
        if use_sparge:
            for which in passes:
                def make_dense(which=which):
                    if which == "forward":
                        run = lambda: sparge.attention_forward(q, k, v, causal=args.causal)  # noqa: E731
                        return (run()[0],), run
                    qd, kd, vd = q.detach(), k.detach(), v.detach()
                    o, lse = sparge.attention_forward(qd, kd, vd, causal=args.causal)
                    run = lambda: sparge.attention_backward(d_o, qd, kd, vd, o, lse, causal=args.causal)  # noqa: E731
                    return run(), run
                bench.measure("sparge-dense", which, "dense", 0.0, None, 128, 64, make_dense, peer=False)

    masks = []  # (name, blocks bool [B,H,Nqb,Nkb] on the device, bq, bk, sparge.Mask or None, (topk, topp))
    for meta, blocks, prefix in files:
        smask = sparge.Mask.from_dense(blocks, Nq, Nk, meta["block_q"], meta["block_k"], device=device,
                                       causal=args.causal) if use_sparge else None
        masks.append((os.path.basename(prefix), blocks.to(device), meta["block_q"], meta["block_k"], smask,
                      (args.topk, args.topp)))
    for topk, topp in levels:
        with torch.no_grad():
            smask = sparge.predict_mask(q.detach(), k.detach(), topk=topk, topp=topp, block_q=args.block_q,
                                        block_k=args.block_k, causal=args.causal)
        masks.append((f"k={topk:g} p={topp:g}", smask.dense.bool(), args.block_q, args.block_k, smask, (topk, topp)))

    flex, flex_error = None, ""
    if masks:
        try:
            flex = Flex()
        except Exception as e:  # noqa: BLE001 (no FlexAttention in this torch)
            flex_error = first_line(e)
    for name, blocks, bq, bk, smask, (topk, topp) in masks:
        sparsity = block_sparsity(blocks, Nq, Nk, bq, bk, args.causal)
        if smask is not None:
            stats = smask.stats().sparsity
            if abs(stats - sparsity) > 1e-6:
                bench.failed.append(f"{name}: sparsity {sparsity:.6f} here, {stats:.6f} in sparge's statistics")
                print(f"{name}: sparsity {sparsity:.6f} here but {stats:.6f} in sparge's statistics", flush=True)
            if B * H * Nq * Nk <= 1 << 24:  # small shapes: FlexAttention's mask_mod against sparge's token pairs
                lookup = mask_lookup(blocks, bq, bk, Nk - Nq if args.causal else None)
                t, u = torch.arange(Nq, device=device)[:, None], torch.arange(Nk, device=device)[None, :]
                mod = torch.stack([torch.stack([lookup(torch.tensor(b, device=device), torch.tensor(h, device=device),
                                                       t, u) for h in range(H)]) for b in range(B)])
                same = torch.equal(mod, smask.token_mask())
                print(f"{name}: the BlockMask's mask_mod {'keeps' if same else 'DOES NOT keep'} the token pairs "
                      "sparge's mask attends", flush=True)
                if not same:
                    bench.failed.append(f"{name}: the BlockMask's mask_mod differs from sparge's token pairs")
        for which in passes:
            if flex is None:
                bench.record("flex", which, name, sparsity, "unavailable", note=flex_error, bq=bq, bk=bk)
            elif which == "backward" and args.no_flex_backward:
                bench.record("flex", which, name, sparsity, "unavailable", note="--no-flex-backward", bq=bq, bk=bk)
            else:
                attempts = [((bq, bk), None)]
                if which == "backward":  # the first attempt that compiles is timed
                    tries = flex_bwd_attempts(bq, bk)
                    attempts = [a for a in tries if a == flex.bwd_known] + [a for a in tries if a != flex.bwd_known]
                failures = []
                for grain, options in attempts:
                    def make_flex(grain=grain, options=options):
                        block_mask = flex.block_mask(blocks, Nq, Nk, bq, bk, grain, args.causal)
                        gqa = {"enable_gqa": True} if grouped else {}
                        return bench.autograd_pair(lambda: flex.attend(q, k, v, block_mask=block_mask,
                                                                       scale=bench.scale, kernel_options=options,
                                                                       **gqa),
                                                   which)
                    try:
                        with torch.enable_grad() if which == "backward" else torch.no_grad():
                            made = make_flex()
                    except Exception as e:  # noqa: BLE001 (no kernel for these blocks and options: try the next)
                        failures.append(f"{grain[0]}x{grain[1]} blocks, kernel_options {options}: {first_line(e)}")
                        print(f"{'flex':<23} {which:<8} {name:<26} failed with {failures[-1]}", flush=True)
                        torch._dynamo.reset()
                        continue
                    if which == "backward":
                        flex.bwd_known = (grain, options)
                    bench.measure("flex", which, name, sparsity, blocks, bq, bk, lambda made=made: made,
                                  kernel_blocks=f"{grain[0]}x{grain[1]}")
                    break
                else:
                    bench.record("flex", which, name, sparsity, "unavailable", note="; ".join(failures), bq=bq, bk=bk)
            if smask is None:
                continue
            qd, kd = q.detach(), k.detach()

            def forward(smask=smask, bq=bq, bk=bk):
                return sparge.sparge_attention(q, k, v, mask=smask, block_q=bq, block_k=bk, is_causal=args.causal,
                                               enable_gqa=grouped)
            bench.measure("sparge", which, name, sparsity, blocks, bq, bk,
                          lambda forward=forward: bench.autograd_pair(forward, which), peer=False)
            if which != "forward":
                continue
            # The timed prediction writes into its own mask, except in --levels mode, where predicting the level's
            # mask again rewrites the same blocks (a prediction is deterministic).
            predicted = smask if levels else sparge.Mask(B, H, Nq, Nk, bq, bk, device=device, causal=args.causal)
            with torch.no_grad():
                def predict(predicted=predicted, topk=topk, topp=topp):
                    return predicted.predict(qd, kd, topk=topk, topp=topp)
                predict()
                ms, host_ms = time_ms(predict, args.warmup, args.reps, bench.cuda)
            bench.record("sparge-mask-prediction", which, name if levels else f"k={topk:g} p={topp:g}",
                         predicted.sparsity, "ok", ms, host_ms, note="on this script's tensors", bq=bq, bk=bk,
                         flops=False)

            def predict_then_forward(predict=predict, forward=forward):
                predict()
                return forward()
            bench.measure("sparge+mask-prediction", which, name, sparsity, blocks, bq, bk,
                          lambda f=predict_then_forward: ((f(),), f), peer=False)

    ratios = ratio_table(bench.rows, passes, [m[0] for m in masks]) if masks and use_sparge else []
    if ratios:
        print("\n" + "\n".join(ratios))
    if args.csv and bench.rows:
        with open(args.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(bench.rows[0].keys()))
            writer.writeheader()
            writer.writerows(bench.rows)
        print(f"wrote {args.csv}")
    if args.md:
        with open(args.md, "w") as f:
            f.write(f"Peers on {bench.device_name} (torch {torch.__version__}), commit {bench.commit}, {bench.stamp}: "
                    f"{shape}, median of {args.reps} "
                    f"{'queued runs (CUDA events)' if bench.cuda else 'runs (wall clock)'} after {args.warmup} "
                    f"warm-up; every timed result checked against fp64 on {len(bench.heads)} "
                    f"whole head(s) first.\n\n" + "\n".join(rows_table(bench.rows)) + "\n")
            if ratios:
                f.write("\n" + "\n".join(ratios) + "\n")
        print(f"wrote {args.md}")
    if bench.failed:
        print("FAILED:\n  " + "\n  ".join(bench.failed))
        sys.exit(1)


if __name__ == "__main__":
    main()
