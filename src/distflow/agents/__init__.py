"""Agents on any harness: an OpenAI-compatible endpoint on every rank that records the exact tokens
the engine sampled (distflow.agents.endpoint, .trajectories), and the harness episodes it serves
(distflow.agents.episodes)."""
