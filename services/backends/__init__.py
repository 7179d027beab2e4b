"""Inference backends beside our engine: vLLM's OpenAI server and any OpenAI-compatible server
command, each run by the instance's adapter process (`shoal engine --instance-id ID` for a model
whose backend is not `shoal`), which serves the instance on the bus (README "Backends")."""
