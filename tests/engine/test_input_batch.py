"""The persistent input batch: after warm-up a step allocates no host or pinned buffer and
waits for the device exactly once (the sampled tokens, logprobs with them)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from duet.engine import SamplingParams, StructuredOutputsParams
from duet.engine.config import EngineConfig
from duet.engine.llm_engine import LLMEngine
from duet.engine.staging import StagingBuffer

# Tensor methods that make the host wait for the device (or read device memory).
_SYNCS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
}


class CountSyncs(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _SYNCS:
            self.calls.append(func.__name__)
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def engine(tiny_llama):
    return LLMEngine(
        EngineConfig(
            model=tiny_llama,
            dtype="float32",
            load_progress=False,
            max_num_batched_tokens=64,  # long prompts go in chunks beside the decodes
            max_num_seqs=16,
        )
    )


def _mixed_params(i: int) -> SamplingParams:
    kinds = [
        dict(temperature=0),
        dict(temperature=0.8, top_p=0.9, seed=i),
        dict(temperature=1.0, top_k=20),
        dict(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.3, seed=7),
        dict(temperature=0, repetition_penalty=1.3, logprobs=3),
        dict(temperature=1.2, min_p=0.05, logprobs=0, min_tokens=3),
        # a grammar: its bitmask is filled on the host and goes down with the step's inputs
        dict(temperature=0.9, structured_outputs=StructuredOutputsParams(regex="[a-z ]{8,40}")),
    ]
    return SamplingParams(max_tokens=12 + i % 9, ignore_eos=True, **kinds[i % len(kinds)])


def test_steady_state_steps_allocate_nothing_and_sync_once(engine):
    gen = torch.Generator().manual_seed(0)
    vocab = engine.arch.vocab_size
    batch = engine.runner.input_batch
    counter = CountSyncs()
    num_added = 0
    allocated_after_warmup = None
    syncs_per_step = []
    for step in range(200):
        # Keep about 10 requests in flight: a new one (prompt 5-150 tokens) whenever fewer.
        while engine.num_unfinished_requests < 10:
            length = int(torch.randint(5, 150, (1,), generator=gen))
            prompt = torch.randint(3, vocab, (length,), generator=gen).tolist()
            engine.add_request(prompt, _mixed_params(num_added))
            num_added += 1
        if step == 20:
            allocated_after_warmup = batch.num_buffers_allocated
        syncs_before = batch.num_host_syncs
        with counter:
            engine.step()
        syncs_per_step.append((batch.num_host_syncs - syncs_before, counter.calls[:]))
        counter.calls.clear()
    assert num_added > 40  # requests came and went all along
    assert allocated_after_warmup is not None
    assert batch.num_buffers_allocated == allocated_after_warmup
    # After warm-up every step samples (decodes run in each): one sync each, no other read.
    steady = syncs_per_step[20:]
    assert [n for n, _ in steady] == [1] * 180
    assert [calls for _, calls in steady] == [["tolist"]] * 180


def test_block_table_rows_follow_the_allocator(engine):
    """The persistent rows equal each running request's blocks, as they grow."""
    prompts = [list(range(3, 3 + n)) for n in (40, 7, 90)]
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    batch = engine.runner.input_batch
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        for request in engine.scheduler.running:
            slot = batch.slot_of(request.request_id)
            if slot is None:
                continue  # admitted but not yet stepped
            blocks = engine.kv.get_block_ids(request.request_id)
            np.testing.assert_array_equal(batch.block_table[slot, : len(blocks)], blocks)
            checked += 1
    assert checked > 30
    engine.step()  # the last finished requests leave at the next step
    assert batch.num_active == 0  # every finished request gave its slot back


def test_kernel_tables_are_each_steps_own(tiny_llama):
    """The C++ kernels' view of every step (decodes and prefill chunks apart, each with its
    block tables) and its tokens' KV slots equal those computed from the step's own requests,
    whatever shapes came before: the staging views are reused across steps of one shape, never
    their contents."""
    engine = LLMEngine(
        EngineConfig(model=tiny_llama, dtype="float32", load_progress=False,
                     max_num_batched_tokens=64, max_num_seqs=8)
    )  # fmt: skip
    batch = engine.runner.input_batch
    assert batch.split_tables
    prepare = batch.prepare
    kinds = set()

    def checked(scheduled, kv, spec=None):
        step = prepare(scheduled, kv, spec)
        kt = step.kernel_tables
        lens = [n for _, n in scheduled]
        dec = [i for i, n in enumerate(lens) if n == 1]
        pre = [i for i, n in enumerate(lens) if n != 1]
        kinds.add((bool(dec), bool(pre)))
        starts = np.cumsum([0, *lens])
        seq = [r.num_computed_tokens + n for r, n in scheduled]
        for rows, got_tables, got_seq in (
            (dec, kt.decode_tables, kt.decode_seq_lens),
            (pre, kt.prefill_tables, kt.prefill_seq_lens),
        ):
            assert got_seq.tolist() == [seq[i] for i in rows]
            if not rows:
                assert got_tables.numel() == 0
                continue
            width = -(-max(seq[i] for i in rows) // batch.block_size)
            for k, i in enumerate(rows):
                blocks = kv.get_block_ids(scheduled[i][0].request_id)[:width]
                assert got_tables[k, : len(blocks)].tolist() == blocks
        assert kt.decode_rows.tolist() == dec and kt.prefill_rows.tolist() == pre
        if dec and not pre:  # on the CPU, consecutive slots' rows are read in place
            in_place = kt.decode_tables.shape[1] == batch.max_blocks
            slots = [batch.slot_of(r.request_id) for r, _ in scheduled]
            assert in_place == (slots == list(range(slots[0], slots[0] + len(slots))))
            kinds.add(("tables in place", in_place))
        # Each token's KV slot: numpy over the step, or one by one for a few tokens.
        want_slots = []
        for request, n in scheduled:
            blocks = kv.get_block_ids(request.request_id)
            for pos in range(request.num_computed_tokens, request.num_computed_tokens + n):
                want_slots.append(blocks[pos // batch.block_size] * batch.block_size
                                  + pos % batch.block_size)  # fmt: skip
        assert step.slot_mapping.tolist() == want_slots
        kinds.add(("few tokens", len(want_slots) <= 8))
        assert kt.decode_token_indices.tolist() == [int(starts[i]) for i in dec]
        assert kt.prefill_query_start.tolist() == [int(starts[i]) for i in pre]
        assert kt.prefill_query_lens.tolist() == [lens[i] for i in pre]
        return step

    batch.prepare = checked
    gen = torch.Generator().manual_seed(1)
    for wave in range(3):  # decodes alone, long prompts in chunks alone, and both together
        for length in (5, 120, 9, 70)[: 2 + wave]:
            prompt = torch.randint(3, engine.arch.vocab_size, (length,), generator=gen).tolist()
            engine.add_request(prompt, _mixed_params(length))
        while engine.has_unfinished_requests():
            engine.step()
    assert kinds == {(True, False), (False, True), (True, True), ("few tokens", True),
                     ("few tokens", False), ("tables in place", True),
                     ("tables in place", False)}  # fmt: skip


def test_staging_buffer_hands_out_spans_front_to_back():
    """Spans follow each other, a step of the same shape gets the same views, a table is a
    [rows, width] view of its span, `copy` starts the next step at the front, and a step that
    takes more than the buffer holds fails with both sizes named."""
    host = torch.zeros(10, dtype=torch.int64)
    staging = StagingBuffer(host, host)
    a, _ = staging.take(3)
    table, table_dev = staging.take_table(2, 2)
    staged = staging.stage(np.array([7, 8], dtype=np.int64))
    a[:] = [1, 2, 3]
    table[:] = [[4, 5], [6, 9]]
    assert host.tolist() == [1, 2, 3, 4, 5, 6, 9, 7, 8, 0]
    assert table_dev.shape == (2, 2) and staged.tolist() == [7, 8]
    staging.copy()
    assert staging.used == 0
    again, _ = staging.take(3)
    assert again is a  # the same span's views, made once
    assert staging.take_table(2, 2)[0] is table
    with pytest.raises(RuntimeError, match=r"overflow the staging buffer \(12 > 10\)"):
        staging.take(5)
