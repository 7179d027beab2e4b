"""The engine's core: scheduling and KV-block bookkeeping, torch-free (tests/unit/test_layering.py
checks). `EngineCore` runs one step as schedule -> runner.execute -> update over the frozen
contract of outputs.py, then detokenizes and builds the requests' outputs
(docs/engine-core.md)."""
