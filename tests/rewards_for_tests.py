"""Custom rewards used by end-to-end tests (loaded via task.reward=rewards_for_tests:NAME)."""


def digit_fraction(prompt, completion, completion_ids, item):
    """Varies across samples even for a random model, so every step has a non-zero gradient."""
    return sum(c.isdigit() for c in completion) / max(len(completion), 1)
