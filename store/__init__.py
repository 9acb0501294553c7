"""kvledger store stage."""
