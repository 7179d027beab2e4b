"""Our own model code for the Llama family; registry.py maps HF architecture names to classes."""
