"""StepPlan's feature accounting: the numbers every cost model reads."""
from policies.types import Request, Sequence, StepPlan


def sequence_at(seq_id, request, num_tokens, num_computed, num_output):
    """A sample of `request` part-way through: num_tokens in all, num_computed of them computed,
    num_output of them outputs."""
    seq = Sequence(seq_id, request, num_output)
    seq.num_tokens = num_tokens
    seq.num_computed_tokens = num_computed
    return seq


def features(plan):
    return (plan.num_prefill_tokens, plan.num_prefill_seqs, plan.prefill_attention_work,
            plan.prefill_context_tokens, plan.sum_squared_prefill_chunks, plan.num_decode_seqs,
            plan.decode_context_tokens, plan.num_batched_tokens)


def test_add_accounts_prefill_chunks_and_decodes():
    request = Request(0, 0.0, 100, 10)
    plan = StepPlan()
    plan.add(sequence_at(0, request, 100, 40, 0), 30)    # a chunk of 30 after 40 cached
    plan.add(sequence_at(1, request, 105, 104, 5), 1)    # a decode at context 105
    plan.add(sequence_at(2, request, 101, 0, 1), 101)    # a recompute of prompt + 1 output
    assert features(plan) == (131, 2, 30 * 70 + 101 * 101, 70 + 101, 30 ** 2 + 101 ** 2,
                              1, 105, 132)


def test_add_decodes_matches_add_one_by_one():
    request = Request(0, 0.0, 50, 10)
    seqs = [sequence_at(i, request, 60 + i, 59 + i, 3) for i in range(5)]
    one_by_one, batched = StepPlan(), StepPlan()
    for seq in seqs:
        one_by_one.add(seq, 1)
    batched.add_decodes(seqs)
    assert features(one_by_one) == features(batched)
    assert batched.num_new_tokens == [1] * 5 and batched.seqs == seqs


def test_remove_request_recomputes_the_features():
    kept_request, removed_request = Request(0, 0.0, 80, 10), Request(1, 0.0, 50, 10)
    kept = [sequence_at(0, kept_request, 80, 0, 0), sequence_at(1, kept_request, 90, 89, 2)]
    removed = [sequence_at(2, removed_request, 50, 10, 0),
               sequence_at(3, removed_request, 60, 59, 4)]
    plan, expected = StepPlan(), StepPlan()
    for seq in [kept[0], removed[0], kept[1], removed[1]]:
        plan.add(seq, seq.num_tokens - seq.num_computed_tokens)
    for seq in kept:
        expected.add(seq, seq.num_tokens - seq.num_computed_tokens)
    plan.remove_request(removed_request)
    assert plan.seqs == kept and features(plan) == features(expected)


def test_advance_counts_a_chunk_then_appends_sampled_tokens():
    request = Request(0, 0.0, prompt_len=10, output_len=4, prompt_token_ids=list(range(10)))
    seq = Sequence(0, request)
    seq.advance(6, 0, now=1.0)   # a chunk short of the prompt's end: nothing sampled
    assert (seq.num_computed_tokens, seq.num_tokens, seq.num_output_tokens) == (6, 10, 0)
    assert seq.last_token_time == 0.0
    seq.advance(4, 1, now=2.0, token_ids=[7])
    assert (seq.num_computed_tokens, seq.num_tokens, seq.num_output_tokens) == (10, 11, 1)
    assert (seq.last_token_time, seq.output_token_ids) == (2.0, [7])
    seq.advance(3, 3, now=3.0, token_ids=[8, 9, 5])   # a decode with 2 accepted drafts
    assert (seq.num_computed_tokens, seq.num_tokens, seq.num_output_tokens) == (13, 14, 4)
    assert seq.output_token_ids == [7, 8, 9, 5]


def _counters(seq):
    return (seq.num_computed_tokens, seq.num_tokens, seq.num_output_tokens, seq.last_token_time)


def test_advance_decodes_is_advance_for_each():
    request = Request(0, 0.0, prompt_len=10, output_len=20)
    batch = [sequence_at(i, request, 10 + i, 9 + i, 1 + i) for i in range(3)]
    one_by_one = [sequence_at(i, request, 10 + i, 9 + i, 1 + i) for i in range(3)]
    Sequence.advance_decodes(batch, 4, 5.0)
    for seq in one_by_one:
        seq.advance(4, 4, now=5.0)
    assert [_counters(seq) for seq in batch] == [_counters(seq) for seq in one_by_one]