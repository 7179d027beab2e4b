"""What callers hold: the offline `LLM`, the `AsyncEngine` that serves, the output streams, and
the chat rendering that turns a conversation into a prompt."""
