"""Agents on any harness: an OpenAI-compatible endpoint on every rank (endpoint: the routes;
gateway: what a request means) that records the exact tokens the engine sampled (trajectories,
messages, stops), and the harness episodes it serves (episodes)."""
