"""The main job, `python -m cute_deform.demo`, on a machine without a Hopper GPU."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cute_deform import demo


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_demo_runs_cpu_path_and_checks_it(capsys, dtype):
    status = demo.main(["--preset", "tiny", "--device", "cpu", "--dtype", dtype])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "CPU path" in printed and "CuTe kernel did not run" in printed
    assert ": OK" in printed


def test_demo_inputs_match_the_preset():
    preset = demo.PRESETS["decoder"]
    value, shapes, starts, loc, attn = demo.make_inputs(preset, torch.float16, torch.device("cpu"),
                                                        torch.Generator().manual_seed(0))
    S = sum(h * w for h, w in preset.levels)
    assert value.shape == (8, S, 8, 32) and value.dtype == torch.float16
    assert loc.shape == (8, 900, 8, 4, 4, 2) and attn.shape == (8, 900, 8, 4, 4)
    assert starts.tolist() == [0, 100 * 167, 100 * 167 + 50 * 84, 100 * 167 + 50 * 84 + 25 * 42]
    torch.testing.assert_close(attn.sum((-1, -2)), torch.ones(8, 900, 8))  # softmax over levels*points


NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where torch sees no CUDA device")


@NO_CUDA
def test_demo_without_cuda_refuses_device_cuda(capsys):
    """An argparse error (status 2, one `error:` line naming --device), not a traceback."""
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--device", "cuda", "--preset", "tiny"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error: argument --device: cuda is not available" in err
    assert "Traceback" not in err


@NO_CUDA
def test_demo_module_without_cuda_exits_2_with_one_error_line():
    """The command itself, as a user runs it."""
    root = Path(__file__).resolve().parent.parent
    run = subprocess.run([sys.executable, "-m", "cute_deform.demo", "--device", "cuda"], cwd=root,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr
    errors = [line for line in run.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "--device" in errors[0], run.stderr
    assert "Traceback" not in run.stderr and run.stdout == ""
