"""The index: who holds each sequence hash, in which class (the fold's mirror as compiled tables), and its read view."""
