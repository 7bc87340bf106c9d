"""Shared runtime pieces: the Ray session, progress lines, vectors, hashing, the k-means core."""
