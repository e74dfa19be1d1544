"""Three causal bf16 SDPA forwards at one shape through one side, for a profiler to catch
(scripts/probes/ncu_attention_fwd.sh): `wg` (torchfuse's per-tile sm 90 variant), `persistent`
(its persistent-forward variant) or `stock` (torchfuse off: cuDNN on an H100).

  python3 scripts/probes/attention_fwd_once.py LIB_DIR SIDE [B H S D]"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from bench_attention import make_inputs, phase_calls

lib_dir, side = sys.argv[1], sys.argv[2]
b, h, s, d = (int(x) for x in sys.argv[3:7]) if len(sys.argv) >= 7 else (8, 12, 1024, 64)
torch.ops.load_library(str(Path(lib_dir) / "libtorchfuse.so"))
torch.ops.torchfuse.set_enabled("sdpa", side != "stock")
torch.ops.torchfuse._serve_below_thresholds(True)
if side != "stock":
    suffix = {"wg": "wg", "persistent": "wg_persistent"}[side]
    torch.ops.torchfuse._force_variant(f"attn_d{d}_causal_{suffix}")
inputs = make_inputs(b, h, s, d, 1, torch.Generator(device="cuda"))[0]
for _ in range(3):
    phase_calls(causal=True)["fwd"](*inputs)
torch.cuda.synchronize()
