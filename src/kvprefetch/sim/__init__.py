"""Discrete-event simulator of tiered KV-cache serving: plans deployments we cannot run here."""
