"""What a check writes and shows: the report (report.json, report.md), the terminal's view, and the shards' merge."""
