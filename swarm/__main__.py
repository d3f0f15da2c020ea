"""``python -m swarm``: the ``swarm`` command."""

from swarm.ops.cli import main

main()
