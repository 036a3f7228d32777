"""The agent section: the OpenAI-compatible endpoint every rank serves while its harness episodes
run (task.agent names the harness; distflow.rollout.agents)."""

from __future__ import annotations

from typing import Literal

from distflow.config.fields import knob, section


@section
class AgentConfig:
    """Where each rank's endpoint listens and how long an episode may run. The harness gets its
    episode's base URL and key, so these only matter to a harness that runs outside the rank
    (another host: set host) or to a firewall (set port). An episode's requests are its turns:
    rollout.max_turns of them at most (the next is refused, 429), all within the response limit
    rollout.max_total_tokens."""

    host: str = knob("127.0.0.1", "The address the endpoint binds; 127.0.0.1 keeps it on the machine, 0.0.0.0 "
                                  "serves a harness on other hosts.", operational=True)
    port: int = knob(0, "The first rank's port on a node; local rank r serves port + r. 0: any free port.",
                     operational=True)
    served_model_name: str = knob("policy", "The model name the endpoint answers to (GET /v1/models lists it); a "
                                            "request naming another is refused (404).", operational=True)
    wait: Literal["wave", "free"] = knob(
        "wave", "wave: the engine steps only while every running episode waits on it (a request out), and the "
                "requests that arrived meanwhile join together in episode order, so the engine's batches, hence its "
                "logprobs to the last bit, do not depend on thread timing (reproducible and resumable bit for bit; a "
                "harness busy with its own work holds the engine meanwhile). free: every request joins the engine "
                "as it arrives (no waiting; batches, so logprobs at float rounding, vary run to run).")
    rows: Literal["every", "last"] = knob(
        "every", "What an episode trains. every: each trajectory it recorded (the choices of a request with n > 1, "
                 "retried turns, a history the harness edited), one row each with the episode's advantage; a branch's "
                 "row holds only the tokens it generated itself, the prefix it shares with its parent as its prompt "
                 "(computed once for all siblings in a packed update). last: only the trajectory of its last request, "
                 "whole.")
    episode_timeout_s: float = knob(300.0, "A harness's own time per episode (running with no request out; time "
                                           "waiting for the engine is not counted): past it the episode is cut, its "
                                           "trajectory kept as a truncated sample and counted (agent/cut).")

    def checks(self) -> list[tuple[bool, str]]:
        return [
            (0 <= self.port <= 65535, f"agent.port must be in [0, 65535], got {self.port}"),
            (self.episode_timeout_s > 0, f"agent.episode_timeout_s must be > 0, got {self.episode_timeout_s}"),
            (bool(self.served_model_name.strip()), "agent.served_model_name must not be empty"),
        ]
