"""The router's ClusterEngine over real prefill and decode workers (gRPC on loopback, KV over
torch_dist/gloo), without Ray: same outputs as the aggregated engine, prefix-aware routing,
conditional disaggregation, and failover when a worker disappears."""

from __future__ import annotations

import asyncio
import dataclasses
import os

import pytest
import torch

from duet.cluster.config import ClusterConfig
from duet.cluster.engine import ClusterEngine
from duet.decode_worker.config import DecodeWorkerConfig
from duet.decode_worker.server import start_decode_server
from duet.decode_worker.worker import DecodeWorker
from duet.engine import LLM, InvalidInputError, SamplingParams
from duet.kv_transfer import chunks
from duet.prefill_worker.config import PrefillWorkerConfig
from duet.prefill_worker.server import start_prefill_server
from duet.prefill_worker.worker import PrefillWorker
from tests.waiting import wait_for_async

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

ENGINE = dict(dtype="float32", load_progress=False, block_size=8, num_kv_blocks=256)


def prompts_of(lengths, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


class Cluster:
    """Workers and their gRPC servers on the test's event loop, and a ClusterEngine."""

    def __init__(
        self, model, num_prefill=1, num_decode=1, threshold=8, kv_backend="auto", engine=None
    ):
        self.model = model
        engine = engine or ENGINE
        self.scheduling_policy = engine.get("scheduling_policy", "fcfs")  # as the CLI sets it
        self.prefill = [
            PrefillWorker(
                PrefillWorkerConfig(model=model, kv_backend=kv_backend, **engine), name=f"p{i}"
            )
            for i in range(num_prefill)
        ]
        self.decode = [
            DecodeWorker(
                DecodeWorkerConfig(model=model, kv_backend=kv_backend, **engine), name=f"d{i}"
            )
            for i in range(num_decode)
        ]
        self.threshold = threshold
        self.servers = {}

    async def __aenter__(self):
        addresses = {}
        for w in self.prefill:
            server, port = await start_prefill_server(w)
            self.servers[w.name] = server
            addresses[w.name] = f"127.0.0.1:{port}"
        for w in self.decode:
            server, port = await start_decode_server(w)
            self.servers[w.name] = server
            addresses[w.name] = f"127.0.0.1:{port}"
        self.engine = ClusterEngine(
            self.model,
            ClusterConfig(
                local_prefill_threshold=self.threshold,
                poll_interval_s=0.05,
                scheduling_policy=self.scheduling_policy,
            ),
        )
        self.engine.pool.set_workers(
            {w.name: addresses[w.name] for w in self.prefill},
            {w.name: addresses[w.name] for w in self.decode},
        )
        await self.engine.start()
        assert await self.engine.pool.wait_until_ready(10)
        await wait_for_async(
            lambda: len(self.engine.pool.healthy_prefill()) == len(self.prefill),
            10,
            "every prefill worker's first report",
        )
        return self

    async def __aexit__(self, *exc):
        await self.engine.stop()
        for server in self.servers.values():
            await server.stop(0)
        for w in self.prefill + self.decode:
            w.shutdown()

    async def run(self, prompt, params):
        last = None
        async for out in self.engine.generate(prompt, params):
            last = out
        return last

    async def kill(self, worker):
        """Stop a worker's gRPC server and its engine, as a crashed process would vanish."""
        await self.servers[worker.name].stop(0)
        worker.shutdown()

    async def stream_losing_a_decode_worker(self, prompts, params):
        """Stream every prompt at once; when one stream has 5 tokens, kill the decode worker
        serving the most requests right now. Returns each stream's outputs, in prompt order,
        and the worker killed (None if no stream got that far)."""
        streams = [self.engine.generate(p, params) for p in prompts]
        outs = [[] for _ in prompts]
        victim = None

        async def drain(i):
            nonlocal victim
            async for out in streams[i]:
                outs[i].append(out)
                if victim is None and len(out.token_ids) >= 5:
                    victim = max(self.decode, key=lambda w: w.load.num_running)
                    await self.kill(victim)

        await asyncio.gather(*(drain(i) for i in range(len(prompts))))
        return outs, victim


@pytest.fixture
def model(tiny_llama):
    return tiny_llama


def test_cluster_equals_aggregated(model):
    prompts = prompts_of([3, 5, 40, 77, 120, 9, 150, 64, 2, 33, 90, 17, 130, 8, 55, 101])
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)
    sampled = SamplingParams(max_tokens=8, temperature=0.8, seed=11, n=2, ignore_eos=True)
    ref = LLM(model, **ENGINE)
    want_greedy = ref.generate(prompts, greedy)
    want_sampled = ref.generate(prompts[:4], sampled)

    async def main():
        async with Cluster(model) as c:
            got = await asyncio.gather(*(c.run(p, greedy) for p in prompts))
            got_n = await asyncio.gather(*(c.run(p, sampled) for p in prompts[:4]))
            stats = c.engine.cluster_stats
            pools = [(w.engine.kv.num_free_blocks, w.engine.num_blocks) for w in c.decode]
            return got, got_n, stats, pools

    got, got_n, stats, pools = asyncio.run(main())
    assert [o.token_ids for o in got] == [o.token_ids for o in want_greedy]
    assert [o.text for o in got] == [o.text for o in want_greedy]
    for o, w in zip(got, want_greedy, strict=True):
        assert [lp.sampled.token_id for lp in o.logprobs] == o.token_ids
        torch.testing.assert_close(
            [lp.sampled.logprob for lp in o.logprobs],
            [lp.sampled.logprob for lp in w.logprobs],
            atol=1e-4,
            rtol=0,
        )
    for o, w in zip(got_n, want_sampled, strict=True):
        assert [s.token_ids for s in o.outputs] == [s.token_ids for s in w.outputs]
    assert (stats.num_prefill_workers, stats.num_decode_workers) == (1, 1)
    assert all(free == total for free, total in pools)


def test_logit_bias_travels_to_both_workers(model):
    prompts = prompts_of([40, 60], seed=21)  # past the threshold: prefilled remotely
    # The first token is the prefill worker's and the rest the decode worker's: both biased.
    forced = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logit_bias={7: 100.0})
    bias = {t: 6.0 for t in range(100, 130)}
    sampled = SamplingParams(
        max_tokens=8, temperature=1.0, seed=4, ignore_eos=True, logit_bias=bias
    )
    ref = LLM(model, **ENGINE)
    want = ref.generate(prompts, sampled)
    assert sum(100 <= t < 130 for o in want for t in o.token_ids) >= 8  # the bias shows

    async def main():
        async with Cluster(model) as c:
            got_forced = await c.run(prompts[0], forced)
            got = await asyncio.gather(*(c.run(p, sampled) for p in prompts))
            with pytest.raises(InvalidInputError) as info:
                c.engine.check_lengths(10, SamplingParams(logit_bias={512: 1.0}))
            return got_forced, got, info.value

    got_forced, got, error = asyncio.run(main())
    assert got_forced.token_ids == [7] * 6
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert error.field == "logit_bias"


def _logprobs(sample):
    return [
        (lp.sampled.logprob, [(t.token_id, t.logprob) for t in lp.top]) for lp in sample.logprobs
    ]


def test_cluster_equals_aggregated_bitwise_in_bf16(smollm2_shaped):
    """Deterministic inference: in bf16, disaggregated (remote prefill, and local prefill of
    short prompts) gives the aggregated engine's tokens and logprobs bit for bit, greedy and
    seeded, with 16 requests in flight at once."""
    engine = {**ENGINE, "dtype": "bfloat16"}
    prompts = prompts_of([3, 5, 40, 77, 120, 9, 150, 64, 2, 33, 90, 17, 130, 8, 55, 101])
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3)
    seeded = SamplingParams(max_tokens=8, temperature=0.9, seed=5, ignore_eos=True, logprobs=1)
    ref = LLM(smollm2_shaped, **engine)
    want = [ref.generate([p], greedy)[0].outputs[0] for p in prompts]  # each alone
    want_seeded = [ref.generate([p], seeded)[0].outputs[0] for p in prompts[:6]]

    async def main():
        async with Cluster(smollm2_shaped, engine=engine) as c:
            assert c.engine.deterministic  # every worker reports it
            assert not c.engine.speculates_with_ngram  # no worker speculates: no predictions
            got = await asyncio.gather(*(c.run(p, greedy) for p in prompts))
            got_seeded = await asyncio.gather(*(c.run(p, seeded) for p in prompts[:6]))
            return [o.outputs[0] for o in got], [o.outputs[0] for o in got_seeded]

    got, got_seeded = asyncio.run(main())
    for g, w in zip(got + got_seeded, want + want_seeded, strict=True):
        assert g.token_ids == w.token_ids
        assert _logprobs(g) == _logprobs(w)


def test_torch_dist_under_nccl_semantics_equals_aggregated(model, monkeypatch):
    """KV over torch_dist with NCCL's semantics emulated (issue #18: tags ignored, `wait` before
    the data landed), one prefill worker feeding two decode workers, 16 concurrent requests
    of mixed lengths whose transfers share each channel: every token as the aggregated
    engine's."""
    monkeypatch.setenv("DUET_KV_EMULATE_NCCL", "1")
    monkeypatch.setattr(chunks, "CHUNK_MIN_BYTES", 1)  # a message per layer, as for real sizes
    prompts = prompts_of([3, 5, 40, 77, 120, 9, 150, 64, 2, 33, 90, 17, 130, 8, 55, 101], seed=4)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = LLM(model, **ENGINE).generate(prompts, greedy)

    async def main():
        async with Cluster(model, num_decode=2, kv_backend="torch_dist") as c:
            got = await asyncio.gather(*(c.run(p, greedy) for p in prompts))
            receivers = [w.receiver for w in c.decode]
            kinds = [sorted(link.kind for link in r._links.values()) for r in receivers]
            pools = [(w.engine.kv.num_free_blocks, w.engine.num_blocks) for w in c.decode]
            return got, kinds, pools

    got, kinds, pools = asyncio.run(main())
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert kinds == [["nccl-emulated"], ["nccl-emulated"]]  # both decode workers received
    assert all(free == total for free, total in pools)


def test_stop_string_is_applied_by_the_router(model):
    prompt = prompts_of([50], seed=8)[0]
    ref = LLM(model, **ENGINE)
    full = ref.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 2]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop])
    want = ref.generate([prompt], params)[0]

    async def main():
        async with Cluster(model) as c:
            return await c.run(prompt, params)

    got = asyncio.run(main())
    assert (got.text, got.finish_reason) == (want.text, "stop")
    assert got.outputs[0].stop_reason == stop


def test_prefix_routing_and_conditional_disaggregation(model):
    shared = prompts_of([96], seed=9)[0]

    async def main():
        async with Cluster(model, num_prefill=2) as c:
            params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
            first = await c.run([*shared, 1, 2], params)
            second_prompt = [*shared, *range(3, 15)]  # 12 new > threshold 8

            def routed_hits() -> int:  # a load report carries the cached hashes to the router
                picked = c.engine.pool.pick_prefill(second_prompt)
                return 0 if picked is None else picked[1]

            await wait_for_async(lambda: routed_hits() == 96, 10, "the router to see the prefix")
            holder = [w for w in c.prefill if w.engine.kv.prefix_stats.num_requests == 1]
            second = await c.run(second_prompt, params)
            # Short prompts never reach a prefill worker.
            before = [w.engine.kv.prefix_stats.num_requests for w in c.prefill]
            await c.run([7, 8, 9], params)
            after = [w.engine.kv.prefix_stats.num_requests for w in c.prefill]
            return first, second, holder, before, after

    first, second, holder, before, after = asyncio.run(main())
    assert len(holder) == 1
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 96)
    assert holder[0].engine.kv.prefix_stats.num_requests == 2  # the second went to it
    assert before == after


@pytest.mark.parametrize(
    "case",
    ["fp32-greedy-auto", "fp32-greedy-nccl", "bf16-greedy-auto", "bf16-seeded-auto"],
)  # bf16: the continuation recomputes prompt + streamed tokens as a prefill (deterministic);
# nccl: KV over torch_dist with NCCL's semantics emulated (a lost peer raises nothing)
def test_decode_worker_lost_mid_stream_continues_elsewhere(request, case, monkeypatch):
    dtype, sampling, kv_backend = case.split("-")
    model = request.getfixturevalue("tiny_llama" if dtype == "fp32" else "smollm2_shaped")
    engine = {**ENGINE, "dtype": "float32" if dtype == "fp32" else "bfloat16"}
    prompts = prompts_of([40, 70], seed=4)
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    if sampling == "seeded":
        params = SamplingParams(max_tokens=60, temperature=0.9, seed=3, ignore_eos=True)
    want = LLM(model, **engine).generate(prompts, params)
    if kv_backend == "nccl":
        monkeypatch.setenv("DUET_KV_EMULATE_NCCL", "1")
        kv_backend = "torch_dist"

    async def main():
        async with Cluster(
            model, num_decode=2, threshold=0, kv_backend=kv_backend, engine=engine
        ) as c:
            return await c.stream_losing_a_decode_worker(prompts, params)

    outs, victim = asyncio.run(main())
    assert victim is not None
    for got, w in zip(outs, want, strict=True):
        assert got[-1].token_ids == w.token_ids
        assert got[-1].text == w.text
        streamed = [t for o in got for t in o.outputs[0].delta_token_ids]
        assert streamed == w.token_ids  # nothing repeated, nothing missing


def test_prefill_worker_lost_retries_on_another(model):
    prompts = prompts_of([60, 80, 100], seed=6)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    want = LLM(model, **ENGINE).generate(prompts, params)

    async def main():
        async with Cluster(model, num_prefill=2, threshold=0) as c:
            await c.kill(c.prefill[0])
            return await asyncio.gather(*(c.run(p, params) for p in prompts))

    got = asyncio.run(main())
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_no_decode_worker_fails_fast_retryable(model):
    from duet.engine.async_engine import EngineDeadError

    async def main():
        async with Cluster(model) as c:
            for w in c.decode:
                await c.kill(w)
            await wait_for_async(
                lambda: not c.engine.pool.healthy_decode(), 10, "the router to drop the workers"
            )
            loop = asyncio.get_running_loop()
            start = loop.time()
            with pytest.raises(EngineDeadError, match="no decode worker"):
                await c.run([5, 6, 7], SamplingParams(max_tokens=3))
            return loop.time() - start

    assert asyncio.run(main()) < 1.0


def test_the_only_decode_worker_lost_mid_stream_is_waited_for(model):
    """The pool's one decode worker dies mid-stream (a restart, say): the accepted streams wait
    for a decode worker instead of failing, and go on where they stopped on the one that
    joins a second later: the aggregated engine's tokens, none repeated or lost."""
    prompts = prompts_of([40, 70], seed=4)
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    want = LLM(model, **ENGINE).generate(prompts, params)

    async def main():
        async with Cluster(model, num_decode=1, threshold=0) as c:
            joined = asyncio.get_running_loop().create_future()

            async def replace_after_the_loss():
                await wait_for_async(
                    lambda: not c.engine.pool.healthy_decode(), 30, "the worker's loss"
                )
                await asyncio.sleep(1.0)  # requests are waiting now
                worker = DecodeWorker(DecodeWorkerConfig(model=model, **ENGINE), name="d1")
                server, port = await start_decode_server(worker)
                c.decode.append(worker)
                c.servers["d1"] = server
                c.engine.pool.set_workers(
                    {w.name: c.engine.pool.prefill[w.name].client.address for w in c.prefill},
                    {"d1": f"127.0.0.1:{port}"},
                )
                joined.set_result(True)

            replacing = asyncio.create_task(replace_after_the_loss())
            outs, victim = await c.stream_losing_a_decode_worker(prompts, params)
            await replacing
            return outs, victim, joined.result()

    outs, victim, joined = asyncio.run(main())
    assert victim is not None and victim.name == "d0" and joined
    for got, w in zip(outs, want, strict=True):
        assert got[-1].token_ids == w.token_ids
        assert [t for o in got for t in o.outputs[0].delta_token_ids] == w.token_ids


def test_admission_capacity_follows_the_decode_pool(model):
    """The router admits as many sequences as the healthy decode workers run (their reports),
    so a pool that grows or shrinks moves the 503 threshold with it."""

    async def main():
        async with Cluster(model, num_decode=2) as c:
            await wait_for_async(
                lambda: len(c.engine.pool.healthy_decode()) == 2, 10, "both decode workers' reports"
            )
            per_worker = [w.config.max_num_seqs for w in c.decode]
            both = c.engine.max_num_seqs
            await c.kill(c.decode[1])
            await wait_for_async(
                lambda: len(c.engine.pool.healthy_decode()) == 1, 10, "the router to drop d1"
            )
            return per_worker, both, c.engine.max_num_seqs

    per_worker, both, one = asyncio.run(main())
    assert both == sum(per_worker)
    assert one == per_worker[0]


def test_predicted_outputs_travel_to_ngram_decode_workers(tiny_llama):
    """Decode workers that speculate with ngram report it, so the router sends them a request's
    Predicted Outputs (`prediction_token_ids`, over the wire to the prefill and the decode
    worker): the decode worker proposes from them and has most of a correctly predicted reply
    accepted, the tokens those of the request without a prediction."""
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
             "prompt_lookup_max": 3}  # fmt: skip
    prompts = prompts_of([20, 33, 47], seed=11)
    greedy = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)

    async def main():
        async with Cluster(tiny_llama, engine={**ENGINE, "speculative_config": ngram}) as c:
            assert c.engine.speculates_with_ngram
            plain = [(await c.run(p, greedy)).outputs[0].token_ids for p in prompts]
            stats = c.decode[0].engine.stats.spec_decode
            before = stats.num_accepted_tokens
            predicted = []
            for p, want in zip(prompts, plain, strict=True):
                params = dataclasses.replace(greedy, prediction_token_ids=want)
                predicted.append((await c.run(p, params)).outputs[0].token_ids)
            return plain, predicted, stats.num_accepted_tokens - before

    plain, predicted, accepted = asyncio.run(main())
    assert predicted == plain
    # 31 tokens per reply come from decode steps (the first from the prefill): with the reply
    # predicted, nearly all are accepted guesses (without, this tiny model's random text
    # repeats little of its prompt).
    assert accepted >= 3 * 24, accepted


def test_embeddings_run_whole_on_a_decode_worker(model):
    """An embedding request (`SamplingParams.pooling`) runs on a decode worker alone (no
    prefill worker, no KV transfer, whatever its length), and the vector that comes back with
    its last output is the aggregated engine's, both poolings; its blocks are freed."""
    prompts = prompts_of([3, 40, 120, 17])
    ref = LLM(model, **ENGINE)

    async def main():
        async with Cluster(model) as c:
            assert c.engine.computes_embeddings
            got = {}
            for kind in ("last", "mean"):
                params = SamplingParams(temperature=0, max_tokens=1, pooling=kind)
                got[kind] = await asyncio.gather(*(c.run(p, params) for p in prompts))
            prefilled = c.prefill[0].engine.stats.num_prompt_tokens
            pools = [(w.engine.kv.num_free_blocks, w.engine.num_blocks) for w in c.decode]
            return got, prefilled, pools

    got, prefilled, pools = asyncio.run(main())
    for kind, outs in got.items():
        params = SamplingParams(temperature=0, max_tokens=1, pooling=kind)
        want = [o.embedding for o in ref.generate(prompts, params)]
        assert [o.embedding for o in outs] == want, kind
        assert all(o.finished and len(o.embedding) == 64 for o in outs)
    assert prefilled == 0  # the prefill worker never saw them
    assert all(free == total for free, total in pools)
