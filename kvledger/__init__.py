"""kvledger: the shared core (events, hashing, fold, reuse model, settings)."""

__version__ = "0.1.0"
