"""The C++ launcher (cute_deform.native) on any machine: it builds, takes the op's CUDA and Autograd kernels,
keeps the op's behaviour on the CPU (the op tests pass with it loaded), and its launch registry works.
Each check runs in a fresh process with CUTE_DEFORM_NATIVE=1 (the choice is made when the op imports)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def run_native(code: str, mode: str = "1", timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "CUTE_DEFORM_NATIVE": mode, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def built():
    """Build once for the module (about half a minute the first time on a machine)."""
    proc = run_native("import cute_deform; from cute_deform import native; print(native.LOADED, native._error)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split()[0] == "True", proc.stdout + proc.stderr
    return True


def test_launcher_holds_the_cuda_and_autograd_kernels(built):
    proc = run_native("""
        import torch, cute_deform
        from cute_deform import native, op, fused
        assert native.LOADED
        # The Python CUDA kernels moved to the helper ops the C++ kernels call for what they cannot launch.
        assert torch.ops.cute_deform._forward_python.default._schema.arguments[0].name == "value"
        assert torch.ops.cute_deform._forward_fused_python.default._schema.arguments[3].name == "reference_points"
        # Autograd is C++'s: an input that requires grad gives an output whose backward raises.
        value, shapes, starts = torch.randn(1, 5, 2, 4, requires_grad=True), torch.tensor([[1, 5]]), torch.tensor([0])
        loc, attn = torch.rand(1, 3, 2, 1, 2, 2), torch.rand(1, 3, 2, 1, 2)
        # C++ raises Python's messages (cute_deform/_checks.py), handed over when the launcher loaded.
        from cute_deform._checks import FORWARD_ONLY, FUSED_FORWARD_ONLY

        def refuses_backward(out, message):
            assert out.requires_grad and out.grad_fn is not None
            try:
                out.sum().backward()
            except RuntimeError as exc:
                assert message in str(exc), exc
            else:
                raise AssertionError(f"backward did not raise: {message[:40]}")

        refuses_backward(torch.ops.cute_deform.forward(value, shapes, starts, loc, attn), FORWARD_ONLY)
        refuses_backward(torch.ops.cute_deform.forward_fused(value, shapes, starts, torch.rand(1, 3, 1, 2),
                                                             torch.randn(1, 3, 2, 1, 2, 2), torch.randn(1, 3, 2, 1, 2)),
                         FUSED_FORWARD_ONLY)
        with torch.no_grad():
            assert torch.ops.cute_deform.forward(value, shapes, starts, loc, attn).grad_fn is None
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


def test_registry_holds_replaces_and_clears(built):
    proc = run_native("""
        import torch, tvm_ffi, cute_deform
        from cute_deform import native
        fn = tvm_ffi.convert(lambda *args: None)  # any TVM-FFI function handle
        value, loc, attn = torch.randn(1, 5, 2, 4), torch.rand(1, 3, 2, 1, 2, 2), torch.rand(1, 3, 2, 1, 2)
        order, maps = torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, 1, 16, dtype=torch.int64)
        assert native.entries() == 0
        native.register(value, loc, attn, None, fn, False, 132, 1, 0, order, maps)
        native.register(value, loc, attn, None, fn, False, 264, 2, 1, order, maps)  # same key: replaced
        assert native.entries() == 1
        native.register(value, loc, attn, torch.rand(1, 3, 1, 4), fn, False, 132, 1, 0, order, maps)  # fused
        native.register(value.half(), loc, attn, None, fn, True, 132, 0, 0, order, maps)  # another dtype
        assert native.entries() == 3
        native.clear()
        assert native.entries() == 0
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


def test_op_tests_pass_with_the_launcher(built):
    """The CPU op, fused op, module and bad-input tests (opcheck, torch.compile, every named error) with the
    C++ kernels registered."""
    proc = run_native(
        "import sys, pytest; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', 'tests/test_op.py', "
        "'tests/test_fused.py', 'tests/test_nn.py', 'tests/test_bad_inputs.py']))"
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout


def test_off_keeps_the_python_kernels():
    proc = run_native("""
        import torch, cute_deform
        from cute_deform import native
        assert not native.LOADED
        assert not hasattr(torch.ops.cute_deform, "_forward_python")
        print("ok")
    """, mode="0")
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


def test_fresh_and_cached_kernels_have_a_handle(tmp_path, monkeypatch):
    """The registry needs each compiled kernel's TVM-FFI handle: a kernel cute.compile just built (the generic
    one wraps it, for its defaults) and the same kernel loaded back from the disk cache."""
    pytest.importorskip("cutlass")
    from cute_deform import native
    from cute_deform.hopper import compile_cache
    from cute_deform.hopper.generic import GenericConfig

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setenv("CUTE_DEFORM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(compile_cache, "_compiled", {})
    cfg = GenericConfig("float32", "float32", "float32", 2, 2, 2, 6)
    fresh = compile_cache.kernel_for(cfg)  # compiled and stored
    assert native._ffi_handle(fresh) != 0
    compile_cache._compiled.clear()
    cached = compile_cache.kernel_for(cfg)  # loaded from tmp_path
    assert cached is not fresh and native._ffi_handle(cached) != 0
    assert native._ffi_handle(object()) == 0
