"""The scheduler: resource-fit placement of model instances (pure policy + a thin NATS service)."""
