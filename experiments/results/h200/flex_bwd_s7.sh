# ---- call b
#!/bin/bash
# session 7 call 3: FlexAttention's backward on sparge's masks (128x64, then the same tokens as 64x64 blocks),
# sparge's backward and cuDNN's in the same call.
log() { echo "## $* (t=${SECONDS}s)"; }
make -j16 experiments/exp_speed >/dev/null 2>&1 || { echo "build failed"; exit 1; }
git_commit=$(cat .tarball-version 2>/dev/null); echo "version $git_commit"
log "exp_speed video 1.3B (hybrid 0.03/0.2 and Top-k 95 %), masks exported"
timeout 120 experiments/exp_speed --backend cuda --family video --heads 12 --dim 128 --dtype bf16 --sparsities 0.95 \
  --hybrid 0.03:0.2 --backward --reps 10 --export-masks /tmp/m13 --csv $OUT/speed_video13.csv --md /tmp/speed_video13.md --quiet
cat /tmp/speed_video13.md
log "sparge backward, Top-k 95 % and dense (random inputs, --settle 1)"
timeout 60 src/sparge bench --backend cuda --H 12 --N 32760 --D 128 --dtype bf16 --sparsity 0.95 --ops bwd --settle 1 | tail -1
log "peers backward: SDPA dense, FlexAttention on the same masks"
timeout 330 python3 experiments/peers/peer_bench.py --backward --mask /tmp/m13-s95.12 --mask /tmp/m13-k0.03-p0.2 --reps 10 \
  --csv $OUT/peer_bwd.csv 2>&1 | grep -v -i "deprecat\|create_block_mask(\|warnings.warn"
log "sparge backward again, Top-k 95 % (--settle 1)"
timeout 60 src/sparge bench --backend cuda --H 12 --N 32760 --D 128 --dtype bf16 --sparsity 0.95 --ops bwd --settle 1 | tail -1
log end
# ---- call c
#!/bin/bash
# session 7 call 4: FlexAttention's backward with explicit backward tiles / 64x64 blocks, on sparge's masks
log() { echo "## $* (t=${SECONDS}s)"; }
make -j16 experiments/exp_speed >/dev/null 2>&1 || { echo "build failed"; exit 1; }
log "exp_speed video 1.3B (hybrid 0.03/0.2 and Top-k 95 %), masks exported"
timeout 120 experiments/exp_speed --backend cuda --family video --heads 12 --dim 128 --dtype bf16 --sparsities 0.95 \
  --hybrid 0.03:0.2 --backward --reps 10 --export-masks /tmp/m13 --csv $OUT/speed_video13.csv --md /tmp/speed_video13.md --quiet
cat /tmp/speed_video13.md
log "peers backward: SDPA dense, FlexAttention on the same masks"
timeout 400 python3 experiments/peers/peer_bench.py --backward --mask /tmp/m13-s95.12 --mask /tmp/m13-k0.03-p0.2 --reps 10 \
  --csv $OUT/peer_bwd.csv 2>&1 | grep -v -i "deprecat\|create_block_mask(\|warnings.warn"
log "sparge backward, Top-k 95 % (--settle 1)"
timeout 60 src/sparge bench --backend cuda --H 12 --N 32760 --D 128 --dtype bf16 --sparsity 0.95 --ops bwd --settle 1 | tail -1
log end
# ---- call d
#!/bin/bash
# session 7 call 5: is FlexAttention's backward failure tied to N = 32760 (not a multiple of 128)? The same test at
# N = 32768 on sparge's Top-k 95 % mask, sparge's backward beside it.
log() { echo "## $* (t=${SECONDS}s)"; }
S="src/sparge bench --backend cuda --H 12 --N 32768 --D 128 --dtype bf16"
log "sparge N=32768: export the Top-k 95 % mask; backward (--settle 1)"
timeout 60 $S --sparsity 0.95 --ops mask,fwd,bwd --settle 1 --export-mask /tmp/m32768-s95 | tail -2
log "peers backward at N=32768: SDPA cuDNN, FlexAttention on the same mask"
timeout 300 python3 experiments/peers/peer_bench.py --backward --mask /tmp/m32768-s95 --reps 10 \
  --csv $OUT/peer_bwd_32768.csv 2>&1 | grep -v -i "deprecat\|create_block_mask(\|warnings.warn"
log "sparge backward again"
timeout 60 $S --sparsity 0.95 --ops bwd --settle 1 | tail -1
log end
# ---- call e
#!/bin/bash
# session 7 call 6: FlexAttention's backward: does it compile at all here (no mask, N=4096), and with sparge's mask as
# 128x128 BlockMask blocks (the lookup applied per token in partly kept blocks)?
log() { echo "## $* (t=${SECONDS}s)"; }
log "FlexAttention backward without a mask, N=4096"
timeout 120 python3 - <<'PY' 2>&1 | grep -v -i "deprecat\|warnings.warn" | tail -3
import torch
from torch.nn.attention.flex_attention import flex_attention
f = torch.compile(flex_attention, dynamic=False)
q, k, v = (torch.randn(1, 2, 4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
try:
    g = torch.autograd.grad(f(q, k, v), (q, k, v), torch.randn(1, 2, 4096, 128, device="cuda", dtype=torch.bfloat16))
    torch.cuda.synchronize(); print("flex backward without mask: OK", float(g[0].float().norm()))
except Exception as e:
    print("flex backward without mask: FAILED", type(e).__name__, " ".join(str(e).split())[:400])
PY
S="src/sparge bench --backend cuda --H 12 --N 32760 --D 128 --dtype bf16"
log "sparge: export the Top-k 95 % mask; backward (--settle 1)"
timeout 60 $S --sparsity 0.95 --ops mask,fwd,bwd --settle 1 --export-mask /tmp/m95 | tail -1
log "peers backward: FlexAttention on the same mask"
timeout 300 python3 experiments/peers/peer_bench.py --backward --no-dense --mask /tmp/m95 --reps 10 \
  --csv $OUT/peer_bwd_flex.csv 2>&1 | grep -v -i "deprecat\|create_block_mask(\|warnings.warn" | cut -c1-420
log "sparge backward again"
timeout 60 $S --sparsity 0.95 --ops bwd --settle 1 | tail -1
log end
