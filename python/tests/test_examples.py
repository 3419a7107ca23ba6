"""The examples run: dit_bench.py's --tiny smoke run (CPU) writes its table's rows, swap_attention.py on the CPU,
parallel_check.py says that it needs a GPU; experiments/peers/peer_bench.py refuses masks it would misread; the
experiment scripts' --help works where torch is missing."""
import csv
import json
import os
import subprocess
import sys
import tempfile
import unittest

from helpers import sparge, torch  # noqa: F401  (skips the module without torch)

EXAMPLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples")
EXPERIMENTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "experiments")
PEERS = os.path.join(EXPERIMENTS, "peers")


def run(script, *args, where=EXAMPLES):
    return subprocess.run([sys.executable, os.path.join(where, script), *args], capture_output=True, text=True,
                          timeout=600)


class Examples(unittest.TestCase):
    def test_dit_bench_tiny(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "dit.csv")
            result = run("dit_bench.py", "--tiny", "--csv", path)
            self.assertEqual(result.returncode, 0, result.stderr)
            with open(path) as f:
                rows = list(csv.DictReader(f))
        self.assertEqual([r["method"][:6] for r in rows], ["dense ", "sparge", "sparge"])
        self.assertIn("| tiny | sparge hybrid k=0.03 p=0.2 |", result.stdout)
        dense = rows[0]
        self.assertEqual((float(dense["sparsity"]), float(dense["step_speedup"])), (0.0, 1.0))
        self.assertLess(float(dense["rel_l2_vs_dense"]), 1e-6)
        for r in rows:
            self.assertEqual((r["tokens"], r["blocks"], r["blocks_timed"]), ("180", "2", "2"))
            self.assertGreater(float(r["step_ms"]), 0.0)
            self.assertGreater(float(r["attention_ms"]), 0.0)
            self.assertGreater(float(r["attention_share"]), 0.0)  # timed apart from the step: may pass 1 on a busy CPU
        for r in rows[1:]:
            self.assertGreater(float(r["sparsity"]), 0.0)
            self.assertLess(float(r["sparsity"]), 1.0)
            self.assertLess(float(r["rel_l2_vs_dense"]), 0.5)  # a sparse step, close to the dense one
            self.assertGreater(float(r["rel_l2_vs_dense"]), 0.0)

    def test_dit_bench_scales_fewer_blocks(self):
        result = run("dit_bench.py", "--tiny", "--blocks", "1")
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("| tiny (1/2 blocks timed) |", result.stdout)

    def test_help_without_torch(self):
        hide = ("import runpy, sys; sys.modules['torch'] = None; sys.argv = [sys.argv[1], '--help']; "
                "runpy.run_path(sys.argv[0], run_name='__main__')")
        for script in (os.path.join(EXPERIMENTS, "dump_qkv.py"), os.path.join(PEERS, "peer_bench.py")):
            result = subprocess.run([sys.executable, "-c", hide, script], capture_output=True, text=True, timeout=60)
            self.assertEqual(result.returncode, 0, f"{script}: {result.stderr}")
            self.assertIn("usage:", result.stdout)

    def test_swap_attention_cpu(self):
        result = run("swap_attention.py", "--device", "cpu", "--tokens", "700")
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("module output vs dense attention with sparge's mask", result.stdout)
        self.assertIn("finite: True", result.stdout)

    @unittest.skipIf(torch.cuda.is_available(), "a CUDA device is present: the check runs")
    def test_parallel_check_says_it_needs_a_gpu(self):
        result = run("parallel_check.py", "--N", "512", "--H", "2", "--D", "16")
        self.assertEqual(result.returncode, 1)
        self.assertIn("no CUDA device", result.stderr)
        self.assertNotIn("Traceback", result.stderr)


if __name__ == "__main__":
    unittest.main()


class PeerBench(unittest.TestCase):
    def test_refuses_a_mask_of_packed_sequences(self):
        """A varlen export's B counts sequences and its Nq, Nk are the longest one's: read as a fixed-length batch
        it would time and check another shape."""
        meta = {"B": 2, "H": 1, "Nq": 200, "Nk": 200, "D": 32, "block_q": 128, "block_k": 64, "Nqb": 2, "Nkb": 4,
                "sparsity": 0.0, "dtype": "f32", "causal": False, "varlen": True, "cu_seqlens_q": [0, 100, 300],
                "cu_seqlens_k": [0, 100, 300], "layout": "dense uint8 [B,H,Nqb,Nkb]"}  # sparge_mask_export's
        with tempfile.TemporaryDirectory() as tmp:
            prefix = os.path.join(tmp, "packed")
            with open(prefix + ".json", "w") as f:
                json.dump(meta, f)
            with open(prefix + ".u8", "wb") as f:
                f.write(bytes([1]) * (2 * 1 * 2 * 4))
            result = run("peer_bench.py", "--device", "cpu", "--mask", prefix, "--sparge", where=PEERS)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("packed sequences", result.stderr)
        self.assertNotIn("Traceback", result.stderr)
