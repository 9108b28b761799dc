"""Benchmarks of impl against verl and a copy floor; see bench/README.md."""
