"""kvledger ingest stage."""
