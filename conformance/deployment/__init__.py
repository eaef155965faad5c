"""Deployed forms held to the golden: an export's own check, and quantized columns (who makes them, what they store, how they are judged)."""
