"""sparge from PyTorch: trainable block-sparse attention (SpargeAttention2) through libsparge, with ctypes.

    import sparge
    out = sparge.sparge_attention(q, k, v)                  # drop-in for F.scaled_dot_product_attention
    out, mask = sparge.sparge_attention(q, k, v, return_mask=True)
    mask.stats().sparsity, mask.dense, mask.counts, mask.indices

Tensors are used in place (data pointer, dtype, shape, element strides); CUDA work is queued on torch's
current stream. The library is found through SPARGE_LIBRARY (a path to libsparge.so), SPARGE_BUILD_DIR
(a build directory; the library is in its .libs/), then the system's library directories.
The torch-facing names are imported on first use, so `import sparge` works without torch.
"""
from ._lib import SpargeError, backend_device_count, backends, build_info, library_path

__version__ = "0.1.0"

_TORCH_NAMES = {
    "Mask": "mask",
    "MaskStats": "mask",
    "predict_mask": "mask",
    "free_cached_masks": "mask",
    "attention_forward": "attention",
    "attention_backward": "attention",
    "SpargeAttentionFunction": "attention",
    "sparge_attention": "attention",
    "open_device": "_torch",
}

__all__ = ["SpargeError", "backends", "backend_device_count", "build_info", "library_path", *_TORCH_NAMES]


def __getattr__(name):
    module = _TORCH_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'sparge' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
