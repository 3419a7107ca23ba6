"""sparge from PyTorch: trainable block-sparse attention (SpargeAttention2) through libsparge, with ctypes.

    import sparge
    out = sparge.sparge_attention(q, k, v)                  # drop-in for F.scaled_dot_product_attention
    out, mask = sparge.sparge_attention(q, k, v, return_mask=True)
    out = sparge.sparge_attention(q, k, v, is_causal=True, enable_gqa=True)   # k, v with fewer heads
    out = sparge.sparge_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_q, max_k)  # flash-attn varlen
    mask.stats().sparsity, mask.dense, mask.counts, mask.indices
    with sparge.patch_sdpa(topk=0.03, topp=0.2):            # any model's SDPA self-attention through sparge
        model(x)

Tensors are used in place (data pointer, dtype, shape, element strides); CUDA work is queued on torch's
current stream. libsparge is loaded on first use, looked for in this order: SPARGE_LIBRARY (a path),
SPARGE_BUILD_DIR (a build directory), a copy bundled in the package (`make python-wheel`), the libdir recorded
by `make install-python`, an in-tree build of the source checkout, `pkg-config --variable=libdir sparge`,
ctypes.util.find_library, then /usr/local/lib and the other usual prefixes. On torch >= 2.4 the operations are
torch.library custom ops (sparge::attention, ...), so torch.compile(fullgraph=True) traces through them.
"""
import os as _os
import re as _re

from ._lib import LibraryNotFoundError, SpargeError, backend_device_count, backends, build_info, library_version


def _read_version():
    """The version from its one source: configure.ac's AC_INIT, copied into _config.py when the package is
    built (setup.py, make python-wheel, make install-python) and read from configure.ac in a source checkout."""
    try:
        from ._config import version

        return version
    except ImportError:
        pass
    here = _os.path.dirname(_os.path.abspath(__file__))
    try:
        with open(_os.path.join(here, _os.pardir, _os.pardir, "configure.ac")) as f:
            match = _re.search(r"AC_INIT\(\[sparge\],\s*\[([^\]]+)\]", f.read())
        return match.group(1) if match else "0+unknown"
    except OSError:
        return "0+unknown"


__version__ = _read_version()

_TORCH_NAMES = {
    "Mask": "mask",
    "MaskStats": "mask",
    "predict_mask": "mask",
    "predict_mask_csr": "mask",
    "free_cached_masks": "mask",
    "attention_forward": "attention",
    "attention_backward": "attention",
    "SpargeAttentionFunction": "attention",
    "sparge_attention": "attention",
    "sparge_attention_varlen": "varlen",
    "custom_ops_available": "attention",
    "custom_ops_reason": "attention",
    "patch_sdpa": "sdpa",
    "open_device": "_torch",
    "tolerance": "_torch",
}

__all__ = ["SpargeError", "LibraryNotFoundError", "backends", "backend_device_count", "build_info",
           "library_version", "library_path", "__version__", *_TORCH_NAMES]


def __getattr__(name):
    if name == "parallel":
        import importlib

        return importlib.import_module(".parallel", __name__)
    if name == "library_path":
        from . import _lib

        return _lib.library_path
    module = _TORCH_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'sparge' has no attribute {name!r}")
    import importlib

    try:
        value = getattr(importlib.import_module(f".{module}", __name__), name)
    except ImportError as e:
        if e.name == "torch":
            raise ImportError(f"sparge.{name} needs torch (pip install torch, or apt-get install python3-torch)",
                              name="torch") from e
        raise
    globals()[name] = value
    return value


try:  # with torch present, bind the torch-facing names now: torch.compile reads module globals
    import torch as _torch_probe  # noqa: F401
except ImportError:
    pass
else:
    del _torch_probe
    for _name in _TORCH_NAMES:
        __getattr__(_name)
    del _name
