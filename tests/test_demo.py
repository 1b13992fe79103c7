"""The main job, `python -m cute_deform.demo`, on a machine without a Hopper GPU."""
import pytest
import torch

from cute_deform import demo


@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
def test_demo_runs_reference_path_and_checks_it(capsys, dtype):
    status = demo.main(["--preset", "tiny", "--device", "cpu", "--dtype", dtype])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "reference path" in printed and "CuTe kernel did not run" in printed
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
