"""Time the whole multi-scale deformable attention layer: fused op vs unfused, and a transformers model.

    python scripts/bench_layer.py                 # on a GPU (meant for an H100 / H200)
    python scripts/bench_layer.py --dry-run       # tiny sizes, a few calls, on the CPU: checks the script runs

Rows (medians, milliseconds, fresh random inputs from a printed seed):

1. `cute_deform.nn.MSDeformAttn` on Deformable DETR's encoder layer: N=2, levels (100,167), (50,84),
   (25,42), (13,21) (S = Lq = 22223, a query per pixel, reference points at pixel centres), d_model 256,
   8 heads, 4 points, the second image padded (padding mask); fp32, and fp16 (`.half()` weights and
   inputs, no autocast); eager, CUDA graph, torch.compile(fullgraph=True). Next to it, the same layer
   unfused: locations and softmax with torch ops, then torch.ops.cute_deform.forward (the module's
   formula before the fused op).
2. transformers' DeformableDetrModel forward, N=2, 800x1066 pixels (second image padded), random
   weights, fp32 and fp16, as shipped and after `cute_deform.integrations.transformers.patch`.
3. Host time per call of forward, forward_fused and the module on small inputs: a loop of calls timed
   on the host, synchronizing once at the end.

Rows that cannot run here (no CUDA for graphs, no transformers, a compile failure) are printed as
skipped, with the reason. GPU timings use triton.testing.do_bench (median) when triton is installed,
else CUDA events. The speedup column is fused over unfused (same dtype and mode), and patched over
as shipped.
"""
from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import time
import traceback
from dataclasses import dataclass

import torch

import cute_deform
from cute_deform import fused, op
from cute_deform.nn import MSDeformAttn
from cute_deform.reference import fused_sampling_inputs, ms_deform_attn_reference

COCO_LEVELS = ((100, 167), (50, 84), (25, 42), (13, 21))
TINY_LEVELS = ((8, 10), (4, 5), (2, 3), (1, 1))
DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


@dataclass
class Row:
    section: str
    what: str
    dtype: str
    mode: str
    ms: float | None = None
    note: str = ""


class Timer:
    """Median milliseconds per call of a function on one device."""

    def __init__(self, device: torch.device, dry_run: bool):
        self.device = device
        self.dry_run = dry_run
        self.do_bench = None
        if device.type == "cuda" and not dry_run:
            try:
                from triton.testing import do_bench
            except Exception:  # no triton: CUDA events
                pass
            else:
                self.do_bench = do_bench

    def __call__(self, fn) -> float:
        fn()  # warm-up: compile caches, lazy imports, autotuning
        self.sync()
        if self.do_bench is not None:
            return float(self.do_bench(fn, warmup=25, rep=200, return_mode="median"))
        times = []
        for _ in range(2 if self.dry_run else 30):
            if self.device.type == "cuda":
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                fn()
                end.record()
                end.synchronize()
                times.append(begin.elapsed_time(end))
            else:
                begin = time.perf_counter()
                fn()
                times.append((time.perf_counter() - begin) * 1e3)
        return statistics.median(times)

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def level_tables(levels, device):
    shapes = torch.tensor(levels, dtype=torch.int64)
    pixels = shapes.prod(-1)
    return shapes.to(device), (pixels.cumsum(0) - pixels).to(device)


def pixel_centres(levels) -> torch.Tensor:
    """(S, 2): every pixel's centre as (x, y) in [0, 1] of its own level, levels back to back."""
    centres = []
    for height, width in levels:
        y, x = torch.meshgrid((torch.arange(height) + 0.5) / height, (torch.arange(width) + 0.5) / width, indexing="ij")
        centres.append(torch.stack([x.flatten(), y.flatten()], -1))
    return torch.cat(centres)


def padding_mask(levels, batch: int) -> torch.Tensor:
    """(N, S) bool, True at padding: the last image covers the left 3/4 and top 7/8 of each level."""
    masks = []
    for height, width in levels:
        pad = torch.zeros((batch, height, width), dtype=torch.bool)
        pad[-1, :, math.ceil(width * 3 / 4):] = True
        pad[-1, math.ceil(height * 7 / 8):] = True
        masks.append(pad.flatten(1))
    return torch.cat(masks, 1)


def encoder_layer(levels, d_model, heads, points, batch, dtype, device, gen):
    """An MSDeformAttn with random weights (offsets: the init pattern plus small query-dependent
    changes) and its encoder inputs."""
    L = len(levels)
    module = MSDeformAttn(d_model, L, heads, points)
    with torch.no_grad():
        module.sampling_offsets.weight.copy_(0.01 * torch.randn(module.sampling_offsets.weight.shape, generator=gen))
        module.attention_weights.weight.copy_(torch.randn(module.attention_weights.weight.shape, generator=gen)
                                              / math.sqrt(d_model))
    module = module.to(device=device, dtype=dtype).eval()
    shapes, starts = level_tables(levels, device)
    S = int(shapes.prod(-1).sum())
    query = torch.randn((batch, S, d_model), generator=gen).to(device, dtype)
    flat = torch.randn((batch, S, d_model), generator=gen).to(device, dtype)
    ref = pixel_centres(levels)[None, :, None, :].expand(batch, S, L, 2).to(device, dtype)
    mask = padding_mask(levels, batch).to(device)
    return module, (query, ref, flat, shapes, starts, mask)


def unfused_layer(module, query, reference_points, flat, shapes, starts, mask, forward=None):
    """The layer as MSDeformAttn computed it before the fused op: locations and softmax with torch ops
    (in the layers' dtype), then forward (torch.ops.cute_deform.forward)."""
    N, Lq, _ = query.shape
    S = flat.shape[1]
    M, L, P = module.n_heads, module.n_levels, module.n_points
    value = module.value_proj(flat).masked_fill(mask[..., None], 0.0).view(N, S, M, module.d_model // M)
    offsets = module.sampling_offsets(query).view(N, Lq, M, L, P, 2)
    weights = module.attention_weights(query).view(N, Lq, M, L * P).softmax(-1).view(N, Lq, M, L, P)
    pixels = shapes.flip(-1).to(offsets.dtype)
    locations = reference_points[:, :, None, :, None, :] + offsets / pixels[None, None, None, :, None, :]
    forward = forward or torch.ops.cute_deform.forward
    return module.output_proj(forward(value, shapes, starts, locations, weights))


def float64_layer(module, query, reference_points, flat, shapes, starts, mask):
    """The layer's output in float64 (the module's weights and the inputs as given, every operation in float64,
    the reference semantics): what both layers' errors are measured against."""
    wide = copy.deepcopy(module).double()
    inputs = [t.double() if t.is_floating_point() else t for t in (query, reference_points, flat)]
    return unfused_layer(wide, *inputs, shapes, starts, mask, forward=ms_deform_attn_reference)


def cuda_graph(fn):
    """fn captured in a CUDA graph; returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def rel_err(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def reason_of(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:120] if text else ''}"


def bench_layer(rows, timer, device, opts, gen):
    levels = TINY_LEVELS if opts.dry_run else COCO_LEVELS
    d_model = 32 if opts.dry_run else 256
    section = "MSDeformAttn, Deformable DETR encoder layer"
    for dtype_name in opts.dtypes:
        dtype = DTYPES[dtype_name]
        module, inputs = encoder_layer(levels, d_model, 8, 4, 2, dtype, device, gen)
        layers = {"fused (forward_fused)": lambda: module(*inputs), "unfused (torch + forward)":
                  lambda: unfused_layer(module, *inputs)}
        notes = {}
        with torch.no_grad():
            try:
                exact = float64_layer(module, *inputs)
                notes = {what: f"rel err vs float64 {rel_err(fn(), exact):.1e}" for what, fn in layers.items()}
            except Exception as exc:
                notes = dict.fromkeys(layers, f"check failed: {reason_of(exc)}")
            for what, fn in layers.items():
                for mode in ("eager", "CUDA graph", "torch.compile"):
                    row = Row(section, what, dtype_name, mode, note=notes.get(what, "") if mode == "eager" else "")
                    rows.append(row)
                    if mode == "CUDA graph" and device.type != "cuda":
                        row.note = "skipped: needs a CUDA device"
                        continue
                    if mode == "torch.compile" and opts.no_compile:
                        row.note = "skipped: --no-compile"
                        continue
                    try:
                        if mode == "eager":
                            run = fn
                        elif mode == "CUDA graph":
                            run = cuda_graph(fn)
                        else:
                            torch._dynamo.reset()
                            run = torch.compile(fn, fullgraph=True)
                        row.ms = timer(run)
                    except Exception as exc:
                        row.note = f"skipped: {reason_of(exc)}"
                        if opts.verbose:
                            traceback.print_exc()


def bench_transformers(rows, timer, device, opts, gen):
    section = "transformers DeformableDetrModel forward"
    try:
        import transformers
        from cute_deform.integrations import transformers as cdt
    except Exception as exc:
        rows.append(Row(section, "as shipped / patched", "-", "eager", note=f"skipped: {reason_of(exc)} "
                        "(pip install -e \".[transformers]\")"))
        return
    section += f" (transformers {transformers.__version__})"
    if opts.dry_run:
        backbone = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16, 16, 16], depths=[1, 1, 1, 1],
                                             out_features=["stage2", "stage3", "stage4"])
        sizes = dict(d_model=32, encoder_layers=1, decoder_layers=1, encoder_ffn_dim=32, decoder_ffn_dim=32,
                     encoder_attention_heads=4, decoder_attention_heads=4, num_queries=10)
        height, width = 64, 80
    else:
        # ResNet-50 as transformers builds it (random weights: no download, no timm needed).
        backbone = transformers.ResNetConfig(out_features=["stage2", "stage3", "stage4"])
        sizes = {}
        height, width = 800, 1066
    named = {"backbone": None} if int(transformers.__version__.split(".")[0]) < 5 else {}
    config = transformers.DeformableDetrConfig(backbone_config=backbone, use_timm_backbone=False,
                                               use_pretrained_backbone=False, **named, **sizes)
    torch.manual_seed(int(torch.randint(2**62, (1,), generator=gen)))
    model = transformers.DeformableDetrModel(config).eval()
    pixels = torch.randn((2, 3, height, width), generator=gen)
    mask = torch.ones((2, height, width), dtype=torch.long)
    mask[1, :, width * 3 // 4:] = 0
    for dtype_name in opts.dtypes:
        dtype = DTYPES[dtype_name]
        model = model.to(device=device, dtype=dtype)
        inputs = dict(pixel_values=pixels.to(device, dtype), pixel_mask=mask.to(device))
        outputs = {}
        for what in ("as shipped", "patched"):
            row = Row(section, what, dtype_name, "eager")
            rows.append(row)
            try:
                if what == "patched":
                    row.note = f"{cdt.patch(model)} modules patched"
                with torch.no_grad():
                    outputs[what] = model(**inputs).last_hidden_state
                    row.ms = timer(lambda: model(**inputs))
            except Exception as exc:
                row.note = f"skipped: {reason_of(exc)}"
                if opts.verbose:
                    traceback.print_exc()
        cdt.unpatch(model)
        if len(outputs) == 2:
            rows[-1].note += f"; last_hidden_state vs shipped: rel err {rel_err(outputs['patched'], outputs['as shipped']):.1e}"


def host_seconds_per_call(fn, device, number: int, loops: int, warmup: int) -> float:
    """Median over `loops` loops of `number` calls of fn, each loop after a sync and with none inside: with
    fewer calls than the launch queue holds, the loop never waits for the GPU, so the time is the host's."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(loops):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        begin = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - begin) / number)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return sorted(times)[len(times) // 2]


def bench_host(rows, device, opts, gen):
    """Host microseconds per call: small inputs, loops of calls shorter than the launch queue, no sync inside."""
    section = "host time per call (N=1, Lq=64, M=8, D=32, P=4, 4 levels)"
    levels = TINY_LEVELS if opts.dry_run else COCO_LEVELS
    shapes, starts = level_tables(levels, device)
    S = int(shapes.prod(-1).sum())
    N, Lq, M, D, L, P = 1, 64, 8, 32, len(levels), 4
    value = torch.randn((N, S, M, D), generator=gen).to(device, torch.float16)
    ref = torch.rand((N, Lq, L, 2), generator=gen).to(device)
    offsets = torch.randn((N, Lq, M, L, P, 2), generator=gen).to(device)
    logits = torch.randn((N, Lq, M, L, P), generator=gen).to(device)
    locations, weights = fused_sampling_inputs(shapes, ref, offsets, logits)
    module, inputs = encoder_layer(levels, M * D, M, P, N, torch.float16, device, gen)
    query = inputs[0][:, :Lq]
    calls = {
        "torch.ops.cute_deform.forward": lambda: torch.ops.cute_deform.forward(value, shapes, starts, locations, weights),
        "torch.ops.cute_deform.forward_fused": lambda: torch.ops.cute_deform.forward_fused(
            value, shapes, starts, ref, offsets, logits),
        "MSDeformAttn (Lq=64)": lambda: module(query, ref.half(), *inputs[2:]),
    }
    # Fewer calls than the launch queue holds: the loop never waits for the GPU, so the time is the host's.
    number = 20 if opts.dry_run else 200
    for mode, context in (("no_grad", torch.no_grad), ("inference_mode", torch.inference_mode)):
        for what, fn in calls.items():
            row = Row(section, what, "fp16 value", mode)
            rows.append(row)
            try:
                with context():
                    row.ms = host_seconds_per_call(fn, device, number, loops=5, warmup=min(number, 100)) * 1e3
                row.note = "host us per call (median of 5 loops of %d): %.1f" % (number, row.ms * 1e3)
                if device.type == "cpu":
                    row.note += " (CPU: includes the computation)"
            except Exception as exc:
                row.note = f"skipped: {reason_of(exc)}"


def describe_paths(device) -> list[str]:
    if device.type != "cuda":
        return [f"device {device}: the ops' CPU paths (reference arithmetic), not the Hopper kernel"]
    index = device.index if device.index is not None else torch.cuda.current_device()
    lines = [f"device {torch.cuda.get_device_name(index)}"]
    reason = op.kernel_unavailable_reason(index)
    lines.append("forward: " + ("the Hopper kernel" if reason is None else f"slow path ({reason})"))
    fused_reason = reason or fused._hopper_fused_unavailable_reason()
    lines.append("forward_fused: " + ("the Hopper kernel (locations and softmax inside)" if fused_reason is None
                                      else f"torch locations + forward ({fused_reason})"))
    return lines


def print_table(rows):
    header = ("benchmark", "dtype", "mode", "ms", "speedup", "note")
    baseline = {(r.section, r.dtype, r.mode): r.ms for r in rows if r.what.startswith("unfused") and r.ms}
    shipped = {(r.section, r.dtype): r.ms for r in rows if r.what == "as shipped" and r.ms}
    table = []
    for r in rows:
        ms = "-" if r.ms is None else f"{r.ms:.3f}"
        base = baseline.get((r.section, r.dtype, r.mode)) if r.what.startswith("fused") else None
        if r.what == "patched":
            base = shipped.get((r.section, r.dtype))
        ratio = f"{base / r.ms:.2f}x" if base and r.ms else ""
        table.append((f"{r.what}", r.dtype, r.mode, ms, ratio, r.note))
    widths = [max(len(str(x)) for x in column) for column in zip(header, *table)]
    section = None
    for r, line in zip(rows, table):
        if r.section != section:
            section = r.section
            print(f"\n{section}")
            print("  " + "  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
        print("  " + "  ".join(str(c).ljust(w) for c, w in zip(line, widths)).rstrip())


def precompile_kernels(opts) -> None:
    """The Hopper kernels the rows run (fused with 2-d and box reference points, unfused), compiled in
    parallel processes into the disk cache first, so no row waits for a compile."""
    from cute_deform.hopper import compile_cache, launch_rules
    from cute_deform.hopper.config import KernelConfig

    names = {"fp32": "float32", "fp16": "float16"}
    configs = []
    for dtype in opts.dtypes:
        dt = names[dtype]
        for ref_dtype in {dt, "float32"}:
            for ref_dims in (2, 4):
                configs.append(KernelConfig(dt, dt, dt, 8, 4, 4, 32, fused=True, ref_dtype=ref_dtype,
                                            ref_dims=ref_dims, **launch_rules.TUNING))
        configs.append(KernelConfig(dt, dt, dt, 8, 4, 4, 32, **launch_rules.TUNING))
        configs.append(KernelConfig(dt, "float32", "float32", 8, 4, 4, 32, **launch_rules.TUNING))
    t0 = time.time()
    compile_cache.precompile(configs)
    print(f"  precompiled {len(configs)} kernel configurations (and their launch variants) in {time.time() - t0:.0f} s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "fp16"])
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes and a few calls (on the CPU by default)")
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    parser.add_argument("--skip", nargs="*", default=[], choices=["layer", "transformers", "host"])
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--verbose", action="store_true", help="print tracebacks of skipped rows")
    opts = parser.parse_args(argv)
    if opts.dry_run and "--device" not in " ".join(argv if argv is not None else sys.argv):
        opts.device = "cpu"
    device = torch.device(opts.device)
    gen = torch.Generator()
    seed = gen.seed() if opts.seed is None else gen.manual_seed(opts.seed).initial_seed()

    print(f"cute_deform {cute_deform.__version__} bench_layer, torch {torch.__version__}, seed {seed}"
          + (", DRY RUN (tiny sizes)" if opts.dry_run else ""))
    for line in describe_paths(device):
        print("  " + line)
    if device.type == "cuda" and op.kernel_unavailable_reason(device.index or 0) is None:
        precompile_kernels(opts)
    timer = Timer(device, opts.dry_run)
    rows: list[Row] = []
    if "layer" not in opts.skip:
        bench_layer(rows, timer, device, opts, gen)
    if "transformers" not in opts.skip:
        bench_transformers(rows, timer, device, opts, gen)
    if "host" not in opts.skip:
        bench_host(rows, device, opts, gen)
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
