"""The agent section: the OpenAI-compatible endpoint every rank serves while its harness episodes
run (task.agent names the harness; distflow.agents)."""

from __future__ import annotations

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
    episode_timeout_s: float = knob(300.0, "Wall-clock limit per episode: one still running is cut, its "
                                           "trajectory kept as a truncated sample and counted (agent/cut).")

    def checks(self) -> list[tuple[bool, str]]:
        return [
            (0 <= self.port <= 65535, f"agent.port must be in [0, 65535], got {self.port}"),
            (self.episode_timeout_s > 0, f"agent.episode_timeout_s must be > 0, got {self.episode_timeout_s}"),
            (bool(self.served_model_name.strip()), "agent.served_model_name must not be empty"),
        ]
