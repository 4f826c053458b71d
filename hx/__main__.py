"""``python -m hx`` runs the CLI."""

from hx.cli import main

if __name__ == "__main__":  # not when a spawned worker imports it
    main()
