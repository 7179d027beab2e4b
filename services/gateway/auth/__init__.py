"""Who may come in, and how much: the edge's checks on every request (edge.py, rules in
edge_rules.py), API keys and scopes (keys.py), per-key limits and usage (quota.py, headers in
ratelimit.py), and the bound on sequences in flight (admission.py)."""
