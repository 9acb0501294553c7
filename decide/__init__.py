"""kvledger decide stage."""
