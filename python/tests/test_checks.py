"""Arguments are checked in Python before anything reaches C, and the defects those checks close: a new Mask
holding a released mask's selection, block sizes wrapped by the C int, numpy arrays, empty tensors, float64 on
cpu-ref (gradcheck), and mask parameters ignored next to a given mask."""
import copy
import gc
import unittest

from helpers import dense_masked_attention, randn, rel_l2, sparge, torch

try:
    import numpy
except ImportError:
    numpy = None


def qkv(B, H, Nq, Nk, D, dtype=torch.float32, seed=0, requires_grad=False):
    ts = [randn(B, H, n, D, dtype=dtype, seed=seed + i) for i, n in enumerate((Nq, Nk, Nk))]
    return [t.requires_grad_(requires_grad) for t in ts]


class RecycledMaskHandles(unittest.TestCase):
    def test_new_mask_holds_no_selection(self):
        q, k, v = qkv(1, 2, 256, 256, 64, seed=31)
        m = sparge.predict_mask(q, k, topk=0.5)
        del m
        gc.collect()  # the released handle goes to the reuse pool
        m2 = sparge.Mask(1, 2, 256, 256)
        with self.assertRaisesRegex(sparge.SpargeError, "holds no selection yet"):
            m2.dense
        with self.assertRaisesRegex(sparge.SpargeError, "holds no selection yet"):
            sparge.attention_forward(q, k, v, m2)
        with self.assertRaisesRegex(sparge.SpargeError, "holds no selection yet"):
            sparge.sparge_attention(q, k, v, mask=m2)
        sparge.free_cached_masks()

    def test_filled_masks_still_reuse_handles(self):
        q, k, _ = qkv(1, 2, 256, 256, 64, seed=32)
        dense = torch.zeros(1, 2, 2, 4, dtype=torch.uint8)
        dense[..., 3] = 1
        gc.collect()
        gc.disable()  # no other mask of these shapes may reach the pool in between
        try:
            first = sparge.predict_mask(q, k, topk=0.5)
            handle = first.handle.value
            del first
            second = sparge.Mask.from_dense(dense, 256, 256)
        finally:
            gc.enable()
        self.assertEqual(second.handle.value, handle)
        self.assertTrue(torch.equal(second.dense, dense))
        with self.assertRaisesRegex(sparge.SpargeError, "not predicted"):
            second.pooled_map  # the first owner's prediction does not show through
        sparge.free_cached_masks()


class CopiedMasks(unittest.TestCase):
    """copy.copy and copy.deepcopy (a module holding a Mask, deep-copied for an EMA) give a Mask of its own: a
    copy sharing the handle would show another mask's selection once the handle is reused."""

    def test_copies_own_their_selection(self):
        q, k, v = qkv(1, 2, 256, 256, 32, seed=71)
        for copy_fn in (copy.copy, copy.deepcopy):
            with self.subTest(copy_fn.__name__):
                mask = sparge.predict_mask(q, k, topk=0.4, topp=0.0, causal=True)
                dense, out = mask.dense, sparge.attention_forward(q, k, v, mask)[0]
                dup = copy_fn(mask)
                self.assertTrue(dup.causal)
                del mask
                gc.collect()  # the original's handle goes to the reuse pool ...
                sparge.predict_mask(*qkv(1, 2, 256, 256, 32, seed=72)[:2], topk=0.1, topp=0.0, causal=True)
                self.assertTrue(torch.equal(dup.dense, dense))  # ... and the copy still holds its own selection
                self.assertTrue(torch.equal(sparge.attention_forward(q, k, v, dup)[0], out))
        sparge.free_cached_masks()

    def test_copy_of_an_empty_and_of_a_variable_length_mask(self):
        cu = torch.tensor([0, 100, 256], dtype=torch.int32)
        empty = copy.copy(sparge.Mask(2, 2, 256, 256, cu_seqlens_q=cu, cu_seqlens_k=cu))
        self.assertTrue(empty.varlen)
        self.assertTrue(torch.equal(empty.cu_seqlens_q, cu))
        with self.assertRaisesRegex(sparge.SpargeError, "holds no selection yet"):
            empty.dense


class BlockSizes(unittest.TestCase):
    BAD = ((2**32 + 64, ValueError, r"block_q = 4294967360 is outside \[1, 2147483647\]"),
           (1 << 40, ValueError, "is outside"),
           (0, ValueError, "is outside"),
           (-64, ValueError, "is outside"),
           (1.5, TypeError, "block_q must be an int, got float"),
           (True, TypeError, "block_q must be an int, got bool"),
           (64.0, TypeError, "got float"),
           ("64", TypeError, "got str"))

    def test_bad_block_sizes_are_refused_before_c(self):
        q, k, v = qkv(1, 1, 128, 128, 32)
        for value, exc, message in self.BAD:
            with self.subTest(block_q=value):
                with self.assertRaisesRegex(exc, message):
                    sparge.predict_mask(q, k, block_q=value)
                with self.assertRaisesRegex(exc, message):
                    sparge.sparge_attention(q, k, v, block_q=value)
                with self.assertRaisesRegex(exc, message):
                    sparge.Mask(1, 1, 128, 128, value, 64)
                with self.assertRaisesRegex(exc, message.replace("block_q", "block_k")):
                    sparge.predict_mask(q, k, block_k=value)

    def test_good_block_sizes(self):
        q, k, _ = qkv(1, 1, 128, 128, 32)
        self.assertEqual(sparge.predict_mask(q, k, block_q=2**31 - 1, block_k=2**31 - 1).Nqb, 1)
        if numpy is not None:
            m = sparge.predict_mask(q, k, block_q=numpy.int64(32), block_k=numpy.int32(16))
            self.assertEqual((m.block_q, m.block_k, m.Nqb, m.Nkb), (32, 16, 4, 8))


class TensorArguments(unittest.TestCase):
    @unittest.skipIf(numpy is None, "skipped: no numpy")
    def test_numpy_arrays_are_a_type_error(self):
        q, k, v = (t.numpy() for t in qkv(1, 1, 64, 64, 32))
        for fn in (sparge.sparge_attention, sparge.attention_forward):
            with self.assertRaisesRegex(TypeError, "q must be a torch.Tensor, got numpy.ndarray"):
                fn(q, k, v)
        with self.assertRaisesRegex(TypeError, "k must be a torch.Tensor, got numpy.ndarray"):
            sparge.predict_mask(torch.from_numpy(q), k)

    def test_sparse_tensors_are_a_type_error(self):
        q, k, v = qkv(1, 1, 64, 64, 32)
        sparse = q.to_sparse()
        for fn in (sparge.sparge_attention, sparge.attention_forward):
            with self.assertRaisesRegex(TypeError, "q has layout torch.sparse_coo; sparge reads strided"):
                fn(sparse, k, v)
        packed = q[0].transpose(0, 1)  # [64, 1, 32]
        with self.assertRaisesRegex(TypeError, "k has layout torch.sparse_coo"):
            sparge.sparge_attention_varlen(packed, packed.to_sparse(), packed,
                                           *[torch.tensor([0, 64], dtype=torch.int32)] * 2, 64, 64)
        with self.assertRaisesRegex(TypeError, "dense mask has layout torch.sparse_coo"):
            sparge.Mask(1, 1, 64, 64).set_dense(torch.ones(1, 1, 1, 1).to_sparse())

    def test_negated_views_are_refused(self):
        # x.conj().imag shares x's memory with torch's lazy negation bit: its values are the negatives of what
        # the memory holds, so sparge would read wrong numbers; it asks for .resolve_neg() instead
        q, k, v = qkv(1, 1, 64, 64, 32)
        neg = torch.complex(torch.zeros_like(q), q).conj().imag
        self.assertTrue(neg.is_neg())
        for fn in (sparge.sparge_attention, sparge.attention_forward):
            with self.assertRaisesRegex(ValueError, "q carries torch's lazy negation bit"):
                fn(neg, k, v)
        out = sparge.sparge_attention(neg.resolve_neg(), k, v)
        self.assertLess(rel_l2(out, sparge.sparge_attention(-q, k, v)), 1e-6)

    def test_head_counts(self):
        q = randn(1, 4, 64, 32)
        k2, k3 = randn(1, 2, 64, 32), randn(1, 3, 64, 32)
        with self.assertRaisesRegex(ValueError, "q has 4 heads but k has 2: grouped K/V heads need enable_gqa=True"):
            sparge.sparge_attention(q, k2, k2)
        for fn in (sparge.attention_forward, lambda q, k, v: sparge.sparge_attention(q, k, v, enable_gqa=True)):
            with self.assertRaisesRegex(ValueError, "q has 4 heads but k has 3, which does not divide them"):
                fn(q, k3, k3)
        with self.assertRaisesRegex(ValueError, "v's heads must match k's"):
            sparge.attention_forward(q, q, randn(1, 2, 64, 32))
        with self.assertRaisesRegex(ValueError, "q has batch 1 but k has batch 2"):
            sparge.predict_mask(q, randn(2, 4, 64, 32))
        with self.assertRaisesRegex(TypeError, "enable_gqa must be a bool"):
            sparge.sparge_attention(q, k2, k2, enable_gqa=1)

    def test_scalar_arguments(self):
        q, k, v = qkv(1, 1, 64, 64, 32)
        cases = ((dict(topk=True), TypeError, "topk must be a float, got bool"),
                 (dict(topk="0.1"), TypeError, "topk must be a float, got str"),
                 (dict(topp=float("nan")), ValueError, "topp = nan is not finite"),
                 (dict(topp=-0.1), ValueError, r"topp = -0.1 is outside \[0, 1\]"),
                 (dict(scale=float("inf")), ValueError, "scale = inf is not finite"),
                 (dict(scale=True), TypeError, "scale must be a float, got bool"),
                 (dict(scale=1e-300), ValueError, "outside float32's range .* round it to 0"),
                 (dict(scale=-1e39), ValueError, "outside float32's range .* round it to infinity"),
                 (dict(deterministic=1), TypeError, "deterministic must be a bool"),
                 (dict(return_mask="yes"), TypeError, "return_mask must be a bool"),
                 (dict(backend=3), TypeError, "backend must be a str"),
                 (dict(dropout_p="0"), TypeError, "dropout_p must be a float"))
        for kwargs, exc, message in cases:
            with self.subTest(**{key: repr(value) for key, value in kwargs.items()}):
                with self.assertRaisesRegex(exc, message):
                    sparge.sparge_attention(q, k, v, **kwargs)

    def test_mask_arguments(self):
        with self.assertRaisesRegex(ValueError, r"B = 0 is outside"):
            sparge.Mask(0, 1, 64, 64)
        with self.assertRaisesRegex(TypeError, "H must be an int, got float"):
            sparge.Mask(1, 2.0, 64, 64)
        with self.assertRaisesRegex(ValueError, r"Nq = 2147483648 is outside \[1, 2147483647\]"):
            sparge.Mask(1, 1, 2**31, 64)
        m = sparge.Mask(1, 1, 256, 128)
        with self.assertRaisesRegex(ValueError, r"row \[b=0, h=0, i=1\] keeps no block"):
            m.set_dense(torch.tensor([[[[1, 0], [0, 0]]]]))
        with self.assertRaisesRegex(ValueError, r"dense mask has shape \[1, 1, 2\], the mask needs \[1, 1, 2, 2\]"):
            m.set_dense(torch.ones(1, 1, 2))
        with self.assertRaisesRegex(TypeError, "dense mask must be a torch.Tensor"):
            m.set_dense([[1, 1], [1, 1]])
        with self.assertRaisesRegex(ValueError, r"a kept index lies outside \[0, 2\)"):
            m.set_csr(torch.tensor([[[1, 1]]]), torch.tensor([[[[0, -1], [2, -1]]]]))
        m.set_csr(torch.tensor([[[1, 2]]]), torch.tensor([[[[1, -1], [1, 0]]]]))
        self.assertTrue(torch.equal(m.dense, torch.tensor([[[[0, 1], [1, 1]]]], dtype=torch.uint8)))

    def test_outputs_handed_back(self):
        q, k, v = qkv(1, 1, 64, 64, 32)
        o, lse = sparge.attention_forward(q, k, v)
        with self.assertRaisesRegex(ValueError, "grad_out has shape"):
            sparge.attention_backward(o[:, :, :10], q, k, v, o, lse)
        with self.assertRaisesRegex(TypeError, "o is torch.float16 but q is torch.float32"):
            sparge.attention_backward(o, q, k, v, o.half(), lse)


class EmptyTensors(unittest.TestCase):
    CASES = ((0, 2, 100, 80, 32), (1, 2, 0, 80, 32), (1, 2, 100, 0, 32), (2, 0, 100, 80, 32), (1, 2, 0, 0, 32))

    def test_forward_and_gradients_are_empty_like_sdpa(self):
        for layout in ("bhnd", "bnhd"):
            for B, H, Nq, Nk, D in self.CASES:
                with self.subTest(layout=layout, B=B, H=H, Nq=Nq, Nk=Nk):
                    shape = (lambda N: (B, H, N, D)) if layout == "bhnd" else (lambda N: (B, N, H, D))
                    q, k, v = (torch.randn(*shape(n), requires_grad=True) for n in (Nq, Nk, Nk))
                    out = sparge.sparge_attention(q, k, v, layout=layout)
                    self.assertEqual(out.shape, q.shape)
                    self.assertTrue(bool((out == 0).all()))  # only Nk = 0 leaves elements: no key, zeros
                    ref, _ = dense_masked_attention(q.detach(), k.detach(), v.detach(), layout=layout)
                    self.assertTrue(torch.equal(out.detach(), ref))
                    grads = torch.autograd.grad(out.sum(), (q, k, v), allow_unused=True)
                    for t, g in zip((q, k, v), grads):
                        self.assertEqual(g.shape, t.shape)
                        self.assertEqual(float(g.abs().sum()), 0.0)
                    o, lse = sparge.attention_forward(q.detach(), k.detach(), v.detach(), layout=layout)
                    self.assertEqual(lse.shape, (B, H, Nq))
                    self.assertTrue(bool((lse == float("-inf")).all()))

    def test_return_mask_and_prediction(self):
        q = torch.randn(1, 2, 0, 32)
        k = torch.randn(1, 2, 50, 32)
        out, mask = sparge.sparge_attention(q, k, k, return_mask=True)
        self.assertEqual(out.shape, q.shape)
        self.assertIsNone(mask)
        with self.assertRaisesRegex(ValueError, "no block mask for empty tensors"):
            sparge.predict_mask(q, k)


class GivenMaskAndPredictionParameters(unittest.TestCase):
    def setUp(self):
        self.q, self.k, self.v = qkv(1, 2, 256, 256, 64, seed=41)
        self.mask = sparge.predict_mask(self.q, self.k, topk=0.5)

    def test_topk_topp_with_a_mask_are_refused(self):
        for kwargs in (dict(topk=0.5), dict(topp=0.9), dict(topk=0.03, topp=0.2)):
            with self.subTest(**kwargs):
                with self.assertRaisesRegex(ValueError, "mask= is given, so there is no prediction"):
                    sparge.sparge_attention(self.q, self.k, self.v, mask=self.mask, **kwargs)

    def test_block_sizes_must_be_the_masks(self):
        with self.assertRaisesRegex(ValueError, "block_q = 64 but the given mask has block_q = 128"):
            sparge.sparge_attention(self.q, self.k, self.v, mask=self.mask, block_q=64)
        with self.assertRaisesRegex(ValueError, "block_k = 128 but the given mask has block_k = 64"):
            sparge.sparge_attention(self.q, self.k, self.v, mask=self.mask, block_k=128)
        out = sparge.sparge_attention(self.q, self.k, self.v, mask=self.mask, block_q=128, block_k=64)
        ref, _ = sparge.attention_forward(self.q, self.k, self.v, self.mask)
        self.assertTrue(torch.equal(out, ref))


class MaskRefilledBeforeTheBackward(unittest.TestCase):
    """A Mask saved by a forward and filled again before its backward: the backward would differentiate the new
    selection, so it is refused (as torch refuses a saved tensor modified in place)."""

    def refills(self, mask):
        q, k, _ = qkv(*[mask.B, mask.H, mask.Nq, mask.Nk], 32, seed=61)
        return {"predict": lambda: mask.predict(q, k, topk=0.5, topp=0.0),
                "set_dense": lambda: mask.set_dense(torch.ones_like(mask.dense)),
                "set_csr": lambda: mask.set_csr(mask.counts, mask.indices)}

    def test_sparge_attention(self):
        q, k, v = qkv(1, 2, 128, 128, 32, seed=62, requires_grad=True)
        for name in ("predict", "set_dense", "set_csr"):
            with self.subTest(name):
                mask = sparge.predict_mask(q.detach(), k.detach(), topk=0.2, topp=0.0, block_q=32, block_k=32)
                out = sparge.sparge_attention(q, k, v, mask=mask)
                self.refills(mask)[name]()
                with self.assertRaisesRegex(RuntimeError, "filled again"):
                    out.sum().backward()
                out = sparge.sparge_attention(q, k, v, mask=mask)  # a forward after the refill is its own
                out.sum().backward()
        out, mask = sparge.sparge_attention(q, k, v, topk=0.2, topp=0.0, block_q=32, block_k=32, return_mask=True)
        self.refills(mask)["predict"]()
        with self.assertRaisesRegex(RuntimeError, "filled again"):
            out.sum().backward()

    def test_varlen(self):
        q, k, v = (randn(70, 2, 16, seed=63 + i).requires_grad_() for i in range(3))
        cu = torch.tensor([0, 40, 70], dtype=torch.int32)
        out, mask = sparge.sparge_attention_varlen(q, k, v, cu, cu, 40, 40, topk=0.3, topp=0.0, block_q=16,
                                                   block_k=16, return_mask=True)
        mask.predict(q.detach()[None], k.detach()[None], topk=1.0, topp=0.0, layout="bnhd")
        with self.assertRaisesRegex(RuntimeError, "filled again"):
            out.sum().backward()


class Float64(unittest.TestCase):
    """gradcheck needs fp64 arithmetic from input to output, which only cpu-ref can give, and only in a library
    that takes SPARGE_F64 tensors there."""

    def test_float64_is_cpu_ref_only(self):
        q, k, v = qkv(1, 1, 64, 64, 16, dtype=torch.float64)
        with self.assertRaisesRegex(TypeError, "float64, which only backend='cpu-ref' computes"):
            sparge.sparge_attention(q, k, v)
        if not sparge._lib.has_f64():
            with self.assertRaisesRegex(TypeError, "has no SPARGE_F64"):
                sparge.sparge_attention(q, k, v, backend="cpu-ref")

    @unittest.skipUnless(sparge._lib.has_f64(), "skipped: this libsparge has no SPARGE_F64 (cpu-ref fp64 tensors), "
                         "which gradcheck needs")
    def test_forward_matches_the_fp64_reference(self):
        q, k, v = qkv(2, 2, 150, 90, 16, dtype=torch.float64, seed=51)
        out, mask = sparge.sparge_attention(q, k, v, topk=0.3, topp=0.0, block_q=32, block_k=16,
                                            backend="cpu-ref", return_mask=True)
        self.assertEqual(out.dtype, torch.float64)
        self.assertLess(mask.sparsity, 1.0)
        self.assertGreater(mask.sparsity, 0.0)
        ref, _ = dense_masked_attention(q, k, v, mask.token_mask())
        self.assertLess(rel_l2(out, ref), 1e-13)

    @unittest.skipUnless(sparge._lib.has_f64(), "skipped: this libsparge has no SPARGE_F64 (cpu-ref fp64 tensors), "
                         "which gradcheck needs")
    def test_gradcheck(self):
        q, k, v = qkv(1, 2, 40, 56, 8, dtype=torch.float64, seed=61, requires_grad=True)
        mask = sparge.predict_mask(q.detach(), k.detach(), topk=0.4, topp=0.0, block_q=16, block_k=16,
                                   backend="cpu-ref")
        self.assertGreater(mask.sparsity, 0.0)

        def fn(q, k, v):
            return sparge.sparge_attention(q, k, v, mask=mask, scale=0.3)

        self.assertTrue(torch.autograd.gradcheck(fn, (q, k, v), rtol=1e-5, atol=1e-7))  # tighter than default
        bnhd = [t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v)]
        self.assertTrue(torch.autograd.gradcheck(lambda q, k, v: sparge.sparge_attention(
            q, k, v, mask=mask, layout="bnhd"), bnhd, rtol=1e-5, atol=1e-7))


if __name__ == "__main__":
    unittest.main()
