"""Tile scheduling: which (block, head, batch) each CTA computes, in order.

A tile is a block of rows of one head of one batch entry: a query block in the
forward, a key block in the backward (whose heads are KV heads, or query heads
with BwdConfig.split_gqa).

Persistent mode launches one CTA per SM and deals the linear order out in
rounds of `grid` tiles, alternating direction (a snake): in round r, CTA c
takes tile r·grid + c when r is even and r·grid + grid-1-c when r is odd, so
with longest-first orders each CTA's sum of tile lengths stays even (a plain
round-robin hands CTA 0 the longest tile of every round). Non-persistent mode
launches one CTA per tile (round 0 only) and the hardware's CTA dispatch does
the balancing. With dynamic_tiles (FwdConfig, BwdConfig) the persistent CTAs
take round 0 by their index, then claim each further tile from a global
counter (atomic add, zero at launch) instead of the snake: a CTA that drew
short tiles comes back sooner and takes the next longest one, which the fixed
deal cannot do. TileQueue carries the claimed index from the producer warp to
the other roles. The order:
- non-causal: block fastest, so CTAs running at once share the K/V (forward)
  or Q, dO and the dQ accumulator (backward) of a head through L2;
- causal: longest first (LPT) inside L2-sized sections of heads. In the
  forward the last query blocks visit the most K/V blocks; in the backward the
  first key blocks are seen by the most query blocks. Those start first and
  short ones fill the tail. A section holds as many (batch, head) pairs as
  have their shared operands fitting in the config's `l2_section_mb`, rounded
  down to a power of two: all blocks of those heads run close together in
  time and share them through L2 (with a global LPT order, CTAs running at
  once would all read different heads and every block would re-read them
  from HBM). With other counts the claims fell unevenly at the end: at 3
  heads of 64 blocks a section (d192/128 causal 8k) the last section's
  longest blocks started when each SM had less than that block's work
  left, and SMs idled (docs/findings.md). For the same reason the section
  of the pairs left over when the count does not divide them runs first,
  not last: its longest tiles start with the grid instead of once every
  whole section is dealt (21 heads of head dim 96 at 2k, batch 1: 16 and
  5 a section, 1.23x the time of one section with the 5 last).
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Int32

from .dsl_struct import DslStruct
from .pipeline import wait_full


@cute.jit
def deal(round_idx: Int32, stream=0, streams: cutlass.Constexpr[int] = 1) -> Int32:
    """The linear tile this CTA (its tile stream `stream` of `streams`,
    FwdConfig.concurrent_tiles: the streams deal as CTAs of a grid that many
    times larger) computes in round `round_idx` of the fixed deal, a snake
    (may be past the end)."""
    cta = Int32(cute.arch.block_idx()[0])
    grid = Int32(cute.arch.grid_dim()[0])
    if cutlass.const_expr(streams > 1):
        cta = stream * grid + cta
        grid = grid * streams
    offset = cta
    if round_idx % 2 == 1:
        offset = grid - 1 - cta
    return round_idx * grid + offset


@dataclass
class TileScheduler(DslStruct):
    num_blocks: Int32
    num_heads: Int32
    num_batch: Int32
    section_heads: Int32  # (batch, head) pairs per L2 section (longest_first only)
    longest_first: bool
    first_block_longest: bool  # causal backward; the forward's longest block is its last
    stream: Int32 | int = 0  # this role's tile stream (FwdConfig.concurrent_tiles)
    streams: int = 1

    @staticmethod
    def create(num_blocks: Int32, num_heads: Int32, num_batch: Int32, shared_rows: Int32,
               heads_per_share: Int32, row_bytes: int, l2_section_bytes: int,
               longest_first: bool, first_block_longest: bool = False) -> "TileScheduler":
        """shared_rows · row_bytes: what the tiles of heads_per_share heads read in
        common (forward: seqlen_k rows of K and V, shared by a KV group's query heads)."""
        share_bytes = shared_rows * row_bytes
        fitting = cutlass.max(Int32(l2_section_bytes) // cutlass.max(share_bytes, 1), 1)
        shares = Int32(1) << (Int32(31) - Int32(cute.arch.clz(fitting)))  # a power of two
        return TileScheduler(num_blocks, num_heads, num_batch, shares * heads_per_share,
                             longest_first, first_block_longest)

    def num_tiles(self) -> Int32:
        return self.num_blocks * self.num_heads * self.num_batch

    @staticmethod
    def grid(num_tiles: Int32, num_sms: Int32, persistent: bool, streams: int = 1) -> Int32:
        """CTAs to launch: with `streams` tile streams a CTA (persistent
        only), enough to give each stream a tile of round 0."""
        if cutlass.const_expr(persistent):
            if cutlass.const_expr(streams > 1):
                return cutlass.min((num_tiles + streams - 1) // streams, num_sms)
            return cutlass.min(num_tiles, num_sms)
        return num_tiles

    def tile_at(self, round_idx: Int32) -> Int32:
        return deal(round_idx, self.stream, self.streams)

    def decode(self, tile: Int32):
        """Linear tile index -> (block, head, batch), marked warp-uniform.

        ptxas computes the divisions in vector registers and cannot tell that
        their results are the same in every lane; unmarked, everything derived
        from them (loop bounds, pipeline stage indices, WGMMA descriptors)
        stays in vector registers too, and each descriptor of the main loop
        costs 64-bit vector adds and R2UR moves (forward d64 causal: 503 ->
        448 instructions per K/V step, 482 -> 521 TFLOP/s at 8k)."""
        if cutlass.const_expr(self.longest_first):
            # sections walked from the last tile: the partial one comes first
            tile = self.num_tiles() - 1 - tile
            section_tiles = self.section_heads * self.num_blocks
            section = tile // section_tiles
            idx = tile - section * section_tiles
            first = section * self.section_heads
            in_section = cutlass.min(self.section_heads,
                                     self.num_heads * self.num_batch - first)
            block = idx // in_section  # shortest first, from the last tile
            if cutlass.const_expr(self.first_block_longest):
                block = self.num_blocks - 1 - block
            rest = first + idx % in_section
        else:
            block = tile % self.num_blocks
            rest = tile // self.num_blocks
        uniform = cute.arch.make_warp_uniform
        return uniform(block), uniform(rest % self.num_heads), uniform(rest // self.num_heads)


@dataclass
class TileQueue(DslStruct):
    """The tiles of a persistent CTA with dynamic_tiles, from the producer
    warp (which claims them) to the roles that read them: the consumer
    warpgroups, and in the backward the dQ writer warp. The tile's first
    barrier carries it: Q's in the forward, K/V's in the backward (below,
    "Q").

    The producer claims tile r+1 once tile r's loads are issued: the
    consumers are then still kv_stages blocks behind, which hides the
    atomic's round trip, and the tile goes to the CTA about to be free
    (claiming it when tile r starts lost 1.9 % at d128 causal 16k: a whole
    tile early, the claim often went to a CTA that was not the next one
    free). With a Q ring of S stages there are N = S + 1 slots
    (slots_for). The producer writes tile r into slot r % N before its
    arrive on Q's full barrier for round r, and the consumers read the slot
    after waiting on that barrier, whose phase completes only after the
    arrive (release/acquire through the mbarrier). The slot is free again:
    its previous tile (r - N = r - 1 - S) was read before the consumers
    released Q of that round, which the producer's acquire of round r - 1
    (the same stage) waited for. With N = S the producer, running ahead over
    tiles of one block, could overwrite a tile the consumers had not read.
    A tile index >= num_tiles ends the loop: for it the producer arrives on
    Q's barrier without a load."""

    counter: cute.Tensor  # global Int32 (1,), zero at launch
    slots: cute.Tensor  # shared Int32 (streams * slots_for(stages),)
    stream: Int32 | int = 0  # this role's tile stream; its slots follow the previous ones'
    streams: int = 1

    @staticmethod
    def slots_for(stages: int) -> int:
        """Slots a ring of `stages` stages needs (above)."""
        return stages + 1

    @cute.jit
    def claim(self) -> Int32:
        """The next tile for this CTA (the whole producer warp calls; one
        lane adds)."""
        claimed = Int32(0)
        if cute.arch.lane_idx() == 0:
            claimed = cute.arch.atomic_add(self.counter.iterator, Int32(1), sem="relaxed",
                                           scope="gpu")
        claimed = cute.arch.shuffle_sync(claimed, 0)
        # round 0 dealt the first grid_dim * streams tiles by index
        return cute.arch.make_warp_uniform(claimed
                                           + Int32(cute.arch.grid_dim()[0]) * self.streams)

    def _slot(self, round_idx: Int32) -> Int32:
        """This stream's slot of a round."""
        count = cute.size(self.slots) // self.streams
        return self.stream * count + round_idx % count

    @cute.jit
    def publish(self, round_idx: Int32, tile: Int32):
        """Before the producer's arrive on Q's full barrier of this round."""
        if cute.arch.lane_idx() == 0:
            self.slots[self._slot(round_idx)] = tile
        cute.arch.sync_warp()  # ordered before the arrive, whichever lane makes it

    @cute.jit
    def finish(self, round_idx: Int32, end: Int32, pipe, state):
        """The producer, past its last tile: publishes `end` (>= num_tiles)
        like a tile. The barrier's phase completes on this arrive alone (no
        load), once the consumers have released the previous round."""
        self.publish(round_idx, end)
        pipe.sync_object_empty.wait(state.index, state.phase)
        if cute.arch.lane_idx() == 0:
            cute.arch.mbarrier_arrive(pipe.producer_get_barrier(state))

    @cute.jit
    def receive(self, pipe, state, round_idx: Int32) -> Int32:
        """A reader's tile of this round: its wait on the barrier that carries
        it, then the slot."""
        wait_full(pipe, state)
        return cute.arch.make_warp_uniform(self.slots[self._slot(round_idx)])


@dataclass
class TileSequence(DslStruct):
    """The tiles of one CTA, round after round: the fixed deal of
    TileScheduler.tile_at, or with dynamic_tiles the tiles its producer warp
    claims (`claimed`), which the other roles read from TileQueue
    (`received`, with the wait on the barrier that carries them)."""

    scheduler: TileScheduler
    queue: TileQueue
    dynamic: bool

    @cute.jit
    def claimed(self, round_idx: Int32) -> Int32:
        """The producer's tile of round round_idx >= 1."""
        if cutlass.const_expr(self.dynamic):
            return self.queue.claim()
        return self.scheduler.tile_at(round_idx)

    @cute.jit
    def received(self, round_idx: Int32, pipe, state) -> Int32:
        """A reader's tile of round round_idx."""
        if cutlass.const_expr(self.dynamic):
            return self.queue.receive(pipe, state, round_idx)
        return self.scheduler.tile_at(round_idx)
