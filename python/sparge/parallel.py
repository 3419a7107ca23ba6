"""Sequence-parallel block-sparse attention over torch.distributed (NCCL on GPUs, gloo on CPUs).

Two schemes; both take each rank's shard of the sequence and return that rank's shard of the output, with
gradients through torch autograd, and both give what one device would compute on the whole sequence (the same
masks bit for bit, outputs and gradients within the dtype's rounding):

- ulysses_attention: an all-to-all turns sequence shards of all heads into the whole sequence for H/P heads,
  sparge predicts the mask and attends locally, and the inverse all-to-all returns the output to sequence
  shards. Needs equal shards and P dividing H. Grouped K/V heads travel as K/V heads: Hkv/P per rank when P
  divides Hkv, else each K/V head is repeated the fewest times that make P divide the count (its gradients summed
  back over the copies).
- context_parallel_attention: Q, K and V stay sharded. Ranks exchange the mean-pooled K (B·Hkv·Nkb·D floats),
  so each predicts the single-device mask for its query blocks, then fetch only the K/V blocks their query
  blocks keep, attend per source rank and merge the partials by their log-sum-exp. Shards are whole blocks
  (a multiple of lcm(block_q, block_k)) except the last rank's, which holds any ragged remainder.

causal=True is causal self-attention over global positions (query t attends keys u <= t). Ulysses attends its
heads over the whole sequence with sparge's causal mask. Context parallelism predicts the single-device causal
mask of its query blocks, attends its own shard with the causal rule and the earlier shards as whole blocks, and
receives nothing (no pooled K, no K/V blocks) from the ranks whose key shards lie above its diagonal.

Tensors are [B,H,N,D] (layout="bhnd", the package's default) or [B,N,H,D] (layout="bnhd"), N being the local
shard. Every call starts with one small all-gather of each rank's shapes and parameters, so a configuration
that one rank refuses is refused by every rank (the same ValueError) instead of leaving the others waiting.
docs/PARALLEL.md compares the schemes and their communication volumes.
"""
import contextlib
import ctypes
import dataclasses
import math
import struct
import time

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from . import _checks, _lib, _torch
from .attention import attention_backward, attention_forward
from .mask import Mask, mask_params, predict_mask

__all__ = ["CommStats", "ulysses_attention", "context_parallel_attention", "shard_lengths", "local_shard",
           "dense_ring_bytes"]

_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


# ---------------------------------------------------------------- statistics


@dataclasses.dataclass
class CommStats:
    """What one rank moved in the calls it was passed to (accumulated over calls, forward and backward).

    sent / received: bytes per phase ("meta", "qkv", "o", "grad_o", "grad_qkv" for Ulysses; "meta", "pooled_k",
    "need", "kv", "grad_kv" for context parallelism), counting the payload that leaves or reaches this rank
    (its own chunk of an all-to-all is not counted). dense_ring: the bytes a dense ring would bring to this rank
    for the same calls (every other shard's K and V in the forward, their dK and dV partials back in the
    backward). seconds: with timing=True, wall time per part ("comm", "mask", "attention"), the device
    synchronized around each part (which serializes what would otherwise overlap)."""

    timing: bool = False
    sent: dict = dataclasses.field(default_factory=dict)
    received: dict = dataclasses.field(default_factory=dict)
    dense_ring: dict = dataclasses.field(default_factory=dict)
    seconds: dict = dataclasses.field(default_factory=dict)

    def totals(self):
        """{"sent": bytes, "received": bytes, "dense_ring_received": bytes} over every phase."""
        return {"sent": sum(self.sent.values()), "received": sum(self.received.values()),
                "dense_ring_received": sum(self.dense_ring.values())}

    def reset(self):
        for d in (self.sent, self.received, self.dense_ring, self.seconds):
            d.clear()

    def _moved(self, phase, sent, received):
        self.sent[phase] = self.sent.get(phase, 0) + int(sent)
        self.received[phase] = self.received.get(phase, 0) + int(received)

    @contextlib.contextmanager
    def _part(self, name, device):
        if not self.timing:
            yield
            return
        _sync(device)
        t0 = time.perf_counter()
        yield
        _sync(device)
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def dense_ring_bytes(lengths, B, H, D, dtype, rank, causal=False):
    """Bytes a dense ring brings to `rank` in one forward: K and V (H heads: K's) of every other shard (sequence
    lengths `lengths`), or with causal of every earlier shard only. Its backward returns as many bytes of dK and
    dV partials."""
    elem = torch.empty((), dtype=dtype).element_size()
    others = sum(lengths[:rank]) if causal else sum(lengths) - lengths[rank]
    return 2 * B * H * D * elem * others


# ---------------------------------------------------------------- shards


def _lcm(a, b):
    return a * b // math.gcd(a, b)


def shard_lengths(N, P, *, scheme="context", block_q=128, block_k=64):
    """Local sequence lengths of P ranks for a sequence of N tokens. scheme="ulysses": N/P each (N must be a
    multiple of P). scheme="context": whole units of lcm(block_q, block_k) tokens spread as evenly as they go,
    the last rank holding the ragged remainder."""
    N, P = _checks.integer(N, "N", 1, _lib.INT64_MAX), _checks.integer(P, "P", 1, _lib.INT64_MAX)
    block_q, block_k = _checks.block(block_q, "block_q"), _checks.block(block_k, "block_k")
    if scheme == "ulysses":
        if N % P:
            raise ValueError(f"sparge.parallel: Ulysses needs equal shards; N = {N} is not a multiple of P = {P}")
        return [N // P] * P
    if scheme != "context":
        raise ValueError(f"sparge.parallel: scheme must be 'ulysses' or 'context', got {scheme!r}")
    unit = _lcm(block_q, block_k)
    units = -(-N // unit)
    if units < P:
        raise ValueError(f"sparge.parallel: N = {N} holds {units} unit(s) of lcm(block_q, block_k) = {unit} "
                         f"tokens, fewer than P = {P} ranks")
    base, extra = divmod(units, P)
    lengths = [(base + (i < extra)) * unit for i in range(P)]
    lengths[-1] -= sum(lengths) - N
    return lengths


def local_shard(x, lengths, rank, dim):
    """Rank `rank`'s shard of x along the sequence dimension `dim` (a view)."""
    start = sum(lengths[:rank])
    return x.narrow(dim, start, lengths[rank])


# ---------------------------------------------------------------- agreement between ranks


def _world(group):
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("sparge.parallel: torch.distributed is not initialized (call "
                           "torch.distributed.init_process_group first)")
    return dist.get_world_size(group), dist.get_rank(group)


def _meta_device(group):
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _bits(x):
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


@dataclasses.dataclass(frozen=True)
class _Options:
    group: object
    layout: str
    topk: float
    topp: float
    block_q: int
    block_k: int
    scale: object
    backend: object
    deterministic: bool
    stats: CommStats
    causal: bool
    requires_grad: bool  # whether autograd will run the backward, whose collectives every rank must join


# Fields every rank must agree on, in the order of the exchanged vector (the local length comes after them).
_SAME = ("B", "H", "Hkv", "D", "dtype", "layout", "block_q", "block_k", "topk", "topp", "scale", "deterministic",
         "causal", "backend", "requires_grad")


def _local_fields(q, k, v, opt):
    """(the exchanged description of this rank's call, its options checked and normalised), or raises what is
    wrong with its arguments."""
    _torch.check_layout(opt.layout)
    for role, t in (("q", q), ("k", k), ("v", v)):
        if isinstance(t, torch.Tensor) and t.dtype == torch.float64:
            raise TypeError(f"{role} is float64: the schemes take float32, float16 and bfloat16; float64 only in "
                            "single-device calls (sparge_attention with backend='cpu-ref')")
        _torch.view(t, opt.layout, role)  # raises for non-tensors, unsupported dtypes, non-4-D shapes
    _torch.same_device([("q", q), ("k", k), ("v", v)])
    kind = {"nccl": "cuda", "gloo": "cpu"}.get(str(dist.get_backend(opt.group)))
    if kind is not None and q.device.type != kind:
        raise ValueError(f"the group's backend {dist.get_backend(opt.group)} needs {kind} tensors, q is on {q.device}")
    if not (k.dtype == q.dtype == v.dtype):
        raise TypeError(f"q, k and v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    B, H, n, D = _torch.bhnd_shape(q, opt.layout)
    kB, Hkv, kn, kD = _torch.bhnd_shape(k, opt.layout)
    if _torch.bhnd_shape(v, opt.layout) != (kB, Hkv, kn, kD):
        raise ValueError(f"v {list(v.shape)} must have k's shape {list(k.shape)}")
    if (kB, kn, kD) != (B, n, D):
        raise ValueError(f"k and v must hold the same tokens as q (B, local N and D of q: {B}, {n}, {D}; of k: "
                         f"{kB}, {kn}, {kD})")
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"k has {Hkv} heads, which must divide q's {H} (grouped K/V heads)")
    # The checks of sparge_attention, here where a refusal reaches every rank: later, one rank's refusal would
    # leave the others waiting in a collective.
    topk, topp, block_q, block_k, scale = mask_params(opt.topk, opt.topp, opt.block_q, opt.block_k, opt.scale)
    backend = _checks.backend(opt.backend)
    resolved = _torch.sparge_device_name(q.device, backend).partition(":")[0]
    _torch.check_compiled_in(resolved)
    opt = dataclasses.replace(opt, topk=topk, topp=topp, block_q=block_q, block_k=block_k, scale=scale,
                              backend=backend, deterministic=_checks.flag(opt.deterministic, "deterministic"),
                              causal=_checks.flag(opt.causal, "causal"))
    fields = dict(B=B, H=H, Hkv=Hkv, D=D, dtype=_DTYPE_CODES[q.dtype], layout=_torch.LAYOUTS.index(opt.layout),
                  block_q=block_q, block_k=block_k, topk=_bits(topk), topp=_bits(topp),
                  scale=_bits(scale if scale is not None else 0.0), deterministic=int(opt.deterministic),
                  causal=int(opt.causal), backend=_checks.BACKENDS.index(resolved),
                  requires_grad=int(opt.requires_grad))
    return [fields[name] for name in _SAME] + [n], opt


def _requires_grad(q, k, v):
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v))


def _agree(q, k, v, opt, P, rank):
    """Exchange every rank's description; every rank raises the same ValueError if a rank refused its
    arguments or the ranks disagree. Returns the local lengths of all ranks, the shared fields and the checked
    options."""
    error = None
    try:
        local, opt = _local_fields(q, k, v, opt)
    except (TypeError, ValueError) as e:
        error, local = str(e), [0] * (len(_SAME) + 1)
    t = torch.tensor([1 if error else 0] + local, dtype=torch.int64, device=_meta_device(opt.group))
    rows = [torch.empty_like(t) for _ in range(P)]
    dist.all_gather(rows, t, group=opt.group)
    rows = torch.stack(rows).cpu().tolist()
    row_bytes = t.numel() * t.element_size()
    opt.stats._moved("meta", row_bytes * (P - 1), row_bytes * (P - 1))
    bad = [r for r, row in enumerate(rows) if row[0]]
    if bad:
        if error:
            raise ValueError(f"sparge.parallel: rank {rank} refused its arguments: {error}")
        raise ValueError(f"sparge.parallel: rank {', '.join(map(str, bad))} refused its arguments (the reason is "
                         "raised there)")
    for i, name in enumerate(_SAME):
        values = [row[1 + i] for row in rows]
        if len(set(values)) > 1:
            raise ValueError(f"sparge.parallel: the ranks disagree on {name} (one value per rank: {values})")
    shared = dict(zip(_SAME, rows[0][1:]))
    return [row[-1] for row in rows], shared, opt


# ---------------------------------------------------------------- Ulysses


def _seq_to_heads(tensors, layout, P, group, stats, phase):
    """Sequence shards of all heads -> the whole sequence for heads [rank·H/P, (rank+1)·H/P), for every tensor
    of the list in one all-to-all (each may have its own head count, a multiple of P)."""
    chunks, shapes = [], []
    for x in tensors:
        if layout == "bhnd":
            B, H, n, D = x.shape
            chunks.append(x.reshape(B, P, H // P, n, D).transpose(0, 1).reshape(P, -1))
        else:
            B, n, H, D = x.shape
            chunks.append(x.reshape(B, n, P, H // P, D).permute(2, 0, 1, 3, 4).reshape(P, -1))
        shapes.append((B, H // P, n, D))
    recv = _all_to_all_equal(torch.cat(chunks, dim=1), group, stats, phase)
    out, col = [], 0
    for B, Hp, n, D in shapes:
        part = recv[:, col:col + B * Hp * n * D]
        col += B * Hp * n * D
        if layout == "bhnd":  # [src, B, Hp, n, D] -> [B, Hp, src·n, D]
            out.append(part.reshape(P, B, Hp, n, D).permute(1, 2, 0, 3, 4).reshape(B, Hp, P * n, D))
        else:  # [src, B, n, Hp, D] -> [B, src·n, Hp, D]
            out.append(part.reshape(P, B, n, Hp, D).transpose(0, 1).reshape(B, P * n, Hp, D))
    return out


def _heads_to_seq(tensors, layout, P, group, stats, phase):
    """The inverse of _seq_to_heads."""
    chunks, shapes = [], []
    for y in tensors:
        if layout == "bhnd":
            B, Hp, N, D = y.shape
            chunks.append(y.reshape(B, Hp, P, N // P, D).permute(2, 0, 1, 3, 4).reshape(P, -1))
        else:
            B, N, Hp, D = y.shape
            chunks.append(y.reshape(B, P, N // P, Hp, D).transpose(0, 1).reshape(P, -1))
        shapes.append((B, Hp, N // P, D))
    recv = _all_to_all_equal(torch.cat(chunks, dim=1), group, stats, phase)
    out, col = [], 0
    for B, Hp, n, D in shapes:
        part = recv[:, col:col + B * Hp * n * D]
        col += B * Hp * n * D
        if layout == "bhnd":  # [head group, B, Hp, n, D] -> [B, H, n, D]
            out.append(part.reshape(P, B, Hp, n, D).transpose(0, 1).reshape(B, P * Hp, n, D))
        else:  # [head group, B, n, Hp, D] -> [B, n, H, D]
            out.append(part.reshape(P, B, n, Hp, D).permute(1, 2, 0, 3, 4).reshape(B, n, P * Hp, D))
    return out


def _wire(t):
    """t as the collectives carry it: bfloat16 as float16 of the same bits, since gloo lacks bfloat16 in some torch
    versions (1.13 among them) and an all-to-all only copies."""
    return t.view(torch.float16) if t.dtype == torch.bfloat16 else t


def _all_to_all_equal(send, group, stats, phase):
    send = send.contiguous()
    recv = torch.empty_like(send)
    dist.all_to_all_single(_wire(recv), _wire(send), group=group)
    P = send.shape[0]
    moved = send.numel() // P * (P - 1) * send.element_size()
    stats._moved(phase, moved, moved)
    return recv


def _kv_copies(H, Hkv, P):
    """How many times Ulysses repeats each K/V head: the fewest copies f (f dividing H/Hkv, so that the copies
    keep the grouping of query heads) for which P divides Hkv·f. f = H/Hkv always works when P divides H."""
    group = H // Hkv
    return next(f for f in range(1, group + 1) if group % f == 0 and Hkv * f % P == 0)


def _repeat_heads(x, f, layout):
    return x if f == 1 else x.repeat_interleave(f, dim=1 if layout == "bhnd" else 2)


def _sum_copies(x, f, layout):
    """The inverse of _repeat_heads for gradients: each head's copies summed."""
    if f == 1:
        return x
    if layout == "bhnd":
        B, H, n, D = x.shape
        return x.view(B, H // f, f, n, D).sum(2)
    B, n, H, D = x.shape
    return x.view(B, n, H // f, f, D).sum(3)


def _empty_forward(ctx, q, k, v, holder):
    """Inputs without batch entries, tokens or head dim: an empty output as sparge_attention gives, and nothing
    exchanged (every rank agreed on the shapes, so every rank comes here, and to _empty_backward)."""
    ctx.empty = True
    ctx.save_for_backward(q, k, v)
    holder["mask"] = None
    return q.new_zeros(q.shape)


def _empty_backward(ctx):
    return tuple(torch.zeros_like(t) for t in ctx.saved_tensors) + (None, None)


class _Ulysses(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, opt, holder):
        ctx.empty = False
        P, rank = _world(opt.group)
        lengths, shared, opt = _agree(q, k, v, opt, P, rank)
        if len(set(lengths)) > 1:
            raise ValueError(f"sparge.parallel: Ulysses needs equal sequence shards, the ranks hold {lengths} tokens "
                             "(use context_parallel_attention for unequal or ragged shards)")
        if shared["H"] % P:
            raise ValueError(f"sparge.parallel: Ulysses spreads heads over ranks: P = {P} must divide H = "
                             f"{shared['H']}")
        if shared["B"] == 0 or shared["D"] == 0 or lengths[0] == 0:
            return _empty_forward(ctx, q, k, v, holder)
        copies = _kv_copies(shared["H"], shared["Hkv"], P)
        st, device = opt.stats, q.device
        B, H, n, D = _torch.bhnd_shape(q, opt.layout)
        ring = dense_ring_bytes(lengths, B, shared["Hkv"], D, q.dtype, rank, opt.causal)
        st.dense_ring["forward"] = st.dense_ring.get("forward", 0) + ring
        with st._part("comm", device):
            qh, kh, vh = _seq_to_heads([q, _repeat_heads(k, copies, opt.layout), _repeat_heads(v, copies, opt.layout)],
                                       opt.layout, P, opt.group, st, "qkv")
        with st._part("mask", device):
            mask = predict_mask(qh, kh, topk=opt.topk, topp=opt.topp, block_q=opt.block_q, block_k=opt.block_k,
                                scale=opt.scale, layout=opt.layout, backend=opt.backend, causal=opt.causal)
        with st._part("attention", device):
            oh, lse = attention_forward(qh, kh, vh, mask, scale=opt.scale, layout=opt.layout, backend=opt.backend)
        with st._part("comm", device):
            (o,) = _heads_to_seq([oh], opt.layout, P, opt.group, st, "o")
        ctx.save_for_backward(qh, kh, vh, oh, lse)
        ctx.mask, ctx.held, ctx.opt, ctx.P, ctx.ring, ctx.copies = mask, mask._held(), opt, P, ring, copies
        holder["mask"] = mask
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        if ctx.empty:
            return _empty_backward(ctx)
        qh, kh, vh, oh, lse = ctx.saved_tensors
        ctx.mask._check_held(ctx.held)
        opt, P, st, device = ctx.opt, ctx.P, ctx.opt.stats, grad.device
        st.dense_ring["backward"] = st.dense_ring.get("backward", 0) + ctx.ring
        with st._part("comm", device):
            (gh,) = _seq_to_heads([grad], opt.layout, P, opt.group, st, "grad_o")
        with st._part("attention", device):
            dq, dk, dv = attention_backward(gh, qh, kh, vh, oh, lse, ctx.mask, scale=opt.scale, layout=opt.layout,
                                            deterministic=opt.deterministic, backend=opt.backend)
        with st._part("comm", device):
            dq, dk, dv = _heads_to_seq([dq, dk, dv], opt.layout, P, opt.group, st, "grad_qkv")
        return dq, _sum_copies(dk, ctx.copies, opt.layout), _sum_copies(dv, ctx.copies, opt.layout), None, None


def ulysses_attention(q, k, v, *, group=None, layout="bhnd", topk=0.03, topp=0.2, block_q=128, block_k=64,
                      scale=None, backend=None, deterministic=False, causal=False, return_mask=False, stats=None):
    """Block-sparse attention of a sequence sharded over the ranks of `group`, Ulysses style.

    q, k, v: this rank's shard, [B,H,n,D] (layout="bhnd") or [B,N,H,D] with n local tokens ("bnhd"); every
    rank holds n = N/P consecutive tokens, rank 0 the first. P must divide H. k and v may have Hkv heads dividing
    H (grouped K/V heads): each rank gets Hkv/P of them when P divides Hkv, else the K/V heads are repeated the
    fewest times that make their count a multiple of P (more bytes moved; dK, dV summed over the copies).
    causal=True: causal self-attention (query t attends keys u <= t). Returns this rank's shard of the output in
    q's layout (and, with return_mask=True, the mask of this rank's H/P heads over the whole sequence: heads
    [rank·H/P, (rank+1)·H/P) of the single-device mask). The mask parameters are sparge_attention's; stats (a
    CommStats) accumulates the bytes moved and, if asked, the time per part."""
    opt = _Options(group, layout, topk, topp, block_q, block_k, scale, backend, deterministic,
                   stats if stats is not None else CommStats(), causal, _requires_grad(q, k, v))
    holder = {}
    out = _Ulysses.apply(q, k, v, opt, holder)
    return (out, holder["mask"]) if return_mask else out


# ---------------------------------------------------------------- context parallelism


def _pool(x, block, dev):
    """Block means of x ([B,H,N,D] view) as f32 [B,H,ceil(N/block),D]: sparge_pool, the pooling of
    sparge_mask_predict, so a shard's blocks pool exactly as they do in the whole sequence."""
    B, H, N, D = x.shape
    out = torch.empty((B, H, -(-N // block), D), dtype=torch.float32, device=x.device)
    xv, ov = _torch.view(x, "bhnd", "x"), _torch.view(out, "bhnd", "pooled")
    with dev.bound():
        _lib.call("sparge_pool", dev.handle, ctypes.byref(xv), block, ctypes.byref(ov))
    return out


def _bhnd(t, layout):
    return t if layout == "bhnd" else t.transpose(1, 2)


def _in_layout(x, layout, dtype):
    """A contiguous tensor in `layout` holding the [B,H,N,D] tensor x, cast to dtype."""
    B, H, N, D = x.shape
    out = _torch.empty_in_layout(B, H, N, D, layout, dtype, x.device)
    _bhnd(out, layout).copy_(x)
    return out


@dataclasses.dataclass
class _Geometry:
    P: int
    rank: int
    lengths: list
    block_q: int
    block_k: int

    @property
    def starts(self):
        return [sum(self.lengths[:s]) for s in range(self.P)]

    def key_blocks(self, s):
        """Global key-block range [first, end) of rank s's shard."""
        first = self.starts[s] // self.block_k
        return first, first + -(-self.lengths[s] // self.block_k)


def _weight(lse_part, lse):
    """exp(lse_part - lse), exactly 0 where the part holds nothing (lse_part = -inf)."""
    w = torch.exp(lse_part - lse)
    return torch.where(torch.isneginf(lse_part), torch.zeros_like(w), w)


@dataclasses.dataclass
class _Source:
    """One source rank's partial attention: its K/V (the local shard, or the fetched blocks packed per head),
    the mask over them, the query rows that keep nothing from it (None if none) and those rows' own LSE."""
    rank: int
    k: torch.Tensor
    v: torch.Tensor
    mask: Mask
    keep_tok: object = None
    lse_own: object = None
    slots: object = None  # (b, h, slot) of the fetched blocks, in the order they arrived


class _ContextParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, opt, holder):
        ctx.empty = False
        P, rank = _world(opt.group)
        lengths, shared, opt = _agree(q, k, v, opt, P, rank)
        bq, bk = opt.block_q, opt.block_k
        unit = _lcm(bq, bk)
        if any(n <= 0 for n in lengths):
            raise ValueError(f"sparge.parallel: every rank must hold tokens, the ranks hold {lengths}")
        bad = [s for s in range(P - 1) if lengths[s] % unit]
        if bad:
            raise ValueError(f"sparge.parallel: context parallelism needs shards of whole blocks: the shards of "
                             f"ranks {bad} ({[lengths[s] for s in bad]} tokens) are not multiples of "
                             f"lcm(block_q, block_k) = {unit} (only the last rank's may be ragged; "
                             "see shard_lengths)")
        if shared["B"] == 0 or shared["D"] == 0:
            return _empty_forward(ctx, q, k, v, holder)
        g = _Geometry(P, rank, lengths, bq, bk)
        st, device = opt.stats, q.device
        dev = _torch.device_for(q, opt.backend)
        qv, kv, vv = _bhnd(q, opt.layout), _bhnd(k, opt.layout), _bhnd(v, opt.layout)
        B, H, n, D = qv.shape
        Hkv = kv.shape[1]
        N, nqb = sum(lengths), -(-n // bq)
        Nkb = -(-N // bk)
        k0, k1 = g.key_blocks(rank)

        # The single-device mask of this rank's query blocks: pooled Q and K as sparge_mask_predict pools them,
        # then a prediction on the pooled rows themselves (blocks of 1, whose pooling copies them exactly):
        # the same pooled map over the key blocks, the same row softmax and selection.
        with st._part("mask", device):
            qbar, kbar = _pool(qv, bq, dev), _pool(kv, bk, dev)
        with st._part("comm", device):
            kbar_all = _exchange_pooled_k(kbar, g, opt.causal, opt.group, st)  # [B,Hkv,Nkb or this end's,D]
        with st._part("mask", device):
            if opt.causal:
                dense = torch.zeros((B, H, nqb, Nkb), dtype=torch.bool, device=device)
                dense[..., :kbar_all.shape[2]] = _predict_causal_rows(qbar, kbar_all, g, N, opt, device)
            else:
                pm = Mask(B, H, nqb, Nkb, 1, 1, device, opt.backend)
                pm.predict(qbar, kbar_all, topk=opt.topk, topp=opt.topp, scale=opt.scale)
                dense = pm.dense.bool()  # [B,H,nqb,Nkb]
        with st._part("comm", device):
            # Per K/V head, the union over its query heads and the rank's query blocks.
            mine = dense.view(B, Hkv, H // Hkv, nqb, Nkb).any(3).any(2)
            needs = _all_gather_same(mine.to(torch.uint8), opt.group, st, "need").bool()  # [P,B,Hkv,Nkb]

        # counts[d][s]: key blocks rank d fetches from rank s (nothing from itself).
        per_block = needs.sum((1, 2))
        counts = torch.stack([per_block[:, a:b].sum(1) for a, b in map(g.key_blocks, range(P))], 1).tolist()
        for s in range(P):
            counts[s][s] = 0
        elem = q.element_size()
        blk = 2 * bk * D  # elements of one K block and one V block
        ring = dense_ring_bytes(lengths, B, Hkv, D, q.dtype, rank, opt.causal)
        st.dense_ring["forward"] = st.dense_ring.get("forward", 0) + ring

        # Send the kept blocks of this shard, for every destination in rank order, (b, h, j) ascending.
        with st._part("comm", device):
            wanted = needs[:, :, :, k0:k1].clone()
            wanted[rank] = False
            _, b_idx, h_idx, j_idx = wanted.nonzero(as_tuple=True)
            tok = (j_idx[:, None] * bk + torch.arange(bk, device=device)).clamp_(max=n - 1)
            send = torch.stack([kv[b_idx[:, None], h_idx[:, None], tok], vv[b_idx[:, None], h_idx[:, None], tok]], 1)
            send_counts = [counts[d][rank] for d in range(P)]
            recv_counts = counts[rank]
            recv = torch.empty((sum(recv_counts), 2, bk, D), dtype=q.dtype, device=device)
            # Every rank knows every count, so all skip together when nothing moves (always with one rank).
            work = _all_to_all_blocks(recv, send, recv_counts, send_counts, blk, opt.group, any(map(any, counts)))
            st._moved("kv", sum(send_counts) * blk * elem, sum(recv_counts) * blk * elem)

        # The local partial runs while the blocks travel; then one partial per source that sent any.
        acc, sources = [], []

        def attend(src, sub, dense_c, nc, causal=False):
            with st._part("mask", device):
                rowkeep = sub.any(3)  # [B,H,nqb]
                if not bool(rowkeep.all()):
                    # A row that keeps nothing from this source still needs a block: it attends to slot 0, and
                    # its result is dropped (weight 0 here, zero dO in the backward). Causal rows keep their
                    # diagonal, in their own shard: never the case there.
                    dense_c[:, :, :, 0] |= ~rowkeep
                    src.keep_tok = rowkeep.repeat_interleave(bq, dim=2)[:, :, :n]
                src.mask = Mask.from_dense(dense_c, n, nc, bq, bk, device, opt.backend, causal=causal)
            with st._part("attention", device):
                o_s, lse_s = attention_forward(qv, src.k, src.v, src.mask, scale=opt.scale, layout="bhnd",
                                               backend=opt.backend)
                if src.keep_tok is not None:
                    src.lse_own = lse_s
                    lse_s = lse_s.masked_fill(~src.keep_tok, float("-inf"))
                if not acc:
                    acc[:] = [o_s.float() * _weight(lse_s, lse_s)[..., None], lse_s]
                else:
                    o_acc, lse_acc = acc
                    lse_new = torch.logaddexp(lse_acc, lse_s)
                    acc[:] = [o_acc * _weight(lse_acc, lse_new)[..., None] +
                              o_s.float() * _weight(lse_s, lse_new)[..., None], lse_new]
            sources.append(src)

        # The own shard holds the diagonal: its queries and keys start at the same global position, so sparge's
        # causal rule on the shard (Nq = Nk = n) is the global one. Earlier shards lie wholly below it.
        local = dense[:, :, :, k0:k1]
        if local.any():
            attend(_Source(rank, kv, vv, None), local, local.clone(), n, opt.causal)
        with st._part("comm", device):
            work.wait()
        offset = 0
        for s in range(P):
            if s != rank and recv_counts[s]:
                a, b = g.key_blocks(s)
                sub = dense[:, :, :, a:b]
                src, dense_c, nc = _unpack(s, sub, recv[offset:offset + recv_counts[s]], g, B, H, Hkv, D)
                attend(src, sub, dense_c, nc)
            offset += recv_counts[s]
        o_acc, lse_acc = acc

        o = _in_layout(o_acc, opt.layout, q.dtype)
        ctx.save_for_backward(q, o, lse_acc)
        ctx.opt, ctx.geometry, ctx.sources = opt, g, sources
        ctx.send_index = (b_idx, h_idx, j_idx, send_counts, recv_counts)
        ctx.moves = any(map(any, counts))
        ctx.ring = ring
        holder["mask"] = dense, n, N
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        if ctx.empty:
            return _empty_backward(ctx)
        q, o, lse = ctx.saved_tensors
        opt, g, st = ctx.opt, ctx.geometry, ctx.opt.stats
        bk, device = g.block_k, grad.device
        qv, ov, gv = _bhnd(q, opt.layout), _bhnd(o, opt.layout), _bhnd(grad, opt.layout)
        B, H, n, D = qv.shape
        Hkv = ctx.sources[0].k.shape[1]
        nkb = -(-n // bk)
        b_idx, h_idx, j_idx, send_counts, recv_counts = ctx.send_index
        st.dense_ring["backward"] = st.dense_ring.get("backward", 0) + ctx.ring
        dq = torch.zeros((B, H, n, D), dtype=torch.float32, device=device)
        dk = torch.zeros((B, Hkv, nkb * bk, D), dtype=torch.float32, device=device)
        dv = torch.zeros_like(dk)
        back = {}
        for src in ctx.sources:
            with st._part("attention", device):
                if src.keep_tok is None:
                    g_s, lse_s = gv, lse
                else:  # dropped rows: zero dO, and their own LSE so that their probabilities stay finite
                    g_s = gv * src.keep_tok[..., None]
                    lse_s = torch.where(src.keep_tok, lse, src.lse_own).contiguous()
                dq_s, dk_s, dv_s = attention_backward(g_s, qv, src.k, src.v, ov, lse_s, src.mask, scale=opt.scale,
                                                      layout="bhnd", deterministic=opt.deterministic,
                                                      backend=opt.backend)
                dq += dq_s
                if src.rank == g.rank:
                    dk[:, :, :n] += dk_s
                    dv[:, :, :n] += dv_s
                else:
                    back[src.rank] = torch.stack([_blocks_of(dk_s, src.slots, bk), _blocks_of(dv_s, src.slots, bk)], 1)
        # The partial dK/dV of fetched blocks go back to their owners (the reverse of the forward's exchange).
        with st._part("comm", device):
            blk = 2 * bk * D
            send = torch.cat([back[s] for s in range(g.P) if s in back]) if back else \
                torch.empty((0, 2, bk, D), dtype=q.dtype, device=device)
            recv = torch.empty((sum(send_counts), 2, bk, D), dtype=q.dtype, device=device)
            _all_to_all_blocks(recv, send, send_counts, recv_counts, blk, opt.group, ctx.moves).wait()
            st._moved("grad_kv", sum(recv_counts) * blk * q.element_size(), sum(send_counts) * blk * q.element_size())
        with st._part("attention", device):
            dkb, dvb = dk.view(B, Hkv, nkb, bk, D), dv.view(B, Hkv, nkb, bk, D)
            start = 0
            for c in send_counts:  # one destination at a time: its blocks are distinct, the sum order fixed
                sl = slice(start, start + c)
                dkb.index_put_((b_idx[sl], h_idx[sl], j_idx[sl]), recv[sl, 0].float(), accumulate=True)
                dvb.index_put_((b_idx[sl], h_idx[sl], j_idx[sl]), recv[sl, 1].float(), accumulate=True)
                start += c
        return (_in_layout(dq, opt.layout, q.dtype), _in_layout(dk[:, :, :n], opt.layout, q.dtype),
                _in_layout(dv[:, :, :n], opt.layout, q.dtype), None, None)


def _exchange_pooled_k(kbar, g, causal, group, stats):
    """Every rank's pooled K [B,Hkv,nkb_s,D], concatenated along the key blocks. With causal a rank receives only
    the shards up to its own (the later ones lie above its diagonal) and sends its own only to the ranks from it
    on, so the result ends at the rank's last key block."""
    B, Hkv, c, D = kbar.shape
    sources = range(g.rank + 1) if causal else range(g.P)
    blocks = [g.key_blocks(s)[1] - g.key_blocks(s)[0] for s in range(g.P)]
    row = B * Hkv * D
    if g.P == 1:
        return kbar
    send_counts = [c * row if not causal or d >= g.rank else 0 for d in range(g.P)]
    recv_counts = [blocks[s] * row if s in sources else 0 for s in range(g.P)]
    send = kbar.contiguous().view(-1).repeat(sum(1 for x in send_counts if x))
    recv = torch.empty(sum(recv_counts), dtype=kbar.dtype, device=kbar.device)
    dist.all_to_all_single(recv, send, recv_counts, send_counts, group=group)
    stats._moved("pooled_k", 4 * (sum(send_counts) - send_counts[g.rank]), 4 * (sum(recv_counts) - recv_counts[g.rank]))
    parts = recv.split(recv_counts)
    return torch.cat([parts[s].view(B, Hkv, blocks[s], D) for s in sources], dim=2)


def _predict_causal_rows(qbar, kbar_all, g, N, opt, device):
    """Rows of the single-device causal mask (self-attention over N tokens) for this rank's query blocks, from
    their pooled Q [B,H,nqb,D] and the pooled K of the key blocks up to this rank's end: bool [B,H,nqb,K].

    Query block I may attend key blocks [0, a_I), a_I = d1 + 1 for its diagonal blocks d0..d1 (sparge_row_rule);
    its map row is the softmax over those, selected, with the diagonal blocks kept besides. A causal prediction on
    pooled rows (blocks of 1) gives row p of an (nq', K) problem exactly that rule with a = p + K − nq' + 1 and d1
    = a − 1, so each pooled Q row is placed at the row whose a is its own (other rows hold zeros and are
    discarded) and d0..d1−1 are added afterwards. Rows of equal a (blocks narrower than key blocks, or a ragged last
    one) go to separate rounds."""
    B, H, nqb, D = qbar.shape
    bq, bk = g.block_q, g.block_k
    first = g.starts[g.rank] // bq
    t0 = [(first + i) * bq for i in range(nqb)]
    d0 = [t // bk for t in t0]
    d1 = [(min(t + bq, N) - 1) // bk for t in t0]
    rounds, seen = {}, {}
    for i, d in enumerate(d1):
        r = seen[d] = seen.get(d, -1) + 1
        rounds.setdefault(r, []).append(i)
    K = kbar_all.shape[2]
    dense = torch.zeros((B, H, nqb, K), dtype=torch.bool, device=device)
    for rows in rounds.values():
        a = torch.tensor([d1[i] + 1 for i in rows], device=device)
        lo, hi = int(a.min()), int(a.max())
        place = a - lo
        fake = torch.zeros((B, H, hi - lo + 1, D), dtype=qbar.dtype, device=device)
        fake[:, :, place] = qbar[:, :, rows]
        pm = Mask(B, H, hi - lo + 1, hi, 1, 1, device, opt.backend, causal=True)
        pm.predict(fake, kbar_all[:, :, :hi], topk=opt.topk, topp=opt.topp, scale=opt.scale)
        dense[:, :, rows, :hi] = pm.dense.bool()[:, :, place]
    for i in range(nqb):
        dense[:, :, i, d0[i]:d1[i] + 1] = True
    return dense


class _Done:
    def wait(self):
        pass


def _all_to_all_blocks(recv, send, recv_counts, send_counts, blk, group, moves):
    """Blocks [count, 2, bk, D] to and from every rank (counts per rank, in blocks of blk elements),
    asynchronously; nothing is called when no rank moves anything."""
    if not moves:
        return _Done()
    return dist.all_to_all_single(_wire(recv.view(-1)), _wire(send.reshape(-1)), [c * blk for c in recv_counts],
                                  [c * blk for c in send_counts], group=group, async_op=True)


def _all_gather_same(t, group, stats, phase):
    P = dist.get_world_size(group)
    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(P)]
    dist.all_gather(parts, t, group=group)
    moved = t.numel() * t.element_size() * (P - 1)
    stats._moved(phase, moved, moved)
    return torch.stack(parts)


def _unpack(s, sub, blocks, g, B, H, Hkv, D):
    """The blocks fetched from rank s ([count, 2, bk, D], (b, K/V head, j) ascending) packed per K/V head into K
    and V of [B,Hkv,Nc,D]: block j of head (b,h) in slot (its rank among that head's blocks), a ragged last block
    of the sequence in the last slot, so that it ends the tensor. Returns the source, the mask over the slots (each
    query head's rows over its K/V head's slots) and Nc."""
    bk = g.block_k
    group = H // Hkv
    need = sub.view(B, Hkv, group, *sub.shape[2:]).any(3).any(2)  # [B,Hkv,nkb_s]: what was fetched, in send order
    rem = g.lengths[s] % bk
    whole = need.clone()
    if rem:
        whole[:, :, -1] = False
    slot = whole.long().cumsum(2) - 1
    width = int(whole.sum(2).max())
    ragged = bool(rem) and bool(need[:, :, -1].any())
    if ragged:
        slot[:, :, -1] = width
    nslots = width + ragged
    nc = width * bk + (rem if ragged else 0)
    b, h, j = need.nonzero(as_tuple=True)
    packed = torch.zeros((2, B, Hkv, nslots, bk, D), dtype=blocks.dtype, device=blocks.device)
    packed[:, b, h, slot[b, h, j]] = blocks.transpose(0, 1)
    k = packed[0].view(B, Hkv, nslots * bk, D)[:, :, :nc]
    v = packed[1].view(B, Hkv, nslots * bk, D)[:, :, :nc]
    dense_c = torch.zeros(sub.shape[:3] + (nslots,), dtype=torch.bool, device=sub.device)
    bb, hh, ii, jj = sub.nonzero(as_tuple=True)
    dense_c[bb, hh, ii, slot[bb, hh // group, jj]] = True
    return _Source(s, k, v, None, slots=(b, h, slot[b, h, j])), dense_c, nc


def _blocks_of(x, slots, bk):
    """The blocks at `slots` of a [B,H,Nc,D] tensor (zero past Nc), as [count, bk, D]."""
    B, H, nc, D = x.shape
    nslots = -(-nc // bk)
    if nc != nslots * bk:
        x = torch.cat([x, x.new_zeros((B, H, nslots * bk - nc, D))], dim=2)
    b, h, slot = slots
    return x.reshape(B, H, nslots, bk, D)[b, h, slot]


def context_parallel_attention(q, k, v, *, group=None, layout="bhnd", topk=0.03, topp=0.2, block_q=128,
                               block_k=64, scale=None, backend=None, deterministic=False, causal=False,
                               return_mask=False, stats=None):
    """Block-sparse attention of a sequence sharded over the ranks of `group`, with the exact global mask.

    q, k, v: this rank's shard ([B,H,n,D] or [B,n,H,D] with layout="bnhd"); rank 0 holds the first tokens.
    Every shard but the last must be a multiple of lcm(block_q, block_k) tokens (shard_lengths(N, P) gives such
    lengths); the shards may differ in length. k and v may have Hkv heads dividing H (grouped K/V heads: the
    blocks fetched are K/V heads' blocks, the union over their query heads). Each rank predicts the
    single-device mask of its query blocks from its pooled Q and every rank's pooled K, fetches the K/V blocks it
    keeps from their owners, and merges per-source partial attentions by their LSE; the backward returns the
    dK/dV partials to the owners. causal=True: causal self-attention over global positions (query t attends keys
    u <= t); a rank then receives pooled K and K/V blocks only from the ranks up to itself.
    Returns this rank's output shard in q's layout (and, with return_mask=True, the Mask of this rank's query
    blocks over the whole sequence: rows [first, last] of the single-device mask, set from its dense form as a
    mask without causal, whose statistics count every block). stats (a CommStats) accumulates the bytes moved,
    with the dense ring's for comparison (with causal, a ring that brings only the earlier shards)."""
    opt = _Options(group, layout, topk, topp, block_q, block_k, scale, backend, deterministic,
                   stats if stats is not None else CommStats(), causal, _requires_grad(q, k, v))
    holder = {}
    out = _ContextParallel.apply(q, k, v, opt, holder)
    if not return_mask or holder["mask"] is None:
        return (out, None) if return_mask else out
    dense, n, N = holder["mask"]
    return out, Mask.from_dense(dense.to(torch.uint8), n, N, block_q, block_k, q.device, backend)
