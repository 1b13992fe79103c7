"""scripts/bench_layer.py (meant for a GPU) runs on the CPU with --dry-run: every CPU row gets a time,
the GPU-only rows say why they were skipped, and its fused and unfused layers match the float64 layer."""
import importlib.util
import re
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_layer.py"


def test_dry_run_on_the_cpu(capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_layer", SCRIPT)
    bench_layer = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_layer", bench_layer)  # its dataclass looks itself up there
    spec.loader.exec_module(bench_layer)
    assert bench_layer.main(["--dry-run", "--device", "cpu", "--no-compile", "--skip", "transformers"]) == 0
    out = capsys.readouterr().out
    eager = re.findall(r"^  (fused|unfused) \S.*?(fp32|fp16)\s+eager\s+([0-9.]+|-)", out, re.M)
    assert len(eager) == 4 and all(ms != "-" for *_, ms in eager), out
    assert out.count("skipped: needs a CUDA device") == 4 and out.count("skipped: --no-compile") == 4
    errors = {(layer, dtype): float(err) for layer, dtype, err in re.findall(
        r"^  (fused|unfused) \S.*?(fp32|fp16)\s+eager\s+\S+\s+\S*\s*rel err vs float64 (\S+)", out, re.M)}
    assert len(errors) == 4, out
    # fp16: the output projection rounds to fp16, and the unfused formula also rounds locations and softmax.
    assert errors["fused", "fp32"] < 1e-5 and errors["unfused", "fp32"] < 1e-5, out
    assert errors["fused", "fp16"] < 2e-3 and errors["unfused", "fp16"] < 1e-2, out
    host = re.findall(r"^  (torch\.ops\.cute_deform\.\w+|MSDeformAttn \(Lq=64\))\s.*?(no_grad|inference_mode)"
                      r".*us per call \(median of 5 loops of \d+\): ([0-9.]+)", out, re.M)
    assert len(host) == 6 and all(float(us) > 0 for *_, us in host), out
