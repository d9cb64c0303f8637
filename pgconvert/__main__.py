"""``python -m pgconvert`` runs the CLI."""

from pgconvert.cli import main

main()
