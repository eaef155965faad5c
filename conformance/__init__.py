"""The conformance harness: case catalogue, tolerance policy, adapter registry, matrix, reports."""
