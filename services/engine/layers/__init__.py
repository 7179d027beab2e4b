"""Model building blocks (nano-vllm style): each parameter carries its own weight_loader."""
