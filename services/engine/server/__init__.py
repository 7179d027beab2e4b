"""The engine as a service on the bus: `shoal engine --instance-id ID` (service.py) and its NATS
adapter (handlers.py). The only part of the engine that imports nats."""
