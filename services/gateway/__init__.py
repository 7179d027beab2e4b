"""The gateway: the OpenAI-compatible and management HTTP APIs in front of the engines
(run_gateway)."""
