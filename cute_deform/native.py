"""The op's launcher in C++ (`csrc/launcher.cpp`): the CUDA and Autograd kernels of
`torch.ops.cute_deform.forward` and `forward_fused`.

A call the Python side has launched before (same dtypes, sizes and device) then runs with no Python:
the C++ kernel checks the inputs, allocates the output and calls the compiled kernel's TVM-FFI entry
on torch's current stream. Every other call goes to the Python implementation (registered as
`cute_deform::_forward_python` / `_forward_fused_python`), which plans, launches and hands the launch
over (`register`).

Built with torch.utils.cpp_extension (a C++ compiler and ninja; no CUDA toolkit) once per torch and
TVM-FFI version and source, into the kernel cache directory. CUTE_DEFORM_NATIVE chooses:
- "auto" (default): build and load where torch sees a CUDA device;
- "1": always (the CPU tests use it to check the registration);
- "0": never; the op stays all Python.
A build that fails leaves the op all Python, with one NativeLauncherWarning.
"""
from __future__ import annotations

import hashlib
import os
import sys
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).parent / "csrc" / "launcher.cpp"

LOADED = False  # the C++ kernels are registered (decided once, by load(), when the op module imports)
_error: str | None = None


class NativeLauncherWarning(UserWarning):
    """The C++ launcher could not be built or loaded; the op runs its Python launch path."""


def wanted() -> bool:
    mode = os.environ.get("CUTE_DEFORM_NATIVE", "auto").strip().lower()
    if mode in ("0", "off", "false", "no"):
        return False
    if mode in ("1", "on", "true", "yes"):
        return True
    # is_available() does not create a CUDA context (forked workers stay safe).
    return torch.cuda.is_available()


def build_directory() -> Path:
    import tvm_ffi

    from ._cache import cache_dir, user_cache_dir

    # One directory per source too: launcher.so there is this source's build, or absent.
    source = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    tag = (f"torch-{torch.__version__}-tvm_ffi-{tvm_ffi.__version__}-py{sys.version_info[0]}{sys.version_info[1]}"
           f"-{source}")
    # With the kernel cache off, a per-user build directory still avoids rebuilding.
    base = cache_dir() or user_cache_dir()
    return base / "launcher" / tag.replace("+", "_")


def build(verbose: bool = False) -> str:
    """Build (or find built) the launcher library; returns its path. Raises where it cannot be built."""
    import torch.utils.cpp_extension as cpp_extension
    import tvm_ffi.libinfo

    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    library = Path(tvm_ffi.libinfo.find_libtvm_ffi())
    if not (directory / "launcher.so").exists():
        print("cute_deform: building the C++ launcher (once per torch version and launcher source, about half a minute)...",
              file=sys.stderr, flush=True)
    cpp_extension.load(
        name="launcher",
        sources=[str(SOURCE)],
        extra_cflags=["-O2"],
        extra_include_paths=[tvm_ffi.libinfo.find_include_path()],
        extra_ldflags=[f"-L{library.parent}", f"-l:{library.name}", f"-Wl,-rpath,{library.parent}"],
        build_directory=str(directory),
        with_cuda=False,
        is_python_module=False,
        verbose=verbose,
    )
    return str(directory / "launcher.so")


def load() -> bool:
    """Build and load the launcher where wanted(); called once, before the op's kernels are registered."""
    global LOADED, _error
    if LOADED or _error is not None or not wanted():
        return LOADED
    try:
        build()
    except Exception as exc:  # no compiler, no ninja, a broken install: the Python path still works
        _error = f"{type(exc).__name__}: {exc}"
        warnings.warn(f"cute_deform: the C++ launcher is unavailable ({_error}); the op launches from Python.",
                      NativeLauncherWarning, stacklevel=2)
        return False
    from ._checks import FORWARD_ONLY, FUSED_FORWARD_ONLY

    torch.ops.cute_deform._native_set_messages(FORWARD_ONLY, FUSED_FORWARD_ONLY)
    LOADED = True
    return True


def _ffi_handle(function) -> int:
    """The TVM-FFI function handle of a compiled kernel, 0 where it has none. A kernel loaded from the disk
    cache is a tvm_ffi.Function; one cute.compile just built may wrap it (a kernel with defaults)."""
    import tvm_ffi

    for candidate in (function, getattr(function, "_tvm_ffi_function", None)):
        if isinstance(candidate, tvm_ffi.Function):
            return candidate.__chandle__()
    return 0


def register(value, sampling, weights, reference, function, generic, grid, rounds, whole, order, maps) -> None:
    """Hand a launch the Python side just made to the C++ kernels: later calls with the same dtypes,
    sizes and device run it from C++. function: the compiled kernel. (A kernel without a TVM-FFI handle
    stays with Python.)"""
    handle = _ffi_handle(function)
    if handle:
        torch.ops.cute_deform._native_register(
            value, sampling, weights, reference, handle, int(generic), int(grid), int(rounds), int(whole), order,
            maps,
        )


def clear() -> None:
    """Forget every registered launch (the next call of each kind goes through Python again)."""
    if LOADED:
        torch.ops.cute_deform._native_clear()


def entries() -> int:
    return int(torch.ops.cute_deform._native_entries()) if LOADED else 0
