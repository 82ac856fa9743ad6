"""The report: shard validation, statistics, tables, figures and dataset.json."""
