"""Block masks: a Mask owns a sparge_mask on the device of the tensors it is used with."""
import contextlib
import ctypes
import dataclasses
import threading
import weakref

import torch

from . import _lib, _torch

# Masks dropped by Python are kept for reuse instead of destroyed: sparge allocates a mask's arrays
# with cudaMalloc and frees them with cudaFree, which synchronizes the whole device — once per
# attention call in a training loop otherwise. A kept mask is only handed out again on the one
# stream all its work was queued on, so stream order protects the work still reading it.
_POOL_PER_KEY = 4
_pool = {}
_pool_lock = threading.Lock()


def _current_stream(torch_device):
    return torch.cuda.current_stream(torch_device).cuda_stream if torch_device.type == "cuda" else None


def _destroy(device, handle):
    with device.guard():
        _lib.lib.sparge_mask_destroy(handle)


def _release(device, key, handle, streams):
    if len(streams) <= 1:
        pool_key = key + (next(iter(streams), None),)
        with _pool_lock:
            kept = _pool.setdefault(pool_key, [])
            if len(kept) < _POOL_PER_KEY:
                kept.append(handle)
                return
    _destroy(device, handle)


def free_cached_masks():
    """Destroy the masks kept for reuse (like torch.cuda.empty_cache for sparge's mask arrays)."""
    with _pool_lock:
        entries = list(_pool.items())
        _pool.clear()
    for (device, *_), handles in entries:
        for handle in handles:
            _destroy(device, handle)


@dataclasses.dataclass
class MaskStats:
    """sparge_mask_stats plus the per-head sparsity [B,H] (float64) and per-row kept pooled mass
    [B,H,Nqb] (float32, NaN for masks not predicted from Q and K)."""

    kept_blocks: int
    total_blocks: int
    sparsity: float
    token_density: float
    mean_row_mass: float
    min_row_blocks: int
    max_row_blocks: int
    head_sparsity: torch.Tensor
    row_mass: torch.Tensor


class Mask:
    """A block mask for (B, H, Nq, Nk) with blocks block_q × block_k, stored by sparge on `device`
    (a torch device: "cpu" or "cuda:N"). Fill it with predict() or set_dense(). The views (counts,
    indices, t_counts, t_indices, dense, pooled_map) are copies, returned as tensors on `device`."""

    def __init__(self, B, H, Nq, Nk, block_q=128, block_k=64, device="cpu", backend=None):
        self.torch_device = torch.device(device)
        if self.torch_device.type == "cuda" and self.torch_device.index is None:
            self.torch_device = torch.device("cuda", torch.cuda.current_device())
        self.device = _torch.open_device(_torch.sparge_device_name(self.torch_device, backend), self.torch_device)
        key = (self.device, int(B), int(H), int(Nq), int(Nk), int(block_q), int(block_k))
        stream = _current_stream(self.torch_device)
        with _pool_lock:
            kept = _pool.get(key + (stream,))
            handle = kept.pop() if kept else None
        if handle is None:
            handle = ctypes.c_void_p()
            with self.device.guard():
                _lib.call("sparge_mask_create", self.device.handle, *key[1:], ctypes.byref(handle))
        self.handle = handle
        self._streams = {stream}  # streams its work was queued on (see _release)
        self._finalizer = weakref.finalize(self, _release, self.device, key, handle, self._streams)
        self._finalizer.atexit = False  # the process is ending: leave the memory to the OS
        shape = _lib.sparge_mask_shape()
        _lib.call("sparge_mask_get_shape", handle, ctypes.byref(shape))
        self.B, self.H, self.Nq, self.Nk = shape.B, shape.H, shape.Nq, shape.Nk
        self.block_q, self.block_k, self.Nqb, self.Nkb = shape.block_q, shape.block_k, shape.Nqb, shape.Nkb
        self.predicted = False

    def __repr__(self):
        return (f"sparge.Mask(B={self.B}, H={self.H}, Nq={self.Nq}, Nk={self.Nk}, blocks {self.block_q}x"
                f"{self.block_k}, on {self.device.name})")

    @contextlib.contextmanager
    def bound(self):
        """Context for a sparge call that uses this mask on the current stream (recorded for reuse)."""
        with self.device.bound() as stream:
            self._streams.add(stream)
            yield

    def _check_tensor_device(self, role, t):
        if t.device != self.torch_device:
            raise ValueError(f"sparge: {role} is on {t.device} but the mask is on {self.torch_device}")

    # ------------------------------------------------------------ filling
    def predict(self, q, k, *, topk=0.03, topp=0.2, scale=None, layout="bhnd"):
        """Pool Q and K, build the pooled map, keep Top-k ∪ Top-p blocks per row (SpargeAttention2)."""
        _torch.check_layout(layout)
        self._check_tensor_device("q", q)
        self._check_tensor_device("k", k)
        qv, kv = _torch.view(q, layout, "q"), _torch.view(k, layout, "k")
        params = _lib.sparge_mask_params(self.block_q, self.block_k, float(topk), float(topp), _scale_arg(scale))
        with self.bound():
            _lib.call("sparge_mask_predict", self.device.handle, ctypes.byref(qv), ctypes.byref(kv),
                      ctypes.byref(params), self.handle)
        self.predicted = True
        return self

    def set_dense(self, dense):
        """Set the mask from a dense [B,H,Nqb,Nkb] tensor (nonzero = keep; every row keeps a block)."""
        want = (self.B, self.H, self.Nqb, self.Nkb)
        if tuple(dense.shape) != want:
            raise ValueError(f"sparge: dense mask has shape {list(dense.shape)}, the mask needs {list(want)}")
        host = (dense != 0).to(device="cpu", dtype=torch.uint8).contiguous()
        with self.bound():
            _lib.call("sparge_mask_set_dense", self.handle, ctypes.c_void_p(host.data_ptr()))
        self.predicted = False
        return self

    @classmethod
    def from_dense(cls, dense, Nq, Nk, block_q=128, block_k=64, device=None, backend=None):
        """A mask for [B,H,Nq,*] × [B,H,Nk,*] from a dense block mask [B,H,Nqb,Nkb]."""
        B, H = dense.shape[0], dense.shape[1]
        return cls(B, H, Nq, Nk, block_q, block_k, device if device is not None else dense.device,
                   backend).set_dense(dense)

    # ------------------------------------------------------------ views (copies)
    def _to_host(self, fn, shape, dtype, slot, nslots):
        out = torch.empty(shape, dtype=dtype)
        args = [None] * nslots
        args[slot] = ctypes.c_void_p(out.data_ptr())
        with self.bound():
            _lib.call(fn, self.handle, *args)
        return out.to(self.torch_device)

    @property
    def counts(self):
        """int32 [B,H,Nqb]: kept key blocks per query-block row."""
        return self._to_host("sparge_mask_get_csr", (self.B, self.H, self.Nqb), torch.int32, 0, 4)

    @property
    def indices(self):
        """int32 [B,H,Nqb,Nkb]: kept key blocks per row, ascending; -1 past the row's count."""
        return self._to_host("sparge_mask_get_csr", (self.B, self.H, self.Nqb, self.Nkb), torch.int32, 1, 4)

    @property
    def t_counts(self):
        """int32 [B,H,Nkb]: query blocks that keep each key block (the transpose, for the backward)."""
        return self._to_host("sparge_mask_get_csr", (self.B, self.H, self.Nkb), torch.int32, 2, 4)

    @property
    def t_indices(self):
        """int32 [B,H,Nkb,Nqb]: query blocks that keep each key block, ascending; -1 past the count."""
        return self._to_host("sparge_mask_get_csr", (self.B, self.H, self.Nkb, self.Nqb), torch.int32, 3, 4)

    @property
    def dense(self):
        """uint8 [B,H,Nqb,Nkb]: 1 where the block pair is kept."""
        return self._to_host("sparge_mask_get_dense", (self.B, self.H, self.Nqb, self.Nkb), torch.uint8, 0, 1)

    @property
    def pooled_map(self):
        """float32 [B,H,Nqb,Nkb]: the pooled map softmax(Q̄K̄ᵀ·s) of the last prediction."""
        return self._to_host("sparge_mask_get_pooled_map", (self.B, self.H, self.Nqb, self.Nkb), torch.float32, 0, 1)

    def token_mask(self):
        """bool [B,H,Nq,Nk]: the block mask expanded to token pairs (for dense masked references)."""
        dense = self.dense.bool()
        rows = dense.repeat_interleave(self.block_q, dim=2)[:, :, : self.Nq]
        return rows.repeat_interleave(self.block_k, dim=3)[:, :, :, : self.Nk]

    def stats(self):
        st = _lib.sparge_mask_stats()
        head = torch.empty((self.B, self.H), dtype=torch.float64)
        mass = torch.empty((self.B, self.H, self.Nqb), dtype=torch.float32)
        with self.bound():
            _lib.call("sparge_mask_get_stats", self.handle, ctypes.byref(st), ctypes.c_void_p(head.data_ptr()),
                      ctypes.c_void_p(mass.data_ptr()))
        return MaskStats(st.kept_blocks, st.total_blocks, st.sparsity, st.token_density, st.mean_row_mass,
                         st.min_row_blocks, st.max_row_blocks, head, mass)

    @property
    def sparsity(self):
        """1 − kept / all block pairs."""
        return self.stats().sparsity


def _scale_arg(scale):
    """sparge's scale argument: 0 means 1/sqrt(D), so an explicit 0 cannot be passed through."""
    if scale is None:
        return 0.0
    if scale == 0.0:
        raise ValueError("sparge: scale = 0 is not supported (None means 1/sqrt(D))")
    return float(scale)


def predict_mask(q, k, *, topk=0.03, topp=0.2, block_q=128, block_k=64, scale=None, layout="bhnd", backend=None):
    """Predict the SpargeAttention2 hybrid Top-k ∪ Top-p block mask of q [B,H,Nq,D] and k [B,H,Nk,D]
    (or [B,N,H,D] with layout="bnhd") on their device. Asynchronous on GPUs, on the current stream."""
    _torch.check_layout(layout)
    _torch.same_device([("q", q), ("k", k)])
    for role, t in (("q", q), ("k", k)):
        if t.dim() != 4:
            _torch.view(t, layout, role)  # raises the shape message
    B, H, Nq, _ = _torch.bhnd_shape(q, layout)
    Nk = _torch.bhnd_shape(k, layout)[2]
    mask = Mask(B, H, Nq, Nk, block_q, block_k, q.device, backend)
    return mask.predict(q, k, topk=topk, topp=topp, scale=scale, layout=layout)
