"""OpenAI's protocol: request bodies and their translation to the bus contract (protocol.py,
structured.py, tools.py, embeddings.py), answers built from the engines' streams (responses.py,
tool_parsers.py, streaming.py), all pure; routes.py and serve.py are the only modules here that
speak HTTP (aiohttp)."""
