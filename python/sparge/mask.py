"""Block masks: a Mask owns a sparge_mask on the device of the tensors it is used with."""
import contextlib
import ctypes
import dataclasses
import re
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
#
# Variable-length masks are not kept (outside captures): their key holds the batch's sequence offsets, which
# change from batch to batch, so kept ones would pile up unused.
_POOL_PER_KEY = 4
_pool = {}
_captured = {}
_pool_lock = threading.Lock()


def _capturing(torch_device):
    return torch_device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _destroy(device, handle):
    with device.guard():
        _lib.lib.sparge_mask_destroy(handle)


def _release(device, key, handle, streams, state, varlen):
    if state["captured"]:
        with _pool_lock:
            _captured.setdefault(key + (next(iter(streams)),), []).append(handle)
        return
    if len(streams) <= 1 and not varlen:
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
    """sparge_mask_stats plus the per-head sparsity [B,H] (float64), the per-row kept pooled mass [B,H,Nqb]
    (float32, NaN for masks not predicted from Q and K; 0 for a variable-length mask's rows past a sequence's
    blocks) and the sparsity per batch entry [B] (float64). Block counts and sparsities are over the block pairs
    a query may attend (causal: on or below the diagonal; variable-length: within each sequence), token_density
    over the token pairs it may attend. For a variable-length mask B counts sequences, so head_sparsity and
    sequence_sparsity are per sequence; a sequence without queries counts nothing and has sparsity 0."""

    kept_blocks: int
    total_blocks: int
    sparsity: float
    token_density: float
    mean_row_mass: float
    min_row_blocks: int
    max_row_blocks: int
    head_sparsity: torch.Tensor
    row_mass: torch.Tensor
    sequence_sparsity: torch.Tensor


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
    (a torch device: "cpu" or "cuda:N"). H counts query heads: with grouped K/V heads every query head has its
    own rows. A new Mask holds no selection: fill it with predict(), set_dense() or set_csr(). The views
    (counts, indices, t_counts, t_indices, dense, pooled_map) are copies, returned as tensors on `device`.

    causal=True: block-causal, aligned bottom-right (query t may attend key u iff u <= t + Nk − Nq, so Nq <= Nk):
    a row selects among the blocks on or below its diagonal and always keeps its diagonal blocks (those holding
    key t + Nk − Nq of one of its queries); attention masks the tokens above the diagonal inside them.

    cu_seqlens_q, cu_seqlens_k (1-D int32 tensors of B+1 offsets, any device; both or neither): a batch of B
    variable-length sequences packed along N (flash-attn's varlen convention): sequence b is tokens
    [cu[b], cu[b+1]) of the packed [1, H, Nq, D] / [1, Hkv, Nk, D] tensors, Nq and Nk being the totals. A
    sequence may be empty (its rows keep nothing, and its keys get zero gradients), but one with queries needs
    keys. Its views are [B, H, Nqb, Nkb] over the longest sequence's blocks (max_seqlen_q / max_seqlen_k tokens);
    rows and columns past a shorter sequence's blocks hold nothing."""

    def __init__(self, B, H, Nq, Nk, block_q=_checks.DEFAULT_BLOCK_Q, block_k=_checks.DEFAULT_BLOCK_K,
                 device="cpu", backend=None, *, causal=False, cu_seqlens_q=None, cu_seqlens_k=None):
        self._open(B, H, Nq, Nk, block_q, block_k, device, backend, causal, cu_seqlens_q, cu_seqlens_k,
                   recycle=False)

    @classmethod
    def _recycled(cls, B, H, Nq, Nk, block_q, block_k, device, backend=None, causal=False, cu_seqlens_q=None,
                  cu_seqlens_k=None):
        """A Mask that may reuse a kept handle, which still holds an old selection: only for callers that
        fill it before returning it."""
        mask = cls.__new__(cls)
        mask._open(B, H, Nq, Nk, block_q, block_k, device, backend, causal, cu_seqlens_q, cu_seqlens_k,
                   recycle=True)
        return mask

    def _open(self, B, H, Nq, Nk, block_q, block_k, device, backend, causal, cu_seqlens_q, cu_seqlens_k, recycle):
        B, H, Nq, Nk = _checks.mask_dims(B, H, Nq, Nk)
        block_q, block_k = _checks.block(block_q, "block_q"), _checks.block(block_k, "block_k")
        causal = _checks.flag(causal, "causal")
        if (cu_seqlens_q is None) != (cu_seqlens_k is None):
            raise ValueError("sparge: give both cu_seqlens_q and cu_seqlens_k, or neither")
        cu = None
        if cu_seqlens_q is not None:
            cu = (_checks.cu_seqlens(cu_seqlens_q, "cu_seqlens_q", Nq, "the packed q (Nq)"),
                  _checks.cu_seqlens(cu_seqlens_k, "cu_seqlens_k", Nk, "the packed k (Nk)"))
            for name, t in zip(("cu_seqlens_q", "cu_seqlens_k"), cu):
                if t.numel() != B + 1:
                    raise ValueError(f"sparge: {name} has {t.numel()} entries; B = {B} sequences need {B + 1}")
            _checks.sequence_lengths(cu[0], cu[1], causal)
        elif causal:
            _checks.causal_lengths(Nq, Nk)
        self.torch_device = _torch_device(device)
        self.device = _torch.open_device(_torch.sparge_device_name(self.torch_device, _checks.backend(backend)),
                                         self.torch_device)
        key = (self.device, B, H, Nq, Nk, block_q, block_k, causal)
        if cu is not None:
            key += (tuple(cu[0].tolist()), tuple(cu[1].tolist()))
        stream = _torch.current_stream(self.torch_device)
        capturing = _capturing(self.torch_device)
        handle = None
        if recycle and (cu is None or capturing):
            with _pool_lock:
                for pool in (_captured, _pool) if capturing else (_pool,):
                    kept = pool.get(key + (stream,))
                    if kept:
                        handle = kept.pop()
                        break
        if handle is None:
            handle = ctypes.c_void_p()
            layout = _lib.sparge_mask_layout(B, H, Nq, Nk, block_q, block_k, int(causal),
                                             cu[0].data_ptr() if cu else None, cu[1].data_ptr() if cu else None)
            with self.device.guard():
                _lib.call("sparge_mask_create_ex", self.device.handle, ctypes.byref(layout), ctypes.byref(handle))
        self.handle = handle
        self._streams = {stream}  # streams its work was queued on (see _release)
        self._state = {"captured": capturing}
        self._finalizer = weakref.finalize(self, _release, self.device, key, handle, self._streams, self._state,
                                           cu is not None)
        self._finalizer.atexit = False  # the process is ending: leave the memory to the OS
        shape = _lib.sparge_mask_shape()
        _lib.call("sparge_mask_get_shape", handle, ctypes.byref(shape))
        self.B, self.H, self.Nq, self.Nk = B, H, Nq, Nk
        self.max_seqlen_q, self.max_seqlen_k = shape.Nq, shape.Nk
        self.block_q, self.block_k, self.Nqb, self.Nkb = shape.block_q, shape.block_k, shape.Nqb, shape.Nkb
        self.causal, self.varlen = bool(shape.causal), bool(shape.varlen)
        self._cu = cu  # host copies of the offsets (None for fixed lengths), handed out as copies again
        self.predicted = False
        self._fills = 0  # selections written so far (see _held, _check_held)

    def __copy__(self):
        """A new Mask of the same layout holding the same selection, set from the dense view: a copy that shared
        the handle would read whatever mask reuses it once this one is released. The pooled map and the row mass
        of a prediction stay with the original."""
        if self._fills == 0:
            return Mask(self.B, self.H, self.Nq, self.Nk, self.block_q, self.block_k, self.torch_device,
                        self.device.backend, causal=self.causal, cu_seqlens_q=self.cu_seqlens_q,
                        cu_seqlens_k=self.cu_seqlens_k)
        return Mask.from_dense(self.dense, self.Nq, self.Nk, self.block_q, self.block_k, self.torch_device,
                               self.device.backend, causal=self.causal, cu_seqlens_q=self.cu_seqlens_q,
                               cu_seqlens_k=self.cu_seqlens_k)

    def __deepcopy__(self, memo):
        return self.__copy__()

    def __repr__(self):
        extra = (", causal" if self.causal else "") + (
            f", {self.B} packed sequences (longest {self.max_seqlen_q} x {self.max_seqlen_k})" if self.varlen else "")
        return (f"sparge.Mask(B={self.B}, H={self.H}, Nq={self.Nq}, Nk={self.Nk}, blocks {self.block_q}x"
                f"{self.block_k}{extra}, on {self.device.name})")

    def _lengths(self):
        """[(nq, nk)] per batch entry: the sequences' lengths (varlen) or (Nq, Nk) for each of the B entries."""
        if not self.varlen:
            return [(self.Nq, self.Nk)] * self.B
        return list(zip(self._cu[0].diff().tolist(), self._cu[1].diff().tolist()))

    @property
    def cu_seqlens_q(self):
        """int32 [B+1]: the sequences' query offsets of a variable-length mask (a host copy), or None."""
        return None if self._cu is None else self._cu[0].clone()

    @property
    def cu_seqlens_k(self):
        """int32 [B+1]: the sequences' key offsets of a variable-length mask (a host copy), or None."""
        return None if self._cu is None else self._cu[1].clone()

    @contextlib.contextmanager
    def bound(self):
        """Context for a sparge call that uses this mask on the current stream (recorded for reuse)."""
        with self.device.bound() as stream:
            self._streams.add(stream)
            if _capturing(self.torch_device):
                self._state["captured"] = True
            yield

    def check_attention_shapes(self, B, H, Nq, Nk):
        """Raise ValueError unless this mask was made for attention of these shapes (B, H: q's batch and heads;
        a variable-length mask takes packed tensors, B = 1 and Nq, Nk the totals)."""
        if self.varlen:
            if (B, H, Nq, Nk) != (1, self.H, self.Nq, self.Nk):
                raise ValueError(f"sparge: the mask was made for {self.B} packed sequences of H={self.H}, Nq={self.Nq} "
                                 f"Nk={self.Nk} tokens in all (tensors of batch 1), the tensors have B={B} H={H} "
                                 f"Nq={Nq} Nk={Nk}")
        elif (B, H, Nq, Nk) != (self.B, self.H, self.Nq, self.Nk):
            raise ValueError(f"sparge: the mask was made for B={self.B} H={self.H} Nq={self.Nq} Nk={self.Nk}, "
                             f"the tensors have B={B} H={H} Nq={Nq} Nk={Nk}")

    def _held(self):
        """A token of the selection the mask holds now: an autograd function keeps it from its forward and gives
        it to _check_held in its backward."""
        return self._fills

    def _check_held(self, token):
        """Raise RuntimeError if the mask was filled again since _held() gave token: a backward would differentiate
        another selection than its forward's (as torch refuses a saved tensor modified in place)."""
        if self._fills != token:
            raise RuntimeError("sparge: the mask was filled again (predict, set_dense or set_csr) after the forward "
                               "that saved it for the backward, which would use the new selection; give each "
                               "forward whose backward is still to run a Mask of its own")

    def _check_tensor_device(self, role, t):
        if t.device != self.torch_device:
            raise ValueError(f"sparge: {role} is on {t.device} but the mask is on {self.torch_device}")

    # ------------------------------------------------------------ filling
    def predict(self, q, k, *, topk=_checks.DEFAULT_TOPK, topp=_checks.DEFAULT_TOPP, scale=None, layout="bhnd"):
        """Pool Q and K, build the pooled map, keep Top-k ∪ Top-p blocks per row (SpargeAttention2). k may have
        fewer heads than q (grouped K/V heads, dividing q's). A causal mask's rows select among the blocks on or
        below their diagonal (the map's softmax runs over those) and keep their diagonal blocks besides; a
        variable-length mask's rows see their own sequence only (q and k packed, batch 1)."""
        B, H, Nq, Nk, _ = _checks.qk(q, k, layout)
        self._check_tensor_device("q", q)
        self.check_attention_shapes(B, H, Nq, Nk)
        topk, topp = _checks.fractions(topk, topp)
        scale = _checks.scale(scale)
        qv = _torch.view(q, layout, "q", self.device.backend)
        kv = _torch.view(k, layout, "k", self.device.backend)
        params = _lib.sparge_mask_params(self.block_q, self.block_k, topk, topp, _scale_arg(scale), int(self.causal))
        with self.bound():
            _lib.call("sparge_mask_predict", self.device.handle, ctypes.byref(qv), ctypes.byref(kv),
                      ctypes.byref(params), self.handle)
        self.predicted = True
        self._fills += 1
        return self

    def set_dense(self, dense):
        """Set the mask from a dense [B,H,Nqb,Nkb] tensor (nonzero = keep; every row keeps a block). A causal
        mask's rows must keep their diagonal blocks and nothing above them, a variable-length mask's nothing past
        a sequence's blocks (sparge refuses the rest with SpargeError, and the mask keeps what it held)."""
        _checks.strided(dense, "dense mask")
        want = (self.B, self.H, self.Nqb, self.Nkb)
        if tuple(dense.shape) != want:
            raise ValueError(f"sparge: dense mask has shape {list(dense.shape)}, the mask needs {list(want)}")
        if dense.is_complex() or dense.is_floating_point() and not torch.isfinite(dense).all():
            raise ValueError("sparge: dense mask must be real and finite (nonzero = keep)")
        host = (dense != 0).to(device="cpu", dtype=torch.uint8).contiguous()
        real_rows = torch.zeros((self.B, 1, self.Nqb), dtype=torch.bool)
        for b, (nq, _) in enumerate(self._lengths()):
            real_rows[b, 0, : -(-nq // self.block_q)] = True
        empty = ((host.sum(-1) == 0) & real_rows).nonzero()
        if len(empty):
            b, h, i = (int(x) for x in empty[0])
            raise ValueError(f"sparge: dense mask row [b={b}, h={h}, i={i}] keeps no block ({len(empty)} such "
                             "rows); every query-block row needs one")
        with self.bound():
            _lib.call("sparge_mask_set_dense", self.handle, ctypes.c_void_p(host.data_ptr()))
        self.predicted = False
        self._fills += 1
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
                   device=None, backend=None, *, causal=False, cu_seqlens_q=None, cu_seqlens_k=None):
        """A mask for [B,H,Nq,*] × [B,H,Nk,*] from a dense block mask [B,H,Nqb,Nkb] (causal and cu_seqlens as
        for Mask(); for a variable-length mask B counts sequences and Nq, Nk are the packed totals)."""
        if not isinstance(dense, torch.Tensor) or dense.dim() != 4:
            raise TypeError("sparge: dense must be a 4-D torch.Tensor [B,H,Nqb,Nkb]")
        B, H = dense.shape[0], dense.shape[1]
        return cls._recycled(B, H, Nq, Nk, block_q, block_k, device if device is not None else dense.device,
                             backend, causal, cu_seqlens_q, cu_seqlens_k).set_dense(dense)

    @classmethod
    def from_csr(cls, counts, indices, Nq, Nk, block_q=_checks.DEFAULT_BLOCK_Q, block_k=_checks.DEFAULT_BLOCK_K,
                 device=None, backend=None, *, causal=False, cu_seqlens_q=None, cu_seqlens_k=None):
        """A mask from per-row counts [B,H,Nqb] and indices [B,H,Nqb,*] (as `counts` and `indices` give them)."""
        if not isinstance(counts, torch.Tensor) or counts.dim() != 3:
            raise TypeError("sparge: counts must be a 3-D torch.Tensor [B,H,Nqb]")
        B, H = counts.shape[0], counts.shape[1]
        return cls._recycled(B, H, Nq, Nk, block_q, block_k, device if device is not None else counts.device,
                             backend, causal, cu_seqlens_q, cu_seqlens_k).set_csr(counts, indices)

    # ------------------------------------------------------------ FlexAttention (torch >= 2.5)
    def to_flex_block_mask(self):
        """This mask as a FlexAttention BlockMask (torch >= 2.5) with BLOCK_SIZE = (block_q, block_k) and
        seq_lengths = (Nq, Nk), so that flex_attention with it computes what sparge computes, compiled or not.
        Kept blocks are listed row-ascending, the unkept ones after them as FlexAttention orders them.

        Kept blocks all of whose token pairs attend are full blocks (full_kv_num_blocks / full_kv_indices):
        without causal every kept block; with causal those below the diagonal. A causal mask's diagonal blocks
        are partial blocks (kv_num_blocks / kv_indices). The mask_mod is flex_mask_mod(): the kept blocks, and
        with causal the bottom-right rule kv_idx <= q_idx + Nk − Nq. It masks the tokens of the partial blocks,
        and it is all that eager (uncompiled) flex_attention reads, which ignores the block lists.
        from_flex_block_mask(..., causal=self.causal) takes such a BlockMask back. Variable-length masks have
        no BlockMask form and are refused."""
        if self.varlen:
            raise ValueError("sparge: a FlexAttention BlockMask has no packed sequences; to_flex_block_mask takes "
                             "fixed-length masks")
        try:
            from torch.nn.attention.flex_attention import BlockMask
        except ImportError as e:
            raise RuntimeError(f"sparge: FlexAttention needs torch >= 2.5 (this is {torch.__version__})") from e

        def blocks(kept):
            counts = kept.sum(-1, dtype=torch.int32)
            order = torch.argsort(kept.to(torch.int32), dim=-1, descending=True, stable=True)
            return counts, order.to(torch.int32).contiguous()

        dense = self.dense.bool()
        full = dense
        if self.causal:
            full = dense & _causal_whole_blocks(self.Nq, self.Nk, self.block_q, self.block_k, dense.device)
        counts, indices = blocks(dense & ~full)
        full_counts, full_indices = blocks(full)
        return BlockMask.from_kv_blocks(counts, indices, full_counts, full_indices,
                                        BLOCK_SIZE=(self.block_q, self.block_k), mask_mod=self.flex_mask_mod(),
                                        seq_lengths=(self.Nq, self.Nk))

    def flex_mask_mod(self):
        """FlexAttention's mask_mod(b, h, q_idx, kv_idx) for this fixed-length mask: whether query q_idx attends key
        kv_idx (the pairs of token_mask()), as elementwise torch operations on a copy of the dense block view."""
        if self.varlen:
            raise ValueError("sparge: flex_mask_mod takes fixed-length masks")
        kept, bq, bk, Nqb, Nkb = self.dense.bool(), self.block_q, self.block_k, self.Nqb, self.Nkb
        off = self.Nk - self.Nq

        def block_mask_mod(b, h, q_idx, kv_idx):
            # Compiled kernels may ask for padded indices past Nq or Nk; their blocks are clamped into range.
            return kept[b, h, (q_idx // bq).clamp(max=Nqb - 1), (kv_idx // bk).clamp(max=Nkb - 1)]

        def causal_mask_mod(b, h, q_idx, kv_idx):
            return block_mask_mod(b, h, q_idx, kv_idx) & (kv_idx <= q_idx + off)

        return causal_mask_mod if self.causal else block_mask_mod

    @classmethod
    def from_flex_block_mask(cls, block_mask, Nq, Nk, *, B=None, H=None, keep_partial=False, causal=False,
                             device=None, backend=None):
        """A sparge Mask from a FlexAttention BlockMask: the union of its partial (kv_num_blocks/kv_indices)
        and full (full_kv_*) blocks over blocks of its BLOCK_SIZE. Batch or head dimensions of size 1 are
        broadcast to B or H when given. A BlockMask with a mask_mod masks tokens inside its partial blocks,
        which a block mask cannot: that is refused unless keep_partial=True keeps those blocks whole.

        causal=True gives a causal Mask (Nq <= Nk), which masks the tokens of its kept blocks by the
        bottom-right rule kv_idx <= q_idx + Nk − Nq, as to_flex_block_mask's BlockMasks do; the import is
        exact, or refused with ValueError: every full block must lie wholly on or below that diagonal, and
        the mask_mod must equal the rule on every token pair of the partial blocks (without a mask_mod they
        are whole, so they must lie below the diagonal too). The mask_mod is called on broadcasting int64
        index tensors, once per (b, h) where the BlockMask's batch or head dimension is not 1 (else with
        index 0), over the existing tokens of the partial blocks only; it must work elementwise (torch
        operations, no Python branching on the indices). The rows must keep their diagonal blocks and
        nothing above them, as for any causal Mask. keep_partial=True is refused with causal=True: a causal
        Mask cannot keep its diagonal blocks whole."""
        kv_num, kv_idx = block_mask.kv_num_blocks, block_mask.kv_indices
        full_num, full_idx = getattr(block_mask, "full_kv_num_blocks", None), getattr(block_mask,
                                                                                     "full_kv_indices", None)
        size = block_mask.BLOCK_SIZE
        block_q, block_k = (size, size) if isinstance(size, int) else (size[0], size[1])
        Nq, Nk = _checks.integer(Nq, "Nq", 1, _lib.INT32_MAX), _checks.integer(Nk, "Nk", 1, _lib.INT32_MAX)
        causal = _checks.flag(causal, "causal")
        mask_mod = getattr(block_mask, "mask_mod", None)
        if mask_mod is not None and getattr(mask_mod, "__name__", "") == "noop_mask":
            mask_mod = None
        if causal:
            if keep_partial:
                raise ValueError("sparge: keep_partial=True and causal=True exclude each other: a causal mask "
                                 "masks the tokens of its diagonal blocks by the bottom-right rule, it cannot "
                                 "keep them whole")
            _checks.causal_lengths(Nq, Nk)
        elif mask_mod is not None and not keep_partial and bool((kv_num > 0).any()):
            raise ValueError("sparge: this BlockMask has a mask_mod, which masks tokens inside its partial blocks; "
                             "a sparge mask keeps or drops whole blocks. keep_partial=True keeps them whole "
                             "(causal=True imports a bottom-right causal mask_mod).")

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

        partial = dense_of(kv_num, kv_idx)
        full = dense_of(full_num, full_idx) if full_num is not None else None
        dense = partial if full is None else partial | full
        Nqb = -(-Nq // block_q)
        if dense.shape[2] != Nqb:
            raise ValueError(f"sparge: the BlockMask has {dense.shape[2]} query-block rows; Nq = {Nq} in blocks "
                             f"of {block_q} needs {Nqb}")
        if causal:
            _flex_causal_tokens(partial, full, mask_mod, Nq, Nk, block_q, block_k, kv_num.device)
        B = dense.shape[0] if B is None else _checks.integer(B, "B", 1, _lib.INT64_MAX)
        H = dense.shape[1] if H is None else _checks.integer(H, "H", 1, _lib.INT64_MAX)
        try:
            dense = dense.expand(B, H, -1, -1)
        except RuntimeError as e:
            raise ValueError(f"sparge: the BlockMask's [B, H] = {list(dense.shape[:2])} cannot broadcast to "
                             f"[{B}, {H}]") from e
        device = device if device is not None else kv_num.device
        if not causal:
            return cls.from_dense(dense, Nq, Nk, block_q, block_k, device, backend)
        try:
            return cls.from_dense(dense, Nq, Nk, block_q, block_k, device, backend, causal=True)
        except _lib.SpargeError as e:
            if e.status_name != "SPARGE_ERR_INVALID":
                raise
            found = re.search(r"row (\d+)(.*)", str(e))
            detail = str(e)
            if found:
                r = int(found.group(1))
                detail = f"row [b={r // (H * Nqb)}, h={r // Nqb % H}, i={r % Nqb}]{found.group(2)}"
            raise ValueError("sparge: the BlockMask is not a causal sparge mask (every query-block row keeps its "
                             f"diagonal blocks and none above them): {detail}") from e

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
        """bool [B,H,Nq,Nk]: the token pairs attention attends (for dense masked references): the kept blocks,
        and with causal only the keys u <= t + Nk − Nq of query t. A variable-length mask gives [B,H,max_seqlen_q,
        max_seqlen_k], sequence b's pairs in its top-left corner, false past its tokens."""
        Nq, Nk = self.max_seqlen_q, self.max_seqlen_k
        dense = self.dense.bool()
        pairs = dense.repeat_interleave(self.block_q, dim=2)[:, :, :Nq].repeat_interleave(self.block_k, dim=3)
        pairs = pairs[:, :, :, :Nk]
        t = torch.arange(Nq, device=pairs.device)[:, None]
        u = torch.arange(Nk, device=pairs.device)[None, :]
        allowed = torch.stack([(t < nq) & (u < nk) & ((u <= t + nk - nq) if self.causal else True)
                               for nq, nk in self._lengths()])
        return pairs & allowed[:, None]

    def stats(self):
        st = _lib.sparge_mask_stats()
        head = torch.empty((self.B, self.H), dtype=torch.float64)
        mass = torch.empty((self.B, self.H, self.Nqb), dtype=torch.float32)
        with self.bound():
            _lib.call("sparge_mask_get_stats", self.handle, ctypes.byref(st), ctypes.c_void_p(head.data_ptr()),
                      ctypes.c_void_p(mass.data_ptr()))
        # Every head of a batch entry has the same attendable blocks, so the mean over heads is the entry's own.
        return MaskStats(st.kept_blocks, st.total_blocks, st.sparsity, st.token_density, st.mean_row_mass,
                         st.min_row_blocks, st.max_row_blocks, head, mass, head.mean(1))

    @property
    def sparsity(self):
        """1 − kept / attendable block pairs."""
        return self.stats().sparsity


def _causal_whole_blocks(Nq, Nk, block_q, block_k, device="cpu"):
    """bool [Nqb, Nkb]: the blocks every token pair of which attends under the bottom-right causal rule (the
    block's first query reaches its last key)."""
    first_query = torch.arange(-(-Nq // block_q), device=device) * block_q
    last_key = (torch.arange(1, -(-Nk // block_k) + 1, device=device) * block_k).clamp(max=Nk) - 1
    return last_key[None, :] <= first_query[:, None] + Nk - Nq


_FLEX_CHECK_PAIRS = 1 << 22  # token pairs per mask_mod call when a causal BlockMask's partial blocks are checked


def _flex_causal_tokens(partial, full, mask_mod, Nq, Nk, block_q, block_k, device):
    """Refuse a BlockMask whose token masking differs from a causal sparge mask's over the same blocks:
    full blocks (and partial ones without a mask_mod) must lie wholly on or below the bottom-right diagonal,
    and the mask_mod must equal the rule kv_idx <= q_idx + Nk − Nq on the existing pairs of every partial
    block. partial and full are the BlockMask's uint8 [B', H', Nqb, Nkb] blocks, B' and H' its own."""
    off = Nk - Nq
    whole = _causal_whole_blocks(Nq, Nk, block_q, block_k)

    def first(sel):
        b, h, i, j = (int(x) for x in sel.nonzero()[0])
        return f"[b={b}, h={h}, i={i}, j={j}]"

    if full is not None and bool((full.bool() & ~whole).any()):
        raise ValueError(f"sparge: full block {first(full.bool() & ~whole)} holds token pairs above the causal "
                         f"diagonal (kv_idx > q_idx + {off}), which FlexAttention attends and a causal sparge mask "
                         "does not; only blocks wholly on or below the diagonal can be full")
    if mask_mod is None:
        if bool((partial.bool() & ~whole).any()):
            raise ValueError(f"sparge: partial block {first(partial.bool() & ~whole)} has no mask_mod, so "
                             "FlexAttention attends all its token pairs, some above the causal diagonal "
                             f"(kv_idx > q_idx + {off}); give the BlockMask the mask_mod kv_idx <= q_idx + {off}")
        return
    blocks = partial.bool().nonzero()  # [n, 4] (b, h, i, j), b and h 0 where the BlockMask broadcasts
    dq = torch.arange(block_q, device=device)[None, :, None]
    dk = torch.arange(block_k, device=device)[None, None, :]
    step = max(1, _FLEX_CHECK_PAIRS // (block_q * block_k))
    for start in range(0, len(blocks), step):
        b, h, i, j = blocks[start:start + step].to(device)[:, :, None, None].unbind(1)  # each [n, 1, 1]
        t, u = i * block_q + dq, j * block_k + dk  # [n, bq, 1], [n, 1, bk]
        exists = (t < Nq) & (u < Nk)
        t, u = t.clamp(max=Nq - 1), u.clamp(max=Nk - 1)  # tokens past Nq / Nk do not exist: never asked for
        try:
            got = torch.as_tensor(mask_mod(b, h, t, u), device=device).to(torch.bool).broadcast_to(exists.shape)
        except Exception as e:
            raise ValueError(f"sparge: the BlockMask's mask_mod could not be evaluated ({type(e).__name__}: {e}); "
                             "causal=True calls it on broadcasting integer index tensors (b, h, q_idx, kv_idx), "
                             "so it must work elementwise with torch operations, without Python branching on "
                             f"the indices (sparge's own rule is kv_idx <= q_idx + {off})") from e
        wrong = (got != (u <= t + off)) & exists
        if bool(wrong.any()):
            n, tq, uk = (int(x) for x in wrong.nonzero()[0])
            bad = blocks[start + n]
            raise ValueError(f"sparge: the BlockMask's mask_mod differs from the bottom-right causal rule kv_idx <= "
                             f"q_idx + {off} in partial block [b={int(bad[0])}, h={int(bad[1])}, i={int(bad[2])}, "
                             f"j={int(bad[3])}]: at q_idx = {int(t[n, tq, 0])}, kv_idx = {int(u[n, 0, uk])} it gives "
                             f"{bool(got[n, tq, uk])}; a causal sparge mask masks the tokens of its blocks by that "
                             "rule only (a top-left causal mask_mod is that rule only for Nq = Nk)")


def _scale_arg(scale):
    """sparge's C scale argument (0 means 1/sqrt(D)) of a checked scale."""
    return 0.0 if scale is None else scale


def mask_params(topk, topp, block_q, block_k, scale):
    """Checked (topk, topp, block_q, block_k, scale) of a mask to predict."""
    topk, topp = _checks.fractions(topk, topp)
    return topk, topp, _checks.block(block_q, "block_q"), _checks.block(block_k, "block_k"), _checks.scale(scale)


def defaulted_mask_params(topk, topp, block_q, block_k, scale):
    """mask_params with the defaults for the parameters left None."""
    return mask_params(_checks.DEFAULT_TOPK if topk is None else topk, _checks.DEFAULT_TOPP if topp is None else topp,
                       _checks.DEFAULT_BLOCK_Q if block_q is None else block_q,
                       _checks.DEFAULT_BLOCK_K if block_k is None else block_k, scale)


def no_prediction_params(fn, topk, topp):
    """An attention call given mask= takes no prediction parameters."""
    if topk is not None or topp is not None:
        raise ValueError(f"{fn}: mask= is given, so there is no prediction for topk / topp to steer; pass either "
                         "mask or topk / topp")


def given_mask_matches(fn, mask, causal, causal_name, block_q, block_k):
    """A given mask has the call's causality and, where given, its block sizes."""
    if mask.causal != causal:
        raise ValueError(f"{fn}: the given mask is {'' if mask.causal else 'not '}causal but {causal_name}={causal}")
    for name, given, own in (("block_q", block_q, mask.block_q), ("block_k", block_k, mask.block_k)):
        if given is not None and _checks.block(given, name) != own:
            raise ValueError(f"{fn}: {name} = {given} but the given mask has {name} = {own}")


def _predict(q, k, topk, topp, block_q, block_k, scale, layout, backend, causal=False):
    """predict_mask on checked arguments."""
    B, H, Nq, _ = _torch.bhnd_shape(q, layout)
    Nk = _torch.bhnd_shape(k, layout)[2]
    mask = Mask._recycled(B, H, Nq, Nk, block_q, block_k, q.device, backend, causal)
    return mask.predict(q, k, topk=topk, topp=topp, scale=scale, layout=layout)


def _prediction_args(q, k, topk, topp, block_q, block_k, scale, layout, backend, causal):
    B, H, Nq, Nk, D = _checks.qk(q, k, layout)
    topk, topp, block_q, block_k, scale = mask_params(topk, topp, block_q, block_k, scale)
    backend = _checks.backend(backend)
    if _checks.flag(causal, "causal"):
        _checks.causal_lengths(Nq, Nk)
    if _checks.is_empty(B, H, Nq, Nk, D):
        raise ValueError(f"sparge: no block mask for empty tensors (B={B} H={H} Nq={Nq} Nk={Nk} D={D})")
    return topk, topp, block_q, block_k, scale, backend


def predict_mask(q, k, *, topk=_checks.DEFAULT_TOPK, topp=_checks.DEFAULT_TOPP, block_q=_checks.DEFAULT_BLOCK_Q,
                 block_k=_checks.DEFAULT_BLOCK_K, scale=None, layout="bhnd", backend=None, causal=False):
    """Predict the SpargeAttention2 hybrid Top-k ∪ Top-p block mask of q [B,H,Nq,D] and k [B,Hkv,Nk,D]
    (or [B,N,H,D] with layout="bnhd"; Hkv dividing H, one mask row per query head) on their device; causal=True
    predicts a block-causal mask (bottom-right aligned, Nq <= Nk). Asynchronous on GPUs, on the current stream."""
    topk, topp, block_q, block_k, scale, backend = _prediction_args(q, k, topk, topp, block_q, block_k, scale,
                                                                    layout, backend, causal)
    return _predict(q, k, topk, topp, block_q, block_k, scale, layout, backend, causal)


def predict_mask_csr(q, k, *, topk=_checks.DEFAULT_TOPK, topp=_checks.DEFAULT_TOPP, block_q=_checks.DEFAULT_BLOCK_Q,
                     block_k=_checks.DEFAULT_BLOCK_K, scale=None, layout="bhnd", backend=None, causal=False):
    """The predicted mask as tensors on q's device: (counts int32 [B,H,Nqb], indices int32 [B,H,Nqb,Nkb], -1
    past each row's count). On torch >= 2.4 this is the custom op sparge::predict_mask, so it can sit inside
    torch.compile'd code; the library hands masks over through host memory, so it synchronizes."""
    topk, topp, block_q, block_k, scale, backend = _prediction_args(q, k, topk, topp, block_q, block_k, scale,
                                                                    layout, backend, causal)
    from . import attention

    if attention.custom_ops_available():
        return torch.ops.sparge.predict_mask(q, k, topk, topp, block_q, block_k, scale, layout, backend, causal)
    return predict_csr_impl(q, k, topk, topp, block_q, block_k, scale, layout, backend, causal)


def predict_csr_impl(q, k, topk, topp, block_q, block_k, scale, layout, backend, causal):
    mask = _predict(q, k, topk, topp, block_q, block_k, scale, layout, backend, causal)
    out = torch.empty((mask.B, mask.H, mask.Nqb), dtype=torch.int32), torch.empty(
        (mask.B, mask.H, mask.Nqb, mask.Nkb), dtype=torch.int32)
    with mask.bound():
        _lib.call("sparge_mask_get_csr", mask.handle, ctypes.c_void_p(out[0].data_ptr()),
                  ctypes.c_void_p(out[1].data_ptr()), None, None)
    return out[0].to(q.device), out[1].to(q.device)
