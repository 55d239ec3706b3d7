"""Shared types: the Structs every join between the parts uses (one module per subject)."""
