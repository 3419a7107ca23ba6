"""CPU tests of the python layer: forward and backward against torch autograd on the equivalent dense
masked attention, layouts and strides without copies, mask views, and error propagation."""
import gc
import math
import unittest

from helpers import dense_masked_attention, randn, rel_l2, sparge, to_bhnd, torch

F32_TOL = sparge.tolerance(torch.float32)


def qkv(B, H, Nq, Nk, D, dtype=torch.float32, layout="bhnd", seed=0, requires_grad=False):
    shape = (lambda N: (B, H, N, D)) if layout == "bhnd" else (lambda N: (B, N, H, D))
    ts = [randn(*shape(n), dtype=dtype, seed=seed + i) for i, n in enumerate((Nq, Nk, Nk))]
    return [t.requires_grad_(requires_grad) for t in ts]


class ForwardBackward(unittest.TestCase):
    def check_against_autograd(self, B, H, Nq, Nk, D, layout, topk=0.1, topp=0.3, scale=None):
        q, k, v = qkv(B, H, Nq, Nk, D, layout=layout, requires_grad=True)
        out, mask = sparge.sparge_attention(q, k, v, topk=topk, topp=topp, scale=scale, layout=layout,
                                            return_mask=True)
        self.assertEqual(out.shape, q.shape)
        self.assertLess(mask.sparsity, 1.0)
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref, ref_lse = dense_masked_attention(q64, k64, v64, mask.token_mask(), scale, layout)
        self.assertLess(rel_l2(out, ref), F32_TOL)
        d_out = randn(*out.shape, seed=99)
        grads = torch.autograd.grad(out, (q, k, v), d_out)
        ref_grads = torch.autograd.grad(ref, (q64, k64, v64), d_out.double())
        for name, g, r in zip("qkv", grads, ref_grads):
            self.assertEqual(g.shape, r.shape)
            self.assertLess(rel_l2(g, r), F32_TOL, f"d{name}")
        _, lse = sparge.attention_forward(q.detach(), k.detach(), v.detach(), mask, scale=scale, layout=layout)
        self.assertLess(rel_l2(lse, ref_lse), F32_TOL)

    def test_bhnd_partial_blocks_nq_ne_nk(self):
        self.check_against_autograd(2, 3, 300, 200, 64, "bhnd")

    def test_bnhd(self):
        self.check_against_autograd(1, 4, 260, 390, 32, "bnhd")

    def test_explicit_scale(self):
        self.check_against_autograd(1, 2, 256, 256, 64, "bhnd", topk=0.2, topp=0.0, scale=0.05)

    def test_dense_forward_without_mask(self):
        q, k, v = qkv(2, 2, 150, 170, 48)
        out, lse = sparge.attention_forward(q, k, v)
        ref, ref_lse = dense_masked_attention(q.double(), k.double(), v.double())
        self.assertLess(rel_l2(out, ref), F32_TOL)
        self.assertLess(rel_l2(lse, ref_lse), F32_TOL)

    def test_half_dtypes(self):
        for dtype, tol in ((torch.bfloat16, 1e-2), (torch.float16, 3e-3)):
            q, k, v = qkv(1, 2, 200, 200, 64, dtype=dtype, requires_grad=True)
            out, mask = sparge.sparge_attention(q, k, v, topk=0.2, return_mask=True)
            self.assertEqual(out.dtype, dtype)
            q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
            ref, _ = dense_masked_attention(q64, k64, v64, mask.token_mask())
            self.assertLess(rel_l2(out, ref), tol, dtype)
            d_out = randn(*out.shape, seed=5)
            grads = torch.autograd.grad(out, (q, k, v), d_out.to(dtype))
            ref_grads = torch.autograd.grad(ref, (q64, k64, v64), d_out.to(dtype).double())
            for name, g, r in zip("qkv", grads, ref_grads):
                self.assertLess(rel_l2(g, r), tol, f"d{name} {dtype}")

    def test_loss_backward_through_module(self):
        torch.manual_seed(0)
        proj = torch.nn.Linear(64, 3 * 64)
        x = randn(2, 200, 64, seed=3)
        q, k, v = proj(x).view(2, 200, 3, 1, 64).unbind(2)  # [B,N,H,D] views of one buffer
        out = sparge.sparge_attention(q, k, v, layout="bnhd")
        out.sum().backward()  # an expanded (stride 0) gradient reaches the backward
        self.assertTrue(torch.isfinite(proj.weight.grad).all())
        self.assertGreater(float(proj.weight.grad.abs().sum()), 0.0)

    def test_given_mask_is_used_as_is(self):
        q, k, v = qkv(1, 2, 256, 320, 64, requires_grad=True)
        dense = torch.zeros(1, 2, 2, 5, dtype=torch.uint8)
        dense[..., 0] = 1
        dense[0, 1, 1, 3] = 1
        mask = sparge.Mask.from_dense(dense, 256, 320)
        out = sparge.sparge_attention(q, k, v, mask=mask, block_q=128, block_k=64)  # the mask's own blocks
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref, _ = dense_masked_attention(q64, k64, v64, mask.token_mask())
        self.assertLess(rel_l2(out, ref), F32_TOL)
        d_out = randn(*out.shape, seed=4)
        for g, r in zip(torch.autograd.grad(out, (q, k, v), d_out),
                        torch.autograd.grad(ref, (q64, k64, v64), d_out.double())):
            self.assertLess(rel_l2(g, r), F32_TOL)

    def test_cpu_ref_backend_agrees(self):
        q, k, v = qkv(1, 2, 300, 300, 64)
        mask = sparge.predict_mask(q, k, topk=0.1)
        out, _ = sparge.attention_forward(q, k, v, mask)
        mask_ref = sparge.predict_mask(q, k, topk=0.1, backend="cpu-ref")
        self.assertEqual(mask_ref.device.name, "cpu-ref")
        self.assertTrue(torch.equal(mask.dense, mask_ref.dense))
        out_ref, _ = sparge.attention_forward(q, k, v, mask_ref, backend="cpu-ref")
        self.assertLess(rel_l2(out, out_ref), F32_TOL)

    def test_deterministic_backward(self):
        q, k, v = qkv(1, 2, 256, 256, 64)
        mask = sparge.predict_mask(q, k)
        o, lse = sparge.attention_forward(q, k, v, mask)
        d_o = randn(*o.shape, seed=7)
        a = sparge.attention_backward(d_o, q, k, v, o, lse, mask, deterministic=True)
        b = sparge.attention_backward(d_o, q, k, v, o, lse, mask, deterministic=True)
        for x, y in zip(a, b):
            self.assertTrue(torch.equal(x, y))


class StridesWithoutCopies(unittest.TestCase):
    def test_views_pass_the_tensor_memory(self):
        from sparge import _torch

        packed = randn(2, 300, 3, 4, 64)  # [B,N,(q,k,v),H,D], as a fused QKV projection gives
        q = packed[:, :, 0]
        self.assertFalse(q.is_contiguous())
        t = _torch.view(q, "bnhd", "q")
        self.assertEqual(t.data, q.data_ptr())
        self.assertEqual(list(t.shape), [2, 4, 300, 64])
        self.assertEqual(list(t.stride), [300 * 3 * 4 * 64, 64, 3 * 4 * 64, 1])

    def test_packed_bnhd_equals_contiguous_bhnd(self):
        packed = randn(2, 300, 3, 4, 64)
        q, k, v = packed.unbind(2)
        out, mask = sparge.sparge_attention(q, k, v, layout="bnhd", topk=0.1, return_mask=True)
        self.assertEqual(out.shape, q.shape)
        qc, kc, vc = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        out_c, mask_c = sparge.sparge_attention(qc, kc, vc, topk=0.1, return_mask=True)
        self.assertTrue(torch.equal(mask.dense, mask_c.dense))
        self.assertLess(rel_l2(to_bhnd(out, "bnhd"), out_c), 1e-6)

    def test_transposed_d_stride(self):
        q, k, v = qkv(1, 2, 130, 130, 32)
        k_strided = k.transpose(-1, -2).contiguous().transpose(-1, -2)  # D is the slow dimension
        self.assertNotEqual(k_strided.stride(-1), 1)
        out, _ = sparge.attention_forward(q, k_strided, v)
        ref, _ = sparge.attention_forward(q, k, v)
        self.assertLess(rel_l2(out, ref), 1e-6)


class MaskViews(unittest.TestCase):
    def setUp(self):
        self.B, self.H, self.Nq, self.Nk, self.D = 2, 3, 700, 520, 64
        self.q, self.k, _ = qkv(self.B, self.H, self.Nq, self.Nk, self.D, seed=11)
        self.mask = sparge.predict_mask(self.q, self.k, topk=0.1, topp=0.3)

    def test_shape(self):
        m = self.mask
        self.assertEqual((m.B, m.H, m.Nq, m.Nk, m.block_q, m.block_k), (2, 3, 700, 520, 128, 64))
        self.assertEqual((m.Nqb, m.Nkb), (6, 9))

    def test_csr_and_transpose_match_dense(self):
        m = self.mask
        dense, counts, indices = m.dense, m.counts, m.indices
        t_counts, t_indices = m.t_counts, m.t_indices
        self.assertEqual(dense.dtype, torch.uint8)
        self.assertTrue(torch.equal(counts, dense.sum(-1, dtype=torch.int32)))
        self.assertTrue(torch.equal(t_counts, dense.sum(2, dtype=torch.int32)))
        for b in range(m.B):
            for h in range(m.H):
                for i in range(m.Nqb):
                    kept = torch.nonzero(dense[b, h, i]).flatten().to(torch.int32)
                    n = int(counts[b, h, i])
                    self.assertTrue(torch.equal(indices[b, h, i, :n], kept))
                    self.assertTrue(bool((indices[b, h, i, n:] == -1).all()))
                for j in range(m.Nkb):
                    kept = torch.nonzero(dense[b, h, :, j]).flatten().to(torch.int32)
                    n = int(t_counts[b, h, j])
                    self.assertTrue(torch.equal(t_indices[b, h, j, :n], kept))
                    self.assertTrue(bool((t_indices[b, h, j, n:] == -1).all()))

    def test_pooled_map_and_hybrid_selection(self):
        m = self.mask
        pad_q, pad_k = m.Nqb * 128 - m.Nq, m.Nkb * 64 - m.Nk

        def pool(x, block, pad, nb):
            x = torch.nn.functional.pad(x.double(), (0, 0, 0, pad))
            sums = x.view(m.B, m.H, nb, block, self.D).sum(3)
            sizes = torch.full((nb,), float(block), dtype=torch.float64)
            sizes[-1] = block - pad
            return sums / sizes[:, None]

        qbar, kbar = pool(self.q, 128, pad_q, m.Nqb), pool(self.k, 64, pad_k, m.Nkb)
        ref_map = torch.softmax(qbar @ kbar.transpose(-1, -2) / math.sqrt(self.D), dim=-1)
        self.assertLess(rel_l2(m.pooled_map, ref_map), F32_TOL)
        # DESIGN §1: keep the first max(n_k, n_p) blocks in descending order (ties: lower index first).
        n_k = max(1, math.floor(0.1 * m.Nkb + 1e-6))
        order = torch.sort(ref_map, dim=-1, descending=True, stable=True)
        cumulative = order.values.cumsum(-1)
        n_p = (cumulative < 0.3).sum(-1) + 1
        keep = torch.clamp(torch.maximum(n_p, torch.tensor(n_k)), max=m.Nkb)
        expected = torch.zeros_like(ref_map, dtype=torch.uint8)
        ranks = torch.arange(m.Nkb).expand_as(ref_map)
        expected.scatter_(-1, order.indices, (ranks < keep[..., None]).to(torch.uint8))
        self.assertTrue(torch.equal(m.dense, expected))

    def test_stats(self):
        m = self.mask
        st, dense = m.stats(), m.dense.double()
        self.assertEqual(st.total_blocks, dense.numel())
        self.assertEqual(st.kept_blocks, int(dense.sum()))
        self.assertAlmostEqual(st.sparsity, 1.0 - float(dense.mean()), places=12)
        self.assertAlmostEqual(m.sparsity, st.sparsity, places=12)
        self.assertAlmostEqual(st.token_density, float(m.token_mask().double().mean()), places=12)
        self.assertTrue(torch.allclose(st.head_sparsity, 1.0 - dense.mean((2, 3)), atol=1e-12))
        self.assertEqual(st.row_mass.shape, (m.B, m.H, m.Nqb))
        self.assertAlmostEqual(st.mean_row_mass, float(st.row_mass.double().mean()), places=6)
        kept_mass = (m.pooled_map.double() * dense).sum(-1)
        self.assertLess(rel_l2(st.row_mass, kept_mass), F32_TOL)
        counts = dense.sum(-1)
        self.assertEqual((st.min_row_blocks, st.max_row_blocks), (int(counts.min()), int(counts.max())))

    def test_from_dense_round_trip(self):
        dense = self.mask.dense
        imported = sparge.Mask.from_dense(dense, self.Nq, self.Nk)
        self.assertTrue(torch.equal(imported.dense, dense))
        self.assertTrue(math.isnan(imported.stats().mean_row_mass))
        _, _, v = qkv(self.B, self.H, self.Nq, self.Nk, self.D, seed=11)
        a, _ = sparge.attention_forward(self.q, self.k, v, self.mask)
        b, _ = sparge.attention_forward(self.q, self.k, v, imported)
        self.assertTrue(torch.equal(a, b))

    def test_released_mask_is_reused_and_refilled(self):
        q, k, v = qkv(1, 2, 256, 256, 64, seed=21)
        gc.collect()
        gc.disable()  # no other mask of these shapes may reach the pool in between
        try:
            first = sparge.predict_mask(q, k, topk=0.5)
            handle = first.handle.value
            del first
            second = sparge.predict_mask(q, k, topk=0.25)
        finally:
            gc.enable()
        self.assertEqual(second.handle.value, handle)
        self.assertEqual(second.stats().kept_blocks, 2 * 2 * 1)  # 1 of 4 key blocks in each of 2x2 rows
        sparge.free_cached_masks()


class Errors(unittest.TestCase):
    def assertSpargeError(self, status_name, fragment, fn, *args, **kwargs):
        with self.assertRaises(sparge.SpargeError) as cm:
            fn(*args, **kwargs)
        self.assertEqual(cm.exception.status_name, status_name)
        self.assertIn(fragment, str(cm.exception))
        return cm.exception

    def test_library_failure_carries_sparge_message(self):
        # Sizes Python accepts one by one whose product the library refuses.
        e = self.assertSpargeError("SPARGE_ERR_OVERFLOW", "B*H*Nqb*Nkb overflows", sparge.Mask, 2**40, 2**20,
                                   2**31 - 1, 2**31 - 1, 1, 1)
        self.assertEqual(e.function, "sparge_mask_create_ex")

    def test_shape_mismatch(self):
        q, _, _ = qkv(1, 2, 128, 128, 64)
        k, v = randn(1, 2, 128, 32), randn(1, 2, 128, 32)
        with self.assertRaisesRegex(ValueError, "q has head dim 64 but k has 32"):
            sparge.attention_forward(q, k, v)
        with self.assertRaisesRegex(ValueError, r"v is \[1, 2, 100, 64\] but k is \[1, 2, 128, 64\] \(v's tokens"):
            sparge.attention_forward(q, q, randn(1, 2, 100, 64))

    def test_dtype_mismatch(self):
        q, k, v = qkv(1, 1, 64, 64, 32)
        with self.assertRaisesRegex(TypeError, "v is torch.float16 but q is torch.float32"):
            sparge.attention_forward(q, k, v.half())

    def test_bad_mask_parameters(self):
        q, k, v = qkv(1, 1, 128, 128, 32)
        with self.assertRaisesRegex(ValueError, r"topk = 1.5 is outside \[0, 1\]"):
            sparge.sparge_attention(q, k, v, topk=1.5)
        with self.assertRaisesRegex(ValueError, "topk = topp = 0 selects nothing"):
            sparge.predict_mask(q, k, topk=0, topp=0)

    def test_mask_for_other_shapes(self):
        q, k, v = qkv(1, 1, 256, 256, 32)
        mask = sparge.predict_mask(q, k)
        q2, k2, v2 = qkv(1, 1, 512, 256, 32)
        with self.assertRaisesRegex(ValueError, "the mask was made for B=1 H=1 Nq=256 Nk=256"):
            sparge.attention_forward(q2, k2, v2, mask)

    def test_python_side_checks(self):
        q, k, v = qkv(1, 1, 64, 64, 32)
        with self.assertRaisesRegex(ValueError, "must be 4-D"):
            sparge.attention_forward(q[0], k[0], v[0])
        with self.assertRaisesRegex(TypeError, "float64, which only backend='cpu-ref' computes"):
            sparge.attention_forward(q.double(), k.double(), v.double())
        with self.assertRaisesRegex(TypeError, "float32, float16 and bfloat16"):
            sparge.attention_forward(q.int(), k.int(), v.int())
        with self.assertRaisesRegex(ValueError, "layout must be"):
            sparge.sparge_attention(q, k, v, layout="bshd")
        with self.assertRaisesRegex(NotImplementedError, "attn_mask"):
            sparge.sparge_attention(q, k, v, torch.ones(64, 64, dtype=torch.bool))
        with self.assertRaisesRegex(TypeError, "is_causal must be a bool"):
            sparge.sparge_attention(q, k, v, None, 0.0, 1)
        with self.assertRaisesRegex(ValueError, "scale = 0"):
            sparge.sparge_attention(q, k, v, scale=0.0)
        _, lse = sparge.attention_forward(q, k, v)
        with self.assertRaisesRegex(ValueError, "lse must be"):
            sparge.attention_backward(q, q, k, v, q, lse[:, :, :10])

    def test_unknown_backend(self):
        q, k, v = qkv(1, 1, 64, 64, 32)
        with self.assertRaisesRegex(ValueError, "unknown backend 'nope'"):
            sparge.attention_forward(q, k, v, backend="nope")
        with self.assertRaisesRegex(ValueError, "backend 'cuda' needs CUDA tensors"):
            sparge.attention_forward(q, k, v, backend="cuda")

    @unittest.skipIf("cuda-generic" in sparge.backends(), "skipped: this library has the cuda-generic backend")
    def test_backend_not_compiled_in(self):
        with self.assertRaisesRegex(ValueError, "backend 'cuda-generic' is not compiled into"):
            sparge.open_device("cuda-generic:0", torch.device("cpu"))

    def test_tensors_on_different_devices(self):
        q, k, v = qkv(1, 1, 64, 64, 32)
        mask = sparge.predict_mask(q, k)
        with self.assertRaisesRegex(ValueError, "mask is on cpu but q is on meta"):
            sparge.attention_forward(q.to("meta"), k.to("meta"), v.to("meta"), mask)
        with self.assertRaisesRegex(ValueError, "k is on meta but q is on cpu"):
            sparge.attention_forward(q, k.to("meta"), v)


if __name__ == "__main__":
    unittest.main()
