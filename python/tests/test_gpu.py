"""GPU tests of the python layer (skipped without CUDA): bf16/fp16 forward and gradients against torch
autograd on the equivalent dense masked attention, grouped K/V heads with causal masks, packed variable-length
batches with cu_seqlens on the GPU, BNHD views, stream ordering, masks against the CPU's."""
import unittest

from helpers import dense_masked_attention, randn, rel_l2, sparge, torch

HAVE_CUDA = torch.cuda.is_available() and "cuda" in sparge.backends() and sparge.backend_device_count("cuda") > 0
TOL = {dt: sparge.tolerance(dt) for dt in (torch.bfloat16, torch.float16)}  # relative L2 against fp64


def qkv(B, H, Nq, Nk, D, dtype, layout, seed=0):
    shape = (lambda N: (B, H, N, D)) if layout == "bhnd" else (lambda N: (B, N, H, D))
    return [randn(*shape(n), dtype=dtype, device="cuda", seed=seed + i).requires_grad_()
            for i, n in enumerate((Nq, Nk, Nk))]


@unittest.skipUnless(HAVE_CUDA, "skipped: no CUDA device (or libsparge built without CUDA)")
class Gradients(unittest.TestCase):
    def check(self, B, H, Nq, Nk, D, dtype, layout, topk=0.1, topp=0.3):
        q, k, v = qkv(B, H, Nq, Nk, D, dtype, layout)
        out, mask = sparge.sparge_attention(q, k, v, topk=topk, topp=topp, layout=layout, return_mask=True)
        self.assertEqual((out.shape, out.dtype, out.device), (q.shape, dtype, q.device))
        self.assertEqual(mask.device.name, f"cuda:{q.device.index}")
        sparsity = mask.sparsity
        q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref, _ = dense_masked_attention(q64, k64, v64, mask.token_mask(), layout=layout)
        what = f"{dtype} {layout} B={B} H={H} Nq={Nq} Nk={Nk} D={D} sparsity={sparsity:.3f}"
        err = rel_l2(out, ref)
        self.assertLess(err, TOL[dtype], f"O {what}")
        d_out = randn(*out.shape, dtype=dtype, device="cuda", seed=42)
        grads = torch.autograd.grad(out, (q, k, v), d_out)
        ref_grads = torch.autograd.grad(ref, (q64, k64, v64), d_out.double())
        errs = [rel_l2(g, r) for g, r in zip(grads, ref_grads)]
        for name, e in zip("qkv", errs):
            self.assertLess(e, TOL[dtype], f"d{name} {what}")
        print(f"\n  {what}: rel L2 O {err:.2e} dQ {errs[0]:.2e} dK {errs[1]:.2e} dV {errs[2]:.2e}", end="")

    def test_bf16_bhnd_d128(self):
        self.check(2, 3, 1000, 777, 128, torch.bfloat16, "bhnd")

    def test_bf16_bnhd_d64(self):
        self.check(1, 4, 640, 1100, 64, torch.bfloat16, "bnhd")

    def test_fp16_bhnd_d64(self):
        self.check(2, 2, 512, 512, 64, torch.float16, "bhnd", topk=0.05, topp=0.0)

    def test_bf16_dense_rows(self):
        self.check(1, 2, 384, 384, 128, torch.bfloat16, "bhnd", topk=1.0, topp=0.0)

    def test_packed_qkv_projection(self):
        torch.manual_seed(0)
        proj = torch.nn.Linear(256, 3 * 256, device="cuda", dtype=torch.bfloat16)
        x = randn(2, 700, 256, dtype=torch.bfloat16, device="cuda", seed=3)
        q, k, v = proj(x).view(2, 700, 3, 2, 128).unbind(2)  # [B,N,H,D] strided views of one buffer
        out = sparge.sparge_attention(q, k, v, layout="bnhd")
        out.float().square().mean().backward()
        self.assertTrue(torch.isfinite(proj.weight.grad).all())

    def test_deterministic_backward_is_bitwise(self):
        q, k, v = (t.detach() for t in qkv(1, 2, 1024, 1024, 128, torch.bfloat16, "bhnd"))
        mask = sparge.predict_mask(q, k)
        o, lse = sparge.attention_forward(q, k, v, mask)
        d_o = randn(*o.shape, dtype=torch.bfloat16, device="cuda", seed=8)
        a = sparge.attention_backward(d_o, q, k, v, o, lse, mask, deterministic=True)
        b = sparge.attention_backward(d_o, q, k, v, o, lse, mask, deterministic=True)
        for x, y in zip(a, b):
            self.assertTrue(torch.equal(x, y))


@unittest.skipUnless(HAVE_CUDA, "skipped: no CUDA device (or libsparge built without CUDA)")
class Shapes(unittest.TestCase):
    def test_gqa_causal_bf16(self):
        g = torch.Generator().manual_seed(12)
        q, k, v = (torch.randn(1, n, h, 128, generator=g).to("cuda", torch.bfloat16).requires_grad_()
                   for n, h in ((900, 8), (1300, 2), (1300, 2)))
        out, mask = sparge.sparge_attention(q, k, v, is_causal=True, enable_gqa=True, layout="bnhd", topk=0.1,
                                            return_mask=True)
        q64, k64, v64 = (t.detach().double().transpose(1, 2).requires_grad_() for t in (q, k, v))
        ref, _ = dense_masked_attention(q64, k64.repeat_interleave(4, 1), v64.repeat_interleave(4, 1),
                                        mask.token_mask())
        self.assertLess(rel_l2(out.transpose(1, 2), ref), TOL[torch.bfloat16])
        d_out = randn(*out.shape, dtype=torch.bfloat16, device="cuda", seed=13)
        grads = torch.autograd.grad(out, (q, k, v), d_out)
        for name, gr, r in zip("qkv", grads, torch.autograd.grad(ref, (q64, k64, v64), d_out.double().transpose(1, 2))):
            self.assertLess(rel_l2(gr.transpose(1, 2), r), TOL[torch.bfloat16], f"d{name}")

    def test_varlen_equals_each_sequence(self):
        lengths = [700, 129, 1000, 64]
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        g = torch.Generator().manual_seed(14)
        q, k, v = (torch.randn(sum(lengths), h, 64, generator=g).to("cuda", torch.bfloat16) for h in (4, 1, 1))
        out, mask = sparge.sparge_attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=True,
                                                   topk=0.2, return_mask=True)
        self.assertEqual(mask.torch_device, q.device)
        for b in range(len(lengths)):
            s = slice(int(cu[b]), int(cu[b + 1]))
            alone, own = sparge.sparge_attention(q[s][None], k[s][None], v[s][None], is_causal=True, enable_gqa=True,
                                                 layout="bnhd", topk=0.2, return_mask=True)
            self.assertTrue(torch.equal(mask.dense[b, :, :own.Nqb, :own.Nkb], own.dense[0]))
            self.assertLess(rel_l2(out[s], alone[0]), TOL[torch.bfloat16], f"sequence {b}")

    def test_varlen_empty_sequences(self):
        # Sequences with keys but no queries and one without any token, first, between and last: the GPU's O and
        # gradients on the CPU's mask are the CPU's, the keys no query attends get zero gradients, and the GPU's own
        # prediction keeps nothing in the empty sequences' rows.
        lq, lk = [0, 700, 0, 129, 0], [64, 1000, 0, 129, 40]
        cu_q, cu_k = (torch.tensor([0] + torch.tensor(n).cumsum(0).tolist(), dtype=torch.int32) for n in (lq, lk))
        Tq, Tk = sum(lq), sum(lk)
        g = torch.Generator().manual_seed(15)
        q, k, v = (torch.randn(n, h, 64, generator=g).to(torch.bfloat16) for n, h in ((Tq, 4), (Tk, 1), (Tk, 1)))
        d_out = torch.randn(Tq, 4, 64, generator=g).to(torch.bfloat16)
        cpu = [t.clone().requires_grad_() for t in (q, k, v)]
        out, mask = sparge.sparge_attention_varlen(*cpu, cu_q, cu_k, 700, 1000, causal=True, topk=0.2,
                                                   return_mask=True)
        grads = torch.autograd.grad(out, cpu, d_out)
        gpu = [t.to("cuda").requires_grad_() for t in (q, k, v)]
        own = sparge.sparge_attention_varlen(*gpu, cu_q, cu_k, 700, 1000, causal=True, topk=0.2, return_mask=True)[1]
        self.assertFalse(bool(own.dense[[0, 2, 4]].any()))
        given = sparge.Mask.from_dense(mask.dense, Tq, Tk, causal=True, device="cuda", cu_seqlens_q=cu_q,
                                       cu_seqlens_k=cu_k)
        out_gpu = sparge.sparge_attention_varlen(*gpu, cu_q, cu_k, 700, 1000, causal=True, mask=given)
        self.assertLess(rel_l2(out_gpu.cpu(), out), TOL[torch.bfloat16], "O")
        alone = torch.zeros(Tk, dtype=torch.bool, device="cuda")  # the keys of the sequences without queries
        for b, nq in enumerate(lq):
            alone[int(cu_k[b]):int(cu_k[b + 1])] = nq == 0
        for name, got, want in zip("qkv", torch.autograd.grad(out_gpu, gpu, d_out.to("cuda")), grads):
            self.assertLess(rel_l2(got.cpu(), want), TOL[torch.bfloat16], f"d{name}")
            if name != "q":
                self.assertFalse(bool(got[alone].any()), f"d{name} of keys no query attends")


@unittest.skipUnless(HAVE_CUDA, "skipped: no CUDA device (or libsparge built without CUDA)")
class StreamsAndMasks(unittest.TestCase):
    def test_work_is_ordered_on_the_current_stream(self):
        side = torch.cuda.Stream()
        base = [t.detach() for t in qkv(2, 4, 2048, 2048, 128, torch.bfloat16, "bhnd")]
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            # Slow producers on the side stream: sparge must wait for them without a host synchronize.
            big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
            for _ in range(4):
                big = big @ big * 1e-2
            q, k, v = (t * 1.0 + big[0, 0] * 0 for t in base)
            out, mask = sparge.sparge_attention(q, k, v, return_mask=True)
            result = out.clone()
        torch.cuda.synchronize()
        expected, _ = sparge.attention_forward(*base, mask)
        self.assertTrue(torch.equal(result, expected))

    def test_gpu_mask_matches_cpu_mask(self):
        q, k, _ = (t.detach() for t in qkv(2, 3, 4096, 4096, 128, torch.bfloat16, "bhnd", seed=5))
        gpu = sparge.predict_mask(q, k).dense.cpu()
        cpu = sparge.predict_mask(q.cpu(), k.cpu()).dense
        differing = int((gpu != cpu).any(-1).sum())
        rows = gpu.shape[0] * gpu.shape[1] * gpu.shape[2]
        # Rows may differ only where two deciding pooled scores tie within rounding (docs/DESIGN.md §2.2).
        self.assertLessEqual(differing, rows // 100, f"{differing} of {rows} rows differ")

    def test_views_are_on_the_gpu(self):
        q, k, _ = (t.detach() for t in qkv(1, 2, 1024, 1024, 64, torch.bfloat16, "bhnd"))
        mask = sparge.predict_mask(q, k)
        for view in (mask.counts, mask.indices, mask.t_counts, mask.t_indices, mask.dense, mask.pooled_map):
            self.assertEqual(view.device, q.device)
        self.assertTrue(torch.equal(mask.counts, mask.dense.sum(-1, dtype=torch.int32)))


if __name__ == "__main__":
    unittest.main()
