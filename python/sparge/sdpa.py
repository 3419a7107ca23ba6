"""patch_sdpa: route a model's F.scaled_dot_product_attention calls to sparge without editing the model."""
import contextlib
import dataclasses
import math
import threading

import torch
import torch.nn.functional as F

from . import _checks, _lib, _torch
from .attention import sparge_attention
from .mask import mask_params

_patch_lock = threading.Lock()


@dataclasses.dataclass
class SdpaRouting:
    """What a patch_sdpa block did: calls sent to sparge and calls passed to torch unchanged."""

    routed: int = 0
    passed: int = 0


def _math_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """SDPA's semantics spelled out, for torch without F.scaled_dot_product_attention (before 2.0)."""
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        key = key.repeat_interleave(query.shape[-3] // key.shape[-3], dim=-3)
        value = value.repeat_interleave(query.shape[-3] // value.shape[-3], dim=-3)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    s = (query @ key.transpose(-1, -2)) * scale
    if is_causal:
        keep = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool, device=s.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask
    p = torch.softmax(s, dim=-1)
    if dropout_p > 0.0:
        p = F.dropout(p, dropout_p)
    return p @ value


def _compiling():
    """Whether torch.compile is tracing (torch >= 2.3 says so; older torch has no compiler to ask)."""
    compiler = getattr(torch, "compiler", None)
    return compiler is not None and hasattr(compiler, "is_compiling") and compiler.is_compiling()


def _device_runs(query, key, value, is_causal, block_q, block_k, backend):
    """Whether a tier of the call's sparge device runs its prediction, forward and (when autograd will ask for
    it) backward: head dims beyond a device's limit are not known from the shapes alone."""
    B, H, Nq, D = query.shape
    Hk, Nk = key.shape[1], key.shape[2]
    ops = ["mask_predict", "forward"]
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        ops.append("backward")
    dev = _torch.device_for(query, backend)
    try:
        for op in ops:
            dev.supports(op, dtype=query.dtype, head_dim=D, block_q=block_q, block_k=block_k, B=B, H=H, Nq=Nq,
                         Nk=Nk, kv_heads=Hk, causal=is_causal)
    except _lib.SpargeError:
        return False
    return True


@contextlib.contextmanager
def patch_sdpa(topk=_checks.DEFAULT_TOPK, topp=_checks.DEFAULT_TOPP, block_q=_checks.DEFAULT_BLOCK_Q,
               block_k=_checks.DEFAULT_BLOCK_K, *, min_tokens=0, backend=None, deterministic=False):
    """Within the block, torch.nn.functional.scaled_dot_product_attention sends every call that sparge
    computes exactly as asked — 4-D [B,H,N,D] query/key/value of one dtype sparge takes (float32, float16,
    bfloat16) on a device it has a backend for, one head dim, the same head count (or, with enable_gqa=True, a
    K/V head count dividing query's), no attn_mask, dropout_p 0, scale None or nonzero and finite in float32,
    is_causal False or, with Nq = Nk, True (where SDPA's top-left causal diagonal is sparge's bottom-right one), a
    head dim that a tier of the device runs (the CPU's limit is 256; under torch.compile, which cannot trace that
    query, the shapes alone decide) — to sparge_attention with these mask parameters, self- and cross-attention
    alike, when both Nq and Nk are >= min_tokens (min_tokens=1024 keeps a 512-token text cross-attention dense).
    Every other call goes to the function that was there before, unchanged (inside another patch_sdpa block, to
    the function that block replaced: the innermost block decides).
    The previous function is restored on exit. Yields an SdpaRouting that counts routed and passed calls.

    The patch replaces the attribute of torch.nn.functional, so it reaches code that calls
    F.scaled_dot_product_attention (or torch.nn.functional.scaled_dot_product_attention) at call time, not a
    reference taken before the block, and it applies to every thread. Torch before 2.0 has no SDPA: there the
    block installs one, and passed calls get the plain softmax(QKᵀ·scale)V computation."""
    topk, topp, block_q, block_k, _ = mask_params(topk, topp, block_q, block_k, None)
    min_tokens = _checks.integer(min_tokens, "min_tokens", 0, _lib.INT32_MAX)
    backend = _checks.backend(backend)
    _checks.flag(deterministic, "deterministic")
    available = set(_lib.backends())  # read now: the routing test below stays plain Python for torch.compile
    device_types = set()
    if available & {"cpu", "cpu-ref"}:
        device_types.add("cpu")
    if available & {"cuda", "cuda-generic", "hip"}:
        device_types.add("cuda")
    if backend is not None:
        device_types &= {"cpu"} if backend.startswith("cpu") else {"cuda"}
    routing = SdpaRouting()
    sentinel = object()
    with _patch_lock:
        previous = getattr(F, "scaled_dot_product_attention", sentinel)
    # Inside another patch_sdpa block, calls this one passes go to torch's function, not to the outer block,
    # which would route what this block's parameters (min_tokens, ...) keep dense.
    fallback = _math_sdpa if previous is sentinel else getattr(previous, "sparge_passes_to", previous)

    def routable(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
        if attn_mask is not None or dropout_p != 0.0:
            return False
        try:
            _checks.scale(scale)
        except (TypeError, ValueError):
            return False
        if not isinstance(is_causal, bool) or not isinstance(enable_gqa, bool):
            return False
        tensors = (query, key, value)
        if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in tensors):
            return False
        if query.dtype not in _checks.FLOAT_DTYPES or any(t.dtype != query.dtype or t.device != query.device
                                                           for t in tensors):
            return False
        if query.device.type not in device_types:
            return False
        B, H, Nq, D = query.shape
        Hk = key.shape[1]
        if key.shape[0] != B or key.shape[3] != D or value.shape != key.shape:
            return False
        if Hk != H and not (enable_gqa and Hk > 0 and H % Hk == 0):
            return False
        if is_causal and Nq != key.shape[2]:
            return False
        if not (min(Nq, key.shape[2]) >= max(min_tokens, 1) and B > 0 and H > 0 and D > 0):
            return False
        # Asking the device is a library call, which torch.compile cannot trace: compiled graphs route on the
        # checks above.
        return _compiling() or _device_runs(query, key, value, is_causal, block_q, block_k, backend)

    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *,
                                     scale=None, enable_gqa=False):
        if routable(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa):
            routing.routed += 1
            return sparge_attention(query, key, value, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                                    topk=topk, topp=topp, block_q=block_q, block_k=block_k, backend=backend,
                                    deterministic=deterministic)
        routing.passed += 1
        kwargs = {}
        if scale is not None:
            kwargs["scale"] = scale
        if enable_gqa:
            kwargs["enable_gqa"] = enable_gqa
        return fallback(query, key, value, attn_mask, dropout_p, is_causal, **kwargs)

    scaled_dot_product_attention.sparge_passes_to = fallback
    with _patch_lock:
        F.scaled_dot_product_attention = scaled_dot_product_attention
    try:
        yield routing
    finally:
        with _patch_lock:
            if previous is sentinel:
                del F.scaled_dot_product_attention
            else:
                F.scaled_dot_product_attention = previous
