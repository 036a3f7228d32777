"""distflow's command line beside the recipe:

    python -m distflow export <checkpoint_dir> <out_dir> [--merged]   an HF folder of a checkpoint
    python -m distflow plot <output_dir>                              training.png of a run folder
    python -m distflow config-docs                                    docs/configuration.md
"""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    if command == "export":
        from distflow.checkpoint.export import main as export

        return export(rest)
    if command == "plot":
        from distflow.metrics.plot import main as plot

        return plot(rest)
    if command == "config-docs" and not rest:
        from distflow.config.docs import configuration_markdown

        sys.stdout.write(configuration_markdown())
        return 0
    print(__doc__.strip(), file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
