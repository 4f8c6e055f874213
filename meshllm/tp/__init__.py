"""Tensor-parallel groups: a stage split over several nodes on a fast link (DESIGN.md "Tensor parallelism")."""
