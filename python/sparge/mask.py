"""Block masks: a Mask owns a sparge_mask on the device of the tensors it is used with."""
import contextlib
import ctypes
import dataclasses
import threading
import weakref

import torch

from . import _checks, _lib, _torch

# Masks dropped by Python are kept for reuse instead of destroyed: sparge allocates a mask's arrays
# with cudaMalloc and frees them with cudaFree, which synchronizes the whole device — once per
# attention call in a training loop otherwise. A kept mask is only handed out again on the one
# stream all its work was queued on, so stream order protects the work still reading it, and only
# to code that fills it before anyone can read it (Mask._recycled): a kept mask still holds the
# selection of its last owner.
#
# A mask used while a CUDA graph is being captured belongs to that graph from then on: every replay
# predicts into its arrays again. It is never freed and never handed to eager code, only to later
# captures on its stream (graphs replayed in stream order refill it before reading it, as eager calls do).
_POOL_PER_KEY = 4
_pool = {}
_captured = {}
_pool_lock = threading.Lock()


def _capturing(torch_device):
    return torch_device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _destroy(device, handle):
    with device.guard():
        _lib.lib.sparge_mask_destroy(handle)


def _release(device, key, handle, streams, state):
    if state["captured"]:
        with _pool_lock:
            _captured.setdefault(key + (next(iter(streams)),), []).append(handle)
        return
    if len(streams) <= 1:
        pool_key = key + (next(iter(streams), None),)
        with _pool_lock:
            kept = _pool.setdefault(pool_key, [])
            if len(kept) < _POOL_PER_KEY:
                kept.append(handle)
                return
    _destroy(device, handle)


def free_cached_masks():
    """Destroy the masks kept for reuse (like torch.cuda.empty_cache for sparge's mask arrays); masks that
    CUDA graphs captured stay."""
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


def _torch_device(device):
    if isinstance(device, str):
        device = torch.device(device)
    if not isinstance(device, torch.device):
        raise TypeError(f"sparge: device must be a torch.device or str, got {type(device).__name__}")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class Mask:
    """A block mask for (B, H, Nq, Nk) with blocks block_q × block_k, stored by sparge on `device`
    (a torch device: "cpu" or "cuda:N"). A new Mask holds no selection: fill it with predict(),
    set_dense() or set_csr(). The views (counts, indices, t_counts, t_indices, dense, pooled_map) are
    copies, returned as tensors on `device`."""

    def __init__(self, B, H, Nq, Nk, block_q=_checks.DEFAULT_BLOCK_Q, block_k=_checks.DEFAULT_BLOCK_K,
                 device="cpu", backend=None):
        self._open(B, H, Nq, Nk, block_q, block_k, device, backend, recycle=False)

    @classmethod
    def _recycled(cls, B, H, Nq, Nk, block_q, block_k, device, backend=None):
        """A Mask that may reuse a kept handle, which still holds an old selection: only for callers that
        fill it before returning it."""
        mask = cls.__new__(cls)
        mask._open(B, H, Nq, Nk, block_q, block_k, device, backend, recycle=True)
        return mask

    def _open(self, B, H, Nq, Nk, block_q, block_k, device, backend, recycle):
        B, H, Nq, Nk = _checks.mask_dims(B, H, Nq, Nk)
        block_q, block_k = _checks.block(block_q, "block_q"), _checks.block(block_k, "block_k")
        self.torch_device = _torch_device(device)
        self.device = _torch.open_device(_torch.sparge_device_name(self.torch_device, _checks.backend(backend)),
                                         self.torch_device)
        key = (self.device, B, H, Nq, Nk, block_q, block_k)
        stream = _torch.current_stream(self.torch_device)
        capturing = _capturing(self.torch_device)
        handle = None
        if recycle:
            with _pool_lock:
                for pool in (_captured, _pool) if capturing else (_pool,):
                    kept = pool.get(key + (stream,))
                    if kept:
                        handle = kept.pop()
                        break
        if handle is None:
            handle = ctypes.c_void_p()
            with self.device.guard():
                _lib.call("sparge_mask_create", self.device.handle, *key[1:], ctypes.byref(handle))
        self.handle = handle
        self._streams = {stream}  # streams its work was queued on (see _release)
        self._state = {"captured": capturing}
        self._finalizer = weakref.finalize(self, _release, self.device, key, handle, self._streams, self._state)
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
            if _capturing(self.torch_device):
                self._state["captured"] = True
            yield

    def check_attention_shapes(self, B, H, Nq, Nk):
        """Raise ValueError unless this mask was made for attention of these shapes."""
        if (B, H, Nq, Nk) != (self.B, self.H, self.Nq, self.Nk):
            raise ValueError(f"sparge: the mask was made for B={self.B} H={self.H} Nq={self.Nq} Nk={self.Nk}, "
                             f"the tensors have B={B} H={H} Nq={Nq} Nk={Nk}")

    def _check_tensor_device(self, role, t):
        if t.device != self.torch_device:
            raise ValueError(f"sparge: {role} is on {t.device} but the mask is on {self.torch_device}")

    # ------------------------------------------------------------ filling
    def predict(self, q, k, *, topk=_checks.DEFAULT_TOPK, topp=_checks.DEFAULT_TOPP, scale=None, layout="bhnd"):
        """Pool Q and K, build the pooled map, keep Top-k ∪ Top-p blocks per row (SpargeAttention2)."""
        B, H, Nq, Nk, _ = _checks.qk(q, k, layout)
        self._check_tensor_device("q", q)
        self.check_attention_shapes(B, H, Nq, Nk)
        topk, topp = _checks.fractions(topk, topp)
        scale = _checks.scale(scale)
        qv = _torch.view(q, layout, "q", self.device.backend)
        kv = _torch.view(k, layout, "k", self.device.backend)
        params = _lib.sparge_mask_params(self.block_q, self.block_k, topk, topp, _scale_arg(scale))
        with self.bound():
            _lib.call("sparge_mask_predict", self.device.handle, ctypes.byref(qv), ctypes.byref(kv),
                      ctypes.byref(params), self.handle)
        self.predicted = True
        return self

    def set_dense(self, dense):
        """Set the mask from a dense [B,H,Nqb,Nkb] tensor (nonzero = keep; every row keeps a block)."""
        if not isinstance(dense, torch.Tensor):
            raise TypeError(f"sparge: dense mask must be a torch.Tensor, got {type(dense).__name__}")
        want = (self.B, self.H, self.Nqb, self.Nkb)
        if tuple(dense.shape) != want:
            raise ValueError(f"sparge: dense mask has shape {list(dense.shape)}, the mask needs {list(want)}")
        if dense.is_complex() or dense.is_floating_point() and not torch.isfinite(dense).all():
            raise ValueError("sparge: dense mask must be real and finite (nonzero = keep)")
        host = (dense != 0).to(device="cpu", dtype=torch.uint8).contiguous()
        empty = (host.sum(-1) == 0).nonzero()
        if len(empty):
            b, h, i = (int(x) for x in empty[0])
            raise ValueError(f"sparge: dense mask row [b={b}, h={h}, i={i}] keeps no block ({len(empty)} such "
                             "rows); every query-block row needs one")
        with self.bound():
            _lib.call("sparge_mask_set_dense", self.handle, ctypes.c_void_p(host.data_ptr()))
        self.predicted = False
        return self

    def set_csr(self, counts, indices):
        """Set the mask from per-row counts [B,H,Nqb] and kept key-block indices [B,H,Nqb,Nkb'] (the first
        counts[b,h,i] entries of a row are read; Nkb' >= 1 may differ from Nkb)."""
        for name, t in (("counts", counts), ("indices", indices)):
            if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
                raise TypeError(f"sparge: {name} must be an integer torch.Tensor, got "
                                f"{getattr(t, 'dtype', type(t).__name__)}")
        if tuple(counts.shape) != (self.B, self.H, self.Nqb):
            raise ValueError(f"sparge: counts has shape {list(counts.shape)}, the mask needs "
                             f"{[self.B, self.H, self.Nqb]}")
        if indices.dim() != 4 or tuple(indices.shape[:3]) != (self.B, self.H, self.Nqb):
            raise ValueError(f"sparge: indices has shape {list(indices.shape)}, the mask needs "
                             f"[{self.B}, {self.H}, {self.Nqb}, n]")
        counts, indices = counts.to("cpu", torch.int64), indices.to("cpu", torch.int64)
        width = indices.shape[-1]
        if bool((counts < 0).any()) or bool((counts > width).any()):
            raise ValueError(f"sparge: counts must lie in [0, {width}] (the width of indices)")
        used = torch.arange(width) < counts[..., None]
        if bool(((indices < 0) | (indices >= self.Nkb))[used].any()):
            raise ValueError(f"sparge: a kept index lies outside [0, {self.Nkb}) (Nkb)")
        dense = torch.zeros((self.B, self.H, self.Nqb, self.Nkb + 1), dtype=torch.uint8)
        dense.scatter_(-1, torch.where(used, indices, torch.full_like(indices, self.Nkb)), 1)
        return self.set_dense(dense[..., : self.Nkb])

    @classmethod
    def from_dense(cls, dense, Nq, Nk, block_q=_checks.DEFAULT_BLOCK_Q, block_k=_checks.DEFAULT_BLOCK_K,
                   device=None, backend=None):
        """A mask for [B,H,Nq,*] × [B,H,Nk,*] from a dense block mask [B,H,Nqb,Nkb]."""
        if not isinstance(dense, torch.Tensor) or dense.dim() != 4:
            raise TypeError("sparge: dense must be a 4-D torch.Tensor [B,H,Nqb,Nkb]")
        B, H = dense.shape[0], dense.shape[1]
        return cls._recycled(B, H, Nq, Nk, block_q, block_k, device if device is not None else dense.device,
                             backend).set_dense(dense)

    @classmethod
    def from_csr(cls, counts, indices, Nq, Nk, block_q=_checks.DEFAULT_BLOCK_Q, block_k=_checks.DEFAULT_BLOCK_K,
                 device=None, backend=None):
        """A mask from per-row counts [B,H,Nqb] and indices [B,H,Nqb,*] (as `counts` and `indices` give them)."""
        if not isinstance(counts, torch.Tensor) or counts.dim() != 3:
            raise TypeError("sparge: counts must be a 3-D torch.Tensor [B,H,Nqb]")
        B, H = counts.shape[0], counts.shape[1]
        return cls._recycled(B, H, Nq, Nk, block_q, block_k, device if device is not None else counts.device,
                             backend).set_csr(counts, indices)

    # ------------------------------------------------------------ FlexAttention (torch >= 2.5)
    def to_flex_block_mask(self):
        """This mask as a FlexAttention BlockMask: counts → kv_num_blocks, kept blocks → kv_indices (row-
        ascending, the unkept blocks after them as FlexAttention orders them), BLOCK_SIZE = (block_q, block_k),
        seq_lengths = (Nq, Nk), no mask_mod. Kept blocks are whole: flex_attention with it computes what
        sparge computes."""
        try:
            from torch.nn.attention.flex_attention import BlockMask
        except ImportError as e:
            raise RuntimeError(f"sparge: FlexAttention needs torch >= 2.5 (this is {torch.__version__})") from e
        dense = self.dense.to(torch.int32)
        counts = dense.sum(-1, dtype=torch.int32)
        indices = torch.argsort(dense, dim=-1, descending=True, stable=True).to(torch.int32).contiguous()
        return BlockMask.from_kv_blocks(counts, indices, BLOCK_SIZE=(self.block_q, self.block_k),
                                        seq_lengths=(self.Nq, self.Nk))

    @classmethod
    def from_flex_block_mask(cls, block_mask, Nq, Nk, *, B=None, H=None, keep_partial=False, device=None,
                             backend=None):
        """A sparge Mask from a FlexAttention BlockMask: the union of its partial (kv_num_blocks/kv_indices)
        and full (full_kv_*) blocks over blocks of its BLOCK_SIZE. Batch or head dimensions of size 1 are
        broadcast to B or H when given. A BlockMask with a mask_mod masks tokens inside its partial blocks,
        which a block mask cannot: that is refused unless keep_partial=True keeps those blocks whole."""
        kv_num, kv_idx = block_mask.kv_num_blocks, block_mask.kv_indices
        full_num, full_idx = getattr(block_mask, "full_kv_num_blocks", None), getattr(block_mask,
                                                                                     "full_kv_indices", None)
        size = block_mask.BLOCK_SIZE
        block_q, block_k = (size, size) if isinstance(size, int) else (size[0], size[1])
        Nq, Nk = _checks.integer(Nq, "Nq", 1, _lib.INT32_MAX), _checks.integer(Nk, "Nk", 1, _lib.INT32_MAX)
        mask_mod = getattr(block_mask, "mask_mod", None)
        if (mask_mod is not None and getattr(mask_mod, "__name__", "") != "noop_mask" and not keep_partial
                and bool((kv_num > 0).any())):
            raise ValueError("sparge: this BlockMask has a mask_mod, which masks tokens inside its partial blocks; "
                             "a sparge mask keeps or drops whole blocks. keep_partial=True keeps them whole.")

        def dense_of(num, idx):
            while num.dim() < 3:
                num, idx = num.unsqueeze(0), idx.unsqueeze(0)
            num, idx = num.to("cpu", torch.int64), idx.to("cpu", torch.int64)
            width = idx.shape[-1]
            used = torch.arange(width) < num[..., None]
            Nkb = -(-Nk // block_k)
            if bool((idx[used] >= Nkb).any()) or bool((idx[used] < 0).any()):
                raise ValueError(f"sparge: the BlockMask keeps key blocks past Nk = {Nk} ({Nkb} blocks of "
                                 f"{block_k})")
            dense = torch.zeros(tuple(num.shape) + (Nkb + 1,), dtype=torch.uint8)
            return dense.scatter_(-1, torch.where(used, idx, torch.full_like(idx, Nkb)), 1)[..., :Nkb]

        dense = dense_of(kv_num, kv_idx)
        if full_num is not None:
            dense = dense | dense_of(full_num, full_idx)
        Nqb = -(-Nq // block_q)
        if dense.shape[2] != Nqb:
            raise ValueError(f"sparge: the BlockMask has {dense.shape[2]} query-block rows; Nq = {Nq} in blocks "
                             f"of {block_q} needs {Nqb}")
        B = dense.shape[0] if B is None else _checks.integer(B, "B", 1, _lib.INT64_MAX)
        H = dense.shape[1] if H is None else _checks.integer(H, "H", 1, _lib.INT64_MAX)
        try:
            dense = dense.expand(B, H, -1, -1)
        except RuntimeError as e:
            raise ValueError(f"sparge: the BlockMask's [B, H] = {list(dense.shape[:2])} cannot broadcast to "
                             f"[{B}, {H}]") from e
        return cls.from_dense(dense, Nq, Nk, block_q, block_k, device if device is not None else kv_num.device,
                              backend)

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
    """sparge's C scale argument (0 means 1/sqrt(D)) of a checked scale."""
    return 0.0 if scale is None else scale


def mask_params(topk, topp, block_q, block_k, scale):
    """Checked (topk, topp, block_q, block_k, scale) of a mask to predict."""
    topk, topp = _checks.fractions(topk, topp)
    return topk, topp, _checks.block(block_q, "block_q"), _checks.block(block_k, "block_k"), _checks.scale(scale)


def _predict(q, k, topk, topp, block_q, block_k, scale, layout, backend):
    """predict_mask on checked arguments."""
    B, H, Nq, _ = _torch.bhnd_shape(q, layout)
    Nk = _torch.bhnd_shape(k, layout)[2]
    mask = Mask._recycled(B, H, Nq, Nk, block_q, block_k, q.device, backend)
    return mask.predict(q, k, topk=topk, topp=topp, scale=scale, layout=layout)


def predict_mask(q, k, *, topk=_checks.DEFAULT_TOPK, topp=_checks.DEFAULT_TOPP, block_q=_checks.DEFAULT_BLOCK_Q,
                 block_k=_checks.DEFAULT_BLOCK_K, scale=None, layout="bhnd", backend=None):
    """Predict the SpargeAttention2 hybrid Top-k ∪ Top-p block mask of q [B,H,Nq,D] and k [B,H,Nk,D]
    (or [B,N,H,D] with layout="bnhd") on their device. Asynchronous on GPUs, on the current stream."""
    B, H, Nq, Nk, D = _checks.qk(q, k, layout)
    topk, topp, block_q, block_k, scale = mask_params(topk, topp, block_q, block_k, scale)
    backend = _checks.backend(backend)
    if _checks.is_empty(B, H, Nq, Nk, D):
        raise ValueError(f"sparge: no block mask for empty tensors (B={B} H={H} Nq={Nq} Nk={Nk} D={D})")
    return _predict(q, k, topk, topp, block_q, block_k, scale, layout, backend)


def predict_mask_csr(q, k, *, topk=_checks.DEFAULT_TOPK, topp=_checks.DEFAULT_TOPP, block_q=_checks.DEFAULT_BLOCK_Q,
                     block_k=_checks.DEFAULT_BLOCK_K, scale=None, layout="bhnd", backend=None):
    """The predicted mask as tensors on q's device: (counts int32 [B,H,Nqb], indices int32 [B,H,Nqb,Nkb], -1
    past each row's count). On torch >= 2.4 this is the custom op sparge::predict_mask, so it can sit inside
    torch.compile'd code; the library hands masks over through host memory, so it synchronizes."""
    B, H, Nq, Nk, D = _checks.qk(q, k, layout)
    topk, topp, block_q, block_k, scale = mask_params(topk, topp, block_q, block_k, scale)
    backend = _checks.backend(backend)
    if _checks.is_empty(B, H, Nq, Nk, D):
        raise ValueError(f"sparge: no block mask for empty tensors (B={B} H={H} Nq={Nq} Nk={Nk} D={D})")
    from . import attention

    if attention.custom_ops_available():
        return torch.ops.sparge.predict_mask(q, k, topk, topp, block_q, block_k, scale, layout, backend)
    return predict_csr_impl(q, k, topk, topp, block_q, block_k, scale, layout, backend)


def predict_csr_impl(q, k, topk, topp, block_q, block_k, scale, layout, backend):
    mask = _predict(q, k, topk, topp, block_q, block_k, scale, layout, backend)
    out = torch.empty((mask.B, mask.H, mask.Nqb), dtype=torch.int32), torch.empty(
        (mask.B, mask.H, mask.Nqb, mask.Nkb), dtype=torch.int32)
    with mask.bound():
        _lib.call("sparge_mask_get_csr", mask.handle, ctypes.c_void_p(out[0].data_ptr()),
                  ctypes.c_void_p(out[1].data_ptr()), None, None)
    return out[0].to(q.device), out[1].to(q.device)
