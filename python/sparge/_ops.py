"""sparge's torch.library custom ops (torch >= 2.4): sparge::attention, sparge::attention_backward and
sparge::predict_mask, with fake implementations (shapes for torch.compile and torch.export) and autograd.

Their arguments are tensors and scalars only: the forward predicts its mask and the backward predicts it again
from the saved q and k, so nothing but tensors crosses a compiled graph, and a CUDA graph replays the whole
sequence of kernels. Arguments reach these ops checked by the public functions.

Grouped K/V heads need no argument: k and v carry their head count (the fakes give dk, dv k's and v's shapes), and
enable_gqa is checked before the op. `causal` is the last argument of each op and has no default: the schema
inference of some torch versions takes none, and every caller passes it.
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

MIN_TORCH = (2, 4)


def _unavailable_reason():
    missing = [name for name in ("custom_op", "register_fake", "register_autograd")
               if not hasattr(torch.library, name)]
    if missing:
        return (f"torch {torch.__version__} has no torch.library.{', '.join(missing)} (sparge registers custom "
                f"ops on torch >= {MIN_TORCH[0]}.{MIN_TORCH[1]}); sparge_attention runs as an autograd.Function")
    return None


UNAVAILABLE_REASON = _unavailable_reason()


def _blocks(n, block):
    return (n + block - 1) // block


def register(forward_impl, backward_impl, predict_impl):
    """Register the ops once per process; returns whether they are registered."""
    if UNAVAILABLE_REASON is not None:
        return False
    if hasattr(torch.ops, "sparge") and hasattr(torch.ops.sparge, "attention"):
        return True  # a second copy of the package in this process: the first one's ops serve both

    @torch.library.custom_op("sparge::attention", mutates_args=())
    def attention(q: Tensor, k: Tensor, v: Tensor, topk: float, topp: float, block_q: int, block_k: int,
                  scale: Optional[float], layout: str, backend: Optional[str], deterministic: bool,
                  causal: bool) -> Tuple[Tensor, Tensor]:
        return forward_impl(q, k, v, topk, topp, block_q, block_k, scale, layout, backend, causal)

    @torch.library.register_fake("sparge::attention")
    def _(q, k, v, topk, topp, block_q, block_k, scale, layout, backend, deterministic, causal):
        B, Nq, H = (q.shape[0], q.shape[2], q.shape[1]) if layout == "bhnd" else q.shape[:3]
        return q.new_empty(q.shape), q.new_empty((B, H, Nq), dtype=torch.float32)

    @torch.library.custom_op("sparge::attention_backward", mutates_args=())
    def attention_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                           topk: float, topp: float, block_q: int, block_k: int, scale: Optional[float],
                           layout: str, backend: Optional[str], deterministic: bool,
                           causal: bool) -> Tuple[Tensor, Tensor, Tensor]:
        return backward_impl(grad_out, q, k, v, out, lse, topk, topp, block_q, block_k, scale, layout, backend,
                             deterministic, causal)

    @torch.library.register_fake("sparge::attention_backward")
    def _(grad_out, q, k, v, out, lse, topk, topp, block_q, block_k, scale, layout, backend, deterministic, causal):
        return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)

    def setup_context(ctx, inputs, output):
        q, k, v, topk, topp, block_q, block_k, scale, layout, backend, deterministic, causal = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.params = (topk, topp, block_q, block_k, scale, layout, backend, deterministic, causal)
        ctx.mark_non_differentiable(lse)

    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.ops.sparge.attention_backward(grad_out, q, k, v, out, lse, *ctx.params)
        return (dq, dk, dv) + (None,) * 9

    torch.library.register_autograd("sparge::attention", backward, setup_context=setup_context)

    @torch.library.custom_op("sparge::predict_mask", mutates_args=())
    def predict_mask(q: Tensor, k: Tensor, topk: float, topp: float, block_q: int, block_k: int,
                     scale: Optional[float], layout: str, backend: Optional[str],
                     causal: bool) -> Tuple[Tensor, Tensor]:
        return predict_impl(q, k, topk, topp, block_q, block_k, scale, layout, backend, causal)

    @torch.library.register_fake("sparge::predict_mask")
    def _(q, k, topk, topp, block_q, block_k, scale, layout, backend, causal):
        B, H, Nq = (q.shape[0], q.shape[1], q.shape[2]) if layout == "bhnd" else (q.shape[0], q.shape[2], q.shape[1])
        Nk = k.shape[2] if layout == "bhnd" else k.shape[1]
        Nqb, Nkb = _blocks(Nq, block_q), _blocks(Nk, block_k)
        return q.new_empty((B, H, Nqb), dtype=torch.int32), q.new_empty((B, H, Nqb, Nkb), dtype=torch.int32)

    return True
