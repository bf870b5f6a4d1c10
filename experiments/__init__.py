"""Studies that reproduce or refute the claims of docs/SEED.md: `python -m experiments <name>`."""
