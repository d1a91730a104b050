"""Gyre's composition root: the program that wires the services together.

It holds the `gyre` command, the local launcher (`gyre run`), the run report, the demo, the embedded local
servers and the tiny-model factory. It may import every service; nothing in `services/` or `shared/` imports it
(import-linter checks this in `make test`).
"""
