"""Connectors move encoder outputs (E->P) and KV blocks (P->D) between instances."""
