"""The disaggregation control plane: the router's view of the prefill and decode workers
(`worker_pool`), its clients of them (`prefill_client`, `decode_client`), one request attempt
over them as a state machine (`attempt`, its samples in `sample`, every failure classified by
the one table in `outcomes`), the engine the front door runs requests on in disaggregated mode
(`engine.ClusterEngine`), and the KV transfers it saw (`transfer_log`). No HTTP, no OpenAI
shapes: the router (router/) sits in front of it."""
