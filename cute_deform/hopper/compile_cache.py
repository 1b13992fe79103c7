"""The compile cache of the Hopper kernels: a configuration compiled once per process (in memory) and once per machine
(on disk, keyed by the configuration, the kernels' source, the DSL version and the target), and compiled ahead in
parallel processes (precompile).

    kernel_for(cfg)        the compiled kernel of one static configuration
    compile_kernel(cfg)    compile it; needs no GPU (CUTE_DSL_ARCH=sm_90a compiles anywhere)
    precompile(configs)    fill the disk cache with configurations and the variants their launches may pick
"""
from __future__ import annotations

import dataclasses
import hashlib
import inspect
import os
import tempfile
from pathlib import Path

try:
    import cutlass
    import cutlass.cute as cute
    import cutlass.runtime
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
except Exception:  # the package works without the DSL, through the reference path
    pass

from .._cache import cache_dir
from .config import TARGET_ARCH, KernelConfig
from .generic import GenericConfig
from .launch_rules import launch_variants
from .order import OrderConfig

# Modules that run on the host only: their source is not part of a compiled kernel's key (_source_digest).
HOST_MODULES = frozenset({"interface.py", "launch_rules.py", "compile_cache.py"})

_compiled: dict = {}


def _dsl(name: str):
    return {"float32": cutlass.Float32, "float16": cutlass.Float16, "bfloat16": cutlass.BFloat16}[name]


def _row_major(dtype, shape, align=None):
    return make_fake_compact_tensor(dtype, shape, stride_order=tuple(range(len(shape) - 1, -1, -1)), assumed_align=align)


def _fake_args(cfg):
    """Fake tensors with symbolic N, S, Lq and grid: one compiled kernel serves every size."""
    if isinstance(cfg, OrderConfig):  # positions (N, Lq, row), the levels (L, 2), the cells and the table (N, Lq)
        n, lq = cute.sym_int(), cute.sym_int()
        return [_row_major(_dsl(cfg.position_dtype), (n, lq, cute.sym_int())),
                _row_major(cutlass.Int64, (cute.sym_int(), 2)), _row_major(cutlass.Int32, (n, lq)),
                _row_major(cutlass.Int64, (n, lq))]
    n, s, lq, grid = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
    M, L, P, D = cfg.num_heads, cfg.num_levels, cfg.num_points, cfg.head_dim
    vdt, ldt, adt = _dsl(cfg.value_dtype), _dsl(cfg.loc_dtype), _dsl(cfg.attn_dtype)
    tiled = isinstance(cfg, KernelConfig)
    # The tiled kernel loads rows of locations and weights as vectors; the generic one element by element.
    loc_align, attn_align = (16, 16) if tiled else (4, 2)
    loc = _row_major(ldt, (n, lq, M, L, P, 2), loc_align)
    args = [
        _row_major(vdt, (n, s, M, D), 16),
        _row_major(cutlass.Int64, (L, 2)),
        _row_major(cutlass.Int64, (L,)),
        loc,
        _row_major(adt, (n, lq, M, L, P), attn_align),
        _row_major(_dsl(cfg.ref_dtype), (n, lq, L, cfg.ref_dims), 8) if cfg.fused else loc,
        _row_major(vdt, (n, lq, M * D), 16),
    ]
    if not tiled:
        return args + [cutlass.Int32(1)]
    order = _row_major(cutlass.Int64, (cute.sym_int(), cute.sym_int()))  # (N, Lq), or a stand-in
    return args[:6] + [order, args[6], _row_major(cutlass.Int64, (grid, cfg.map_slots, 16), 128),
                       cutlass.Int32(1), cutlass.Int32(1), cutlass.Int32(0)]


def compile_kernel(cfg, extra_options: str = ""):
    """Compile one static configuration. Needs no GPU: with CUTE_DSL_ARCH=sm_90a it compiles anywhere,
    and extra_options="--keep-ptx --dump-dir=DIR" writes the PTX."""
    if isinstance(cfg, GenericConfig):
        from .generic import MSDAGeneric as Kernel
    elif isinstance(cfg, OrderConfig):
        from .order import QueryOrder as Kernel
    else:
        from .kernel import MSDAForward as Kernel
    return cute.compile(
        Kernel(cfg), *_fake_args(cfg), make_fake_stream(use_tvm_ffi_env_stream=True),
        options=f"--enable-tvm-ffi --gpu-arch={TARGET_ARCH} {extra_options}".strip(),
    )


_SOURCE_DIGEST = None


def _source_digest() -> bytes:
    """What a compiled kernel is made of: every module of this package but the host-side ones (HOST_MODULES),
    and from this one the compile call and the argument signature. A change to the launch rules or the torch glue
    keeps the cache."""
    global _SOURCE_DIGEST
    if _SOURCE_DIGEST is None:
        digest = hashlib.sha256()
        for path in sorted(Path(__file__).parent.glob("*.py")):
            if path.name not in HOST_MODULES:
                digest.update(path.read_bytes())
        for fn in (_fake_args, compile_kernel, _dsl, _row_major):
            digest.update(inspect.getsource(fn).encode())
        _SOURCE_DIGEST = digest.digest()
    return _SOURCE_DIGEST


def cache_key(cfg) -> str:
    """Changes with the configuration, the kernels' source, the DSL version and the target."""
    text = type(cfg).__name__ + repr(dataclasses.astuple(cfg)) + cutlass.__version__ + TARGET_ARCH
    return hashlib.sha256(_source_digest() + text.encode()).hexdigest()[:20]


def _load_cached(path: Path, symbol: str):
    try:
        return getattr(cutlass.runtime.load_module(str(path), enable_tvm_ffi=True), symbol)
    except Exception:
        # A corrupt or stale entry (interrupted write, other DSL build): drop it and rebuild.
        path.unlink(missing_ok=True)
        return None


def _store_cached(fn, path: Path, symbol: str) -> None:
    """Write to a private file, then rename: concurrent processes never see a partial entry. A cache
    that cannot be written is skipped, never an error."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".o")
        os.close(fd)
    except OSError:
        return
    try:
        fn.export_to_c(tmp, symbol)
        os.replace(tmp, path)
    except OSError:
        Path(tmp).unlink(missing_ok=True)


def kernel_for(cfg):
    """The compiled kernel for a configuration: from memory, else from the disk cache, else compiled
    (and stored)."""
    fn = _compiled.get(cfg)
    if fn is not None:
        return fn
    directory = cache_dir()
    if directory is not None:
        key = cache_key(cfg)
        path, symbol = directory / f"msda_{key}.o", f"msda_{key}"
        if path.exists():
            fn = _load_cached(path, symbol)
    if fn is None:
        fn = compile_kernel(cfg)
        if directory is not None:
            _store_cached(fn, path, symbol)
    _compiled[cfg] = fn
    return fn


def _compile_into_cache(cfg) -> str:
    kernel_for(cfg)
    return repr(cfg)


def precompile(configs, jobs: int | None = None, variants: bool = True) -> None:
    """Compile configurations, and (with variants) the variants their launches may pick, into the disk
    cache in parallel processes (each compile is single threaded); later processes, and this one, load
    them in ms."""
    import concurrent.futures
    import multiprocessing

    variants = [v for cfg in configs for v in (launch_variants(cfg) if variants else [cfg])]
    # Launches through the order table also run the order kernel on their positions.
    variants += [OrderConfig(cfg.ref_dtype if cfg.fused else cfg.loc_dtype) for cfg in variants
                 if isinstance(cfg, KernelConfig) and cfg.permuted]
    todo = [cfg for cfg in dict.fromkeys(variants) if cfg not in _compiled]
    if cache_dir() is None or len(todo) <= 1:
        for cfg in todo:
            kernel_for(cfg)
        return
    jobs = jobs or max(1, min(len(todo), (os.cpu_count() or 2)))
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_compile_into_cache, todo))
