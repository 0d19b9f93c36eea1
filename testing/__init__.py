"""Harnesses that run Daybreak's real pieces as child processes for tests, benchmarks and the demo.

``store_agent.LocalAgent`` (a standalone store agent), ``transfer_peer.PeerProcess``
(a transfer engine in another process), ``operator_process.OperatorProcess``
(the operator against a cluster) and ``devicecheck`` (the engine's device paths
on a real accelerator). Nothing in the product imports this package.
"""
