"""The typed messages between the router and its workers, beside their definitions in
proto/duet/v1/worker.proto: one module per message family, each converting engine values to
the generated protobuf classes and back (validated on the way in): the sampling parameters
(`sampling`), a decode worker's token deltas and a prefill worker's prompt logprobs (`deltas`),
and the prefill hand-off that travels with the KV blocks (`handoff`). Workers send token ids and
logprobs only; the router detokenizes once."""
