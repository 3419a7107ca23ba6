"""Packed variable-length batches with flash-attn's varlen convention: sparge_attention_varlen.

q [Tq, H, D], k and v [Tk, Hkv, D] hold the batch's sequences one after another (total tokens first, as
flash_attn_varlen_func takes them); cu_seqlens_q / cu_seqlens_k (int32, B+1 offsets) say where each sequence
starts. sparge sees the packed tensors as [1, H, T, D] views (no copy) and a mask whose layout carries the
offsets, so every sequence predicts, attends and is differentiated on its own, in one call.
"""
import numbers

import torch
from torch.autograd.function import once_differentiable

from . import _checks
from .attention import _backward, _forward
from .mask import Mask, defaulted_mask_params, given_mask_matches, no_prediction_params


def _packed(t, name):
    """(T, H, D) of a packed [T, H, D] tensor."""
    _checks.strided(t, name)
    if t.dim() != 3:
        raise ValueError(f"sparge: {name} must be 3-D [total_tokens, heads, head_dim] (flash-attn's varlen "
                         f"layout), got shape {list(t.shape)}")
    return tuple(t.shape)


class _VarlenFunction(torch.autograd.Function):
    """O of packed q, k, v under a variable-length mask, held fixed (None for empty tensors, whose O is zeros);
    gradients through sparge's backward."""

    @staticmethod
    def forward(ctx, q, k, v, mask, scale, deterministic, causal):
        o, lse = _forward(q[None], k[None], v[None], mask, scale, "bnhd", None, causal)
        o = o[0]
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.mask, ctx.scale, ctx.deterministic, ctx.causal = mask, scale, deterministic, causal
        ctx.held = mask._held() if mask is not None else None
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q, k, v, o, lse = ctx.saved_tensors
        if ctx.mask is not None:
            ctx.mask._check_held(ctx.held)
        grads = _backward(grad_out[None], q[None], k[None], v[None], o[None], lse, ctx.mask, ctx.scale, "bnhd",
                          ctx.deterministic, None, ctx.causal)
        return grads[0][0], grads[1][0], grads[2][0], None, None, None, None


def sparge_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, *,
                            softmax_scale=None, causal=False, topk=None, topp=None, block_q=None, block_k=None,
                            mask=None, return_mask=False, backend=None, deterministic=False):
    """Block-sparse attention over a packed batch of variable-length sequences, with flash_attn_varlen_func's
    arguments: q [Tq, H, D], k and v [Tk, Hkv, D] (Hkv dividing H: grouped K/V heads, query head h reading K/V
    head h / (H/Hkv)), any strides; cu_seqlens_q / cu_seqlens_k int32 tensors (any device; copied to the host once)
    of B+1 offsets from 0, non-decreasing, ending at Tq / Tk; max_seqlen_q / max_seqlen_k at least the longest
    sequence (flash-attn's bound; checked, not otherwise used). Sequence b's queries attend its keys only. A
    sequence may be empty, as in flash-attn (its keys, if any, get zero gradients), but one with queries needs
    keys.

    causal=True: causal per sequence, aligned bottom-right as flash-attn aligns it (query t of a sequence attends
    its keys u <= t + nk − nq; nq <= nk in every sequence). softmax_scale defaults to 1/sqrt(D). The hybrid mask
    (topk, topp, block_q × block_k as in sparge_attention) is predicted per sequence unless mask (a Mask made with
    the same cu_seqlens and causal) is given. dropout_p must be 0. Returns O [Tq, H, D] in q's dtype, and with
    return_mask=True (O, mask): the mask's views are [B, H, Nqb, Nkb] over the longest sequence's blocks, and
    mask.stats() gives head_sparsity [B, H] and sequence_sparsity [B] per sequence. Gradients flow to q, k and v
    through sparge's backward (dk, dv summed over each K/V head's query heads); the call runs eagerly. Tensors
    without heads, queries or head dim give zeros and zero gradients (and no mask)."""
    Tq, H, D = _packed(q, "q")
    Tk, Hkv, Dk = _packed(k, "k")
    if _packed(v, "v") != (Tk, Hkv, Dk):
        raise ValueError(f"sparge: v is {list(v.shape)} but k is {list(k.shape)} (v must have k's shape)")
    # The [1, T, H, D] views as sparge_attention checks them (dtype, device, heads, head dim).
    _checks.qkv(q[None], k[None], v[None], "bnhd")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"sparge: dropout_p must be a float, got {type(dropout_p).__name__}")
    if dropout_p != 0.0:
        raise NotImplementedError(f"sparge_attention_varlen: dropout_p = {dropout_p!r} is not supported (0 only)")
    causal = _checks.flag(causal, "causal")
    scale, backend = _checks.scale(softmax_scale), _checks.backend(backend)
    _checks.flag(return_mask, "return_mask")
    _checks.flag(deterministic, "deterministic")
    cu_q = _checks.cu_seqlens(cu_seqlens_q, "cu_seqlens_q", Tq, "q")
    cu_k = _checks.cu_seqlens(cu_seqlens_k, "cu_seqlens_k", Tk, "k")
    if cu_q.numel() != cu_k.numel():
        raise ValueError(f"sparge: cu_seqlens_q has {cu_q.numel()} entries and cu_seqlens_k {cu_k.numel()} (B+1 "
                         "each, one sequence of queries per sequence of keys)")
    lengths = _checks.sequence_lengths(cu_q, cu_k, causal)
    for name, given, longest in (("max_seqlen_q", max_seqlen_q, max(nq for nq, _ in lengths)),
                                 ("max_seqlen_k", max_seqlen_k, max(nk for _, nk in lengths))):
        if _checks.integer(given, name, 0, _checks.INT32_MAX) < longest:
            raise ValueError(f"sparge: {name} = {given} but a sequence holds {longest} tokens")
    B = cu_q.numel() - 1
    if mask is not None:
        no_prediction_params("sparge_attention_varlen", topk, topp)
        if not isinstance(mask, Mask):
            raise TypeError(f"sparge: mask must be a sparge.Mask, got {type(mask).__name__}")
        if not mask.varlen or not (torch.equal(mask.cu_seqlens_q, cu_q) and torch.equal(mask.cu_seqlens_k, cu_k)):
            raise ValueError("sparge_attention_varlen: the given mask was not made for these cu_seqlens_q / "
                             "cu_seqlens_k")
        if mask.torch_device != q.device:
            raise ValueError(f"sparge: the mask is on {mask.torch_device} but q is on {q.device}")
        if backend is not None and backend != mask.device.backend:
            raise ValueError(f"sparge: the mask lives on backend '{mask.device.backend}', not '{backend}'")
        mask.check_attention_shapes(1, H, Tq, Tk)
        given_mask_matches("sparge_attention_varlen", mask, causal, "causal", block_q, block_k)
    else:
        topk, topp, block_q, block_k, scale = defaulted_mask_params(topk, topp, block_q, block_k, scale)
        if H and D and Tq:  # no mask for empty tensors: their O is zeros, their gradients too
            mask = Mask._recycled(B, H, Tq, Tk, block_q, block_k, q.device, backend, causal, cu_q, cu_k)
            with torch.no_grad():
                mask.predict(q[None], k[None], topk=topk, topp=topp, scale=scale, layout="bnhd")
    out = _VarlenFunction.apply(q, k, v, mask, scale, deterministic, causal)
    return (out, mask) if return_mask else out
