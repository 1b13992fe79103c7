"""The Hopper (sm_90a) kernels of cute_deform, written in the CuTe DSL.

One concern per module:
- config.py          static parameters (KernelConfig) and the shared-memory plan
- tile_scheduler.py  which tiles each cluster works on, in rounds that keep L2 warm in any query order
- pipeline.py        the producer/consumer rings (cutlass.pipeline), the staging barrier
- inputs.py          a query's locations and weights: prefetched or from global; fused or not
- sampling.py        the per-sample bilinear arithmetic
- kernel.py          the tiled kernel (MSDAForward): TMA atoms, shared storage, producer and consumer roles
- generic.py         the generic kernel for every other shape (any head dim, more levels or points)
- order.py           the order table: each image's queries by position (a counting sort on the device)
- launch_rules.py    the knobs, grid and schedule each launch takes from the problem's size, with their measurements
- compile_cache.py   compiled kernels in memory and on disk, and compiling ahead (precompile)
- interface.py       torch glue: the configuration of a call, its launch plan, the launch
"""
from .interface import available, check_supported, msda_forward, msda_forward_fused  # noqa: F401
