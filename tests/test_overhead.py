"""scripts/overhead.py op-layer times the op layer's host cost on the CPU (no GPU): every piece gets a
time, and the op through the dispatcher costs more than its CPU kernel body alone."""
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "overhead.py"


def test_op_layer_on_the_cpu():
    # Its own process: it stubs the math, the launch and the device probe of the process it runs in.
    run = subprocess.run([sys.executable, str(SCRIPT), "op-layer", "--number", "200", "--repeats", "3", "--routes"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    rows = dict((name.strip(), float(us)) for name, us in re.findall(r"^(.+?)\s+(-?[0-9]+\.[0-9]+)$", run.stdout, re.M))
    assert len(rows) == 26, run.stdout
    pieces = {name: us for name, us in rows.items() if not name.startswith("=")}
    assert all(us > 0 for us in pieces.values()), run.stdout
    # The dispatcher and autograd layer around the CPU kernel: the op costs more than its body.
    assert rows["torch.ops.cute_deform.forward (CPU, math stubbed)"] > rows["op CPU kernel body (math stubbed)"]
    assert "stub kernel via define/impl + register_autograd (the op's route)" in rows
