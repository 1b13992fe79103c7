"""Synchronisation between the warps of a CTA (and a cluster).

- GroupRings: each group's ring of shared-memory stages between the producer warp that feeds it (TMA
  loads) and the group's four consumer warps. All groups' rings are one `cutlass.pipeline.PipelineTmaAsync` of
  groups * stages stages: group g uses stages g, g + groups, g + 2 * groups, ..., so one copy of each
  role's code serves every group (the group is a run-time value).
- StagingBarrier: one mbarrier that the staged levels of each segment land on (TMA, possibly
  multicast by the peer CTA); its phase flips once per segment.
- segment_sync: every warp of the CTA (or cluster) is done with the last segment's staged levels.
"""
from __future__ import annotations

from dataclasses import dataclass

try:
    import cutlass
    import cutlass.cute as cute
    from cutlass.pipeline import Agent, CooperativeGroup, PipelineState, PipelineTmaAsync
except Exception:
    pass

from .config import CONSUMER_WARPS


@dataclass(frozen=True)
class GroupRings:
    """Rings of `stages` stages per group, each stage filled by TMA with tx_count bytes. Read only, so
    the DSL's loops need not carry it; the position in a ring is a PipelineState, which a group advances by `groups` stages
    (`state.advance(rings.groups)`, written in the loop that carries the state)."""

    pipeline: object
    groups: int
    stages: int  # of all groups together

    @staticmethod
    def create(barrier_storage, groups: int, stages: int, tx_count: int) -> "GroupRings":
        # Barrier init by warp 0 (inside create); the kernel fences and syncs once for everything.
        ring = PipelineTmaAsync.create(
            num_stages=groups * stages,
            producer_group=CooperativeGroup(Agent.Thread, 1),
            consumer_group=CooperativeGroup(Agent.Thread, CONSUMER_WARPS),
            tx_count=tx_count,
            barrier_storage=barrier_storage,
            defer_sync=True,
        )
        return GroupRings(ring, groups, groups * stages)

    def producer_state(self, group):
        return PipelineState(self.stages, cutlass.Int32(0), cutlass.Int32(group), cutlass.Int32(1))

    def consumer_state(self, group):
        return PipelineState(self.stages, cutlass.Int32(0), cutlass.Int32(group), cutlass.Int32(0))

    @cute.jit
    def acquire(self, state):
        """Producer: wait until the stage is free, then expect its bytes on its full barrier."""
        self.pipeline.producer_acquire(state)
        return self.pipeline.producer_get_barrier(state)

    @cute.jit
    def wait(self, state):
        """Consumer: wait until the stage has landed."""
        self.pipeline.consumer_wait(state)

    @cute.jit
    def release(self, state):
        """Consumer: one arrive per warp (lane 0), after the warp's reads of the stage."""
        cute.arch.sync_warp()
        self.pipeline.consumer_release(state)

    @cute.jit
    def drain(self, state):
        """Producer, at exit: wait until the consumers have released every stage of the group, so no
        TMA load is still in flight into a CTA that leaves."""
        for _ in cutlass.range(self.stages // self.groups, unroll=1):
            cute.arch.mbarrier_wait(self.pipeline.consumer_get_barrier(state), state.phase)
            state.advance(self.groups)


@dataclass(frozen=True)
class StagingBarrier:
    """The staged levels of segment k land on one mbarrier in phase k % 2."""

    barrier: object

    @cute.jit
    def init(self, warp):
        if warp == 0:
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(self.barrier, 1)

    @cute.jit
    def expect(self, tx_bytes):
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(self.barrier, tx_bytes)
        cute.arch.sync_warp()

    @cute.jit
    def wait(self, segment):
        cute.arch.mbarrier_wait(self.barrier, segment % 2)


@cute.jit
def segment_sync(cluster_size: cutlass.Constexpr):
    """Everyone (both CTAs of a cluster) is done with the staged levels of the last segment."""
    if cutlass.const_expr(cluster_size > 1):
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()
    else:
        cute.arch.barrier()
