#!/usr/bin/env python3
"""Dump the Q, K, V that attention layers of a PyTorch model see, as safetensors
files the experiment drivers read (`--input FILE`, tensors "q", "k", "v",
[B, H, N, D] = layout BHND).

How: forward pre-/post-hooks on the chosen modules mark "inside this layer";
while inside, torch.nn.functional.scaled_dot_product_attention is wrapped and
records its (query, key, value) arguments — i.e. Q and K after any RoPE and
QK-norm, exactly what the attention kernel gets. Models that bind SDPA under
another name at import time need that name patched instead (--sdpa-attr).

Recipe for Wan2.1-T2V-1.3B with diffusers (self-attention is `blocks.<i>.attn1`):

    import torch
    from diffusers import WanPipeline
    from dump_qkv import QKVDumper
    pipe = WanPipeline.from_pretrained("Wan-AI/Wan2.1-T2V-1.3B-Diffusers",
                                       torch_dtype=torch.bfloat16).to("cuda")
    with QKVDumper(pipe.transformer, r"blocks\\.(0|15|29)\\.attn1$", "dumps", max_calls=2):
        pipe(prompt="a red panda climbing a tree", height=480, width=832,
             num_frames=81, num_inference_steps=50)
    # then: experiments/exp_table1 --input dumps/blocks.15.attn1-call0.safetensors

At 480p the self-attention sees N = 21*30*52 = 32760 tokens, 12 heads of D = 128.
Self-test without any model download: `python3 dump_qkv.py --demo OUT_DIR`
(run with Debian's python3-torch 1.13 on the CPU: it writes two files that
`exp_gen --input` and `exp_table1 --input` read; paper-repro/README.md).

Where it runs: on a machine with the model's weights and PyTorch. The lent GPU
machine has no network (no model download) and a call carries at most 64 MiB
(Wan2.1-1.3B's weights alone are ~2.6 GiB in bf16), so it cannot run there.
"""
import argparse
import contextlib
import importlib
import json
import os
import re
import struct

try:  # --help works without torch; the dumper runs inside a model's process, which has it
    import torch
    import torch.nn.functional as F
except ImportError:
    torch = F = None

_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"} if torch else {}


def save_safetensors(path, tensors, metadata=None):
    """Minimal safetensors writer (the `safetensors` package does the same)."""
    header, blobs, offset = {}, [], 0
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    for name, t in tensors.items():
        if t.dtype not in _DTYPES:
            t = t.float()
        t = t.detach().contiguous().cpu()
        raw = t.view(torch.uint8).numpy().tobytes() if t.dtype != torch.float32 else t.numpy().tobytes()
        header[name] = {"dtype": _DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in blobs:
            f.write(raw)


class QKVDumper(contextlib.AbstractContextManager):
    """Record SDPA inputs inside modules whose qualified name matches `pattern`."""

    def __init__(self, model, pattern, out_dir, max_calls=1, dtype=None,
                 sdpa_attr="torch.nn.functional.scaled_dot_product_attention"):
        self.model, self.regex, self.out_dir = model, re.compile(pattern), out_dir
        self.max_calls, self.dtype, self.sdpa_attr = max_calls, dtype, sdpa_attr
        self.current, self.calls, self.handles, self.written = None, {}, [], []

    def _pre(self, name):
        def hook(module, args):
            self.current = name
        return hook

    def _post(self, module, args, output):
        self.current = None

    def _wrap(self, sdpa):
        def wrapped(query, key, value, *args, **kwargs):
            name = self.current
            if name is not None and self.calls.get(name, 0) < self.max_calls:
                call = self.calls.get(name, 0)
                self.calls[name] = call + 1
                q, k, v = (t if self.dtype is None else t.to(self.dtype) for t in (query, key, value))
                path = os.path.join(self.out_dir, f"{name}-call{call}.safetensors")
                save_safetensors(path, {"q": q, "k": k, "v": v},
                                 {"layout": "BHND", "module": name, "call": call,
                                  "scale": kwargs.get("scale"), "is_causal": kwargs.get("is_causal", False)})
                self.written.append(path)
            return sdpa(query, key, value, *args, **kwargs)
        return wrapped

    def __enter__(self):
        os.makedirs(self.out_dir, exist_ok=True)
        for name, module in self.model.named_modules():
            if self.regex.search(name):
                self.handles.append(module.register_forward_pre_hook(self._pre(name)))
                self.handles.append(module.register_forward_hook(self._post))
        if not self.handles:
            raise ValueError(f"no module name matches {self.regex.pattern!r}")
        mod_name, attr = self.sdpa_attr.rsplit(".", 1)
        self._owner = importlib.import_module(mod_name)
        self._original = getattr(self._owner, attr)
        setattr(self._owner, attr, self._wrap(self._original))
        self._attr = attr
        return self

    def __exit__(self, *exc):
        setattr(self._owner, self._attr, self._original)
        for h in self.handles:
            h.remove()
        return False


def _reference_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
    """softmax(Q Kᵀ · scale) V, what torch >= 2.0 provides as F.scaled_dot_product_attention (no mask, no dropout)."""
    if attn_mask is not None or dropout_p or is_causal:
        raise NotImplementedError("the demo's stand-in attention takes no mask, dropout or causal flag")
    s = query.shape[-1] ** -0.5 if scale is None else scale
    return torch.softmax(query @ key.transpose(-2, -1) * s, dim=-1) @ value


def _demo(out_dir):
    if not hasattr(F, "scaled_dot_product_attention"):  # torch < 2.0: the demo brings the function the hooks wrap
        F.scaled_dot_product_attention = _reference_sdpa

    class _DemoAttention(torch.nn.Module):
        def __init__(self, dim=128, heads=2):
            super().__init__()
            self.heads, self.qkv, self.out = heads, torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)

        def forward(self, x):
            b, n, c = x.shape
            q, k, v = self.qkv(x).view(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
            o = F.scaled_dot_product_attention(q, k, v)
            return self.out(o.transpose(1, 2).reshape(b, n, c))

    torch.manual_seed(0)
    model = torch.nn.Sequential(_DemoAttention(), torch.nn.GELU(), _DemoAttention())
    x = torch.randn(1, 300, 128)
    with QKVDumper(model, r"^[02]$", out_dir) as d:
        model(x)
    for path in d.written:
        print("wrote", path)
    print(f"check with: experiments/exp_gen --input {d.written[0]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--demo", metavar="OUT_DIR", help="dump a tiny random model's two attention layers")
    args = ap.parse_args()
    if args.demo and torch is None:
        ap.error("--demo needs PyTorch (Debian: apt-get install python3-torch)")
    if args.demo:
        _demo(args.demo)
    else:
        ap.print_help()


if __name__ == "__main__":
    main()
