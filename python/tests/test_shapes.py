"""The shapes real models use, from Python on the CPU: grouped K/V heads (GQA, MQA), causal attention (bottom-right
aligned, Nq = Nk and Nq < Nk, dense and sparse) and packed variable-length batches (flash-attn's varlen
convention), against dense float64 torch references that share no code with sparge's: K/V heads repeated per query
head, a token-level masked softmax built from the block mask and the causal rule, each sequence run on its own.
Then gradcheck on cpu-ref in float64, the statistics, FlexAttention BlockMasks of causal masks, device options, and
bad inputs refused with clear errors before anything is written."""
import fractions
import sys
import types
import unittest

from helpers import dense_masked_attention, randn, rel_l2, sparge, torch

F32_TOL = sparge.tolerance(torch.float32)
HAVE_F64 = sparge._lib.has_f64()
NO_F64 = "skipped: this libsparge has no SPARGE_F64 (cpu-ref fp64 tensors), which gradcheck needs"


def tensors(shapes, dtype=torch.float32, seed=0, requires_grad=False):
    return [randn(*s, dtype=dtype, seed=seed + i).requires_grad_(requires_grad) for i, s in enumerate(shapes)]


def diagonal_blocks(i, nq, nk, bq, bk):
    """Key blocks holding key t + nk − nq of a query t of query block i (the causal diagonal)."""
    return {(t + nk - nq) // bk for t in range(i * bq, min((i + 1) * bq, nq))}


def token_pairs(dense, nq, nk, bq, bk, causal):
    """bool [..., nq, nk] of the pairs a block mask [..., Nqb, Nkb] keeps, cut by the causal rule u <= t + nk − nq."""
    pairs = dense.bool().repeat_interleave(bq, -2)[..., :nq, :].repeat_interleave(bk, -1)[..., :nk]
    if causal:
        t, u = torch.arange(nq)[:, None], torch.arange(nk)[None, :]
        pairs = pairs & (u <= t + nk - nq)
    return pairs


def reference(q, k, v, pairs, scale=None):
    """Dense masked softmax attention in float64 with K/V heads repeated per query head (differentiable)."""
    group = q.shape[1] // k.shape[1]
    return dense_masked_attention(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), pairs, scale)


def expect_close(test, got, want, what, tol=F32_TOL):
    test.assertEqual(tuple(got.shape), tuple(want.shape), what)
    test.assertLess(rel_l2(got, want), tol, what)


class GroupedHeads(unittest.TestCase):
    def check(self, H, Hkv, Nq, Nk, D=32, causal=False, layout="bhnd"):
        B = 2
        shape = (lambda h, n: (B, h, n, D)) if layout == "bhnd" else (lambda h, n: (B, n, h, D))
        q, k, v = tensors([shape(H, Nq), shape(Hkv, Nk), shape(Hkv, Nk)], seed=H + Hkv, requires_grad=True)
        out, mask = sparge.sparge_attention(q, k, v, is_causal=causal, enable_gqa=True, topk=0.3, topp=0.2,
                                            block_q=64, block_k=32, layout=layout, return_mask=True)
        self.assertEqual((mask.H, mask.causal), (H, causal))
        self.assertGreater(mask.sparsity, 0.0)
        # The prediction reads K/V head h / (H/Hkv): the same mask as with K repeated per query head.
        rep = [t.detach().repeat_interleave(H // Hkv, 1 if layout == "bhnd" else 2) for t in (k, v)]
        same = sparge.predict_mask(q.detach(), rep[0], topk=0.3, topp=0.2, block_q=64, block_k=32, layout=layout,
                                   causal=causal)
        self.assertTrue(torch.equal(mask.dense, same.dense))
        bhnd = [(t if layout == "bhnd" else t.transpose(1, 2)).detach().double().requires_grad_() for t in (q, k, v)]
        ref, _ = reference(*bhnd, token_pairs(mask.dense, Nq, Nk, 64, 32, causal))
        got = out if layout == "bhnd" else out.transpose(1, 2)
        expect_close(self, got, ref, "O")
        d_out = randn(*got.shape, seed=7)
        grads = torch.autograd.grad(got, (q, k, v), d_out)
        ref_grads = torch.autograd.grad(ref, bhnd, d_out.double())
        for name, g, r in zip("qkv", grads, ref_grads):
            expect_close(self, g if layout == "bhnd" else g.transpose(1, 2), r, f"d{name}")  # dk, dv: K's heads

    def test_gqa_8_2(self):
        self.check(8, 2, 200, 200)

    def test_mqa(self):
        self.check(6, 1, 150, 230, layout="bnhd")

    def test_gqa_causal_nq_lt_nk(self):
        self.check(4, 2, 130, 200, causal=True)

    def test_heads_must_divide(self):
        q, k = tensors([(1, 8, 64, 16), (1, 3, 64, 16)])
        for call in (lambda: sparge.sparge_attention(q, k, k, enable_gqa=True), lambda: sparge.predict_mask(q, k),
                     lambda: sparge.attention_forward(q, k, k)):
            with self.assertRaisesRegex(ValueError, "q has 8 heads but k has 3, which does not divide them"):
                call()
        k2 = k[:, :2]
        with self.assertRaisesRegex(ValueError, "grouped K/V heads need enable_gqa=True"):
            sparge.sparge_attention(q, k2, k2)
        with self.assertRaisesRegex(ValueError, "v's heads must match k's"):
            sparge.sparge_attention(q, k2, k[:, :1], enable_gqa=True)


class Causal(unittest.TestCase):
    def check_sparse(self, Nq, Nk, bq, bk, topk, topp):
        q, k, v = tensors([(1, 3, Nq, 32), (1, 3, Nk, 32), (1, 3, Nk, 32)], seed=Nq, requires_grad=True)
        out, mask = sparge.sparge_attention(q, k, v, is_causal=True, topk=topk, topp=topp, block_q=bq, block_k=bk,
                                            return_mask=True)
        dense = mask.dense
        for i in range(mask.Nqb):
            diag = diagonal_blocks(i, Nq, Nk, bq, bk)
            kept = set(torch.nonzero(dense[0, :, i].any(0)).flatten().tolist())
            self.assertTrue(bool(dense[0, :, i, sorted(diag)].all()), f"row {i} drops a diagonal block")
            self.assertLessEqual(max(kept), max(diag), f"row {i} keeps a block above the diagonal")
        self.assertTrue(bool((dense.sum(-1) < dense.shape[-1]).any()), "the mask should drop blocks")
        pairs = token_pairs(dense, Nq, Nk, bq, bk, True)
        self.assertTrue(torch.equal(mask.token_mask(), pairs))
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref, ref_lse = reference(q64, k64, v64, pairs)
        expect_close(self, out, ref, "O")
        d_out = randn(*out.shape, seed=9)
        for name, g, r in zip("qkv", torch.autograd.grad(out, (q, k, v), d_out),
                              torch.autograd.grad(ref, (q64, k64, v64), d_out.double())):
            expect_close(self, g, r, f"d{name}")
        _, lse = sparge.attention_forward(q.detach(), k.detach(), v.detach(), mask)
        expect_close(self, lse, ref_lse, "LSE")

    def test_sparse_square(self):
        self.check_sparse(300, 300, 64, 32, 0.2, 0.3)

    def test_sparse_nq_lt_nk(self):
        self.check_sparse(170, 333, 64, 64, 0.25, 0.0)

    def test_sparse_blocks_wider_on_keys(self):
        self.check_sparse(200, 260, 32, 64, 0.2, 0.2)

    def test_dense(self):
        for Nq, Nk in ((150, 150), (90, 170)):
            with self.subTest(Nq=Nq, Nk=Nk):
                q, k, v = tensors([(2, 2, Nq, 16), (2, 1, Nk, 16), (2, 1, Nk, 16)], seed=3, requires_grad=True)
                t, u = torch.arange(Nq)[:, None], torch.arange(Nk)[None, :]
                q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
                ref, ref_lse = reference(q64, k64, v64, u <= t + Nk - Nq)
                out, lse = sparge.attention_forward(q, k, v, causal=True)
                expect_close(self, out, ref, "O")
                expect_close(self, lse, ref_lse, "LSE")
                d_out = randn(*out.shape, seed=4)
                grads = sparge.attention_backward(d_out, q.detach(), k.detach(), v.detach(), out, lse, causal=True)
                for name, g, r in zip("qkv", grads, torch.autograd.grad(ref, (q64, k64, v64), d_out.double())):
                    expect_close(self, g, r, f"d{name}")
                # Keeping every block, the sparse path computes the same causal attention.
                full = sparge.sparge_attention(q, k, v, is_causal=True, enable_gqa=True, topk=1.0, topp=0.0,
                                               block_q=32, block_k=32)
                expect_close(self, full, ref, "O, every block kept")

    def test_sdpa_agrees_where_the_diagonals_coincide(self):
        sdpa = getattr(torch.nn.functional, "scaled_dot_product_attention", None)
        if sdpa is None:
            self.skipTest(f"skipped: torch {torch.__version__} has no scaled_dot_product_attention")
        q, k, v = tensors([(1, 2, 128, 32)] * 3, seed=5)
        expect_close(self, sparge.sparge_attention(q, k, v, is_causal=True, topk=1.0, topp=0.0), sdpa(q, k, v,
                                                                                                 is_causal=True), "O")

    def test_given_mask_must_agree(self):
        q, k, v = tensors([(1, 2, 128, 16)] * 3, seed=6)
        causal = sparge.predict_mask(q, k, topk=0.5, block_q=32, block_k=32, causal=True)
        plain = sparge.predict_mask(q, k, topk=0.5, block_q=32, block_k=32)
        with self.assertRaisesRegex(ValueError, "the given mask is causal but is_causal=False"):
            sparge.sparge_attention(q, k, v, mask=causal)
        with self.assertRaisesRegex(ValueError, "the given mask is not causal but is_causal=True"):
            sparge.sparge_attention(q, k, v, mask=plain, is_causal=True)
        with self.assertRaisesRegex(ValueError, r"causal=True but the mask was not created causal"):
            sparge.attention_forward(q, k, v, plain, causal=True)
        out = sparge.sparge_attention(q, k, v, mask=causal, is_causal=True)
        self.assertTrue(torch.equal(out, sparge.attention_forward(q, k, v, causal)[0]))

    def test_nq_gt_nk_refused(self):
        q, k = tensors([(1, 1, 100, 16), (1, 1, 60, 16)])
        for call in (lambda: sparge.sparge_attention(q, k, k, is_causal=True),
                     lambda: sparge.attention_forward(q, k, k, causal=True),
                     lambda: sparge.predict_mask(q, k, causal=True),
                     lambda: sparge.Mask(1, 1, 100, 60, causal=True)):
            with self.assertRaisesRegex(ValueError, r"causal attention needs Nq <= Nk .* got Nq = 100, Nk = 60"):
                call()

    def test_set_dense_keeps_the_diagonal(self):
        mask = sparge.Mask(1, 1, 64, 64, 32, 32, causal=True).set_dense(torch.tensor([[[[1, 0], [0, 1]]]]))
        for bad in ([[1, 1], [0, 1]], [[1, 0], [1, 0]]):  # above the diagonal; a diagonal block dropped
            with self.assertRaisesRegex(sparge.SpargeError, "diagonal"):
                mask.set_dense(torch.tensor([[bad]]))
            self.assertTrue(torch.equal(mask.dense, torch.tensor([[[[1, 0], [0, 1]]]], dtype=torch.uint8)))

    def test_statistics_count_attendable_pairs(self):
        Nq, Nk, bq, bk = 100, 160, 32, 16
        q, k = tensors([(2, 2, Nq, 16), (2, 2, Nk, 16)], seed=8)
        mask = sparge.predict_mask(q, k, topk=0.3, topp=0.0, block_q=bq, block_k=bk, causal=True)
        st = mask.stats()
        allowed = sum(max(diagonal_blocks(i, Nq, Nk, bq, bk)) + 1 for i in range(mask.Nqb)) * 4
        self.assertEqual(st.total_blocks, allowed)
        self.assertEqual(st.kept_blocks, int(mask.dense.sum()))
        self.assertAlmostEqual(st.sparsity, 1 - st.kept_blocks / allowed, places=12)
        t, u = torch.arange(Nq)[:, None], torch.arange(Nk)[None, :]
        attendable = float((u <= t + Nk - Nq).sum()) * 4
        self.assertAlmostEqual(st.token_density, float(mask.token_mask().sum()) / attendable, places=12)
        self.assertTrue(torch.allclose(st.sequence_sparsity, st.head_sparsity.mean(1)))


def ragged(H, Hkv, lq, lk, D=32, seed=0):
    cu = [torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32) for lengths in (lq, lk)]
    q, k, v = tensors([(sum(lq), H, D), (sum(lk), Hkv, D), (sum(lk), Hkv, D)], seed=seed, requires_grad=True)
    return q, k, v, cu[0], cu[1]


class Varlen(unittest.TestCase):
    KW = dict(topk=0.2, topp=0.3, block_q=64, block_k=32)

    def check(self, H, Hkv, lq, lk, causal):
        q, k, v, cu_q, cu_k = ragged(H, Hkv, lq, lk, seed=len(lq) + causal)
        out, mask = sparge.sparge_attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal,
                                                   return_mask=True, **self.KW)
        self.assertEqual(tuple(out.shape), tuple(q.shape))
        self.assertEqual((mask.B, mask.max_seqlen_q, mask.max_seqlen_k, mask.varlen), (len(lq), max(lq), max(lk),
                                                                                       True))
        d_out = randn(*out.shape, seed=11)
        grads = torch.autograd.grad(out, (q, k, v), d_out)
        dense, st = mask.dense, mask.stats()
        self.assertEqual(tuple(st.head_sparsity.shape), (len(lq), H))
        for b, (nq, nk) in enumerate(zip(lq, lk)):
            with self.subTest(sequence=b):
                sq, sk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
                # Each sequence alone, [1, n, H, D]: its prediction is the packed mask's rows for it...
                qb, kb, vb = (t.detach()[s][None].requires_grad_() for t, s in ((q, sq), (k, sk), (v, sk)))
                alone, own = sparge.sparge_attention(qb, kb, vb, is_causal=causal, enable_gqa=True, layout="bnhd",
                                                     return_mask=True, **self.KW)
                self.assertTrue(torch.equal(dense[b, :, :own.Nqb, :own.Nkb], own.dense[0]))
                self.assertFalse(bool(dense[b, :, own.Nqb:].any()) or bool(dense[b, :, :, own.Nkb:].any()))
                # ... and its output and gradients are the packed ones.
                expect_close(self, out[sq], alone[0], "O")
                for name, g, t in zip("qkv", grads, (qb, kb, vb)):
                    s = sq if name == "q" else sk
                    expect_close(self, g[s], torch.autograd.grad(alone, t, d_out[sq][None], retain_graph=True)[0][0],
                                 f"d{name}")
                self.assertAlmostEqual(float(st.sequence_sparsity[b]), own.stats().sparsity, places=12)
                # And against the float64 reference of this sequence.
                q64, k64, v64 = (t.double().transpose(1, 2) for t in (qb, kb, vb))
                ref, _ = reference(q64, k64, v64, token_pairs(own.dense, nq, nk, 64, 32, causal))
                expect_close(self, out[sq], ref[0].transpose(0, 1), "O against float64")

    def test_four_ragged_sequences(self):
        self.check(2, 2, [300, 77, 129, 64], [300, 77, 129, 64], causal=False)

    def test_causal_gqa(self):
        self.check(4, 2, [200, 33, 129, 64], [260, 33, 190, 100], causal=True)

    def test_cross_lengths_mqa(self):
        self.check(3, 1, [100, 250, 64, 7], [140, 90, 64, 300], causal=False)

    def test_empty_sequences(self):
        # Padding entries, as flash-attn takes them: sequences with keys but no queries, and one without any token,
        # first, between and last. The batch equals its two other sequences alone; the keys no query attends get
        # zero gradients, and an empty sequence counts in no statistic (its sparsity is 0).
        lq, lk = [0, 70, 0, 50, 0], [30, 90, 20, 60, 0]
        q, k, v, cu_q, cu_k = ragged(4, 2, lq, lk, seed=13)
        out, mask = sparge.sparge_attention_varlen(q, k, v, cu_q, cu_k, 70, 90, causal=True, return_mask=True,
                                                   **self.KW)
        self.assertEqual(mask.B, 5)
        real = torch.cat([torch.arange(30, 120), torch.arange(140, 200)])  # the keys of sequences 1 and 3
        k2, v2 = (t.detach()[real].requires_grad_() for t in (k, v))
        q2 = q.detach().requires_grad_()
        cu_q2, cu_k2 = (torch.tensor(c, dtype=torch.int32) for c in ([0, 70, 120], [0, 90, 150]))
        out2, mask2 = sparge.sparge_attention_varlen(q2, k2, v2, cu_q2, cu_k2, 70, 90, causal=True, return_mask=True,
                                                     **self.KW)
        expect_close(self, out, out2, "O")
        self.assertTrue(torch.equal(mask.dense[[1, 3]], mask2.dense))
        self.assertFalse(bool(mask.dense[[0, 2, 4]].any()))
        st, st2 = mask.stats(), mask2.stats()
        self.assertEqual((st.kept_blocks, st.total_blocks, st.sparsity, st.token_density),
                         (st2.kept_blocks, st2.total_blocks, st2.sparsity, st2.token_density))
        self.assertTrue(torch.equal(st.head_sparsity[[1, 3]], st2.head_sparsity))
        self.assertTrue(torch.equal(st.head_sparsity[[0, 2, 4]], torch.zeros(3, 4, dtype=torch.float64)))
        self.assertEqual(st.sequence_sparsity[[0, 2, 4]].tolist(), [0.0, 0.0, 0.0])
        d_out = randn(*out.shape, seed=17)
        for deterministic in (False, True):
            with self.subTest(deterministic=deterministic):
                out, out2 = (sparge.sparge_attention_varlen(*args, 70, 90, causal=True, mask=m,
                                                             deterministic=deterministic)
                             for args, m in (((q, k, v, cu_q, cu_k), mask), ((q2, k2, v2, cu_q2, cu_k2), mask2)))
                dq, dk, dv = torch.autograd.grad(out, (q, k, v), d_out)
                dq2, dk2, dv2 = torch.autograd.grad(out2, (q2, k2, v2), d_out)
                expect_close(self, dq, dq2, "dq")
                for name, g, g2 in (("dk", dk, dk2), ("dv", dv, dv2)):
                    expect_close(self, g[real], g2, name)
                    others = torch.ones(len(k), dtype=torch.bool)
                    others[real] = False
                    self.assertTrue(torch.equal(g[others], torch.zeros_like(g[others])), name)
        # The mask of these offsets takes the selection back; its empty rows refuse a kept block.
        copy = sparge.Mask.from_dense(mask.dense, 120, 200, 64, 32, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        self.assertTrue(torch.equal(copy.dense, mask.dense))
        bad = mask.dense.clone()
        bad[2, 0, 0, 0] = 1
        with self.assertRaisesRegex(sparge.SpargeError, "past its sequence"):
            copy.set_dense(bad)
        self.assertTrue(torch.equal(copy.dense, mask.dense))

    def test_no_queries_at_all(self):
        # Every sequence without queries: zeros (an empty O) and zero gradients, without a mask.
        q, k, v, cu_q, cu_k = ragged(2, 1, [0, 0], [20, 30], seed=19)
        out, mask = sparge.sparge_attention_varlen(q, k, v, cu_q, cu_k, 0, 30, return_mask=True)
        self.assertEqual((tuple(out.shape), mask), ((0, 2, 32), None))
        for g in torch.autograd.grad(out, (k, v), torch.empty_like(out)):
            self.assertTrue(torch.equal(g, torch.zeros_like(g)))

    def test_queries_without_keys_refused(self):
        q, k, v, cu_q, cu_k = ragged(2, 2, [40, 30], [40, 30])
        no_keys = torch.tensor([0, 0, 70], dtype=torch.int32)  # sequence 0: 40 queries, no key
        for causal in (False, True):
            with self.subTest(causal=causal):
                with self.assertRaisesRegex(ValueError, r"sequence 0 has 40 query and 0 key tokens"):
                    sparge.sparge_attention_varlen(q, k, v, cu_q, no_keys, 40, 70, causal=causal)
                with self.assertRaisesRegex(ValueError, r"sequence 0 has 40 query and 0 key tokens"):
                    sparge.Mask(2, 2, 70, 70, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=no_keys)
        self.assertIsNone(q.grad)

    def test_given_mask(self):
        q, k, v, cu_q, cu_k = ragged(2, 1, [70, 50], [70, 80], seed=3)
        out, mask = sparge.sparge_attention_varlen(q, k, v, cu_q, cu_k, 70, 80, causal=True, return_mask=True,
                                                   **self.KW)
        again = sparge.sparge_attention_varlen(q, k, v, cu_q, cu_k, 70, 80, causal=True, mask=mask)
        self.assertTrue(torch.equal(out, again))
        copy = sparge.Mask.from_dense(mask.dense, 120, 150, 64, 32, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        self.assertTrue(torch.equal(out, sparge.sparge_attention_varlen(q, k, v, cu_q, cu_k, 70, 80, causal=True,
                                                                        mask=copy)))
        with self.assertRaisesRegex(ValueError, "given mask is causal but causal=False"):
            sparge.sparge_attention_varlen(q, k, v, cu_q, cu_k, 70, 80, mask=mask)
        other = torch.tensor([0, 60, 120], dtype=torch.int32)
        with self.assertRaisesRegex(ValueError, "not made for these cu_seqlens"):
            sparge.sparge_attention_varlen(q, k, v, other, cu_k, 70, 80, causal=True, mask=mask)
        with self.assertRaisesRegex(ValueError, "use sparge_attention_varlen"):
            sparge.sparge_attention(q[None], k[None], v[None], mask=mask, is_causal=True, layout="bnhd",
                                    enable_gqa=True)
        with self.assertRaisesRegex(ValueError, "no block"):
            mask.set_dense(torch.zeros_like(mask.dense))

    def test_dropout_zero_of_any_real_type(self):
        q, k, v, cu_q, cu_k = ragged(2, 2, [40, 30], [40, 30])
        expected = sparge.sparge_attention_varlen(q, k, v, cu_q, cu_k, 40, 40)
        for zero in (0, 0.0, fractions.Fraction(0)):  # any numbers.Real, as sparge_attention takes dropout_p
            with self.subTest(zero=type(zero).__name__):
                out = sparge.sparge_attention_varlen(q, k, v, cu_q, cu_k, 40, 40, zero)
                self.assertTrue(torch.equal(out, expected))

    def test_mask_keeps_its_own_offsets(self):
        q, k, v, cu_q, cu_k = ragged(2, 2, [40, 30], [40, 30])
        cu = cu_q.clone()
        out, mask = sparge.sparge_attention_varlen(q, k, v, cu, cu, 40, 40, return_mask=True)
        cu[1] = 50  # the caller's buffer, refilled for the next batch
        mask.cu_seqlens_k[1] = 50  # and what the mask hands out
        self.assertTrue(torch.equal(mask.cu_seqlens_q, cu_q))
        self.assertTrue(torch.equal(mask.cu_seqlens_k, cu_k))
        with self.assertRaisesRegex(ValueError, "not made for these cu_seqlens"):
            sparge.sparge_attention_varlen(q, k, v, cu, cu, 50, 50, mask=mask)
        self.assertTrue(torch.equal(sparge.sparge_attention_varlen(q, k, v, cu_q, cu_k, 40, 40, mask=mask), out))

    def test_cu_seqlens_refused(self):
        q, k, v, cu_q, cu_k = ragged(2, 2, [40, 30], [40, 30])
        before = [t.detach().clone() for t in (q, k, v)]
        bad = {
            "must not decrease": torch.tensor([0, 40, 30, 70], dtype=torch.int32),
            r"cu_seqlens_q\[0\] = 5, must be 0": torch.tensor([5, 40, 70], dtype=torch.int32),
            r"cu_seqlens_q\[-1\] = 60 but q holds 70 tokens": torch.tensor([0, 40, 60], dtype=torch.int32),
            "must be torch.int32": torch.tensor([0, 40, 70]),
            "must be 1-D": torch.tensor([[0, 40, 70]], dtype=torch.int32),
            "B\\+1 >= 2 entries": torch.tensor([0], dtype=torch.int32),
        }
        for message, cu in bad.items():
            with self.subTest(message):
                with self.assertRaisesRegex((ValueError, TypeError), message):
                    sparge.sparge_attention_varlen(q, k, v, cu, cu_k, 40, 40)
        with self.assertRaisesRegex(TypeError, "cu_seqlens_k must be a torch.Tensor"):
            sparge.sparge_attention_varlen(q, k, v, cu_q, [0, 40, 70], 40, 40)
        with self.assertRaisesRegex(ValueError, "cu_seqlens_q has 3 entries and cu_seqlens_k 4"):
            sparge.sparge_attention_varlen(q, k, v, cu_q, torch.tensor([0, 20, 40, 70], dtype=torch.int32), 40, 40)
        with self.assertRaisesRegex(ValueError, "max_seqlen_q = 39 but a sequence holds 40 tokens"):
            sparge.sparge_attention_varlen(q, k, v, cu_q, cu_k, 39, 40)
        with self.assertRaisesRegex(TypeError, "max_seqlen_k must be an int"):
            sparge.sparge_attention_varlen(q, k, v, cu_q, cu_k, 40, 40.0)
        short = torch.tensor([0, 30, 70], dtype=torch.int32)
        with self.assertRaisesRegex(ValueError, r"needs Nq <= Nk in every sequence \(sequence 0\)"):
            sparge.sparge_attention_varlen(q, k, v, cu_q, short, 40, 40, causal=True)
        with self.assertRaisesRegex(ValueError, "must be 3-D"):
            sparge.sparge_attention_varlen(q[None], k, v, cu_q, cu_k, 40, 40)
        with self.assertRaisesRegex(ValueError, "which does not divide them"):
            sparge.sparge_attention_varlen(q.repeat(1, 3, 1)[:, :3], k, v, cu_q, cu_k, 40, 40)
        with self.assertRaisesRegex(NotImplementedError, "dropout_p"):
            sparge.sparge_attention_varlen(q, k, v, cu_q, cu_k, 40, 40, 0.1)
        with self.assertRaisesRegex(TypeError, "dropout_p must be a float"):
            sparge.sparge_attention_varlen(q, k, v, cu_q, cu_k, 40, 40, False)
        for t, b in zip((q, k, v), before):
            self.assertTrue(torch.equal(t.detach(), b))
            self.assertIsNone(t.grad)


@unittest.skipUnless(HAVE_F64, NO_F64)
class Gradcheck(unittest.TestCase):
    def test_causal_gqa(self):
        q, k, v = tensors([(1, 4, 24, 8), (1, 2, 40, 8), (1, 2, 40, 8)], dtype=torch.float64, seed=21,
                          requires_grad=True)
        mask = sparge.predict_mask(q.detach(), k.detach(), topk=0.4, topp=0.0, block_q=8, block_k=8,
                                   backend="cpu-ref", causal=True)
        self.assertGreater(mask.sparsity, 0.0)
        self.assertTrue(torch.autograd.gradcheck(lambda q, k, v: sparge.sparge_attention(
            q, k, v, mask=mask, is_causal=True, enable_gqa=True, scale=0.4), (q, k, v), rtol=1e-5, atol=1e-7))
        # Every allowed block kept, predicted inside: the selection cannot change under the perturbations.
        self.assertTrue(torch.autograd.gradcheck(lambda q, k, v: sparge.sparge_attention(
            q, k, v, is_causal=True, enable_gqa=True, topk=1.0, topp=0.0, block_q=8, block_k=8, backend="cpu-ref"),
            (q, k, v), rtol=1e-5, atol=1e-7))

    def test_varlen(self):
        q, k, v, cu_q, cu_k = ragged(2, 1, [20, 9, 16], [20, 30, 16], D=8, seed=22)
        q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
        _, mask = sparge.sparge_attention_varlen(q, k, v, cu_q, cu_k, 20, 30, causal=True, topk=0.5, topp=0.0,
                                                 block_q=8, block_k=8, backend="cpu-ref", return_mask=True)
        self.assertTrue(torch.autograd.gradcheck(lambda q, k, v: sparge.sparge_attention_varlen(
            q, k, v, cu_q, cu_k, 20, 30, causal=True, mask=mask), (q, k, v), rtol=1e-5, atol=1e-7))


class Empty(unittest.TestCase):
    def test_grouped_and_causal_empty_inputs(self):
        for B, Nq, Nk in ((0, 50, 60), (1, 0, 60), (1, 0, 0)):
            with self.subTest(B=B, Nq=Nq, Nk=Nk):
                q = torch.randn(B, 4, Nq, 16, requires_grad=True)
                k, v = (torch.randn(B, 2, Nk, 16, requires_grad=True) for _ in range(2))
                out, mask = sparge.sparge_attention(q, k, v, is_causal=True, enable_gqa=True, return_mask=True)
                self.assertEqual(out.shape, q.shape)
                self.assertIsNone(mask)
                for t, g in zip((q, k, v), torch.autograd.grad(out.sum(), (q, k, v), allow_unused=True)):
                    self.assertEqual(g.shape, t.shape)
        with self.assertRaisesRegex(ValueError, "needs Nq <= Nk"):
            sparge.sparge_attention(torch.randn(1, 2, 5, 8), torch.randn(1, 2, 0, 8), torch.randn(1, 2, 0, 8),
                                    is_causal=True)

    def test_varlen_without_heads_or_head_dim(self):
        cu = torch.tensor([0, 30, 50], dtype=torch.int32)
        for H, D in ((0, 16), (2, 0)):
            with self.subTest(H=H, D=D):
                q, k, v = (torch.randn(50, H, D, requires_grad=True) for _ in range(3))
                out, mask = sparge.sparge_attention_varlen(q, k, v, cu, cu, 30, 30, causal=True, return_mask=True)
                self.assertEqual(out.shape, q.shape)
                self.assertIsNone(mask)
                for t, g in zip((q, k, v), torch.autograd.grad(out.sum(), (q, k, v))):
                    self.assertEqual(g.shape, t.shape)


class FlexBlockMask(unittest.TestCase):
    """to_flex_block_mask: full blocks where every pair attends, partial (causal diagonal) blocks, and a mask_mod that
    is the token mask. On torch < 2.5 a stand-in BlockMask records what sparge hands to from_kv_blocks."""

    def block_mask(self, mask):
        try:
            from torch.nn.attention.flex_attention import BlockMask  # noqa: F401
            return mask.to_flex_block_mask(), True
        except ImportError:
            pass

        class Recorder:
            @classmethod
            def from_kv_blocks(cls, kv_num_blocks, kv_indices, full_kv_num_blocks=None, full_kv_indices=None,
                               BLOCK_SIZE=128, mask_mod=None, seq_lengths=None):
                return types.SimpleNamespace(kv_num_blocks=kv_num_blocks, kv_indices=kv_indices,
                                             full_kv_num_blocks=full_kv_num_blocks, full_kv_indices=full_kv_indices,
                                             BLOCK_SIZE=BLOCK_SIZE, mask_mod=mask_mod, seq_lengths=seq_lengths)

        names = ("torch.nn.attention", "torch.nn.attention.flex_attention")
        saved = {n: sys.modules.get(n) for n in names}
        flex = types.ModuleType(names[1])
        flex.BlockMask = Recorder
        sys.modules[names[0]], sys.modules[names[1]] = types.ModuleType(names[0]), flex
        try:
            return mask.to_flex_block_mask(), False
        finally:
            for n, m in saved.items():
                if m is None:
                    del sys.modules[n]
                else:
                    sys.modules[n] = m

    def test_blocks_and_mask_mod(self):
        Nq, Nk, bq, bk = 150, 230, 32, 16
        q, k, v = tensors([(1, 2, Nq, 16), (1, 2, Nk, 16), (1, 2, Nk, 16)], seed=30)
        for causal in (True, False):
            out, mask = sparge.sparge_attention(q, k, v, is_causal=causal, topk=0.3, topp=0.0, block_q=bq,
                                                block_k=bk, return_mask=True)
            bm, real = self.block_mask(mask)

            def dense_of(num, idx):
                d = torch.zeros(mask.B, mask.H, mask.Nqb, mask.Nkb, dtype=torch.bool)
                for b, h, i in torch.nonzero(num >= 0).tolist():
                    d[b, h, i, idx[b, h, i, :num[b, h, i]].long()] = True
                return d

            partial, full = dense_of(bm.kv_num_blocks, bm.kv_indices), dense_of(bm.full_kv_num_blocks,
                                                                               bm.full_kv_indices)
            self.assertFalse(bool((partial & full).any()))
            self.assertTrue(torch.equal(partial | full, mask.dense.bool()))
            self.assertTrue(bool(full.any()) and bool(partial.any()) == causal)
            # The mask_mod is the token mask itself: eager flex_attention reads it and not the block lists.
            t, u = torch.arange(Nq)[:, None], torch.arange(Nk)[None, :]
            tokens = mask.token_mask()
            for h in range(mask.H):
                self.assertTrue(torch.equal(bm.mask_mod(0, h, t, u), tokens[0, h]))
            padded = bm.mask_mod(0, 0, torch.arange(Nq + bq)[:, None], torch.arange(Nk + bk)[None, :])
            self.assertEqual(tuple(padded.shape), (Nq + bq, Nk + bk))  # padded indices stay in range
            allowed = u <= t + Nk - Nq if causal else torch.ones(Nq, Nk, dtype=torch.bool)
            for b, h, i, j in torch.nonzero(partial | full).tolist():
                block = allowed[i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
                self.assertEqual(bool(block.all()), bool(full[b, h, i, j]), f"block ({i}, {j})")
            self.assertEqual(tuple(bm.BLOCK_SIZE), (bq, bk))
            if real:
                from torch.nn.attention.flex_attention import flex_attention

                self.assertLess(rel_l2(flex_attention(q, k, v, block_mask=bm), out), 1e-5)

    def test_varlen_refused(self):
        _, _, _, cu_q, cu_k = ragged(1, 1, [40, 30], [40, 30])
        mask = sparge.Mask(2, 1, 70, 70, 32, 32, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        with self.assertRaisesRegex(ValueError, "no packed sequences"):
            mask.to_flex_block_mask()


class DeviceOptions(unittest.TestCase):
    def test_options_and_supports(self):
        dev = sparge.open_device("cpu")
        options = dev.options()
        self.assertIn("strict", options)
        self.assertEqual(options["strict"]["values"][0], "auto")
        self.assertEqual(dev.get_option("strict"), options["strict"]["value"])
        with self.assertRaisesRegex(sparge.SpargeError, "SPARGE_ERR_INVALID"):
            dev.set_option("strict", "sometimes")
        self.assertEqual(dev.get_option("strict"), options["strict"]["value"])
        self.assertEqual(dev.supports("forward", head_dim=64, block_q=128, block_k=64, H=8, kv_heads=2, causal=True,
                                      Nq=300, Nk=300), "cpu")
        self.assertEqual(sparge.open_device("cpu-ref").supports("backward", dtype=torch.float64, varlen=True,
                                                                Nq=100, Nk=100), "cpu-ref")
        with self.assertRaisesRegex(sparge.SpargeError, "SPARGE_ERR_UNSUPPORTED.*cpu-ref only"):
            dev.supports("forward", dtype=torch.float64)
        with self.assertRaisesRegex(ValueError, "op must be one of"):
            dev.supports("attend")

    def test_supports_checks_its_sizes(self):
        dev = sparge.open_device("cpu")
        # Values that a C integer would wrap to a supported call, or that describe no call at all.
        bad = ((dict(head_dim=2**64 + 64), ValueError), (dict(head_dim=-1), ValueError), (dict(head_dim=0), ValueError),
               (dict(block_q=2**32 + 64, block_k=64), ValueError), (dict(Nq=0), ValueError),
               (dict(kv_heads=-2), ValueError), (dict(head_dim=64.0), TypeError), (dict(causal=2), TypeError))
        for kwargs, error in bad:
            with self.subTest(**kwargs):
                with self.assertRaises(error):
                    dev.supports("forward", **kwargs)


if __name__ == "__main__":
    unittest.main()
