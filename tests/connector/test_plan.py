"""Which blocks hold what: the block-id rules measured on vLLM 0.33's real scheduler."""

from __future__ import annotations

from anchorkv.connector.plan import GroupInfo, GroupKind, select_blocks, state_block_index

GROUPS = [GroupInfo(i, GroupKind.STATE, 64, (f"kda{i}",)) for i in range(3)] + [
    GroupInfo(3, GroupKind.PAGED, 64, ("mla",))]


def test_align_mode_load_blocks_seen_with_vllm():
    # vLLM 0.33, align mode, local hit 192, external 64 -> ([0,0,0,10],[0,0,0,9],[0,0,0,8],[4,5,6,7])
    blocks = ([0, 0, 0, 10], [0, 0, 0, 9], [0, 0, 0, 8], [4, 5, 6, 7])
    assert select_blocks(GROUPS, blocks, 192, 256, "align") == ((10,), (9,), (8,), (7,))


def test_none_mode_load_blocks_seen_with_vllm():
    blocks = ([7], [6], [5], [4, 3, 2, 1])
    assert select_blocks(GROUPS, blocks, 0, 197, "none") == ((7,), (6,), (5,), (4, 3, 2, 1))


def test_null_or_missing_block_means_no_plan():
    assert select_blocks(GROUPS, ([0, 0, 1], [0, 0, 2], [0, 0, 3], [4, 5, 6]), 0, 128, "align") is None
    assert select_blocks(GROUPS, ([0, 0, 1], [0, 0, 2], [0, 0, 3], [4, 5, 6]), 0, 129, "align") is not None
    assert select_blocks(GROUPS, ([1], [2], [3], [4]), 0, 197, "none") is None


def test_boundaries():
    # align mode: the block of the last token (preprocess_mamba reads (n - 1) // block_size)
    assert state_block_index(197, 64, "align") == 3 and state_block_index(192, 64, "align") == 2
    assert state_block_index(193, 64, "align") == 3 and state_block_index(0, 64, "align") is None
    assert state_block_index(197, 64, "none") == 0


def test_align_load_of_a_sub_block_entry_uses_the_block_of_its_last_token():
    # an entry of 200 tokens (another tp's boundary) restores at block size 64: state in block 3
    blocks = ([0, 0, 0, 10], [0, 0, 0, 9], [0, 0, 0, 8], [4, 5, 6, 7])
    assert select_blocks(GROUPS, blocks, 0, 200, "align") == ((10,), (9,), (8,), (4, 5, 6, 7))
    assert select_blocks(GROUPS, blocks, 128, 200, "align") == ((10,), (9,), (8,), (6, 7))
