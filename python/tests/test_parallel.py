"""sparge.parallel on the CPU over gloo: Ulysses and context parallelism with 1, 2 and 4 processes against one
process on the whole sequence (outputs and gradients within f32 rounding, masks bit for bit), grouped K/V heads
and causal attention in both schemes (2 processes; one causal case with every count), the bytes that context
parallelism moves (nothing from above the causal diagonal), and bad configurations refused by every rank.

Each group of processes runs all its cases in one spawn (a process start costs more than the cases); the test
methods then check what each rank reported. A hang fails the group after a deadline instead of blocking."""
import datetime
import os
import socket
import time
import traceback
import unittest

from helpers import rel_l2, sparge, torch

try:
    import torch.distributed as dist
    import torch.multiprocessing as mp

    MISSING = None if dist.is_available() and dist.is_gloo_available() else "torch.distributed with gloo"
except ImportError:
    MISSING = "torch.distributed"
if MISSING:
    raise unittest.SkipTest(f"skipped: {MISSING} is not available in this torch")

from sparge import parallel  # noqa: E402  (needs torch.distributed)

F32_TOL = sparge.tolerance(torch.float32)
KW = dict(topk=0.15, topp=0.3, block_q=32, block_k=16)
COLLECTIVE_TIMEOUT_S = 60
GROUP_DEADLINE_S = 100


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def inputs(B, H, N, D, layout, seed=0, banded=False, Hkv=None):
    """q, k, v and an output gradient of the whole sequence, identical in every process (k and v with Hkv heads).
    banded adds the same positional signal to q and k, so that blocks attend to their neighbourhood (a local
    mask)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v, d_out = (torch.randn(B, h, N, D, generator=g) for h in (H, Hkv or H, Hkv or H, H))
    if banded:
        pos = torch.arange(N, dtype=torch.float32)[:, None] * torch.linspace(0.002, 0.05, D)[None, :] * 6.283
        pe = 2.0 * torch.sin(pos + torch.arange(D)[None, :])
        q, k = q + pe, k + pe
    if layout == "bnhd":
        q, k, v, d_out = (t.transpose(1, 2).contiguous() for t in (q, k, v, d_out))
    return q, k, v, d_out


def seq_dim(layout):
    return 2 if layout == "bhnd" else 1


def single_device(q, k, v, d_out, layout, causal, **kw):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, mask = sparge.sparge_attention(*leaves, layout=layout, return_mask=True, is_causal=causal, enable_gqa=True,
                                        **kw)
    out.backward(d_out)
    return out.detach(), [t.grad for t in leaves], mask.dense


def run_scheme(rank, P, scheme, B, H, lengths, D, layout, banded=False, deterministic=False, Hkv=None, causal=False,
               kw=KW, dtype=torch.float32):
    """One call of a scheme on this rank's shard against the single-device call; returns what the parent checks."""
    N, dim, Hkv = sum(lengths), seq_dim(layout), Hkv or H
    q, k, v, d_out = (t.to(dtype) for t in inputs(B, H, N, D, layout, banded=banded, Hkv=Hkv))
    ref_out, ref_grads, ref_dense = single_device(q, k, v, d_out, layout, causal, **kw)
    shard = [parallel.local_shard(t, lengths, rank, dim).clone().requires_grad_() for t in (q, k, v)]
    stats = parallel.CommStats()
    fn = parallel.ulysses_attention if scheme == "ulysses" else parallel.context_parallel_attention
    out, mask = fn(*shard, layout=layout, return_mask=True, stats=stats, deterministic=deterministic, causal=causal,
                   **kw)
    out.backward(parallel.local_shard(d_out, lengths, rank, dim))
    local = lambda t: parallel.local_shard(t, lengths, rank, dim)  # noqa: E731
    result = {"out": rel_l2(out, local(ref_out)), "shape": list(out.shape) == list(shard[0].shape),
              "tol": sparge.tolerance(dtype)}
    for name, g, r in zip(("dq", "dk", "dv"), (t.grad for t in shard), ref_grads):
        result[name] = rel_l2(g, local(r))
    if scheme == "ulysses":
        expected = ref_dense[:, rank * H // P:(rank + 1) * H // P]
    else:
        first = sum(lengths[:rank]) // kw["block_q"]
        expected = ref_dense[:, :, first:first + mask.Nqb]
    result["mask_equal"] = bool(torch.equal(mask.dense, expected))
    result["sparsity"] = float(1.0 - ref_dense.float().mean())
    result["received"], result["sent"], result["ring"] = dict(stats.received), dict(stats.sent), stats.dense_ring
    if scheme == "context":
        # The K/V blocks this rank's query blocks keep from other shards, from the single-device mask: per K/V
        # head, the union over its query heads.
        bk, start = kw["block_k"], sum(lengths[:rank])
        need = expected.bool().view(B, Hkv, H // Hkv, *expected.shape[2:]).any(3).any(2)
        own = slice(start // bk, (start + lengths[rank] + bk - 1) // bk)
        need[:, :, own] = False
        elem = q.element_size()
        result["kv_expected"] = int(need.sum()) * 2 * bk * D * elem
        result["ring_expected"] = 2 * B * Hkv * D * elem * (start if causal else N - lengths[rank])
    return result


def refused(call):
    try:
        call()
    except ValueError as e:
        return "ValueError: " + str(e)
    except Exception as e:  # noqa: BLE001  (reported to the parent, which fails the test)
        return f"unexpected {type(e).__name__}: {e}"
    return "accepted"


def bad_cases(rank, P):
    """Configurations to refuse, each on every rank, followed by a valid call (the group must still be usable)."""
    D, layout = 16, "bhnd"
    out = {}
    q, k, v, _ = inputs(1, 3, 64 * P, D, layout)
    sh = [parallel.local_shard(t, [64] * P, rank, 2) for t in (q, k, v)]
    out["heads"] = refused(lambda: parallel.ulysses_attention(*sh, **KW))
    lengths = [64] * (P - 1) + [48]
    q, k, v, _ = inputs(1, 2 * P, sum(lengths), D, layout)
    sh = [parallel.local_shard(t, lengths, rank, 2) for t in (q, k, v)]
    out["unequal"] = refused(lambda: parallel.ulysses_attention(*sh, **KW))
    lengths = [40] + [64] * (P - 2) + [50]
    q, k, v, _ = inputs(1, 2, sum(lengths), D, layout)
    sh = [parallel.local_shard(t, lengths, rank, 2) for t in (q, k, v)]
    out["misaligned"] = refused(lambda: parallel.context_parallel_attention(*sh, **KW))
    # Only the last rank passes a k of another head dimension: the others must not wait for it.
    q, k, v, _ = inputs(1, 2, 64 * P, D, layout)
    sh = [parallel.local_shard(t, [64] * P, rank, 2) for t in (q, k, v)]
    if rank == P - 1:
        sh[1] = sh[1][..., :8]
    out["local"] = refused(lambda: parallel.context_parallel_attention(*sh, **KW))
    out["topk_disagrees"] = refused(lambda: parallel.ulysses_attention(
        *sh[:1], sh[0], sh[0], **dict(KW, topk=0.1 + 0.01 * rank)))
    q, k, v, _ = inputs(1, 2, 64 * P, D, layout)
    sh = [parallel.local_shard(t, [64] * P, rank, 2) for t in (q, k, v)]
    out["causal_disagrees"] = refused(lambda: parallel.context_parallel_attention(*sh, causal=rank == 0, **KW))
    q, k, v, _ = inputs(1, 4, 64 * P, D, layout, Hkv=3)
    sh = [parallel.local_shard(t, [64] * P, rank, 2) for t in (q, k, v)]
    out["kv_heads"] = refused(lambda: parallel.context_parallel_attention(*sh, **KW))
    q, k, v, _ = inputs(1, 2, 64 * P, D, layout)
    sh = [parallel.local_shard(t, [64] * P, rank, 2) for t in (q, k, v)]
    # Arguments that sparge's own checks refuse: on one rank, or on all of them, before any rank moves data.
    out["backend_one_rank"] = refused(lambda: parallel.context_parallel_attention(
        *sh, backend="cuda" if rank == P - 1 else None, **KW))
    out["bool_block"] = refused(lambda: parallel.context_parallel_attention(*sh, **dict(KW, block_q=True)))
    out["topk_range"] = refused(lambda: parallel.ulysses_attention(*sh, **dict(KW, topk=1.5)))
    out["float64"] = refused(lambda: parallel.context_parallel_attention(
        *(t.double() for t in sh), **dict(KW, backend="cpu-ref")))
    # A backward on some ranks only would leave them in its collectives.
    grad_q = sh[0].clone().requires_grad_(rank == 0)
    out["grad_disagrees"] = refused(lambda: parallel.context_parallel_attention(grad_q, *sh[1:], **KW))
    out["after"] = run_scheme(rank, P, "context", 1, 2, [64] * P, D, layout)
    return out


def empty_cases(rank, P):
    """Inputs without batch entries, head dim or (Ulysses) tokens: empty outputs and gradients, as one device
    gives them; returns {case: what happened}."""
    out = {}
    for name, (B, n, D) in {"batch": (0, 64, 16), "head_dim": (1, 64, 0), "tokens": (1, 0, 16)}.items():
        for scheme, fn in (("ulysses", parallel.ulysses_attention), ("context", parallel.context_parallel_attention)):
            if scheme == "context" and n == 0:
                continue  # context parallelism needs tokens on every rank
            q, k, v = (torch.randn(B, 4, n, D, requires_grad=True) for _ in range(3))
            try:
                o, mask = fn(q, k, v, return_mask=True, **KW)
                o.sum().backward()
                out[f"{scheme}_{name}"] = (list(o.shape) == list(q.shape) and mask is None
                                           and all(t.grad is not None and t.grad.shape == t.shape for t in (q, k, v)))
            except Exception as e:  # noqa: BLE001  (reported to the parent)
                out[f"{scheme}_{name}"] = f"{type(e).__name__}: {e}"
    return out


def cases(P):
    ragged = parallel.shard_lengths(300, P, block_q=KW["block_q"], block_k=KW["block_k"])
    unequal = {1: [300], 2: [96, 204], 4: [64, 128, 32, 76]}[P]
    shapes = {  # grouped heads and causal: every count runs one case, two processes all of them
        "context_causal_gqa": ("context", 1, 4, ragged, 32, "bhnd", False, False, 2, True),
    }
    if P == 2:
        shapes.update({
            "ulysses_causal_gqa": ("ulysses", 1, 4, [150, 150], 32, "bhnd", False, False, 2, True),
            "ulysses_mqa_bnhd": ("ulysses", 2, 4, [75, 75], 16, "bnhd", False, False, 1, False),
            "context_gqa_unequal_bnhd": ("context", 2, 4, unequal, 16, "bnhd", False, False, 2, False),
            "context_causal_mqa_narrow_q": ("context", 1, 2, [128, 172], 16, "bhnd", False, True, 1, True,
                                            dict(KW, block_q=16, block_k=32)),
            # bfloat16 crosses gloo, which lacks bfloat16 in some torch versions
            "ulysses_bf16": ("ulysses", 1, 4, [75, 75], 16, "bnhd", False, False, 2, False, KW, torch.bfloat16),
            "context_bf16": ("context", 1, 4, ragged, 16, "bhnd", False, False, 2, True, KW, torch.bfloat16),
        })
    return {**shapes, **{
        "ulysses_bhnd": ("ulysses", 1, 4, [150] * P if P == 2 else [75] * P, 32, "bhnd"),
        "ulysses_bnhd": ("ulysses", 2, 4, [75] * P, 16, "bnhd"),
        "context_ragged_bhnd": ("context", 1, 4, ragged, 32, "bhnd"),
        "context_unequal_bnhd": ("context", 2, 2, unequal, 16, "bnhd"),
        "context_banded": ("context", 1, 2, parallel.shard_lengths(640, P, block_q=32, block_k=16), 32, "bhnd", True),
        "context_deterministic": ("context", 1, 2, ragged, 16, "bhnd", False, True),
    }}


def worker(rank, P, port, queue):
    torch.set_num_threads(1)
    report = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=P,
                                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        for name, (scheme, *args) in cases(P).items():
            report[name] = run_scheme(rank, P, scheme, *args)
        report["empty"] = empty_cases(rank, P)
        if P > 1:
            report["bad"] = bad_cases(rank, P)
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001  (the parent reports it)
        report["crash"] = traceback.format_exc()
    queue.put((rank, report))


def run_group(P):
    """{rank: report} of P processes, or raises with what went wrong (a crash, a hang past the deadline)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # 2 cores shared by P processes: libsparge reads it when loaded
    try:
        port = free_port()
        procs = [ctx.Process(target=worker, args=(r, P, port, queue), daemon=True) for r in range(P)]
        for p in procs:
            p.start()
    finally:
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    reports, deadline = {}, time.monotonic() + GROUP_DEADLINE_S
    try:
        while len(reports) < P:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{P} processes: no report from ranks {sorted(set(range(P)) - set(reports))} "
                                     f"after {GROUP_DEADLINE_S} s (hang)")
            try:
                rank, report = queue.get(timeout=min(left, 5.0))
                reports[rank] = report
            except Exception:  # queue.Empty
                if any(p.exitcode not in (None, 0) for p in procs):
                    raise AssertionError(f"{P} processes: a rank died: exit codes {[p.exitcode for p in procs]}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    for rank, report in reports.items():
        if "crash" in report:
            raise AssertionError(f"rank {rank} of {P} crashed:\n{report['crash']}")
    return reports


class ParallelGroups:
    """One spawn per process count, shared by the test methods."""
    _cache = {}

    @classmethod
    def get(cls, P):
        if P not in cls._cache:
            try:
                cls._cache[P] = run_group(P)
            except AssertionError as e:
                cls._cache[P] = e
        if isinstance(cls._cache[P], AssertionError):
            raise cls._cache[P]
        return cls._cache[P]


class Equivalence:
    P = None

    def check_case(self, name):
        reports = ParallelGroups.get(self.P)
        for rank in range(self.P):
            r = reports[rank][name]
            where = f"{name}, rank {rank} of {self.P}"
            self.assertTrue(r["shape"], where)
            self.assertTrue(r["mask_equal"], f"{where}: mask differs from the single-device mask")
            for key in ("out", "dq", "dk", "dv"):
                self.assertLess(r[key], r["tol"], f"{where}: {key}")
            if "kv_expected" in r:
                self.assertEqual(r["received"]["kv"], r["kv_expected"], f"{where}: K/V bytes received")
                self.assertEqual(r["sent"]["grad_kv"], r["kv_expected"], f"{where}: dK/dV bytes returned")
                self.assertEqual(r["ring"]["forward"], r["ring_expected"], where)
        return reports

    def test_ulysses_bhnd(self):
        self.check_case("ulysses_bhnd")

    def test_ulysses_bnhd(self):
        self.check_case("ulysses_bnhd")

    def test_context_ragged_bhnd(self):
        self.check_case("context_ragged_bhnd")

    def test_context_unequal_shards_bnhd(self):
        self.check_case("context_unequal_bnhd")

    def test_context_deterministic(self):
        self.check_case("context_deterministic")

    def test_context_causal_gqa(self):
        reports = self.check_case("context_causal_gqa")
        # Nothing comes from the ranks whose key shards lie above a rank's diagonal: rank 0 receives nothing,
        # the last rank sends nothing (and each rank takes pooled K only from the ranks up to itself).
        first, last = reports[0]["context_causal_gqa"], reports[self.P - 1]["context_causal_gqa"]
        for phase in ("pooled_k", "kv"):
            self.assertEqual(first["received"].get(phase, 0), 0, phase)
            self.assertEqual(last["sent"].get(phase, 0), 0, phase)
        self.assertEqual(first["ring"]["forward"], 0)

    def test_empty_inputs(self):
        reports = ParallelGroups.get(self.P)
        for rank in range(self.P):
            for case, result in reports[rank]["empty"].items():
                self.assertIs(result, True, f"{case}, rank {rank} of {self.P}")

    def test_context_moves_only_kept_blocks(self):
        reports = self.check_case("context_banded")
        if self.P > 1:
            received = sum(reports[r]["context_banded"]["received"]["kv"] for r in range(self.P))
            ring = sum(reports[r]["context_banded"]["ring"]["forward"] for r in range(self.P))
            self.assertLess(received, 0.8 * ring, "a local mask should need well under a dense ring's K/V")


class OneProcess(Equivalence, unittest.TestCase):
    P = 1


class TwoProcesses(Equivalence, unittest.TestCase):
    P = 2

    def test_ulysses_causal_gqa(self):
        self.check_case("ulysses_causal_gqa")

    def test_ulysses_mqa_repeats_kv_heads(self):
        reports = self.check_case("ulysses_mqa_bnhd")
        # One K/V head over two ranks travels as two copies, one per rank: half of the local Q (B=2, n=75, H=4,
        # D=16, f32) and of the local K and V of two heads each leave the rank.
        r = reports[0]["ulysses_mqa_bnhd"]
        self.assertEqual(r["sent"]["qkv"], 2 * 75 * (4 + 2 + 2) * 16 * 4 // 2)

    def test_context_gqa_unequal_shards(self):
        self.check_case("context_gqa_unequal_bnhd")

    def test_context_causal_query_blocks_narrower_than_key_blocks(self):
        self.check_case("context_causal_mqa_narrow_q")

    def test_bfloat16(self):
        self.check_case("ulysses_bf16")
        self.check_case("context_bf16")

    def test_bad_configurations_refused_everywhere(self):
        reports = ParallelGroups.get(self.P)
        expect = {"heads": "must divide H", "unequal": "equal sequence shards", "misaligned": "multiples of",
                  "local": "rank 1 refused", "topk_disagrees": "disagree on topk",
                  "causal_disagrees": "disagree on causal", "kv_heads": "must divide q's 4",
                  "backend_one_rank": "rank 1 refused", "bool_block": "must be an int, got bool",
                  "topk_range": "refused its arguments: sparge: topk = 1.5",
                  "grad_disagrees": "disagree on requires_grad",
                  "float64": "float32, float16 and bfloat16; float64 only in single-device calls"}
        for rank in range(self.P):
            bad = reports[rank]["bad"]
            for case, text in expect.items():
                self.assertTrue(bad[case].startswith("ValueError"), f"rank {rank}, {case}: {bad[case]}")
                self.assertIn(text, bad[case], f"rank {rank}, {case}")
            after = bad["after"]
            self.assertLess(after["out"], F32_TOL, f"rank {rank}: the call after the refusals")
            self.assertTrue(after["mask_equal"])


class FourProcesses(Equivalence, unittest.TestCase):
    P = 4

    def test_bad_configurations_refused_everywhere(self):
        reports = ParallelGroups.get(self.P)
        for rank in range(self.P):
            bad = reports[rank]["bad"]
            for case in ("heads", "unequal", "misaligned", "local", "topk_disagrees", "causal_disagrees", "kv_heads",
                         "backend_one_rank", "bool_block", "topk_range", "grad_disagrees", "float64"):
                self.assertTrue(bad[case].startswith("ValueError"), f"rank {rank}, {case}: {bad[case]}")
            self.assertLess(bad["after"]["out"], F32_TOL)


class Helpers(unittest.TestCase):
    def test_shard_lengths(self):
        self.assertEqual(parallel.shard_lengths(300, 2, block_q=32, block_k=16), [160, 140])
        self.assertEqual(parallel.shard_lengths(75600, 8), [9472] * 7 + [9296])
        self.assertEqual(parallel.shard_lengths(300, 4, scheme="ulysses"), [75] * 4)
        with self.assertRaisesRegex(ValueError, "multiple of P"):
            parallel.shard_lengths(301, 4, scheme="ulysses")
        with self.assertRaisesRegex(ValueError, "fewer than P"):
            parallel.shard_lengths(100, 4, block_q=64, block_k=64)
        for args, kw, error in (((100, 0), {}, ValueError), ((100, -2), dict(scheme="ulysses"), ValueError),
                                ((100, 2), dict(block_q=0), ValueError), ((100, 2), dict(block_q=True), TypeError),
                                ((100.0, 2), {}, TypeError)):
            with self.subTest(args=args, **kw):
                with self.assertRaises(error):
                    parallel.shard_lengths(*args, **kw)

    def test_needs_an_initialized_group(self):
        if dist.is_initialized():
            self.skipTest("a process group is already initialized")
        q = torch.zeros(1, 2, 64, 16)
        with self.assertRaisesRegex(RuntimeError, "init_process_group"):
            parallel.context_parallel_attention(q, q, q)


if __name__ == "__main__":
    unittest.main()
