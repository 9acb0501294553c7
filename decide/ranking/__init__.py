"""Ranking: the compiled kernels, the cpu and cuda backends, the answers' texts, and what-if replay."""
