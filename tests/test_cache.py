import numpy as np
import pytest
import torch

from speed.engine.cache import CacheError, KVCache, Rows
from speed.engine.kernels import ATTN_CHUNK


def _slot(store: torch.Tensor, cache: KVCache, loop: int, slot: int, span: int) -> torch.Tensor:
    """(H, span, D) a slot's first ``span`` positions at one loop of ``store`` (a layer's keys or values), block by
    block through its block table: the reference a read must equal."""
    return torch.cat([store[loop, :, b] for b in cache.table[slot, : span // ATTN_CHUNK].tolist()], dim=1)


def test_slot_entries_are_a_slots_positions_in_order():
    cache = KVCache(n_loops=2, n_layers=1, n_slots=2, n_heads=1, max_len=2 * ATTN_CHUNK, d_kv=1)
    k = torch.arange(40.0).view(1, 40, 1)
    cache.write_span(0, 1, 1, 0, k[:, :3], -k[:, :3])  # slot 1 takes block 1 first
    cache.write_span(0, 1, 0, 0, k, -k)  # slot 0: blocks 2 and 3
    keys, values = cache.slot_entries(0, 0, 40)
    assert keys.shape == (2, 1, 40, 1) and torch.equal(keys[1], k) and torch.equal(values[1], -k)


def test_write_read_and_invalidate_copies_nothing():
    cache = KVCache(n_loops=3, n_layers=2, n_slots=2, n_heads=1, max_len=8, d_kv=1)
    for pos in range(4):
        rows = Rows.build([0, 1], [0, 0], [pos, pos])
        k = torch.full((2, 1, 1), float(pos))
        cache.write(1, rows, k, -k)
        keys, values = cache.read(1, rows, ATTN_CHUNK)
        assert keys.shape == values.shape == (2, 1, ATTN_CHUNK, 1)  # whole attention chunks, masked past the rows
        assert keys[0, 0, :, 0].tolist() == [*range(pos + 1), *[0.0] * (ATTN_CHUNK - 1 - pos)]
        assert torch.equal(values, -keys)
    assert cache.lengths[0, 1].tolist() == [4, 4]
    assert cache.lengths[0, 0].tolist() == [0, 0]  # another virtual layer: untouched
    storage = cache.keys[1].data_ptr()
    before = cache.read(1, rows, ATTN_CHUNK)[0]
    cache.invalidate(slot=1, from_pos=2)
    assert cache.lengths[0, 1].tolist() == [4, 2]
    assert cache.keys[1].data_ptr() == storage and torch.equal(cache.read(1, rows, ATTN_CHUNK)[0], before)
    # the next write at position 2 overwrites the stale entry
    cache.write(1, Rows.build([1], [0], [2]), torch.full((1, 1, 1), 9.0), torch.zeros(1, 1, 1))
    assert cache.read(1, Rows.build([1], [0], [2]), ATTN_CHUNK)[0][0, 0, 2, 0].item() == 9.0


def test_gaps_and_overwrites_are_errors():
    cache = KVCache(n_loops=2, n_layers=1, n_slots=1, n_heads=1, max_len=4, d_kv=1)
    z = torch.zeros(1, 1, 1)
    with pytest.raises(CacheError, match="position 1, but its valid length is 0"):
        cache.write(0, Rows.build([0], [1], [1]), z, z)
    cache.write(0, Rows.build([0], [1], [0]), z, z)
    with pytest.raises(CacheError, match="position 0, but its valid length is 1"):
        cache.write(0, Rows.build([0], [1], [0]), z, z)
    # two rows of one slot at one virtual layer in the same pass cannot both be appended
    with pytest.raises(CacheError):
        cache.write(0, Rows.build([0, 0], [0, 0], [0, 1]), torch.zeros(2, 1, 1), torch.zeros(2, 1, 1))


def test_claim_keeps_the_books_of_a_write_and_points_at_its_places():
    """``claim`` (a native block writes the keys itself): the checks and lengths of ``write``, and each row's own
    place in the attention's index; refused for branch rows."""
    from speed.engine import native

    cache = KVCache(n_loops=2, n_layers=2, n_slots=2, n_heads=2, max_len=70, d_kv=4)
    if not cache.native_attention:
        pytest.skip(f"no native attention here: {native.unavailable_reason()}")
    for pos in range(40):  # slot 1 into its second block
        cache.write(0, Rows.build([1], [0], [pos]), torch.zeros(1, 2, 4), torch.zeros(1, 2, 4))
    rows = Rows.build([0, 1], [1, 0], [0, 40])
    with pytest.raises(CacheError, match="position 40, but its valid length is 0"):
        cache.claim(1, rows)  # layer 1 of slot 1 holds nothing yet
    offsets, lengths = cache.claim(0, rows)
    assert cache.lengths[1, 0, 0] == 1 and cache.lengths[0, 0, 1] == 41 and lengths.tolist() == [1, 41]
    k = torch.arange(16.0).view(2, 2, 4)
    flat = cache.keys[0].view(-1)
    for r in range(2):  # write where the index says, as native.lm_block does: read back in the row's place
        at = int(offsets[r, lengths[r] - 1])
        for g in range(2):
            flat[at + g * cache.pool_head_stride : at + g * cache.pool_head_stride + 4] = k[r, g]
    assert torch.equal(cache.slot_entries(0, 0, 1)[0][1, :, 0], k[0])
    assert torch.equal(cache.slot_entries(0, 1, 41)[0][0, :, 40], k[1])
    with pytest.raises(CacheError, match="chain rows"):
        cache.claim(0, Rows.build([0, 1], [0, 0], [0, 41], side=[0, -1], up=[(), ()]))


def test_reset_and_max_len():
    cache = KVCache(n_loops=1, n_layers=1, n_slots=1, n_heads=1, max_len=1, d_kv=1)
    z = torch.zeros(1, 1, 1)
    cache.write(0, Rows.build([0], [0], [0]), z, z)
    with pytest.raises(CacheError, match="beyond the cache's max_len 1"):
        cache.write(0, Rows.build([0], [0], [1]), z, z)
    cache.reset(0)
    assert cache.lengths.sum() == 0


def test_rows_take_and_device_tensors():
    rows = Rows.build([0, 1, 2], [0, 1, 0], [3, 4, 5])
    tile = rows.take(np.array([0, 2, 2, 2]))  # padded by repeating the last row
    assert tile.slot.tolist() == [0, 2, 2, 2] and tile.pos.tolist() == [3, 5, 5, 5]
    slot_t, loop_t, pos_t = tile.tensors("cpu")
    assert slot_t.tolist() == [0, 2, 2, 2] and loop_t.dtype == torch.long
    assert tile.tensors("cpu")[0] is slot_t  # made once per device
    with pytest.raises(ValueError, match="differ in length"):
        Rows.build([0], [0, 1], [0])


def test_read_spans_whole_chunks_of_the_rows_virtual_layers():
    """Storage is ``max_len`` rounded up to whole chunks; a read copies only the asked span, row by row from its
    own (loop, slot) pair."""
    cache = KVCache(n_loops=2, n_layers=1, n_slots=3, n_heads=2, max_len=ATTN_CHUNK + 3, d_kv=4)
    # a pool of (n_loops, n_heads, blocks + the zero block, ATTN_CHUNK, d_kv): every slot at max_len by default
    assert cache.n_positions == 2 * ATTN_CHUNK and cache.keys[0].shape == (2, 2, 3 * 2 + 1, ATTN_CHUNK, 4)
    for slot in range(3):  # every slot's two chunks, in scattered blocks
        cache.write_span(0, 0, slot, 0, torch.zeros(2, 35, 4), torch.zeros(2, 35, 4))
    cache.keys[0].copy_(torch.randn_like(cache.keys[0]))
    rows = Rows.build([2, 0, 2], [1, 0, 0], [0, 0, 0])
    for span in (ATTN_CHUNK, 2 * ATTN_CHUNK):
        keys, _ = cache.read(0, rows, span)
        assert keys.shape == (3, 2, span, 4)
        for r, (s, lo) in enumerate(zip(rows.slot, rows.loop)):
            assert torch.equal(keys[r], _slot(cache.keys[0], cache, lo, s, span))
    for bad in (0, ATTN_CHUNK - 1, 3 * ATTN_CHUNK):
        with pytest.raises(ValueError, match="span must be a multiple"):
            cache.read(0, rows, bad)


def test_branch_rows_keep_their_own_entry_and_read_the_prefix():
    """A branch row at position p writes its side entry and reads positions 0..p-1 from its slot, p from its
    side entry; the chain token at p keeps its own entry; promotion copies the branch's loops into position p."""
    cache = KVCache(n_loops=2, n_layers=1, n_slots=2, n_heads=1, max_len=8, d_kv=1)
    assert cache.side_keys[0].shape == (2, 2 * 4, 1, 1)  # n_loops**2 side entries per slot
    for pos in range(3):  # sequence 1, loop 0: positions 0..2 on the chain
        cache.write(0, Rows.build([1], [0], [pos]), torch.full((1, 1, 1), float(pos + 1)), torch.zeros(1, 1, 1))
    # one step: a chain row and a branch row, both at position 3
    rows = Rows.build([1, 1], [0, 0], [3, 3], side=[-1, 1])
    k = torch.tensor([7.0, 9.0]).view(2, 1, 1)
    cache.write(0, rows, k, -k)
    assert cache.lengths[0, 0].tolist() == [0, 4]  # only the chain row moved the valid length
    assert cache.side_keys[0][0, 1 * 4 + 1, 0, 0].item() == 9.0
    keys, values = cache.read(0, rows, ATTN_CHUNK)
    assert keys[0, 0, :5, 0].tolist() == [1.0, 2.0, 3.0, 7.0, 0.0]
    assert keys[1, 0, :5, 0].tolist() == [1.0, 2.0, 3.0, 9.0, 0.0]  # its own key at 3, the prefix before it
    assert values[1, 0, 3, 0].item() == -9.0
    assert _slot(cache.keys[0], cache, 0, 1, ATTN_CHUNK)[0, 3, 0].item() == 7.0  # the chain's entry is untouched
    # a lane: the branch's successor at 4 reads the branch's entry at 3 (side 1, not the chain's), its own at 4
    cache.write(0, Rows.build([1], [0], [4], side=[2], up=[((3, 1),)]), torch.full((1, 1, 1), 5.0), k[:1])
    lane = Rows.build([1], [0], [4], side=[2], up=[((3, 1),)])
    assert cache.read(0, lane, ATTN_CHUNK)[0][0, 0, :6, 0].tolist() == [1.0, 2.0, 3.0, 9.0, 5.0, 0.0]
    assert lane.take(np.array([0, 0])).up == (((3, 1),), ((3, 1),))
    with pytest.raises(CacheError, match="branch write .* position 5, but its prefix's valid length is 4"):
        cache.write(0, Rows.build([1], [0], [5], side=[0]), k[:1], k[:1])
    with pytest.raises(CacheError, match="promotion to position 3"):
        cache.promote(1, 1, 3, 1)  # position 3 is still the chain's
    cache.invalidate(1, 3)
    cache.promote(1, 1, 3, 1)
    assert cache.lengths[0, 0].tolist() == [0, 4] and _slot(cache.keys[0], cache, 0, 1, ATTN_CHUNK)[0, 3, 0] == 9.0
    assert _slot(cache.values[0], cache, 0, 1, ATTN_CHUNK)[0, 3, 0].item() == -9.0
    chain_only = Rows.build([0], [0], [0], side=[-1])
    assert chain_only.side is None and rows.take(np.array([0, 0])).side is None  # no branch rows: the plain path


def test_a_span_write_fills_positions_of_one_slot_at_one_virtual_layer():
    cache = KVCache(n_loops=2, n_layers=2, n_slots=2, n_heads=1, max_len=6, d_kv=1)
    k = torch.arange(4.0).view(1, 4, 1)  # (H, T, D)
    cache.write_span(1, 1, 0, 0, k, -k)
    assert cache.lengths[1, 1].tolist() == [4, 0] and cache.lengths.sum() == 4  # only (loop 1, layer 1), slot 0
    assert _slot(cache.keys[1], cache, 1, 0, ATTN_CHUNK)[0, :4, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    cache.write(1, Rows.build([0], [1], [4]), torch.full((1, 1, 1), 7.0), torch.zeros(1, 1, 1))  # rows go on
    with pytest.raises(CacheError, match="from position 0, but its valid length is 5"):
        cache.write_span(1, 1, 0, 0, k, k)
    with pytest.raises(CacheError, match="beyond the cache's max_len 6"):
        cache.write_span(0, 0, 1, 0, torch.zeros(1, 7, 1), torch.zeros(1, 7, 1))
