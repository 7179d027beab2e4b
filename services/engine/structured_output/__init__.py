"""Structured outputs on xgrammar: the spec check and compile that the core's grammar gate asks
for (compiler.py, grammar_check.py), and the per-sequence matcher and token bitmask that the
runner's sampler applies. Imported only at an engine's first constrained request."""
