"""Block-sparse masks: PyTorch FlexAttention's BlockMask (or a dense boolean
mask) as the kernels take it.

`BlockSparseMask` holds a mask at the kernels' block size, SPARSE_BLOCK (128)
queries x 128 keys: each block is empty (never loaded nor multiplied), full
(computed without a mask) or partial (computed, then the scores its bit mask
hides set to -inf). The bits of a partial block come from the BlockMask's
mask_mod, evaluated here once, on the partial blocks only, with
FlexAttention's semantics: an element is visible iff its FlexAttention block
is listed, and it lies in a full block or mask_mod says so. A block whose
bits turn out all set becomes full, all clear empty. Any FlexAttention block
size that divides 128 or that 128 divides is accepted (FlexAttention's
default is 128 x 128); other sizes would make a kernel tile straddle blocks.

The kernels read per-tile lists (`tile_lists`, packed as
cute_kernels/block_sparse.py says): for the forward one row per query tile
of the key tiles it visits, for the backward one row per key tile of the
query tiles, the partial ones first with their bits. Converting runs on the
mask's device and waits for it (the lists' lengths); convert once and reuse
the BlockSparseMask across calls and layers, as one reuses a BlockMask. The
conversion makes the lists of every tile size the kernels use (a few per
head dim) and keeps them in the object, so that a call, compiled or not,
only looks them up.

Memory: a partial block keeps 2 KiB of bits per tile list; a mask whose
partial blocks are a large share of all blocks (token-level sparsity) costs
up to 1/8 of a dense boolean mask per direction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .kernels.config import SPARSE_BLOCK, SUPPORTED_HEAD_DIMS
from .kernels.bwd_config import block_sparse_tiles
from .validate import describe

EMPTY, PARTIAL, FULL = 0, 1, 2
HEADER_WORDS = 4  # cute_kernels/block_sparse.py
WORD_BITS = 32
# mask_mod is evaluated on this many partial blocks at once (bounds the
# temporaries: 128 x 128 indices each)
_EVAL_CHUNK_BLOCKS = 256


def _blocks(n: int) -> int:
    return -(-n // SPARSE_BLOCK)


@dataclass(eq=False)
class BlockSparseMask:
    """A mask of (batch or 1, heads or 1, seqlen_q, seqlen_k) at the kernels'
    block size: `state` (b, h, q_blocks, k_blocks) int8 EMPTY / PARTIAL / FULL;
    `partial` (n, 128, 128) bool, the visibility of the partial blocks, block
    `partial_index[b, h, i, j]` (-1 elsewhere). Columns at and past seqlen_k
    are never visible; rows past seqlen_q are (they leave no output)."""

    seqlen_q: int
    seqlen_k: int
    state: torch.Tensor
    partial_index: torch.Tensor
    partial: torch.Tensor
    _lists: dict = field(default_factory=dict, repr=False)

    @property
    def batch(self) -> int:
        return self.state.shape[0]

    @property
    def heads(self) -> int:
        return self.state.shape[1]

    @property
    def device(self) -> torch.device:
        return self.state.device

    def density(self) -> float:
        """The share of blocks computed (partial or full)."""
        return float((self.state != EMPTY).float().mean())

    # ------------------------------------------------------------ building
    @classmethod
    def from_dense(cls, visible: torch.Tensor) -> BlockSparseMask:
        """From a boolean (b or 1, h or 1, seqlen_q, seqlen_k) mask, True where
        the key is visible."""
        if not isinstance(visible, torch.Tensor) or visible.dim() != 4 \
                or visible.dtype != torch.bool:
            raise ValueError(f"visible: expected a boolean tensor (batch or 1, heads or 1, "
                             f"seqlen_q, seqlen_k), got {describe(visible)}")
        batch, heads, seqlen_q, seqlen_k = visible.shape
        rows, cols = _blocks(seqlen_q) * SPARSE_BLOCK, _blocks(seqlen_k) * SPARSE_BLOCK
        padded = torch.zeros((batch, heads, rows, cols), dtype=torch.bool, device=visible.device)
        padded[:, :, :seqlen_q, :seqlen_k] = visible
        padded[:, :, seqlen_q:, :seqlen_k] = True  # rows that leave no output
        blocks = padded.unflatten(3, (-1, SPARSE_BLOCK)).unflatten(2, (-1, SPARSE_BLOCK))
        blocks = blocks.transpose(3, 4)  # (b, h, q_blocks, k_blocks, 128, 128)
        state = _state_of(blocks.flatten(4).all(-1), blocks.flatten(4).any(-1))
        where = (state == PARTIAL).nonzero(as_tuple=True)
        return cls._with_partials(seqlen_q, seqlen_k, state, where, blocks[where])

    @classmethod
    def from_block_mask(cls, block_mask) -> BlockSparseMask:
        """From a FlexAttention BlockMask (create_block_mask's), evaluating
        its mask_mod on the blocks that are neither empty nor full."""
        if not all(hasattr(block_mask, name) for name in ("kv_num_blocks", "seq_lengths")):
            raise TypeError(f"block_mask: expected a FlexAttention BlockMask "
                            f"(create_block_mask's), got {type(block_mask).__name__}")
        seqlen_q, seqlen_k = (int(n) for n in block_mask.seq_lengths)
        q_block, k_block = (int(n) for n in _block_size(block_mask))
        for name, size in (("Q", q_block), ("KV", k_block)):
            if size <= 0 or (SPARSE_BLOCK % size and size % SPARSE_BLOCK):
                raise ValueError(f"block_mask: expected a {name} block size that divides "
                                 f"{SPARSE_BLOCK} or is a multiple of it, got {size} "
                                 f"(BLOCK_SIZE {(q_block, k_block)})")
        listed = _listed(block_mask.kv_num_blocks, block_mask.kv_indices)
        full = (_listed(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
                if block_mask.full_kv_num_blocks is not None else torch.zeros_like(listed))
        present = listed | full
        # the blocks' states on a grid of units that both block sizes divide
        unit_q, unit_k = math.gcd(q_block, SPARSE_BLOCK), math.gcd(k_block, SPARSE_BLOCK)
        present_u = _units(present, q_block // unit_q, k_block // unit_k)
        full_u = _units(full, q_block // unit_q, k_block // unit_k)
        q_blocks, k_blocks = _blocks(seqlen_q), _blocks(seqlen_k)
        per_q, per_k = SPARSE_BLOCK // unit_q, SPARSE_BLOCK // unit_k
        present_b = _pool(present_u, q_blocks * per_q, k_blocks * per_k, per_q, per_k, "any")
        full_b = _pool(full_u, q_blocks * per_q, k_blocks * per_k, per_q, per_k, "all")
        # the last key block past seqlen_k needs bits, however full
        ragged = seqlen_k % SPARSE_BLOCK != 0
        candidates = present_b & ~full_b
        if ragged:
            candidates[..., -1] |= full_b[..., -1]
        state = _state_of(full_b, present_b)
        where = candidates.nonzero(as_tuple=True)
        mask_mod = block_mask.mask_mod
        bits = _evaluate(mask_mod, where, present_u, full_u, (unit_q, unit_k), seqlen_q,
                         seqlen_k, state.device)
        return cls._refined(seqlen_q, seqlen_k, state, where, bits)

    @classmethod
    def _refined(cls, seqlen_q, seqlen_k, state, where, bits) -> BlockSparseMask:
        """The mask with the blocks `where` given `bits`: all set -> full, all
        clear (on rows before seqlen_q) -> empty, otherwise partial."""
        state = state.clone()
        rows_in = (torch.arange(SPARSE_BLOCK, device=state.device)[None, :]
                   + where[2][:, None] * SPARSE_BLOCK) < seqlen_q  # (n, 128)
        bits = bits | ~rows_in[:, :, None]
        all_set = bits.flatten(1).all(-1)
        any_set = (bits & rows_in[:, :, None]).flatten(1).any(-1)
        state[where] = _state_of(all_set, any_set)
        keep = ~all_set & any_set
        return cls._with_partials(seqlen_q, seqlen_k, state, tuple(w[keep] for w in where),
                                  bits[keep])

    @classmethod
    def _with_partials(cls, seqlen_q, seqlen_k, state, where, bits) -> BlockSparseMask:
        """The mask of `state` whose partial blocks, at `where`, have `bits`,
        with the lists of every kernel tile size."""
        partial_index = torch.full(state.shape, -1, dtype=torch.int32, device=state.device)
        partial_index[where] = torch.arange(where[0].numel(), dtype=torch.int32,
                                            device=state.device)
        return cls(seqlen_q, seqlen_k, state, partial_index,
                   bits.contiguous())._with_kernel_lists()

    # ------------------------------------------------------------- reading
    def dense(self) -> torch.Tensor:
        """The mask as booleans (b or 1, h or 1, seqlen_q, seqlen_k)."""
        batch, heads, q_blocks, k_blocks = self.state.shape
        blocks = (self.state == FULL)[..., None, None].expand(
            batch, heads, q_blocks, k_blocks, SPARSE_BLOCK, SPARSE_BLOCK).clone()
        where = (self.partial_index >= 0).nonzero(as_tuple=True)
        blocks[where] = self.partial[self.partial_index[where].long()]
        full = blocks.transpose(3, 4).flatten(4, 5).flatten(2, 3)
        return full[:, :, :self.seqlen_q, :self.seqlen_k]

    def _with_kernel_lists(self) -> BlockSparseMask:
        """The mask, with the lists of every kernel tile size made."""
        for d in SUPPORTED_HEAD_DIMS:
            for dv in SUPPORTED_HEAD_DIMS:
                if dv <= d:
                    (fwd_rows, fwd_cols), (bwd_rows, bwd_cols) = block_sparse_tiles(d, dv)
                    self.tile_lists(fwd_rows, fwd_cols, transposed=False)
                    self.tile_lists(bwd_rows, bwd_cols, transposed=True)
        return self

    def tile_lists(self, rows: int, cols: int, transposed: bool) -> torch.Tensor:
        """The packed lists of a kernel whose outer tiles have `rows` rows and
        inner tiles `cols` columns (both dividing 128): the forward's
        (transposed False: query tiles over key tiles, key tiles last to
        first) or the backward's (True: key tiles over query tiles). Int32
        (b or 1, (h or 1) · outer tiles, words); kept per tile size."""
        key = (rows, cols, transposed)
        if key not in self._lists:
            if torch.compiler.is_compiling():  # the packing reads the GPU
                raise ValueError(f"block_mask: expected lists for tiles {key} made before "
                                 f"torch.compile traces the call (BlockSparseMask.from_* makes "
                                 f"every kernel's), got a mask without them")
            self._lists[key] = _pack_lists(self, rows, cols, transposed)
        return self._lists[key]


def _state_of(all_set: torch.Tensor, any_set: torch.Tensor) -> torch.Tensor:
    """FULL where every element is visible, PARTIAL where some, EMPTY where none."""
    return torch.where(all_set, FULL, torch.where(any_set, PARTIAL, EMPTY)).to(torch.int8)


def _block_size(block_mask) -> tuple:
    size = block_mask.BLOCK_SIZE
    return (size, size) if isinstance(size, int) else tuple(size)


def _listed(num_blocks: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """(b, h, q_blocks, k_blocks) bool from a BlockMask's (count, indices) pair."""
    used = torch.arange(indices.shape[-1], device=indices.device) < num_blocks[..., None]
    hits = torch.zeros(indices.shape, dtype=torch.int32, device=indices.device)
    hits.scatter_add_(-1, torch.where(used, indices.long(), 0), used.to(torch.int32))
    return hits > 0


def _units(blocks: torch.Tensor, per_q: int, per_k: int) -> torch.Tensor:
    """A block grid refined to units: each block repeated per_q x per_k."""
    return blocks.repeat_interleave(per_q, dim=2).repeat_interleave(per_k, dim=3)


def _pool(units: torch.Tensor, rows: int, cols: int, per_q: int, per_k: int,
          how: str) -> torch.Tensor:
    """Units (b, h, r, c) pooled over per_q x per_k groups into (b, h, rows /
    per_q, cols / per_k); units past the grid count as empty (and not full)."""
    b, h = units.shape[:2]
    grid = torch.zeros((b, h, rows, cols), dtype=torch.bool, device=units.device)
    r, c = min(rows, units.shape[2]), min(cols, units.shape[3])
    grid[:, :, :r, :c] = units[:, :, :r, :c]
    groups = grid.view(b, h, rows // per_q, per_q, cols // per_k, per_k)
    return groups.any(5).any(3) if how == "any" else groups.all(5).all(3)


def _evaluate(mask_mod, where, present_u, full_u, unit, seqlen_q, seqlen_k, device):
    """The visibility bits (n, 128, 128) of the blocks `where` (b, h, i, j
    indices): listed in a FlexAttention block, and in a full one or seen by
    mask_mod; never past seqlen_k."""
    offsets = torch.arange(SPARSE_BLOCK, device=device)
    out = []
    fn = None
    if mask_mod is not None and not _is_noop(mask_mod):
        fn = torch.vmap(mask_mod, in_dims=(None, None, None, 0))
        fn = torch.vmap(fn, in_dims=(None, None, 0, None))
        fn = torch.vmap(fn, in_dims=(0, 0, 0, 0))
    unit_q, unit_k = unit
    for start in range(0, where[0].numel(), _EVAL_CHUNK_BLOCKS):
        b, h, i, j = (w[start:start + _EVAL_CHUNK_BLOCKS] for w in where)
        q_idx = i[:, None] * SPARSE_BLOCK + offsets  # (n, 128)
        k_idx = j[:, None] * SPARSE_BLOCK + offsets
        q_units = (q_idx // unit_q).clamp(max=present_u.shape[2] - 1)
        k_units = (k_idx // unit_k).clamp(max=present_u.shape[3] - 1)
        index = (b[:, None, None], h[:, None, None], q_units[:, :, None], k_units[:, None, :])
        if fn is None:
            bits = torch.ones((b.numel(), SPARSE_BLOCK, SPARSE_BLOCK), dtype=torch.bool,
                              device=device)
        else:
            seen = fn(b, h, q_idx.clamp(max=seqlen_q - 1), k_idx.clamp(max=seqlen_k - 1))
            bits = full_u[index] | seen.to(torch.bool)
        bits &= present_u[index]
        bits &= (k_idx < seqlen_k)[:, None, :]
        out.append(bits)
    if not out:
        return torch.zeros((0, SPARSE_BLOCK, SPARSE_BLOCK), dtype=torch.bool, device=device)
    return torch.cat(out)


def _is_noop(mask_mod) -> bool:
    """FlexAttention's own mask_mod that sees every key (a BlockMask made
    from blocks alone)."""
    return getattr(mask_mod, "__name__", "") == "noop_mask"


def _pack_words(bits: torch.Tensor) -> torch.Tensor:
    """(..., cols) bool -> (..., cols / 32) int32, bit c % 32 of word c // 32."""
    weights = torch.ones(WORD_BITS, dtype=torch.int64, device=bits.device) << torch.arange(
        WORD_BITS, device=bits.device)
    words = (bits.unflatten(-1, (-1, WORD_BITS)).to(torch.int64) * weights).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def _pack_lists(mask: BlockSparseMask, rows: int, cols: int, transposed: bool) -> torch.Tensor:
    for name, n in (("rows", rows), ("cols", cols)):
        if n <= 0 or SPARSE_BLOCK % n or n % WORD_BITS:
            raise ValueError(f"{name}: expected a multiple of {WORD_BITS} dividing "
                             f"{SPARSE_BLOCK}, got {n}")
    state, index, partial = mask.state, mask.partial_index, mask.partial
    if transposed:
        state, index, partial = (state.transpose(2, 3), index.transpose(2, 3),
                                 partial.transpose(1, 2))
    per_outer, per_inner = SPARSE_BLOCK // rows, SPARSE_BLOCK // cols
    batch, heads = state.shape[:2]
    # tiles inherit their block's state; a partial block's tiles are refined
    # by their bits; tiles past the sequences are dropped
    outer_len, inner_len = ((mask.seqlen_k, mask.seqlen_q) if transposed
                            else (mask.seqlen_q, mask.seqlen_k))
    outer_tiles, inner_tiles = -(-outer_len // rows), -(-inner_len // cols)
    tiles = state.repeat_interleave(per_outer, 2).repeat_interleave(per_inner, 3)[
        :, :, :outer_tiles, :inner_tiles]
    tile_index = index.repeat_interleave(per_outer, 2).repeat_interleave(per_inner, 3)[
        :, :, :outer_tiles, :inner_tiles]
    tile_bits = partial.reshape(-1, per_outer, rows, per_inner, cols).transpose(2, 3)
    where = (tiles == PARTIAL).nonzero(as_tuple=True)
    bits = tile_bits[tile_index[where].long(), where[2] % per_outer, where[3] % per_inner]
    all_set, any_set = bits.flatten(1).all(-1), bits.flatten(1).any(-1)
    tiles = tiles.clone()
    tiles[where] = _state_of(all_set, any_set)
    keep = ~all_set & any_set
    where, bits = tuple(w[keep] for w in where), bits[keep]

    # each outer tile's list: partial inner tiles, then full ones, each from
    # the last inner tile to the first
    inner = torch.arange(inner_tiles, device=tiles.device)
    rank = torch.where(tiles == PARTIAL, 2 * inner_tiles, 0) + torch.where(
        tiles == FULL, inner_tiles, 0) + inner
    rank = torch.where(tiles == EMPTY, -1, rank)
    order = rank.argsort(dim=-1, descending=True, stable=True)
    n_partial = (tiles == PARTIAL).sum(-1)
    count = (tiles != EMPTY).sum(-1)
    longest = int(count.max()) if count.numel() else 0
    most_partial = int(n_partial.max()) if n_partial.numel() else 0
    index_words = -(-longest // 4) * 4
    words = cols // WORD_BITS
    bits_start = HEADER_WORDS + index_words
    row_words = bits_start + most_partial * rows * words
    table = torch.zeros((batch, heads, outer_tiles, row_words), dtype=torch.int32,
                        device=tiles.device)
    table[..., 0] = n_partial.to(torch.int32)
    table[..., 1] = (count - n_partial).to(torch.int32)
    table[..., 2] = bits_start
    table[..., HEADER_WORDS:HEADER_WORDS + longest] = order[..., :longest].to(torch.int32)
    if where[0].numel():
        # the entry of each partial tile in its row's list: its place among
        # the row's partial tiles (they come first, last inner tile first)
        partial_rank = torch.where(tiles == PARTIAL, 1, 0).flip(-1).cumsum(-1).flip(-1) - 1
        entry = partial_rank[where]
        packed = _pack_words(bits)  # (n, rows, words)
        spans = packed.view(-1, rows * words)
        start = bits_start + entry * rows * words
        columns = start[:, None] + torch.arange(rows * words, device=tiles.device)
        table[where[0][:, None], where[1][:, None], where[2][:, None], columns] = spans
    return table.view(batch, heads * outer_tiles, row_words)


def lists_dense(table: torch.Tensor, rows: int, cols: int, transposed: bool, seqlen_q: int,
                seqlen_k: int) -> torch.Tensor:
    """The boolean mask (b or 1, h or 1, seqlen_q, seqlen_k) that packed lists
    describe (the CPU op's reference, and the lists' own test)."""
    batch = table.shape[0]
    outer_len, inner_len = (seqlen_k, seqlen_q) if transposed else (seqlen_q, seqlen_k)
    outer_tiles = -(-outer_len // rows)
    mask_heads = table.shape[1] // outer_tiles if outer_tiles else 1
    inner_tiles = -(-inner_len // cols)
    dense = torch.zeros((batch, mask_heads, outer_tiles * rows, inner_tiles * cols),
                        dtype=torch.bool)
    words = cols // WORD_BITS
    cpu = table.cpu().view(batch, mask_heads, outer_tiles, table.shape[2])
    shifts = torch.arange(cols) % WORD_BITS
    for b in range(batch):
        for h in range(mask_heads):
            for o in range(outer_tiles):
                row = cpu[b, h, o]
                n_partial, n_full, bits_start = int(row[0]), int(row[1]), int(row[2])
                for e in range(n_partial + n_full):
                    t = int(row[HEADER_WORDS + e])
                    block = dense[b, h, o * rows:(o + 1) * rows, t * cols:(t + 1) * cols]
                    if e >= n_partial:
                        block[:] = True
                        continue
                    start = bits_start + e * rows * words
                    w = row[start:start + rows * words].view(rows, words).to(torch.int64)
                    w = w.repeat_interleave(WORD_BITS, dim=1)[:, :cols]
                    block[:] = ((w >> shifts) & 1).bool()
    if transposed:
        dense = dense.transpose(2, 3)
    return dense[:, :, :seqlen_q, :seqlen_k]
