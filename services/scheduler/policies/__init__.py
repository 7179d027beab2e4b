"""Placement policy: filters -> selectors -> scorers -> pick (GPUStack's pipeline, pure Python).

No import of nats, aiohttp or sqlalchemy here: the policy is tested on synthetic fleets.
"""
