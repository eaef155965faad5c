"""What a check will take and what fits: its cost in time (cost), the plan a budget allows (budget), and memory (memory)."""
