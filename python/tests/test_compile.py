"""sparge's torch.library custom ops (torch >= 2.4): opcheck, torch.compile(fullgraph=True) of a Wan-style DiT
block on the CPU and on CUDA against eager (forward and gradients), no graph breaks in torch._dynamo.explain,
dynamic shapes, CUDA graph capture (by hand and through mode="reduce-overhead"), make_fx and torch.jit.trace.
On older torch the module checks that sparge says why the ops are absent and that eager still runs."""
import importlib.util
import os
import unittest

from helpers import rel_l2, sparge, torch

OPS = sparge.custom_ops_available()
REASON = sparge.custom_ops_reason()
SKIP_OPS = f"skipped: {REASON}" if REASON else ""
HAVE_CUDA = torch.cuda.is_available() and "cuda" in sparge.backends() and sparge.backend_device_count("cuda") > 0


def load_dit_bench():
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples", "dit_bench.py")
    spec = importlib.util.spec_from_file_location("dit_bench", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dense_attention(q, k, v):
    """Dense attention on [B,N,H,D], spelled out (the cross-attention of the test block)."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    s = (q.float() @ k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    return (torch.softmax(s, dim=-1) @ v.float()).to(q.dtype).transpose(1, 2)


def sparse_attention(q, k, v):
    return sparge.sparge_attention(q, k, v, layout="bnhd", topk=0.25, topp=0.1, block_q=64, block_k=32)


def make_block(device, dtype, dim=128, heads=2, grid=(4, 8, 10), text=24, seed=0):
    """A small Wan2.1 block calling sparge_attention for its self-attention, and its inputs."""
    bench = load_dit_bench()
    torch.manual_seed(seed)
    block = bench.WanBlock(dim, heads, 2 * dim, sparse_attention, dense_attention).to(device=device, dtype=dtype)
    N = grid[0] * grid[1] * grid[2]
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(1, N, dim, generator=g).to(device=device, dtype=dtype)
    context = torch.randn(1, text, dim, generator=g).to(device=device, dtype=dtype)
    t_emb = (0.1 * torch.randn(1, 6, dim, generator=g)).to(device=device, dtype=dtype)
    cos, sin = bench.rope_tables(grid, dim // heads, device)
    return block, (x, context, t_emb, cos, sin)


class WithoutCustomOps(unittest.TestCase):
    @unittest.skipIf(OPS, "skipped: the custom ops are registered on this torch")
    def test_reason_and_eager_fallback(self):
        self.assertIn(torch.__version__, REASON)
        self.assertIn(">= 2.4", REASON)
        self.assertIn("autograd.Function", REASON)
        block, args = make_block("cpu", torch.float32)
        out = block(*args)
        out.float().square().mean().backward()
        self.assertTrue(torch.isfinite(block.q.weight.grad).all())


@unittest.skipUnless(OPS, SKIP_OPS)
class CustomOps(unittest.TestCase):
    def test_registered_with_schemas(self):
        for name in ("attention", "attention_backward", "predict_mask"):
            self.assertTrue(hasattr(torch.ops.sparge, name), name)
            self.assertIn("bool causal)", str(getattr(torch.ops.sparge, name).default._schema), name)
        schema = str(torch.ops.sparge.attention.default._schema)
        self.assertIn("sparge::attention(Tensor q, Tensor k, Tensor v, float topk", schema)

    def test_opcheck(self):
        g = torch.Generator().manual_seed(3)
        # Plain, and causal with grouped K/V heads (Nq <= Nk).
        for Hkv, Nq, causal in ((2, 150, False), (1, 110, True)):
            q = torch.randn(1, 2, Nq, 32, generator=g)
            k, v = (torch.randn(1, Hkv, 130, 32, generator=g) for _ in range(2))
            params = (0.3, 0.1, 64, 32, None, "bhnd", None)
            for t in (q, k, v):
                t.requires_grad_()
            torch.library.opcheck(torch.ops.sparge.attention.default, (q, k, v, *params, False, causal))
            torch.library.opcheck(torch.ops.sparge.predict_mask.default, (q.detach(), k.detach(), *params, causal))
            out, lse = torch.ops.sparge.attention(q, k, v, *params, False, causal)
            grad = torch.randn(out.shape, generator=g)
            torch.library.opcheck(torch.ops.sparge.attention_backward.default,
                                  (grad, q.detach(), k.detach(), v.detach(), out.detach(), lse, *params, False,
                                   causal))

    def test_eager_op_matches_the_function_path(self):
        # Bitwise comparisons need the deterministic backward: the default one may sum dQ in whatever order the
        # threads of a many-core CPU reach it.
        g = torch.Generator().manual_seed(4)
        q, k, v = (torch.randn(2, 3, n, 64, generator=g).requires_grad_() for n in (300, 260, 260))
        out = sparge.sparge_attention(q, k, v, topk=0.2, deterministic=True)  # the op
        # the autograd.Function
        ref, mask = sparge.sparge_attention(q, k, v, topk=0.2, deterministic=True, return_mask=True)
        self.assertTrue(torch.equal(out, ref))
        d_out = torch.randn(out.shape, generator=g)
        for a, b in zip(torch.autograd.grad(out, (q, k, v), d_out), torch.autograd.grad(ref, (q, k, v), d_out)):
            self.assertTrue(torch.equal(a, b))
        counts, indices = sparge.predict_mask_csr(q.detach(), k.detach(), topk=0.2)
        self.assertTrue(torch.equal(counts, mask.counts))
        self.assertTrue(torch.equal(indices, mask.indices))
        kv = [t[:, :1].detach().requires_grad_() for t in (k, v)]
        out = sparge.sparge_attention(q[:, :, :200], *kv, is_causal=True, enable_gqa=True, topk=0.2,
                                      deterministic=True)  # the op
        ref = sparge.sparge_attention(q[:, :, :200], *kv, is_causal=True, enable_gqa=True, topk=0.2,
                                      deterministic=True, return_mask=True)[0]
        self.assertTrue(torch.equal(out, ref))
        for a, b in zip(torch.autograd.grad(out.sum(), (q, *kv)), torch.autograd.grad(ref.sum(), (q, *kv))):
            self.assertTrue(torch.equal(a, b))

    def test_make_fx_records_the_ops(self):
        from torch.fx.experimental.proxy_tensor import make_fx

        q, k, v = (torch.randn(1, 2, 200, 32) for _ in range(3))
        gm = make_fx(lambda q, k, v: sparge.sparge_attention(q, k, v, topk=0.5))(q, k, v)
        self.assertIn("sparge.attention", str(gm.graph))
        self.assertTrue(torch.equal(gm(q, k, v), sparge.sparge_attention(q, k, v, topk=0.5)))


@unittest.skipUnless(OPS, SKIP_OPS)
class Compile(unittest.TestCase):
    def setUp(self):
        torch._dynamo.reset()

    def check_block(self, device, dtype, tol):
        block, args = make_block(device, dtype)
        explanation = torch._dynamo.explain(block)(*args)
        self.assertEqual(explanation.graph_break_count, 0, explanation)
        self.assertEqual(explanation.graph_count, 1)
        graphs = []

        def recording_backend(gm, example_inputs):
            graphs.append(str(gm.graph))
            return gm.forward

        torch.compile(block, backend=recording_backend, fullgraph=True)(*args)
        self.assertIn("sparge.attention", graphs[0])
        torch._dynamo.reset()

        compiled = torch.compile(block, fullgraph=True)
        x = args[0].detach().requires_grad_()
        eager_out = block(x, *args[1:])
        eager_grads = torch.autograd.grad(eager_out.float().square().mean(), (x, block.q.weight))
        out = compiled(x, *args[1:])
        grads = torch.autograd.grad(out.float().square().mean(), (x, block.q.weight))
        self.assertLess(rel_l2(out, eager_out), tol)
        for a, b in zip(grads, eager_grads):
            self.assertLess(rel_l2(a, b), tol)

    def test_cpu_fullgraph_matches_eager(self):
        self.check_block("cpu", torch.float32, 1e-4)

    @unittest.skipUnless(HAVE_CUDA, "skipped: no CUDA device (or libsparge built without CUDA)")
    def test_cuda_fullgraph_matches_eager(self):
        self.check_block("cuda", torch.bfloat16, 2e-2)

    def test_dynamic_token_counts(self):
        compiled = torch.compile(sparse_attention, fullgraph=True, dynamic=True)
        for n in (400, 520, 333):
            q, k, v = (torch.randn(1, n, 2, 32) for _ in range(3))
            self.assertTrue(torch.equal(compiled(q, k, v), sparse_attention(q, k, v)), n)

    def test_jit_trace_records_the_op(self):
        block, args = make_block("cpu", torch.float32)
        with torch.no_grad():
            traced = torch.jit.trace(block, args, check_trace=False)
            self.assertIn("sparge::attention", str(traced.graph))
            self.assertLess(rel_l2(traced(*args), block(*args)), 1e-6)


@unittest.skipUnless(OPS, SKIP_OPS)
@unittest.skipUnless(HAVE_CUDA, "skipped: no CUDA device (or libsparge built without CUDA)")
class CudaGraphs(unittest.TestCase):
    def test_capture_and_replay_by_hand(self):
        block, args = make_block("cuda", torch.bfloat16)
        x, rest = args[0], args[1:]
        static_x = x.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad():
            with torch.cuda.stream(side):  # warm-up on the capture stream: its sparge handle, masks and scratch
                for _ in range(3):
                    block(static_x, *rest)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side):
                static_out = block(static_x, *rest)
            for seed in (5, 6):
                new_x = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(x)
                static_x.copy_(new_x)
                graph.replay()
                torch.cuda.synchronize()
                self.assertLess(rel_l2(static_out, block(new_x, *rest)), 1e-2, seed)

    def test_reduce_overhead(self):
        from torch._dynamo.utils import counters

        block, args = make_block("cuda", torch.bfloat16)
        torch._dynamo.reset()
        counters.clear()
        compiled = torch.compile(block, mode="reduce-overhead", fullgraph=True)
        with torch.no_grad():
            expected = block(*args)
            for _ in range(4):  # warm-up, recording, replays
                out = compiled(*args)
            self.assertLess(rel_l2(out, expected), 2e-2)
        self.assertEqual(counters["inductor"]["cudagraph_skips"], 0, dict(counters["inductor"]))


if __name__ == "__main__":
    unittest.main()
