"""Routing: which E, P and D instance serves a request. Plain Python, no Ray: each gateway
replica runs its own `RouterPolicy`, fed by the loads and prefix-cache events instances
publish and by its own accounting of what it sent."""
