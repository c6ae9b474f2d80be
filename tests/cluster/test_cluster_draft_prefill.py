"""A draft model whose prompt KV the prefill worker computes, through the router's
ClusterEngine (gRPC on loopback, KV over tcp): when the decode worker serving a request dies
mid-stream, the request continues on another one, which gets the draft's KV over prompt and
streamed tokens with the target's and keeps speculating; the text is an aggregated engine's
without speculation."""

from __future__ import annotations

import asyncio

import pytest

from duet.engine import LLM, SamplingParams
from tests.cluster.test_cluster_engine import ENGINE, Cluster, prompts_of


@pytest.mark.parametrize("where", ["prefill", "decode"])
def test_decode_worker_lost_mid_stream_keeps_speculating_elsewhere(
    tiny_llama, tiny_model_factory, where
):
    draft = tiny_model_factory(
        "llama", num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1
    )
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3,
            "draft_prefill": where}  # fmt: skip
    prompts = prompts_of([40, 70], seed=4)
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    want = LLM(tiny_llama, **ENGINE).generate(prompts, params)
    received: dict[str, list[bool]] = {}

    async def main():
        engine = {**ENGINE, "speculative_config": spec}
        async with Cluster(tiny_llama, num_decode=2, threshold=0, engine=engine) as c:
            for worker in c.decode:  # what each decode worker's draft got from transfers
                proposer = worker.engine.speculator.proposer
                calls = received.setdefault(worker.name, [])
                original = proposer.prompt_received

                def spy(request_id, ok, calls=calls, original=original):
                    calls.append(ok)
                    original(request_id, ok)

                proposer.prompt_received = spy
            outs, victim = await c.stream_losing_a_decode_worker(prompts, params)
            [survivor] = [w for w in c.decode if w is not victim]
            stats = survivor.engine.stats.spec_decode
            draft_kv = survivor.engine.speculator.proposer.kv
            transfers = list(c.engine.transfers.recent)
            return outs, victim, survivor, stats, draft_kv.num_free_blocks, transfers

    outs, victim, survivor, stats, draft_free, transfers = asyncio.run(main())
    assert victim is not None
    for got, w in zip(outs, want, strict=True):
        assert got[-1].token_ids == w.token_ids
        assert [t for o in got for t in o.outputs[0].delta_token_ids] == w.token_ids
    assert stats is not None and stats.num_draft_tokens > 0  # the survivor speculated
    assert draft_free == survivor.engine.num_blocks
    # Both requests ended on the survivor: with draft_prefill prefill, each KV transfer to it
    # brought the draft's KV with the target's (the replayed request's over prompt + streamed
    # tokens). Counted by the router's transfer log: a replayed request prefills on the
    # survivor itself when the router sees no healthy prefill worker at that moment.
    done = [t.request_id for t in transfers if t.decode_worker == survivor.name
            and t.status == "done"]  # fmt: skip
    assert done and received[survivor.name] == ([True] * len(done) if where == "prefill" else []), (
        victim.name, survivor.name, received, transfers, [len(o) for o in outs],
    )  # fmt: skip
