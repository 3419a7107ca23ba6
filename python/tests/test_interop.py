"""Interop on the CPU: patch_sdpa's two routes (to sparge, and unchanged to torch), FlexAttention BlockMasks
both ways (duck-typed here; the real class on torch >= 2.5), and torch.fx tracing of a wrapped call."""
import types
import unittest

import torch.fx
import torch.nn.functional as F

from helpers import dense_masked_attention, randn, rel_l2, sparge, torch

HAVE_FLEX = True
try:
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:
    HAVE_FLEX = False

sparge_attention = sparge.sparge_attention
torch.fx.wrap("sparge_attention")  # a leaf for symbolic tracing: recorded as one call, run as is


class Spy:
    """Stands in for torch's SDPA: records each call's arguments and computes the dense reference."""

    def __init__(self):
        self.calls = []

    def __call__(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        self.calls.append((query, key, value, attn_mask, dropout_p, is_causal, kwargs))
        return dense_masked_attention(query, key, value, scale=kwargs.get("scale"))[0]


class PatchSdpa(unittest.TestCase):
    def setUp(self):
        self.had = hasattr(F, "scaled_dot_product_attention")
        self.original = getattr(F, "scaled_dot_product_attention", None)
        self.spy = F.scaled_dot_product_attention = Spy()

    def tearDown(self):
        if self.had:
            F.scaled_dot_product_attention = self.original
        elif hasattr(F, "scaled_dot_product_attention"):
            del F.scaled_dot_product_attention

    def test_routes_self_and_cross_attention_to_sparge(self):
        q, k, v = randn(1, 2, 300, 32, seed=1), randn(1, 2, 300, 32, seed=2), randn(1, 2, 300, 32, seed=3)
        kc, vc = randn(1, 2, 200, 32, seed=4), randn(1, 2, 200, 32, seed=5)
        with sparge.patch_sdpa(topk=0.3, topp=0.0, block_q=64, block_k=32) as routing:
            self_out = F.scaled_dot_product_attention(q, k, v)
            cross_out = torch.nn.functional.scaled_dot_product_attention(q, kc, vc, scale=0.1)
        self.assertEqual(self.spy.calls, [])
        self.assertEqual((routing.routed, routing.passed), (2, 0))
        expected = sparge.sparge_attention(q, k, v, topk=0.3, topp=0.0, block_q=64, block_k=32)
        self.assertTrue(torch.equal(self_out, expected))
        out, mask = sparge.sparge_attention(q, kc, vc, topk=0.3, topp=0.0, block_q=64, block_k=32, scale=0.1,
                                            return_mask=True)
        self.assertTrue(torch.equal(cross_out, out))
        self.assertGreater(mask.sparsity, 0.5)
        self.assertIs(F.scaled_dot_product_attention, self.spy)

    def test_passes_every_other_call_unchanged(self):
        q, k, v = randn(1, 2, 300, 32, seed=1), randn(1, 2, 300, 32, seed=2), randn(1, 2, 300, 32, seed=3)
        short = randn(1, 2, 100, 32, seed=6)
        bool_mask = torch.ones(300, 300, dtype=torch.bool)
        long = randn(1, 2, 400, 32, seed=7)
        calls = [((q, k, v), dict(attn_mask=bool_mask)),
                 ((q, long, long), dict(is_causal=True)),  # Nq != Nk: SDPA's diagonal is top-left, sparge's not
                 ((q, k, v), dict(dropout_p=0.1)),
                 ((q.double(), k.double(), v.double()), {}),
                 ((q[0], k[0], v[0]), {}),  # 3-D
                 ((q, k[:, :1], v[:, :1]), {}),  # unequal heads without enable_gqa: torch's error to raise
                 ((q, k, v), dict(is_causal=1)),
                 ((q, k, v), dict(scale=0.0)),
                 ((q, k, v), dict(scale=float("inf"))),
                 ((q, k, v), dict(scale=float("nan"))),
                 ((q, k, v), dict(scale=1e-300)),  # 0 as sparge's float32 scale
                 ((q, short, short), {}),  # below min_tokens
                 ((q, k, v[..., :16]), {})]  # a head dim sparge does not take for v
        with sparge.patch_sdpa(min_tokens=200) as routing:
            for args, kwargs in calls:
                F.scaled_dot_product_attention(*args, **kwargs)
        self.assertEqual((routing.routed, routing.passed), (0, len(calls)))
        self.assertEqual(len(self.spy.calls), len(calls))
        for (args, kwargs), seen in zip(calls, self.spy.calls):
            for a, b in zip(args, seen[:3]):
                self.assertIs(a, b)
            self.assertIs(seen[3], kwargs.get("attn_mask"))
            self.assertEqual(seen[4:6], (kwargs.get("dropout_p", 0.0), kwargs.get("is_causal", False)))
            self.assertEqual(seen[6], {key: kwargs[key] for key in ("scale", "enable_gqa") if key in kwargs})

    def test_passes_head_dims_the_device_does_not_run(self):
        device = sparge.open_device("cpu")
        D = 8
        while True:  # the first power of two past the CPU's head-dim limit, as the library states it
            try:
                device.supports("forward", head_dim=D)
            except sparge.SpargeError:
                break
            D *= 2
        q, k, v = (randn(1, 1, 64, D, seed=s) for s in (1, 2, 3))
        with sparge.patch_sdpa() as routing:
            F.scaled_dot_product_attention(q, k, v)
        self.assertEqual((routing.routed, routing.passed), (0, 1))
        self.assertIs(self.spy.calls[0][0], q)

    def test_routes_causal_and_grouped_calls(self):
        q, k, v = randn(1, 4, 260, 32, seed=1), randn(1, 1, 260, 32, seed=2), randn(1, 1, 260, 32, seed=3)
        kw = dict(topk=0.3, topp=0.0, block_q=64, block_k=32)
        with sparge.patch_sdpa(**kw) as routing:
            causal = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            grouped = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, scale=0.2)
        self.assertEqual((routing.routed, routing.passed, self.spy.calls), (2, 0, []))
        self.assertTrue(torch.equal(causal, sparge.sparge_attention(q, k, v, is_causal=True, enable_gqa=True, **kw)))
        self.assertTrue(torch.equal(grouped, sparge.sparge_attention(q, k, v, enable_gqa=True, scale=0.2, **kw)))

    def test_restores_on_exit_and_on_error(self):
        with self.assertRaises(KeyError):
            with sparge.patch_sdpa():
                self.assertIsNot(F.scaled_dot_product_attention, self.spy)
                raise KeyError("inside")
        self.assertIs(F.scaled_dot_product_attention, self.spy)
        with sparge.patch_sdpa(topk=0.1):
            inner = F.scaled_dot_product_attention
            with sparge.patch_sdpa(topk=0.2):
                self.assertIsNot(F.scaled_dot_product_attention, inner)
            self.assertIs(F.scaled_dot_product_attention, inner)
        self.assertIs(F.scaled_dot_product_attention, self.spy)

    def test_the_innermost_block_decides(self):
        q, k, v = randn(1, 2, 300, 32, seed=1), randn(1, 2, 300, 32, seed=2), randn(1, 2, 300, 32, seed=3)
        with sparge.patch_sdpa() as outer:
            with sparge.patch_sdpa(min_tokens=1024) as inner:
                F.scaled_dot_product_attention(q, k, v)  # kept dense by the inner block
            F.scaled_dot_product_attention(q, k, v)
        self.assertEqual((inner.routed, inner.passed, outer.routed, outer.passed), (0, 1, 1, 0))
        self.assertEqual(len(self.spy.calls), 1)
        self.assertIs(self.spy.calls[0][0], q)

    def test_without_torch_sdpa(self):
        del F.scaled_dot_product_attention  # torch before 2.0
        q, k, v = randn(1, 2, 50, 16, seed=7), randn(1, 1, 60, 16, seed=8), randn(1, 1, 60, 16, seed=9)
        with sparge.patch_sdpa(min_tokens=100) as routing:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        self.assertEqual((routing.routed, routing.passed), (0, 1))
        causal = torch.ones(50, 60, dtype=torch.bool).tril().expand(1, 2, 50, 60)  # SDPA's: top-left
        ref, _ = dense_masked_attention(q.double(), k.double().expand(1, 2, 60, 16), v.double().expand(1, 2, 60, 16),
                                        causal)
        self.assertLess(rel_l2(out, ref), 1e-5)
        self.assertFalse(hasattr(F, "scaled_dot_product_attention"))

    def test_a_model_trains_through_the_patch(self):
        torch.manual_seed(0)

        class Block(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.qkv = torch.nn.Linear(64, 192)

            def forward(self, x):
                q, k, v = self.qkv(x).view(2, 260, 3, 2, 32).permute(2, 0, 3, 1, 4)
                return torch.nn.functional.scaled_dot_product_attention(q, k, v).sum()

        block, x = Block(), randn(2, 260, 64, seed=10)
        with sparge.patch_sdpa(topk=0.5, topp=0.0) as routing:
            block(x).backward()
        self.assertEqual(routing.routed, 1)
        self.assertTrue(torch.isfinite(block.qkv.weight.grad).all())
        self.assertGreater(float(block.qkv.weight.grad.abs().sum()), 0.0)

    def test_bad_parameters(self):
        with self.assertRaisesRegex(ValueError, "topk = 2.0 is outside"):
            with sparge.patch_sdpa(topk=2.0):
                pass
        with self.assertRaisesRegex(TypeError, "min_tokens must be an int"):
            with sparge.patch_sdpa(min_tokens=1.5):
                pass
        self.assertIs(F.scaled_dot_product_attention, self.spy)


def noop_mask(b, h, q_idx, kv_idx):
    return torch.ones((), dtype=torch.bool)


def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def bottom_right(off):
    """sparge's causal rule for Nk - Nq = off, as to_flex_block_mask's mask_mod states it."""
    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx + off
    return mask_mod


class FlexBlockMasks(unittest.TestCase):
    def block_mask_like(self, kv_num, kv_idx, full_num=None, full_idx=None, block=(128, 64), mask_mod=noop_mask):
        return types.SimpleNamespace(kv_num_blocks=kv_num, kv_indices=kv_idx, full_kv_num_blocks=full_num,
                                     full_kv_indices=full_idx, BLOCK_SIZE=block, mask_mod=mask_mod)

    @staticmethod
    def blocks(kept):
        """FlexAttention's counts and indices of kept blocks [..., Nkb], the kept ones first."""
        order = torch.argsort(kept.to(torch.int32), dim=-1, descending=True, stable=True)
        return kept.sum(-1, dtype=torch.int32), order.to(torch.int32)

    def test_from_flex_fields(self):
        # B=1 H=2, 2 query-block rows, 4 key blocks; partial and full blocks are united, -1 and stale tails ignored.
        kv_num = torch.tensor([[[1, 0], [2, 1]]], dtype=torch.int32)
        kv_idx = torch.tensor([[[[2, 3, 0, 1], [0, 0, 0, 0]], [[0, 3, -1, -1], [1, 2, 3, 0]]]], dtype=torch.int32)
        full_num = torch.tensor([[[1, 1], [0, 0]]], dtype=torch.int32)
        full_idx = torch.tensor([[[[0, 1, 2, 3], [3, 0, 1, 2]], [[0, 0, 0, 0], [0, 0, 0, 0]]]], dtype=torch.int32)
        mask = sparge.Mask.from_flex_block_mask(self.block_mask_like(kv_num, kv_idx, full_num, full_idx), 200, 250)
        expected = torch.tensor([[[[1, 0, 1, 0], [0, 0, 0, 1]], [[1, 0, 0, 1], [0, 1, 0, 0]]]], dtype=torch.uint8)
        self.assertEqual((mask.B, mask.H, mask.Nq, mask.Nk, mask.block_q, mask.block_k), (1, 2, 200, 250, 128, 64))
        self.assertTrue(torch.equal(mask.dense, expected))
        wide = sparge.Mask.from_flex_block_mask(self.block_mask_like(kv_num[:, 1:], kv_idx[:, 1:]), 200, 250, B=3,
                                                H=4)
        self.assertTrue(torch.equal(wide.dense, expected[:, 1:].expand(3, 4, 2, 4)))

    def test_from_flex_refusals(self):
        kv_num = torch.tensor([[[1, 1]]], dtype=torch.int32)
        kv_idx = torch.tensor([[[[0, 1], [1, 0]]]], dtype=torch.int32)
        with self.assertRaisesRegex(ValueError, "has a mask_mod"):
            sparge.Mask.from_flex_block_mask(self.block_mask_like(kv_num, kv_idx, mask_mod=causal_mask), 256, 128)
        kept = sparge.Mask.from_flex_block_mask(self.block_mask_like(kv_num, kv_idx, mask_mod=causal_mask), 256, 128,
                                                keep_partial=True)
        self.assertTrue(torch.equal(kept.dense, torch.tensor([[[[1, 0], [0, 1]]]], dtype=torch.uint8)))
        with self.assertRaisesRegex(ValueError, "keeps key blocks past Nk = 64"):
            sparge.Mask.from_flex_block_mask(self.block_mask_like(kv_num, kv_idx), 256, 64)
        with self.assertRaisesRegex(ValueError, "has 2 query-block rows; Nq = 100 in blocks of 128 needs 1"):
            sparge.Mask.from_flex_block_mask(self.block_mask_like(kv_num, kv_idx), 100, 128)
        with self.assertRaisesRegex(ValueError, r"row \[b=0, h=0, i=1\] keeps no block"):
            sparge.Mask.from_flex_block_mask(self.block_mask_like(torch.tensor([[[1, 0]]]), kv_idx), 256, 128)
        with self.assertRaisesRegex(ValueError, r"cannot broadcast to \[1, 3\]"):
            sparge.Mask.from_flex_block_mask(self.block_mask_like(kv_num.expand(1, 2, 2), kv_idx.expand(1, 2, 2, 2)),
                                             256, 128, H=3)

    def causal_block_mask_like(self, Nq, Nk, block, H=1, seed=0, mask_mod=None):
        """A causal BlockMask as FlexAttention lays one out: per head, every diagonal block and about half of the
        other blocks below it kept; those all of whose pairs attend are full, the others partial, with the
        bottom-right causal mask_mod unless another is given. Returns it, the kept blocks [1,H,Nqb,Nkb] and the
        whole blocks [Nqb,Nkb]."""
        bq, bk = block
        off, Nqb, Nkb = Nk - Nq, -(-Nq // bq), -(-Nk // bk)
        first_query = torch.arange(Nqb) * bq
        last_query = (torch.arange(1, Nqb + 1) * bq).clamp(max=Nq) - 1
        first_key = torch.arange(Nkb) * bk
        last_key = (torch.arange(1, Nkb + 1) * bk).clamp(max=Nk) - 1
        allowed = first_key[None, :] <= last_query[:, None] + off
        whole = last_key[None, :] <= first_query[:, None] + off
        diagonal = torch.zeros(Nqb, Nkb, dtype=torch.bool)
        t = torch.arange(Nq)
        diagonal[t // bq, (t + off) // bk] = True  # the blocks holding a query's last attendable key
        g = torch.Generator().manual_seed(seed)
        kept = diagonal | (allowed & (torch.rand(1, H, Nqb, Nkb, generator=g) < 0.5))
        bm = self.block_mask_like(*self.blocks(kept & ~whole), *self.blocks(kept & whole), block,
                                  mask_mod or bottom_right(off))
        return bm, kept, whole

    def test_from_flex_causal(self):
        for Nq, Nk, block in ((300, 300, (128, 64)), (200, 330, (32, 64)), (200, 330, (64, 32))):
            bm, kept, whole = self.causal_block_mask_like(Nq, Nk, block, H=2, seed=Nq + block[0])
            mask = sparge.Mask.from_flex_block_mask(bm, Nq, Nk, causal=True)
            self.assertTrue(mask.causal)
            self.assertEqual((mask.B, mask.H, mask.Nq, mask.Nk, mask.block_q, mask.block_k), (1, 2, Nq, Nk) + block)
            self.assertTrue(torch.equal(mask.dense, kept.to(torch.uint8)))
            # The token pairs FlexAttention attends: full blocks whole, partial blocks where mask_mod allows.
            t, u = torch.arange(Nq)[:, None], torch.arange(Nk)[None, :]
            blocks = kept[..., t // block[0], u // block[1]]
            flex_pairs = blocks & (whole[t // block[0], u // block[1]] | (u <= t + Nk - Nq))
            self.assertTrue(torch.equal(mask.token_mask(), flex_pairs))
            q, k, v = randn(1, 2, Nq, 32, seed=1), randn(1, 2, Nk, 32, seed=2), randn(1, 2, Nk, 32, seed=3)
            out = sparge.sparge_attention(q, k, v, is_causal=True, mask=mask)
            ref, _ = dense_masked_attention(q.double(), k.double(), v.double(), flex_pairs)
            self.assertLess(rel_l2(out, ref), 1e-5)
        # Batch and head dimensions of size 1 broadcast; the mask_mod is then evaluated for index 0.
        bm, kept, _ = self.causal_block_mask_like(200, 330, (64, 32))
        wide = sparge.Mask.from_flex_block_mask(bm, 200, 330, B=2, H=3, causal=True, backend="cpu-ref")
        self.assertTrue(torch.equal(wide.dense, kept.to(torch.uint8).expand(2, 3, -1, -1)))
        self.assertTrue(wide.causal)
        # For Nq = Nk the top-left rule is the bottom-right one.
        bm, kept, _ = self.causal_block_mask_like(300, 300, (128, 64), mask_mod=causal_mask)
        self.assertTrue(torch.equal(sparge.Mask.from_flex_block_mask(bm, 300, 300, causal=True).dense,
                                    kept.to(torch.uint8)))

    def test_from_flex_causal_refusals(self):
        def refuses(pattern, bm, Nq, Nk, **kw):
            with self.assertRaisesRegex(ValueError, pattern):
                sparge.Mask.from_flex_block_mask(bm, Nq, Nk, causal=True, **kw)

        # SDPA's top-left causal rule differs from sparge's bottom-right one when Nq < Nk.
        bm, _, _ = self.causal_block_mask_like(200, 330, (32, 64), mask_mod=causal_mask)
        refuses(r"mask_mod differs from the bottom-right causal rule kv_idx <= q_idx \+ 130 in partial block "
                r"\[b=0, h=0, i=0, j=\d+\]", bm, 200, 330)
        # Masking something else inside the partial blocks: a sliding window; on one head only.
        window = lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) & (kv_idx > q_idx - 16)  # noqa: E731
        refuses("mask_mod differs from the bottom-right causal rule", self.causal_block_mask_like(
            300, 300, (128, 64), mask_mod=window)[0], 300, 300)
        per_head = lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) & ((h == 0) | (kv_idx > q_idx - 16))  # noqa: E731
        refuses(r"partial block \[b=0, h=1, ", self.causal_block_mask_like(300, 300, (128, 64), H=2,
                                                                          mask_mod=per_head)[0], 300, 300)

        def branching(b, h, q_idx, kv_idx):
            if kv_idx <= q_idx:  # Python control flow on tensors
                return True
            return False

        refuses("mask_mod could not be evaluated", self.causal_block_mask_like(300, 300, (128, 64),
                                                                              mask_mod=branching)[0], 300, 300)
        # Full blocks must lie wholly on or below the diagonal: one on it, one above it.
        bm, kept, whole = self.causal_block_mask_like(300, 300, (128, 64))
        nothing = torch.zeros_like(kept)
        on = self.block_mask_like(*self.blocks(nothing), *self.blocks(kept), (128, 64), bottom_right(0))
        refuses(r"full block \[b=0, h=0, i=0, j=0\] holds token pairs above the causal diagonal", on, 300, 300)
        above = kept & whole
        above[0, 0, 0, 4] = True
        refuses(r"full block \[b=0, h=0, i=0, j=4\] holds", self.block_mask_like(
            bm.kv_num_blocks, bm.kv_indices, *self.blocks(above), (128, 64), bottom_right(0)), 300, 300)
        # Without a mask_mod the partial blocks are whole, which the diagonal ones are not.
        refuses(r"partial block \[b=0, h=0, i=0, j=\d\] has no mask_mod", self.block_mask_like(
            bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices, (128, 64)), 300, 300)
        # sparge's causal rules, checked on import: diagonal blocks kept, none above them.
        dropped = self.block_mask_like(*self.blocks(kept & ~whole & (torch.arange(5) != 1)), bm.full_kv_num_blocks,
                                       bm.full_kv_indices, (128, 64), bottom_right(0))
        refuses(r"not a causal sparge mask.*row \[b=0, h=0, i=0\] drops block 1", dropped, 300, 300)
        beyond = self.block_mask_like(*self.blocks(kept & ~whole | (torch.arange(5) == 4)), bm.full_kv_num_blocks,
                                      bm.full_kv_indices, (128, 64), bottom_right(0))
        refuses(r"not a causal sparge mask.*row \[b=0, h=0, i=0\] keeps block 4, which lies above", beyond,
                300, 300)
        refuses("keep_partial=True and causal=True exclude each other", bm, 300, 300, keep_partial=True)
        refuses("causal attention needs Nq <= Nk", bm, 300, 250)

    @unittest.skipUnless(HAVE_FLEX, f"skipped: torch {torch.__version__} has no FlexAttention (torch >= 2.5)")
    def test_causal_round_trip(self):
        for Nq, Nk in ((300, 300), (300, 330)):
            q, k = randn(1, 2, Nq, 64, seed=21), randn(1, 2, Nk, 64, seed=22)
            mask = sparge.predict_mask(q, k, topk=0.3, topp=0.0, causal=True)
            bm = mask.to_flex_block_mask()
            back = sparge.Mask.from_flex_block_mask(bm, Nq, Nk, causal=True)
            self.assertTrue(back.causal)
            self.assertTrue(torch.equal(back.dense, mask.dense))

    @unittest.skipUnless(HAVE_FLEX, f"skipped: torch {torch.__version__} has no FlexAttention (torch >= 2.5)")
    def test_round_trip_and_flex_attention_agree(self):
        q, k, v = randn(1, 2, 300, 64, seed=11), randn(1, 2, 330, 64, seed=12), randn(1, 2, 330, 64, seed=13)
        out, mask = sparge.sparge_attention(q, k, v, topk=0.3, topp=0.0, return_mask=True)
        bm = mask.to_flex_block_mask()
        self.assertIsInstance(bm, BlockMask)
        self.assertEqual(tuple(bm.BLOCK_SIZE), (128, 64))
        self.assertTrue(torch.equal(bm.full_kv_num_blocks, mask.counts))
        self.assertFalse(bool(bm.kv_num_blocks.any()))
        for b in range(mask.B):
            for h in range(mask.H):
                for i in range(mask.Nqb):
                    n = int(mask.counts[b, h, i])
                    self.assertTrue(torch.equal(bm.full_kv_indices[b, h, i, :n], mask.indices[b, h, i, :n]))
        self.assertTrue(torch.equal(bm.to_dense().to(torch.uint8), mask.dense))
        back = sparge.Mask.from_flex_block_mask(bm, 300, 330)
        self.assertTrue(torch.equal(back.dense, mask.dense))
        flex_out = flex_attention(q, k, v, block_mask=bm)
        self.assertLess(rel_l2(out, flex_out), 1e-5)


class FxTracing(unittest.TestCase):
    def test_symbolic_trace_keeps_the_wrapped_call(self):
        class Attend(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.proj = torch.nn.Linear(32, 96)

            def forward(self, x):
                qkv = self.proj(x).view(1, 200, 3, 2, 16)  # a proxy is indexed, not unpacked, under tracing
                return sparge_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], layout="bnhd", topk=0.5, topp=0.0,
                                        block_q=64, block_k=32)

        torch.manual_seed(0)
        module, x = Attend(), randn(1, 200, 32, seed=14)
        traced = torch.fx.symbolic_trace(module)
        targets = [node.target for node in traced.graph.nodes if node.op == "call_function"]
        self.assertIn(sparge.sparge_attention, targets)
        self.assertTrue(torch.equal(traced(x), module(x)))


if __name__ == "__main__":
    unittest.main()
