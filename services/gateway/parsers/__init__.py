"""Reading a model's answer text (pure: no network, no I/O), delta by delta, the same code for
streamed and whole answers: tool/ (vLLM's --tool-call-parser: tool calls out of the text) and
reasoning/ (vLLM's --reasoning-parser: the <think> monologue apart from the answer). Each parser
is one small module; each folder's __init__ is its registry by vLLM's name."""
