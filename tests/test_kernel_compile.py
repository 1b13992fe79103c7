"""Every CuTe kernel variant compiles for sm_90a on a machine without a GPU, and its PTX holds the
instructions the design depends on. Also the disk cache of compiled kernels."""
import dataclasses
import re

import pytest

msda_fwd = pytest.importorskip("cute_deform.msda_fwd")
if not msda_fwd.available():
    pytest.skip("nvidia-cutlass-dsl is not importable", allow_module_level=True)

KernelConfig = msda_fwd.KernelConfig

# (name, config): the code paths of the kernel. fine_gather picks how unstaged levels are read
# (ldg = 16-byte loads through L1, tma = one TMA box per sample through the ring), cluster_size=2
# adds TMA multicast of the staged levels, stage_bytes=0 sends every level the unstaged way; dtypes
# and head dims change the vector widths and the threads per query.
VARIANTS = [
    ("default", KernelConfig("float16", "float32", "float32", 8, 4, 4, 32)),
    ("ldg-cluster1", KernelConfig("float16", "float32", "float32", 8, 4, 8, 32, fine_gather="ldg", cluster_size=1)),
    ("ldg-nostage-bf16", KernelConfig("bfloat16", "bfloat16", "bfloat16", 8, 4, 4, 64, fine_gather="ldg",
                                      stage_bytes=0, cluster_size=1)),
    ("tma-cluster1", KernelConfig("float16", "float32", "float32", 8, 4, 4, 32, fine_gather="tma", num_groups=3,
                                  num_stages=4, cluster_size=1)),
    ("tma-cluster2-fp32", KernelConfig("float32", "float16", "float32", 4, 3, 2, 32, fine_gather="tma",
                                       num_groups=2, num_stages=4, cluster_size=2)),
    ("tma-nostage-d16", KernelConfig("float16", "float16", "float16", 1, 5, 16, 16, fine_gather="tma",
                                     num_groups=2, num_stages=4, stage_bytes=0, cluster_size=1)),
    ("ldg-fp32-d64-l1p1", KernelConfig("float32", "float32", "float32", 1, 1, 1, 64, fine_gather="ldg")),
    ("ldg-bf16-d128", KernelConfig("bfloat16", "float32", "float16", 2, 2, 8, 128, fine_gather="ldg")),
    ("ldg-prefetch-fp16", KernelConfig("float16", "float16", "float16", 8, 4, 8, 32, fine_gather="ldg", num_groups=5,
                                       num_stages=2, cluster_size=2)),
    ("ldg-records", KernelConfig("float16", "float32", "float32", 8, 4, 4, 32, fine_gather="ldg", num_groups=5,
                                 num_stages=1, cluster_size=2, footprint_records=True)),
]


@pytest.fixture(scope="module")
def ptx_of(tmp_path_factory):
    """Compile each variant once, with its PTX dumped to its own folder."""
    texts = {}
    root = tmp_path_factory.mktemp("ptx")
    for name, cfg in VARIANTS:
        folder = root / name
        folder.mkdir()
        msda_fwd.compile_kernel(cfg, f"--keep-ptx --dump-dir={folder}")
        files = list(folder.glob("*.sm_90a.ptx"))
        assert len(files) == 1, f"{name}: expected one sm_90a PTX file, found {files}"
        texts[name] = files[0].read_text()
    return texts


def configs_of(name):
    return dict(VARIANTS)[name]


@pytest.mark.parametrize("name", [n for n, _ in VARIANTS])
def test_variant_compiles_for_sm90a_with_tma_and_mbarriers(ptx_of, name):
    ptx = ptx_of[name]
    cfg = configs_of(name)
    assert re.search(r"^\.target sm_90a", ptx, re.M), "not compiled for sm_90a"
    # Whole coarse levels (and with fine_gather=tma every footprint) arrive by TMA on an mbarrier.
    assert "cp.async.bulk.tensor.4d" in ptx and "mbarrier::complete_tx::bytes" in ptx
    assert "mbarrier.try_wait" in ptx
    # Tensor maps are patched on the device, never built from host-read level sizes.
    assert "tensormap.replace.tile.global_dim" in ptx and "tensormap.cp_fenceproxy" in ptx
    assert "fence.proxy.tensormap::generic.acquire" in ptx
    boxes = "cp.async.bulk.tensor.5d" in ptx
    assert boxes == (cfg.fine_gather == "tma"), "2x2xD footprint boxes only in the TMA gather variant"
    if cfg.fine_gather == "ldg":
        assert re.search(r"ld\.global(\.nc)?\.v4", ptx), "L1 gathers should be 16-byte vector loads"
    # With L1 gathers, producers prefetch each tile's locations and weights: two more 4-D TMA loads
    # (shapes whose rows are not a multiple of 16 bytes read them in the consumers instead).
    loads_4d = len(re.findall(r"^\s*cp\.async\.bulk\.tensor\.4d", ptx, re.M))
    assert loads_4d == cfg.num_levels + (2 if cfg.prefetch_inputs else 0)
    # Footprint records: a named barrier per group (bar.sync with a thread count) between the phases.
    assert cfg.records == bool(re.search(r"bar(rier)?\.sync(\.aligned)?\s+%?\w+,\s*128;", ptx))
    multicast = ".multicast::cluster" in ptx
    assert multicast == (cfg.cluster_size > 1)
    # The shared-memory reads of boxes and staged pixels are 16-byte vectors.
    assert "ld.shared.v4" in ptx


def test_cache_key_depends_only_on_static_parameters():
    a = KernelConfig("float16", "float32", "float32", 8, 4, 4, 32)
    assert msda_fwd.cache_key(a) == msda_fwd.cache_key(KernelConfig("float16", "float32", "float32", 8, 4, 4, 32))
    assert msda_fwd.cache_key(a) != msda_fwd.cache_key(KernelConfig("float16", "float32", "float32", 8, 4, 8, 32))
    fields = {f.name for f in dataclasses.fields(KernelConfig)}
    assert not fields & {"batch", "num_queries", "num_keys", "height", "width"}


def test_disk_cache_stores_loads_and_rebuilds_a_corrupt_entry(tmp_path, monkeypatch):
    monkeypatch.setenv("CUTE_DEFORM_CACHE_DIR", str(tmp_path))
    cfg = KernelConfig("float16", "float16", "float16", 2, 1, 1, 16, fine_gather="ldg", cluster_size=1)
    monkeypatch.setattr(msda_fwd, "_compiled", {})
    compiled = msda_fwd._kernel_for(cfg)
    entry = tmp_path / f"msda_fwd_{msda_fwd.cache_key(cfg)}.o"
    assert entry.is_file() and entry.stat().st_size > 10_000
    assert not list(tmp_path.glob(".tmp-*")), "temporary files must be renamed or removed"

    monkeypatch.setattr(msda_fwd, "_compiled", {})
    monkeypatch.setattr(msda_fwd, "compile_kernel", lambda *a, **k: pytest.fail("should load from disk"))
    loaded = msda_fwd._kernel_for(cfg)
    assert callable(loaded) and loaded is not compiled

    entry.write_bytes(b"not an object file")
    monkeypatch.setattr(msda_fwd, "_compiled", {})
    monkeypatch.undo()
    monkeypatch.setenv("CUTE_DEFORM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(msda_fwd, "_compiled", {})
    rebuilt = msda_fwd._kernel_for(cfg)
    assert callable(rebuilt)
    assert entry.stat().st_size > 10_000, "the corrupt entry was replaced by a good one"


def test_cache_can_be_moved_or_disabled(tmp_path, monkeypatch):
    monkeypatch.setenv("CUTE_DEFORM_CACHE_DIR", str(tmp_path / "here"))
    assert msda_fwd.cache_dir() == tmp_path / "here"
    monkeypatch.setenv("CUTE_DEFORM_CACHE_DIR", "off")
    assert msda_fwd.cache_dir() is None
    monkeypatch.delenv("CUTE_DEFORM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert msda_fwd.cache_dir() == tmp_path / "cute_deform"


def test_precompile_covers_the_gather_order_the_launch_may_pick():
    cfg = KernelConfig("float16", "float32", "float32", 8, 4, 4, 32, **msda_fwd.TUNING)
    variants = msda_fwd.launch_variants(cfg)
    assert variants == [cfg, dataclasses.replace(cfg, l1_first=True)]
    assert msda_fwd.launch_variants(variants[1]) == [variants[1]]
    even_split = dataclasses.replace(cfg, whole_segments=False)
    assert msda_fwd.launch_variants(even_split) == [even_split]
