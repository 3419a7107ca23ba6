"""Block-sparse attention on torch tensors: forward, backward, autograd, and the SDPA drop-in."""
import ctypes

import torch
from torch.autograd.function import once_differentiable

from . import _lib, _torch
from .mask import Mask, _scale_arg, predict_mask


def _bound(mask, dev):
    return mask.bound() if mask is not None else dev.bound()


def _device_of(q, mask, backend):
    if mask is None:
        return _torch.device_for(q, backend)
    if not isinstance(mask, Mask):
        raise TypeError(f"sparge: mask must be a sparge.Mask, got {type(mask).__name__}")
    if mask.torch_device != q.device:
        raise ValueError(f"sparge: the mask is on {mask.torch_device} but q is on {q.device}")
    if backend is not None and backend != mask.device.backend:
        raise ValueError(f"sparge: the mask lives on backend '{mask.device.backend}', not '{backend}'")
    return mask.device


def _attn_params(scale, deterministic):
    return _lib.sparge_attn_params(_scale_arg(scale), 1 if deterministic else 0)


def attention_forward(q, k, v, mask=None, *, scale=None, layout="bhnd", backend=None):
    """O and LSE of block-sparse attention (dense attention when mask is None).

    q [B,H,Nq,D], k and v [B,H,Nk,D] (or [B,N,H,D] each with layout="bnhd"), float32/float16/bfloat16,
    any strides. Returns O in q's layout (contiguous) and LSE float32 [B,H,Nq] (natural log)."""
    _torch.check_layout(layout)
    _torch.same_device([("q", q), ("k", k), ("v", v)])
    dev = _device_of(q, mask, backend)
    qv, kv, vv = _torch.view(q, layout, "q"), _torch.view(k, layout, "k"), _torch.view(v, layout, "v")
    B, H, Nq, D = _torch.bhnd_shape(q, layout)
    o = _torch.empty_in_layout(B, H, Nq, D, layout, q.dtype, q.device)
    lse = torch.empty((B, H, Nq), dtype=torch.float32, device=q.device)
    ov = _torch.view(o, layout, "o")
    params = _attn_params(scale, False)
    with _bound(mask, dev):
        _lib.call("sparge_attention_forward", dev.handle, ctypes.byref(qv), ctypes.byref(kv), ctypes.byref(vv),
                  mask.handle if mask is not None else None, ctypes.byref(params), ctypes.byref(ov),
                  ctypes.c_void_p(lse.data_ptr()))
    return o, lse


def _unit_stride_rows(t):
    """Incoming gradients may be expanded (stride 0) or strided along D; GPU kernels need unit-stride rows."""
    if t.stride(-1) != 1 or any(s == 0 and n > 1 for s, n in zip(t.stride(), t.shape)):
        return t.contiguous()
    return t


def attention_backward(grad_out, q, k, v, o, lse, mask=None, *, scale=None, layout="bhnd", deterministic=False,
                       backend=None):
    """dQ, dK, dV of attention_forward with the mask held fixed. o and lse must come from that forward.
    deterministic=True asks for bitwise reproducible gradients (no atomics)."""
    _torch.check_layout(layout)
    grad_out = _unit_stride_rows(grad_out)
    tensors = [("q", q), ("k", k), ("v", v), ("o", o), ("grad_out", grad_out), ("lse", lse)]
    _torch.same_device(tensors)
    dev = _device_of(q, mask, backend)
    views = [_torch.view(t, layout, role) for role, t in tensors[:5]]
    B, H, Nq, D = _torch.bhnd_shape(q, layout)
    # sparge sees lse as a bare pointer: its shape is checked here.
    if lse.dtype != torch.float32 or not lse.is_contiguous() or lse.numel() != B * H * Nq:
        raise ValueError(f"sparge: lse must be a contiguous float32 tensor of B*H*Nq = {B * H * Nq} elements "
                         f"(the forward's), got {lse.dtype} {list(lse.shape)}")
    Nk = _torch.bhnd_shape(k, layout)[2]
    dq = _torch.empty_in_layout(B, H, Nq, D, layout, q.dtype, q.device)
    dk = _torch.empty_in_layout(B, H, Nk, k.shape[-1], layout, k.dtype, k.device)
    dv = _torch.empty_in_layout(B, H, Nk, v.shape[-1], layout, v.dtype, v.device)
    grads = [_torch.view(dq, layout, "dq"), _torch.view(dk, layout, "dk"), _torch.view(dv, layout, "dv")]
    params = _attn_params(scale, deterministic)
    with _bound(mask, dev):
        _lib.call("sparge_attention_backward", dev.handle, *[ctypes.byref(x) for x in views],
                  ctypes.c_void_p(lse.data_ptr()), mask.handle if mask is not None else None, ctypes.byref(params),
                  *[ctypes.byref(x) for x in grads])
    return dq, dk, dv


class SpargeAttentionFunction(torch.autograd.Function):
    """O = block-sparse attention of q, k, v with gradients for q, k and v.

    apply(q, k, v, mask, topk, topp, block_q, block_k, scale, layout, backend, deterministic): when mask is
    None it is predicted from q and k in the forward. The mask is held fixed: no gradient flows through it.
    q, k, v, O, LSE and the mask are kept for the backward."""

    @staticmethod
    def forward(ctx, q, k, v, mask, topk, topp, block_q, block_k, scale, layout, backend, deterministic):
        if mask is None:
            mask = predict_mask(q, k, topk=topk, topp=topp, block_q=block_q, block_k=block_k, scale=scale,
                                layout=layout, backend=backend)
        o, lse = attention_forward(q, k, v, mask, scale=scale, layout=layout, backend=backend)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.mask = mask
        ctx.options = dict(scale=scale, layout=layout, backend=backend, deterministic=deterministic)
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = attention_backward(grad_out, q, k, v, o, lse, ctx.mask, **ctx.options)
        return dq, dk, dv, None, None, None, None, None, None, None, None, None


def sparge_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                     enable_gqa=False, topk=0.03, topp=0.2, block_q=128, block_k=64, layout="bhnd", mask=None,
                     return_mask=False, backend=None, deterministic=False):
    """Drop-in for torch.nn.functional.scaled_dot_product_attention with SpargeAttention2's block-sparse mask.

    Same conventions as SDPA: query [B,H,Nq,D], key/value [B,H,Nk,D] (or [B,N,H,D] with layout="bnhd",
    the layout of diffusion models and FlashAttention, without a copy), scale defaults to 1/sqrt(D), the
    result has query's shape. Per call the hybrid Top-k (topk) ∪ Top-p (topp) mask over blocks of
    block_q queries × block_k keys is predicted from query and key, unless mask (a sparge.Mask) is given.
    attn_mask, dropout and causal masking are not supported. return_mask=True returns (out, mask).
    backend overrides the sparge backend ("cpu-ref", "cuda-generic"); the device comes from the tensors."""
    unsupported = [name for name, bad in (("attn_mask", attn_mask is not None), ("dropout_p", dropout_p != 0.0),
                                          ("is_causal", bool(is_causal)), ("enable_gqa", bool(enable_gqa))) if bad]
    if unsupported:
        raise NotImplementedError(f"sparge_attention: {', '.join(unsupported)} not supported (block-sparse "
                                  "attention without extra masks, dropout, causality or grouped heads)")
    if return_mask and mask is None:
        with torch.no_grad():
            mask = predict_mask(query, key, topk=topk, topp=topp, block_q=block_q, block_k=block_k, scale=scale,
                                layout=layout, backend=backend)
    out = SpargeAttentionFunction.apply(query, key, value, mask, topk, topp, block_q, block_k, scale, layout,
                                        backend, deterministic)
    return (out, mask) if return_mask else out
