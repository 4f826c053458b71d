"""``python -m hx`` runs the CLI."""

from hx.cli import main

main()
