"""KV-cache managers: unit tests per operation, then random operation sequences checked against
a model of the KV memory (every sequence must read back its own tokens through its table)."""
from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings, strategies as st

from policies.memory import ContiguousAllocator, PagedBlockManager
from policies.memory.decode_growth import DecodeGrowth, new_blocks_per_step
from policies.protocols import KVCacheManager
from policies.types import Request, Sequence, SequenceStatus

from factories import make_seq


def make_child(parent: Sequence, seq_id: int) -> Sequence:
    child = Sequence(seq_id, parent.request, parent.num_output_tokens,
                     list(parent.output_token_ids or []))
    parent.request.sequences.append(child)
    return child


def snapshot(manager) -> dict:
    return copy.deepcopy(vars(manager))


def waste(manager) -> float:
    return 1 - manager.num_tokens_stored() / manager.num_slots_allocated()


def test_both_satisfy_the_protocol():
    assert isinstance(PagedBlockManager(4, 4), KVCacheManager)
    assert isinstance(ContiguousAllocator(4, 4, max_model_len=16), KVCacheManager)


# ---------------------------------------------------------------- paged: configuration

@pytest.mark.parametrize("kwargs, message", [
    (dict(num_blocks=0), "kv_cache.num_blocks must be a positive integer, got 0"),
    (dict(block_size=0), "kv_cache.block_size must be a positive integer, got 0"),
    (dict(block_size=2.5), "kv_cache.block_size must be a positive integer, got 2.5"),
    (dict(block_size=True), "kv_cache.block_size must be a positive integer, got True"),
    (dict(num_host_blocks=-1), "kv_cache.num_host_blocks must be a non-negative integer"),
    (dict(watermark=1.0), "kv_cache.watermark must be a number in [0, 1), got 1.0"),
    (dict(watermark=-0.1), "kv_cache.watermark must be a number in [0, 1)"),
    (dict(enable_prefix_caching="yes"), "kv_cache.enable_prefix_caching must be true or false"),
    (dict(share_on_fork=1), "kv_cache.share_on_fork must be true or false"),
])
def test_paged_rejects_bad_config(kwargs, message):
    arguments = dict(num_blocks=8, block_size=4) | kwargs
    with pytest.raises(ValueError) as error:
        PagedBlockManager(**arguments)
    assert message in str(error.value)


# ---------------------------------------------------------------- paged: growth

def test_paged_growth_takes_one_block_per_block_boundary():
    manager = PagedBlockManager(8, 4, watermark=0)
    seq = make_seq(0, 3)
    assert manager.allocate_slots(seq, 3)
    assert len(manager.block_tables[0]) == 1
    assert manager.num_used_blocks() == 1
    assert (manager.num_slots_allocated(), manager.num_tokens_stored()) == (4, 3)
    first_block = manager.block_tables[0][0]

    assert manager.allocate_slots(seq, 4)                       # fills the block
    assert manager.block_tables[0] == [first_block]
    assert manager.num_tokens_stored() == 4
    assert manager.allocate_slots(seq, 5)                       # crosses into a second block
    assert len(manager.block_tables[0]) == 2 and manager.block_tables[0][0] == first_block
    assert manager.allocate_slots(seq, 12)                      # several blocks at once
    assert len(manager.block_tables[0]) == 3
    assert manager.allocate_slots(seq, 12)                      # same length: nothing to do
    assert (manager.num_used_blocks(), manager.num_free_blocks()) == (3, 5)
    assert manager.num_tokens_stored() == 12
    with pytest.raises(ValueError, match="cannot shrink"):
        manager.allocate_slots(seq, 11)
    manager.check_invariants()


def test_paged_block_tables_is_a_live_view():
    manager = PagedBlockManager(8, 4, watermark=0)
    seq = make_seq(0, 3)
    tables = manager.block_tables
    manager.allocate_slots(seq, 3)
    table = tables[0]
    manager.allocate_slots(seq, 9)
    assert tables[0] is table and len(table) == 3


def test_paged_failed_allocation_changes_nothing():
    manager = PagedBlockManager(4, 4, watermark=0)
    first, second = make_seq(0, 8), make_seq(1, 12)
    assert manager.allocate_slots(first, 8)
    before = snapshot(manager)
    assert not manager.allocate_slots(second, 12)
    assert snapshot(manager) == before and 1 not in manager.block_tables


def test_paged_failed_copy_on_write_changes_nothing():
    manager = PagedBlockManager(4, 4, watermark=0)
    parent = make_seq(0, 6)
    manager.allocate_slots(parent, 6)
    child = make_child(parent, 1)
    manager.fork(parent, child)
    manager.allocate_slots(make_seq(2, 4), 4)                   # one block left
    before = snapshot(manager)
    assert not manager.allocate_slots(child, 9)                 # needs a copy and a new block
    assert snapshot(manager) == before
    assert manager.allocate_slots(child, 8)                     # the copy alone fits
    assert len(manager.take_pending_copies()) == 1
    manager.check_invariants()


def test_paged_watermark_keeps_blocks_free_for_admissions_only():
    manager = PagedBlockManager(100, 1, watermark=0.1)
    assert manager.watermark_blocks == 10
    first = make_seq(0, 91)
    assert not manager.allocate_slots(first, 91, watermark=True)
    assert manager.num_free_blocks() == 100
    assert manager.allocate_slots(first, 90, watermark=True)
    assert not manager.allocate_slots(make_seq(1, 1), 1, watermark=True)
    assert manager.allocate_slots(make_seq(2, 1), 1)            # growth may dip below it
    assert manager.can_ever_fit(90) and not manager.can_ever_fit(91)


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 2000), max_size=40),
       block_size=st.sampled_from([1, 2, 7, 16, 255, 256, 257, 1024]),
       num_steps=st.integers(0, 600), first_step=st.integers(0, 300))
def test_new_blocks_per_step_counts_each_decode_block_by_block(lengths, block_size, num_steps,
                                                               first_step):
    def num_blocks(num_tokens):
        return -(-num_tokens // block_size)
    # One sequence at a time, one step at a time: at step j it holds length + j tokens.
    per_step = [sum(num_blocks(length + step) - num_blocks(length + step - 1)
                    for length in lengths) if step else 0
                for step in range(first_step + num_steps)]
    # From first_step on, the first entry with every block taken by then.
    expected = per_step[first_step:]
    if expected:
        expected[0] = sum(per_step[:first_step + 1])
    slots_left = [-length % block_size for length in lengths]
    assert new_blocks_per_step(slots_left, block_size, num_steps, first_step) == expected
    if block_size <= 256:
        assert new_blocks_per_step(bytes(slots_left), block_size, num_steps,
                                   first_step) == expected


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 2000), max_size=40),
       num_leaving=st.integers(0, 40),
       block_size=st.sampled_from([1, 2, 7, 16, 255, 256, 257, 1024]),
       num_steps=st.integers(0, 600), first_step=st.integers(0, 300))
def test_decode_growth_answers_as_new_blocks_per_step_after_decodes_leave(
        lengths, num_leaving, block_size, num_steps, first_step):
    slots_left = [-length % block_size for length in lengths]
    growth = DecodeGrowth(bytes(slots_left) if block_size <= 256 else slots_left, block_size)
    growth.remove(slots_left[:num_leaving])
    assert (growth.new_blocks_per_step(num_steps, first_step)
            == new_blocks_per_step(slots_left[num_leaving:], block_size, num_steps, first_step))


def test_paged_new_blocks_per_step_matches_the_blocks_append_slots_takes():
    manager = PagedBlockManager(400, 8)
    seqs = [make_seq(index, length) for index, length in enumerate([1, 7, 8, 9, 15, 16, 40])]
    for seq in seqs:
        assert manager.allocate_slots(seq, seq.num_tokens)
    predicted = manager.decode_growth(seqs).new_blocks_per_step(30)
    taken = [0]
    for _ in range(29):
        used = manager.num_used_blocks()
        for seq in seqs:
            seq.num_tokens += 1
        assert manager.append_slots(seqs) == len(seqs)
        taken.append(manager.num_used_blocks() - used)
    assert predicted == taken
    manager.check_invariants()


@pytest.mark.parametrize("kind", ["paged", "contiguous"])
def test_append_slots_stops_at_the_first_failure_and_grows_to_num_tokens(kind):
    manager = (PagedBlockManager(6, 4) if kind == "paged"
               else ContiguousAllocator(6, 4, max_model_len=8))
    seqs = [make_seq(index, 4) for index in range(3)]
    for seq in seqs[:2]:
        assert manager.allocate_slots(seq, 4)
    # Sequences several tokens past their slots (as after repeated steps) grow to num_tokens;
    # from `start` on only.
    for seq in seqs[:2]:
        seq.num_computed_tokens, seq.num_tokens = 5, 6
    assert manager.append_slots(seqs[:2]) == 2
    assert manager.num_tokens_stored() == 6 + 6
    seqs[1].num_tokens = 7
    assert manager.append_slots(seqs[:2], 1) == 2
    assert manager.num_tokens_stored() == 6 + 7
    if kind == "paged":   # 4 of 6 blocks used: the third sequence's 3 blocks do not fit
        seqs[2].num_tokens = 12
        assert manager.allocate_slots(seqs[2], 1)
        assert manager.append_slots(seqs, 2) == 2
        assert manager.append_slots(seqs) == 2
    manager.check_invariants()


@pytest.mark.parametrize("kind", ["paged", "contiguous"])
def test_take_computed_slots_is_allocate_slots_to_num_computed_tokens_for_each(kind):
    def manager_and_seqs():
        manager = (PagedBlockManager(7, 4) if kind == "paged"
                   else ContiguousAllocator(9, 4, max_model_len=12))
        seqs = [make_seq(index, 4) for index in range(3)]
        for seq in seqs:
            assert manager.allocate_slots(seq, 4)
        # Decodes after repeated steps: computed up to the token before the sampled one.
        for seq, num_computed in zip(seqs, (9, 5, 11)):
            seq.num_computed_tokens, seq.num_tokens = num_computed, num_computed + 1
        return manager, seqs

    manager, seqs = manager_and_seqs()
    one_by_one, seqs_one_by_one = manager_and_seqs()
    held = manager.take_computed_slots(seqs)
    expected = next((index for index, seq in enumerate(seqs_one_by_one)
                     if not one_by_one.allocate_slots(seq, seq.num_computed_tokens)), 3)
    assert held == expected == (2 if kind == "paged" else 3)
    assert snapshot(manager) == snapshot(one_by_one)
    assert manager.num_tokens_stored() == one_by_one.num_tokens_stored()
    manager.check_invariants()


@settings(max_examples=60, deadline=None)
@given(num_used=st.integers(0, 40), lengths=st.lists(st.integers(1, 60), min_size=1, max_size=4),
       watermark=st.sampled_from([0.0, 0.05, 0.2]))
def test_paged_may_allocate_new_says_false_exactly_when_the_admission_fails(num_used, lengths,
                                                                             watermark):
    manager = PagedBlockManager(40, 4, watermark=watermark)
    if num_used:
        assert manager.allocate_slots(make_seq(99, num_used * 4), num_used * 4)
    answer = manager.may_allocate_new(lengths)
    seqs = [make_seq(index, length) for index, length in enumerate(lengths)]
    allocated = all(manager.allocate_slots(seq, length, watermark=True)
                    for seq, length in zip(seqs, lengths))
    assert answer == allocated


def test_paged_may_allocate_new_with_prefix_caching_always_tries():
    manager = PagedBlockManager(4, 4, watermark=0, enable_prefix_caching=True)
    assert manager.may_allocate_new([100])


def test_paged_can_ever_fit():
    manager = PagedBlockManager(10, 16, watermark=0)
    assert manager.can_ever_fit(160) and not manager.can_ever_fit(161)


# ---------------------------------------------------------------- paged: fork and copy-on-write

def test_paged_fork_shares_and_copies_on_first_write_only():
    manager = PagedBlockManager(8, 4, watermark=0)
    parent = make_seq(0, 6)
    manager.allocate_slots(parent, 6)
    child = make_child(parent, 1)
    assert manager.fork(parent, child)
    shared_first, shared_last = manager.block_tables[0]
    assert manager.block_tables[1] == [shared_first, shared_last]
    assert manager._ref_counts[shared_first] == manager._ref_counts[shared_last] == 2
    assert manager.num_used_blocks() == 2 and manager.num_tokens_stored() == 6  # counted once
    assert manager.take_pending_copies() == []

    assert manager.allocate_slots(parent, 7)                    # first writer into the shared block
    private_last = manager.block_tables[0][1]
    assert private_last != shared_last and manager.block_tables[0][0] == shared_first
    assert manager._ref_counts[shared_last] == 1
    assert manager.num_tokens_stored() == 6 + 2 + 1             # the copy holds 2 tokens, +1 new
    manager.check_invariants()

    assert manager.allocate_slots(child, 7)                     # second writer owns it now
    assert manager.block_tables[1] == [shared_first, shared_last]
    assert manager.take_pending_copies() == [(shared_last, private_last)]
    assert manager.take_pending_copies() == []
    assert manager.num_tokens_stored() == 4 + 3 + 3
    manager.check_invariants()


def test_paged_fork_at_block_boundary_needs_no_copy():
    manager = PagedBlockManager(8, 4, watermark=0)
    parent = make_seq(0, 8)
    manager.allocate_slots(parent, 8)
    child = make_child(parent, 1)
    manager.fork(parent, child)
    assert manager.allocate_slots(child, 9)
    assert manager.block_tables[1][:2] == manager.block_tables[0]
    assert manager.take_pending_copies() == []
    manager.check_invariants()


def test_paged_fork_without_sharing_copies_every_block():
    manager = PagedBlockManager(5, 4, watermark=0, share_on_fork=False)
    parent = make_seq(0, 6)
    manager.allocate_slots(parent, 6)
    child = make_child(parent, 1)
    assert manager.fork(parent, child)
    parent_table, child_table = manager.block_tables[0], manager.block_tables[1]
    assert not set(parent_table) & set(child_table)
    assert manager.take_pending_copies() == list(zip(parent_table, child_table))
    assert manager.num_tokens_stored() == 12
    before = snapshot(manager)
    assert not manager.fork(parent, make_child(parent, 2))      # 2 blocks needed, 1 free
    assert snapshot(manager) == before
    manager.check_invariants()


def test_paged_free_drops_references():
    manager = PagedBlockManager(8, 4, watermark=0)
    parent = make_seq(0, 6)
    manager.allocate_slots(parent, 6)
    child = make_child(parent, 1)
    manager.fork(parent, child)
    manager.free(parent)
    assert 0 not in manager.block_tables
    assert [manager._ref_counts[block] for block in manager.block_tables[1]] == [1, 1]
    assert manager.num_used_blocks() == 2 and manager.num_tokens_stored() == 6
    manager.free(child)
    manager.free(child)                                         # twice: no-op
    manager.free(make_seq(7, 1))                                # unknown: no-op
    assert manager.num_free_blocks() == 8 and manager.num_tokens_stored() == 0
    assert not any(manager._ref_counts)
    manager.check_invariants()


def test_paged_pending_copy_into_a_freed_block_is_dropped():
    manager = PagedBlockManager(8, 4, watermark=0)
    parent = make_seq(0, 6)
    manager.allocate_slots(parent, 6)
    child = make_child(parent, 1)
    manager.fork(parent, child)
    manager.allocate_slots(child, 7)                            # CoW copy pending
    manager.free(child)
    assert manager.take_pending_copies() == []
    manager.check_invariants()


# ---------------------------------------------------------------- paged: swap

def make_forked_group(manager):
    """A request with three samples: all share block 0, parent and c2 share block 1, c1 wrote."""
    parent = make_seq(0, 6)
    manager.allocate_slots(parent, 6)
    first_child, second_child = make_child(parent, 1), make_child(parent, 2)
    manager.fork(parent, first_child)
    manager.fork(parent, second_child)
    manager.allocate_slots(first_child, 7)
    manager.take_pending_copies()
    return [parent, first_child, second_child]


def test_paged_swap_round_trip_preserves_sharing_and_lengths():
    manager = PagedBlockManager(16, 4, num_host_blocks=8, watermark=0)
    group = make_forked_group(manager)
    tables_before = {seq_id: list(table) for seq_id, table in manager.block_tables.items()}
    stored_before = manager.num_tokens_stored()
    assert stored_before == 4 + 2 + 3

    assert manager.can_swap_out(group)
    swapped_out = manager.swap_out(group)
    assert len(swapped_out) == 3                                # each distinct block once
    assert len({host for _, host in swapped_out}) == 3
    assert manager.block_tables == {} and manager.num_free_blocks() == 16
    assert manager.num_tokens_stored() == 0 and manager.num_free_host_blocks() == 5
    manager.check_invariants()

    assert manager.can_swap_in(group)
    swapped_in = manager.swap_in(group)
    assert len(swapped_in) == 3 and manager.num_free_host_blocks() == 8
    device_to_host, host_to_device = dict(swapped_out), dict(swapped_in)
    for seq_id, table in tables_before.items():
        assert manager.block_tables[seq_id] == [host_to_device[device_to_host[block]]
                                                for block in table]
    tables = manager.block_tables
    assert tables[0][0] == tables[1][0] == tables[2][0] and tables[0][1] == tables[2][1]
    assert tables[1][1] != tables[0][1]
    assert manager.num_used_blocks() == 3 and manager.num_tokens_stored() == stored_before
    # Lengths survived: the same lengths need nothing; the next token in c2 copies the shared block.
    before = snapshot(manager)
    assert all(manager.allocate_slots(seq, n) for seq, n in zip(group, (6, 7, 6)))
    assert snapshot(manager) == before
    assert manager.allocate_slots(group[2], 7)
    assert len(manager.take_pending_copies()) == 1
    manager.check_invariants()


def test_paged_swap_needs_room():
    manager = PagedBlockManager(16, 4, num_host_blocks=2, watermark=0)
    group = make_forked_group(manager)
    assert not manager.can_swap_out(group)
    with pytest.raises(RuntimeError):
        manager.swap_out(group)
    assert manager.can_swap_out(group[:1])


def test_paged_swap_in_keeps_the_watermark():
    manager = PagedBlockManager(10, 4, num_host_blocks=10, watermark=0.2)
    swapped = make_seq(0, 16)
    manager.allocate_slots(swapped, 16)
    manager.swap_out([swapped])
    other = make_seq(1, 20)
    manager.allocate_slots(other, 20)                           # 5 free left; 4 needed, 2 kept
    assert not manager.can_swap_in([swapped])
    manager.free(other)
    assert manager.can_swap_in([swapped])
    manager.swap_in([swapped])
    assert manager.num_tokens_stored() == 16
    manager.free(swapped)
    assert manager.num_free_blocks() == 10 and manager.num_free_host_blocks() == 10


def test_paged_swap_out_sends_the_source_of_a_pending_copy():
    # Swaps run before copies, so a block still waiting for its CoW copy has the wrong contents.
    manager = PagedBlockManager(8, 4, num_host_blocks=8, watermark=0)
    parent = make_seq(0, 6)
    manager.allocate_slots(parent, 6)
    child = make_child(parent, 1)
    manager.fork(parent, child)
    manager.allocate_slots(child, 7)
    shared_first, shared_last = manager.block_tables[0]
    swapped_out = manager.swap_out([parent, child])
    assert [device for device, _ in swapped_out] == [shared_first, shared_last, shared_last]
    assert manager.take_pending_copies() == []
    manager.check_invariants()


def test_paged_free_releases_a_swapped_seq():
    manager = PagedBlockManager(8, 4, num_host_blocks=4, watermark=0)
    group = make_forked_group(manager)
    manager.swap_out(group)
    for seq in group:
        manager.free(seq)
    assert manager.num_free_host_blocks() == 4 and not any(manager._host_ref_counts)
    manager.check_invariants()


# ---------------------------------------------------------------- paged: prefix cache

PROMPT = list(range(100, 110))


def test_paged_prefix_cache_hits_full_blocks():
    manager = PagedBlockManager(16, 4, watermark=0, enable_prefix_caching=True)
    first = make_seq(0, 10, prompt_token_ids=PROMPT)
    assert manager.allocate_prefix(first) == 0
    manager.allocate_slots(first, 10)                           # blocks 0 and 1 are full
    first.num_computed_tokens = 10                              # ...and the step computed them

    second = make_seq(1, 10, prompt_token_ids=PROMPT)
    assert manager.allocate_prefix(second) == 8
    assert manager.block_tables[1] == manager.block_tables[0][:2]
    assert manager._ref_counts[manager.block_tables[1][0]] == 2
    assert manager.allocate_slots(second, 10)
    second.num_computed_tokens = 10
    assert manager.num_tokens_stored() == 10 + 2
    manager.check_invariants()

    exact = make_seq(2, 8, prompt_token_ids=PROMPT[:8])         # one token left to compute
    assert manager.allocate_prefix(exact) == 4
    diverging = make_seq(3, 10, prompt_token_ids=PROMPT[:4] + [0] * 6)
    assert manager.allocate_prefix(diverging) == 4
    # As the scheduler does: cached tokens count as computed.
    exact.num_computed_tokens = diverging.num_computed_tokens = 4
    without_ids = make_seq(4, 10)
    assert manager.allocate_prefix(without_ids) == 0 and 4 not in manager.block_tables
    manager.check_invariants()

    for seq in (first, second, exact, diverging):
        manager.free(seq)
    assert manager.num_free_blocks() == 16 and manager.num_tokens_stored() == 0
    again = make_seq(5, 10, prompt_token_ids=PROMPT)
    assert manager.allocate_prefix(again) == 8                  # revived from the free pool
    assert manager.num_free_blocks() == 14 and manager.num_tokens_stored() == 8
    manager.check_invariants()


def test_paged_prefix_cache_registers_blocks_filled_while_decoding():
    manager = PagedBlockManager(8, 2, watermark=0, enable_prefix_caching=True)
    seq = make_seq(0, 3, prompt_token_ids=[1, 2, 3])
    seq.output_token_ids = []
    manager.allocate_slots(seq, 3)
    seq.output_token_ids.append(4)
    seq.num_output_tokens, seq.num_tokens = 1, 4
    manager.allocate_slots(seq, 4)                              # the decode step fills block 1
    assert manager.allocate_prefix(make_seq(1, 5, prompt_token_ids=[1, 2, 3, 4, 5])) == 4
    assert manager.allocate_prefix(make_seq(2, 5, prompt_token_ids=[1, 2, 3, 9, 5])) == 2



def test_paged_prefix_cache_gives_a_resumed_seq_its_own_outputs_without_their_ids():
    """The simulator samples no output ids, yet a seq preempted after decoding finds its own
    computed output blocks again (vLLM V1 hashes generated tokens' blocks); no other seq does,
    and a finished seq's outputs stay uncached."""
    manager = PagedBlockManager(16, 2, watermark=0, enable_prefix_caching=True)
    seq = make_seq(0, 3, prompt_token_ids=[1, 2, 3])
    seq.status = SequenceStatus.RUNNING
    manager.allocate_slots(seq, 3)
    for _ in range(4):                                          # four decodes, no ids kept
        seq.num_output_tokens += 1
        seq.num_tokens += 1
        manager.allocate_slots(seq, seq.num_tokens)
    seq.num_computed_tokens = 6                                 # the last token not yet
    manager.free(seq)                                           # preempted for recompute
    seq.num_computed_tokens = 0
    assert manager.allocate_prefix(seq) == 6                    # 3 full blocks, last token left
    seq.num_computed_tokens = 6
    twin = make_seq(1, 3, prompt_token_ids=[1, 2, 3])           # same prompt, its own outputs
    twin.num_output_tokens, twin.num_tokens = 4, 7
    assert manager.allocate_prefix(twin) == 2
    twin.num_computed_tokens = 2
    manager.check_invariants()
    seq.num_output_tokens, seq.num_tokens = 5, 8                # one more decode fills block 3
    manager.allocate_slots(seq, 8)
    seq.num_computed_tokens = 8
    seq.status = SequenceStatus.FINISHED
    manager.free(seq)
    manager.free(twin)
    assert len(manager._hash_to_block) == 3                     # not block 3: seq finished

def test_paged_prefix_cache_disabled_or_without_ids_does_nothing():
    manager = PagedBlockManager(8, 4, watermark=0)
    first = make_seq(0, 10, prompt_token_ids=PROMPT)
    manager.allocate_slots(first, 10)
    before = snapshot(manager)
    assert manager.allocate_prefix(make_seq(1, 10, prompt_token_ids=PROMPT)) == 0
    assert snapshot(manager) == before
    manager = PagedBlockManager(8, 4, watermark=0, enable_prefix_caching=True)
    manager.allocate_slots(make_seq(0, 10), 10)
    assert manager._hash_to_block == {}


def test_paged_prefix_cache_forgets_blocks_freed_before_they_were_computed():
    """A sequence dropped in the step that allocated it (a failed admission, a preemption)
    leaves no cached block behind: its KV was never written."""
    manager = PagedBlockManager(8, 4, watermark=0, enable_prefix_caching=True)
    dropped = make_seq(0, 10, prompt_token_ids=PROMPT)
    manager.allocate_slots(dropped, 10)
    dropped.num_computed_tokens = 4                             # only the first block computed
    manager.free(dropped)
    manager.check_invariants()
    assert manager.allocate_prefix(make_seq(1, 10, prompt_token_ids=PROMPT)) == 4


def test_paged_prefix_cache_evicts_uncached_first_then_least_recently_freed():
    manager = PagedBlockManager(6, 2, watermark=0, enable_prefix_caching=True)
    first = make_seq(0, 4, prompt_token_ids=[1, 2, 3, 4])
    second = make_seq(1, 4, prompt_token_ids=[5, 6, 7, 8])
    manager.allocate_slots(first, 4)                            # blocks 0, 1
    manager.allocate_slots(second, 4)                           # blocks 2, 3
    first.num_computed_tokens = second.num_computed_tokens = 4  # the step computed them
    manager.free(first)                                         # freed tail first: 1, 0
    manager.free(second)                                        # then 3, 2
    assert manager.num_free_blocks() == 6

    manager.allocate_slots(make_seq(2, 4), 4)                   # never-cached blocks 4, 5
    assert manager.block_tables[2] == [4, 5]
    assert len(manager._hash_to_block) == 4
    manager.allocate_slots(make_seq(3, 2), 2)                   # evicts block 1: first's tail
    assert manager.block_tables[3] == [1]
    manager.check_invariants()
    assert manager.allocate_prefix(make_seq(4, 5, prompt_token_ids=[1, 2, 3, 4, 9])) == 2
    assert manager.block_tables[4] == [0]
    assert manager.allocate_prefix(make_seq(5, 5, prompt_token_ids=[5, 6, 7, 8, 9])) == 4
    manager.check_invariants()


# ---------------------------------------------------------------- paged: host tier

def cache_and_free(manager, seq_id: int, token_ids: list[int]) -> Sequence:
    """Admit a prompt, compute it (as a step would) and free it: its full blocks stay cached."""
    seq = make_seq(seq_id, len(token_ids), prompt_token_ids=token_ids)
    seq.num_computed_tokens = manager.allocate_prefix(seq)
    assert manager.allocate_slots(seq, len(token_ids))
    seq.num_computed_tokens = len(token_ids)
    manager.free(seq)
    return seq


def test_paged_offload_needs_prefix_caching():
    with pytest.raises(ValueError, match="needs kv_cache.enable_prefix_caching=true"):
        PagedBlockManager(8, 4, num_offload_blocks=2)
    with pytest.raises(ValueError, match="kv_cache.num_offload_blocks must be a non-negative"):
        PagedBlockManager(8, 4, enable_prefix_caching=True, num_offload_blocks=-1)


def test_paged_offload_stores_evicted_blocks_and_loads_them_back():
    manager = PagedBlockManager(4, 2, watermark=0, enable_prefix_caching=True,
                                num_offload_blocks=3)
    cache_and_free(manager, 0, [1, 2, 3, 4, 5])             # blocks 0, 1 cached; 2 uncached
    manager.allocate_slots(make_seq(1, 8), 8)               # takes 2, 3, then evicts 1 and 0
    stores, loads = manager.take_pending_offload()
    assert stores == [(1, 0), (0, 1)] and loads == []       # the tail first, to slots 0, 1
    assert manager.num_offloaded_blocks() == 2 and manager._hash_to_block == {}
    manager.check_invariants()
    assert manager.num_cached_prefix_tokens([1, 2, 3, 4, 5]) == 4
    manager.free(make_seq(1, 8))                            # frees 0, 1, 3, 2, uncached

    again = make_seq(2, 5, prompt_token_ids=[1, 2, 3, 4, 5])
    assert manager.allocate_prefix(again) == 4
    assert manager.num_loaded_prefix_tokens(again) == 4
    assert manager.block_tables[2] == [0, 1]
    manager.check_invariants()
    stores, loads = manager.take_pending_offload()
    assert stores == [] and loads == [(1, 0), (0, 1)]       # slot 1 held the first block
    assert manager.num_offloaded_blocks() == 0              # one tier per hash
    manager.check_invariants()
    assert manager.num_cached_prefix_tokens([1, 2, 3, 4, 9]) == 4   # device hits now


def test_paged_offload_freed_before_its_load_returns_to_the_tier():
    """A failed admission frees the blocks whose loads were pending: no load runs, the hashes
    are back in their host slots, the blocks are uncached."""
    manager = PagedBlockManager(2, 2, watermark=0, enable_prefix_caching=True,
                                num_offload_blocks=2)
    cache_and_free(manager, 0, [1, 2, 3])                   # block 0 cached
    manager.allocate_slots(make_seq(1, 4), 4)               # evicts block 0 to slot 0
    assert manager.take_pending_offload() == ([(0, 0)], [])
    manager.free(make_seq(1, 4))

    seq = make_seq(2, 3, prompt_token_ids=[1, 2, 3])
    assert manager.allocate_prefix(seq) == 2
    manager.free(seq)
    manager.check_invariants()
    assert manager.take_pending_offload() == ([], [])
    assert manager.num_offloaded_blocks() == 1 and manager._block_to_hash == {}
    assert manager.num_cached_prefix_tokens([1, 2, 3]) == 2


def test_paged_offload_keeps_the_most_recently_stored_and_the_watermark():
    manager = PagedBlockManager(4, 2, watermark=0.25, enable_prefix_caching=True,
                                num_offload_blocks=1)
    cache_and_free(manager, 0, [1, 2, 3])                   # block 0 cached
    cache_and_free(manager, 1, [5, 6, 7])                   # block 2 cached
    manager.allocate_slots(make_seq(2, 8), 8)               # evicts 0, then 2: slot 0 reused
    stores, _ = manager.take_pending_offload()
    assert stores == [(2, 0)]                               # the dropped entry's store is gone
    assert manager.num_cached_prefix_tokens([1, 2, 3]) == 0
    assert manager.num_cached_prefix_tokens([5, 6, 7]) == 2
    manager.check_invariants()
    # Four blocks in use, the watermark keeps one: a host hit is not loaded into it.
    seq = make_seq(3, 3, prompt_token_ids=[5, 6, 7])
    assert manager.allocate_prefix(seq) == 0
    manager.free(make_seq(2, 8))
    assert manager.allocate_prefix(seq) == 2 and manager.num_loaded_prefix_tokens(seq) == 2


def test_paged_prefix_computed_again_drops_its_host_copy():
    manager = PagedBlockManager(2, 2, watermark=0, enable_prefix_caching=True,
                                num_offload_blocks=2)
    cache_and_free(manager, 0, [1, 2, 3])
    manager.allocate_slots(make_seq(1, 4), 4)               # block 0's hash to the tier
    manager.free(make_seq(1, 4))
    manager.take_pending_offload()
    # Allocated without asking the cache: its first block registers the same hash on device.
    manager.allocate_slots(make_seq(2, 3, prompt_token_ids=[1, 2, 3]), 3)
    assert manager.num_offloaded_blocks() == 0
    manager.check_invariants()


# ---------------------------------------------------------------- contiguous

@pytest.mark.parametrize("kwargs, message", [
    (dict(reserve="min"), "kv_cache.reserve must be one of max, oracle, got 'min'"),
    (dict(max_model_len=0), "kv_cache.max_model_len must be a positive integer, got 0"),
    (dict(num_blocks=-2), "kv_cache.num_blocks must be a positive integer, got -2"),
    (dict(num_host_blocks=None), "kv_cache.num_host_blocks must be a non-negative integer"),
    (dict(watermark=2), "kv_cache.watermark must be a number in [0, 1), got 2"),
])
def test_contiguous_rejects_bad_config(kwargs, message):
    arguments = dict(num_blocks=8, block_size=4, max_model_len=16) | kwargs
    with pytest.raises(ValueError) as error:
        ContiguousAllocator(**arguments)
    assert message in str(error.value)


def test_contiguous_max_reserves_max_model_len_up_front():
    manager = ContiguousAllocator(64, 4, max_model_len=30)
    seq = make_seq(0, 5)
    assert manager.allocate_slots(seq, 5)
    assert manager.block_tables[0] == list(range(8))
    assert manager.num_used_blocks() == 8
    assert (manager.num_slots_allocated(), manager.num_tokens_stored()) == (32, 5)
    assert manager.allocate_slots(seq, 32)
    assert manager.num_used_blocks() == 8 and manager.num_tokens_stored() == 32
    with pytest.raises(ValueError, match="beyond its reservation"):
        manager.allocate_slots(seq, 33)
    with pytest.raises(ValueError, match="cannot shrink"):
        manager.allocate_slots(seq, 31)
    assert manager.allocate_prefix(seq) == 0
    assert manager.can_ever_fit(30) and not manager.can_ever_fit(31)
    assert not ContiguousAllocator(7, 4, max_model_len=30).can_ever_fit(1)
    manager.check_invariants()


def test_contiguous_oracle_reserves_prompt_plus_output():
    manager = ContiguousAllocator(64, 4, max_model_len=1000, reserve="oracle")
    seq = make_seq(0, 10, output_len=7)
    assert manager.allocate_slots(seq, 10)
    assert manager.num_used_blocks() == 5                       # ceil(17 / 4)
    with pytest.raises(ValueError, match="beyond its reservation"):
        manager.allocate_slots(make_seq(1, 30, output_len=1), 33)  # 8 blocks
    manager.check_invariants()


def test_contiguous_first_fit_fragments_and_coalesces():
    manager = ContiguousAllocator(10, 1, max_model_len=10, reserve="oracle")
    a, b, c = (make_seq(i, 2, output_len=1) for i in range(3))
    for seq in (a, b, c):
        assert manager.allocate_slots(seq, 2)
    assert [manager.block_tables[i] for i in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    manager.free(b)
    assert manager.num_free_blocks() == 4 and manager.largest_free_run() == 3
    before = snapshot(manager)
    assert not manager.allocate_slots(make_seq(3, 4, output_len=0), 4)  # 4 free, not together
    assert snapshot(manager) == before
    e = make_seq(4, 2, output_len=0)
    assert manager.allocate_slots(e, 2) and manager.block_tables[4] == [3, 4]   # first hole
    assert manager.allocate_slots(make_seq(5, 1, output_len=0), 1)
    assert manager.block_tables[5] == [5]
    assert manager.allocate_slots(make_seq(6, 1, output_len=0), 1)
    assert manager.block_tables[6] == [9]
    manager.check_invariants()
    manager.free(a)
    manager.free(e)
    assert manager._free_extents == [(0, 5)] and manager.largest_free_run() == 5
    manager.check_invariants()


def test_contiguous_fork_copies_filled_blocks_into_its_own_run():
    manager = ContiguousAllocator(8, 4, max_model_len=16)
    parent = make_seq(0, 6)
    manager.allocate_slots(parent, 6)
    child = make_child(parent, 1)
    assert manager.fork(parent, child)
    assert manager.block_tables[1] == [4, 5, 6, 7]
    assert manager.take_pending_copies() == [(0, 4), (1, 5)]
    assert manager.num_tokens_stored() == 12
    assert manager.allocate_slots(child, 7)
    before = snapshot(manager)
    assert not manager.fork(parent, make_child(parent, 2))
    assert snapshot(manager) == before
    manager.free(child)
    manager.free(parent)
    assert manager.num_free_blocks() == 8 and manager.num_tokens_stored() == 0
    manager.check_invariants()


def test_contiguous_swap_round_trip():
    manager = ContiguousAllocator(12, 4, max_model_len=16, num_host_blocks=4)
    seq = make_seq(0, 6)
    manager.allocate_slots(seq, 6)
    assert manager.can_swap_out([seq])
    assert manager.swap_out([seq]) == [(0, 0), (1, 1)]          # filled blocks only
    assert manager.num_free_blocks() == 12 and manager.num_tokens_stored() == 0
    assert manager.num_free_host_blocks() == 2
    manager.check_invariants()

    manager.allocate_slots(make_seq(1, 1), 1)                   # takes run 0..3
    assert manager.can_swap_in([seq])
    assert manager.swap_in([seq]) == [(0, 4), (1, 5)]           # a fresh run
    assert manager.block_tables[0] == [4, 5, 6, 7] and manager.num_tokens_stored() == 7
    assert manager.num_free_host_blocks() == 4
    assert manager.allocate_slots(seq, 6) and manager.allocate_slots(seq, 16)
    manager.check_invariants()


def test_contiguous_swap_needs_room():
    manager = ContiguousAllocator(10, 1, max_model_len=4, reserve="oracle", num_host_blocks=2)
    seq = make_seq(0, 3, output_len=1)
    manager.allocate_slots(seq, 3)
    assert not manager.can_swap_out([seq])                      # 3 filled blocks, 2 host blocks
    with pytest.raises(RuntimeError):
        manager.swap_out([seq])


def test_contiguous_swap_in_needs_a_contiguous_run():
    manager = ContiguousAllocator(10, 1, max_model_len=4, reserve="oracle", num_host_blocks=8)
    swapped = make_seq(0, 3, output_len=1)                      # run 0-3
    a, b, c = (make_seq(i, 1, output_len=1) for i in (1, 2, 3))  # runs 4-5, 6-7, 8-9
    for seq in (swapped, a, b, c):
        assert manager.allocate_slots(seq, seq.num_tokens)
    manager.swap_out([swapped])
    manager.allocate_slots(make_seq(4, 1, output_len=0), 1)     # takes 0
    manager.free(b)                                             # free: 1-3 and 6-7
    assert manager.num_free_blocks() == 5 and manager.largest_free_run() == 3
    assert not manager.can_swap_in([swapped])                   # 5 free, no run of 4
    with pytest.raises(RuntimeError):
        manager.swap_in([swapped])
    manager.free(a)                                             # free: 1-7
    assert manager.can_swap_in([swapped])
    assert manager.swap_in([swapped]) == [(0, 1), (1, 2), (2, 3)]
    assert manager.block_tables[0] == [1, 2, 3, 4]
    manager.check_invariants()


# ---------------------------------------------------------------- waste

def test_waste_paged_under_one_block_per_seq_contiguous_max_large():
    lengths = [17, 100, 3, 64, 250, 31]
    paged = PagedBlockManager(1024, 16, watermark=0)
    contiguous = ContiguousAllocator(1024, 16, max_model_len=2048)
    for seq_id, length in enumerate(lengths):
        assert paged.allocate_slots(make_seq(seq_id, length), length)
        assert contiguous.allocate_slots(make_seq(seq_id, length), length)
    assert paged.num_tokens_stored() == contiguous.num_tokens_stored() == sum(lengths)
    assert paged.num_slots_allocated() - paged.num_tokens_stored() < len(lengths) * 16
    assert waste(paged) < 0.1
    assert contiguous.num_slots_allocated() == len(lengths) * 2048
    assert waste(contiguous) > 0.9


# ---------------------------------------------------------------- random operation sequences

BLOCK_SIZE = 4
TEMPLATES = [list(range(1000, 1020)), list(range(2000, 2020)), list(range(1000, 1008)) + [7] * 12]
# Growth weighted up: copy-on-write and block boundaries happen while growing.
OPERATIONS = ("admit", "grow", "grow", "grow", "fork", "free", "swap_out", "swap_in")

MANAGERS = {
    "paged": lambda: PagedBlockManager(24, BLOCK_SIZE, num_host_blocks=16, watermark=0),
    "paged-no-share": lambda: PagedBlockManager(24, BLOCK_SIZE, num_host_blocks=16,
                                                watermark=0, share_on_fork=False),
    "paged-prefix": lambda: PagedBlockManager(24, BLOCK_SIZE, num_host_blocks=16, watermark=0.1,
                                              enable_prefix_caching=True),
    # A small device pool, so cached blocks are evicted into the host tier and loaded back.
    "paged-offload": lambda: PagedBlockManager(14, BLOCK_SIZE, num_host_blocks=8, watermark=0.1,
                                               enable_prefix_caching=True, num_offload_blocks=6),
    "contiguous-max": lambda: ContiguousAllocator(40, BLOCK_SIZE, max_model_len=40,
                                                  num_host_blocks=16),
    "contiguous-oracle": lambda: ContiguousAllocator(40, BLOCK_SIZE, max_model_len=40,
                                                     reserve="oracle", num_host_blocks=16,
                                                     watermark=0.05),
}


class KVMemoryModel:
    """Plays the executor: applies copies, swaps and the host tier's stores and loads to fake KV
    blocks and writes each token's id into its slot, so a wrong table, a missed copy-on-write, a
    bad swap or a wrong reload shows up as a sequence reading someone else's tokens. Each
    operation is a step that computes what it allocated."""

    def __init__(self, manager):
        self.manager = manager
        self.device = [[None] * BLOCK_SIZE for _ in range(manager.num_blocks)]
        self.host = [[None] * BLOCK_SIZE for _ in range(manager.num_host_blocks)]
        self.tier = [[None] * BLOCK_SIZE for _ in range(getattr(manager, "num_offload_blocks", 0))]
        self.num_loaded = 0
        self.requests: dict[int, Request] = {}
        self.swapped: set[int] = set()
        self.next_id = 0

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    def running_seqs(self) -> list[Sequence]:
        return [seq for request_id, request in sorted(self.requests.items())
                if request_id not in self.swapped for seq in request.sequences]

    def apply_copies(self) -> None:
        """The step's memory operations in the executor's order (swaps are applied where they
        are decided): host-tier stores, loads, copies."""
        take_pending_offload = getattr(self.manager, "take_pending_offload", None)
        if take_pending_offload is not None:
            stores, loads = take_pending_offload()
            assert len({slot for _, slot in stores}) == len(stores)
            for device, slot in stores:
                self.tier[slot] = list(self.device[device])
            for slot, device in loads:
                self.device[device] = list(self.tier[slot])
            self.num_loaded += len(loads)
        for src, dst in self.manager.take_pending_copies():
            self.device[dst] = list(self.device[src])

    def write(self, seq: Sequence, start: int) -> None:
        token_ids, table = seq.token_ids(), self.manager.block_tables[seq.seq_id]
        for position in range(start, seq.num_tokens):
            self.device[table[position // BLOCK_SIZE]][position % BLOCK_SIZE] = token_ids[position]

    def check(self) -> None:
        self.manager.check_invariants()
        for seq in self.running_seqs():
            token_ids, table = seq.token_ids(), self.manager.block_tables[seq.seq_id]
            stored = [self.device[table[position // BLOCK_SIZE]][position % BLOCK_SIZE]
                      for position in range(seq.num_tokens)]
            assert stored == token_ids, f"seq {seq.seq_id} reads {stored}, wrote {token_ids}"

    def step(self, operation: str, choice: int, amount: int) -> None:
        manager = self.manager
        running = self.running_seqs()
        if operation in ("grow", "fork") and not running:
            operation = "admit"
        if operation == "admit":
            template = TEMPLATES[choice % len(TEMPLATES)]
            prompt_len = 1 + choice % 19
            request_id = self.new_id()
            request = Request(request_id, 0.0, prompt_len, 8 + amount,
                              prompt_token_ids=template[:prompt_len])
            seq = Sequence(request_id, request, output_token_ids=[])
            request.sequences.append(seq)
            num_cached = manager.allocate_prefix(seq)
            assert 0 <= num_cached < prompt_len and num_cached % BLOCK_SIZE == 0
            before = snapshot(manager)
            if manager.allocate_slots(seq, seq.num_tokens, watermark=True):
                self.requests[request_id] = request
                self.apply_copies()
                self.write(seq, num_cached)
                seq.num_computed_tokens = seq.num_tokens
            else:
                assert snapshot(manager) == before
                manager.free(seq)
                self.apply_copies()
        elif operation == "grow":
            seq = running[choice % len(running)]
            limit = seq.request.prompt_len + seq.request.output_len
            num_new = min(amount, limit - seq.num_tokens)
            if num_new <= 0:
                return
            start = seq.num_tokens
            seq.output_token_ids.extend((choice + i) % 997 for i in range(num_new))
            seq.num_output_tokens += num_new
            seq.num_tokens += num_new
            before = snapshot(manager)
            if manager.allocate_slots(seq, seq.num_tokens):
                self.apply_copies()
                self.write(seq, start)
                seq.num_computed_tokens = seq.num_tokens
            else:
                assert snapshot(manager) == before
                del seq.output_token_ids[-num_new:]
                seq.num_output_tokens -= num_new
                seq.num_tokens -= num_new
        elif operation == "fork":
            parent = running[choice % len(running)]
            child = Sequence(self.new_id(), parent.request, parent.num_output_tokens,
                             list(parent.output_token_ids))
            before = snapshot(manager)
            if manager.fork(parent, child):
                parent.request.sequences.append(child)
                child.num_computed_tokens = parent.num_computed_tokens
                self.apply_copies()
            else:
                assert snapshot(manager) == before
        elif operation == "free" and self.requests:
            request = self.requests[sorted(self.requests)[choice % len(self.requests)]]
            seq = request.sequences[amount % len(request.sequences)]
            manager.free(seq)
            request.sequences.remove(seq)
            if not request.sequences:
                del self.requests[request.request_id]
                self.swapped.discard(request.request_id)
        elif operation == "swap_out":
            candidates = sorted(set(self.requests) - self.swapped)
            if not candidates:
                return
            request = self.requests[candidates[choice % len(candidates)]]
            if manager.can_swap_out(request.sequences):
                swaps = manager.swap_out(request.sequences)
                assert len({host for _, host in swaps}) == len(swaps)
                for device, host in swaps:
                    self.host[host] = list(self.device[device])
                self.swapped.add(request.request_id)
                assert not any(seq.seq_id in manager.block_tables for seq in request.sequences)
        elif operation == "swap_in" and self.swapped:
            request = self.requests[sorted(self.swapped)[choice % len(self.swapped)]]
            if manager.can_swap_in(request.sequences):
                swaps = manager.swap_in(request.sequences)
                assert len({device for _, device in swaps}) == len(swaps)
                self.apply_copies()   # stores of blocks evicted for the swap-in go first
                for host, device in swaps:
                    self.device[device] = list(self.host[host])
                self.swapped.discard(request.request_id)

    def free_everything(self) -> None:
        for request in self.requests.values():
            for seq in request.sequences:
                self.manager.free(seq)
        self.requests.clear()
        self.swapped.clear()


operations = st.lists(st.tuples(st.sampled_from(OPERATIONS), st.integers(0, 10**6),
                                st.integers(1, 12)), min_size=20, max_size=80)


@pytest.mark.parametrize("kind", sorted(MANAGERS))
@settings(max_examples=120, deadline=None)
@given(steps=operations)
def test_random_operations_keep_invariants_and_contents(kind, steps):
    manager = MANAGERS[kind]()
    model = KVMemoryModel(manager)
    for operation, choice, amount in steps:
        model.step(operation, choice, amount)
        model.check()
    model.free_everything()
    assert manager.take_pending_copies() == []
    if isinstance(manager, PagedBlockManager):
        assert manager.take_pending_offload() == ([], [])
        assert manager.num_offloaded_blocks() <= manager.num_offload_blocks
    manager.check_invariants()
    assert manager.block_tables == {}
    assert manager.num_free_blocks() == manager.num_blocks and manager.num_used_blocks() == 0
    assert manager.num_tokens_stored() == 0
    assert manager.num_free_host_blocks() == manager.num_host_blocks
    if isinstance(manager, PagedBlockManager):
        assert not any(manager._ref_counts) and not any(manager._host_ref_counts)


def test_paged_pool_holds_a_paused_runs_growth_in_bulk_and_gives_it_back():
    """A paused run of repeated steps has its decodes' growth held before their tables take it:
    the pool counts those blocks used and those tokens stored, its bookkeeping holds (also once
    a fork starts sharing blocks meanwhile), and the blocks go back to the free list for the
    decodes to take."""
    manager = PagedBlockManager(16, 4, watermark=0)
    seq = make_seq(0, 6)
    manager.allocate_slots(seq, 6)
    assert manager.can_hold_decode_growth()
    free_before, stored_before = manager.num_free_blocks(), manager.num_tokens_stored()
    manager.hold_decode_growth(3, 9)
    assert manager.num_free_blocks() == free_before - 3
    assert manager.num_tokens_stored() == stored_before + 9
    manager.check_invariants()
    manager.fork(seq, make_child(seq, 1))                       # sharing starts while held
    assert not manager.can_hold_decode_growth()
    manager.check_invariants()
    manager.release_decode_growth(2, 6)
    manager.check_invariants()
    manager.release_decode_growth(1, 3)
    assert manager.num_free_blocks() == free_before
    assert manager.num_tokens_stored() == stored_before
    seq.num_tokens = seq.num_computed_tokens = 6 + 9            # the decodes take their growth
    assert manager.take_computed_slots([seq]) == 1
    assert manager.num_free_blocks() == free_before - 3
    manager.check_invariants()
