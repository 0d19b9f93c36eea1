"""Harnesses that run Daybreak's real pieces as child processes for tests, benchmarks and the demo.

``store_agent.LocalAgent`` (a standalone store agent), ``transfer_peer.PeerProcess``
(a transfer engine in another process) and ``operator_process.OperatorProcess``
(the operator against a cluster), ``vllm_server.VllmServer`` (a vLLM OpenAI server on CPU for
the connector tests and ``daybreak bench vllm``) and ``tinymodel`` (the random-weight Llama those
servers load). Nothing in the product imports this package.
"""
