"""The management API (/api/v1: models, instances, workers, keys, usage) over the registry and
the scheduler, the OpenAPI document of every route, and the dashboard (/ui/) with the API docs
(/docs) served from static/."""
