"""Where a request goes: the model a name or alias means (model_names.py), the live instance
table (instances.py), the routing policy (router.py, pure) and the engine client that sends,
streams, retries and aborts (infer_client.py)."""
