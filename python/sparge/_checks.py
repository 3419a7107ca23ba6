"""Argument checks that run before anything reaches C.

Plain Python over tensor metadata (no ctypes, no library), so torch.compile traces them and folds them into
guards. Each returns the normalised value or raises TypeError / ValueError naming the argument.
"""
import math
import numbers

import torch

from ._lib import INT32_MAX, INT64_MAX

LAYOUTS = ("bhnd", "bnhd")
BACKENDS = ("cpu", "cpu-ref", "cuda", "cuda-generic", "hip")
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SHAPE_NAMES = {"bhnd": "[B,H,N,D]", "bnhd": "[B,N,H,D]"}

# The paper's hybrid mask: Top-k 3 % ∪ Top-p 20 % over 128 × 64 blocks (sparge_mask_params_default).
DEFAULT_TOPK = 0.03
DEFAULT_TOPP = 0.2
DEFAULT_BLOCK_Q = 128
DEFAULT_BLOCK_K = 64


def integer(value, name, lo, hi):
    """A Python/NumPy integer (not bool, not float) within [lo, hi]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"sparge: {name} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if not lo <= value <= hi:
        raise ValueError(f"sparge: {name} = {value} is outside [{lo}, {hi}]")
    return value


def block(value, name):
    """A block size: it travels as a C int, so 1 <= b <= 2^31 - 1."""
    return integer(value, name, 1, INT32_MAX)


def real(value, name):
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"sparge: {name} must be a float, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"sparge: {name} = {value} is not finite")
    return value


def fractions(topk, topp):
    """Top-k fraction and Top-p mass, each in [0, 1], not both 0."""
    topk, topp = real(topk, "topk"), real(topp, "topp")
    for name, x in (("topk", topk), ("topp", topp)):
        if not 0.0 <= x <= 1.0:
            raise ValueError(f"sparge: {name} = {x} is outside [0, 1]")
    if topk == 0.0 and topp == 0.0:
        raise ValueError("sparge: topk = topp = 0 selects nothing (set at least one > 0)")
    return topk, topp


# sparge takes the scale as a C float: magnitudes at or below half the smallest subnormal round to 0 (the default
# scale), at or above FLT_MAX plus half an ulp to infinity.
FLOAT32_ROUNDS_TO_ZERO = 2.0**-150
FLOAT32_ROUNDS_TO_INF = 2.0**128 - 2.0**103


def scale(value):
    """None (1/sqrt(D)) or a finite nonzero float; sparge's C scale 0 means the default, so 0 cannot pass, and
    neither can a float that the C float rounds to 0 or to infinity."""
    if value is None:
        return None
    value = real(value, "scale")
    if value == 0.0:
        raise ValueError("sparge: scale = 0 is not supported (None means 1/sqrt(D))")
    if not FLOAT32_ROUNDS_TO_ZERO < abs(value) < FLOAT32_ROUNDS_TO_INF:
        raise ValueError(f"sparge: scale = {value} is outside float32's range (sparge takes it as a float32, which "
                         f"would round it to {'0' if abs(value) <= FLOAT32_ROUNDS_TO_ZERO else 'infinity'})")
    return value


def layout(value):
    if value not in LAYOUTS:
        raise ValueError(f"sparge: layout must be 'bhnd' ([B,H,N,D]) or 'bnhd' ([B,N,H,D]), got {value!r}")
    return value


def backend(value):
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"sparge: backend must be a str or None, got {type(value).__name__}")
    if value not in BACKENDS:
        raise ValueError(f"sparge: unknown backend {value!r} (one of {', '.join(BACKENDS)})")
    return value


def flag(value, name):
    if not isinstance(value, bool):
        raise TypeError(f"sparge: {name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def strided(t, name):
    """A torch.Tensor with memory sparge can read: strided (not sparse, not MKL-DNN)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"sparge: {name} must be a torch.Tensor, got {type(t).__module__}.{type(t).__name__}")
    if t.layout != torch.strided:
        raise TypeError(f"sparge: {name} has layout {t.layout}; sparge reads strided (dense) tensors (convert it "
                        "with .to_dense())")
    if t.is_neg():
        raise ValueError(f"sparge: {name} carries torch's lazy negation bit (a view such as x.conj().imag): its "
                         f"memory holds the negated values; pass {name}.resolve_neg()")


def tensor(t, name, layout_):
    """A 4-D torch.Tensor of a floating dtype; returns its (B, H, N, D)."""
    strided(t, name)
    if t.dim() != 4:
        raise ValueError(f"sparge: {name} must be 4-D {_SHAPE_NAMES[layout_]} (layout '{layout_}'), got shape "
                         f"{list(t.shape)}")
    if t.dtype not in FLOAT_DTYPES and t.dtype != torch.float64:
        raise TypeError(f"sparge: {name} has dtype {t.dtype}; sparge takes float32, float16 and bfloat16 "
                        "(float64 on backend='cpu-ref')")
    B, X, Y, D = t.shape
    return (B, X, Y, D) if layout_ == "bhnd" else (B, Y, X, D)


def same_device(named):
    """Every tensor on the first one's device: sparge cannot tell a host pointer from a device one."""
    first_name, first = named[0]
    for name, t in named[1:]:
        if t.device != first.device:
            raise ValueError(f"sparge: {name} is on {t.device} but {first_name} is on {first.device}")


def same_dtype(named):
    first_name, first = named[0]
    for name, t in named[1:]:
        if t.dtype != first.dtype:
            raise TypeError(f"sparge: {name} is {t.dtype} but {first_name} is {first.dtype} (one dtype for all)")


def _length(n, name):
    if n > INT32_MAX:
        raise ValueError(f"sparge: {name} = {n} does not fit in int32")


def heads(Hq, Hk, grouped):
    """K's heads against q's: equal, or (grouped) dividing them, as SDPA's enable_gqa takes them."""
    if Hk == Hq:
        return
    if Hk == 0 or Hq % Hk:
        raise ValueError(f"sparge: q has {Hq} heads but k has {Hk}, which does not divide them (grouped K/V heads: "
                         "each K/V head serves H/Hkv query heads)")
    if not grouped:
        raise ValueError(f"sparge: q has {Hq} heads but k has {Hk}: grouped K/V heads need enable_gqa=True (as in "
                         "scaled_dot_product_attention)")


def qk(q, k, layout_, grouped=True):
    """Shapes of q and k for a mask: (B, H, Nq, Nk, D). k may have fewer heads, dividing q's, when grouped."""
    layout(layout_)
    Bq, Hq, Nq, Dq = tensor(q, "q", layout_)
    Bk, Hk, Nk, Dk = tensor(k, "k", layout_)
    same_device([("q", q), ("k", k)])
    same_dtype([("q", q), ("k", k)])
    if Bk != Bq:
        raise ValueError(f"sparge: q has batch {Bq} but k has batch {Bk}")
    heads(Hq, Hk, grouped)
    if Dk != Dq:
        raise ValueError(f"sparge: q has head dim {Dq} but k has {Dk}")
    _length(Nq, "Nq")
    _length(Nk, "Nk")
    _length(Dq, "D")
    return Bq, Hq, Nq, Nk, Dq


def causal_lengths(Nq, Nk, where=""):
    """Causal attention aligns the last query with the last key, so it needs Nq <= Nk."""
    if Nq > Nk:
        raise ValueError(f"sparge: causal attention needs Nq <= Nk{where} (query t attends keys u <= t + Nk - Nq, "
                         f"the diagonal aligned bottom-right), got Nq = {Nq}, Nk = {Nk}")


def cu_seqlens(t, name, total, role):
    """flash-attn's cumulative sequence lengths: a 1-D int32 tensor (any device) of B+1 offsets, from 0,
    non-decreasing (a sequence may be empty), ending at `total` (the packed tensor `role`'s tokens). Returns a host
    copy, never the caller's tensor: a Mask keeps it, and a caller refilling its buffer for the next batch must not
    change the mask's."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"sparge: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"sparge: {name} must be torch.int32 (flash-attn's convention), got {t.dtype}")
    if t.dim() != 1 or t.numel() < 2:
        raise ValueError(f"sparge: {name} must be 1-D with B+1 >= 2 entries, got shape {list(t.shape)}")
    host = t.detach().to("cpu").clone(memory_format=torch.contiguous_format)
    values = host.tolist()
    if values[0] != 0:
        raise ValueError(f"sparge: {name}[0] = {values[0]}, must be 0")
    for b in range(len(values) - 1):
        if values[b + 1] < values[b]:
            raise ValueError(f"sparge: {name} must not decrease (sequence {b} would hold a negative number of "
                             f"tokens): entries {b} and {b + 1} are {values[b]}, {values[b + 1]}")
    if values[-1] != total:
        raise ValueError(f"sparge: {name}[-1] = {values[-1]} but {role} holds {total} tokens")
    return host


def sequence_lengths(cu_q, cu_k, causal):
    """[(nq, nk)] of the packed sequences of checked offsets (as many of each): a sequence may be empty, but one
    with queries needs keys, and causal attention nq <= nk."""
    lengths = list(zip(cu_q.diff().tolist(), cu_k.diff().tolist()))
    for b, (nq, nk) in enumerate(lengths):
        if nq and not nk:
            raise ValueError(f"sparge: sequence {b} has {nq} query and 0 key tokens (its queries would attend "
                             "nothing)")
        if causal:
            causal_lengths(nq, nk, f" in every sequence (sequence {b})")
    return lengths


def qkv(q, k, v, layout_, grouped=True):
    """Shapes of q, k, v for attention: (B, H, Nq, Nk, D); k and v may have fewer heads when grouped."""
    B, H, Nq, Nk, D = qk(q, k, layout_, grouped)
    Bv, Hv, Nv, Dv = tensor(v, "v", layout_)
    same_device([("q", q), ("v", v)])
    same_dtype([("q", q), ("v", v)])
    Hk = tensor(k, "k", layout_)[1]
    if (Bv, Hv, Nv) != (B, Hk, Nk):
        what = "heads" if Hv != Hk else "batch" if Bv != B else "tokens"
        raise ValueError(f"sparge: v is {list(v.shape)} but k is {list(k.shape)} (v's {what} must match k's)")
    if Dv != D:
        raise ValueError(f"sparge: v has head dim {Dv} but q and k have {D} (sparge needs one head dim)")
    return B, H, Nq, Nk, D


def like(t, name, ref, ref_name):
    """t has ref's shape, dtype and device (outputs handed back: o, grad_out)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"sparge: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.shape != ref.shape:
        raise ValueError(f"sparge: {name} has shape {list(t.shape)} but {ref_name} has {list(ref.shape)}")
    if t.dtype != ref.dtype:
        raise TypeError(f"sparge: {name} is {t.dtype} but {ref_name} is {ref.dtype}")
    if t.device != ref.device:
        raise ValueError(f"sparge: {name} is on {t.device} but {ref_name} is on {ref.device}")


def mask_dims(B, H, Nq, Nk):
    return (integer(B, "B", 1, INT64_MAX), integer(H, "H", 1, INT64_MAX), integer(Nq, "Nq", 1, INT32_MAX),
            integer(Nk, "Nk", 1, INT32_MAX))


def is_empty(B, H, Nq, Nk, D):
    return B == 0 or H == 0 or Nq == 0 or Nk == 0 or D == 0
