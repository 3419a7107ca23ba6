"""Block-sparse attention on torch tensors: forward, backward, autograd, and the SDPA drop-in.

Two autograd paths lead to the same library calls. On torch >= 2.4 sparge_attention calls the custom op
sparge::attention (registered in _ops: fake shapes for torch.compile, autograd through sparge::attention_backward),
which predicts its mask inside and predicts it again in the backward from the saved q and k, so no Python object
crosses the graph. Elsewhere, and whenever a Mask object is given or returned, SpargeAttentionFunction holds the
Mask from the forward to the backward.

K and V may have fewer heads than Q (grouped K/V heads, Hkv dividing H: query head h reads K/V head h / (H/Hkv)),
and attention may be causal, aligned bottom-right as flash-attn aligns it (query t attends keys u <= t + Nk − Nq).
"""
import ctypes
import numbers

import torch
from torch.autograd.function import once_differentiable

from . import _checks, _lib, _torch
from .mask import (Mask, _predict, _scale_arg, defaulted_mask_params, given_mask_matches,
                   no_prediction_params, predict_csr_impl)


def _check_mask(mask, q, B, H, Nq, Nk, backend, varlen=False):
    if not isinstance(mask, Mask):
        raise TypeError(f"sparge: mask must be a sparge.Mask, got {type(mask).__name__}")
    if mask.varlen != varlen:
        raise ValueError("sparge: the mask is for packed variable-length sequences: use sparge_attention_varlen"
                         if mask.varlen else "sparge: the mask is for fixed-length tensors, not packed sequences")
    if mask.torch_device != q.device:
        raise ValueError(f"sparge: the mask is on {mask.torch_device} but q is on {q.device}")
    if backend is not None and backend != mask.device.backend:
        raise ValueError(f"sparge: the mask lives on backend '{mask.device.backend}', not '{backend}'")
    mask.check_attention_shapes(B, H, Nq, Nk)


def _attn_params(scale, deterministic, causal):
    return _lib.sparge_attn_params(_scale_arg(scale), 1 if deterministic else 0, 1 if causal else 0)


def _causal_arg(causal, mask, Nq, Nk):
    """The call's causality: the mask's when None; given, it must agree with a mask's. Dense: Nq <= Nk."""
    if causal is None:
        return mask.causal if mask is not None else False
    _checks.flag(causal, "causal")
    if mask is not None and causal != mask.causal:
        raise ValueError(f"sparge: causal={causal} but the mask was {'' if mask.causal else 'not '}created causal")
    if causal and mask is None:
        _checks.causal_lengths(Nq, Nk)
    return causal


def _unit_stride_rows(t):
    """Incoming gradients may be expanded (stride 0) or strided along D; GPU kernels need unit-stride rows."""
    if t.stride(-1) != 1 or any(s == 0 and n > 1 for s, n in zip(t.stride(), t.shape)):
        return t.contiguous()
    return t


# ---------------------------------------------------------------- calls on checked arguments
def _forward(q, k, v, mask, scale, layout, backend, causal):
    B, H, Nq, D = _torch.bhnd_shape(q, layout)
    Nk = _torch.bhnd_shape(k, layout)[2]
    if _checks.is_empty(B, H, Nq, Nk, D):
        # Like SDPA: nothing to attend to gives zeros (Nk = 0), and an empty output stays empty.
        o = _torch.empty_in_layout(B, H, Nq, D, layout, q.dtype, q.device).zero_()
        return o, torch.full((B, H, Nq), float("-inf"), dtype=torch.float32, device=q.device)
    dev = mask.device if mask is not None else _torch.device_for(q, backend)
    qv, kv, vv = (_torch.view(t, layout, role, dev.backend) for t, role in ((q, "q"), (k, "k"), (v, "v")))
    o = _torch.empty_in_layout(B, H, Nq, D, layout, q.dtype, q.device)
    lse = torch.empty((B, H, Nq), dtype=torch.float32, device=q.device)
    ov = _torch.view(o, layout, "o", dev.backend)
    params = _attn_params(scale, False, causal and mask is None)
    with (mask.bound() if mask is not None else dev.bound()):
        _lib.call("sparge_attention_forward", dev.handle, ctypes.byref(qv), ctypes.byref(kv), ctypes.byref(vv),
                  mask.handle if mask is not None else None, ctypes.byref(params), ctypes.byref(ov),
                  ctypes.c_void_p(lse.data_ptr()))
    return o, lse


def _backward(grad_out, q, k, v, o, lse, mask, scale, layout, deterministic, backend, causal):
    B, H, Nq, D = _torch.bhnd_shape(q, layout)
    Nk = _torch.bhnd_shape(k, layout)[2]
    if _checks.is_empty(B, H, Nq, Nk, D):
        return tuple(_torch.empty_in_layout(*_torch.bhnd_shape(t, layout), layout, t.dtype, t.device).zero_()
                     for t in (q, k, v))
    dev = mask.device if mask is not None else _torch.device_for(q, backend)
    grad_out = _unit_stride_rows(grad_out)
    tensors = [("q", q), ("k", k), ("v", v), ("o", o), ("grad_out", grad_out)]
    views = [_torch.view(t, layout, role, dev.backend) for role, t in tensors]
    Hkv = _torch.bhnd_shape(k, layout)[1]
    dq = _torch.empty_in_layout(B, H, Nq, D, layout, q.dtype, q.device)
    dk = _torch.empty_in_layout(B, Hkv, Nk, D, layout, k.dtype, k.device)
    dv = _torch.empty_in_layout(B, Hkv, Nk, D, layout, v.dtype, v.device)
    grads = [_torch.view(t, layout, role, dev.backend) for t, role in ((dq, "dq"), (dk, "dk"), (dv, "dv"))]
    params = _attn_params(scale, deterministic, causal and mask is None)
    with (mask.bound() if mask is not None else dev.bound()):
        _lib.call("sparge_attention_backward", dev.handle, *[ctypes.byref(x) for x in views],
                  ctypes.c_void_p(lse.data_ptr()), mask.handle if mask is not None else None, ctypes.byref(params),
                  *[ctypes.byref(x) for x in grads])
    return dq, dk, dv


def forward_impl(q, k, v, topk, topp, block_q, block_k, scale, layout, backend, causal):
    """(O, LSE) with the mask predicted from q and k: the body of the custom op sparge::attention."""
    B, H, Nq, D = _torch.bhnd_shape(q, layout)
    Nk = _torch.bhnd_shape(k, layout)[2]
    mask = None
    if not _checks.is_empty(B, H, Nq, Nk, D):
        mask = _predict(q, k, topk, topp, block_q, block_k, scale, layout, backend, causal)
    return _forward(q, k, v, mask, scale, layout, backend, causal)


def backward_impl(grad_out, q, k, v, o, lse, topk, topp, block_q, block_k, scale, layout, backend, deterministic,
                  causal):
    """(dQ, dK, dV) of forward_impl: the mask is predicted again from the same q and k with the same parameters,
    which gives the forward's selection (prediction is deterministic), and costs a fraction of the backward."""
    B, H, Nq, D = _torch.bhnd_shape(q, layout)
    Nk = _torch.bhnd_shape(k, layout)[2]
    mask = None
    if not _checks.is_empty(B, H, Nq, Nk, D):
        mask = _predict(q, k, topk, topp, block_q, block_k, scale, layout, backend, causal)
    return _backward(grad_out, q, k, v, o, lse, mask, scale, layout, deterministic, backend, causal)


# ---------------------------------------------------------------- public functions
def _check_given_mask(mask, q, B, H, Nq, Nk, backend):
    """A mask given to attention_forward / attention_backward: fixed-length for 4-D tensors, or variable-length
    for packed ones."""
    if mask is not None:
        _check_mask(mask, q, B, H, Nq, Nk, backend, getattr(mask, "varlen", False))


def attention_forward(q, k, v, mask=None, *, scale=None, layout="bhnd", backend=None, causal=None):
    """O and LSE of block-sparse attention (dense attention when mask is None).

    q [B,H,Nq,D], k and v [B,Hkv,Nk,D] with Hkv dividing H (or [B,N,H,D] each with layout="bnhd"),
    float32/float16/bfloat16 (float64 on backend="cpu-ref" where the library has it), any strides. causal: the
    mask's when a mask is given (a value given must agree with it); for dense attention False, or True for the
    bottom-right causal rule (Nq <= Nk). A variable-length mask takes packed tensors of batch 1 (its LSE is
    [1,H,T]). Returns O in q's layout (contiguous) and LSE float32 [B,H,Nq] (natural log). Empty tensors give an
    empty O (zeros when only Nk is 0) and LSE -inf."""
    B, H, Nq, Nk, _ = _checks.qkv(q, k, v, layout)
    scale, backend = _checks.scale(scale), _checks.backend(backend)
    _check_given_mask(mask, q, B, H, Nq, Nk, backend)
    causal = _causal_arg(causal, mask, Nq, Nk)
    return _forward(q, k, v, mask, scale, layout, backend, causal)


def attention_backward(grad_out, q, k, v, o, lse, mask=None, *, scale=None, layout="bhnd", deterministic=False,
                       backend=None, causal=None):
    """dQ, dK, dV of attention_forward with the mask held fixed (dK, dV with K's heads, each the sum over its
    query heads). o and lse must come from that forward, with the same causal. deterministic=True asks for
    bitwise reproducible gradients (no atomics)."""
    B, H, Nq, Nk, _ = _checks.qkv(q, k, v, layout)
    _checks.like(o, "o", q, "q")
    _checks.like(grad_out, "grad_out", q, "q")
    scale, backend = _checks.scale(scale), _checks.backend(backend)
    _checks.flag(deterministic, "deterministic")
    # sparge sees lse as a bare pointer: its shape is checked here.
    if (not isinstance(lse, torch.Tensor) or lse.dtype != torch.float32 or not lse.is_contiguous()
            or lse.numel() != B * H * Nq or lse.device != q.device):
        raise ValueError(f"sparge: lse must be a contiguous float32 tensor of B*H*Nq = {B * H * Nq} elements on "
                         f"{q.device} (the forward's), got {getattr(lse, 'dtype', type(lse).__name__)} "
                         f"{list(getattr(lse, 'shape', []))}")
    _check_given_mask(mask, q, B, H, Nq, Nk, backend)
    causal = _causal_arg(causal, mask, Nq, Nk)
    return _backward(grad_out, q, k, v, o, lse, mask, scale, layout, deterministic, backend, causal)


class SpargeAttentionFunction(torch.autograd.Function):
    """O = block-sparse attention of q, k, v with gradients for q, k and v.

    apply(q, k, v, mask, topk, topp, block_q, block_k, scale, layout, backend, deterministic, causal): when mask
    is None it is predicted from q and k in the forward. The mask is held fixed: no gradient flows through it.
    q, k, v, O, LSE and the mask are kept for the backward. Arguments are those sparge_attention checked."""

    @staticmethod
    def forward(ctx, q, k, v, mask, topk, topp, block_q, block_k, scale, layout, backend, deterministic, causal):
        B, H, Nq, D = _torch.bhnd_shape(q, layout)
        if mask is None and not _checks.is_empty(B, H, Nq, _torch.bhnd_shape(k, layout)[2], D):
            mask = _predict(q, k, topk, topp, block_q, block_k, scale, layout, backend, causal)
        o, lse = _forward(q, k, v, mask, scale, layout, backend, causal)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.mask, ctx.held = mask, mask._held() if mask is not None else None
        ctx.options = dict(scale=scale, layout=layout, backend=backend, deterministic=deterministic, causal=causal)
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, o, lse = ctx.saved_tensors
        if ctx.mask is not None:
            ctx.mask._check_held(ctx.held)
        o_ = ctx.options
        dq, dk, dv = _backward(grad_out, q, k, v, o, lse, ctx.mask, o_["scale"], o_["layout"], o_["deterministic"],
                               o_["backend"], o_["causal"])
        return (dq, dk, dv) + (None,) * 10


def _unsupported(attn_mask, dropout_p):
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"sparge: dropout_p must be a float, got {type(dropout_p).__name__}")
    bad = [name for name, on in (("attn_mask", attn_mask is not None), ("dropout_p", dropout_p != 0.0)) if on]
    if bad:
        raise NotImplementedError(f"sparge_attention: {', '.join(bad)} not supported (block-sparse attention "
                                  "without extra masks or dropout)")


def sparge_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                     enable_gqa=False, topk=None, topp=None, block_q=None, block_k=None, layout="bhnd", mask=None,
                     return_mask=False, backend=None, deterministic=False):
    """Drop-in for torch.nn.functional.scaled_dot_product_attention with SpargeAttention2's block-sparse mask.

    Same conventions as SDPA: query [B,H,Nq,D], key/value [B,Hkv,Nk,D] (or [B,N,H,D] with layout="bnhd",
    the layout of diffusion models and FlashAttention, without a copy), scale defaults to 1/sqrt(D), the
    result has query's shape. Per call the hybrid Top-k (topk, default 0.03) ∪ Top-p (topp, default 0.2) mask
    over blocks of block_q (128) queries × block_k (64) keys is predicted from query and key, unless mask (a
    sparge.Mask) is given: then topk and topp must be left unset, and block_q / block_k, if given, must be the
    mask's.

    is_causal=True makes the mask block-causal and masks the tokens above the diagonal inside its diagonal
    blocks. The diagonal is aligned bottom-right (query t attends keys u <= t + Nk − Nq; Nq <= Nk), as in
    flash-attn: for Nq = Nk this is SDPA's causal attention, for Nq < Nk SDPA aligns top-left instead. A given
    mask must be causal exactly when is_causal is. enable_gqa=True lets key and value have Hkv heads dividing H
    (query head h reads K/V head h / (H/Hkv)), as SDPA's enable_gqa; without it unequal head counts are an error.
    attn_mask and dropout are not supported.

    return_mask=True returns (out, mask); the mask is None for empty inputs, which give an empty result like
    SDPA's. backend overrides the sparge backend ("cpu-ref", "cuda-generic"); the device comes from the tensors. A
    given or returned Mask runs eagerly (an autograd.Function holding it); without one, torch >= 2.4 runs the
    custom op, which torch.compile traces."""
    _unsupported(attn_mask, dropout_p)
    causal = _checks.flag(is_causal, "is_causal")
    grouped = _checks.flag(enable_gqa, "enable_gqa")
    B, H, Nq, Nk, D = _checks.qkv(query, key, value, layout, grouped)
    if causal:
        _checks.causal_lengths(Nq, Nk)
    scale, backend = _checks.scale(scale), _checks.backend(backend)
    _checks.flag(return_mask, "return_mask")
    _checks.flag(deterministic, "deterministic")
    if mask is not None:
        no_prediction_params("sparge_attention", topk, topp)
        _check_mask(mask, query, B, H, Nq, Nk, backend)
        given_mask_matches("sparge_attention", mask, causal, "is_causal", block_q, block_k)
    else:
        topk, topp, block_q, block_k, scale = defaulted_mask_params(topk, topp, block_q, block_k, scale)
        if not return_mask and _OPS_REGISTERED:
            return torch.ops.sparge.attention(query, key, value, topk, topp, block_q, block_k, scale, layout,
                                              backend, deterministic, causal)[0]
        if return_mask and not _checks.is_empty(B, H, Nq, Nk, D):
            with torch.no_grad():
                mask = _predict(query, key, topk, topp, block_q, block_k, scale, layout, backend, causal)
    out = SpargeAttentionFunction.apply(query, key, value, mask, topk, topp, block_q, block_k, scale, layout,
                                        backend, deterministic, causal)
    return (out, mask) if return_mask else out


def custom_ops_available():
    """Whether sparge's torch.library custom ops are registered (torch >= 2.4); see custom_ops_reason()."""
    return _OPS_REGISTERED


def custom_ops_reason():
    """Why the custom ops are not registered (None when they are)."""
    return _ops.UNAVAILABLE_REASON


from . import _ops  # noqa: E402  (registration needs the functions above)

_OPS_REGISTERED = _ops.register(forward_impl, backward_impl, predict_csr_impl)
