"""Studies that reproduce or refute the seed's claims: `python -m experiments <name>`."""
