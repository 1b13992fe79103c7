"""One small case of the Hopper kernel against the float64 reference (for compute-sanitizer runs)."""
import sys

import torch

sys.path.insert(0, "scripts")
import kernel_check as kc  # noqa: E402
from cute_deform import msda_fwd  # noqa: E402

torch.manual_seed(0)
value, shapes, starts, loc, attn = kc.make_inputs(N=2, Lq=50, M=2, D=32, levels=[(9, 13), (5, 6), (1, 3), (3, 1)], P=4,
                                                  vdt=torch.float16, border=True)
out = msda_fwd.msda_forward(value, shapes, starts, loc, attn)
torch.cuda.synchronize()
err = kc.rel_err(out, kc.reference_f64(value, shapes, starts, loc, attn))
print(f"smoke: rel err {err:.2e}")
sys.exit(0 if err < 5e-3 else 1)
