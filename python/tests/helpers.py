"""Shared set-up of the python tests: torch or a clean skip, the package path, dense references."""
import os
import sys
import unittest

try:
    import torch
except ImportError:
    raise unittest.SkipTest("skipped: no torch (install python3-torch or pip install torch)")

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import sparge  # noqa: E402  (after the path set-up; a missing libsparge is an error, not a skip)

__all__ = ["sparge", "torch", "randn", "to_bhnd", "dense_masked_attention", "rel_l2"]


def randn(*shape, dtype=torch.float32, device="cpu", seed=None):
    g = torch.Generator(device="cpu")
    g.manual_seed(seed if seed is not None else 1234)
    return torch.randn(*shape, generator=g, dtype=torch.float32).to(device=device, dtype=dtype)


def to_bhnd(t, layout):
    return t if layout == "bhnd" else t.transpose(1, 2)


def dense_masked_attention(q, k, v, token_mask=None, scale=None, layout="bhnd"):
    """Reference O and LSE in the dtype of q (use float64 inputs for an oracle): plain softmax attention
    with the keys outside token_mask [B,H,Nq,Nk] removed. Differentiable with torch autograd."""
    q, k, v = to_bhnd(q, layout), to_bhnd(k, layout), to_bhnd(v, layout)
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    s = (q @ k.transpose(-1, -2)) * scale
    if token_mask is not None:
        s = s.masked_fill(~token_mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    o = torch.softmax(s, dim=-1) @ v
    return to_bhnd(o, layout), lse


def rel_l2(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if not torch.isfinite(a).all():
        return float("inf")
    return float((a - b).norm() / b.norm())
