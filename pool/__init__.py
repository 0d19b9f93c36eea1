"""The pool's contract, the layer the client and the agent both stand on.

Frames of the store protocol (``protocol``), the authenticated request/reply
connection (``connection``), the one handshake (``handshake``), socket helpers
(``sockets``), rendezvous placement (``placement``), block checksums
(``checksum``) and the shared-memory segments (``shm``). Nothing here imports
``daybreak.agent``, ``daybreak.operator`` or the CLI (tests/test_layers.py).
"""
